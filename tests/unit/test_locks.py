"""fleet/locks.py on both databases: `transaction_lock` waits, the file lock excludes a second
open, the leader's session lock ends with its idle connection; the keys stay what they were.
(The per-server power lock is a lease: tests/unit/test_leases.py.)"""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet import locks


class Busy(Exception):
    pass


def test_lock_keys_are_the_crc32_of_the_names_they_always_had() -> None:
    """Another release's processes must contend for the same keys: never change a name."""
    assert locks.lock_key("fleet.placement") == 61836565
    assert locks.lock_key("fleet.leader:control") == 2919472429


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
