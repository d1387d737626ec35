"""fleet/locks.py on both databases: a lock excludes other threads and other processes, a
refused `try_lock` raises the caller's error, `transaction_lock` waits, the leader's session
lock ends with its idle connection; the keys stay what they were."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet import locks


class Busy(Exception):
    pass


def test_lock_keys_are_the_crc32_of_the_names_they_always_had() -> None:
    """Another release's processes must contend for the same keys: never change a name."""
    assert locks.lock_key("fleet.placement") == 61836565
    assert locks.lock_key("fleet.power:r1-gpu0") == 1481299851
    assert locks.lock_key("fleet.leader:control") == 2919472429


def test_try_lock_refuses_a_second_holder_until_the_first_lets_go(db: Engine) -> None:
    with locks.try_lock(db, "test.a", Busy("held")):
        with pytest.raises(Busy, match="held"), locks.try_lock(db, "test.a", Busy("held")):
            pytest.fail("a second holder got the lock")
        with locks.try_lock(db, "test.b", Busy("b")):  # another name is another lock
            pass
    with locks.try_lock(db, "test.a", Busy("held")):  # released: free again
        pass


def test_try_lock_refuses_a_second_holder_on_another_thread(db: Engine) -> None:
    refused: list[bool] = []

    def second() -> None:
        try:
            with locks.try_lock(db, "test.thread", Busy()):
                refused.append(False)
        except Busy:
            refused.append(True)

    with locks.try_lock(db, "test.thread", Busy()):
        worker = threading.Thread(target=second)
        worker.start()
        worker.join(timeout=10)
    assert refused == [True]


HOLD_IN_CHILD = """
import sys, time
from fleet import db, locks
engine = db.make_engine(sys.argv[1])
with locks.try_lock(engine, "test.process", RuntimeError("busy")):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_try_lock_excludes_another_process(db: Engine) -> None:
    """Process-safe on both backends: another service process on the same database."""
    url = db.url.render_as_string(hide_password=False)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_IN_CHILD, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "locked\n", "the child never took the lock"
        with pytest.raises(Busy), locks.try_lock(db, "test.process", Busy()):
            pytest.fail("the lock was taken while another process holds it")
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with locks.try_lock(db, "test.process", Busy()):  # its holder exited: free again
        pass


def test_transaction_lock_waits_for_the_holder(db: Engine) -> None:
    """The second taker blocks (it is not refused) until the first one's transaction ends."""
    entered = threading.Event()
    order: list[str] = []

    def second() -> None:
        with Session(db) as session, locks.transaction_lock(session, "test.placement"):
            order.append("second")
            entered.set()
            session.commit()

    with Session(db) as session, locks.transaction_lock(session, "test.placement"):
        worker = threading.Thread(target=second)
        worker.start()
        assert not entered.wait(timeout=0.5), "the second taker did not wait"
        order.append("first")
        session.commit()  # Postgres: the transaction lock goes with the transaction
    assert entered.wait(timeout=10)
    worker.join(timeout=10)
    assert order == ["first", "second"]


def test_an_in_memory_database_locks_per_process() -> None:
    memory = sa.create_engine("sqlite://")
    try:
        with (
            locks.try_lock(memory, "test.memory", Busy()),
            pytest.raises(Busy),
            locks.try_lock(memory, "test.memory", Busy()),
        ):
            pass
        with locks.try_lock(memory, "test.memory", Busy()):
            pass
    finally:
        memory.dispose()


def test_file_lock_stamps_its_holder_and_excludes_a_second_open(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "leader"
    first, second = locks.FileLock(path), locks.FileLock(path)
    try:
        assert first.acquire(wait=False, stamp="first\n") and first.held
        assert second.acquire(wait=False, stamp="second\n") is False and not second.held
        assert path.read_text() == "first\n", "a refused taker must not overwrite the holder"
        first.release()
        assert second.acquire(wait=False, stamp="second\n")
        assert path.read_text() == "second\n"
    finally:
        first.release()
        second.release()


def test_postgres_session_lock_is_held_across_calls_and_ends_with_an_idle_session(
    pg_url: str,
) -> None:
    engine = sa.create_engine(pg_url)
    first = locks.PostgresSessionLock(engine, "test.leader", idle_timeout_s=0.5)
    second = locks.PostgresSessionLock(engine, "test.leader")
    try:
        assert first.acquire() and first.held()
        assert second.acquire() is False and not second.connected
        first.release()
        assert not first.connected and second.acquire() and second.held()
        second.release()

        # Left idle past its timeout, Postgres ends the session and the lock goes with it.
        assert first.acquire()
        time.sleep(1.5)
        assert first.held() is False
        first.drop()  # what its holder does on finding it lost
        assert second.acquire(), "the lock of an ended session is free"
    finally:
        first.release()
        second.release()
        engine.dispose()
