"""Measured draw: readings into Server.drawn_* and into the bounded history (docs/power.md).

Two sources. The BMC: the reconciler (fleet/power/reconciler.py) reads each powered server's
power sensor in the same job as its power state and hands the sweep's readings to the `Meter`
(one per service process, in the leader). The agent: where a powered server's BMC gives no
reading, each heartbeat (fleet/registry/agent_reports.py) stores Σ its GPUs' power plus the
server's non-GPU idle baseline, labelled "estimate" (`estimate_w`); it never replaces a fresh
BMC reading.

A reading that `fleet.power.readings.check_watts` refuses (negative, far above the server's
maximum, not a number) is never believed: it changes nothing and is recorded as an Event, at
most once an hour per server so that a broken BMC does not flood the log.

Write rate at 10,000 servers (reconcile every 60 s, buckets of 300 s): `drawn_w` is rewritten
when it moved 2 % or more, or else every other sweep (`needs_write`, `rewrite_after_s`), so
that its `drawn_at` stays inside the freshness the rack view and the cap valve count on
(fleet/power/racks.FRESH_INTERVALS sweeps): between 83 rows/s (a steady fleet) and 167 rows/s
(every draw moving), one batched UPDATE per sweep, beside the 2,000 rows/s the heartbeats
(every 5 s) already write to the same table. The history adds one row per server and per rack
per bucket: 10,000/300 + racks/300 (2,500 racks: 42 rows/s).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.models import Event, GpuModelSpec, Rack, Server
from fleet.power import history

# One freshness rule for readings (re-exported: the agent routes name it here).
from fleet.power.racks import drawn_fresh_s as drawn_fresh_s
from fleet.power.readings import check_watts
from fleet.power.series import SERVER, Reading, Series, rack_readings
from fleet.settings import Settings
from fleet_core.gpus import gpu_spec

log = logging.getLogger(__name__)

ACTOR = "reconciler"
BMC = "bmc"
ESTIMATE = "estimate"
REFUSED_KIND = "server.power_reading_refused"
REFUSED_EVERY_S = 3_600.0  # one refused-reading Event per server per hour at most
MOVE_FRACTION = 0.02  # drawn_w is rewritten when it moves this much (or is rewrite_after_s old)

_SERVER = Server.__table__  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Pure rules


def rewrite_after_s(settings: Settings) -> float:
    """An unmoved reading is rewritten once the stored one is this old: at the second sweep
    after the last write (sweeps are a reconcile interval apart, give or take their own
    length), never later than a bucket; well inside `drawn_fresh_s`."""
    return min(settings.power_bucket_s, 1.5 * settings.reconcile_interval_s)


def needs_write(
    old_w: float | None,
    old_source: str | None,
    old_at: datetime | None,
    new_w: float,
    new_source: str,
    now: datetime,
    max_age_s: float,
) -> bool:
    """Whether a new reading must be written to Server.drawn_*: a first reading, a new source,
    a move of MOVE_FRACTION or more (and of a watt at least), or a stored one `max_age_s` old
    (so that its age still says whether the source is alive)."""
    if old_w is None or old_at is None or old_source != new_source:
        return True
    if now - old_at >= timedelta(seconds=max_age_s):
        return True
    return abs(new_w - old_w) >= max(MOVE_FRACTION * abs(old_w), 1.0)  # a watt at least


def estimate_w(
    gpu_watts: Sequence[float | None],
    *,
    gpu_count: int,
    gpu_idle_w: float,
    server_idle_w: float,
) -> float | None:
    """The agent-based estimate of a server's draw: its GPUs' reported power (a GPU that
    reports none counted at its idle) plus the server's idle draw minus its GPUs' idle (the
    CPUs, fans, NICs; floored at 0). None when no GPU reports power: nothing was measured."""
    reported = [w for w in gpu_watts if w is not None]
    if not reported:
        return None
    missing = max(0, gpu_count - len(reported))
    baseline = max(0.0, server_idle_w - gpu_count * gpu_idle_w)
    return sum(reported) + missing * gpu_idle_w + baseline


def refused_message(server: str, why: str) -> str:
    """`why` is check_watts's reason: it names the watts."""
    return f"{server}: BMC power reading ignored, never believed: {why}"


# ---------------------------------------------------------------------------------------------
# The database side


