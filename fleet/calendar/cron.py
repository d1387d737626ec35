"""Cron expressions in an IANA time zone, on APScheduler's cron arithmetic (DST included).

Accepted: the standard five fields (minute hour day-of-month month day-of-week), an optional
leading seconds field (six fields, as in robfig/cron and Quartz), and the @hourly, @daily,
@weekly, @monthly and @yearly macros. Day-of-week follows cron, not APScheduler: 0 and 7 are
Sunday, so "1-5" is Monday to Friday. (APScheduler 3's own day-of-week numbers start at Monday:
its `from_crontab` reads "1-5" as Tuesday to Saturday. We translate the field to day names.)
As in cron, when both day-of-month and day-of-week are restricted a day matching either fires.

Across DST, as vixie cron does: a firing in a spring-forward gap (02:30 on the night clocks jump
from 02:00 to 03:00) happens right after the jump, at 03:30; a fixed-hour firing in a repeated
hour (autumn) happens once, at its first occurrence. Wildcard-hour expressions ("*/15 * * * *")
keep firing through the repeated hour.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger

MACROS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # cron's numbering: 0 = Sunday
_FIELDS5 = ("minute", "hour", "day", "month", "day_of_week")


class CronError(ValueError):
    """An expression or time zone that cannot be scheduled; the message says what to fix."""


@dataclass(frozen=True)
class Cron:
    expression: str
    timezone: str
    trigger: BaseTrigger
    fixed_hour: bool  # the hour field is not "*": a repeated local hour fires once

    def next_after(self, at: datetime) -> datetime | None:
        """The first firing strictly after `at`, in UTC (None: it never fires again)."""
        tz = ZoneInfo(self.timezone)
        for _ in range(4):  # at most one repeated hour to step over
            # APScheduler: the first firing at or after `now` (rounded up to a second).
            nxt: datetime | None = self.trigger.get_next_fire_time(
                None, at + timedelta(microseconds=1)
            )
            if nxt is None:
                return None
            if not (self.fixed_hour and _second_occurrence(nxt.astimezone(tz))):
                return nxt.astimezone(UTC)
            at = nxt.astimezone(UTC)  # (local + timedelta would drop the fold)
        return None


def _second_occurrence(local: datetime) -> bool:
    """A local time in a repeated hour, the second time round (APScheduler fires both)."""
    return local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()


def zone(name: str) -> ZoneInfo:
    try:
        if not name or name.startswith(("/", ".")):
            raise ValueError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CronError(
            f"unknown time zone {name!r}: use an IANA name such as Europe/Berlin or UTC"
        ) from None


def parse(expression: str, timezone: str) -> Cron:
    """A `Cron` for `expression` in `timezone`; CronError says what is wrong."""
    tz = zone(timezone)
    text = " ".join(expression.split())
    fields = MACROS.get(text.lower(), text).split(" ")
    if len(fields) == 5:
        second = "0"
    elif len(fields) == 6:
        second, fields = fields[0], fields[1:]
    else:
        raise CronError(
            f"cron {expression!r}: expected 5 fields (minute hour day month weekday), "
            "6 with a leading seconds field, or a macro such as @daily"
        )
    minute, hour, day, month, weekday = fields
    names = _weekdays(weekday, expression)

    def trigger(day: str, day_of_week: str) -> CronTrigger:
        try:
            return CronTrigger(
                second=second,
                minute=minute,
                hour=hour,
                day=day,
                month=month,
                day_of_week=day_of_week,
                timezone=tz,
            )
        except ValueError as exc:
            raise CronError(f"cron {expression!r}: {exc}") from None

    if day not in ("*", "?") and weekday not in ("*", "?"):
        # Cron's rule: either restricted field matching is enough.
        combined: BaseTrigger = OrTrigger([trigger(day, "*"), trigger("*", names)])
    else:
        combined = trigger("*" if day == "?" else day, names)
    return Cron(text, timezone, combined, fixed_hour=hour != "*")


def _weekdays(field: str, expression: str) -> str:
    """Cron's day-of-week field as APScheduler day names ("1-5" → "mon,tue,wed,thu,fri")."""
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for part in field.lower().split(","):
        body, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if step < 1:
                raise ValueError
            if body == "*":
                first, last = 0, 6
            elif "-" in body:
                low, high = body.split("-", 1)
                first, last = _day(low), _day(high)
            else:
                first = _day(body)
                last = 6 if step_text else first
        except ValueError:
            raise CronError(
                f"cron {expression!r}: day-of-week {part!r} is not a day (0–7 with 0 and 7 "
                "Sunday, or sun–sat), a range, a list or a step"
            ) from None
        if last < first:
            if last == 0 and first > 0:  # "5-0": Friday to Sunday
                last = 7
            else:
                raise CronError(f"cron {expression!r}: day-of-week range {part!r} runs backwards")
        days.update(d % 7 for d in range(first, last + 1, step))
    if len(days) == 7:
        return "*"
    return ",".join(DAY_NAMES[d] for d in sorted(days))


def _day(text: str) -> int:
    if text in DAY_NAMES:
        return DAY_NAMES.index(text)
    number = int(text)
    if not 0 <= number <= 7:
        raise ValueError(text)
    return number
