"""Leader election for the fleet's singleton loops (reconciler, autoscaler, calendar, ...).

Any number of service processes may serve the API; the loops that act on the fleet run in one
of them, the leader.

- **Postgres**: the leader holds the lease `leader:<name>` (fleet/leases.py: a row with a holder
  and an expiry `lease_s` ahead), renewed by a heartbeat thread every third of the lease. No
  connection is held between statements, so PgBouncer in transaction mode is fine. A process
  that dies or is stopped (SIGSTOP, a debugger, a VM paused for minutes) stops renewing; once
  the lease has expired a follower takes it at its next attempt. A process that exits cleanly
  gives the lease back at once. A leader that wakes up after a pause has not confirmed its
  lease for more than half a lease: it asks the database before it acts, finds the lease taken
  and steps down.
- **SQLite** (the embedded default, one host): an exclusive `flock` on a file beside the
  database. The kernel releases it when the process dies.

`is_leader()` is asked at the start of every tick: it re-checks the lock, it does not trust a
flag set minutes ago. `StepDown` wraps a leadership: a leader whose loops keep failing releases
the lock and follows for a back-off, so that another replica takes over.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fleet import leases
from fleet.locks import FileLock
from fleet.models import utcnow

log = logging.getLogger(__name__)


def identity() -> str:
    """Who holds the lock, as events and logs name it."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Leadership(Protocol):
    name: str

    def is_leader(self) -> bool:
        """True when this process holds the lock now (acquiring it if it is free)."""
        ...

    def release(self) -> None: ...


def leadership_for(engine: Engine, name: str, lease_s: float) -> Leadership:
    if engine.dialect.name == "postgresql":
        return LeaseLeadership(engine, name, lease_s)
    database = engine.url.database
    if not database or database == ":memory:":
        return SoleProcess(name)
    return FileLeadership(Path(database).with_suffix(f".{name}.leader"), name)


class SoleProcess:
    """An in-memory database lives in one process: that process leads."""

    def __init__(self, name: str) -> None:
        self.name = name

    def is_leader(self) -> bool:
        return True

    def release(self) -> None:
        return None


class FileLeadership:
    """An exclusive, non-blocking flock on a file beside the SQLite database (fleet/locks.py),
    the holder's name written in it."""

    def __init__(self, path: Path, name: str) -> None:
        self.name = name
        self._lock = FileLock(path)
        self._guard = threading.Lock()

    def is_leader(self) -> bool:
        with self._guard:
            return self._lock.acquire(wait=False, stamp=identity() + "\n")

    def release(self) -> None:
        with self._guard:
            self._lock.release()


