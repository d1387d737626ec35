"""Drawn power, budget modes and the cap valve in the simulator (fleet/sim/power.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.data import SCENARIOS_DIR
from fleet.sim import power as sim_power
from fleet.sim import racks as sim_racks
from fleet.sim.arrivals import Constant, FixedSizes, poisson
from fleet.sim.autoscale import AutoscaleSpec, BootTime
from fleet.sim.core import DeploymentSpec, RunResult, Simulation
from fleet.sim.engine import Engine, SimRequest
from fleet.sim.racks import RackSpec
from fleet.sim.scenario import ScenarioError, compare, load
from fleet_core import cost_model, power_model

H100 = cost_model.gpu_spec("H100")
# One H100 spare (tp 1): 1,275 W max, 237.5 W idle, 90 W standby.
MAX_W, STANDBY_W = sim_racks.SERVER_POWER["H100"]
IDLE_W = sim_racks.SERVER_IDLE_W["H100"]


def _requests(
    rps: float, duration_s: float, prompt: int = 400, output: int = 120
) -> list[SimRequest]:
    got = poisson(Constant(rps), FixedSizes(prompt, output), duration_s, 1)
    return [SimRequest(k, a.at, a.prompt, a.output, a.output) for k, a in enumerate(got)]


def _run(
    racks: list[RackSpec],
    power: sim_power.PowerSpec | None,
    requests: list[SimRequest],
    *,
    replicas: int = 6,
) -> RunResult:
    """One run on fresh copies of `requests` (a run fills in their times)."""
    requests = [SimRequest(r.rid, r.arrival, r.prompt, r.output, r.max_tokens) for r in requests]
    auto = AutoscaleSpec(
        min_replicas=replicas, max_replicas=replicas, boot=BootTime(20.0), interval_s=15.0
    )
    spec = DeploymentSpec("chat", "llama-3.1-8b", (("H100", 1),), max_batch_size=16, autoscale=auto)
    return Simulation([spec], racks=racks, seed=1, power=power).run(requests)


def test_server_draw_runs_from_idle_to_nameplate() -> None:
    lo = power_model.idle_power_w(H100)
    assert sim_power.server_w(H100, 1900, 10200, lo) == pytest.approx(1900)
    assert sim_power.server_w(H100, 1900, 10200, H100.tdp_w) == pytest.approx(10200)
    assert 1900 < sim_power.server_w(H100, 1900, 10200, 300.0) < 10200


def test_power_tracking_leaves_timings_alone_and_caps_slow_prefill() -> None:
    shape = DeploymentSpec("d", "llama-3.1-8b", (("H100", 1),), max_batch_size=16).shape("H100")

    def finishes(power: bool, limit_w: float | None) -> tuple[list[float], Engine]:
        e = Engine(shape)
        e.power = power
        e.set_limit(limit_w, 0.0)
        reqs = [SimRequest(k, 0.0, 3000, 20, 20) for k in range(8)]
        for r in reqs:
            e.add(r, 0.0)
        while e.block is not None:
            e.advance()
        return [r.finish for r in reqs], e

    plain, _ = finishes(False, None)
    tracked, e = finishes(True, None)
    assert tracked == plain  # watts are counted; time is not touched
    assert e.above_idle_j > 0 and e.throttled_s == 0
    capped, c = finishes(True, 0.5 * H100.tdp_w)
    assert max(capped) > max(plain)  # prefill-heavy work slows under a 50 % cap
    assert c.throttled_s > 0
    assert c.above_idle_j < e.above_idle_j * (max(capped) / max(plain))  # fewer watts


def test_exceedances_count_samples_above_the_budget() -> None:
    # Nothing on: the rack draws its other loads + two standbys, 1,180 W on a 1,100 W budget.
    rack = RackSpec("r", budget_w=1100.0, spares=(("H100", 2),), other_w=1000.0)
    books = sim_power.PowerBooks(
        sim_power.PowerSpec(sample_s=5.0, valve=None), [rack], sim_racks.spares([rack], 1)
    )
    for t in (0.0, 5.0, 10.0, 15.0):
        books.sample(t, {})
    figures = books.report(0.0).racks[0]
    assert figures.drawn_w == (1000 + 2 * STANDBY_W,) * 3
    assert figures.exceedances == 3
    rack = RackSpec("r", budget_w=1200.0, spares=(("H100", 2),), other_w=1000.0)
    books = sim_power.PowerBooks(
        sim_power.PowerSpec(sample_s=5.0, valve=None), [rack], sim_racks.spares([rack], 1)
    )
    for t in (0.0, 5.0):
        books.sample(t, {})
    assert books.report(0.0).exceedances == 0


def test_a_measured_rack_with_history_admits_more_servers_than_nameplate() -> None:
    # 4,000 W with five 1,275 W spares: nameplate boots two (4,000 - 5 × 90 = 3,550 W of room,
    # 1,185 W a boot). Measured: once each has 60 s of samples it commits its p99 × 1.15, far
    # under its maximum at this load, and the autoscaler's floor boots more.
    power = sim_power.PowerSpec(sample_s=5.0, window_s=300.0, min_history_s=60.0)
    requests = _requests(4.0, 600.0)
    rack = RackSpec("r", budget_w=4000.0, spares=(("H100", 5),))
    nameplate = _run([rack], power, requests).power
    measured_rack = RackSpec("r", budget_w=4000.0, spares=(("H100", 5),), budget_mode="measured")
    measured = _run([measured_rack], power, requests).power
    assert nameplate is not None and measured is not None
    assert nameplate.serving_peak == 2
    assert measured.serving_peak > nameplate.serving_peak
    assert nameplate.exceedances == measured.exceedances == 0


def test_the_valve_caps_a_hot_rack_and_lifts_the_cap_when_it_cools() -> None:
    # One server of prefill-heavy work in a rack that other loads fill to 1,000 of 2,400 W:
    # above 60 % the valve caps its GPU, below 50 % it lifts the cap again (after the burst).
    rack = RackSpec("r", budget_w=2400.0, spares=(("H100", 1),), other_w=1000.0)
    valve = sim_power.ValveSpec(interval_s=5.0, high_pct=60, low_pct=50, floor_pct=50, step_pct=10)
    requests = _requests(12.0, 300.0, prompt=3000, output=4)
    capped = _run([rack], sim_power.PowerSpec(sample_s=1.0, valve=valve), requests, replicas=2)
    free = _run([rack], sim_power.PowerSpec(sample_s=1.0, valve=None), requests, replicas=2)
    assert capped.power is not None and free.power is not None
    hot, cool = capped.power.racks[0], free.power.racks[0]
    assert cool.cap_changes == 0 and cool.throttled_gpu_s == 0
    assert hot.cap_changes >= 2  # down, and up again
    assert hot.throttled_gpu_s > 0
    assert hot.peak_w < cool.peak_w  # the cap holds the draw down


def test_scenario_racks_take_budgets_from_feeds_and_refuse_nonsense(tmp_path: Path) -> None:
    sc = load(SCENARIOS_DIR / "rack-power.yaml")
    budgets = {r.name: r.spec().budget_w for r in sc.racks}
    assert budgets["fra1-r01"] == pytest.approx(36_802.6, abs=1)  # 2 × 415 V 32 A 3φ × 0.8
    assert budgets["fra1-r02"] == pytest.approx(46_003.3, abs=1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "deployments: [{name: d, replicas: {H100: 1}, arrivals: {rate: {rps: 1}, duration_s: 9}}]\n"
        "racks: [{name: r, budget_w: 1000, budget_mode: measured}]\n"
    )
    with pytest.raises(ScenarioError, match="power"):
        load(bad)
    bad.write_text(
        "deployments: [{name: d, replicas: {H100: 1}, arrivals: {rate: {rps: 1}, duration_s: 9}}]\n"
        "power: {}\n"
        "racks: [{name: r, budget_w: 1000, budget_margin: 0.8}]\n"
    )
    with pytest.raises(ScenarioError, match="budget_margin"):
        load(bad)


def test_rack_power_scenario_small_measured_serves_more_with_no_exceedance() -> None:
    """The acceptance scenario (fleet/data/scenarios/rack-power.yaml) cut down: two of its racks,
    short boots and history, light demand. The direction, not the figures."""
    sc = load(SCENARIOS_DIR / "rack-power.yaml")
    assert sc.power is not None
    dep = sc.deployments[0]
    assert dep.autoscale is not None
    small = sc.model_copy(
        update={
            "racks": [sc.racks[0], sc.racks[1]],
            "warmup": 0.6,
            "power": sc.power.model_copy(update={"window_s": 600.0, "min_history_s": 120.0}),
            "deployments": [
                dep.model_copy(
                    update={
                        "arrivals": dep.arrivals.model_copy(
                            update={
                                "rate": dep.arrivals.rate.model_copy(update={"rps": 8.0})
                                if dep.arrivals.rate
                                else None,
                                "duration_s": 1200.0,
                            }
                        ),
                        "autoscale": dep.autoscale.model_copy(
                            update={"boot_s": 60.0, "min_replicas": 11, "max_replicas": 11}
                        ),
                    }
                )
            ],
        }
    )
    rows = dict(compare(small, ["nameplate", "measured"], seed=1))
    nameplate, measured = rows["nameplate"].power, rows["measured"].power
    assert nameplate is not None and measured is not None
    assert nameplate.serving_peak == 3 + 4  # 36.8 kW: three DGX at 10.2 kW; 46.0 kW: four
    assert measured.serving_mean >= 1.3 * nameplate.serving_mean
    assert nameplate.exceedances == measured.exceedances == 0


def test_the_chart_shows_drawn_power_per_rack(tmp_path: Path) -> None:
    from fleet.sim import charts

    rack = RackSpec("r", budget_w=4000.0, spares=(("H100", 3),))
    result = _run([rack], sim_power.PowerSpec(sample_s=5.0), _requests(2.0, 120.0), replicas=3)
    path = tmp_path / "power.png"
    assert charts.render(result, path, title="power") == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
