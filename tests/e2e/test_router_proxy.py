"""The router end to end: a real `fleetctl router run` in front of real stand-in engines
(`python -m fleet_agent.engine.standin`, trtllm-serve's HTTP API), spoken to with the official
`openai` client.

The router reads a routing table file (the same shape as the fleet's GET /api/v1/routing). Where
a test needs an agent, `AgentDouble` serves the agent's /state contract (ready, draining, per
replica state, queue, KV) from the test: a TEST DOUBLE of fleet_agent/local_api.py's /state, so that
the test can turn a replica not-ready at a moment of its choosing. tests/unit/test_agent_api.py
covers the real /state.

- completions and streaming chat completions through the router;
- a replica that starts draining mid-stream (SIGTERM: the stand-in finishes what it runs and
  503s new work, as trtllm-serve does) finishes that stream; new requests go elsewhere;
- a killed replica's new requests go elsewhere (connect refused → retry, then ejection);
- an agent turning not-ready: no new request reaches its replica from 0.5 s on;
- 429 with Retry-After only once the bounded queue is full; interactive overtakes batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from threaded_app import ThreadedApp

from fleet.lab.harness import RouterProcess, free_port
from fleet.lab.harness import wait_for as _wait_for

DEPLOYMENT = "llama"
MODEL = "llama-3.1-8b"

# The router and the engines change state within milliseconds: polled every 50 ms.
wait_for = partial(_wait_for, every=0.05)


class Engine:
    """One stand-in engine process (8B FP8) pretending to run on `gpu`."""

    def __init__(self, gpu: str, log: Path, speedup: float = 1.0, max_batch: int = 64) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "FLEET_STANDIN_GPU": gpu,
            "FLEET_STANDIN_LOAD_S": "0.05",
            "FLEET_STANDIN_SPEEDUP": str(speedup),
            "FLEET_STANDIN_DRAIN_S": "20",
        }
        args = [sys.executable, "-m", "fleet_agent.engine.standin", MODEL, "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--max_batch_size", str(max_batch)]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=1).status_code == 200

    def served(self) -> int:
        """Requests this engine finished (its Prometheus counter, which reads without reset)."""
        text = httpx.get(f"{self.url}/prometheus/metrics", timeout=2).text
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("trtllm_request_success_total{")
            )
        )

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=25)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class AgentDouble(ThreadedApp):
    """A TEST DOUBLE of the agent's /state (see the module doc), on its own event loop."""

    def __init__(self, replicas: list[str]) -> None:
        super().__init__()
        self.state: dict[str, Any] = {
            "ready": True,
            "draining": False,
            "replicas": [{"url": u, "state": "ready", "queued": 0, "running": 0} for u in replicas],
        }
        self.polls = 0

    async def _handle(self, _: web.Request) -> web.Response:
        self.polls += 1
        return web.json_response(self.state)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/state", self._handle)


class Router(RouterProcess):
    """`fleetctl router run --table FILE` as a process."""

    def __init__(self, tmp: Path, replicas: list[dict[str, Any]], **settings: str) -> None:
        n = free_port()  # a number of its own for its files
        self.table = tmp / f"table-{n}.json"
        self.write(replicas)
        # About routing, not callers (test_router_callers.py): explicitly unauthenticated.
        settings = {
            "FLEET_ROUTER_FLEET_POLL_S": "0.2",
            "FLEET_ROUTER_CLIENT_AUTH": "none",
            **settings,
        }
        super().__init__(tmp / f"router-{n}.log", settings, "--table", str(self.table))
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def write(
        self,
        replicas: list[dict[str, Any]],
        max_batch: int | None = None,
        cold_start_s: float | None = None,
    ) -> None:
        row = {
            "deployment": DEPLOYMENT,
            "models": [DEPLOYMENT, MODEL],
            "model_uri": f"s3://models/{MODEL}",
            "tp_size": 1,
            "max_batch_size": max_batch,
            "replicas": replicas,
            "cold_start_s": cold_start_s,
        }
        self.table.write_text(json.dumps({"results": [row]}))

    def state(self) -> dict[str, Any]:
        [row] = httpx.get(f"{self.url}/state", timeout=5).json()["deployments"]
        return dict(row)


