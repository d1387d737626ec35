"""The calendar's pure logic: windows, when an entry fires, its lead time and its floor.

An entry opens a window at each firing T of its start expression (the scheduled minute) until
its end (the end expression's next firing after T, or T + a duration). While a window is open
the entry's minimum is a floor under the autoscaler's target for its deployment.

Bare metal needs 10–20 minutes from power-on to serving (docs/hardware.md), so a window *fires* one
lead time early: the slowest expected boot-to-ready of the spares placement would boot for it
(the p90 for each one's GPU model and cache state: a spare holding the version serves sooner),
or, where placement cannot place them all now, of the GPU models it may boot (`lead_time`: a
configured default for a model never measured). The service ticks every `tick_s`; an entry
fires at the first tick at or after T − lead − tick, so its boots start in
[T − lead − tick, T − lead) and its capacity serves by T.

The service and the simulator call these same functions; nothing here reads a clock or a
database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from fleet.calendar.cron import Cron, zone

# A catch-up after an outage looks back this far at most for an end-expression entry (whose
# window length is not known before it opens): a week and a day covers weekly windows.
END_CRON_LOOKBACK_S = 8 * 24 * 3600.0
MAX_SCAN = 10_000  # cron firings stepped over in one search, at most (every loop is bounded)
# After an outage, windows that began up to this long ago are caught up (fired if still open,
# else reported missed); older ones are left alone.
CATCH_UP_S = 8 * 24 * 3600.0


@dataclass(frozen=True)
class Spec:
    start: Cron
    end: Cron | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if (self.end is None) == (self.duration_s is None):
            raise ValueError("an entry ends either by an end expression or after a duration")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("the duration must be positive")

    def window_end(self, start: datetime) -> datetime:
        if self.duration_s is not None:
            return start + timedelta(seconds=self.duration_s)
        assert self.end is not None
        end = self.end.next_after(start)
        # An end expression that never fires again leaves the window open "for ever": a
        # century is as long as any operator will wait.
        return end if end is not None else start + timedelta(days=36500)

    @property
    def lookback_s(self) -> float:
        return self.duration_s if self.duration_s is not None else END_CRON_LOOKBACK_S


@dataclass(frozen=True)
class Window:
    start: datetime  # T: the capacity serves from here (UTC)
    end: datetime
    fire_at: datetime  # T − lead: the boots start here

    def local(self, timezone: str) -> tuple[datetime, datetime, datetime]:
        tz = zone(timezone)
        return self.start.astimezone(tz), self.end.astimezone(tz), self.fire_at.astimezone(tz)


@dataclass(frozen=True)
class Due:
    window: Window
    action: Literal["fire", "missed"]  # missed: the window closed before anyone could fire it
    late_s: float  # how far past its fire time this tick is (0: on time)


def windows(spec: Spec, after: datetime, lead_s: float, count: int) -> list[Window]:
    """The next `count` windows whose start is after `after` (a preview)."""
    out: list[Window] = []
    at = after
    for _ in range(min(count, MAX_SCAN)):
        start = spec.start.next_after(at)
        if start is None:
            break
        out.append(Window(start, spec.window_end(start), start - timedelta(seconds=lead_s)))
        at = start
    return out


def due(
    spec: Spec,
    handled: datetime | None,
    now: datetime,
    lead_s: float,
    tick_s: float,
    *,
    since: datetime | None = None,
) -> Due | None:
    """The window to act on at this tick, if any: the latest one with start T after `handled`
    (the last window this entry fired or missed) whose fire time is within a tick of `now`
    (now ≥ T − lead − tick). Earlier unhandled windows are overtaken by it.

    An entry never handled searches from `since` (its creation) less one window length, so
    that a window open when it was made is found; windows that began more than CATCH_UP_S
    (plus a window length) ago are neither fired nor reported."""
    horizon = now + timedelta(seconds=lead_s + tick_s)
    reach = timedelta(seconds=spec.lookback_s + lead_s + tick_s)
    begin = handled if handled is not None else (since or now) - reach
    at = max(begin, now - reach - timedelta(seconds=CATCH_UP_S))
    latest: datetime | None = None
    for _ in range(MAX_SCAN):
        start = spec.start.next_after(at)
        if start is None or start > horizon:
            break
        latest = at = start
    if latest is None:
        return None
    window = Window(latest, spec.window_end(latest), latest - timedelta(seconds=lead_s))
    if window.end <= now:
        return Due(window, "missed", (now - window.fire_at).total_seconds())
    return Due(window, "fire", max(0.0, (now - window.fire_at).total_seconds()))


@dataclass(frozen=True)
class Lead:
    seconds: float
    basis: str  # what it was measured on, for the decision's reason


def lead_time(models: list[str], measured: dict[str, tuple[float, int]], default_s: float) -> Lead:
    """The lead for spares of `models`: the slowest model's p90 boot-to-ready, so that the
    capacity serves by T whichever of them placement picks; `default_s` for a model never
    measured."""
    if not models:
        return Lead(default_s, "no spare to boot: default")
    worst: tuple[float, str] = (-1.0, "")
    for model in sorted(set(models)):
        if model in measured:
            seconds, n = measured[model]
            basis = f"{model}, {n} boot{'s' if n != 1 else ''} measured"
        else:
            seconds, basis = default_s, f"{model} never measured: default"
        if seconds > worst[0]:
            worst = (seconds, basis)
    return Lead(worst[0], worst[1])


def slowest(leads: Sequence[Lead]) -> Lead | None:
    """The longest of the leads (the capacity serves by T only once the slowest boot has), the
    earlier one on a tie; None when there are none."""
    worst: Lead | None = None
    for lead in leads:
        if worst is None or lead.seconds > worst.seconds:
            worst = lead
    return worst


def boot_models(allowed: Sequence[str], warm_models: Iterable[str]) -> list[str]:
    """The GPU models of the spares a deployment could boot now: those of the warm spares it
    allows (every model when `allowed` is empty), or its allowed models when none is warm."""
    models = [m for m in warm_models if not allowed or m in allowed]
    return sorted(set(models or allowed))


def floor_servers(min_replicas: int, replicas_per_server: int) -> int:
    return math.ceil(min_replicas / max(1, replicas_per_server)) if min_replicas > 0 else 0


def open_until(window: Window, active_until: datetime | None, now: datetime) -> datetime:
    """An entry's open-window end once `window` fires at `now`: an earlier window of it that
    is still open keeps its later end."""
    still_open = active_until if active_until is not None and active_until > now else None
    return max(window.end, still_open) if still_open else window.end


def raised_target(target: int, floor: int, highest: int, *, pinned: bool) -> int:
    """The target after a firing: raised to the floor at once, never lowered, never above
    `highest` (the deployment's max servers); an operator's pin keeps it as it is."""
    return target if pinned else max(target, min(floor, highest))


def minutes(seconds: float) -> str:
    """17 min, 45 s, 1 h 5 min: a duration as an operator reads it."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    total = round(seconds / 60)
    hours, mins = divmod(total, 60)
    if hours:
        return f"{hours} h {mins} min" if mins else f"{hours} h"
    return f"{mins} min"
