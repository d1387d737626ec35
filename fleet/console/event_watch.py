"""The newest Event id, read at most once per poll interval per process, for every open event
feed of the console (fleet/console/routes.py).

Each open feed used to run its own filtered query every second: a hundred operators' open
feeds were a hundred queries a second whether anything happened or not. Now a feed asks the
shared watch for the newest id (one `max(id)` read per interval whatever the number of feeds,
an index lookup) and runs its own filtered query only when that id moved past what it last
saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class EventWatch:
    """`newest()`: the newest Event id, at most `poll_s` old. Created in the event loop that
    uses it (its lock belongs to that loop)."""

    def __init__(
        self,
        read_newest: Callable[[], int],
        poll_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read_newest
        self.poll_s = poll_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._value = 0
        self._read_at: float | None = None
        self.reads = 0  # database reads so far (the tests count them)

    async def newest(self) -> int:
        async with self._lock:  # one read at a time; the others take its answer
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self.poll_s:
                self._value = await asyncio.to_thread(self._read)
                self._read_at = self._clock()
                self.reads += 1
            return self._value
