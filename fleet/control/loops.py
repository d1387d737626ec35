"""Singleton control loops: a tick every `interval` seconds, only while this process leads.

A `SingletonLoop` owns one thread. Each tick first asks its `Leadership` (which re-checks the
lock, fleet/control/leader.py); a follower tries again at the next tick. A tick that raises is
logged
and counted, and the loop carries on: one bad tick must not stop the reconciler for good. Each
tick's outcome also goes to `on_tick` (fleet/control/leader.py's `StepDown` counts failures in a row
across the loops of one leadership: a leader whose loops keep failing gives the lead away).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.control.leader import Leadership

log = logging.getLogger(__name__)


@dataclass
class LoopStats:
    leader: bool = False
    ticks: int = 0
    failed_ticks: int = 0
    leader_changes: int = 0
    last_tick_s: float = 0.0
    last_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class SingletonLoop:
    def __init__(
        self,
        name: str,
        interval_s: float,
        tick: Callable[[], object],
        leadership: Leadership,
        *,
        on_leadership: Callable[[bool], None] | None = None,
        on_tick: Callable[[bool, str | None], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"loop {name}: the interval must be positive")
        self.name = name
        self.interval_s = interval_s
        self.stats = LoopStats()
        self._tick = tick
        self._leadership = leadership
        self._on_leadership = on_leadership
        self._on_tick = on_tick
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"loop {self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.signal_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self._leadership.release()

    def signal_stop(self) -> None:
        """Ask the thread to end after its current tick (stop() also waits and releases)."""
        self._stop.set()
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Tick now rather than at the end of the interval (another loop has work for it)."""
        self._wake.set()

    def run_once(self) -> bool:
        """One tick if this process leads; returns whether it led."""
        leading = self._leadership.is_leader()
        with self.stats.lock:
            if leading != self.stats.leader:
                self.stats.leader = leading
                self.stats.leader_changes += 1
                changed = True
            else:
                changed = False
        if changed:
            log.info("loop %s: %s", self.name, "leading" if leading else "following")
            if self._on_leadership is not None:
                try:
                    self._on_leadership(leading)
                except Exception:  # e.g. the Event write during a database outage
                    log.exception("loop %s: leadership callback failed", self.name)
        if not leading:
            return False
        started = time.monotonic()
        error: str | None = None
        try:
            self._tick()
        except Exception as exc:  # a loop must survive a bad tick
            log.exception("loop %s: tick failed", self.name)
            error = f"{type(exc).__name__}: {exc}"
            with self.stats.lock:
                self.stats.failed_ticks += 1
                self.stats.last_error = error
        with self.stats.lock:
            self.stats.ticks += 1
            self.stats.last_tick_s = time.monotonic() - started
        if self._on_tick is not None:
            # The first line, bounded: it goes into a log line and an Event (no SQL text).
            brief = None if error is None else f"{self.name}: {error.splitlines()[0][:200]}"
            self._on_tick(error is None, brief)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.run_once()
            except Exception:  # the lock check itself failed: try again next tick
                log.exception("loop %s: leadership check failed", self.name)
            # Ticks start `interval` apart (sooner when woken); a tick longer than that is
            # followed at once.
            self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
            self._wake.clear()


class Alongside:
    """A Leadership that contends for nothing: it leads while `loop` last found this process
    leading. For a loop that ticks too often to ask the lease each time (a follower's ask is
    a write: fleet/control/wakeups.py's watch reads 10 times a second)."""

    def __init__(self, loop: SingletonLoop) -> None:
        self.name = f"alongside {loop.name}"
        self._loop = loop

    def is_leader(self) -> bool:
        with self._loop.stats.lock:
            return self._loop.stats.leader

    def release(self) -> None:
        """Nothing held: `loop` gives its lease back itself."""


def stop_all(loops: list[SingletonLoop], timeout: float) -> list[str]:
    """Stop every loop within `timeout` seconds in all (a tick blocked in a BMC call is left
    behind: the threads are daemons); returns the names of the loops still running."""
    deadline = time.monotonic() + timeout
    for loop in loops:
        loop.signal_stop()
    for loop in loops:
        loop.stop(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [loop.name for loop in loops if loop.running]
    if stuck:
        log.warning("loops %s still in a tick after %.1f s: left behind", ", ".join(stuck), timeout)
    return stuck
