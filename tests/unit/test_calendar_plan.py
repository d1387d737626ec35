"""The calendar's pure parts: cron in a time zone (fleet/calendar/cron.py) and when an entry
fires, for how long, how early and with what floor (fleet/calendar/plan.py).

The issue's pins: a Monday–Friday 09:00 entry in Europe/Berlin serves at 09:00 local on each
side of both 2027 DST changes. The firing rule is checked with a stepped clock: for an entry at
T with a p90 boot of P, a leader ticking every `tick` seconds starts the boots in
[T − P − tick, T − P], at whatever phase its ticks fall.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.calendar.cron import CronError, parse
from fleet.calendar.plan import Spec, due, floor_servers, lead_time, minutes, windows
from fleet.provisioning.boot_times import BootQuantile, by_model

BERLIN = "Europe/Berlin"


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


def firings(expression: str, tz: str, after: datetime, count: int) -> list[datetime]:
    cron = parse(expression, tz)
    out: list[datetime] = []
    for _ in range(count):
        nxt = cron.next_after(after)
        assert nxt is not None
        out.append(nxt)
        after = nxt
    return out


# ---------------------------------------------------------------------------------------------
# Cron


def test_weekdays_at_nine_in_berlin_across_both_dst_changes() -> None:
    spring = firings("0 9 * * 1-5", BERLIN, utc(2027, 3, 25, 12), 2)
    autumn = firings("0 9 * * 1-5", BERLIN, utc(2027, 10, 28, 12), 2)
    assert spring == [utc(2027, 3, 26, 8), utc(2027, 3, 29, 7)]  # Fri CET, Mon CEST
    assert autumn == [utc(2027, 10, 29, 7), utc(2027, 11, 1, 8)]  # Fri CEST, Mon CET
    for at in spring + autumn:
        local = at.astimezone(ZoneInfo(BERLIN))
        assert (local.hour, local.minute) == (9, 0)
        assert local.strftime("%a") in ("Fri", "Mon")


@pytest.mark.parametrize(
    ("weekday", "days"),
    [
        ("1-5", ["Mon", "Tue", "Wed", "Thu", "Fri"]),  # APScheduler's from_crontab: Tue–Sat
        ("0", ["Sun"]),
        ("7", ["Sun"]),
        ("5-7", ["Fri", "Sat", "Sun"]),
        ("5-0", ["Fri", "Sat", "Sun"]),
        ("sat,sun", ["Sat", "Sun"]),
        ("MON-wed", ["Mon", "Tue", "Wed"]),
        ("*/2", ["Sun", "Tue", "Thu", "Sat"]),
        ("1/3", ["Mon", "Thu"]),
        ("1-5/2", ["Mon", "Wed", "Fri"]),
    ],
)
def test_day_of_week_follows_cron_numbering(weekday: str, days: list[str]) -> None:
    # 2027-01-03 is a Sunday: one week of firings covers each weekday once.
    week = [
        at
        for at in firings(f"0 12 * * {weekday}", "UTC", utc(2027, 1, 3), 7)
        if at < utc(2027, 1, 10)
    ]
    assert sorted(at.strftime("%a") for at in week) == sorted(days)


def test_day_of_month_and_day_of_week_both_set_fire_on_either() -> None:
    # Cron's rule: the 13th of the month OR a Friday.
    got = firings("0 0 13 * 5", "UTC", utc(2027, 1, 1), 4)
    assert got == [utc(2027, 1, 8), utc(2027, 1, 13), utc(2027, 1, 15), utc(2027, 1, 22)]


def test_a_leading_seconds_field_and_macros() -> None:
    assert firings("*/20 * * * * *", "UTC", utc(2027, 1, 1, 0, 0, 5), 2) == [
        utc(2027, 1, 1, 0, 0, 20),
        utc(2027, 1, 1, 0, 0, 40),
    ]
    assert firings("@daily", "UTC", utc(2027, 1, 1, 0, 0, 0), 1) == [utc(2027, 1, 2)]
    assert firings("@weekly", "UTC", utc(2027, 1, 1), 1) == [utc(2027, 1, 3)]  # Sunday


def test_next_after_is_strictly_after() -> None:
    cron = parse("0 9 * * *", "UTC")
    assert cron.next_after(utc(2027, 1, 1, 9)) == utc(2027, 1, 2, 9)
    assert cron.next_after(utc(2027, 1, 1, 8, 59, 59, 999999)) == utc(2027, 1, 1, 9)


def test_a_spring_forward_gap_fires_right_after_the_jump() -> None:
    # 2027-03-28 02:30 does not exist in Berlin: clocks go from 02:00 to 03:00.
    got = firings("30 2 * * *", BERLIN, utc(2027, 3, 27, 12), 2)
    assert got == [utc(2027, 3, 28, 1, 30), utc(2027, 3, 29, 0, 30)]  # 03:30 CEST, 02:30 CEST


def test_a_repeated_hour_fires_once_for_a_fixed_hour_and_throughout_for_a_wildcard() -> None:
    # 2027-10-31 02:00–03:00 happens twice in Berlin.
    assert firings("30 2 * * *", BERLIN, utc(2027, 10, 30, 12), 2) == [
        utc(2027, 10, 31, 0, 30),
        utc(2027, 11, 1, 1, 30),
    ]
    half_hours = firings("*/30 * * * *", BERLIN, utc(2027, 10, 31, 0, 10), 4)
    assert half_hours == [
        utc(2027, 10, 31, 0, 30),
        utc(2027, 10, 31, 1, 0),
        utc(2027, 10, 31, 1, 30),  # 02:30 again, the second time round
        utc(2027, 10, 31, 2, 0),
    ]


def test_firings_just_after_midnight_survive_the_spring_forward_day() -> None:
    """APScheduler's zone-aware search skips these (agronholm/apscheduler#529); ours does not."""
    assert firings("@daily", BERLIN, utc(2027, 3, 27, 12), 3) == [
        utc(2027, 3, 27, 23),  # Sun 00:00 CET
        utc(2027, 3, 28, 22),  # Mon 00:00 CEST
        utc(2027, 3, 29, 22),
    ]
    mondays = firings("0 0 * * 1", BERLIN, utc(2027, 3, 20), 3)
    assert mondays == [utc(2027, 3, 21, 23), utc(2027, 3, 28, 22), utc(2027, 4, 4, 22)]
    # Santiago's clocks jump from 00:00 to 01:00 on 2027-09-05: that day's midnight fires at 01:00.
    santiago = firings("@daily", "America/Santiago", utc(2027, 9, 3, 12), 3)
    assert santiago == [utc(2027, 9, 4, 4), utc(2027, 9, 5, 4), utc(2027, 9, 6, 3)]


