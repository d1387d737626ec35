"""Waking the leader's provisioner from any replica (fleet/control/wakeups.py), on both
databases: a committed bump wakes once, a rolled-back one never; boots and operator drains
bump; the watch leads alongside the provisioner without asking for a lease. (The agent's
registration and heartbeats: tests/unit/test_agent_api.py; the effect on a boot's steps:
bench/provision.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa
from factories import add_rack, add_server, add_site
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet.control import wakeups
from fleet.control.loops import Alongside, SingletonLoop
from fleet.db import make_engine, upgrade
from fleet.lifecycle.states import ServerState
from fleet.models import Wakeup
from fleet.provisioning.boots import start_boot
from fleet.provisioning.operator_moves import operator_drain


def seq(db: Engine, loop: str = wakeups.PROVISIONER) -> int:
    with Session(db) as session:
        row = session.get(Wakeup, loop)
        return 0 if row is None else row.seq


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_a_committed_request_wakes_once_and_a_rolled_back_one_never(db: Engine) -> None:
    woken = Counter()
    watch = wakeups.Watch(db, {wakeups.PROVISIONER: woken})
    watch.tick()  # the first read only remembers
    assert woken.calls == 0

    with Session(db) as session:  # the row is made if missing (the test database is wiped)
        wakeups.request(session)
        session.commit()
    watch.tick()
    assert woken.calls == 1
    watch.tick()
    assert woken.calls == 1, "nothing moved since"

    with Session(db) as session:
        wakeups.request(session)
        wakeups.request(session)  # twice in one transaction: still one wake
        session.commit()
    watch.tick()
    assert woken.calls == 2

    with Session(db) as session:
        wakeups.request(session)
        session.rollback()
    watch.tick()
    assert woken.calls == 2
    assert seq(db) == 3


def test_another_loops_counter_wakes_nothing_of_the_provisioner(db: Engine) -> None:
    woken = Counter()
    watch = wakeups.Watch(db, {wakeups.PROVISIONER: woken})
    watch.tick()
    with Session(db) as session:
        wakeups.request(session, "rollouts")
        session.commit()
    watch.tick()
    assert woken.calls == 0


def test_a_boot_begun_and_an_operator_drain_wake_the_provisioner(
    db: Engine, session: Session
) -> None:
    rack = add_rack(session, add_site(session, "s1"), "r1")
    spare = add_server(session, rack, "spare", ServerState.WARM, bmc_port=9001)
    busy = add_server(session, rack, "busy", ServerState.SERVING, u_position=9, bmc_port=9002)
    session.commit()
    before = seq(db)

    start_boot(session, spare, None, "stage", "tests", "pre-staging")
    session.commit()
    assert seq(db) == before + 1

    operator_drain(session, busy.name, "tests")
    assert seq(db) == before + 2


def test_the_watch_leads_alongside_the_provisioner_and_asks_for_nothing() -> None:
    class Lease:
        name = "control"
        asked = 0
        leading = False

        def is_leader(self) -> bool:
            self.asked += 1
            return self.leading

        def release(self) -> None:
            pass

    lease = Lease()
    provisioner = SingletonLoop("provisioner", 5.0, lambda: None, lease)
    ticks = Counter()
    watch = SingletonLoop("wakeups", 0.1, ticks, Alongside(provisioner))

    assert watch.run_once() is False
    lease.leading = True
    assert provisioner.run_once() is True
    asked = lease.asked
    assert [watch.run_once() for _ in range(20)] == [True] * 20
    assert ticks.calls == 20
    assert lease.asked == asked, "the watch must not ask the lease (a write for a follower)"
    lease.leading = False
    provisioner.run_once()
    assert watch.run_once() is False


def test_the_migration_seeds_the_provisioners_row(tmp_path: Path) -> None:
    """A freshly migrated database has the row: the first bump is an update, and the watch
    has a counter to read from the start."""
    engine = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        upgrade(engine)
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT name, seq FROM wakeup")).all()
        assert [tuple(r) for r in rows] == [(wakeups.PROVISIONER, 0)]
    finally:
        engine.dispose()


def test_a_database_that_fails_the_read_costs_one_warning_not_a_traceback_per_tick(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The watch reads ten times a second: through an outage its failures would drown the
    log (the chaos suite saw 78 tracebacks in 3.5 s). The provisioner's ticks carry on."""
    gone = make_engine(f"sqlite:///{tmp_path / 'no-such-dir' / 'fleet.db'}")
    woken = Counter()
    watch = wakeups.Watch(gone, {wakeups.PROVISIONER: woken})
    try:
        with caplog.at_level(logging.WARNING, logger="fleet.control.wakeups"):
            for _ in range(20):
                watch.tick()  # never raises
        warnings = [r for r in caplog.records if r.name == "fleet.control.wakeups"]
        assert len(warnings) == 1 and "wake-ups not read" in warnings[0].getMessage()
        assert warnings[0].exc_info is None
        assert woken.calls == 0
    finally:
        gone.dispose()
