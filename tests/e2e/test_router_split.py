"""The router's split by model version end to end: a real `fleetctl router run` reading a
routing table with a rollout in it, in front of two replicas of the stable version and one of
a canary that fails half its requests.

The replicas and the fleet's report endpoint are TEST DOUBLES on the test's own event loop (an
OpenAI-shaped completion, trtllm-serve's error body for a 500; POST /api/v1/routing/report kept
as received and checked with the fleet's own `LoadReport` model): what is under test is the
router — exactly the canary's share of requests, the fallback, requests counted by version in
its metrics, and the per-version figures in its load report.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from fleet.lab.harness import RouterProcess, free_port
from fleet.lab.harness import wait_for as _wait_for
from fleet.registry.routing_table import LoadReport

wait_for = partial(_wait_for, every=0.05)
DEPLOYMENT = "llama"
V1, V2 = "llama@v1", "llama@v2"


class Doubles:
    """Replicas (URL → answers 200, or 500 for every other request) and the fleet's report
    endpoint, on one event loop in a thread."""

    def __init__(self, failing: set[int]) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.fleet_port = free_port()
        self.failing = failing  # indexes of replicas answering 500 every other request
        self.served = [0, 0, 0]
        self.reports: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    async def _completion(self, i: int, request: web.Request) -> web.Response:
        await request.read()
        self.served[i] += 1
        if i in self.failing and self.served[i] % 2 == 0:
            error = {"object": "error", "message": "bad version", "type": "InternalServerError"}
            return web.json_response({**error, "code": 500}, status=500)
        body = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "llama",
            "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        return web.json_response(body)

    async def _report(self, request: web.Request) -> web.Response:
        self.reports.append(await request.json())
        return web.json_response({"recorded": 1})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runners = []
        for i, port in enumerate(self.ports):
            app = web.Application()
            app.router.add_post("/v1/completions", partial(self._completion, i))
            runners.append((web.AppRunner(app), port))
        fleet = web.Application()
        fleet.router.add_post("/api/v1/routing/report", self._report)
        runners.append((web.AppRunner(fleet), self.fleet_port))
        for runner, port in runners:
            self._loop.run_until_complete(runner.setup())
            self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        self._started.set()
        self._loop.run_forever()
        for runner, _ in runners:
            self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> Doubles:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def table(doubles: Doubles, canary_weight: float, canary: str | None = V2) -> dict[str, Any]:
    replicas = [
        {"server": f"s{i}", "gpu_model": "H100", "url": doubles.url(i), "version": version}
        for i, version in enumerate((V1, V1, V2))
    ]
    row = {
        "deployment": DEPLOYMENT,
        "models": [DEPLOYMENT],
        "model_uri": DEPLOYMENT,
        "tp_size": 1,
        "replicas": replicas,
        "versions": {"stable": V1, "canary": canary, "canary_weight": canary_weight},
    }
    return {"results": [row]}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Doubles, RouterProcess, Path]]:
    with Doubles(failing={2}) as doubles:
        path = tmp_path / "table.json"
        path.write_text(json.dumps(table(doubles, 0.1)))
        settings = {
            "FLEET_ROUTER_FLEET_POLL_S": "0.1",
            "FLEET_ROUTER_FLEET_URL": f"http://127.0.0.1:{doubles.fleet_port}",
            "FLEET_ROUTER_TOKEN": "flt_test-double",
            "FLEET_ROUTER_REPORT_S": "0.2",
            # About the split by version, not callers: explicitly unauthenticated.
            "FLEET_ROUTER_CLIENT_AUTH": "none",
        }
        router = RouterProcess(tmp_path / "router.log", settings, "--table", str(path))
        try:
            yield doubles, router, path
        finally:
            router.stop()


def complete(router: RouterProcess, client: httpx.Client) -> int:
    body = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 1}
    return client.post(f"{router.url}/v1/completions", json=body).status_code


def series(router: RouterProcess, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{router.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name) :]] = float(value)
    return out


def test_the_canary_gets_its_share_and_its_failures_are_counted_by_version(
    world: tuple[Doubles, RouterProcess, Path],
) -> None:
    doubles, router, path = world
    with httpx.Client(timeout=10) as client:
        codes = [complete(router, client) for _ in range(200)]
    # 10 % of 200 to the canary, one in two of those failing; nothing else fails.
    assert doubles.served[2] == 20 and doubles.served[0] + doubles.served[1] == 180
    assert codes.count(500) == 10 and codes.count(200) == 190
    requests = series(router, "router_requests_total")
    labels = (
        '{{code="{}",deployment="llama",priority="interactive",tenant="anonymous",version="{}"}}'
    )
    assert requests[labels.format("200", "llama@v1")] == 180
    assert requests[labels.format("500", "llama@v2")] == 10
    assert requests[labels.format("200", "llama@v2")] == 10
    tries = series(router, "router_version_attempts_total")
    assert tries['{deployment="llama",outcome="error",version="llama@v2"}'] == 10
    assert tries['{deployment="llama",outcome="ok",version="llama@v1"}'] == 180
    state = httpx.get(f"{router.url}/state", timeout=5).json()["deployments"][0]
    assert state["versions"] == {"stable": V1, "canary": V2, "canary_weight": 0.1}

    # The load report carries the figures per version, in the shape the fleet accepts. Reports
    # go out on the router's own interval, so one may have left mid-stream (the canary's 20th
    # request in it, not yet the stable's last few: CI once read 177): wait for all 200.
    def reported() -> dict[str, Any] | None:
        for body in reversed(doubles.reports):
            figures = LoadReport.model_validate(body).deployments[DEPLOYMENT].versions
            if sum(f.requests for f in figures.values()) == 200:
                return {k: v.model_dump() for k, v in figures.items()}
        return None

    wait_for("a report with all 200 requests", reported, 10)
    figures = reported()
    assert figures is not None
    assert (figures[V2]["requests"], figures[V2]["errors"]) == (20, 10)
    assert (figures[V1]["requests"], figures[V1]["errors"]) == (180, 0)
    assert figures[V1]["p95_s"] is not None

    # Rolled back: the canary set aside, its replica still listed (its server not yet back on
    # v1) gets nothing.
    path.write_text(json.dumps(table(doubles, 0.0, canary=None)))
    wait_for(
        "the rollback in the router",
        lambda: (
            httpx.get(f"{router.url}/state", timeout=5).json()["deployments"][0]["versions"][
                "canary"
            ]
            is None
        ),
        10,
    )
    with httpx.Client(timeout=10) as client:
        codes = [complete(router, client) for _ in range(40)]
    assert codes == [200] * 40 and doubles.served[2] == 20
