"""Leader election (fleet/control/leader.py) for the singleton control loops, against real Postgres.

- Unit level: two `LeaseLeadership` objects contend for one lease in a throwaway database of
  the test's own; `FileLeadership` (SQLite) contends through flock.
- Process level (the acceptance tests): two real `fleetctl serve` processes on one migrated
  Postgres database, with a 1 s reconciler interval and a 1 s lease. Exactly one leads; when
  it is SIGKILLed or SIGSTOPped the other takes over within two ticks, and a stopped leader
  that wakes up steps down instead of leading alongside its successor. Every change of leader
  is an Event (`service.leader` / `service.follower`) naming the process as host:pid.

Each failover time is printed (`pytest -s` shows it) and checked against an upper bound:
two reconciler intervals plus a generous slack for a loaded CI machine.
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import sqlalchemy as sa
import sqlmodel
from factories import TEST_SECRET_KEY
from pg import throwaway_database
from pgbouncer_peer import pgbouncer_binary, pgbouncer_peer
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from fleet import db
from fleet.control.leader import (
    FileLeadership,
    LeaseLeadership,
    SoleProcess,
    StepDown,
    identity,
    leadership_for,
)
from fleet.control.loops import SingletonLoop
from fleet.lab.harness import LoopMetrics, ServeProcess
from fleet.lab.harness import wait_for as _wait_for
from fleet.models import Event, Lease, utcnow

T = TypeVar("T")

LEASE_S = 1.0
INTERVAL_S = 1.0
# Process start-up, scrape and scheduling noise on a loaded 2-core CI machine: an upper bound.
SLACK_S = 1.5
# A follower tries for the lock once a tick: it leads at most two ticks after the lock is free
# (SIGKILL and SIGSTOP free it after at most one lease, and the lease is one interval).
FAILOVER_BOUND_S = 2 * INTERVAL_S + SLACK_S
START_TIMEOUT_S = 30.0
POLL_S = 0.05

# ---------------------------------------------------------------------------------------------
# Databases


@pytest.fixture
def leader_db(pg_url: str) -> Iterator[str]:
    """A throwaway Postgres database of this test's own (its own lease table)."""
    admin = sa.make_url(pg_url).set(database="postgres").render_as_string(hide_password=False)
    with throwaway_database("fleet_leader", admin) as url:
        yield url


@pytest.fixture
def leader_engine(leader_db: str) -> Iterator[Engine]:
    engine = db.make_engine(leader_db)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def migrated_engine(leader_engine: Engine) -> Engine:
    """`leader_engine`, migrated to head (what `fleetctl db upgrade` does)."""
    db.upgrade(leader_engine)
    return leader_engine


