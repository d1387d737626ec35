"""Demand history and the forecasts made from it: the autoscaler's I/O edge for predictive
scaling (the model itself is pure: fleet/autoscaler/forecast.py).

- **Counting.** Routers report, per deployment, counters of the requests that arrived (refused
  ones included) and their tokens since they started (`RouterReport.arrived`). Each tick the
  leader takes the differences since the last tick (a counter that went down is a restarted
  router: all of it is new) and adds them to the deployment's current minute. A router first
  seen only sets its baseline: a new leader cannot tell a router's old count from new demand,
  so up to one report interval of it is not counted.
- **History.** When a minute ends it is written into the deployment's `DemandHour` row (one
  row per hour, 60 packed values per series): requests, tokens, and the servers serving and
  their batch-slot use as the tick saw them. A minute no router reported in is NaN (not seen),
  which the profile leaves out; a minute the routers reported nothing for is 0. Rows older
  than `FLEET_DEMAND_HISTORY_DAYS` are deleted once an hour. Only the leader writes.
- **Forecasts.** Per deployment, a `Predictor` fits the profile from the rows every
  `FLEET_FORECAST_REFIT_S` (so a new leader starts with the fleet's history, not an empty
  one), scores its forecasts as minutes end, and says how many servers the forecast needs,
  or why none (`state`: learning, off, or no capacity measured yet).
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.autoscaler import forecast as fc
from fleet.models import DemandHour, RouterReport

__all__ = ["DemandBook", "Forecasts", "Predictor", "pack", "unpack"]

MINUTES = 60
_PACK = struct.Struct(f"<{MINUTES}f")
NAN = float("nan")


def pack(values: list[float]) -> bytes:
    return _PACK.pack(*values)


def unpack(data: bytes) -> list[float]:
    if len(data) != _PACK.size:
        return [NAN] * MINUTES  # written by another release: not seen
    return list(_PACK.unpack(data))


@dataclass
class _Minute:
    at: float  # the minute's start (epoch)
    requests: float = 0.0
    tokens: float = 0.0
    seen: bool = False  # some router reported the deployment in it
    servers: int = 0
    slot_use: float | None = None
    p95_s: float | None = None
    ttft_p95_s: float | None = None


@dataclass(frozen=True)
class Closed:
    deployment: str
    at: float
    requests: float  # NaN: not seen
    tokens: float
    servers: int
    slot_use: float | None
    p95_s: float | None = None
    ttft_p95_s: float | None = None


@dataclass
class DemandBook:
    """The routers' last counters and each deployment's minute being counted (the leader's
    memory; module docstring)."""

    last: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    minutes: dict[str, _Minute] = field(default_factory=dict)
    counted_at: float = -math.inf
    max_gap_s: float = 120.0  # longer between ticks (leadership lost and back): new baselines

    def count(self, rows: Iterable[RouterReport], at: float) -> dict[str, tuple[float, float]]:
        """Per deployment reported in `rows`: requests and tokens since the last tick. After
        a gap the counters only set baselines: what came in it has no minute to go to."""
        if at - self.counted_at > self.max_gap_s:
            self.last.clear()
        self.counted_at = at
        out: dict[str, tuple[float, float]] = {}
        for row in rows:
            if row.arrived is None:
                continue
            key = (row.router, row.deployment)
            now = (row.arrived, row.arrived_tokens or 0)
            before = self.last.get(key)
            self.last[key] = now
            seen = out.get(row.deployment, (0.0, 0.0))
            if before is None:
                out[row.deployment] = seen  # a baseline: the deployment is reported, 0 new
                continue
            requests = now[0] - before[0] if now[0] >= before[0] else now[0]
            tokens = now[1] - before[1] if now[1] >= before[1] else now[1]
            out[row.deployment] = (seen[0] + requests, seen[1] + tokens)
        return out

    def add(
        self,
        deployment: str,
        at: float,
        counted: tuple[float, float] | None,
        servers: int,
        slot_use: float | None,
        p95_s: float | None = None,
        ttft_p95_s: float | None = None,
    ) -> Closed | None:
        """Add a tick's counts (None: no router reports the deployment) to its minute, with
        what the tick saw (the minute keeps its last tick's); the minute that ended, if one
        did."""
        minute = fc.minute_of(at)
        current = self.minutes.get(deployment)
        closed = None
        if current is None or current.at != minute:
            if current is not None:
                closed = Closed(
                    deployment,
                    current.at,
                    current.requests if current.seen else NAN,
                    current.tokens if current.seen else NAN,
                    current.servers,
                    current.slot_use,
                    current.p95_s,
                    current.ttft_p95_s,
                )
            current = self.minutes[deployment] = _Minute(minute)
        if counted is not None:
            current.seen = True
            current.requests += counted[0]
            current.tokens += counted[1]
        current.servers, current.slot_use = servers, slot_use
        current.p95_s, current.ttft_p95_s = p95_s, ttft_p95_s
        return closed


def write(session: Session, closed: Closed) -> None:
    """Put a minute into its hour's row (the leader is the only writer)."""
    at = datetime.fromtimestamp(closed.at, tz=UTC)
    hour = at.replace(minute=0, second=0, microsecond=0)
    row = session.exec(
        select(DemandHour).where(
            DemandHour.deployment == closed.deployment, DemandHour.hour == hour
        )
    ).first()
    empty = pack([NAN] * MINUTES)
    if row is None:
        row = DemandHour(
            deployment=closed.deployment,
            hour=hour,
            requests=empty,
            tokens=empty,
            servers=empty,
            slot_use=empty,
            p95_s=empty,
            ttft_p95_s=empty,
        )
    i = at.minute
    for name, value in (
        ("requests", closed.requests),
        ("tokens", closed.tokens),
        ("servers", float(closed.servers)),
        ("slot_use", NAN if closed.slot_use is None else closed.slot_use),
        ("p95_s", NAN if closed.p95_s is None else closed.p95_s),
        ("ttft_p95_s", NAN if closed.ttft_p95_s is None else closed.ttft_p95_s),
    ):
        values = unpack(getattr(row, name))
        values[i] = value
        setattr(row, name, pack(values))
    session.add(row)


def prune(session: Session, before: datetime) -> None:
    session.execute(sa.delete(DemandHour).where(col(DemandHour.hour) < before))


def _minutes(
    session: Session, deployment: str, since: datetime, a: str, b: str, c: str
) -> list[tuple[float, float, float, float]]:
    """The deployment's minutes since `since`, in order: (minute, series a, b, c), each a
    `DemandHour` column; NaN where not seen."""
    rows = session.exec(
        select(DemandHour)
        .where(DemandHour.deployment == deployment, DemandHour.hour >= since)
        .order_by(col(DemandHour.hour))
    )
    out = []
    for row in rows:
        start = row.hour.timestamp()
        series = zip(
            unpack(getattr(row, a)), unpack(getattr(row, b)), unpack(getattr(row, c)), strict=True
        )
        for i, (x, y, z) in enumerate(series):
            out.append((start + 60.0 * i, x, y, z))
    return out


def read(
    session: Session, deployment: str, since: datetime
) -> list[tuple[float, float, float, float]]:
    """(minute, requests, servers, slot use) since `since`: what the forecast learns from."""
    return _minutes(session, deployment, since, "requests", "servers", "slot_use")


def read_recent(
    session: Session, deployment: str, since: datetime
) -> list[tuple[float, float, float, float]]:
    """(minute, requests, p95, TTFT p95) since `since`: the console's deployment charts."""
    return _minutes(session, deployment, since, "requests", "p95_s", "ttft_p95_s")


@dataclass
class Predictor:
    """One deployment's forecast state (module docstring)."""

    config: fc.ForecastConfig
    profile: fc.Profile | None = None
    fitted_at: float = -math.inf
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=60))
    # Busy minutes ((requests, servers, slot use), slot use ≥ fc.BUSY), the newest kept: what
    # the capacity per server is measured on, again at each fit.
    samples: deque[tuple[float, int, float | None]] = field(
        default_factory=lambda: deque(maxlen=fc.BUSY_KEPT)
    )
    capacity: float | None = None  # req/s a server carries at the slot ceiling
    accuracy: fc.Accuracy | None = None
    last: fc.Forecast | None = None

    def fit(
        self, minutes: list[tuple[float, float, float, float]], now: float, ceiling: float
    ) -> None:
        """Fit the profile and measure the capacity on `minutes` (demand.read's rows)."""
        seen = [(at, r) for at, r, _, _ in minutes if not math.isnan(r)]
        self.profile = fc.fit(seen, now, self.config)
        self.fitted_at = now
        self.recent.clear()
        self.recent.extend(seen[-60:])
        self.samples.clear()
        for _, r, s, u in minutes:
            if not math.isnan(r) and not math.isnan(s) and not math.isnan(u) and u >= fc.BUSY:
                self.samples.append((r, int(s), u))
        self.capacity = fc.capacity_per_server(self.samples, ceiling)
        if self.accuracy is None:
            self.accuracy = fc.Accuracy(self.config)

    def observe(self, closed: Closed) -> str | None:
        """A minute ended: learn it and score the forecast made for it; "off"/"on" when the
        forecast switched."""
        if math.isnan(closed.requests):
            return None
        self.recent.append((closed.at, closed.requests))
        if closed.slot_use is not None and closed.slot_use >= fc.BUSY:
            self.samples.append((closed.requests, closed.servers, closed.slot_use))
        if self.accuracy is None:
            return None
        self.accuracy.observe(closed.at, closed.requests)
        return self.accuracy.update()

    def need(self, now: float, lead_s: float, ceiling: float) -> tuple[int | None, str, str]:
        """`ceiling`: the slot ceiling the capacity was measured at, for the basis."""
        """(servers the forecast needs or None, its basis, its state for `explain`)."""
        if self.profile is None:
            return None, "", "learning: no history read yet"
        seen = fc.forecast(self.profile, list(self.recent), now, lead_s)
        self.last = seen
        if seen is None:
            have = self.profile.span_s / 86_400.0
            return (
                None,
                "",
                (f"learning: {have:.2g} days of demand history (needs {self.config.min_days:g})"),
            )
        assert self.accuracy is not None
        self.accuracy.predict(fc.minute_of(now + lead_s), seen.point_rpm)
        error = self.accuracy.error()
        scored = "not scored yet" if error is None else f"error {error:.0%} over 6 h"
        if not self.accuracy.on:
            return (
                None,
                "",
                (
                    f"off: {scored} (above {self.config.max_error:.0%}; back on at "
                    f"{self.config.resume_error:.0%} or less)"
                ),
            )
        per_server = self.capacity
        if per_server is None:
            return (
                None,
                "",
                ("no capacity measured yet: needs 10 minutes with the batch slots half busy"),
            )
        servers = fc.servers_for(seen.peak_rpm, per_server)
        basis = (
            f"{seen.describe(lead_s)} at {per_server:.3g} req/s per server "
            f"(measured, at {ceiling:.0%} of its batch slots)"
        )
        return servers, basis, f"on: {scored}"


