"""The server state machine: the one place that writes `Server.state`.

`transition()` checks the move against `fleet.lifecycle.states.TRANSITIONS`, then writes the new
state with
a compare-and-set UPDATE and its Event in the caller's transaction (or its own), so the two can
never disagree. Moving a server to the state it is already in is a no-op: control loops may
repeat themselves freely. (`Server.state` refuses any other writer: see fleet/models.py.)
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, col, select

from fleet.errors import ConflictError, IllegalTransitionError, NotFoundError
from fleet.lifecycle.states import INITIAL, ServerState, allowed_targets, is_allowed
from fleet.models import Event, Server, utcnow

# Each retry means another writer moved the server between our read and our write.
_ATTEMPTS = 3


def enroll(session: Session, server: Server, actor: str, reason: str) -> Event:
    """Record the arrival of a server not yet in the database (it starts in the initial state)."""
    server.state = INITIAL
    server.state_changed_at = utcnow()
    session.add(server)
    event = Event(
        subject_type="server",
        subject=server.name,
        actor=actor,
        kind="server.enrolled",
        from_state=None,
        to_state=INITIAL.value,
        message=reason,
    )
    session.add(event)
    return event


def enroll_many(
    session: Session, rows: list[dict[str, Any]], actor: str, reason: str
) -> dict[str, int]:
    """`enroll` for many servers at once (an inventory import): each row holds a server's
    columns but its state; servers and their Events go in as plain rows, a batch each, and
    the new ids come back by name. No ORM objects: building 10,000 of them took longer than
    writing them (bench/inventory.py). The rows' keys must be the same in every row."""
    if not rows:
        return {}
    now = utcnow()
    server, event = Server.__table__, Event.__table__  # type: ignore[attr-defined]
    # Without RETURNING, the driver's executemany sends one prepared statement per row
    # (psycopg pipelines them); a multi-row VALUES would be parsed afresh for each batch.
    session.execute(
        sa.insert(server), [{**row, "state": INITIAL, "state_changed_at": now} for row in rows]
    )
    session.execute(
        sa.insert(event),
        [
            {
                "at": now,
                "subject_type": "server",
                "subject": row["name"],
                "actor": actor,
                "kind": "server.enrolled",
                "from_state": None,
                "to_state": INITIAL.value,
                "message": reason,
                "details": {},
            }
            for row in rows
        ],
    )
    wanted = {row["name"] for row in rows}
    return {
        name: id_
        for id_, name in session.execute(sa.select(server.c.id, server.c.name))
        if name in wanted
    }


def _read(session: Session, name: str) -> Server:
    # FOR UPDATE locks the row on Postgres; populate_existing re-reads it even if this session
    # already holds a (possibly stale) copy.
    row = session.exec(
        select(Server)
        .where(Server.name == name)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"no server named {name!r}")
    return row


def transition(
    session: Session,
    server: Server | str,
    to: ServerState,
    actor: str,
    reason: str,
    details: dict[str, Any] | None = None,
    *,
    commit: bool = True,
) -> Event | None:
    """Move `server` to `to`; returns the Event written, or None when already there.

    The UPDATE only matches while the server is still in the state the move was checked
    against, so two writers can never both move it on from the same state — on SQLite too,
    where SELECT … FOR UPDATE locks nothing.
    """
    name = server if isinstance(server, str) else server.name
    for _ in range(_ATTEMPTS):
        row = _read(session, name)
        current = ServerState(row.state)
        if current == to:
            return None
        if not is_allowed(current, to):
            allowed = ", ".join(s.value for s in allowed_targets(current)) or "none (terminal)"
            raise IllegalTransitionError(
                f"server {name}: cannot move from {current.value} to {to.value} "
                f"(allowed from {current.value}: {allowed})"
            )
        now = utcnow()
        moved = session.connection().execute(
            sa.update(Server)
            .where(col(Server.id) == row.id, col(Server.state) == current)
            .values(state=to, state_changed_at=now, updated_at=now)
        )
        if moved.rowcount == 1:
            break
    else:
        raise ConflictError(f"server {name} kept changing state while moving it; try again")
    for key, value in (("state", to), ("state_changed_at", now), ("updated_at", now)):
        set_committed_value(row, key, value)
        if not isinstance(server, str) and server is not row:
            set_committed_value(server, key, value)
    event = Event(
        at=now,
        subject_type="server",
        subject=name,
        actor=actor,
        kind="server.transition",
        from_state=current.value,
        to_state=to.value,
        message=reason,
        details=details or {},
    )
    session.add(event)
    if commit:
        session.commit()
    return event
