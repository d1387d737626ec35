"""fleet/leases.py on both databases: a lease excludes other threads and other processes, holds
no connection while held, is renewed while its holder works, and is taken over only once it
has expired; a holder that lost it does not delete its successor's."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fleet import leases
from fleet.models import utcnow


class Busy(Exception):
    pass


def holder_of(engine: Engine, name: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT holder FROM lease WHERE name = :n"), {"n": name}
        ).scalar()


def shifted(by_s: float) -> Callable[[], datetime]:
    """A clock `by_s` seconds ahead of this one."""
    return lambda: utcnow() + timedelta(seconds=by_s)


def test_a_second_holder_is_refused_until_the_first_lets_go(db: Engine) -> None:
    with leases.hold(db, "test.a", Busy("held")):
        assert holder_of(db, "test.a") is not None
        with pytest.raises(Busy, match="held"), leases.hold(db, "test.a", Busy("held")):
            pytest.fail("a second holder got the lease")
        with leases.hold(db, "test.b", Busy("b")):  # another name is another lease
            pass
    assert holder_of(db, "test.a") is None  # given back: the row is gone
    with leases.hold(db, "test.a", Busy("held")):
        pass


def test_another_thread_is_refused(db: Engine) -> None:
    refused: list[bool] = []

    def second() -> None:
        try:
            with leases.hold(db, "test.thread", Busy()):
                refused.append(False)
        except Busy:
            refused.append(True)

    with leases.hold(db, "test.thread", Busy()):
        worker = threading.Thread(target=second)
        worker.start()
        worker.join(timeout=10)
    assert refused == [True]


def test_no_connection_is_held_while_leases_are(db: Engine) -> None:
    """The point of a lease: 40 held at once (a bulk action on slow BMCs) hold no connection
    of the pool between their statements."""
    holding = threading.Barrier(41, timeout=30)
    done = threading.Event()

    def work(i: int) -> None:
        with leases.hold(db, f"test.many:{i}", Busy()):
            holding.wait()
            done.wait(timeout=30)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(40)]
    for worker in workers:
        worker.start()
    try:
        holding.wait()
        with db.connect() as conn:
            held = conn.execute(sa.text("SELECT count(*) FROM lease")).scalar()
        assert held == 40
        if db.dialect.name == "postgresql":
            assert db.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        done.set()
        for worker in workers:
            worker.join(timeout=30)
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM lease")).scalar() == 0


def test_an_expired_lease_is_taken_over_and_its_holder_cannot_delete_the_new_ones(
    db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    first = leases.Keeper(db, ttl_s=10)
    later = leases.Keeper(db, ttl_s=10, clock=shifted(11))  # past the first one's expiry
    with caplog.at_level(logging.WARNING, logger="fleet.leases"):
        first_block = first.hold("test.expire", Busy())
        first_block.__enter__()
        with later.hold("test.expire", Busy()):
            taken = holder_of(db, "test.expire")
            assert first.renew_now() == {"test.expire"}  # the first learns it lost it
            first_block.__exit__(None, None, None)  # and ends while its successor holds
            assert holder_of(db, "test.expire") == taken
        assert holder_of(db, "test.expire") is None
    assert "lease test.expire was lost while held" in caplog.text


def test_a_renewed_lease_is_not_taken_over(db: Engine) -> None:
    keeper = leases.Keeper(db, ttl_s=10, clock=shifted(8))
    with keeper.hold("test.renew", Busy()):
        # Without the renewal a taker at +11 s would win; renewed at +8 s it holds to +18 s.
        assert keeper.renew_now() == set()
        with (
            pytest.raises(Busy),
            leases.Keeper(db, ttl_s=10, clock=shifted(11)).hold("test.renew", Busy()),
        ):
            pytest.fail("a renewed lease was taken over")
        with leases.Keeper(db, ttl_s=10, clock=shifted(19)).hold("test.renew", Busy()):
            pass  # past the renewed expiry: taken over


def test_the_keeper_renews_by_itself_while_held(db: Engine) -> None:
    keeper = leases.Keeper(db, ttl_s=0.3)
    with keeper.hold("test.keeper", Busy()):
        with db.connect() as conn:
            first = conn.execute(sa.text("SELECT expires_at FROM lease")).scalar()
        for _ in range(100):  # bounded: ~10 renewal periods
            with db.connect() as conn:
                now = conn.execute(sa.text("SELECT expires_at FROM lease")).scalar()
            if now != first:
                break
            threading.Event().wait(0.05)
        assert now != first, "the keeper never renewed the lease"


HOLD_IN_CHILD = """
import sys
from fleet import db, leases
engine = db.make_engine(sys.argv[1])
with leases.hold(engine, "test.process", RuntimeError("busy"), ttl_s=5):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_another_process_is_excluded_and_a_killed_holders_lease_expires(db: Engine) -> None:
    """Another service process on the same database: refused while it holds; killed (no
    give-back), its lease holds until its expiry and is taken over after."""
    url = db.url.render_as_string(hide_password=False)
    for ending in ("exit", "kill"):
        child = subprocess.Popen(
            [sys.executable, "-c", HOLD_IN_CHILD, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline() == "held\n", "the child never took the lease"
            with pytest.raises(Busy), leases.hold(db, "test.process", Busy()):
                pytest.fail("the lease was taken while another process holds it")
            if ending == "exit":
                child.stdin.write("\n")
                child.stdin.flush()
                assert child.wait(timeout=30) == 0
                with leases.hold(db, "test.process", Busy()):  # given back: free at once
                    pass
                continue
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
            with pytest.raises(Busy), leases.hold(db, "test.process", Busy()):
                pytest.fail("a killed holder's lease was taken before its expiry")
            with leases.Keeper(db, clock=shifted(6)).hold("test.process", Busy()):
                pass
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_an_in_memory_database_excludes_within_the_process() -> None:
    memory = sa.create_engine("sqlite://")
    try:
        with (
            leases.hold(memory, "test.memory", Busy()),
            pytest.raises(Busy),
            leases.hold(memory, "test.memory", Busy()),
        ):
            pass
        with leases.hold(memory, "test.memory", Busy()):
            pass
    finally:
        memory.dispose()