def replica(engine: Engine, gpu: str, agent: str | None = None) -> dict[str, Any]:
    return {"server": f"srv-{engine.port}", "gpu_model": gpu, "agent_url": agent, "url": engine.url}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def engines(stack: ExitStack, tmp: Path, gpus: list[str], **kw: Any) -> list[Engine]:
    started = [Engine(gpu, tmp / f"engine-{i}.log", **kw) for i, gpu in enumerate(gpus)]
    for engine in started:
        stack.callback(engine.stop, signal.SIGKILL)
    for engine in started:
        wait_for(f"engine {engine.url}", engine.ready)
    return started


def start_router(stack: ExitStack, tmp: Path, rows: list[dict[str, Any]], **kw: str) -> Router:
    router = Router(tmp, rows, **kw)
    stack.callback(router.stop)
    return router


def long_stream(router: Router, tokens: int, priority: str = "interactive") -> Iterator[str]:
    stream = router.client.completions.create(
        model=DEPLOYMENT,
        prompt="a stream that takes a while",
        max_tokens=tokens,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"x-fleet-priority": priority},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            yield chunk.choices[0].text


# ---------------------------------------------------------------------------------------------


def test_completions_and_streaming_chat_through_the_router(
    stack: ExitStack, tmp_path: Path
) -> None:
    a, b = engines(stack, tmp_path, ["H100", "L40S"], speedup=20)
    router = start_router(stack, tmp_path, [replica(a, "H100"), replica(b, "L40S")])
    models = {m.id for m in router.client.models.list().data}
    assert models == {DEPLOYMENT, MODEL}
    reply = router.client.completions.create(model=DEPLOYMENT, prompt="x" * 400, max_tokens=8)
    assert reply.usage is not None and reply.usage.prompt_tokens == 100  # the router's count too
    assert reply.usage.completion_tokens == 8 and reply.choices[0].text
    chunks = list(
        router.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    with pytest.raises(openai.NotFoundError, match="not served here"):
        router.client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="x-fleet-priority"):
        router.client.completions.create(
            model=DEPLOYMENT, prompt="x", max_tokens=1, extra_headers={"x-fleet-priority": "vip"}
        )
    metrics = httpx.get(f"{router.url}/metrics").text
    assert (
        'router_requests_total{code="200",deployment="llama",priority="interactive",'
        'tenant="anonymous",version=""} 2.0' in metrics
    )
    assert 'router_output_tokens_total{deployment="llama"} 20.0' in metrics
    assert "router_time_to_first_token_seconds_bucket" in metrics


def test_a_replica_draining_mid_stream_finishes_it_and_new_requests_go_elsewhere(
    stack: ExitStack, tmp_path: Path
) -> None:
    a, b = engines(stack, tmp_path, ["L40S", "L40S"])
    # Least-pending and one engine busy: the stream lands on `a` when `a` is listed alone first.
    router = start_router(
        stack, tmp_path, [replica(a, "L40S")], FLEET_ROUTER_STRATEGY="least_pending"
    )
    stream = long_stream(router, tokens=120)
    first = next(stream)
    router.write([replica(a, "L40S"), replica(b, "L40S")])
    wait_for("both replicas listed", lambda: len(router.state()["replicas"]) == 2)
    a.proc.send_signal(signal.SIGTERM)  # drains: finishes what it runs, 503s new work
    wait_for("a to refuse new work", lambda: httpx.get(f"{a.url}/health").status_code == 503)
    answers = [
        router.client.completions.create(model=DEPLOYMENT, prompt="p", max_tokens=2)
        for _ in range(4)
    ]
    rest = list(stream)
    assert len([first, *rest]) == 120, "the drained replica's stream was cut"
    assert all(r.choices[0].text for r in answers)
    assert b.served() == 4
    a.proc.wait(timeout=20)
    assert a.proc.returncode == 0


def test_a_killed_replicas_new_requests_go_elsewhere(stack: ExitStack, tmp_path: Path) -> None:
    a, b = engines(stack, tmp_path, ["H100", "H100"], speedup=20)
    router = start_router(
        stack,
        tmp_path,
        [replica(a, "H100"), replica(b, "H100")],
        FLEET_ROUTER_STRATEGY="round_robin",
        FLEET_ROUTER_EJECT_AFTER="2",
        FLEET_ROUTER_EJECT_S="60",
    )
    a.stop(signal.SIGKILL)
    for _ in range(10):
        reply = router.client.completions.create(model=DEPLOYMENT, prompt="p", max_tokens=2)
        assert reply.choices[0].text
    assert b.served() == 10
    [dead] = [r for r in router.state()["replicas"] if r["url"] == a.url]
    assert dead["ejected"] and dead["inflight"] == 0


