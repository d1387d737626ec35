"""Named locks that every service process sharing one database sees.

- **Postgres**: advisory locks. `transaction_lock` a transaction lock on the caller's session,
  released when that transaction ends; `PostgresSessionLock` a session lock held across calls
  (the leader's), which Postgres drops with the connection.
- **SQLite** (one host): an exclusive `flock` on a file beside the database. flock belongs to
  an open file description, so it excludes other threads of this process as well as other
  processes, and the kernel releases it when its holder dies. An in-memory database lives in
  one process: a thread lock per name.

A lock is named by a string; Postgres keys are its crc32 (`lock_key`), the same for every
process and release. Work that must not run twice but may take seconds of I/O (a power action
on a server) takes a lease instead (fleet/leases.py): a lock here holds a connection.
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
from sqlalchemy.engine import Connection, Engine
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


# ---------------------------------------------------------------------------------------------
# Held across calls: the leader's


class PostgresSessionLock:
    """A session advisory lock on a connection of its own (no pool): the lock lives and dies
    with exactly one connection. With `idle_timeout_s`, Postgres ends that session once it has
    been idle that long, and the lock with it: the holder touches it (`held`) well inside."""

    def __init__(self, engine: Engine, name: str, idle_timeout_s: float | None = None) -> None:
        self.name = name
        self.key = lock_key(name)
        self.idle_timeout_s = idle_timeout_s
        self._engine = sa.create_engine(
            engine.url, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT", hide_parameters=True
        )
        self._conn: Connection | None = None

    @property
    def connected(self) -> bool:
        """Whether it holds (or held until it was lost) a lock connection."""
        return self._conn is not None

    def acquire(self) -> bool:
        """Try once, without waiting; True once held. Raises sa.exc.DBAPIError when the
        database cannot be reached or the attempt fails."""
        if self._conn is not None:
            return True
        conn = self._engine.connect()
        try:
            if self.idle_timeout_s is not None:
                timeout_ms = max(int(self.idle_timeout_s * 1000), 1)
                conn.execute(sa.text(f"SET idle_session_timeout = {timeout_ms}"))
            got = conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar()
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        if not got:
            conn.close()
            return False
        self._conn = conn
        return True

    def held(self) -> bool:
        """Whether the lock is still held: asks Postgres (which also touches the connection)."""
        conn = self._conn
        if conn is None:
            return False
        try:
            return bool(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                        " AND pid = pg_backend_pid() AND objid = :low AND classid = :high"
                    ),
                    {"low": self.key & 0xFFFFFFFF, "high": self.key >> 32},
                ).scalar()
            )
        except sa.exc.DBAPIError:
            return False

    def release(self) -> None:
        """Unlock (when the connection still answers) and drop the connection."""
        if self._conn is not None:
            # A connection that died meanwhile raises (or wants a rollback): nothing to unlock.
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                self._conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
        self.drop()

    def drop(self) -> None:
        """Let the connection go (the lock was lost, or is being given up)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()