@dataclass
class Forecasts:
    """The leader's demand book and one predictor per deployment."""

    config: fc.ForecastConfig
    book: DemandBook = field(default_factory=DemandBook)
    predictors: dict[str, Predictor] = field(default_factory=dict)
    pruned_at: float = -math.inf
    # Fitting reads weeks of rows (~0.1 s a deployment: bench/forecast.py): a tick fits while
    # it has spent less than this on fits, and leaves the rest for the next ticks, so that a
    # new leader with 100 deployments does not stall one tick for ten seconds.
    fit_budget_s: float = 1.0
    fit_spent_s: float = 0.0

    def start_tick(self) -> None:
        self.fit_spent_s = 0.0

    def may_fit(self) -> bool:
        return self.fit_spent_s < self.fit_budget_s

    @classmethod
    def new(cls, max_error: float = 0.35) -> Forecasts:
        resume = min(fc.RESUME_ERROR, max_error)
        return cls(fc.ForecastConfig(max_error=max_error, resume_error=resume))

    def predictor(self, deployment: str) -> Predictor:
        got = self.predictors.get(deployment)
        if got is None:
            got = self.predictors[deployment] = Predictor(self.config)
        return got

    def history_since(self, now: float) -> datetime:
        return datetime.fromtimestamp(now, tz=UTC) - timedelta(weeks=self.config.weeks)