def test_an_agent_turning_not_ready_gets_no_new_request_within_half_a_second(
    stack: ExitStack, tmp_path: Path
) -> None:
    a, b = engines(stack, tmp_path, ["H100", "H100"], speedup=20)
    agent_a = stack.enter_context(AgentDouble([a.url]))
    agent_b = stack.enter_context(AgentDouble([b.url]))
    router = start_router(
        stack,
        tmp_path,
        [replica(a, "H100", agent_a.url), replica(b, "H100", agent_b.url)],
        FLEET_ROUTER_STRATEGY="round_robin",
    )
    wait_for("both replicas ready", lambda: all(r["ready"] for r in router.state()["replicas"]), 10)
    for _ in range(4):
        router.client.completions.create(model=DEPLOYMENT, prompt="p", max_tokens=1)
    assert (a.served(), b.served()) == (2, 2)
    agent_a.state = {**agent_a.state, "ready": False, "draining": True}
    time.sleep(0.5)
    for _ in range(6):
        router.client.completions.create(model=DEPLOYMENT, prompt="p", max_tokens=1)
    assert (a.served(), b.served()) == (2, 8)
    agent_a.state = {**agent_a.state, "ready": True, "draining": False}
    wait_for("a ready again", lambda: all(r["ready"] for r in router.state()["replicas"]), 5)


def test_a_deployment_at_zero_holds_requests_and_says_how_long_a_boot_takes(
    stack: ExitStack, tmp_path: Path
) -> None:
    """No replica (scaled to zero): a request waits in the room (the demand the router
    reports) up to the queue timeout, then 503 with Retry-After: the boot time the table
    gives; a request still waiting when a replica appears is served by it."""
    [a] = engines(stack, tmp_path, ["L40S"])  # the server that will come, started ahead
    router = start_router(stack, tmp_path, [], FLEET_ROUTER_QUEUE_TIMEOUT_S="2")
    router.write([], cold_start_s=840.0)
    time.sleep(0.5)  # the table polled (every 0.2 s)
    body = {"model": DEPLOYMENT, "prompt": "p", "max_tokens": 1}
    refused = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "840"
    assert "~840 s to boot" in refused.json()["error"]["message"]
    answers: list[int] = []
    held = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{router.url}/v1/completions", json=body, timeout=10).status_code
        )
    )
    held.start()
    wait_for("the request to wait", lambda: sum(router.state()["queue"].values()) == 1, 5)
    router.write([replica(a, "L40S")])
    held.join(10)
    assert answers == [200]


def test_429_only_when_the_bounded_queue_is_full_and_interactive_overtakes_batch(
    stack: ExitStack, tmp_path: Path
) -> None:
    [a] = engines(stack, tmp_path, ["L40S"])
    router = start_router(
        stack,
        tmp_path,
        [replica(a, "L40S")],
        FLEET_ROUTER_REPLICA_LIMIT="1",
        FLEET_ROUTER_QUEUE_BOUND="2",
    )
    order: list[str] = []
    lock = threading.Lock()

    def client(name: str, priority: str, tokens: int) -> None:
        """Note when the first token arrives, then read the stream to its end."""
        for i, _ in enumerate(long_stream(router, tokens, priority)):
            if i == 0:
                with lock:
                    order.append(name)

    running = threading.Thread(target=client, args=("first", "interactive", 200))
    running.start()
    wait_for("the first request to run", lambda: order == ["first"], 10)
    batch = threading.Thread(target=client, args=("batch", "batch", 5))
    batch.start()
    wait_for("the batch request to wait", lambda: router.state()["queue"]["batch"] == 1, 5)
    interactive = threading.Thread(target=client, args=("interactive", "interactive", 5))
    interactive.start()
    wait_for("two waiting", lambda: sum(router.state()["queue"].values()) == 2, 5)
    # The room holds two: the next one is turned away at once, with a Retry-After.
    refused = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "p", "max_tokens": 1},
        timeout=5,
    )
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert "2 requests are waiting" in refused.json()["error"]["message"]
    for thread in (running, batch, interactive):
        thread.join(60)
        assert not thread.is_alive()
    assert order == ["first", "interactive", "batch"], router.tail()
    codes = httpx.get(f"{router.url}/metrics").text
    assert (
        'router_requests_total{code="429",deployment="llama",priority="interactive",'
        'tenant="anonymous",version=""} 1.0' in codes
    )