@dataclass(frozen=True, slots=True)
class BmcReading:
    """One server's BMC at one sweep: on or not, and its power sensor (None: no reading, or
    not asked because the server is off)."""

    server_id: int
    server: str
    max_w: float
    on: bool
    watts: float | None


@dataclass(frozen=True, slots=True)
class MeterReport:
    written: int  # Server rows whose drawn_* changed
    refused: int
    buckets: int  # history rows written
    pruned: int


def gpu_idle_w(session: Session, model: str) -> float | None:
    """A GPU model's idle draw: the built-in table's mid-range figure, or an inventory-added
    model's (GpuModelSpec); None for a model in neither."""
    try:
        return gpu_spec(model).idle_mid_w
    except ValueError:
        pass
    spec = session.exec(select(GpuModelSpec).where(GpuModelSpec.name == model)).first()
    return None if spec is None else spec.idle_w


def record_estimate(
    session: Session,
    server: Server,
    gpu_watts: Sequence[float | None],
    now: datetime,
    fresh_s: float,
) -> bool:
    """Store the agent-based estimate on `server` (the caller commits) unless its BMC gave a
    reading within `fresh_s`; whether it was stored."""
    if (
        server.drawn_source == BMC
        and server.drawn_at is not None
        and now - server.drawn_at < timedelta(seconds=fresh_s)
    ):
        return False
    idle = gpu_idle_w(session, server.gpu_model)
    if idle is None:
        return False
    watts = estimate_w(
        gpu_watts, gpu_count=server.gpu_count, gpu_idle_w=idle, server_idle_w=server.idle_w
    )
    if watts is None or check_watts(watts, max_w=server.max_w) is not None:
        return False
    server.drawn_w, server.drawn_source, server.drawn_at = watts, ESTIMATE, now
    return True


class Meter:
    """The leader's measured-draw writer: one bucket accumulator per service process, fed at
    every reconciler sweep. Buckets still open when the process stops are lost (at most one
    bucket's worth); a successor merges what it writes into the same rows."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.series = Series(settings.power_bucket_s)
        self._pruned_at: datetime | None = None
        self._lock = threading.Lock()  # one sweep at a time (a test may share a meter)

    def record(self, engine: Engine, readings: Sequence[BmcReading], now: datetime) -> MeterReport:
        with self._lock, Session(engine) as session:
            refused = self._refuse(session, readings, now)
            believed = [r for r in readings if r.server_id not in refused]
            stored = _stored(session)
            updates = plan_writes(stored, believed, now, rewrite_after_s(self.settings))
            _write_drawn(session, updates)
            sweep = sweep_readings(stored, believed, now, drawn_fresh_s(self.settings))
            closed = self.series.add_all(sweep)
            closed += self.series.close_until(now)
            buckets = history.write_buckets(session, closed)
            pruned = 0
            every = timedelta(seconds=self.settings.power_bucket_s)
            if self._pruned_at is None or now - self._pruned_at >= every:
                pruned = history.prune(session, now, self.settings)
                self._pruned_at = now
            session.commit()
        report = MeterReport(len(updates), len(refused), buckets, pruned)
        log.debug("measured draw: %s", report)
        return report

    def _refuse(self, session: Session, readings: Sequence[BmcReading], now: datetime) -> set[int]:
        """The readings not to believe (their server ids), each with its Event unless that
        server had one within the hour."""
        problems = {
            r.server_id: (r, why)
            for r in readings
            if r.watts is not None and (why := check_watts(r.watts, max_w=r.max_w)) is not None
        }
        if not problems:
            return set()
        names = [r.server for r, _ in problems.values()]
        since = now - timedelta(seconds=REFUSED_EVERY_S)
        recent = set(
            session.exec(
                select(Event.subject).where(
                    Event.subject_type == "server",
                    Event.kind == REFUSED_KIND,
                    col(Event.subject).in_(names),
                    Event.at >= since,
                )
            )
        )
        for reading, why in problems.values():
            assert reading.watts is not None
            if reading.server in recent:
                continue
            session.add(
                Event(
                    at=now,
                    subject_type="server",
                    subject=reading.server,
                    actor=ACTOR,
                    kind=REFUSED_KIND,
                    message=refused_message(reading.server, why),
                    details={
                        # JSON has no NaN nor infinity: such a figure is kept as text.
                        "watts": reading.watts
                        if math.isfinite(reading.watts)
                        else str(reading.watts),
                        "max_w": reading.max_w,
                        "reason": why,
                    },
                )
            )
        return set(problems)


@dataclass(frozen=True, slots=True)
class Stored:
    """A server's stored draw as a sweep finds it."""

    server_id: int
    rack: str
    drawn_w: float | None
    source: str | None
    at: datetime | None


