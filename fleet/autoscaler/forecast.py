"""Predictive scaling's forecaster: a deployment's demand history in, the capacity it will need
one boot ahead out.

Pure: plain data in and out, no I/O, no clock (time is epoch seconds the caller passes). The
service (fleet/autoscaler/service.py), the simulator (fleet/sim/week.py) and the tests call
this same code.

The model is small on purpose (a forecasting library would bring numba or a dataframe stack
for what a seasonal profile does; docs/autoscaler.md, "Predictive scaling"):

- **Seasonal profile.** Demand is requests per minute. The week is cut into `slot_s` slots
  (an hour, AWS predictive scaling's step) by day of week and time of day, in UTC. For each
  slot of each past week the minutes' `peak_q` quantile (0.9) and median are taken, then the
  median of those over the weeks: one spiky week among three moves nothing (robust to spikes),
  and the within-slot quantile covers the minute-to-minute bursts that a reactive scaler is
  always too late for. The slot is an hour, not a quarter, because a burst that comes every
  day but at another minute each week falls into another quarter-hour each week, and the
  median over the weeks then drops it; an hour's quantile keeps it (the week scenario's bursts
  land at a random minute of each hour: with 15-minute slots the week missed 2-4 times as many
  requests, for more GPU-hours; docs/sim.md, "A week at fleet scale").
  Where fewer than `min_weeks` weeks cover a slot, the same time of day over the past days
  stands in (daily seasonality); with less than `min_days` of history there is no forecast.
- **Level.** Recent demand against the profile: the median, over the last `level_window_s`,
  of actual ÷ profile median per minute, clipped to `level_clip`. A fleet that grew since the
  profile's weeks is followed; a burst of a few minutes is not.
- **Need.** The largest slot peak × level over the slots that [now, now + lead] touches:
  capacity asked for now serves from now + lead (the p90 boot-to-ready), and a server given
  back now cannot be had again before then. The autoscaler asks again every tick, so the
  slot after that is the next ticks' business.
- **Capacity.** The need is in requests; a server's share of it is what one server carries at
  the utilisation the deployment is run at, measured (`capacity_per_server`): over minutes whose
  batch slots were at least half busy, demand ÷ (servers × slot use) is what one server's full
  batch carries (Little's law), times the policy's `slot_ceiling`; the median over the busy
  minutes of the last week. A request runs longer in a fuller batch, so a half-busy minute
  overstates what a server carries at the ceiling (~84 % of its capacity instead of 75 % in
  the week scenario); taking only the busiest tenth (`busiest=0.1`) corrects it, but with the
  within-slot p90 (of 15-minute slots, then) the week cost 9.7–10.8 % more GPU-hours than
  reactive scaling for 99.8 % attainment, and with a p75 it was dominated by the median
  (docs/sim.md, "A week at fleet scale"). With too few busy minutes there is no capacity and
  no forecast.
- **Accuracy.** Each minute's point forecast (the profile's median there, read linearly
  between slot centres, × level, made `lead` ahead) is scored against what came
  (`Accuracy`): its weighted absolute percentage error over `error_window_s` above
  `max_error` switches the forecast off (the service writes an Event), at or under
  `resume_error` on again. Off, it keeps forecasting and scoring, and only stops acting.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Accuracy",
    "Forecast",
    "ForecastConfig",
    "Profile",
    "capacity_per_server",
    "fit",
    "forecast",
    "minute_of",
    "servers_for",
]

MINUTE_S = 60.0
SLOT_S = 3600.0  # ForecastConfig.slot_s's default
RESUME_ERROR = 0.25  # ForecastConfig.resume_error's default
PEAK_Q = 0.9  # ForecastConfig.peak_q's default
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    slot_s: float = SLOT_S  # profile slots: an hour (module docstring)
    weeks: int = 4  # history the profile is fitted on
    min_weeks: int = 2  # weeks covering a slot for the weekly profile; else the daily one
    min_days: float = 1.0  # less history than this: no forecast
    peak_q: float = PEAK_Q  # the within-slot quantile of minutes that capacity must cover
    level_window_s: float = 3600.0
    level_clip: tuple[float, float] = (0.5, 2.0)
    error_window_s: float = 6 * 3600.0
    min_scored_s: float = 3600.0  # an error needs this much scored history to count
    max_error: float = 0.35  # WAPE above this: off
    resume_error: float = 0.25  # WAPE at or under this: on again (RESUME_ERROR)

    def __post_init__(self) -> None:
        if not self.slot_s >= MINUTE_S or DAY_S % self.slot_s:
            raise ValueError(f"slot_s must be whole minutes dividing a day (got {self.slot_s})")
        if not 0 < self.peak_q <= 1:
            raise ValueError(f"peak_q must be in (0, 1] (got {self.peak_q})")
        if not 0 < self.resume_error <= self.max_error:
            raise ValueError("resume_error must be in (0, max_error]")
        lo, hi = self.level_clip
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"level_clip must hold 1 (got {self.level_clip})")


def minute_of(at: float) -> float:
    """The start of the minute `at` falls in."""
    return at - at % MINUTE_S


def _week_slot(at: float, slot_s: float) -> int:
    # 1970-01-01 was a Thursday: +3 days makes Monday slot 0.
    return int(((at + 3 * DAY_S) % WEEK_S) // slot_s)


def _day_slot(at: float, slot_s: float) -> int:
    return int((at % DAY_S) // slot_s)


@dataclass(frozen=True, slots=True)
class _Figure:
    median: float  # requests per minute
    peak: float  # the slot's peak_q quantile
    basis: int  # weeks (weekly) or days (daily) it stands on


@dataclass(frozen=True, slots=True)
class Profile:
    """A fitted seasonal profile: per week slot and per day slot, requests per minute."""

    config: ForecastConfig
    weekly: dict[int, _Figure]
    daily: dict[int, _Figure]
    fitted_at: float
    span_s: float  # the history it was fitted on, first minute to `fitted_at`

    def figure(self, at: float) -> tuple[_Figure, str] | None:
        c = self.config
        week = self.weekly.get(_week_slot(at, c.slot_s))
        if week is not None and week.basis >= c.min_weeks:
            return week, "weekly"
        day = self.daily.get(_day_slot(at, c.slot_s))
        if day is not None:
            return day, "daily"
        return None


def fit(minutes: Iterable[tuple[float, float]], now: float, config: ForecastConfig) -> Profile:
    """The profile of `minutes` ((minute start, requests in it)) within `config.weeks` before
    `now`. Minutes not given count as none seen (a deployment with no traffic reports zeros)."""
    c = config
    since = now - c.weeks * WEEK_S
    # (week index, week slot) and (day index, day slot) → the minutes' values. Keys are built
    # by arithmetic on whole slots (this runs over weeks of minutes).
    slot = c.slot_s
    week_slots = int(WEEK_S // slot)
    day_slots = int(DAY_S // slot)
    shift = 3 * DAY_S  # 1970-01-01 was a Thursday: Monday starts the week
    by_week: dict[tuple[int, int], list[float]] = {}
    by_day: dict[tuple[int, int], list[float]] = {}
    first = now
    for at, value in minutes:
        if not since <= at < now:
            continue
        if at < first:
            first = at
        n = int((at + shift) // slot)  # slots since the first Monday
        w = by_week.get((n // week_slots, n % week_slots))
        if w is None:
            by_week[(n // week_slots, n % week_slots)] = [value]
        else:
            w.append(value)
        m = int(at // slot)
        d = by_day.get((m // day_slots, m % day_slots))
        if d is None:
            by_day[(m // day_slots, m % day_slots)] = [value]
        else:
            d.append(value)
    return Profile(
        config=c,
        weekly=_combine(by_week, c),
        daily=_combine(by_day, c),
        fitted_at=now,
        span_s=now - first,
    )


def _combine(groups: dict[tuple[int, int], list[float]], c: ForecastConfig) -> dict[int, _Figure]:
    """Per slot: the median over periods of each period's median and peak quantile. A period
    that saw under half of the slot's minutes is left out (a gap, or the slot now running)."""
    need = 0.5 * c.slot_s / MINUTE_S
    per_slot: dict[int, list[tuple[float, float]]] = {}
    for (_, slot), values in groups.items():
        if len(values) < need:
            continue
        values.sort()
        per_slot.setdefault(slot, []).append((_median(values), _rank(values, c.peak_q)))
    out = {}
    for slot, figures in per_slot.items():
        medians = sorted(m for m, _ in figures)
        peaks = sorted(p for _, p in figures)
        out[slot] = _Figure(_median(medians), _median(peaks), len(figures))
    return out


