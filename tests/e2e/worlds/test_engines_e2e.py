"""Issue 24's acceptance end to end: one fleet, three engines.

The world (tests/colo_world.py): `fleetctl serve` on its embedded SQLite database, a virtual
colo of three 1-GPU H100 servers whose agents run each engine's STAND-IN (trtllm-serve's,
`vllm serve`'s and SGLang's launch_server's command lines, routes, metric names and error
bodies; fleet_agent/engine/standin/), and one router in front.

1. A deployment with an option its engine lacks is refused when it is created, naming it.
2. One deployment per engine, each booted on a spare: every one answers completions through
   the same router; each replica reports its engine, and its engine speaks its own dialect
   (its metric names on its own route, its error body for a bad request).
3. An agent SIGKILLed while its engine streams answers, and started again: the engine is
   adopted (the same process), every request in flight completes, and the server never
   leaves `serving`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from colo_world import World, colo_world, ipmi_inventory

from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    SERVING_SETTINGS,
    RouterProcess,
)
from fleet.lab.harness import wait_for as _wait_for

for tool in ("ipmi_sim", "ipmitool"):
    if shutil.which(tool) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{tool} is required in CI", pytrace=False)
        pytest.skip(f"{tool} not installed (Debian openipmi, ipmitool)", allow_module_level=True)

SITE, RACK = "en", "en-r01"
SERVERS = tuple(f"{RACK}-h100-{i}" for i in range(1, 4))
MODEL_URI = "s3://models/llama-3.1-8b"  # weights outside Fleet: the stand-ins need none
# One deployment per engine, each with a batch limit in its engine's own words.
DEPLOYMENTS = {
    "chat-trt": ("trtllm", "max_batch_size=8"),
    "chat-vllm": ("vllm", "max_num_seqs=8"),
    "chat-sgl": ("sglang", "max_running_requests=8"),
}
# Where each engine's Prometheus text lives, and a family only that engine exposes.
DIALECT = {
    "trtllm": ("/prometheus/metrics", "trtllm_"),
    "vllm": ("/metrics", "vllm:num_requests_running"),
    "sglang": ("/metrics", "sglang:num_running_reqs"),
}
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | SERVING_SETTINGS
AGENT_ENV = FAST_AGENT_SETTINGS
SERVE_TIMEOUT_S = 90.0
wait_for = partial(_wait_for, every=0.25)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("engines")
    inventory = ipmi_inventory(SITE, RACK, SERVERS, "H100", 1)
    with colo_world(base, inventory, SERVICE_SETTINGS, boot_delay_s=0.5, agent_env=AGENT_ENV) as w:
        yield w


def create(world: World, name: str, *engine: str) -> Any:
    return world.fleetctl(
        *("deployments", "create", name, "--model-uri", MODEL_URI, "--checksum", "sha256:1"),
        *("--sla-p95-ms", "60000", "--sla-ttft-ms", "60000", "--gpu-model", "H100"),
        # One replica each, held there by the autoscaler (min 1): it boots it, too.
        *("--min", "1", "--max", "1", *[a for value in engine for a in ("--engine", value)]),
        *("-o", "json"),
    )


@dataclass
class Stream:
    """One streaming completion through the router, in a thread: every chunk, or the error."""

    url: str
    model: str
    max_tokens: int
    chunks: list[str] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {
            "model": self.model,
            "prompt": f"stream {id(self)}",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json=body, timeout=120
            ) as reply:
                if reply.status_code != 200:
                    self.error = f"HTTP {reply.status_code}: {reply.read()[:300]!r}"
                    return
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.chunks.append(choice.get("text", ""))
                    self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"


def test_one_fleet_three_engines_one_router_and_engines_outlive_their_agent(
    world: World, tmp_path: Path
) -> None:
    # 1. An option the engine lacks: refused at create time, naming it and the engine.
    refused = create(world, "bad-sgl", "sglang", "max_num_seqs=8")
    assert refused.exit_code != 0
    line = refused.output.strip()
    assert len(line.splitlines()) == 1 and "max_num_seqs" in line and "sglang" in line, line
    gone = world.api.request("GET", "/deployments/bad-sgl")
    assert gone.status_code == 404, gone.text

    # 2. One deployment per engine, each booted on a spare of its own by the autoscaler.
    for name, (engine, limit) in DEPLOYMENTS.items():
        made = create(world, name, engine, limit)
        assert made.exit_code == 0, made.output
        assert json.loads(made.stdout)["engine"] == engine
    wait_for(
        "every deployment serving",
        lambda: set(world.states().values()) == {"serving"},
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    servers = {s["name"]: s for s in world.servers()}
    where = {s["deployment"]: name for name, s in servers.items()}
    assert set(where) == set(DEPLOYMENTS), where

    settings = {
        "FLEET_ROUTER_FLEET_URL": world.service.url,
        "FLEET_ROUTER_TOKEN": world.api.token,
        "FLEET_ROUTER_FLEET_POLL_S": "0.3",
        "FLEET_ROUTER_REPORT_S": "0.5",
        # About engines, not callers: explicitly unauthenticated.
        "FLEET_ROUTER_CLIENT_AUTH": "none",
    }
    router = RouterProcess(tmp_path / "router.log", settings)
    try:
        for name, (engine, _) in DEPLOYMENTS.items():

            def answered(name: str = name) -> httpx.Response | None:
                body = {"model": name, "prompt": "hello", "max_tokens": 8}
                reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
                return reply if reply.status_code == 200 else None

            reply = wait_for(f"{name} through the router", answered, 30, why=router.tail)
            assert reply.json()["choices"][0]["text"], reply.text

            # The replica reports its engine; its engine speaks its own dialect.
            row = world.api("GET", f"/servers/{where[name]}")
            [replica] = row["replicas"]
            assert replica["engine"] == engine, replica
            path, family = DIALECT[engine]
            text = httpx.get(replica["url"] + path, timeout=5).text
            assert family in text, f"{engine}: {family} not in {path}"
            bad = httpx.post(
                f"{replica['url']}/v1/completions",
                json={"model": name, "prompt": "x", "max_tokens": -1},
                timeout=5,
            )
            assert bad.status_code == 400, (engine, bad.status_code, bad.text)
            print(f"\n{engine}: bad request → {bad.status_code} {bad.text[:160]}")

        # 3. The vLLM server's agent SIGKILLed mid-stream and started again.
        name = "chat-vllm"
        server = where[name]
        [before] = world.api("GET", f"/servers/{server}")["replicas"]
        streams = [Stream(router.url, name, 400).start() for _ in range(4)]
        wait_for("the streams flowing", lambda: all(s.chunks for s in streams), 30)
        seen: set[str] = set()
        stop = threading.Event()

        def watch() -> None:  # every state the fleet shows meanwhile
            while not stop.is_set():
                seen.add(world.states()[server])
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        pid = world.colo.agent_pid(server)
        assert pid is not None
        world.colo.restart_agent(server, signal.SIGKILL)
        assert world.colo.agent_pid(server) not in (None, pid)
        for stream in streams:
            stream.join(120)
        stop.set()
        watcher.join(5)
        for stream in streams:
            assert stream.error is None, stream.error
            assert len(stream.chunks) == 400 and stream.finish == "length", len(stream.chunks)
        assert seen == {"serving"}, seen

        def adopted() -> dict[str, Any] | None:
            row = world.api("GET", f"/servers/{server}")
            replicas = row["replicas"]
            fresh = row["agent_url"] and replicas and replicas[0]["state"] == "ready"
            return replicas[0] if fresh else None

        after = wait_for("the restarted agent reporting", adopted, 30, why=world.why)
        assert after["pid"] == before["pid"] and after["url"] == before["url"], (before, after)
        assert world.states()[server] == "serving"
    finally:
        router.stop()
