"""fleet.autoscaler.forecast (the seasonal profile, level, need, capacity and the accuracy
switch) and the policy's forecast rule (fleet/autoscaler/policy.py: the larger of the reactive
answer and the forecast's servers). Plain data, no clock."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fleet.autoscaler import DeploymentState, PolicyConfig, Signals, decide
from fleet.autoscaler import forecast as fc

MONDAY = 1_796_601_600.0  # 2026-12-07 00:00 UTC, a Monday
DAY = 86_400.0
WEEK = 7 * DAY
CFG = fc.ForecastConfig()


def demand(at: float) -> float:
    """Requests per minute: a daily cosine (peak 14:00 UTC, trough 30 %) × weekends lower."""
    hour = (at % DAY) / 3600
    weekday = int(((at // DAY) + 3) % 7)
    daily = 0.3 + 0.7 * (1 + math.cos(2 * math.pi * (hour - 14) / 24)) / 2
    return 600.0 * daily * (1.0 if weekday < 5 else 0.7)


def minutes(start: float, end: float, f=demand) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    return [(t, f(t)) for t in _range(start, end)]


def _range(start: float, end: float) -> list[float]:
    n = int((end - start) // 60)
    return [start + 60.0 * i for i in range(n)]


def touched(now: float, lead_s: float) -> tuple[float, float]:
    """The span of the profile's slots that [now, now + lead_s] touches."""
    slot = CFG.slot_s
    end = now + lead_s
    return now - now % slot, end - end % slot + slot


