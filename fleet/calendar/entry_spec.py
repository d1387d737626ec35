"""A calendar entry as an operator (or a scenario) writes it, and its checks: both cron
expressions parse in its time zone, the start fires again, its minimum fits the deployment.

Pure (pydantic and the cron dialect): the API's create and the simulator's scenarios check an
entry with the same code (fleet/calendar/entries.py, fleet/sim/calendar.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.calendar.cron import CronError, parse
from fleet.calendar.plan import Spec
from fleet.errors import FleetError
from fleet.validation import MAX_REPLICAS, Int, OptInt, exactly_one_of


class ScheduleEntryCreate(BaseModel):
    """A calendar entry as an operator writes it: from each firing of `cron` (in `timezone`)
    until `end_cron`'s next firing or for `duration_s`, at least `min_replicas`."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra=exactly_one_of("end_cron", "duration_s")
    )

    deployment: str = Field(max_length=63)
    cron: str = Field(min_length=1, max_length=200)
    timezone: str = Field(default="UTC", min_length=1, max_length=64)
    min_replicas: Int = Field(ge=1, le=MAX_REPLICAS)
    end_cron: str | None = Field(default=None, min_length=1, max_length=200)
    duration_s: OptInt = Field(default=None, gt=0, le=366 * 24 * 3600)
    note: str = Field(default="", max_length=500)

    @model_validator(mode="after")
    def _one_end(self) -> ScheduleEntryCreate:
        if (self.end_cron is None) == (self.duration_s is None):
            raise ValueError("give exactly one end: end_cron (a cron expression) or duration_s")
        return self


def checked_spec(spec: ScheduleEntryCreate) -> Spec:
    """The entry's schedule, or FleetError (400) saying which expression is wrong and how."""
    try:
        start = parse(spec.cron, spec.timezone)
        end = parse(spec.end_cron, spec.timezone) if spec.end_cron else None
    except CronError as exc:
        raise FleetError(str(exc)) from None
    checked = Spec(start, end, float(spec.duration_s) if spec.duration_s else None)
    if start.next_after(datetime.now(UTC)) is None:
        raise FleetError(f"cron {spec.cron!r} never fires again")
    return checked


def check_fits(spec: ScheduleEntryCreate, max_replicas: int) -> None:
    """FleetError (400) when the entry's minimum is above its deployment's maximum."""
    if spec.min_replicas > max_replicas:
        raise FleetError(
            f"min_replicas {spec.min_replicas} is above deployment {spec.deployment!r}'s "
            f"max_replicas {max_replicas}: raise its max_replicas first"
        )
