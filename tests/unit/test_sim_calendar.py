"""Scheduled scaling in the simulator (fleet/sim/calendar.py): the production calendar's windows,
lead time and floor, driving the production autoscaler policy's "floor" rule."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fleet.calendar.plan import due, lead_time
from fleet.data import SCENARIOS_DIR
from fleet.sim.autoscale import BootTime
from fleet.sim.calendar import BOOTS_MEASURED, DEFAULT_BOOT_S, Calendar, EntryModel, entries
from fleet.sim.scenario import Scenario, ScenarioError, load, run

START = datetime(2026, 12, 7, 9, 30, tzinfo=UTC)
TICK = 30.0
T = 1800.0  # the window's start, 10:00 UTC, in simulated seconds
END = 3600.0  # 10:30


def _scenario(**calendar: Any) -> dict[str, Any]:
    entry = {"cron": "0 10 * * *", "duration_s": 1800, "min_replicas": 4, "note": "launch"}
    return {
        "name": "calendar",
        "start": "2026-12-07T09:30:00Z",
        "calendar_interval_s": TICK,
        "warm_pool": {"H100": 6},
        "deployments": [
            {
                "name": "chat",
                "replicas": {"H100": 1},
                "max_batch_size": 16,
                "sla": {"latency_s": 30, "ttft_s": 2},
                "arrivals": {
                    "rate": {"rps": 1},
                    "duration_s": 5400,
                    "sizes": {"prompt": 200, "output": 50},
                },
                "autoscale": {
                    "boot_s": 300,
                    "max_replicas": 8,
                    "down_window_s": 120,
                    "cooldown_down_s": 120,
                },
                "calendar": [entry | calendar],
            }
        ],
    }


def test_the_floor_rises_one_lead_early_serves_by_the_window_and_is_released_after() -> None:
    scenario = Scenario.model_validate(_scenario())
    assert scenario.start == START
    result, _ = run(scenario)

    # The lead is the production function's, fed the boot distribution as measured boots.
    lead = lead_time(["H100"], {"H100": (300.0, BOOTS_MEASURED)}, DEFAULT_BOOT_S)
    assert lead.seconds == 300.0
    # It fires at the first calendar tick at or after T - lead - tick (ticks from second 0).
    fire_at = math.ceil((T - lead.seconds - TICK) / TICK) * TICK
    assert T - lead.seconds - TICK <= fire_at < T - lead.seconds
    [fired] = result.fired
    assert fired.at == fire_at == 1470.0
    assert (fired.lead_s, fired.lead_basis) == (lead.seconds, lead.basis)
    assert fired.window_start == START + timedelta(seconds=T)
    assert fired.window_end == START + timedelta(seconds=END)
    assert (fired.floor, fired.target_before, fired.target_after, fired.late_s) == (4, 1, 4, 0.0)

    before = [p for p in result.timeline if p.at < fire_at]
    assert before and all(p.target == 1 and p.floor == 0 for p in before)
    [raised] = [p for p in result.timeline if p.rule == "calendar"]
    assert (raised.at, raised.target, raised.serving, raised.booting) == (fire_at, 4, 1, 3)
    # While the window is open the autoscaler's decide keeps the target at the floor.
    held = [p for p in result.timeline if fire_at <= p.at < END and p.rule != "calendar"]
    assert held and all(p.floor == 4 and p.target == 4 for p in held)
    assert {p.rule for p in held} == {"floor"}
    # Four replicas serve from before the window's start to its end.
    window = [p for p in result.timeline if T - 15 <= p.at < END]
    assert window and all(p.serving == 4 and p.booting == 0 for p in window)
    # Then the floor goes (the calendar tick at the end closes the window), and the autoscaler
    # scales down by its own rules, back to min_replicas.
    after = [p for p in result.timeline if p.at >= END]
    assert after and all(p.floor == 0 for p in after)
    downs = [p for p in after if p.rule == "scale_down"]
    assert [p.target for p in downs] == [3, 2, 1]
    assert after[-1].target == 1


def test_the_firing_is_plan_due_on_the_calendar_cadence() -> None:
    """The simulated firing is exactly the tick at which production's `due` first says fire."""
    [entry] = entries("chat", [EntryModel(cron="0 10 * * *", duration_s=1800, min_replicas=4)], 8)
    lead = lead_time(["H100"], {"H100": (300.0, BOOTS_MEASURED)}, DEFAULT_BOOT_S)
    first = next(
        k * TICK
        for k in range(1000)
        if (d := due(entry.spec, None, START + timedelta(seconds=k * TICK), lead.seconds, TICK))
        and d.action == "fire"
    )
    cal = Calendar("chat", [entry], START, TICK)
    fired_at = None
    for k in range(200):
        tick = cal.tick(k * TICK, target=1, max_servers=8, warm_models=["H100"], boot_p90_s=300)
        if tick.fired:
            assert fired_at is None  # once only
            fired_at = k * TICK
            assert (tick.floor, tick.target) == (4, 4)
        expected_floor = 4 if fired_at is not None and k * TICK < END else 0
        assert tick.floor == expected_floor, k * TICK
    assert fired_at == first == 1470.0