def _rank(sorted_values: Sequence[float], q: float) -> float:
    """The value at index ⌊q·n⌋ (fleet_core.stats.quantile's rule), of a sorted non-empty list."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


@dataclass(frozen=True, slots=True)
class Forecast:
    """What the forecast says at `at`: the peak demand to be covered over the horizon."""

    at: float
    peak_rpm: float  # requests per minute, the largest slot peak × level over the horizon
    point_rpm: float  # the point forecast for the minute `lead` ahead (what Accuracy scores)
    level: float
    basis: str  # "weekly" or "daily", and on how many periods

    def describe(self, lead_s: float) -> str:
        return (
            f"{self.peak_rpm / 60:.3g} req/s at peak within {lead_s:.0f} s (boot) "
            f"({self.basis}, level {self.level:.2f})"
        )


def forecast(
    profile: Profile,
    recent: Sequence[tuple[float, float]],
    now: float,
    lead_s: float,
) -> Forecast | None:
    """The demand to be ready for (module docstring); None without enough history.

    `recent`: the last minutes ((minute start, requests)), at least `level_window_s` of them
    where there are; minutes the profile has no figure for are left out of the level."""
    c = profile.config
    if profile.span_s < c.min_days * DAY_S:
        return None
    ratios = []
    for at, value in recent:
        if not now - c.level_window_s <= at < now:
            continue
        got = profile.figure(at)
        if got is not None and got[0].median > 0:
            ratios.append(value / got[0].median)
    lo, hi = c.level_clip
    level = min(max(_median(sorted(ratios)), lo), hi) if ratios else 1.0
    peak = 0.0
    bases: set[str] = set()
    basis_n = 0
    # Every slot that [now, now + lead] touches: what a server asked for now must meet when
    # it serves, and what a server given back now could not be had again before.
    t = now - now % c.slot_s
    end = now + lead_s
    while t <= end:
        got = profile.figure(t)
        if got is not None:
            figure, kind = got
            peak = max(peak, figure.peak)
            bases.add(kind)
            basis_n = max(basis_n, figure.basis)
        t += c.slot_s
    if not bases:
        return None
    point = _median_at(profile, now + lead_s) * level
    kind = "weekly" if bases == {"weekly"} else "daily" if bases == {"daily"} else "mixed"
    unit = "weeks" if kind == "weekly" else "periods" if kind == "mixed" else "days"
    return Forecast(now, peak * level, point, level, f"{kind} on {basis_n} {unit}")


def _median_at(profile: Profile, at: float) -> float:
    """The profile's median at `at`, linear between the centres of its slots (an hour's
    median stands for its middle minute: on a ramp, the slot's ends are off by half an hour's
    change); 0.0 where the profile has no figure."""
    slot = profile.config.slot_s
    offset = at % slot - slot / 2
    here = profile.figure(at)
    there = profile.figure(at + math.copysign(slot, offset))
    if here is None:
        return 0.0
    if there is None:
        return here[0].median
    weight = abs(offset) / slot
    return (1 - weight) * here[0].median + weight * there[0].median


def servers_for(peak_rpm: float, per_server_rps: float) -> int:
    """Servers that carry `peak_rpm` at `per_server_rps` each (the load one server carries at
    the utilisation the deployment is run at)."""
    if peak_rpm <= 0:
        return 0
    return math.ceil(peak_rpm / 60.0 / per_server_rps - 1e-9)


BUSY = 0.5  # a minute whose batch slots were at least this busy measures capacity
BUSY_KEPT = 7 * 1440  # the busy minutes a caller keeps for it (the latest week's worth)
BUSIEST = 1.0  # the share of them, by slot use, the figure is taken from (all: see below)


def capacity_per_server(
    samples: Iterable[tuple[float, int, float | None]],
    ceiling: float,
    *,
    busy: float = BUSY,
    busiest: float = BUSIEST,
    min_samples: int = 10,
) -> float | None:
    """Requests per second one server carries at `ceiling` of its batch slots, from `samples`
    ((requests in a minute, servers serving, slot use)) with slot use ≥ `busy`: the median of
    demand ÷ (servers × slot use) × ceiling over the `busiest` share of them by slot use. A
    request runs longer in a fuller batch, so the figure from a half-busy minute overstates
    what a server carries at the ceiling; the busiest minutes extrapolate least. None with
    fewer than `min_samples` busy minutes."""
    rows = sorted(
        (use, rpm / 60.0 / (servers * use))
        for rpm, servers, use in samples
        if use is not None and use >= busy and servers > 0 and rpm > 0
    )
    if len(rows) < min_samples:
        return None
    top = rows[-max(min_samples, math.ceil(busiest * len(rows))) :]
    return _median(sorted(rate for _, rate in top)) * ceiling


@dataclass
class Accuracy:
    """Scores each minute's point forecast against what came, and says whether the forecast
    may act (module docstring). In memory, like the autoscaler's signal windows."""

    config: ForecastConfig
    on: bool = True
    pending: dict[float, float] = field(default_factory=dict)  # minute → point forecast
    scored: deque[tuple[float, float, float]] = field(default_factory=deque)  # minute, f, actual

    def predict(self, minute: float, point_rpm: float) -> None:
        """Keep the point forecast for `minute` (the first made `lead` ahead wins)."""
        self.pending.setdefault(minute, point_rpm)

    def observe(self, minute: float, actual_rpm: float) -> None:
        predicted = self.pending.pop(minute, None)
        if predicted is not None:
            self.scored.append((minute, predicted, actual_rpm))
        horizon = minute - self.config.error_window_s
        while self.scored and self.scored[0][0] < horizon:
            self.scored.popleft()
        for stale in [m for m in self.pending if m < minute - self.config.error_window_s]:
            del self.pending[stale]

    def error(self) -> float | None:
        """WAPE over the window: Σ|forecast − actual| ÷ Σ actual; None when too little is
        scored, or nothing came (a forecast of zero for zero is not an error)."""
        if not self.scored:
            return None
        span = self.scored[-1][0] - self.scored[0][0] + MINUTE_S
        if span < self.config.min_scored_s:
            return None
        actual = sum(a for _, _, a in self.scored)
        miss = sum(abs(f - a) for _, f, a in self.scored)
        if actual <= 0:
            return 0.0 if miss == 0 else math.inf
        return miss / actual

    def update(self) -> str | None:
        """Switch on or off by the error; returns "off" or "on" when it switched."""
        error = self.error()
        if error is None:
            return None
        if self.on and error > self.config.max_error:
            self.on = False
            return "off"
        if not self.on and error <= self.config.resume_error:
            self.on = True
            return "on"
        return None
