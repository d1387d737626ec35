"""The router during a rollout: requests split by model version at the canary weight, the
fallback when one side has nothing available, replicas on neither version left out, and the
per-version figures its load report sends."""

from __future__ import annotations

import asyncio

from fleet.router.admission import AdmissionQueue
from fleet.router.config import RouterSettings
from fleet.router.discovery import WorkerView, apply_agent_state
from fleet.router.estimates import Throughput
from fleet.router.metrics import RouterMetrics
from fleet.router.pool import DeploymentPool
from fleet.router.strategy import Replica, Request, least_pending

REQ = Request("m", prompt_tokens=10, expected_output=10)
V1, V2 = "m@v1", "m@v2"


def pool(versions: dict[str, str], *, limit: int = 1000) -> DeploymentPool:
    p = DeploymentPool("d", least_pending(), AdmissionQueue(64))
    for url, version in versions.items():
        p.replicas[url] = Replica(url=url, models=frozenset({"m"}), limit=limit, version=version)
        p.throughput[url] = Throughput(1.0)
    return p


def sent(p: DeploymentPool, n: int) -> dict[str, int]:
    """Versions of the replicas chosen for n requests (each released at once)."""

    async def run() -> dict[str, int]:
        counts: dict[str, int] = {}
        for _ in range(n):
            ticket = await p.acquire(REQ, "interactive", timeout=1)
            counts[ticket.replica.version] = counts.get(ticket.replica.version, 0) + 1
            p.release(ticket, output_tokens=10, ok=True, failed=False)
        return counts

    return asyncio.run(run())


def test_the_canary_gets_exactly_its_share_spread_evenly() -> None:
    p = pool({"http://a": V1, "http://b": V1, "http://c": V2})
    p.set_versions(V1, V2, 0.05)
    assert sent(p, 400) == {V1: 380, V2: 20}
    # Not in a burst: one canary request in every twenty.
    order = []

    async def run() -> None:
        for _ in range(40):
            ticket = await p.acquire(REQ, "interactive", timeout=1)
            order.append(ticket.replica.version)
            p.release(ticket, output_tokens=10, ok=True, failed=False)

    asyncio.run(run())
    positions = [i for i, v in enumerate(order) if v == V2]
    assert len(positions) == 2 and positions[1] - positions[0] == 20
    p.set_versions(V1, V2, 0.25)
    assert sent(p, 100) == {V1: 75, V2: 25}


def test_without_a_canary_every_request_goes_to_the_stable_version() -> None:
    p = pool({"http://a": V1, "http://b": V2})
    p.set_versions(V1, "", 0.0)  # a rollback: b still runs the bad version
    assert p.mixed
    assert sent(p, 50) == {V1: 50}
    p.set_versions(V1, V2, 0.0)  # a rollout before its first window: weight 0
    assert sent(p, 50) == {V1: 50}


def test_a_deployment_switched_outright_serves_on_from_the_old_version_meanwhile() -> None:
    """PATCH model_version (no canary): every server still runs v1 until v2 is in its cache.
    Refusing every request meanwhile would be an outage as long as the fetch."""
    p = pool({"http://a": V1, "http://b": V1})
    p.set_versions(V2, "", 0.0)
    assert sent(p, 10) == {V1: 10}
    p.replicas["http://b"].version = V2  # one has moved: the new version only from now on
    p.refresh_versions()
    assert sent(p, 10) == {V2: 10}


def test_a_canary_at_weight_0_takes_nothing_even_when_the_stable_side_is_busy() -> None:
    p = pool({"http://a": V1, "http://c": V2}, limit=1)
    p.set_versions(V1, V2, 0.0)  # servers moving to the canary, no window open yet

    async def run() -> str:
        held = await p.acquire(REQ, "interactive", timeout=1)  # the stable replica is full
        try:
            await p.acquire(REQ, "interactive", timeout=0.05)
        except Exception as exc:  # NoReplica: waited, nothing freed up
            return type(exc).__name__
        finally:
            p.release(held, output_tokens=10, ok=True, failed=False)
        return "chosen"

    assert asyncio.run(run()) == "NoReplica"