def test_lead_from_the_boot_distribution_and_the_default() -> None:
    cal = Calendar("chat", [], START)
    boot = BootTime(900, 120)
    lead = cal.lead(["L40S", "H100", "H100"], boot.p90_s)
    assert lead.seconds == pytest.approx(900 + 1.2815515655446004 * 120)
    assert lead == lead_time(
        ["H100", "L40S"],
        {"H100": (boot.p90_s, BOOTS_MEASURED), "L40S": (boot.p90_s, BOOTS_MEASURED)},
        DEFAULT_BOOT_S,
    )
    # No warm spare to boot: the production default (FLEET_BOOT_ESTIMATE_S).
    none = cal.lead([], boot.p90_s)
    assert (none.seconds, none.basis) == (1200.0, "no spare to boot: default")


def test_time_zone_catch_up_and_the_max_cap() -> None:
    # 11:00 in Berlin is 10:00 UTC in December; the scenario starts inside the window.
    model = EntryModel(
        cron="0 11 * * *", timezone="Europe/Berlin", end_cron="0 12 * * *", min_replicas=6
    )
    cal = Calendar("chat", entries("chat", [model], 8), START + timedelta(minutes=40), TICK)
    tick = cal.tick(0.0, target=2, max_servers=5, warm_models=["H100"], boot_p90_s=300)
    [fired] = tick.fired
    assert fired.window_start == datetime(2026, 12, 7, 10, 0, tzinfo=UTC)
    assert fired.window_end == datetime(2026, 12, 7, 11, 0, tzinfo=UTC)
    assert fired.late_s == 600 + 300  # fired at 10:10, due at 09:55
    assert (tick.floor, tick.target) == (6, 5)  # the floor, capped at max servers
    again = cal.tick(30.0, target=5, max_servers=5, warm_models=["H100"], boot_p90_s=300)
    assert (again.floor, again.target, again.fired) == (6, 5, ())


@pytest.mark.parametrize(
    ("entry", "where", "message"),
    [
        ({"cron": "0 9 * * 8"}, "deployments.0", "calendar[0]: cron '0 9 * * 8': day-of-week"),
        ({"timezone": "Mars/Olympus"}, "deployments.0", "unknown time zone 'Mars/Olympus'"),
        ({"cron": "0 9 30 2 *"}, "deployments.0", "cron '0 9 30 2 *' never fires again"),
        (
            {"min_replicas": 9},
            "deployments.0",
            "calendar[0]: min_replicas 9 is above deployment 'chat''s max_replicas 8",
        ),
        ({"duration_s": 0}, "deployments.0.calendar.0.duration_s", "greater than 0"),
        ({"min_replicas": 0}, "deployments.0.calendar.0.min_replicas", "greater than or equal"),
        ({"end_cron": "0 11 * * *"}, "deployments.0.calendar.0", "give exactly one end"),
        ({"cronn": "0 9 * * *"}, "deployments.0.calendar.0.cronn", "Extra inputs"),
        ({"deployment": "other"}, "deployments.0", "calendar[0]: deployment 'other'"),
    ],
)
def test_bad_calendar_input_names_the_field(
    tmp_path: Path, entry: dict[str, Any], where: str, message: str
) -> None:
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_scenario(**entry)))
    with pytest.raises(ScenarioError) as info:
        load(path)
    text = str(info.value)
    assert f"  {where}: " in text and message in text, text


def test_calendar_needs_autoscale() -> None:
    data = _scenario()
    del data["deployments"][0]["autoscale"]
    with pytest.raises(ValueError, match="calendar needs autoscale"):
        Scenario.model_validate(data)


def test_start_defaults_and_without_an_offset_is_utc() -> None:
    data = _scenario()
    del data["start"]
    assert Scenario.model_validate(data).start == datetime(2026, 12, 7, tzinfo=UTC)
    data["start"] = "2026-12-07T11:00:00+01:00"
    assert Scenario.model_validate(data).start == datetime(2026, 12, 7, 10, tzinfo=UTC)
    data["start"] = "2026-12-07T10:00:00"
    assert Scenario.model_validate(data).start == datetime(2026, 12, 7, 10, tzinfo=UTC)


def test_the_launch_scenario_file() -> None:
    scenario = load(SCENARIOS_DIR / "launch-calendar.yaml")
    result, summary = run(scenario)
    [fired] = result.fired
    lead = lead_time(["H100"], {"H100": (BootTime(900, 120).p90_s, BOOTS_MEASURED)}, 1200.0)
    assert fired.lead_s == lead.seconds
    assert fired.window_start == datetime(2026, 12, 7, 10, tzinfo=UTC)  # 11:00 in Berlin
    start_s = (fired.window_start - scenario.start).total_seconds()
    tick = scenario.calendar_interval_s
    assert fired.at == math.ceil((start_s - lead.seconds - tick) / tick) * tick
    assert summary.sla_attainment is not None and summary.sla_attainment > 0.95
