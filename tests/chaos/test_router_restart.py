"""Chaos: a router restarted mid-stream.

The world: a real `fleetctl router run --table FILE` in front of two real stand-in engines
(`python -m fleet_agent.engine.standin`, trtllm-serve's API, paced so that one answer streams
for several seconds), clients streaming completions through it.

Fault injected: SIGKILL of the router (its process group) while four streams are mid-answer
and two more wait in its waiting room (two requests per replica at most), then the same
command started again on the same port, as a supervisor would.

Checked ("nothing lost" — requests, state):
- every stream the kill cut ends at its client with a transport error (an incomplete chunked
  body; no answer at all for the waiting ones), within a bound, never a hang and never a
  `[DONE]` it did not get;
- a client that retries from the moment of the kill (connection refused while the port is
  empty) is answered 200 by the restarted router;
- the restarted router's view is right: both replicas ready, none ejected, no request in
  flight or waiting once its traffic is done (/state and the `router_replica_inflight` and
  `router_queue_depth` series of /metrics), and streams through it complete in full;
- the engines do not keep generating for the cut streams: their running and waiting counts
  fall to zero (they abort a request whose client left), and the requests they report
  finished are exactly the ones clients were answered in full.

The other side, with the router alive: its connections to one engine reset mid-stream (a TCP
fault proxy, tests/chaos/tcp_faults.py, between them). Documented (docs/router.md, "Failures"):
the client's stream ends there, counted as answered, the replica not ejected for it. Checked:
the cut streams end (without `[DONE]`: at the HTTP level the router ends them cleanly, so a
client can tell only by the missing `[DONE]` and finish_reason), the others complete, the
router's in-flight count for that engine falls to zero, the engine aborts the cut requests,
and new streams through that engine complete.

`pytest -s` prints the figures: tokens each cut stream got, when its error came, the restart's
time to /readyz and to the first answer, the engines' time to drop the cut requests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from tcp_faults import TcpFaultProxy

from fleet.lab.harness import RouterProcess, child_env, free_port
from fleet.lab.harness import wait_for as _wait_for

DEPLOYMENT = "llama"
MODEL = "llama-3.1-8b"
# The stand-in at a fifth of its modelled pace: a 400-token answer streams for ~9 s alone, so
# the kill lands mid-stream however busy the machine (it only makes them longer).
SPEEDUP = 0.2
REPLICA_LIMIT = 2  # requests in flight per replica: the table's max_batch_size
STREAMS = 4  # running: both replicas full
WAITING = 2  # in the router's waiting room when it dies
STREAM_TOKENS = 400
AFTER_TOKENS = 60  # the streams through the restarted router, to completion
CUT_BOUND_S = 15.0  # a cut stream's error reaches its client within this (not a hang)
SERVE_AGAIN_S = 60.0  # the restarted router answers within this (a busy 2-core machine)
ROUTER_SETTINGS = {
    "FLEET_ROUTER_CLIENT_AUTH": "none",  # about restarts, not callers
    "FLEET_ROUTER_FLEET_POLL_S": "0.2",
    "FLEET_ROUTER_LOG_LEVEL": "WARNING",
}

wait_for = partial(_wait_for, every=0.1)


class Engine:
    """One stand-in engine process (trtllm-serve's API), 8B on an H100, paced by SPEEDUP."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "FLEET_STANDIN_GPU": "H100",
            "FLEET_STANDIN_LOAD_S": "0.05",
            "FLEET_STANDIN_SPEEDUP": str(SPEEDUP),
        }
        args = [sys.executable, "-m", "fleet_agent.engine.standin", MODEL, "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--max_batch_size", "64"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=1).status_code == 200

    def figures(self) -> dict[str, float]:
        """Its Prometheus figures, summed over labels: running, waiting, finished."""
        text = httpx.get(f"{self.url}/prometheus/metrics", timeout=5).text

        def total(name: str) -> float:
            pattern = rf"^{name}\{{[^}}]*\}} (\S+)$"
            return sum(float(v) for v in re.findall(pattern, text, re.M))

        return {
            "running": total("trtllm_num_requests_running"),
            "waiting": total("trtllm_num_requests_waiting"),
            "finished": total("trtllm_request_success_total"),
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


class Router(RouterProcess):
    """`fleetctl router run --table FILE` over the engines at `urls`, restartable on its
    port."""

    def __init__(self, tmp: Path, urls: list[str]) -> None:
        self.table = tmp / "table.json"
        row = {
            "deployment": DEPLOYMENT,
            "models": [DEPLOYMENT, MODEL],
            "model_uri": f"s3://models/{MODEL}",
            "tp_size": 1,
            "max_batch_size": REPLICA_LIMIT,
            "replicas": [
                {"server": f"srv-{i}", "gpu_model": "H100", "url": url}
                for i, url in enumerate(urls)
            ],
        }
        self.table.write_text(json.dumps({"results": [row]}))
        super().__init__(tmp / "router.log", ROUTER_SETTINGS, "--table", str(self.table))

    def restart(self) -> None:
        """The same command on the same port, as a supervisor restarts it; returns once
        /readyz answers."""
        args = ["router", "run", "--table", str(self.table), "--port", str(self.port)]
        self.launch(args, child_env(ROUTER_SETTINGS))
        wait_for(
            "the restarted router",
            lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200,
            30,
            why=self.tail,
            give_up=self.exited,
        )

    def replicas(self) -> list[dict[str, Any]]:
        [row] = httpx.get(f"{self.url}/state", timeout=5).json()["deployments"]
        return list(row["replicas"])

    def gauges(self) -> dict[str, float]:
        """router_replica_inflight and router_queue_depth, each summed over its labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for name in ("router_replica_inflight", "router_queue_depth"):
            values = re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
            out[name] = sum(float(v) for v in values)
        return out


@dataclass
class Stream:
    """One streaming completion through the router, on a thread of its own."""

    url: str
    tokens: int
    chunks: int = 0
    done: bool = False  # the `[DONE]` line arrived
    error: str | None = None
    ended_at: float | None = None

    def __post_init__(self) -> None:
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {
            "model": DEPLOYMENT,
            "prompt": "a stream cut in the middle",
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "stream": True,
        }
        # A read timeout far beyond the bound: a hang shows as a thread still alive.
        timeout = httpx.Timeout(10.0, read=120.0)
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json=body, timeout=timeout
            ) as reply:
                if reply.status_code != 200:
                    self.error = f"HTTP {reply.status_code}"
                    return
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks += 1
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


@dataclass
class Retrier:
    """A client asking for a short completion until one is answered 200: the first try at
    the kill, each try bounded, 0.1 s apart."""

    url: str
    deadline_s: float
    tries: int = 0
    errors: int = 0
    answered_at: float | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": DEPLOYMENT, "prompt": "again?", "max_tokens": 8, "ignore_eos": True}
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            self.tries += 1
            try:
                reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=10)
                if reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8:
                    self.answered_at = time.monotonic()
                    return
                self.errors += 1
            except httpx.HTTPError:
                self.errors += 1
            time.sleep(0.1)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def start_engines(stack: ExitStack, tmp: Path) -> list[Engine]:
    engines = [Engine(tmp / f"engine-{i}.log") for i in range(2)]
    for engine in engines:
        stack.callback(engine.stop)
    for engine in engines:
        wait_for(f"engine {engine.url}", engine.ready, 30)
    return engines


def start_router(stack: ExitStack, tmp: Path, urls: list[str]) -> Router:
    router = Router(tmp, urls)
    stack.callback(router.stop)
    return router


def engines_idle(engines: list[Engine]) -> bool:
    return all(f["running"] == 0 and f["waiting"] == 0 for f in (e.figures() for e in engines))


def test_a_router_sigkilled_mid_stream_cuts_its_streams_clearly_and_serves_again(
    stack: ExitStack, tmp_path: Path
) -> None:
    engines = start_engines(stack, tmp_path)
    router = start_router(stack, tmp_path, [e.url for e in engines])
    finished_before = sum(e.figures()["finished"] for e in engines)

    streams = [Stream(router.url, STREAM_TOKENS) for _ in range(STREAMS)]
    for stream in streams:
        assert stream.started.wait(30), f"a stream never started: {router.tail()}"
    waiting = [Stream(router.url, STREAM_TOKENS) for _ in range(WAITING)]
    wait_for(
        f"{WAITING} requests in the router's waiting room",
        lambda: router.gauges()["router_queue_depth"] == WAITING,
        30,
        why=router.tail,
    )
    wait_for("every stream some tokens in", lambda: all(s.chunks >= 20 for s in streams), 30)
    assert not any(s.done or s.error for s in streams + waiting), streams + waiting
    running = sum(e.figures()["running"] for e in engines)

    killed_at = time.monotonic()
    router.kill()
    retrier = Retrier(router.url, SERVE_AGAIN_S)
    for stream in streams + waiting:
        stream.thread.join(CUT_BOUND_S)
    hung = [s for s in streams + waiting if s.thread.is_alive()]

    # The engines drop the cut requests rather than generating for nobody.
    wait_for("the engines to drop the cut requests", partial(engines_idle, engines), 30)
    idle_s = time.monotonic() - killed_at
    restarting = time.monotonic()
    router.restart()
    restart_s = time.monotonic() - restarting
    retrier.thread.join(SERVE_AGAIN_S + 15)

    # Streams through the restarted router complete in full.
    after = [Stream(router.url, AFTER_TOKENS) for _ in range(STREAMS)]
    for stream in after:
        stream.thread.join(60)

    print(
        f"\n{STREAMS} streams of {STREAM_TOKENS} tokens ({running:.0f} running on the engines) "
        f"and {WAITING} waiting in the router, router SIGKILLed; each cut stream: "
        + ", ".join(
            f"{s.chunks} tokens then "
            + (
                f"{(s.error or 'no error')[:60]!r} {s.ended_at - killed_at:.2f} s after the kill"
                if s.ended_at is not None
                else "still open"
            )
            for s in streams + waiting
        )
        + f"\nengines idle {idle_s:.2f} s after the kill; router restarted then, /readyz in "
        f"{restart_s:.1f} s; retrying client answered "
        + (
            f"{retrier.answered_at - killed_at:.1f} s after the kill"
            if retrier.answered_at is not None
            else "never"
        )
        + f" ({retrier.tries} tries, {retrier.errors} failed)"
    )

    # Cut streams: a clear error, in bounded time, no [DONE] they did not earn.
    assert not hung, f"{len(hung)} streams hang after the kill"
    for stream in streams:
        assert stream.error is not None and not stream.done, stream
        assert stream.error.startswith(("RemoteProtocolError", "ReadError")), stream.error
        assert 20 <= stream.chunks < STREAM_TOKENS, stream
    for stream in waiting:  # no answer had begun: the connection closed without one
        assert stream.error is not None and stream.chunks == 0 and not stream.done, stream
        assert stream.error.startswith("RemoteProtocolError"), stream.error
    # The retrying client is served by the restarted router.
    assert retrier.answered_at is not None, f"never answered again\n{router.tail()}"
    # Streams through the restarted router: complete.
    for stream in after:
        assert stream.done and stream.error is None, stream
        assert stream.chunks == AFTER_TOKENS, stream

    # The restarted router's view: both replicas ready, none ejected, nothing in flight.
    def router_idle() -> bool:
        gauges = router.gauges()
        return all(v == 0 for v in gauges.values()) and all(
            r["inflight"] == 0 for r in router.replicas()
        )

    wait_for("the restarted router to hold nothing", router_idle, 10, why=router.tail)
    replicas = router.replicas()
    assert len(replicas) == 2 and all(r["ready"] and not r["ejected"] for r in replicas), replicas
    # The engines finished exactly what clients were answered in full: the retried request
    # and the streams after the restart, none of the cut ones.
    finished = sum(e.figures()["finished"] for e in engines) - finished_before
    assert finished == 1 + len(after), f"engines finished {finished}"
    assert engines_idle(engines)


def test_an_engine_connection_cut_mid_stream_leaves_the_surviving_router_holding_nothing(
    stack: ExitStack, tmp_path: Path
) -> None:
    """The router alive, its connections to one engine reset mid-stream (module doc)."""
    engines = start_engines(stack, tmp_path)
    cut_engine = engines[0]
    proxy = TcpFaultProxy(cut_engine.port, name="router-to-engine").start()
    stack.callback(proxy.close)
    router = start_router(stack, tmp_path, [proxy.url, engines[1].url])
    finished_before = [e.figures()["finished"] for e in engines]

    streams = [Stream(router.url, STREAM_TOKENS) for _ in range(STREAMS)]
    wait_for("every stream some tokens in", lambda: all(s.chunks >= 20 for s in streams), 30)
    by_url = {r["url"]: r["inflight"] for r in router.replicas()}
    assert by_url == {proxy.url: REPLICA_LIMIT, engines[1].url: REPLICA_LIMIT}, by_url

    cut_at = time.monotonic()
    assert proxy.cut() == REPLICA_LIMIT  # the router's two connections to that engine
    wait_for(
        "the cut streams to end", lambda: sum(s.ended_at is not None for s in streams) >= 2, 30
    )
    cut = [s for s in streams if s.ended_at is not None]
    wait_for(
        "the router to drop the cut requests",
        lambda: {r["url"]: r["inflight"] for r in router.replicas()}[proxy.url] == 0,
        10,
        why=router.tail,
    )
    dropped_s = time.monotonic() - cut_at
    wait_for("the engine to drop them", partial(engines_idle, engines[:1]), 30)
    for stream in streams:
        stream.thread.join(60)
    # The router goes on using the replica behind the proxy (a mid-stream cut ejects nothing).
    after = [Stream(router.url, AFTER_TOKENS) for _ in range(STREAMS)]
    for stream in after:
        stream.thread.join(60)
    forwarded = proxy.counters().forwarded

    print(
        "\nan engine's connections cut mid-stream: the cut streams got "
        + ", ".join(
            f"{s.chunks} tokens then {s.error or 'a clean end without [DONE]'!r}" for s in cut
        )
        + f"; the router held nothing on it {dropped_s:.2f} s after the cut; the others "
        f"{[s.chunks for s in streams if s not in cut]} tokens; {forwarded} connections to "
        f"the cut engine in all"
    )
    assert len(cut) == REPLICA_LIMIT and all(not s.done for s in cut), cut
    assert all(20 <= s.chunks < STREAM_TOKENS for s in cut), cut
    for stream in streams:
        if stream not in cut:
            assert stream.done and stream.chunks == STREAM_TOKENS, stream
    for stream in after:
        assert stream.done and stream.error is None and stream.chunks == AFTER_TOKENS, stream
    wait_for(
        "the router to hold nothing",
        lambda: (
            all(v == 0 for v in router.gauges().values())
            and all(r["inflight"] == 0 for r in router.replicas())
        ),
        10,
        why=router.tail,
    )
    replicas = router.replicas()
    assert all(r["ready"] and not r["ejected"] for r in replicas), replicas
    finished = [e.figures()["finished"] - b for e, b in zip(engines, finished_before, strict=True)]
    # The cut engine finished none of the cut streams; every other stream finished once.
    assert sum(finished) == STREAMS - len(cut) + len(after), finished
    assert engines_idle(engines)
