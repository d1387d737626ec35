"""Leases: work that must not run twice at once across service processes (a power action on
one server), holding no database connection while the work runs.

A lease is a row — name, holder, expiry — taken with one conditional write: inserted, or
taken over from a holder whose expiry has passed. While it is held this process's keeper
renews it every third of `ttl_s`; when the work ends the row is deleted. A holder that dies
leaves its lease to expire, after which anyone may take it. Ironic reserves a node the same
way (a conditional UPDATE of its `reservation` column) and for the same reason: a session
advisory lock would pin a connection for every BMC call in flight (seconds each, up to the
call timeout), which a bulk action on slow BMCs turns into an exhausted Postgres, and it does
not survive PgBouncer in transaction mode. A lease costs a connection for a statement.

Expiries are written with this process's clock: service hosts keep time with NTP, and a lease
outlives any plausible skew (`ttl_s` is tens of seconds).

An in-memory SQLite database lives in one process and one connection per thread: there a
thread lock per name stands in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from weakref import WeakKeyDictionary, ref

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fleet.db import upsert
from fleet.models import Lease, utcnow

log = logging.getLogger(__name__)

# The default lease: long enough that a renewal missed for a database hiccup loses nothing,
# short enough that a crashed holder's servers wait only that long.
TTL_S = 30.0

_TABLE = Lease.__table__  # type: ignore[attr-defined]


def holder_token() -> str:
    """Who holds a lease, as operators read it in the table: host, pid and a unique tail."""
    return f"{socket.gethostname()[:60]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _in_memory(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite" and engine.url.database in (None, "", ":memory:")


# ---------------------------------------------------------------------------------------------
# The statements


def take(engine: Engine, name: str, holder: str, ttl_s: float, now: datetime) -> bool:
    """Take lease `name` for `holder` until now + ttl_s: insert it, or take it over if its
    expiry has passed. True if `holder` has it now. One statement: two takers of one expired
    lease cannot both win (Postgres re-checks the condition on the row it locked; SQLite runs
    one writer at a time)."""
    values = {"name": name, "holder": holder, "taken_at": now}
    values["expires_at"] = now + timedelta(seconds=ttl_s)
    statement = upsert(_TABLE, engine.dialect.name).values(values)
    statement = statement.on_conflict_do_update(
        index_elements=[_TABLE.c.name],
        set_={c: statement.excluded[c] for c in ("holder", "taken_at", "expires_at")},
        where=_TABLE.c.expires_at < now,
    )
    with engine.begin() as conn:  # RETURNING: psycopg reports no rowcount for an upsert
        return conn.execute(statement.returning(_TABLE.c.holder)).first() is not None


def renew(engine: Engine, holders: list[str], ttl_s: float, now: datetime) -> set[str]:
    """Push the expiry of every lease these holders still have to now + ttl_s; returns the
    holders that no longer have theirs (expired and taken over, or deleted)."""
    if not holders:
        return set()
    with engine.begin() as conn:
        conn.execute(
            _TABLE.update()
            .where(_TABLE.c.holder.in_(holders))
            .values(expires_at=now + timedelta(seconds=ttl_s))
        )
        kept = set(conn.execute(sa.select(_TABLE.c.holder).where(_TABLE.c.holder.in_(holders))))
    return set(holders) - {row[0] for row in kept}


def give_back(engine: Engine, name: str, holder: str) -> bool:
    """Delete lease `name` if `holder` still has it; True if it did."""
    with engine.begin() as conn:
        gone = conn.execute(_TABLE.delete().where(_TABLE.c.name == name, _TABLE.c.holder == holder))
        return gone.rowcount == 1


# ---------------------------------------------------------------------------------------------
# The keeper: one per database and ttl in a process, renewing what this process holds


class Keeper:
    """Renews this process's leases on one database, all in one statement, every third of
    `ttl_s`; its thread runs only while a lease is held. A renewal that fails (the database
    away) is retried next period: the leases hold until their expiry meanwhile."""

    def __init__(
        self, engine: Engine, ttl_s: float = TTL_S, clock: Callable[[], datetime] = utcnow
    ) -> None:
        # Weakly: the registry below keys keepers by engine, and a strong reference here would
        # keep every engine (and its keeper) alive for good.
        self._engine = ref(engine)
        self.ttl_s = ttl_s
        self.clock = clock
        self._held: dict[str, str] = {}  # holder token → lease name
        self._lost: set[str] = set()
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    @property
    def engine(self) -> Engine:
        engine = self._engine()
        if engine is None:  # only while a lease is held is it used, and the holder has it
            raise RuntimeError("the keeper's engine is gone")
        return engine

    @contextlib.contextmanager
    def hold(self, name: str, busy: Exception) -> Iterator[None]:
        """Hold lease `name` for the block, or raise `busy` at once if another holder has it
        (never queued). A lease lost meanwhile (renewals failing past its expiry) is logged
        when the block ends: the work cannot be called back."""
        holder = holder_token()
        if not take(self.engine, name, holder, self.ttl_s, self.clock()):
            raise busy
        with self._guard:
            self._held[holder] = name
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fleet-lease-keeper", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._guard:
                self._held.pop(holder, None)
                lost = holder in self._lost
                self._lost.discard(holder)
            if lost:
                log.warning("lease %s was lost while held (renewals failed past its expiry)", name)
            try:
                give_back(self.engine, name, holder)
            except sa.exc.SQLAlchemyError as exc:  # it expires by itself
                log.warning(
                    "lease %s not given back (%s); it expires in %g s", name, exc, self.ttl_s
                )

    def renew_now(self) -> set[str]:
        """Renew every lease held; returns the names of those lost. (The thread's step; tests
        call it with a clock of their own.)"""
        with self._guard:
            holders = list(self._held)
        lost = renew(self.engine, holders, self.ttl_s, self.clock())
        with self._guard:
            self._lost |= lost & set(self._held)
            return {self._held[h] for h in lost if h in self._held}

    def _run(self) -> None:
        while True:
            self._wake.wait(self.ttl_s / 3)
            with self._guard:
                if not self._held:
                    self._thread = None
                    return
            try:
                lost = self.renew_now()
            except sa.exc.SQLAlchemyError as exc:
                log.warning("leases not renewed (%s): retried in %g s", exc, self.ttl_s / 3)
                continue
            for name in sorted(lost):
                log.warning("lease %s lost: another holder took it after it expired", name)


_keepers: WeakKeyDictionary[Engine, dict[float, Keeper]] = WeakKeyDictionary()
_keepers_guard = threading.Lock()


def keeper_for(engine: Engine, ttl_s: float = TTL_S) -> Keeper:
    """This process's keeper for `engine` and `ttl_s`."""
    with _keepers_guard:
        per_ttl = _keepers.setdefault(engine, {})
        if ttl_s not in per_ttl:
            per_ttl[ttl_s] = Keeper(engine, ttl_s)
        return per_ttl[ttl_s]


_thread_locks: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def hold(engine: Engine, name: str, busy: Exception, *, ttl_s: float = TTL_S) -> Iterator[None]:
    """Hold lease `name` on `engine`'s database for the block, or raise `busy` at once."""
    if _in_memory(engine):
        with _keepers_guard:
            lock = _thread_locks.setdefault(name, threading.Lock())
        if not lock.acquire(blocking=False):
            raise busy
        try:
            yield
        finally:
            lock.release()
        return
    with keeper_for(engine, ttl_s).hold(name, busy):
        yield
