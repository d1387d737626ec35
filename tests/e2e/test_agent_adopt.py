"""Engines survive their agent: a new EngineSupervisor on the same work dir (what an agent
restarted after a crash or SIGKILL builds) adopts the engines the old one left running, and an
engine whose agent is gone for longer than the leash's bound stops by itself.

The agent-level test runs two Agents one after the other on the same settings against a
scripted fleet (as tests/e2e/test_agent_engines.py does); the first dies without stopping
anything.

Real parts: the STAND-IN engine (`python -m fleet_agent.engine.standin`, trtllm-serve's command
line) under the leash (`python -m fleet_agent.engine.leash`), the records, and streaming
requests in flight across the takeover. The old agent is "killed" by abandoning its supervisor
without close(): nothing of it runs any more, exactly as after SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_streams import stream_completion
from procs import alive
from pydantic import SecretStr

from fleet.lab.processes import free_port_block
from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.engine.records import find_records, read_record
from fleet_agent.engine.supervisor import EngineSupervisor, SupervisorConfig
from fleet_agent.fleet_client import FleetClient
from fleet_agent.main import build_supervisor
from fleet_agent.telemetry.simulated import SimulatedTelemetry

ASSIGNMENT: dict[str, Any] = {
    "kind": "serve",
    "deployment": "llama-8b",
    "model_uri": "s3://models/llama-3.1-8b",
    "engine": "trtllm",
    "engine_params": {"backend": "pytorch", "tp_size": 1, "pp_size": 1, "max_batch_size": 16},
    "gpus_per_replica": 1,
    "replicas": 2,
}


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.work = tmp_path / "engines"
        self.base_port = free_port_block(2)
        self.supervisors: list[EngineSupervisor] = []

    def supervisor(self, **overrides: Any) -> EngineSupervisor:
        settings: dict[str, Any] = {
            "stop_grace_s": 5.0,
            "poll_interval_s": 0.1,
            "leash_bound_s": 300.0,
            **overrides,
        }
        config = SupervisorConfig(
            work_dir=self.work,
            engine_command=(sys.executable, "-m", "fleet_agent.engine.standin"),
            base_port=self.base_port,
            extra_env={
                "FLEET_STANDIN_GPU": "H100",
                "FLEET_STANDIN_LOAD_S": "0.5",
                "FLEET_STANDIN_MISSING_WEIGHTS": "ignore",
            },
            **settings,
        )
        sup = EngineSupervisor(config)
        self.supervisors.append(sup)
        return sup


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    pids = [rec.pid for path in find_records(r.work) if (rec := read_record(path)) is not None]
    for sup in r.supervisors:
        sup.close(grace_s=2.0)
    for pid in pids:  # whatever no supervisor owned any more (a test's abandoned one)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    _wait(lambda: not any(alive(p) for p in pids), "no engine outlives the test", 10.0)


def _wait(
    check: Any, what: str, timeout: float = 20.0, sup: EngineSupervisor | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sup is not None:
            sup.poll()
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _streams_on(urls: list[str], count: int = 4) -> tuple[list[list[str]], list[threading.Thread]]:
    """`count` streaming completions spread over the engines at `urls`, each under way (its
    first chunk in) when this returns: their chunks, and the threads to join."""
    chunks: list[list[str]] = [[] for _ in range(count)]
    started = [threading.Event() for _ in range(count)]
    threads = [
        threading.Thread(
            target=_stream, args=(urls[i % len(urls)], f"story {i}", chunks[i], started[i])
        )
        for i in range(count)
    ]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30)
    return chunks, threads


def _stream(url: str, prompt: str, chunks: list[str], started: threading.Event) -> None:
    stream_completion(url, prompt, chunks, started, max_tokens=200)


def test_a_restarted_agent_adopts_its_engines_without_losing_a_request(rig: Rig) -> None:
    old = rig.supervisor()
    old.apply(ASSIGNMENT, gpus=[0, 1])
    _wait(lambda: old.ready, "the engines ready", sup=old)
    before = old.replica_stats()
    pids = [r["pid"] for r in before]
    records = [read_record(p) for p in find_records(rig.work)]
    assert sorted(r.pid for r in records if r is not None) == sorted(pids)

    # Requests in flight on both engines, then the agent dies (its supervisor is abandoned).
    chunks, threads = _streams_on([r["url"] for r in before])
    rig.supervisors.remove(old)  # SIGKILL: no close(), no SIGTERM to anything

    new = rig.supervisor()
    new.apply(ASSIGNMENT, gpus=[0, 1])  # the fleet says "serve" the same deployment again
    after = new.replica_stats()
    assert new.ready and [r["state"] for r in after] == ["ready", "ready"]  # at once
    assert [r["pid"] for r in after] == pids  # adopted, not started again
    for _ in range(5):
        new.poll()
        assert new.ready  # never left ready
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    for c in chunks:  # every request finished: 200 tokens, then the usage chunk and [DONE]
        assert c[-1] == "[DONE]"
        usage = json.loads(c[-2])["usage"]
        assert usage["completion_tokens"] == 200
    stats = new.replica_stats()
    assert all(r["running"] is not None for r in stats)  # read like its own engines

    # An adopted engine is stopped like any other: the fleet moves this server elsewhere.
    new.apply(None)
    _wait(lambda: not any(alive(p) for p in pids), "the adopted engines gone", sup=new)
    assert find_records(rig.work) == []


def test_a_different_assignment_retires_the_engines_left_running(rig: Rig) -> None:
    old = rig.supervisor()
    old.apply(ASSIGNMENT, gpus=[0, 1])
    _wait(lambda: old.ready, "the engines ready", sup=old)
    pids = [r["pid"] for r in old.replica_stats()]
    rig.supervisors.remove(old)

    new = rig.supervisor()
    other = {**ASSIGNMENT, "engine_params": {**ASSIGNMENT["engine_params"], "max_batch_size": 8}}
    new.apply(other, gpus=[0, 1])
    assert [r["state"] for r in new.replica_stats()] == ["starting", "starting"]
    _wait(lambda: new.ready, "the new engines ready", sup=new)
    assert not any(alive(p) for p in pids)  # retired first: they held the ports
    assert not set(pids) & {r["pid"] for r in new.replica_stats()}


def test_a_stale_record_is_removed_and_the_replica_started(rig: Rig) -> None:
    sup = rig.supervisor()
    stale = rig.work / "llama-8b" / "replica-0.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(
        json.dumps(
            {
                "pid": 2**22 + 17,  # above pid_max's default: no such process
                "start_time": 1,
                "port": rig.base_port,
                "index": 0,
                "deployment": "llama-8b",
                "engine": "trtllm",
                "version": None,
                "identity": "x",
            }
        )
    )
    sup.apply({**ASSIGNMENT, "replicas": 1}, gpus=[0])
    [replica] = sup.replica_stats()
    assert replica["state"] == "loading" and replica["pid"] != 2**22 + 17
    record = read_record(stale)
    assert record is not None and record.pid == replica["pid"]  # the new engine's record


def test_an_engine_whose_agent_is_gone_stops_by_itself(rig: Rig) -> None:
    old = rig.supervisor(leash_bound_s=2.0)
    old.apply({**ASSIGNMENT, "replicas": 1}, gpus=[0])
    _wait(lambda: old.ready, "the engine ready", sup=old)
    [replica] = old.replica_stats()
    rig.supervisors.remove(old)  # the agent is gone for good: nobody touches the lease
    _wait(lambda: not alive(replica["pid"]), "the engine to stop by itself", timeout=30.0)
    log = (rig.work / "llama-8b" / "replica-0.log").read_text()
    assert "untouched for over 2 s (agent gone)" in log


class ScriptedFleet:
    """Hands out ASSIGNMENT and records every heartbeat (which agent sent it: `era`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.heartbeats: list[tuple[int, dict[str, Any]]] = []
        self.era = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/heartbeat"):
            with self.lock:
                self.heartbeats.append((self.era, body))
        reply = {
            "server": "gpu-1",
            "state": "serving",
            "heartbeat_interval_s": 0.5,
            "expected_gpus": 2,
            "assignment": ASSIGNMENT,
        }
        return httpx.Response(200, json=reply)

    def of(self, era: int) -> list[dict[str, Any]]:
        with self.lock:
            return [body for e, body in self.heartbeats if e == era]


def test_an_agent_killed_and_started_again_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_STANDIN_GPU", "H100")
    monkeypatch.setenv("FLEET_STANDIN_LOAD_S", "0.5")
    settings = AgentSettings(
        server="gpu-1",
        token=SecretStr("flt_test"),
        telemetry="simulated",
        sim_gpus=2,
        engine_command=f"{sys.executable} -m fleet_agent.engine.standin",  # version checked
        engine_base_port=free_port_block(2),
        work_dir=tmp_path / "agent",
        sample_interval_s=0.2,
        heartbeat_interval_s=0.5,
        engine_stop_grace_s=5.0,
    )
    fleet = ScriptedFleet()

    def start_agent() -> tuple[Agent, EngineSupervisor, threading.Event, threading.Thread]:
        client = FleetClient(
            "http://fleet.test", "flt_test", 2.0, httpx.MockTransport(fleet.handler)
        )
        sup = build_supervisor(settings)
        agent = Agent(settings, SimulatedTelemetry("H100", 2, seed=1), client, supervisor=sup)
        stop = threading.Event()
        loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        loop.start()
        return agent, sup, stop, loop

    agent, sup, stop, loop = start_agent()
    pids: list[int] = []
    try:
        _wait(lambda: any(h["ready"] for h in fleet.of(0)), "the first agent serving")
        before = sup.replica_stats()
        pids = [r["pid"] for r in before]
        chunks, threads = _streams_on([r["url"] for r in before])

        # SIGKILL: the loop and the supervisor's thread end, and nothing is stopped or drained.
        monkeypatch.setattr(sup, "close", lambda *a, **k: sup._stop.set())
        stop.set()
        agent.wake()
        loop.join(timeout=10)
        assert not loop.is_alive()
        assert all(alive(p) for p in pids)

        with fleet.lock:
            fleet.era = 1
        agent, sup, stop, loop = start_agent()
        _wait(lambda: len(fleet.of(1)) >= 3, "three heartbeats of the restarted agent")
        # Its very first heartbeat already says ready, with the same engines.
        for beat in fleet.of(1):
            assert beat["ready"] is True
            assert [r["state"] for r in beat["replicas"]] == ["ready", "ready"]
            assert [r["pid"] for r in beat["replicas"]] == pids
            assert [r["engine"] for r in beat["replicas"]] == ["trtllm", "trtllm"]
        assert [r["pid"] for r in sup.replica_stats()] == pids
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for c in chunks:  # no request lost
            assert c[-1] == "[DONE]"
            assert json.loads(c[-2])["usage"]["completion_tokens"] == 200
    finally:
        stop.set()
        agent.wake()
        loop.join(timeout=30)
    assert sup.replica_stats() == []  # a clean stop stops the engines
    _wait(lambda: not any(alive(p) for p in pids), "the engines stopped with the agent")