@pytest.mark.parametrize(
    "tz", [BERLIN, "America/New_York", "Australia/Lord_Howe", "America/Santiago"]
)
@pytest.mark.parametrize("expression", ["0 0 * * *", "30 2 * * *", "15 1 * * *"])
def test_a_daily_expression_fires_once_every_local_day_of_a_year(tz: str, expression: str) -> None:
    days = [
        at.astimezone(ZoneInfo(tz)).date() for at in firings(expression, tz, utc(2027, 1, 1), 365)
    ]
    assert len(set(days)) == 365 and days == sorted(days)
    assert all((b - a).days == 1 for a, b in itertools.pairwise(days))


@pytest.mark.parametrize(
    ("expression", "tz", "says"),
    [
        ("0 9 * *", "UTC", "expected 5 fields"),
        ("0 9 * * * * *", "UTC", "expected 5 fields"),
        ("0 25 * * *", "UTC", "maximum value (23)"),
        ("0 9 * * 8", "UTC", "day-of-week '8'"),
        ("0 9 * * 5-3", "UTC", "runs backwards"),
        ("0 9 * * 1/0", "UTC", "day-of-week '1/0'"),
        ("0 9 32 * *", "UTC", "maximum value (31)"),
        ("0 9 * * *", "Mars/Olympus_Mons", "unknown time zone 'Mars/Olympus_Mons'"),
        ("0 9 * * *", "../etc/passwd", "unknown time zone"),
        ("0 9 * * *", "", "unknown time zone"),
    ],
)
def test_bad_expressions_say_what_to_fix(expression: str, tz: str, says: str) -> None:
    with pytest.raises(CronError, match=None) as caught:
        parse(expression, tz)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------------
