"""Cron expressions in an IANA time zone, on APScheduler's cron arithmetic (DST included).

Accepted: the standard five fields (minute hour day-of-month month day-of-week), an optional
leading seconds field (six fields, as in robfig/cron and Quartz), and the @hourly, @daily,
@weekly, @monthly and @yearly macros. Day-of-week follows cron, not APScheduler: 0 and 7 are
Sunday, so "1-5" is Monday to Friday. (APScheduler 3's own day-of-week numbers start at Monday:
its `from_crontab` reads "1-5" as Tuesday to Saturday. We translate the field to day names.)
As in cron, when both day-of-month and day-of-week are restricted a day matching either fires.

Across DST, as vixie cron does: a firing in a spring-forward gap (02:30 on the night clocks jump
from 02:00 to 03:00) happens after the jump, at 03:30 (where clocks jump at midnight, a 00:00
firing happens at 01:00); a fixed-hour firing in a repeated hour (autumn) happens once, at its
first occurrence. Wildcard-hour expressions ("*/15 * * * *") keep firing through the repeated
hour, both times round.
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
    """An expression in a zone. The cron fields match local wall-clock times; APScheduler
    finds the next matching wall time on a zone-free clock (its own zone-aware search loses
    firings near a spring-forward jump, agronholm/apscheduler#529), and `next_after` maps wall
    times to instants: a wall time in a gap fires right after the jump, one in a repeated
    hour at its first occurrence (and, for a wildcard hour, at its second too)."""

    expression: str
    timezone: str
    trigger: BaseTrigger  # over naive wall-clock times, presented to APScheduler as UTC
    fixed_hour: bool  # the hour field is not "*": a repeated local hour fires once

    def next_after(self, at: datetime) -> datetime | None:
        """The first firing strictly after `at`, in UTC (None: it never fires again)."""
        tz = ZoneInfo(self.timezone)
        best = self._from_wall(_wall(at, tz), at, tz)
        if best is not None and not self.fixed_hour:
            # Clocks going back between `at` and `best` repeat wall times the search above
            # has passed: look again from the wall time right after the change.
            back = _backward_change(at, best, tz)
            if back is not None:
                again = self._from_wall(_wall(back, tz) - _TICK, at, tz, second_pass=True)
                if again is not None and again < best:
                    best = again
        return best

    def _from_wall(
        self, wall: datetime, at: datetime, tz: ZoneInfo, *, second_pass: bool = False
    ) -> datetime | None:
        for _ in range(_MAX_STEPS):
            found = self.trigger.get_next_fire_time(None, (wall + _TICK).replace(tzinfo=UTC))
            if found is None:
                return None
            wall = found.replace(tzinfo=None)
            instants = _instants(wall, tz)
            if self.fixed_hour:
                instants = instants[:1]
            elif second_pass:
                instants = instants[-1:]
            later = [i for i in instants if i > at]
            if later:
                return later[0]
        return None


_TICK = timedelta(microseconds=1)
_MAX_STEPS = 8  # wall times to try past one already behind `at` (a repeated hour)


def _wall(at: datetime, tz: ZoneInfo) -> datetime:
    return at.astimezone(tz).replace(tzinfo=None)


def _instants(wall: datetime, tz: ZoneInfo) -> list[datetime]:
    """The instants (UTC) at which local clocks show `wall`: one, two in a repeated hour, and
    for a wall time skipped by a jump the instant it would have been had the clocks not jumped
    yet (02:30 on the spring-forward night → 03:30 new time)."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    real = sorted({u for u in (first, second) if _wall(u, tz) == wall})
    return real or [max(first, second)]


def _backward_change(start: datetime, end: datetime, tz: ZoneInfo) -> datetime | None:
    """The instant in (start, end] at which the zone's offset last decreased, if it did."""
    if (end.astimezone(tz).utcoffset() or timedelta()) >= (
        start.astimezone(tz).utcoffset() or timedelta()
    ):
        return None
    low, high = start, end  # offset(low) > offset(high): bisect to the second
    while (high - low) > timedelta(seconds=1):
        mid = low + (high - low) / 2
        if mid.astimezone(tz).utcoffset() == low.astimezone(tz).utcoffset():
            low = mid
        else:
            high = mid
    return high.replace(microsecond=0) if high.microsecond else high


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
    zone(timezone)  # validated here; next_after applies it
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
    fields_given = {"second": second, "minute": minute, "hour": hour, "day": day, "month": month}
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
                timezone=UTC,
            )
        except ValueError as exc:
            raise CronError(f"cron {expression!r}: {_culprit(fields_given)}{exc}") from None

    if day not in ("*", "?") and weekday not in ("*", "?"):
        # Cron's rule: either restricted field matching is enough.
        combined: BaseTrigger = OrTrigger([trigger(day, "*"), trigger("*", names)])
    else:
        combined = trigger("*" if day == "?" else day, names)
    return Cron(text, timezone, combined, fixed_hour=hour != "*")


def _culprit(fields: dict[str, str]) -> str:
    """Which field APScheduler rejected ("hour: "), found by trying each alone."""
    for name, value in fields.items():
        try:
            CronTrigger(**{name: value}, timezone=UTC)
        except ValueError:
            return f"{name.replace('day', 'day-of-month')} field {value!r}: "
    return ""


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
