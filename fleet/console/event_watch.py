"""The settled Event id, read at most once per poll interval per process, for every open event
feed of the console (fleet/console/routes.py).

Each open feed used to run its own filtered query every second: a hundred operators' open
feeds were a hundred queries a second whether anything happened or not. Now a feed asks the
shared watch for the settled id (one index range read per interval whatever the number of
feeds) and runs its own filtered query, for the events up to it, only when it moved past what
the feed last saw.

Settled, not newest: on Postgres an event's id is taken from a sequence when its row is
inserted, and transactions commit in any order, so id 7 can become visible after id 8. A feed
that went on from the newest id it had sent would never send 7. The watch moves its mark over
ids that are visible one after another and stops at a gap: an id not visible yet (its
transaction still open) or never to be (rolled back: a sequence does not hand an id out
twice). A gap still there `grace_s` after the watch first saw it is given up, so a rollback
delays the feeds by `grace_s` once, and an event committed more than `grace_s` after a later
one is not sent (as before this watch, for every late commit). On SQLite, writers take turns
and ids commit in order; a gap is a rolled-back id at most.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

GAP_GRACE_S = 5.0  # a missing id is waited for this long, then passed (rolled back or stuck)
READ_LIMIT = 1000  # ids read per query; a poll reads on while a read comes back full
MAX_READS = 10  # queries per poll at most (10,000 events a second; the next poll goes on)


class EventWatch:
    """`newest()`: the settled Event id (module doc), at most `poll_s` old. Created in the
    event loop that uses it (its lock belongs to that loop).

    `read_newest()` is the newest id, read once, where the watch starts (the events before the
    process watched are the pages' business); `read_ids(after, limit)` the visible ids above
    `after`, ascending, `limit` at most."""

    def __init__(
        self,
        read_newest: Callable[[], int],
        read_ids: Callable[[int, int], list[int]],
        poll_s: float,
        clock: Callable[[], float] = time.monotonic,
        grace_s: float = GAP_GRACE_S,
    ) -> None:
        self._read_newest = read_newest
        self._read_ids = read_ids
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._settled: int | None = None
        self._read_at: float | None = None
        # The gaps seen, by the visible id just above each: when the watch first saw it
        self._gaps: dict[int, float] = {}
        self.reads = 0  # database reads so far (the tests count them)

    async def newest(self) -> int:
        async with self._lock:  # one read at a time; the others take its answer
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self.poll_s:
                await asyncio.to_thread(self._poll, now)
                self._read_at = self._clock()
            return self._settled or 0

    def _poll(self, now: float) -> None:
        if self._settled is None:
            self._settled = self._read_newest()
            self.reads += 1
            return
        for _ in range(MAX_READS):
            ids = self._read_ids(self._settled, READ_LIMIT)
            self.reads += 1
            self._settled = self.advance(self._settled, ids, now)
            if len(ids) < READ_LIMIT or self._settled < ids[-1]:
                break
        for above in [a for a in self._gaps if a <= self._settled]:
            del self._gaps[above]  # passed or filled

    def advance(self, settled: int, ids: list[int], now: float) -> int:
        """The settled id after `settled`, given the visible ids above it (ascending): on to
        each next id, and past a gap the watch has seen for `grace_s`; up to a newer gap."""
        for i in ids:
            if i != settled + 1:  # ids settled+1 .. i-1 are not visible
                since = self._gaps.setdefault(i, now)
                if now - since < self.grace_s:
                    break
            settled = i
        return settled