# Windows and the firing rule


def weekdays_nine_to_six() -> Spec:
    return Spec(parse("0 9 * * 1-5", BERLIN), end=parse("0 18 * * 1-5", BERLIN))


def test_windows_run_from_the_start_to_the_end_expression_or_a_duration() -> None:
    [friday, monday] = windows(weekdays_nine_to_six(), utc(2027, 3, 25, 12), 1020, 2)
    assert (friday.start, friday.end) == (utc(2027, 3, 26, 8), utc(2027, 3, 26, 17))
    assert friday.fire_at == utc(2027, 3, 26, 7, 43)  # 17 min early
    assert (monday.start, monday.end) == (utc(2027, 3, 29, 7), utc(2027, 3, 29, 16))
    start, end, fire = monday.local(BERLIN)
    assert (start.hour, end.hour, fire.strftime("%H:%M")) == (9, 18, "08:43")
    timed = Spec(parse("0 9 * * *", "UTC"), duration_s=5400)
    [one] = windows(timed, utc(2027, 1, 1), 0, 1)
    assert one.end - one.start == timedelta(minutes=90)


def test_a_spec_has_exactly_one_end() -> None:
    cron = parse("0 9 * * *", "UTC")
    with pytest.raises(ValueError, match="either"):
        Spec(cron)
    with pytest.raises(ValueError, match="either"):
        Spec(cron, end=cron, duration_s=60)
    with pytest.raises(ValueError, match="positive"):
        Spec(cron, duration_s=0)


def test_an_entry_fires_at_the_first_tick_within_one_of_its_early_start() -> None:
    spec = Spec(parse("0 9 * * *", "UTC"), duration_s=3600)
    lead, tick = 1020.0, 30.0
    t = utc(2027, 1, 4, 9)
    assert due(spec, None, t - timedelta(seconds=lead + tick + 1), lead, tick) is None
    found = due(spec, None, t - timedelta(seconds=lead + tick), lead, tick)
    assert found is not None and found.action == "fire" and found.late_s == 0
    assert found.window.start == t and found.window.fire_at == t - timedelta(seconds=lead)
    # Handled: nothing more for this window, at any later tick.
    assert due(spec, t, t - timedelta(seconds=lead), lead, tick) is None
    assert due(spec, t, t + timedelta(minutes=30), lead, tick) is None