def lease_holders(engine: Engine) -> list[str]:
    """The holders of unexpired leader leases in `engine`'s database."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT holder FROM lease WHERE name LIKE 'leader:%' AND expires_at > :now"
                ),
                {"now": utcnow()},
            ).scalars()
        )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------
# LeaseLeadership


@pytest.fixture
def lease_engine(leader_engine: Engine) -> Engine:
    """`leader_engine` with the lease table and nothing else."""
    Lease.__table__.create(leader_engine)  # type: ignore[attr-defined]
    return leader_engine


@pytest.fixture
def contender(lease_engine: Engine) -> Iterator[Callable[..., LeaseLeadership]]:
    """Makes LeaseLeadership objects on the test database; all released at the end."""
    made: list[LeaseLeadership] = []

    def make(
        name: str = "control", lease_s: float = LEASE_S, clock: Clock | None = None
    ) -> LeaseLeadership:
        leadership = LeaseLeadership(lease_engine, name, lease_s, clock=clock or time.monotonic)
        made.append(leadership)
        return leadership

    try:
        yield make
    finally:
        for leadership in made:
            leadership.release()


def test_exactly_one_of_two_leads_and_the_other_takes_over_after_release(
    contender: Callable[..., LeaseLeadership], leader_engine: Engine
) -> None:
    first, second = contender(), contender()
    assert first.is_leader() is True
    assert second.is_leader() is False
    # Asking again re-checks the lock and changes nothing: the same connection keeps it.
    [holder] = lease_holders(leader_engine)
    assert (first.is_leader(), second.is_leader()) == (True, False)
    assert lease_holders(leader_engine) == [holder]
    # Another name is another lock.
    assert contender("other").is_leader() is True

    first.release()
    assert holder not in lease_holders(leader_engine)
    assert second.is_leader() is True
    assert first.is_leader() is False
    assert (first.is_leader(), second.is_leader()) == (False, True)


def test_the_heartbeat_keeps_a_live_leader_past_its_lease(
    contender: Callable[..., LeaseLeadership], leader_engine: Engine
) -> None:
    """The heartbeat (every third of the lease) keeps a live leader's lease across several
    leases, without anyone asking."""
    leader, follower = contender(), contender()
    assert leader.is_leader()
    [holder] = lease_holders(leader_engine)
    time.sleep(2.5 * LEASE_S)
    assert lease_holders(leader_engine) == [holder]
    assert follower.is_leader() is False
    assert leader.is_leader() is True
    assert lease_holders(leader_engine) == [holder]


def test_a_paused_leader_whose_lease_was_taken_over_steps_down(
    contender: Callable[..., LeaseLeadership],
    lease_engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A leader paused past its lease (SIGSTOP, a VM frozen): its lease expires, a follower takes
    it, and the leader asks the database at its next check instead of trusting its flag.
    (A 30 s lease: no heartbeat renews it during the test; the pause is the leader's clock.)"""
    caplog.set_level(logging.INFO, logger="fleet.control.leader")
    paused = Clock()
    leader, follower = contender(lease_s=30.0, clock=paused), contender(lease_s=30.0)
    assert leader.is_leader() and not follower.is_leader()
    [holder] = lease_holders(lease_engine)

    with lease_engine.begin() as conn:  # its renewals stopped long ago
        conn.execute(sa.text("UPDATE lease SET expires_at = :past"), {"past": utcnow()})
    paused.now += 30.0
    assert follower.is_leader() is True
    assert leader.is_leader() is False
    assert "lost the lease; stepping down" in caplog.text
    [new_holder] = lease_holders(lease_engine)
    assert new_holder != holder

    # It may lead again once the lease is free, under a new holder token.
    follower.release()
    assert lease_holders(lease_engine) == []
    assert leader.is_leader() is True
    [again] = lease_holders(lease_engine)
    assert again not in (holder, new_holder)


def test_a_paused_leader_whose_lease_nobody_took_keeps_leading(
    contender: Callable[..., LeaseLeadership], lease_engine: Engine
) -> None:
    """Past half a lease without a confirmation it asks the database; the lease still being its
    own, it renews it and leads on under the same token (no needless change of leader)."""
    paused = Clock()
    leader = contender(lease_s=30.0, clock=paused)
    assert leader.is_leader()
    [holder] = lease_holders(lease_engine)
    paused.now += 60.0
    assert leader.is_leader() is True
    assert lease_holders(lease_engine) == [holder]


def test_a_lease_must_be_positive(leader_engine: Engine) -> None:
    with pytest.raises(ValueError, match="lease must be positive"):
        LeaseLeadership(leader_engine, "control", 0)


def test_leadership_for_each_backend(tmp_path: Path) -> None:
    pg = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/fleet")
    sqlite_file = sa.create_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    memory = sa.create_engine("sqlite://")
    try:
        assert isinstance(leadership_for(pg, "control", LEASE_S), LeaseLeadership)
        by_file = leadership_for(sqlite_file, "control", LEASE_S)
        assert isinstance(by_file, FileLeadership)
        assert by_file.is_leader()
        assert (tmp_path / "fleet.control.leader").read_text() == identity() + "\n"
        by_file.release()
        assert isinstance(leadership_for(memory, "control", LEASE_S), SoleProcess)
    finally:
        for engine in (pg, sqlite_file, memory):
            engine.dispose()


# ---------------------------------------------------------------------------------------------
# FileLeadership (SQLite)


def test_file_leadership_two_holders_in_one_process(tmp_path: Path) -> None:
    """flock belongs to an open file description: a second open of the file, even in the same
    process, does not get the lock while the first holds it."""
    path = tmp_path / "locks" / "fleet.control.leader"
    first, second = FileLeadership(path, "control"), FileLeadership(path, "control")
    try:
        assert first.is_leader() is True
        assert second.is_leader() is False
        assert (first.is_leader(), second.is_leader()) == (True, False)
        assert path.read_text() == identity() + "\n"
        first.release()
        assert second.is_leader() is True
        assert first.is_leader() is False
    finally:
        first.release()
        second.release()