class LeaseLeadership:
    """The lease `leader:<name>` (fleet/leases.py), renewed by a heartbeat every third of the
    lease; no connection is held between statements."""

    def __init__(
        self,
        engine: Engine,
        name: str,
        lease_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("the leader lease must be positive")
        self.name = name
        self.lease_s = lease_s
        self.lease = f"leader:{name}"
        self._engine = engine
        self._clock = clock
        self._guard = threading.Lock()
        self._holder: str | None = None  # this process's token while it leads
        self._confirmed_at = 0.0  # when the last renewal that found the lease ours was sent
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def is_leader(self) -> bool:
        with self._guard:
            # Confirmed within half a lease: nobody can have taken it since. Older (this
            # process was stopped, or renewals failed): ask the database before acting.
            fresh = self._clock() - self._confirmed_at < self.lease_s / 2
            if self._holder is not None and (fresh or self._renew()):
                return True
            return self._try_take()

    def release(self) -> None:
        self._stop.set()
        with self._guard:
            holder, self._holder = self._holder, None
            if holder is not None:
                try:
                    leases.give_back(self._engine, self.lease, holder)
                except sa.exc.SQLAlchemyError as exc:  # it expires by itself
                    log.warning("leader %s: lease not given back (%s)", self.name, exc)
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=self.lease_s)

    # -----------------------------------------------------------------------------------------

    def _try_take(self) -> bool:
        holder = leases.holder_token()
        try:
            got = leases.take(self._engine, self.lease, holder, self.lease_s, utcnow())
        except sa.exc.SQLAlchemyError as exc:
            log.warning("leader %s: lease attempt failed: %s", self.name, exc)
            return False
        if not got:
            return False
        self._holder, self._confirmed_at = holder, self._clock()
        log.info("leader %s: this process (%s) now leads", self.name, identity())
        self._start_heartbeat()
        return True

    def _renew(self) -> bool:
        """Push the lease's expiry out; False (and no longer leading) once it is not ours.
        A renewal that fails for the database keeps the lead until the lease could have run out.
        Called under the guard."""
        assert self._holder is not None
        sent_at = self._clock()
        try:
            lost = leases.renew(self._engine, [self._holder], self.lease_s, utcnow())
        except sa.exc.SQLAlchemyError as exc:
            if sent_at - self._confirmed_at < self.lease_s:
                log.warning("leader %s: renewal failed (%s); retried", self.name, exc)
                return True
            log.warning("leader %s: renewals failed past the lease (%s)", self.name, exc)
            lost = {self._holder}
        if lost:
            log.warning("leader %s: lost the lease; stepping down", self.name)
            self._holder = None
            self._stop.set()
            return False
        self._confirmed_at = sent_at
        return True

    def _start_heartbeat(self) -> None:
        """A fresh heartbeat per lead: the one before it stopped when the lead was lost."""
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat,
            args=(self._stop,),
            name=f"leader-heartbeat {self.name}",
            daemon=True,
        )
        self._heartbeat.start()

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.lease_s / 3):
            with self._guard:
                if stop.is_set() or self._holder is None or not self._renew():
                    return


class StepDown:
    """A `Leadership` that gives the lead away when its loops keep failing.

    The loops sharing one leadership report every tick (`record`). After `max_failures` failed
    ticks in a row (across those loops: any good tick resets the count) the lock is released
    and this process follows for `backoff_s`, whatever the lock, so that another replica takes
    over: a leader that cannot act (its pool exhausted, its BMC network cut, a bug) must not
    keep the lock while a healthy replica could act. After the back-off it contends again like
    any follower. `on_step_down(reason)` is told (once per step-down, on the loop thread).
    """

    def __init__(
        self,
        inner: Leadership,
        max_failures: int,
        backoff_s: float,
        *,
        on_step_down: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or backoff_s <= 0:
            raise ValueError("step-down: max_failures must be >= 1 and backoff_s positive")
        self.name = inner.name
        self.max_failures = max_failures
        self.backoff_s = backoff_s
        self._inner = inner
        self._on_step_down = on_step_down
        self._clock = clock
        self._guard = threading.Lock()
        self._failures = 0
        self._following_until: float | None = None
        self.reason: str | None = None  # why it last stepped down

    @property
    def backing_off(self) -> bool:
        with self._guard:
            return self._backing_off()

    def _backing_off(self) -> bool:
        return self._following_until is not None and self._clock() < self._following_until

    def is_leader(self) -> bool:
        # Under the guard: a loop thread asking now must not take the lock back just after
        # another one's tick released it.
        with self._guard:
            return not self._backing_off() and self._inner.is_leader()

    def release(self) -> None:
        self._inner.release()

    def record(self, ok: bool, error: str | None = None) -> None:
        """One tick's outcome (SingletonLoop's `on_tick`)."""
        with self._guard:
            if ok:
                self._failures = 0
                return
            self._failures += 1
            # A tick still running when it stepped down may fail late: that is not news.
            if self._failures < self.max_failures or self._backing_off():
                return
            self._failures = 0
            self._following_until = self._clock() + self.backoff_s
            self.reason = (
                f"{self.max_failures} control-loop ticks failed in a row (last: {error}); "
                f"following for {self.backoff_s:g} s"
            )
            reason = self.reason
            self._inner.release()
        log.error("leader %s: %s gives up the lead: %s", self.name, identity(), reason)
        if self._on_step_down is not None:
            try:
                self._on_step_down(reason)
            except Exception:  # e.g. the Event write, when the database is what fails
                log.exception("leader %s: step-down callback failed", self.name)
