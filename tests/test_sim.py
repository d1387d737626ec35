"""The fleet simulator (fleet/sim): determinism, M/D/1, the routing and batching orderings."""

from __future__ import annotations

from typing import Any

import pytest

from agents.engine import cost_model as cm
from fleet.sim.arrivals import Arrival, Constant, Diurnal, FixedSizes, poisson
from fleet.sim.core import DeploymentSpec, Simulation, summarize
from fleet.sim.engine import Engine, SimRequest
from fleet.sim.scenario import Scenario, compare, generate, run, run_requests

MIXED: dict[str, Any] = {
    "name": "mixed-code",
    "seed": 1,
    "warmup": 0.1,
    "deployments": [
        {
            "name": "code",
            "replicas": {"H200": 3, "H100": 3, "L40S": 2},
            "max_batch_size": 16,
            "router_limit": 64,
            "sla": {"latency_s": 5, "ttft_s": 2},
            "arrivals": {"trace": "code", "requests": 2400, "load": 0.8},
        }
    ],
}


def _requests(arrivals: list[Arrival], max_tokens: int | None = None) -> list[SimRequest]:
    return [
        SimRequest(k, a.at, a.prompt, a.output, max_tokens or a.output)
        for k, a in enumerate(arrivals)
    ]


def test_cost_model_is_affine() -> None:
    # The engine's fast mode relies on iteration_seconds being affine in its counts.
    shape = cm.EngineShape(gpu=cm.gpu_spec("H100"), model=cm.model_spec("llama-3.1-8b"))
    e = Engine(shape)
    for d, p, kv in [(3, 0, 5000), (40, 700, 123_456), (0, 8192, 8192)]:
        direct = cm.iteration_seconds(shape, d, p, kv)
        assert direct == pytest.approx(e._base + e._per_token * (d + p) + e._per_kv * kv)


def test_same_seed_same_result_and_fast_mode_matches_per_iteration() -> None:
    sc = Scenario.model_validate(MIXED | {"warmup": 0.0})
    reqs = generate(sc)[:600]
    a = run_requests(sc, reqs)
    b = run_requests(sc, reqs)
    assert [(r.finish, r.first_token) for r in a.requests] == [
        (r.finish, r.first_token) for r in b.requests
    ]
    slow = run_requests(sc, reqs, per_iteration=True)
    for x, y in zip(a.requests, slow.requests, strict=True):
        assert x.finish == pytest.approx(y.finish, rel=1e-6, abs=1e-6)


def test_poisson_is_reproducible() -> None:
    curve = Diurnal(mean_rps=20, amplitude=0.5, peak_s=100, period_s=400)
    one = poisson(curve, FixedSizes(100, 10), 400, seed=3)
    assert one == poisson(curve, FixedSizes(100, 10), 400, seed=3)
    assert one != poisson(curve, FixedSizes(100, 10), 400, seed=4)
    assert 8000 * 0.9 < len(one) < 8000 * 1.1
    near_peak = sum(1 for a in one if 50 <= a.at < 150)
    near_trough = sum(1 for a in one if 250 <= a.at < 350)
    assert near_peak > 2 * near_trough


def test_md1_mean_wait() -> None:
    """One engine, max batch 1, Poisson arrivals, fixed sizes, ρ = 0.7: the mean wait is
    ρ·S / (2(1 − ρ)) within 5 % (80k requests: seeds 0-9 land within 2.8 %, seed 0 at 0.1 %)."""
    spec = DeploymentSpec("d", "llama-3.1-8b", (("H100", 1),), "round_robin", max_batch_size=1)
    shape = spec.shape("H100")
    prompt, output = 512, 64
    service = cm.iteration_seconds(shape, 0, prompt, prompt) + sum(
        cm.iteration_seconds(shape, 1, 0, prompt + j) for j in range(1, output)
    )
    rho = 0.7
    arrivals = poisson(
        Constant(rho / service), FixedSizes(prompt, output), 80_000 * service / rho, 0
    )
    result = Simulation([spec]).run(_requests(arrivals))
    for r in result.requests:
        assert r.finish - r.start == pytest.approx(service, rel=1e-9)
    expected = rho * service / (2 * (1 - rho))
    assert summarize(result).wait_mean == pytest.approx(expected, rel=0.05)


def test_compare_orders_routing_and_batching() -> None:
    """Azure code trace (CC BY 4.0), 3 H200 + 3 H100 + 2 L40S, 80 % load, requests allowed to
    queue inside the engines (router limit 64 > max batch 16)."""
    sc = Scenario.model_validate(MIXED)
    rows = dict(
        compare(
            sc,
            [
                "round_robin",
                "least_pending",
                "estimated_completion_time",
                "estimated_completion_time/static",
            ],
        )
    )
    rr, lp, ect = rows["round_robin"], rows["least_pending"], rows["estimated_completion_time"]
    assert ect.latency_p95 < lp.latency_p95 < rr.latency_p95
    static = rows["estimated_completion_time/static"]
    assert ect.latency_p95 < static.latency_p95
    assert ect.ttft_p95 < static.ttft_p95
    assert ect.sla_attainment is not None and static.sla_attainment is not None
    assert ect.sla_attainment > static.sla_attainment


def test_run_and_bad_scenario() -> None:
    result, summary = run(Scenario.model_validate(MIXED))
    assert summary.requests == 2160 and summary.gpu_hours > 0 and summary.kwh > 0
    assert len(result.engines) == 8
    bad = MIXED | {"deployments": [MIXED["deployments"][0] | {"strategy": "fastest"}]}
    with pytest.raises(ValueError, match="unknown strategy"):
        Scenario.model_validate(bad)
