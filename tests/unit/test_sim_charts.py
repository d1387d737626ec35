"""The simulator's charts (fleet/sim/charts.py): series, a PNG, `fleetctl simulate --charts`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleet import cli
from fleet.sim import charts
from fleet.sim.autoscale import AutoscaleSpec, ScalePoint
from fleet.sim.core import DeploymentSpec, RunResult
from fleet.sim.engine import Engine, SimRequest
from fleet.sim.scenario import Scenario, capacity_rps, run

PNG = b"\x89PNG\r\n\x1a\n"


def test_series_functions() -> None:
    assert charts.bucket_s(120) == 1 and charts.bucket_s(121) == 2 and charts.bucket_s(7200) == 60
    assert charts.bucket_s(1e9) == 3600
    assert charts.p95_window_s(120, 1) == 15 and charts.p95_window_s(7200, 60) == 60
    assert charts.p95_window_s(86400, 900) == 900
    # Buckets [0, 10), [10, 20), [20, 30]: an arrival at the end counts in the last one
    t, rps = charts.demand([0, 1, 9.99, 10, 25, 30], 0, 30, 10)
    assert t == [0, 10, 20] and rps == [0.3, 0.1, 0.2]
    assert charts.step_at([(10, 5), (20, 7), (20, 8)], 1, [0, 10, 15, 20, 99]) == [1, 5, 5, 8, 8]
    assert charts.step_sum([(1, [(10, 3)]), (2, [(5, 0), (50, 9)])], 0, 30) == (
        [0, 5, 10, 30],
        [3, 1, 3, 3],
    )
    assert charts.step_sum([], 0, 30) == ([0, 30], [0.0, 0.0])
    # Finished at 1..20 with values 1..20; a 10 s window holds (t − 10, t]
    done = [(float(k), float(k)) for k in range(1, 21)]
    p = charts.rolling_p95(done, [0, 1, 10, 20, 35], 10)
    assert math.isnan(p[0]) and p[1:4] == [1, 10, 20] and math.isnan(p[4])
    assert charts.rolling_p95([(1, x) for x in range(100, 0, -1)], [1], 5) == [95]
    assert charts.spares_in_use([(15, 6), (15, 4), (30, 3), (45, 7)], 6) == (
        [15, 30, 45],
        [2, 3, -1],
    )
    assert charts.file_name("mixed code", "estimated_completion_time/static") == (
        "mixed-code-estimated_completion_time-static.png"
    )
    spec = DeploymentSpec("a", "llama-3.1-8b", (("H100", 1),))
    static = DeploymentSpec("b", "llama-3.1-8b", (("H100", 1),), batching="static")
    assert charts.variant_name([spec, spec]) == "estimated_completion_time"
    assert charts.variant_name([spec, static]) == (
        "estimated_completion_time+estimated_completion_time/static"
    )


def _spec(autoscaled: bool) -> DeploymentSpec:
    return DeploymentSpec(
        "chat",
        "llama-3.1-8b",
        (("H100", 1),),
        max_batch_size=16,
        latency_sla_s=20,
        ttft_sla_s=2,
        autoscale=AutoscaleSpec(warm_pool=(("H100", 4),), sla_p95_s=20, sla_ttft_s=2)
        if autoscaled
        else None,
    )


def _result(autoscaled: bool) -> RunResult:
    """2 req/s for 120 s (500 → 100 tokens), each done 0.5 s after it arrived (TTFT 0.1 s); with
    the autoscaler, 2 spares drawn at 30 s, serving at 60 s, one drained at 90 s."""
    spec = _spec(autoscaled)
    reqs = []
    for k in range(240):
        r = SimRequest(k, k * 0.5, 500, 100, 100)
        r.first_token, r.finish = r.arrival + 0.1, r.arrival + 0.5
        reqs.append(r)
    timeline = []
    engines = 1
    if autoscaled:
        rows = [  # at, target, serving, booting, draining, rule, warm_left
            (30, 3, 1, 2, 0, "queue_high", 2),
            (60, 3, 3, 0, 0, "hold", 2),
            (90, 2, 2, 0, 1, "scale_down", 2),
            (105, 2, 2, 0, 0, "hold", 3),
        ]
        timeline = [
            ScalePoint(
                at=at,
                deployment="chat",
                target=target,
                serving=serving,
                booting=booting,
                draining=draining,
                rule=rule,
                warm_left=left,
            )
            for at, target, serving, booting, draining, rule, left in rows
        ]
        engines = 3
    return RunResult(
        requests=reqs,
        engines=[("H100", Engine(spec.shape("H100"))) for _ in range(engines)],
        deployments=[spec],
        span_s=120,
        timeline=timeline,
        engine_deployments=[0] * engines,
    )


def test_chart_data_fixed_fleet() -> None:
    data = charts.chart_data(_result(False))
    assert data.bucket_s == 1 and data.window_s == 15
    assert len(data.demand.values) == 121 and set(data.demand.values) == {2.0}
    assert data.demand.t_min[0] == 0 and data.demand.t_min[-1] == 2.0
    per = capacity_rps(_spec(False), [(500, 100)])  # what `load` is a share of
    assert per > 2
    assert data.capacity.t_min == [0, 2.0] and data.capacity.values == pytest.approx([per, per])
    assert data.target is None and data.spares == [] and data.booting is None
    [(name, lat, ttft)] = data.p95
    assert name == "chat" and len(lat.values) == 120
    assert set(lat.values) == {0.5} and ttft.values == [pytest.approx(0.1)] * 120
    assert data.slas == [("chat", "latency", 20), ("chat", "TTFT", 2)]


def test_chart_data_autoscaled() -> None:
    data = charts.chart_data(_result(True))
    per = capacity_rps(_spec(True), [(500, 100)])
    minutes = [0, 0.5, 1.0, 1.5, 1.75, 2.0]
    assert data.capacity.t_min == minutes
    assert data.capacity.values == pytest.approx([per * n for n in (1, 1, 3, 2, 2, 2)])
    assert data.target is not None
    assert data.target.values == pytest.approx([per * n for n in (1, 3, 3, 2, 2, 2)])
    [(spares, size)] = data.spares
    assert size == 4 and spares.t_min == [0.5, 1.0, 1.5, 1.75] and spares.values == [2, 2, 2, 1]
    assert data.booting is not None and data.booting.values == [0, 2, 0, 0, 0, 0]
    assert data.draining is not None and data.draining.values == [0, 0, 0, 1, 0, 0]


def test_render_writes_a_png(tmp_path: Path) -> None:
    for autoscaled in (False, True):
        path = tmp_path / f"run-{autoscaled}.png"
        assert charts.render(_result(autoscaled), path, title="test") == path
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 20_000


def test_a_real_run_two_deployments() -> None:
    dep = {
        "replicas": {"H100": 1},
        "max_batch_size": 16,
        "sla": {"latency_s": 20, "ttft_s": 2},
        "arrivals": {"rate": {"rps": 2}, "duration_s": 60, "sizes": {"prompt": 500, "output": 50}},
    }
    sc = Scenario.model_validate(
        {
            "name": "two",
            "deployments": [dep | {"name": "a"}, dep | {"name": "b", "replicas": {"H200": 2}}],
        }
    )
    result, _ = run(sc)
    assert result.engine_deployments == [0, 1, 1]
    data = charts.chart_data(result)
    assert [name for name, _, _ in data.p95] == ["a", "b"]
    # demand sums both deployments: every request counted once
    total = sum(data.demand.values[:-1]) * data.bucket_s
    assert total == pytest.approx(len(result.requests))
    a = charts.replica_rps(result.deployments[0], ["H100"], [(500, 50)])
    b = charts.replica_rps(result.deployments[1], ["H200"] * 2, [(500, 50)])
    assert data.capacity.values == [pytest.approx(a + 2 * b)] * 2


def test_cli_charts(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        yaml.safe_dump(
            {
                "name": "tiny",
                "deployments": [
                    {
                        "name": "chat",
                        "replicas": {"H100": 1},
                        "max_batch_size": 16,
                        "arrivals": {
                            "rate": {"rps": 2},
                            "duration_s": 30,
                            "sizes": {"prompt": 200, "output": 20},
                        },
                    }
                ],
            }
        )
    )
    runner = CliRunner()
    out = tmp_path / "charts" / "new"
    args = ["simulate", str(scenario), "--charts", str(out)]
    result = runner.invoke(cli.app, [*args, "--compare", "round_robin,least_pending/static"])
    assert result.exit_code == 0, result.output
    paths = [out / "tiny-round_robin.png", out / "tiny-least_pending-static.png"]
    for p in paths:
        assert f"chart: {p}" in result.stdout and p.read_bytes().startswith(PNG)
    result = runner.invoke(cli.app, args[:2])  # no --charts: no chart
    assert result.exit_code == 0 and "chart:" not in result.stdout
    bad = runner.invoke(cli.app, ["simulate", str(scenario), "--charts", str(scenario)])
    assert bad.exit_code == 1
    assert bad.stderr.strip().splitlines() == [f"error: --charts {scenario}: not a directory"]