def test_a_side_with_nothing_available_hands_its_turn_to_the_other() -> None:
    p = pool({"http://a": V1, "http://c": V2})
    p.set_versions(V1, V2, 0.5)
    p.replicas["http://c"].ready = False  # the canary's replica restarts
    assert sent(p, 10) == {V1: 10}
    p.replicas["http://c"].ready = True
    p.replicas["http://a"].ready = False
    assert sent(p, 10) == {V2: 10}


def test_replicas_of_no_known_version_count_as_stable_and_plain_pools_skip_versions() -> None:
    p = pool({"http://a": "", "http://b": ""})
    p.set_versions("", "", 0.0)  # a static table: no versions at all
    assert not p.mixed
    assert sent(p, 4) == {"": 4}
    p = pool({"http://a": "", "http://c": V2})
    p.set_versions(V1, V2, 0.5)
    assert sent(p, 10) == {"": 5, V2: 5}


def test_the_table_and_the_agents_set_versions() -> None:
    view = WorkerView(RouterSettings(), http=None)  # type: ignore[arg-type]
    view.apply_table(
        [
            {
                "deployment": "d",
                "models": ["m"],
                "replicas": [
                    {"url": "http://a", "agent_url": "http://agent-a", "version": V1},
                    {"url": "http://c", "agent_url": "http://agent-c", "version": V1},
                ],
                "versions": {"stable": V1, "canary": V2, "canary_weight": 0.1},
            }
        ]
    )
    p = view.pools["d"]
    assert (p.stable, p.canary, p.canary_weight) == (V1, V2, 0.1)
    assert {r.version for r in p.replicas.values()} == {V1}
    # The agent says first that c restarted on the canary.
    apply_agent_state(
        view.agents["http://agent-c"],
        {"ready": True, "replicas": [{"url": "http://c", "state": "ready", "version": V2}]},
    )
    assert p.replicas["http://c"].version == V2
    # A table without versions (an older fleet): one pool, as before.
    view.apply_table([{"deployment": "d", "replicas": [{"url": "http://a"}]}])
    assert (p.stable, p.canary, p.mixed) == ("", "", False)


def test_per_version_figures_count_tries_and_take_p95s_of_the_last_minute() -> None:
    now = [1000.0]
    metrics = RouterMetrics()
    metrics.clock = lambda: now[0]
    for _ in range(8):
        metrics.attempt("d", V1, error=False)
        metrics.finished("d", "interactive", "200", 0.5, V1)
    metrics.attempt("d", V2, error=True)  # a 500, passed to the client
    metrics.finished("d", "interactive", "500", 0.1, V2)
    metrics.attempt("d", V2, error=False)
    metrics.finished("d", "interactive", "200", 2.0, V2)
    metrics.ttft("d", 0.2, V2)
    metrics.attempt("d", "", error=True)  # no version known: not counted per version
    figures = metrics.version_figures("d", [V1, V2])
    assert figures == {
        V1: {"requests": 8, "errors": 0, "p95_s": 0.5, "ttft_p95_s": None},
        V2: {"requests": 2, "errors": 1, "p95_s": 2.0, "ttft_p95_s": 0.2},
    }
    now[0] += 61
    later = metrics.version_figures("d", [V1, V2])
    assert later[V2] == {"requests": 2, "errors": 1, "p95_s": None, "ttft_p95_s": None}
    text = metrics_text(metrics)
    assert (
        'router_requests_total{code="500",deployment="d",priority="interactive",'
        'tenant="anonymous",version="m@v2"} 1.0' in text
    )
    assert (
        'router_version_attempts_total{deployment="d",outcome="error",version="m@v2"} 1.0' in text
    )


def metrics_text(metrics: RouterMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