@settings(max_examples=300, deadline=None)
@given(
    lead=st.floats(min_value=0, max_value=3 * 3600),
    tick=st.floats(min_value=0.5, max_value=120),
    phase=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_stepped_clock_starts_boots_between_t_minus_p_minus_a_tick_and_t_minus_p(
    lead: float, tick: float, phase: float
) -> None:
    """The acceptance rule, at any lead, tick length and tick phase."""
    spec = Spec(parse("0 9 * * *", "UTC"), duration_s=4 * 3600)
    t = utc(2027, 6, 1, 9)
    now = t - timedelta(seconds=lead + 5 * tick + phase * tick)
    handled: datetime | None = utc(2027, 5, 31, 9)  # yesterday's window, long closed
    fired_at = None
    for _ in range(20):
        found = due(spec, handled, now, lead, tick)
        if found is not None:
            assert found.action == "fire" and found.window.start == t
            fired_at = now
            handled = found.window.start
            break
        now += timedelta(seconds=tick)
    assert fired_at is not None
    early = (t - fired_at).total_seconds()
    assert lead <= early + 1e-6 and early <= lead + tick + 1e-6, (early, lead, tick)


def test_a_missed_firing_is_caught_up_late_while_its_window_is_open() -> None:
    spec = weekdays_nine_to_six()
    handled = utc(2027, 3, 25, 8)  # Thursday's window
    # The leader was down from Friday 07:00 UTC until 10:30 UTC (11:30 local).
    found = due(spec, handled, utc(2027, 3, 26, 10, 30), 1020, 30)
    assert found is not None and found.action == "fire"
    assert found.window.start == utc(2027, 3, 26, 8)
    assert found.late_s == pytest.approx(2.5 * 3600 + 1020)
    # Down until after 18:00 local: the window is gone, it is reported missed, not fired.
    missed = due(spec, handled, utc(2027, 3, 26, 17, 30), 1020, 30)
    assert missed is not None and missed.action == "missed"


def test_a_window_long_closed_during_an_outage_is_still_reported_missed() -> None:
    spec = Spec(parse("0 9 * * *", "UTC"), duration_s=60)
    # Handled Monday's; the leader was down from Tuesday 08:00 to Wednesday 08:00.
    found = due(spec, utc(2027, 1, 4, 9), utc(2027, 1, 6, 8), 30, 30)
    assert found is not None and found.action == "missed"
    assert found.window.start == utc(2027, 1, 5, 9)
    # Never handled: the search starts one window before the entry was made.
    made = utc(2027, 1, 4, 12)
    fresh = due(spec, None, utc(2027, 1, 6, 8), 30, 30, since=made)
    assert fresh is not None and fresh.window.start == utc(2027, 1, 5, 9)
    # Beyond the catch-up horizon nothing is said.
    assert due(spec, None, utc(2027, 3, 1, 8), 30, 30, since=made) is not None  # Feb 28's
    assert due(Spec(parse("0 9 1 1 *", "UTC"), duration_s=60), None, utc(2027, 3, 1), 0, 30) is None


def test_of_several_missed_windows_the_latest_is_acted_on() -> None:
    spec = Spec(parse("0 * * * *", "UTC"), duration_s=1800)
    found = due(spec, utc(2027, 1, 1, 0), utc(2027, 1, 1, 5, 10), 0, 30)
    assert found is not None and found.action == "fire"
    assert found.window.start == utc(2027, 1, 1, 5)


def test_a_new_entry_fires_at_once_inside_an_open_window_and_not_for_old_ones() -> None:
    spec = weekdays_nine_to_six()
    inside = due(spec, None, utc(2027, 3, 26, 12), 600, 30)  # Friday 13:00 local
    assert inside is not None and inside.action == "fire"
    assert inside.window.start == utc(2027, 3, 26, 8)
    # Saturday: Friday's window closed; the service does not report windows before the entry.
    after = due(spec, None, utc(2027, 3, 27, 12), 600, 30)
    assert after is not None and after.action == "missed"


def test_lead_is_the_slowest_candidate_model_and_the_default_before_a_measurement() -> None:
    measured = by_model([("H100", 900.0), ("H100", 960.0), ("L40S", 400.0)], BootQuantile())
    assert measured == {"H100": (960.0, 2), "L40S": (400.0, 1)}
    both = lead_time(["L40S", "H100"], measured, 1200)
    assert (both.seconds, both.basis) == (960.0, "H100, 2 boots measured")
    fresh = lead_time(["H200", "L40S"], measured, 1200)
    assert (fresh.seconds, fresh.basis) == (1200, "H200 never measured: default")
    assert lead_time([], measured, 1200).seconds == 1200


def test_the_boot_figure_is_the_nearest_rank_quantile_plus_the_margin() -> None:
    p90 = BootQuantile()
    assert p90.value([]) is None
    assert p90.value([5.0]) == 5.0
    assert p90.value(float(i) for i in range(1, 11)) == 10.0
    assert p90.value(float(i) for i in range(1, 101)) == 91.0
    assert p90.label == "p90"
    planned = BootQuantile(quantile=0.95, margin_pct=10)
    assert planned.value(float(i) for i in range(1, 101)) == 96.0 * 1.1
    assert planned.label == "p95 + 10 %"


def test_floor_and_durations_as_an_operator_reads_them() -> None:
    assert [floor_servers(n, 2) for n in (0, 1, 2, 3, 4)] == [0, 1, 1, 2, 2]
    assert floor_servers(3, 0) == 3
    assert [minutes(s) for s in (45, 1020, 3600, 3900)] == ["45 s", "17 min", "1 h", "1 h 5 min"]
