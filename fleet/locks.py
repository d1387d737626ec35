"""Named locks that every service process sharing one database sees.

- **Postgres**: a transaction advisory lock on the caller's session (`transaction_lock`),
  released when that transaction ends (which PgBouncer in transaction mode keeps on one server
  connection).
- **SQLite** (one host): an exclusive `flock` on a file beside the database. flock belongs to
  an open file description, so it excludes other threads of this process as well as other
  processes, and the kernel releases it when its holder dies. An in-memory database lives in
  one process: a thread lock per name.

A lock is named by a string; Postgres keys are its crc32 (`lock_key`), the same for every
process and release. Work that must not run twice but may take seconds of I/O (a power action
on a server) or be held across calls (the leader's) takes a lease instead (fleet/leases.py):
a lock here holds a connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session


def lock_key(name: str) -> int:
    """The advisory lock key of `name` (crc32: stable across processes and releases)."""
    return zlib.crc32(name.encode())


# ---------------------------------------------------------------------------------------------
# SQLite: a file lock


class FileLock:
    """An exclusive flock on `path`, held from `acquire` until `release`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, *, wait: bool, stamp: str | None = None) -> bool:
        """Take the lock (`wait`: block until it is free); True once held. `stamp`, if given,
        replaces the file's content once the lock is held (who holds it)."""
        if self._file is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        except BaseException:
            handle.close()
            raise
        if stamp is not None:
            handle.seek(0)
            handle.truncate()
            handle.write(stamp)
            handle.flush()
        self._file = handle
        return True

    def release(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def _lock_file(engine: Engine, name: str) -> Path | None:
    """The file that stands for lock `name` on a SQLite file database (None: in memory)."""
    database = engine.url.database
    if not database or database == ":memory:":
        return None
    return Path(f"{database}.locks") / f"{lock_key(name)}.lock"


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _thread_lock(name: str) -> threading.Lock:
    with _thread_locks_guard:
        return _thread_locks.setdefault(name, threading.Lock())


@contextlib.contextmanager
def _local_lock(engine: Engine, name: str, *, wait: bool) -> Iterator[bool]:
    """SQLite: yields whether lock `name` is held (always, when `wait`)."""
    path = _lock_file(engine, name)
    if path is None:
        lock = _thread_lock(name)
        got = lock.acquire(blocking=wait)
        try:
            yield got
        finally:
            if got:
                lock.release()
        return
    file_lock = FileLock(path)
    got = file_lock.acquire(wait=wait)
    try:
        yield got
    finally:
        file_lock.release()


# ---------------------------------------------------------------------------------------------
# Held for a transaction


@contextlib.contextmanager
def transaction_lock(session: Session, name: str) -> Iterator[None]:
    """Hold lock `name` for `session`'s current transaction, waiting for it if need be.

    Postgres: a transaction advisory lock, released when the transaction commits or rolls
    back (so commit inside the block). SQLite: held until the block ends."""
    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    if engine.dialect.name == "postgresql":
        session.connection().execute(
            sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key(name)}
        )
        yield
        return
    with _local_lock(engine, name, wait=True):
        yield