CHILD_HOLDS_FLOCK = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.write("child\\n")
handle.flush()
print("locked", flush=True)
time.sleep(60)
"""


def test_file_leadership_is_freed_when_its_holder_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "fleet.control.leader"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_HOLDS_FLOCK, str(path)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    leadership = FileLeadership(path, "control")
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 10)
        assert ready and child.stdout.readline() == "locked\n", "the child never took the lock"
        assert leadership.is_leader() is False
        assert path.read_text() == "child\n", "a follower must not overwrite the holder's name"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert leadership.is_leader() is True
        assert path.read_text() == identity() + "\n"
    finally:
        leadership.release()
        kill_group(child)


# ---------------------------------------------------------------------------------------------
# SingletonLoop with a real lock


def test_a_failing_leadership_callback_does_not_stop_the_loop(
    contender: Callable[..., LeaseLeadership],
) -> None:
    def event_write_fails(_: bool) -> None:
        raise RuntimeError("cannot write the leadership event")

    loop = SingletonLoop(
        "reconciler", 0.05, lambda: None, contender(), on_leadership=event_write_fails
    )
    loop.start()
    try:
        wait_for("the loop to tick", lambda: loop.stats.ticks >= 3 or None, timeout=1.5)
    finally:
        loop.stop(timeout=5)


# ---------------------------------------------------------------------------------------------
# StepDown: a leader whose loops keep failing gives the lead away


def test_step_down_after_failures_in_a_row_and_back_after_the_backoff(
    contender: Callable[..., LeaseLeadership], leader_engine: Engine
) -> None:
    clock, reasons = Clock(), list[str]()
    leadership = StepDown(contender(), 3, 30.0, on_step_down=reasons.append, clock=clock)
    assert leadership.is_leader()
    [holder] = lease_holders(leader_engine)
    # A good tick anywhere resets the count: failures must come in a row.
    for ok in (False, False, True, False, False):
        leadership.record(ok, None if ok else "reconciler: OperationalError: gone")
    assert leadership.is_leader() and lease_holders(leader_engine) == [holder]

    leadership.record(False, "provisioner: TimeoutError: QueuePool limit")
    assert lease_holders(leader_engine) == [], "the lock must be released at once"
    assert leadership.is_leader() is False and leadership.backing_off
    assert reasons == [
        "3 control-loop ticks failed in a row (last: provisioner: TimeoutError: QueuePool "
        "limit); following for 30 s"
    ]
    # A tick that was still running fails late: no second step-down.
    leadership.record(False, "autoscaler: late")
    assert len(reasons) == 1

    clock.now += 30.0
    assert leadership.is_leader() is True, "after the back-off it contends again"
    assert len(lease_holders(leader_engine)) == 1


def test_step_down_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_failures"):
        StepDown(SoleProcess("control"), 0, 1.0)


def test_a_failing_leader_hands_the_lead_to_a_healthy_one(
    contender: Callable[..., LeaseLeadership],
    leader_engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two processes' worth of loops on one lock: the leader's ticks all fail (as when its pool
    is exhausted), the follower's work. The leader gives up the lock and the follower leads."""
    caplog.set_level(logging.INFO, logger="fleet.control.leader")

    def broken() -> None:
        raise RuntimeError("QueuePool limit reached")

    sick_lead = StepDown(contender(), 3, 60.0)
    healthy_lead = StepDown(contender(), 3, 60.0)
    sick = SingletonLoop("provisioner", 0.05, broken, sick_lead, on_tick=sick_lead.record)
    healthy = SingletonLoop(
        "provisioner", 0.05, lambda: None, healthy_lead, on_tick=healthy_lead.record
    )
    sick.start()
    try:
        wait_for("the sick one to lead", lambda: sick.stats.leader or None, timeout=5)
        healthy.start()
        wait_for("the healthy one to lead", lambda: healthy.stats.ticks >= 3 or None, timeout=5)
        assert healthy.stats.leader and healthy.stats.failed_ticks == 0
        assert not sick.stats.leader and sick_lead.backing_off
        assert sick.stats.failed_ticks == 3
        assert "gives up the lead: 3 control-loop ticks failed in a row" in caplog.text
        assert len(lease_holders(leader_engine)) == 1
    finally:
        sick.stop(timeout=5)
        healthy.stop(timeout=5)


