"""Waking the leader's provisioner from any replica, instead of leaving it to its next tick.

A change the provisioner acts on (a spare asked to boot, an agent that registered, became ready
or finished draining, a new health verdict) bumps the `wakeup` row's counter in the
transaction that made it (`request`). The leader's `watch` loop reads the counters every
`wake_poll_s` and wakes the loop whose counter moved. Without it, each step of a boot (power-on,
booting → loading, loading → serving) waited up to one tick (5 s) for the provisioner.

A row rather than Postgres's LISTEN/NOTIFY: a LISTEN needs a session of its own, which
PgBouncer in transaction mode does not give (docs/api.md), and SQLite has none; a bump is
visible only once its transaction committed, so the woken loop sees the change it was woken
for. The ticks stay: a lost wake-up (a leader that changed hands) costs one tick, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet.db import upsert
from fleet.models import Wakeup

PROVISIONER = "provisioner"
QUIET_S = 30.0
log = logging.getLogger(__name__)
_TABLE = Wakeup.__table__  # type: ignore[attr-defined]


def request(session: Session, loop: str = PROVISIONER) -> None:
    """Wake `loop` in the leader once the caller's transaction commits (a row lock held until
    then: callers bump only on the rare changes named above, not on every heartbeat). An
    upsert: the migration seeds the row, and a missing one is made, never an error. Call it
    after the transaction's other writes (its statement flushes them first): the row is then
    always the last lock a transaction takes, and no two wait on each other through it."""
    statement = upsert(_TABLE, session.get_bind().dialect.name).values(name=loop, seq=1)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[_TABLE.c.name], set_={"seq": _TABLE.c.seq + 1}
        )
    )


class Watch:
    """The leader's side: `tick()` reads the counters and calls the waker of each loop whose
    counter moved since the last read (the first read only remembers them)."""

    def __init__(self, engine: Engine, wakers: Mapping[str, Callable[[], None]]) -> None:
        self._engine = engine
        self._wakers = dict(wakers)
        self._seen: dict[str, int] | None = None
        self._warned_at = -QUIET_S

    def tick(self) -> None:
        """One read. A database that fails it is the other loops' news (they log it): ten
        tracebacks a second through an outage would drown it, so a warning at most every
        `QUIET_S`; the provisioner's own ticks go on meanwhile."""
        try:
            self._read()
        except sa.exc.SQLAlchemyError as exc:
            now = time.monotonic()
            if now - self._warned_at >= QUIET_S:
                self._warned_at = now
                first = str(exc).strip().splitlines()
                log.warning(
                    "wake-ups not read (%s: %s)", type(exc).__name__, first[0] if first else ""
                )

    def _read(self) -> None:
        with self._engine.connect() as conn:
            now = {
                name: int(seq) for name, seq in conn.execute(sa.select(_TABLE.c.name, _TABLE.c.seq))
            }
        seen, self._seen = self._seen, now
        if seen is None:
            return
        for name, waker in self._wakers.items():
            if now.get(name) != seen.get(name):
                waker()