def test_monday_is_a_monday() -> None:
    assert int(((MONDAY // DAY) + 3) % 7) == 0 and MONDAY % DAY == 0


def test_the_weekly_profile_forecasts_the_peak_one_boot_ahead() -> None:
    now = MONDAY + 3 * WEEK + 6 * 3600  # Monday 06:00 after three weeks
    history = minutes(MONDAY, now)
    profile = fc.fit(history, now, CFG)
    got = fc.forecast(profile, history[-60:], now, lead_s=900.0)
    assert got is not None
    assert got.basis == "weekly on 3 weeks"
    # The largest minute of the slots [06:00, 06:15] touches (the rising side of the cosine)
    # and their p90: the forecast covers the end of the horizon, not the minute now.
    window = [demand(t) for t in _range(*touched(now, 900.0))]
    assert max(window) * 0.97 <= got.peak_rpm <= max(window) * 1.01
    assert got.level == pytest.approx(1.0, abs=0.01)
    assert got.point_rpm == pytest.approx(demand(now + 900), rel=0.03)


def test_one_spiky_week_moves_nothing() -> None:
    now = MONDAY + 3 * WEEK + 6 * 3600
    spike_start = MONDAY + WEEK + 6 * 3600  # week 2, the same Monday morning: ×5

    def spiky(t: float) -> float:
        return demand(t) * (5.0 if spike_start <= t < spike_start + 3600 else 1.0)

    clean = fc.forecast(fc.fit(minutes(MONDAY, now), now, CFG), minutes(now - 3600, now), now, 900)
    history = minutes(MONDAY, now, spiky)
    got = fc.forecast(fc.fit(history, now, CFG), history[-60:], now, 900)
    assert clean is not None and got is not None
    assert got.peak_rpm == pytest.approx(clean.peak_rpm, rel=0.02)


def test_with_days_but_not_weeks_the_daily_profile_stands_in() -> None:
    now = MONDAY + 3 * DAY + 10 * 3600  # Thursday 10:00 after three days
    history = minutes(MONDAY, now)
    got = fc.forecast(fc.fit(history, now, CFG), history[-60:], now, 900)
    assert got is not None and got.basis == "daily on 3 days"
    window = [demand(t) for t in _range(*touched(now, 900.0))]
    assert got.peak_rpm == pytest.approx(max(window), rel=0.03)


def test_less_than_a_day_of_history_is_no_forecast() -> None:
    now = MONDAY + 20 * 3600
    history = minutes(MONDAY, now)
    assert fc.forecast(fc.fit(history, now, CFG), history[-60:], now, 900) is None


def test_the_level_follows_recent_demand_and_is_clipped() -> None:
    now = MONDAY + 3 * WEEK + 12 * 3600
    profile = fc.fit(minutes(MONDAY, now), now, CFG)
    base = fc.forecast(profile, minutes(now - 3600, now), now, 900)
    grown = fc.forecast(profile, minutes(now - 3600, now, lambda t: 1.5 * demand(t)), now, 900)
    wild = fc.forecast(profile, minutes(now - 3600, now, lambda t: 10 * demand(t)), now, 900)
    assert base is not None and grown is not None and wild is not None
    assert grown.level == pytest.approx(1.5, rel=0.01)
    assert grown.peak_rpm == pytest.approx(1.5 * base.peak_rpm, rel=0.02)
    assert wild.level == CFG.level_clip[1]


def test_a_few_minutes_of_burst_do_not_move_the_level() -> None:
    now = MONDAY + 3 * WEEK + 12 * 3600
    profile = fc.fit(minutes(MONDAY, now), now, CFG)
    burst = minutes(now - 3600, now, lambda t: demand(t) * (4.0 if t >= now - 600 else 1.0))
    got = fc.forecast(profile, burst, now, 900)
    assert got is not None and got.level == pytest.approx(1.0, abs=0.02)


def test_servers_for_rounds_up() -> None:
    assert fc.servers_for(0.0, 5.0) == 0
    assert fc.servers_for(600.0, 5.0) == 2  # 10 req/s at 5 each
    assert fc.servers_for(601.0, 5.0) == 3


def test_capacity_is_measured_on_busy_minutes_only() -> None:
    busy = [(600.0, 2, 0.5)] * 10  # 10 req/s on 2 servers half busy: 10 req/s a full server
    idle = [(60.0, 2, 0.01)] * 50  # a near-idle minute says little of a full batch
    assert fc.capacity_per_server(busy + idle, 0.75) == pytest.approx(7.5)
    assert fc.capacity_per_server(busy[:9] + idle, 0.75) is None
    assert fc.capacity_per_server([(600.0, 0, 0.9)] * 20, 0.75) is None  # no servers
    assert fc.capacity_per_server([(600.0, 2, None)] * 20, 0.75) is None  # no batch size


def test_a_forecast_that_keeps_missing_switches_off_and_back_on() -> None:
    acc = fc.Accuracy(CFG)
    t = MONDAY
    switches = []
    # Two hours exact, then four hours at twice the demand, then exact again.
    for i in range(24 * 60):
        actual = 100.0
        wrong = 120 <= i < 360
        acc.predict(t, 2 * actual if wrong else actual)
        acc.observe(t, actual)
        got = acc.update()
        if got is not None:
            switches.append((i, got))
        t += 60
    assert [s for _, s in switches] == ["off", "on"]
    off_at, on_at = switches[0][0], switches[1][0]
    # Off once the wrong minutes are over 35 % of the scored ones, each missed by 100 %:
    # k ÷ (120 + k) > 0.35 at k = 65, the minute 184.
    assert off_at == 184
    # And it is back at 25 % once the 4 wrong hours are mostly out of the 6-hour window.
    assert 360 + 60 <= on_at <= 360 + 6 * 60
    assert not math.isnan(acc.error() or 0.0)


def test_nothing_scored_is_no_error() -> None:
    acc = fc.Accuracy(CFG)
    acc.predict(MONDAY, 10.0)
    acc.observe(MONDAY, 10.0)
    assert acc.error() is None and acc.update() is None and acc.on


def test_a_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="slot_s"):
        fc.ForecastConfig(slot_s=7 * 60)
    with pytest.raises(ValueError, match="resume_error"):
        fc.ForecastConfig(max_error=0.2, resume_error=0.3)


# ---------------------------------------------------------------------------------------------
# the policy's forecast rule

NOW = 1_800_000_000.0


def _state(**kw: object) -> DeploymentState:
    base: dict[str, object] = {
        "name": "llama",
        "sla_p95_s": 2.0,
        "sla_ttft_s": 0.5,
        "gpus_per_server": 8,
        "min_servers": 1,
        "max_servers": 20,
        "target": 4,
        "serving": 4,
    }
    base.update(kw)
    return DeploymentState(**base)  # type: ignore[arg-type]


def _quiet(span: float = 900.0) -> list[Signals]:
    """Every signal under its low water for `span`: the reactive rules want one fewer."""
    n = int(span // 10)
    return [Signals(NOW - span + 10 * i, 2.0, 0.2, 0.5, 0.1, 32, 0.2) for i in range(n + 1)]


def _mid(span: float = 900.0) -> list[Signals]:
    n = int(span // 10)
    return [Signals(NOW - span + 10 * i, 7.0, 0.6, 1.2, 0.3, 32, 0.5) for i in range(n + 1)]


def test_the_forecast_raises_the_target_ahead_of_demand() -> None:
    d = decide(replace(_state(), forecast_servers=7, forecast_basis="b"), _mid(), NOW)
    assert (d.target, d.rule) == (7, "forecast")
    assert d.inputs["won"] == "forecast" and d.inputs["reactive_target"] == 4
    assert d.inputs["reactive_rule"] == "hold" and d.inputs["forecast_servers"] == 7
    assert "forecast wants 7 servers: b" in d.reason


def test_the_forecast_holds_a_scale_in_it_would_want_back() -> None:
    reactive = decide(_state(), _quiet(), NOW)
    assert (reactive.target, reactive.rule) == (3, "scale_down")
    d = decide(replace(_state(), forecast_servers=4, forecast_basis="b"), _quiet(), NOW)
    assert (d.target, d.rule, d.delta) == (4, "forecast", 0)
    assert "forecast holds 4 servers" in d.reason


def test_a_forecast_under_the_reactive_answer_changes_nothing() -> None:
    plain = decide(_state(), _quiet(), NOW)
    d = decide(replace(_state(), forecast_servers=2, forecast_basis="b"), _quiet(), NOW)
    assert (d.target, d.rule, d.reason) == (plain.target, plain.rule, plain.reason)
    assert d.inputs["won"] == "reactive"


def test_the_forecast_stays_within_the_bounds_and_a_pin_ignores_it() -> None:
    d = decide(replace(_state(), forecast_servers=50, forecast_basis="b"), _mid(), NOW)
    assert (d.target, d.rule) == (20, "max")
    pinned = decide(_state(pinned=2, forecast_servers=9, forecast_basis="b"), _mid(), NOW)
    assert (pinned.target, pinned.rule) == (2, "pinned")
    assert "forecast_servers" not in pinned.inputs


def test_the_forecast_may_start_a_deployment_at_zero() -> None:
    zero = _state(target=0, serving=0, min_servers=0)
    d = decide(replace(zero, forecast_servers=2, forecast_basis="b"), [], NOW, PolicyConfig())
    assert (d.target, d.rule) == (2, "forecast")