def _stored(session: Session) -> dict[str, Stored]:
    """Every server's stored draw and rack, in one query (10,000 rows a minute at most)."""
    columns = (
        Server.id,
        Server.name,
        Rack.name,
        Server.drawn_w,
        Server.drawn_source,
        Server.drawn_at,
    )
    rows = session.execute(
        sa.select(*(col(c) for c in columns))
        .select_from(Server)
        .join(Rack, col(Rack.id) == Server.rack_id)
    )
    return {name: Stored(sid, rack, w, src, at) for sid, name, rack, w, src, at in rows}


def plan_writes(
    stored: Mapping[str, Stored],
    readings: Sequence[BmcReading],
    now: datetime,
    max_age_s: float,
) -> list[dict[str, object]]:
    """The Server.drawn_* rows to write from a sweep's believed readings: a server on with a
    reading gets it (when `needs_write`); a server off has no draw to show; a server on
    without a reading keeps what it has (the agent's estimate, if any)."""
    updates: list[dict[str, object]] = []
    for r in readings:
        old = stored.get(r.server)
        if old is None:
            continue  # deleted since the sweep began
        if r.on and r.watts is not None:
            if needs_write(old.drawn_w, old.source, old.at, r.watts, BMC, now, max_age_s):
                updates.append({"sid": r.server_id, "w": r.watts, "src": BMC, "at": now})
        elif not r.on and old.drawn_w is not None:
            updates.append({"sid": r.server_id, "w": None, "src": None, "at": now})
    return updates


def _write_drawn(session: Session, updates: list[dict[str, object]]) -> None:
    """One batched UPDATE (executemany; psycopg pipelines it)."""
    if updates:
        session.execute(
            _SERVER.update()
            .where(_SERVER.c.id == sa.bindparam("sid"))
            .values(
                drawn_w=sa.bindparam("w"),
                drawn_source=sa.bindparam("src"),
                drawn_at=sa.bindparam("at"),
            ),
            updates,
        )


def sweep_readings(
    stored: Mapping[str, Stored],
    readings: Sequence[BmcReading],
    now: datetime,
    fresh_s: float,
) -> list[Reading]:
    """This sweep's readings for the series: every server's latest draw (this sweep's BMC
    reading, else its stored one while fresh; none for a server found off), and per rack the
    sum of them."""
    read_now = {r.server: r.watts for r in readings if r.on and r.watts is not None}
    off_now = {r.server for r in readings if not r.on}
    fresh_since = now - timedelta(seconds=fresh_s)
    latest: list[tuple[str, str, float, bool]] = []  # server, rack, watts, estimated
    for name, row in sorted(stored.items()):
        bmc_now = read_now.get(name)
        if bmc_now is not None:
            latest.append((name, row.rack, bmc_now, False))
        elif (
            name not in off_now
            and row.drawn_w is not None
            and row.at is not None
            and row.at >= fresh_since
        ):
            latest.append((name, row.rack, row.drawn_w, row.source == ESTIMATE))
    servers = [Reading(SERVER, name, now, w, est) for name, _, w, est in latest]
    return servers + rack_readings(((rack, w, est) for _, rack, w, est in latest), now)


_meters: weakref.WeakKeyDictionary[Engine, Meter] = weakref.WeakKeyDictionary()
_meters_lock = threading.Lock()


def meter_for(engine: Engine, settings: Settings) -> Meter:
    """The process's meter for this database (made on first use; remade if the bucket width
    changed): the reconciler's open buckets live here between sweeps."""
    with _meters_lock:
        meter = _meters.get(engine)
        if meter is None or meter.series.bucket_s != settings.power_bucket_s:
            meter = _meters[engine] = Meter(settings)
        meter.settings = settings  # retention and cadence as configured now
        return meter


__all__ = [
    "BMC",
    "ESTIMATE",
    "REFUSED_KIND",
    "BmcReading",
    "Meter",
    "MeterReport",
    "Stored",
    "drawn_fresh_s",
    "estimate_w",
    "gpu_idle_w",
    "meter_for",
    "needs_write",
    "plan_writes",
    "record_estimate",
    "rewrite_after_s",
    "sweep_readings",
]
