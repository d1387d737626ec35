"""Run one BMC call per server, many at once: bounded overall, staggered per rack.

Powering on a rack of GPU servers at once draws an inrush current that can trip its breakers,
so power-ons in one rack start at most `per_rack` at a time and `rack_delay` seconds apart,
while racks proceed in parallel. Each job has its own result; a stalled BMC holds up only its
own slot (driver calls are bounded by their own timeouts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Job(Generic[T]):
    server: str
    rack: str
    call: Callable[[], T]
    # False: no inrush (a power-off, a read), so its rack's stagger does not hold it; lets one
    # bulk run (the provisioner's tick) mix power-ons with power-offs.
    spaced: bool = True


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    server: str
    rack: str
    value: T | None
    error: Exception | None
    started: float  # seconds since the bulk action began
    finished: float

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class Stagger:
    """Concurrency bounds. `per_rack=None` and `rack_delay=0` disable staggering (power off)."""

    workers: int = 32
    per_rack: int | None = 2
    rack_delay: float = 2.0


class _RackGate:
    """At most `limit` jobs of one rack at a time, starts at least `delay` seconds apart."""

    def __init__(
        self,
        limit: int | None,
        delay: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._slots = threading.Semaphore(limit) if limit else None
        self._delay, self._clock, self._sleep = delay, clock, sleep
        self._lock = threading.Lock()
        self._next_start = float("-inf")

    def enter(self) -> None:
        if self._slots is not None:
            self._slots.acquire()
        with self._lock:  # reserve a start time, then wait for it outside the lock
            start = max(self._clock(), self._next_start)
            self._next_start = start + self._delay
        wait = start - self._clock()
        if wait > 0:
            self._sleep(wait)

    def leave(self) -> None:
        if self._slots is not None:
            self._slots.release()


def run_bulk(
    jobs: Sequence[Job[T]],
    stagger: Stagger = Stagger(),
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_done: Callable[[Outcome[T]], None] | None = None,
) -> list[Outcome[T]]:
    """Run every job; returns outcomes in the order of `jobs`. Exceptions are results, not
    raised: one failed BMC never stops the others. `on_done` (e.g. a progress bar) is called
    from worker threads as each job ends."""
    if not jobs:
        return []
    began = clock()
    gates: dict[str, _RackGate] = {}
    for job in jobs:
        if job.rack not in gates:
            gates[job.rack] = _RackGate(stagger.per_rack, stagger.rack_delay, clock, sleep)

    def run(job: Job[T]) -> Outcome[T]:
        gate = gates[job.rack] if job.spaced else None
        if gate is not None:
            gate.enter()
        started = clock() - began
        value: T | None = None
        error: Exception | None = None
        try:
            value = job.call()
        except Exception as exc:  # a result: reported per server, never propagated
            error = exc
        finally:
            if gate is not None:
                gate.leave()
        outcome = Outcome(job.server, job.rack, value, error, started, clock() - began)
        if on_done is not None:
            on_done(outcome)
        return outcome

    # A rack waiting on its stagger must not hold a worker another rack could use: workers are
    # capped by the job count, and staggered waits are short next to BMC calls.
    with ThreadPoolExecutor(max_workers=min(stagger.workers, len(jobs))) as pool:
        return list(pool.map(run, jobs))
