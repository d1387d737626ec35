"""The reconciler: every server's BMC power state, read concurrently, against the database.

One tick (`reconcile_once`) reads each due server's BMC (fleet/power/reconcile_policy.py decides
who is due
and what a reading means), stores what the hardware says in the observed fields and records
Events for changes, contradictions and unreachable BMCs. A server found on also has its power
sensor read in the same job (the same BMC session, so the sweep's wall time barely moves); the
sweep's readings go to the measured-draw Meter (fleet/power/measure.py). It runs in the leader only
(fleet/control/loops.py). A server whose power action is in flight (its power lock is held) is
skipped
for this tick, as is one whose last action is still settling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.bmc import PowerDriver, driver_for
from fleet.bmc.base import BmcTarget
from fleet.bmc.bulk import Job, Outcome, Stagger, run_bulk
from fleet.bmc.targets import target_for
from fleet.crypto import SecretBox
from fleet.models import Event, PowerState, Rack, Server, utcnow
from fleet.power.actions import ServerBusy, server_power_lock
from fleet.power.measure import BmcReading, Meter, meter_for
from fleet.power.reconcile_policy import (
    Due,
    ServerView,
    SyncPolicy,
    SyncResult,
    due,
    judge_failure,
    judge_reading,
)
from fleet.settings import Settings

log = logging.getLogger(__name__)

ACTOR = "reconciler"


@dataclass(frozen=True, slots=True)
class TickReport:
    read: int
    settling: int
    backoff: int
    busy: int
    failed: int
    changed: int
    mismatched: int
    seconds: float
    metered: int = 0  # servers whose power sensor gave a reading


@dataclass(frozen=True, slots=True)
class Read:
    """One job's answer: the power state and, for a server found on, its sensor's watts (None:
    no reading, or the sensor read failed: the power state still stands)."""

    state: PowerState
    watts: float | None


def policy_from(settings: Settings) -> SyncPolicy:
    return SyncPolicy(
        failures_to_unreachable=settings.reconcile_failures,
        unreachable_interval_s=settings.reconcile_unreachable_interval_s,
    )


def _view(server: Server) -> ServerView:
    return ServerView(
        name=server.name,
        state=server.state,
        power_state=server.power_state,
        bmc_failures=server.bmc_failures,
        bmc_checked_at=server.bmc_checked_at,
        power_settle_until=server.power_settle_until,
        bmc_reachable=server.bmc_reachable,
    )


def reconcile_once(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    *,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
    now: Callable[[], datetime] = utcnow,
    meter: Meter | None = None,
) -> TickReport:
    """One sweep. `meter`: where measured draw goes (default: this process's meter for
    `engine`, fleet/power/measure.meter_for)."""
    started = time.monotonic()
    policy = policy_from(settings)
    tick_at = now()
    with Session(engine) as session:
        rows = list(
            session.exec(
                select(Server, Rack.name)
                .select_from(Server)
                .join(Rack, col(Rack.id) == Server.rack_id)
                .order_by(col(Server.name))
            )
        )
    counts = {d: 0 for d in Due}
    servers: dict[str, Server] = {}
    jobs: list[Job[Read]] = []
    for server, rack in rows:
        verdict = due(_view(server), tick_at, policy)
        counts[verdict] += 1
        if verdict is Due.READ:
            servers[server.name] = server
            jobs.append(Job(server.name, rack, _reader(engine, box, settings, server, drivers)))

    busy = failed = changed = mismatched = 0
    readings: list[BmcReading] = []
    tally = threading.Lock()  # outcomes arrive on the bulk workers' threads

    def record(outcome: Outcome[Read]) -> None:
        nonlocal busy, failed, changed, mismatched
        if isinstance(outcome.error, ServerBusy):
            with tally:
                busy += 1
            return
        server = servers[outcome.server]
        read = outcome.value
        if read is not None:
            result = judge_reading(_view(server), read.state, policy)
        else:
            result = judge_failure(_view(server), str(outcome.error), policy)
        stored = _store(engine, server, result, tick_at, now())
        with tally:
            failed += read is None
            if stored:
                changed += result.power_state not in (None, server.power_state)
                mismatched += result.mismatched
            # An UNKNOWN state says nothing about the draw: the server keeps what it has.
            if stored and read is not None and read.state in (PowerState.ON, PowerState.OFF):
                assert server.id is not None
                on = read.state is PowerState.ON
                readings.append(BmcReading(server.id, server.name, server.max_w, on, read.watts))

    # Reads draw no inrush current: no per-rack stagger, only the overall bound.
    run_bulk(
        jobs, Stagger(workers=settings.bmc_workers, per_rack=None, rack_delay=0.0), on_done=record
    )
    # Every sweep, readings or none: the series also takes the agents' estimates and closes
    # buckets on time. A failure here is logged, never the sweep's: power states are stored.
    try:
        (meter or meter_for(engine, settings)).record(engine, readings, now())
    except Exception:
        log.exception("reconcile: measured draw not recorded this sweep")
    report = TickReport(
        read=counts[Due.READ] - busy,
        settling=counts[Due.SETTLING],
        backoff=counts[Due.BACKOFF],
        busy=busy,
        failed=failed,
        changed=changed,
        mismatched=mismatched,
        seconds=round(time.monotonic() - started, 3),
        metered=sum(r.watts is not None for r in readings),
    )
    log.info("reconcile: %s", report)
    return report


def _reader(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    server: Server,
    drivers: Callable[[BmcTarget], PowerDriver],
) -> Callable[[], Read]:
    def read() -> Read:
        with (
            server_power_lock(engine, server, settings.lease_s),
            drivers(target_for(server, box, settings)) as driver,
        ):
            state = driver.power_state()
            return Read(state, _watts(driver) if state is PowerState.ON else None)

    return read


def _watts(driver: PowerDriver) -> float | None:
    """The server's power sensor; a failed read costs the reading only, not the power state
    just read (a BMC without a power sensor, one that times out on it)."""
    try:
        return driver.sensors().power_w
    except Exception as exc:  # a driver's error or a malformed answer: the sensor is optional
        log.info("reconcile: no power reading from %s: %s", driver.target.server, exc)
        return None


def _store(
    engine: Engine, seen: Server, result: SyncResult, tick_at: datetime, now: datetime
) -> bool:
    """Observed fields and events in one transaction. A power action that wrote the server
    after this tick began knows better than this read: the read is then dropped."""
    with Session(engine) as session:
        row = session.get(Server, seen.id)
        if row is None:
            return False
        if row.power_state_at is not None and row.power_state_at > tick_at:
            return False
        if row.power_settle_until != seen.power_settle_until:
            return False  # an action was sent meanwhile
        row.bmc_failures = result.bmc_failures
        row.bmc_checked_at = now
        if result.bmc_reachable is not None:
            row.bmc_reachable = result.bmc_reachable
        if result.power_state is not None:
            row.power_state, row.power_state_at = result.power_state, now
        session.add(row)
        for spec in result.events:
            session.add(
                Event(
                    at=now,
                    subject_type="server",
                    subject=row.name,
                    actor=ACTOR,
                    kind=spec.kind,
                    message=spec.message,
                    details=spec.details,
                )
            )
        session.commit()
    return True
