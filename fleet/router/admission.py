"""The router's bounded waiting room, per deployment (pure: no clock, no I/O).

When every replica of a deployment is at its concurrency limit, a request waits here;
interactive requests leave before batch ones (FIFO within a class). Beyond `bound` waiting
requests the router answers 429 with Retry-After: a bounded queue keeps latency bounded and
tells clients to back off, where an unbounded one would only hide the overload. The depth is an
autoscaler signal.

`fluid_waits` sizes the bound: the backlog a burst builds even with perfect routing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Generic, Literal, TypeVar

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")
T = TypeVar("T")


class AdmissionQueue(Generic[T]):
    def __init__(self, bound: int) -> None:
        if bound < 0:
            raise ValueError("the queue bound must be at least 0")
        self.bound = bound
        self._waiting: dict[Priority, deque[T]] = {p: deque() for p in PRIORITIES}
        self._size = 0  # both classes (asked after every request: kept, not summed)

    def __len__(self) -> int:
        return self._size

    def depth(self, priority: Priority) -> int:
        return len(self._waiting[priority])

    def push(self, item: T, priority: Priority) -> bool:
        """Queue `item`; False when the queue is full (the caller answers 429)."""
        if self._size >= self.bound:
            return False
        self._waiting[priority].append(item)
        self._size += 1
        return True

    def ordered(self) -> list[T]:
        """Every waiting item, in the order `pop` would return them."""
        if not self._size:
            return []
        return [item for priority in PRIORITIES for item in self._waiting[priority]]

    def peek(self) -> T | None:
        """The item `pop` would return, left in place."""
        for priority in PRIORITIES:
            if self._waiting[priority]:
                return self._waiting[priority][0]
        return None

    def pop(self) -> T | None:
        """The next item to admit: the oldest interactive one, else the oldest batch one."""
        for priority in PRIORITIES:
            if self._waiting[priority]:
                self._size -= 1
                return self._waiting[priority].popleft()
        return None

    def remove(self, item: T) -> bool:
        """Take back an item that gave up waiting (timeout, client gone)."""
        for queue in self._waiting.values():
            try:
                queue.remove(item)
                self._size -= 1
                return True
            except ValueError:
                continue
        return False


def fluid_waits(arrivals: Sequence[float], rate: float) -> list[float]:
    """Each arrival's wait (seconds) in one first-come-first-served queue drained at `rate`
    requests per second: the fleet as a fluid at its full capacity, so with perfect routing.
    A wait times `rate` is the backlog that request found, so max(waits) · rate is what the
    waiting room must hold for that burst (the requests in flight aside), and no FIFO router
    makes requests wait less. `arrivals` in time order."""
    if not rate > 0:
        raise ValueError("the rate must be positive")
    waits: list[float] = []
    backlog = 0.0  # requests (fractional: a fluid)
    last = arrivals[0] if arrivals else 0.0
    for at in arrivals:
        drained = (at - last) * rate
        backlog = backlog - drained if backlog > drained else 0.0
        last = at
        waits.append(backlog / rate)
        backlog += 1.0
    return waits
