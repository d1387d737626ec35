"""Scheduled scaling in the simulator: the production calendar (fleet/calendar/), imported.

A scenario has a wall-clock origin (`start`, default `DEFAULT_START`): simulated second t is
`start + t`. An autoscaled deployment may have `calendar:` entries with the API's fields and
checks: each is a `ScheduleEntryCreate` (`EntryModel`, the deployment it sits under filled
in), and `entries` checks it with fleet/calendar/entries.py's own `checked_spec` and `check_fits`,
so an error reads as the API's 400 would.

`Calendar.tick` is the leader's `calendar_once` (fleet/calendar/service.py) for one
deployment, on plain data, every `tick_s` of simulated time (default: the
`calendar_interval_s` setting, 30 s), from t = 0:

1. an entry whose open window has ended is closed (`active_until` cleared);
2. the lead is `plan.lead_time` over the GPU models it could boot now (`plan.boot_models`: the
   warm spares' models that fit the model; none warm: the default), and `plan.due` says
   which window to act on; acting claims it (`fired_for`, and `plan.open_until` for the
   open window's end), so a window fires once. The entries exist from `start` (`since`): a
   window already open at `start` fires at the first tick, late;
3. the floor is the largest `plan.floor_servers` of the open windows (one replica per server
   in the simulator), and a firing raises the target at once (`plan.raised_target`, capped
   at max_replicas; rule "calendar" in the timeline).

The autoscaler's ticks then pass the floor to `decide` (`DeploymentState.floor`), which keeps
the target at or above it (rule "floor") until the window ends, after which it scales down by
its own rules.

**The measured boots.** Production's lead is the slowest candidate model's p90 over the boots
the fleet has measured. In the simulator every candidate model counts as measured at the
deployment's boot distribution's p90 (`BootTime.p90_s`: the mean plus 1.2816 sd; the fixed
time for fixed boots) over `BOOTS_MEASURED` boots, as a fleet with a history of such boots
would have it. So with boots of a fixed 300 s the lead is 300 s ("H100, 100 boots measured"),
and a window at T fires at the first calendar tick at or after T − 300 − 30 s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pydantic import Field

from fleet.calendar.entry_spec import ScheduleEntryCreate, check_fits, checked_spec
from fleet.calendar.plan import (
    Lead,
    Spec,
    boot_models,
    due,
    floor_servers,
    lead_time,
    open_until,
    raised_target,
)
from fleet.errors import FleetError
from fleet.settings import Settings

DEFAULT_START = datetime(2026, 12, 7, tzinfo=UTC)  # a Monday, 00:00 UTC
TICK_S = float(Settings.model_fields["calendar_interval_s"].default)
DEFAULT_BOOT_S = float(Settings.model_fields["boot_estimate_s"].default)  # never measured
BOOTS_MEASURED = 100  # the boots each candidate model counts as measured over


class EntryModel(ScheduleEntryCreate):
    """A calendar entry as a scenario writes it under a deployment: ScheduleEntryCreate's
    fields and checks (cron, timezone, min_replicas, end_cron or duration_s, note);
    `deployment` may be left out (it is the one the entry sits under)."""

    deployment: str = Field(default="", max_length=63)


@dataclass(frozen=True)
class Entry:
    """A checked entry: its schedule (`plan.Spec`) and its minimum."""

    cron: str
    timezone: str
    min_replicas: int
    spec: Spec
    note: str = ""


def entries(deployment: str, models: Iterable[EntryModel], max_replicas: int) -> tuple[Entry, ...]:
    """Each entry checked as the API's create checks it; ValueError says which entry and what
    is wrong, in the API's words."""
    out: list[Entry] = []
    for i, model in enumerate(models):
        where = f"calendar[{i}]"
        if model.deployment not in ("", deployment):
            raise ValueError(
                f"{where}: deployment {model.deployment!r}: an entry scales the deployment it "
                f"is under ({deployment!r}); leave deployment out"
            )
        create = ScheduleEntryCreate.model_validate(model.model_dump() | {"deployment": deployment})
        try:
            spec = checked_spec(create)
            check_fits(create, max_replicas)
        except FleetError as exc:
            raise ValueError(f"{where}: {exc}") from None
        out.append(Entry(create.cron, create.timezone, create.min_replicas, spec, create.note))
    return tuple(out)


@dataclass(frozen=True)
class Fired:
    """A window fired: when (simulated seconds), for which window, with which lead."""

    at: float
    deployment: str
    entry: int  # its index in the deployment's calendar
    window_start: datetime
    window_end: datetime
    lead_s: float
    lead_basis: str
    late_s: float
    floor: int  # servers (= replicas here)
    target_before: int
    target_after: int


@dataclass(frozen=True)
class Tick:
    floor: int
    target: int
    fired: tuple[Fired, ...] = ()


@dataclass
class _Row:
    """The columns of a schedule_entry row that the leader writes."""

    fired_for: datetime | None = None
    active_until: datetime | None = None


@dataclass
class Calendar:
    """One deployment's entries and their state; `tick` is one `calendar_once` for it."""

    deployment: str
    entries: Sequence[Entry]
    start: datetime = DEFAULT_START
    tick_s: float = TICK_S
    rows: list[_Row] = field(default_factory=list, init=False)  # per entry, in order

    def __post_init__(self) -> None:
        self.rows = [_Row() for _ in self.entries]

    def clock(self, t: float) -> datetime:
        """Simulated second `t` as a UTC time."""
        return self.start + timedelta(seconds=t)

    def lead(self, warm_models: Sequence[str], boot_p90_s: float) -> Lead:
        """`plan.lead_time` over the models it could boot now, each measured at the boot
        distribution's p90 (module docstring)."""
        models = boot_models((), warm_models)
        measured = {m: (boot_p90_s, BOOTS_MEASURED) for m in models}
        return lead_time(models, measured, DEFAULT_BOOT_S)

    def tick(
        self,
        t: float,
        *,
        target: int,
        max_servers: int,
        warm_models: Sequence[str],
        boot_p90_s: float,
        replicas_per_server: int = 1,
    ) -> Tick:
        at = self.clock(t)
        lead = self.lead(warm_models, boot_p90_s)
        claimed: list[tuple[int, datetime, datetime, float]] = []
        for i, (entry, row) in enumerate(zip(self.entries, self.rows, strict=True)):
            if row.active_until is not None and row.active_until <= at:
                row.active_until = None  # the window ended: its floor no longer holds
            found = due(entry.spec, row.fired_for, at, lead.seconds, self.tick_s, since=self.start)
            if found is None or (row.fired_for is not None and row.fired_for >= found.window.start):
                continue  # nothing due, or already handled (the claim's condition)
            row.fired_for = found.window.start
            if found.action == "fire":
                row.active_until = open_until(found.window, row.active_until, at)
                claimed.append((i, found.window.start, found.window.end, found.late_s))
        floor = max(
            (
                floor_servers(e.min_replicas, replicas_per_server)
                for e, row in zip(self.entries, self.rows, strict=True)
                if row.active_until is not None and row.active_until > at
            ),
            default=0,
        )
        if not claimed:
            return Tick(floor, target)
        after = raised_target(target, floor, max_servers, pinned=False)
        fired = tuple(
            Fired(
                t,
                self.deployment,
                i,
                start,
                end,
                lead.seconds,
                lead.basis,
                late,
                floor,
                target,
                after,
            )
            for i, start, end, late in claimed
        )
        return Tick(floor, after, fired)
