"""fleet/sim/week.py: the fluid model's tick arithmetic, the demand it builds from the Azure
trace, and issue 27's acceptance run — the bundled week-predictive scenario (1,000 GPUs, a
week scored after three of history, ~15-min boots), predictive + reactive against reactive
alone and a fleet sized for the peak (~60 s)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fleet.data import scenario_path
from fleet.sim import scenario as sim
from fleet.sim import week

SCENARIO = scenario_path("week-predictive")


def small(**kw: object) -> week.WeekScenario:
    base: dict[str, object] = {
        "kind": "week",
        "gpus": 80,
        "days": 1,
        "history_days": 0,
        "sla": {"latency_s": 20, "ttft_s": 2},
        "autoscale": {"min_replicas": 1, "max_replicas": 10, "boot_s": 900},
        "calibration": {"engines": 1, "duration_s": 120},
    }
    base.update(kw)
    return week.WeekScenario.model_validate(base)


def test_the_bundled_week_is_a_week_scenario_and_others_are_not() -> None:
    loaded = week.load(SCENARIO)
    assert loaded is not None and loaded.servers == 125 and loaded.gpus == 1000
    assert week.load(scenario_path("spike-autoscale")) is None


def test_a_bad_week_scenario_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("kind: week\ngpus: 4\ntp_size: 8\nsla: {latency_s: 20}\n")
    with pytest.raises(sim.ScenarioError, match="sla needs latency_s and ttft_s"):
        week.load(path)
    path.write_text("kind: week\ngpus: 4\nsla: {latency_s: 20, ttft_s: 2}\nbogus: 1\n")
    with pytest.raises(sim.ScenarioError, match="bogus"):
        week.load(path)


def test_the_demand_is_the_traces_bursts_on_the_cycle() -> None:
    sc = small(days=7)
    pattern = week.hour_pattern("conv", 15.0)
    assert sum(pattern) / len(pattern) == pytest.approx(1.0)
    assert 1.3 < max(pattern) < 2.5  # the conversation trace's real bursts, per 15 s
    demand = week.build_demand(sc, capacity_rps=10.0, seed=0)
    assert len(demand.rates) == 7 * 86_400 // 15
    # The busiest tick loads the whole fleet (10 servers × 10 req/s) to peak_load.
    assert demand.peak_rps == pytest.approx(0.8 * 10 * 10.0)
    # Weekdays over weekends, afternoons over nights (hourly means, bursts averaged out).
    per_hour = 3600 // 15

    def hour_mean(day: int, hour: int) -> float:
        i = (day * 24 + hour) * per_hour
        return sum(demand.rates[i : i + per_hour]) / per_hour

    assert hour_mean(0, 14) > 2 * hour_mean(0, 3)
    assert hour_mean(2, 14) > hour_mean(6, 14) * 1.3
    assert week.build_demand(sc, 10.0, 0).rates == demand.rates  # same seed, same demand
    assert week.build_demand(sc, 10.0, 1).rates != demand.rates


def test_a_fleet_with_room_meets_the_sla_and_counts_every_gpu_hour() -> None:
    sc = small()
    cal = week.calibrate(sc, 0)
    assert [lv.load for lv in cal.levels] == list(week.LEVELS)
    assert all(0 <= lv.met(0.0) <= 1 for lv in cal.levels)
    assert cal.levels[0].met(1e9) == 0.0  # a wait longer than any SLA meets none
    demand = week.build_demand(sc, cal.capacity_rps, 0)
    peak = week.run(sc, "peak", cal, demand, 0)
    assert peak.gpu_hours == pytest.approx(10 * 8 * 24)  # every server, all day
    assert peak.attainment > 0.999
    assert peak.requests == pytest.approx(sum(demand.rates) * 15)


def test_nothing_serving_meets_nothing() -> None:
    sc = small(gpus=8, autoscale={"min_replicas": 1, "max_replicas": 1, "boot_s": 900})
    cal = week.calibrate(sc, 0)
    demand = week.Demand(15.0, [5.0] * 40, 0, 1.0)
    out = week.run(sc, "reactive", cal, demand, 0)
    # It starts with one server (min_replicas): everything is served, nothing boots.
    assert out.attainment > 0.99 and out.booting_gpu_hours == 0
    overload = week.Demand(15.0, [cal.capacity_rps * 3] * 40, 0, 1.0)
    jammed = week.run(sc, "reactive", cal, overload, 0)
    assert jammed.attainment < 0.5 and jammed.wait_p99_s > 60
    assert not math.isnan(jammed.wait_p99_s)


def test_an_unknown_variant_is_refused() -> None:
    sc = small()
    with pytest.raises(sim.ScenarioError, match="unknown variant 'psychic'"):
        week.compare(sc, ["predictive", "psychic"], 0)


def test_the_week_acceptance_predictive_beats_reactive_within_the_budget() -> None:
    """Issue 27: SLA attainment ≥ 99.5 % with at most 60 % of the peak-sized fleet's
    GPU-hours, and strictly better than reactive alone at no more than 5 % extra GPU-hours."""
    loaded = week.load(SCENARIO)
    assert loaded is not None
    _, _, (predictive, reactive, peak) = week.compare(loaded, ["predictive", "reactive", "peak"])
    assert predictive.attainment >= 0.995
    assert predictive.gpu_hours <= 0.60 * peak.gpu_hours
    assert predictive.attainment > reactive.attainment
    assert predictive.gpu_hours <= 1.05 * reactive.gpu_hours
    assert predictive.forecast_ticks > 0  # the forecast did act
    assert peak.attainment >= predictive.attainment


def test_fleetctl_simulate_runs_a_week_scenario_and_refuses_charts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fleet import cli

    path = tmp_path / "week.yaml"
    path.write_text(
        "kind: week\nname: tiny\ngpus: 80\ndays: 1\nhistory_days: 0\n"
        "sla: {latency_s: 20, ttft_s: 2}\n"
        "autoscale: {min_replicas: 1, max_replicas: 10, boot_s: 900}\n"
        "calibration: {engines: 1, duration_s: 120}\n"
    )
    runner = CliRunner()
    shown = runner.invoke(cli.app, ["simulate", str(path), "--compare", "reactive,peak"])
    assert shown.exit_code == 0, shown.output
    assert "tiny: 10 servers of 8 × H100 (80 GPUs)" in shown.output
    assert "| reactive |" in shown.output and "| peak | 100.00% |" in shown.output
    refused = runner.invoke(cli.app, ["simulate", str(path), "--charts", str(tmp_path / "c")])
    assert refused.exit_code != 0 and "--charts" in refused.output
    bad = runner.invoke(cli.app, ["simulate", str(path), "--compare", "psychic"])
    assert bad.exit_code != 0 and "unknown variant 'psychic'" in bad.output