def test_the_service_loops_step_down_together_and_say_why_in_an_event(
    migrated_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fleet/control/service_loops.py: the loops share one StepDown; failed provisioner ticks
    (the
    loop that ticks most) make the process give up the lead, with a service.follower Event."""
    from pydantic import SecretStr

    from fleet.control import service_loops as control
    from fleet.crypto import SecretBox
    from fleet.settings import Settings

    def pool_exhausted(*_: object, **__: object) -> None:
        raise sa.exc.TimeoutError("QueuePool limit of size 10 overflow 10 reached")

    monkeypatch.setattr(control, "provision_once", pool_exhausted)
    settings = Settings(
        data_dir=tmp_path,
        database_url=migrated_engine.url.render_as_string(hide_password=False),
        secret_key=SecretStr(TEST_SECRET_KEY.decode()),
        leader_lease_s=LEASE_S,
        leader_step_down_failures=2,
    )
    loops = control.build_loops(settings, migrated_engine, SecretBox(TEST_SECRET_KEY))
    reconciler, provisioner = loops[0], loops[1]
    try:
        assert reconciler.run_once() is True  # leads: the service.leader Event
        assert provisioner.run_once() is True
        assert lease_holders(migrated_engine) != []
        assert provisioner.run_once() is True  # the second failure in a row: it steps down
        assert lease_holders(migrated_engine) == []
        assert [loop.run_once() for loop in loops] == [False] * len(loops)
        with Session(migrated_engine) as session:
            events = session.exec(
                sqlmodel.select(Event).where(col(Event.subject_type) == "service")
            ).all()
        assert [e.kind for e in events] == ["service.leader", "service.follower"]
        follower = events[1]
        assert "gave up the lead" in follower.message
        assert "2 control-loop ticks failed in a row" in follower.details["reason"]
        assert "provisioner: TimeoutError" in follower.details["reason"]
    finally:
        for loop in loops:
            loop.stop(timeout=5)


# ---------------------------------------------------------------------------------------------
# Two real services on one database


LEADER_LINE = re.compile(r'^fleet_loop_leader\{loop="reconciler"\} (\S+)$', re.MULTILINE)
TICKS_LINE = re.compile(r'^fleet_loop_ticks_total\{loop="reconciler"\} (\S+)$', re.MULTILINE)


def parse_loop_metrics(text: str) -> LoopMetrics:
    leader, ticks = LEADER_LINE.search(text), TICKS_LINE.search(text)
    assert leader is not None and ticks is not None, f"no reconciler metrics in:\n{text}"
    return LoopMetrics(leader=float(leader[1]) == 1.0, ticks=int(float(ticks[1])))


@dataclass
class Service:
    """One `fleetctl serve` process (in a session, hence a process group, of its own)."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    http: httpx.Client

    @property
    def process(self) -> str:
        """The name its Events give it: host:pid (fleet.control.leader.identity)."""
        return f"{socket.gethostname()}:{self.proc.pid}"

    def get(self, path: str) -> httpx.Response | None:
        """The response, or None while the service does not answer."""
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            return self.http.get(f"{self.url}{path}", timeout=1.0)
        except httpx.HTTPError:
            return None

    def metrics(self) -> LoopMetrics | None:
        response = self.get("/metrics")
        if response is None or response.status_code != 200:
            return None
        return parse_loop_metrics(response.text)

    def send(self, signum: signal.Signals) -> None:
        os.kill(self.proc.pid, signum)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(f"  {self.name}| {line}" for line in text.splitlines()[-lines:])


def kill_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGCONT (in case it is stopped) and SIGKILL to the process group the child leads."""
    if proc.poll() is None:
        for signum in (signal.SIGCONT, signal.SIGKILL):
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def service_settings(database_url: str) -> dict[str, str]:
    return {
        "FLEET_DATABASE_URL": database_url,
        "FLEET_SECRET_KEY": TEST_SECRET_KEY.decode(),
        "FLEET_RUN_LOOPS": "true",  # conftest turns them off for the test process
        "FLEET_RECONCILE_INTERVAL_S": str(INTERVAL_S),
        "FLEET_LEADER_LEASE_S": str(LEASE_S),
        "FLEET_LOG_LEVEL": "INFO",
    }


def logs(services: list[Service]) -> str:
    return "\n".join(service.log_tail() for service in services)


# probe() every POLL_S; a wait that runs out shows the services' logs when given `why`.
wait_for = partial(_wait_for, every=POLL_S)


@contextmanager
def two_services(
    engine: Engine, tmp_path: Path, url: str | None = None, **settings: str
) -> Iterator[list[Service]]:
    """Two `fleetctl serve` processes on `engine`'s database (through `url` if given, with
    `settings` added), both ready (/readyz) on return; both killed (with their process groups)
    on the way out, whatever happened."""
    url = url or engine.url.render_as_string(hide_password=False)
    services: list[Service] = []
    http = httpx.Client()
    try:
        for name in ("one", "two"):
            serve = ServeProcess(
                name,
                tmp_path / f"data-{name}",
                service_settings(url) | settings,
                log=tmp_path / f"{name}.log",
            )
            serve.spawn()
            services.append(Service(name, serve.proc, serve.url, serve.log, http))

        def all_ready() -> bool | None:
            answers = [service.get("/readyz") for service in services]
            return all(a is not None and a.status_code == 200 for a in answers) or None

        wait_for("both services ready", all_ready, START_TIMEOUT_S, why=partial(logs, services))
        yield services
    finally:
        for service in services:
            kill_group(service.proc)
        http.close()


def one_leader(services: list[Service]) -> tuple[Service, Service]:
    """Wait until exactly one service leads (and has ticked twice); (leader, follower)."""

    def probe() -> tuple[Service, Service] | None:
        sample = [(service, service.metrics()) for service in services]
        if any(m is None for _, m in sample):
            return None
        leading = [(s, m) for s, m in sample if m is not None and m.leader]
        assert len(leading) <= 1, f"two leaders at once:\n{logs(services)}"
        if not leading or leading[0][1] is None or leading[0][1].ticks < 2:
            return None
        [(leader, _)] = leading
        [follower] = [s for s in services if s is not leader]
        return leader, follower

    leader, follower = wait_for(
        "one leader ticking", probe, START_TIMEOUT_S, why=partial(logs, services)
    )
    # A follower that never led never ticked.
    assert follower.metrics() == LoopMetrics(leader=False, ticks=0)
    return leader, follower


def time_to_take_over(follower: Service, since: float, services: list[Service]) -> float:
    """Seconds from `since` until `follower`'s /metrics shows it leading and ticking; then
    check that its ticks keep coming."""

    def leads() -> LoopMetrics | None:
        metrics = follower.metrics()
        return metrics if metrics is not None and metrics.leader and metrics.ticks > 0 else None

    # Waits past the bound, so that a failure reports the figure rather than just "too slow".
    took_over = wait_for(
        f"{follower.name} to lead", leads, FAILOVER_BOUND_S + 10, why=partial(logs, services)
    )
    elapsed = time.monotonic() - since

    def ticks_more() -> LoopMetrics | None:
        metrics = follower.metrics()
        return metrics if metrics is not None and metrics.ticks > took_over.ticks else None

    after = wait_for(
        f"{follower.name} to tick again",
        ticks_more,
        INTERVAL_S + SLACK_S,
        why=partial(logs, services),
    )
    assert after.leader
    return elapsed


def service_events(engine: Engine) -> list[tuple[str, str]]:
    """(kind, details.process) of the service leadership Events, oldest first."""
    with Session(engine) as session:
        events = session.exec(
            sqlmodel.select(Event)
            .where(col(Event.subject_type) == "service")
            .order_by(col(Event.id))
        ).all()
    for event in events:
        assert event.subject == "leader"
        assert event.actor == event.details["process"]
    return [(event.kind, str(event.details["process"])) for event in events]


def test_sigkill_of_the_leader_fails_over_within_two_ticks(
    migrated_engine: Engine, tmp_path: Path
) -> None:
    with two_services(migrated_engine, tmp_path) as services:
        leader, follower = one_leader(services)
        assert service_events(migrated_engine) == [("service.leader", leader.process)]

        killed_at = time.monotonic()
        leader.send(signal.SIGKILL)
        elapsed = time_to_take_over(follower, killed_at, services)
        print(f"\nfailover after SIGKILL: {elapsed:.2f} s (bound {FAILOVER_BOUND_S:.1f} s)")
        assert elapsed <= FAILOVER_BOUND_S, f"failover took {elapsed:.2f} s\n{logs(services)}"

        assert leader.proc.wait(timeout=10) == -signal.SIGKILL
        assert service_events(migrated_engine) == [
            ("service.leader", leader.process),
            ("service.leader", follower.process),
        ]
        assert len(lease_holders(migrated_engine)) == 1


def test_sigstop_of_the_leader_fails_over_and_the_sleeper_wakes_as_a_follower(
    migrated_engine: Engine, tmp_path: Path
) -> None:
    with two_services(migrated_engine, tmp_path) as services:
        sleeper, successor = one_leader(services)
        before_stop = sleeper.metrics()
        assert before_stop is not None and before_stop.leader

        stopped_at = time.monotonic()
        sleeper.send(signal.SIGSTOP)
        try:
            # Nothing tells the database it stopped: its lease expires, then the other takes it.
            elapsed = time_to_take_over(successor, stopped_at, services)
        finally:
            sleeper.send(signal.SIGCONT)
        print(f"\nfailover after SIGSTOP: {elapsed:.2f} s (bound {FAILOVER_BOUND_S:.1f} s)")
        assert elapsed <= FAILOVER_BOUND_S, f"failover took {elapsed:.2f} s\n{logs(services)}"

        # Awake again, the old leader finds its lease taken at its next tick and steps
        # down (it may answer a scrape or two with the flag of its last tick before that).
        def stepped_down() -> LoopMetrics | None:
            metrics = sleeper.metrics()
            return metrics if metrics is not None and not metrics.leader else None

        woke = wait_for("the woken leader to step down", stepped_down, 2 * INTERVAL_S + SLACK_S)
        # A tick caught by SIGSTOP may finish after SIGCONT; no tick starts after it.
        assert woke.ticks <= before_stop.ticks + 1

        # Never two leaders: for a few ticks the successor leads, ticking, and the sleeper not.
        successor_start = successor.metrics()
        assert successor_start is not None
        watch_until = time.monotonic() + 2 * INTERVAL_S + 0.2
        while time.monotonic() < watch_until:
            now = (sleeper.metrics(), successor.metrics())
            assert now == (woke, now[1]), f"the sleeper moved: {now}\n{logs(services)}"
            assert now[1] is not None and now[1].leader, f"{now}\n{logs(services)}"
            time.sleep(0.1)
        successor_end = successor.metrics()
        assert successor_end is not None and successor_end.ticks > successor_start.ticks
        assert len(lease_holders(migrated_engine)) == 1

        def three_events() -> list[tuple[str, str]] | None:
            events = service_events(migrated_engine)
            return events if len(events) >= 3 else None

        events = wait_for("the sleeper's service.follower Event", three_events, timeout=2)
        assert events == [
            ("service.leader", sleeper.process),
            ("service.leader", successor.process),
            ("service.follower", sleeper.process),
        ]


def test_two_services_behind_pgbouncer_in_transaction_mode_fail_over_on_sigkill(
    migrated_engine: Engine, tmp_path: Path
) -> None:
    """The same failover with both services behind Debian's PgBouncer in transaction mode (3
    server connections for two pools): the leader's lease holds no session state."""
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer not installed (Debian pgbouncer)")
    database = migrated_engine.url.database
    assert database
    with (
        pgbouncer_peer(server_connections=3) as bouncer,
        two_services(
            migrated_engine,
            tmp_path,
            bouncer.url(database),
            FLEET_DB_PREPARED_STATEMENTS="false",
        ) as services,
    ):
        leader, follower = one_leader(services)
        killed_at = time.monotonic()
        leader.send(signal.SIGKILL)
        elapsed = time_to_take_over(follower, killed_at, services)
        print(f"\nfailover behind PgBouncer: {elapsed:.2f} s (bound {FAILOVER_BOUND_S:.1f} s)")
        assert elapsed <= FAILOVER_BOUND_S, f"failover took {elapsed:.2f} s\n{logs(services)}"
        assert lease_holders(migrated_engine) != []
        assert len(lease_holders(migrated_engine)) == 1
        assert bouncer.servers(database) <= 3
