"""The fleet's GPU power limit through a real agent on simulated GPUs, wired as `fleetctl agent
run` wires it (fleet_agent.main's build_telemetry and build_supervisor): the agent sets the limit
on its simulated GPUs, the STAND-IN engines running on them slow their prefill to hold it, and
the heartbeats show GPU power that follows the traffic and never passes the limit.

The fleet is scripted (httpx.MockTransport); the engines are real processes on 127.0.0.1, killed
with the agent. Every wait is bounded."""

from __future__ import annotations

import json
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from fleet.lab.harness import wait_for as _wait_for
from fleet.lab.processes import free_port_block
from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.fleet_client import FleetClient
from fleet_agent.main import build_supervisor, build_telemetry

ASSIGNMENT: dict[str, Any] = {
    "kind": "serve",
    "deployment": "llama-8b",
    "model_uri": "s3://models/llama-3.1-8b",
    "model_checksum": "sha256:abc",
    "engine_params": {"backend": "pytorch", "tp_size": 1, "pp_size": 1},
    "gpus_per_replica": 1,
    "replicas": 2,
}
wait_for = partial(_wait_for, every=0.05)


@dataclass
class FakeFleet:
    limit: float | None = None
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/heartbeat"):
            with self.lock:
                self.heartbeats.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "server": "gpu-1",
                "heartbeat_interval_s": 0.3,
                "expected_gpus": 2,
                "assignment": ASSIGNMENT,
                "gpu_power_limit_w": self.limit,
            },
        )

    def gpus_since(self, mark: int) -> list[list[dict[str, Any]]]:
        with self.lock:
            return [hb["gpus"] for hb in self.heartbeats[mark:]]

    def mark(self) -> int:
        with self.lock:
            return len(self.heartbeats)


@dataclass
class Rig:
    agent: Agent
    fleet: FakeFleet
    base_port: int


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    monkeypatch.delenv("FLEET_STANDIN_GPU", raising=False)  # the agent's simulated model rules
    monkeypatch.setenv("FLEET_STANDIN_LOAD_S", "0.3")
    base = free_port_block(2)
    settings = AgentSettings(
        server="gpu-1",
        token=SecretStr("flt_test"),
        telemetry="simulated",
        sim_gpu_model="H200",
        sim_gpus=2,
        engine_command=f"{sys.executable} -m fleet_agent.engine.standin",
        engine_base_port=base,
        work_dir=tmp_path / "agent",
        sample_interval_s=0.2,
        heartbeat_interval_s=0.3,
        engine_stop_grace_s=5.0,
    )
    fleet = FakeFleet(limit=350.0)
    client = FleetClient("http://fleet.test", "flt_test", 2.0, httpx.MockTransport(fleet.handler))
    supervisor = build_supervisor(settings)
    agent = Agent(settings, build_telemetry(settings), client, supervisor=supervisor)
    stop = threading.Event()
    loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    loop.start()
    try:
        yield Rig(agent, fleet, base)
    finally:
        stop.set()
        agent.wake()
        loop.join(timeout=30)
        assert not loop.is_alive()
        assert supervisor.replica_stats() == []


def prefill_traffic(port: int, stop: threading.Event) -> threading.Thread:
    """Long prompts one after another (each a fresh prefix: no KV reuse) until `stop`."""

    def run() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(10_000):  # bounded; stop ends it long before
                if stop.is_set():
                    return
                prompt = uuid.uuid4().hex + "x" * 31_900  # ≈ 8,000 tokens
                body = {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 1}
                http.post("/v1/completions", json=body).raise_for_status()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def gpu_power(gpus_per_heartbeat: list[list[dict[str, Any]]], index: int) -> list[float]:
    return [g["power_w"] for gpus in gpus_per_heartbeat for g in gpus if g["index"] == index]


def test_the_fleets_cap_holds_gpu_power_and_lifts(rig: Rig) -> None:
    wait_for("engines ready", lambda: rig.agent.ready, 30)
    wait_for(
        "the cap in the heartbeats",
        lambda: any(
            [g["power_limit_w"] for g in gpus] == [350.0, 350.0] for gpus in rig.fleet.gpus_since(0)
        ),
        10,
    )
    assert rig.agent.state()["power_limit"]["applied"] == {0: 350.0, 1: 350.0}

    stop = threading.Event()
    traffic = prefill_traffic(rig.base_port, stop)  # replica 0, on GPU 0
    try:
        mark = rig.fleet.mark()
        wait_for(
            "GPU 0 held at its cap",
            lambda: any(w >= 300 for w in gpu_power(rig.fleet.gpus_since(mark), 0)),
            15,
        )
        capped = rig.fleet.gpus_since(mark)
        assert max(gpu_power(capped, 0)) <= 350.0  # prefill wants ≈ 680 W: held at the cap
        assert max(gpu_power(capped, 1)) < 100.0  # the idle replica's GPU stays near idle
        assert all(g["power_limit_w"] == 350.0 for gpus in capped for g in gpus)

        rig.fleet.limit = None  # the valve lifts the cap: the boards' default again
        mark = rig.fleet.mark()
        wait_for(
            "GPU 0 above the old cap",
            lambda: any(w > 450 for w in gpu_power(rig.fleet.gpus_since(mark), 0)),
            15,
        )
        assert rig.fleet.gpus_since(mark)[-1][0]["power_limit_w"] == 700.0
    finally:
        stop.set()
        traffic.join(timeout=15)
    mark = rig.fleet.mark()
    wait_for(
        "GPU 0 idle again",
        lambda: any(w < 100 for w in gpu_power(rig.fleet.gpus_since(mark), 0)),
        15,
    )
