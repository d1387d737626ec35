"""The server state machine: the one place that writes `Server.state`.

`transition()` checks the move against `fleet.states.TRANSITIONS`, then writes the new state and
its Event in the caller's transaction (or its own), so the two can never disagree. Moving a
server to the state it is already in is a no-op: control loops may repeat themselves freely.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, select

from fleet.errors import IllegalTransitionError, NotFoundError
from fleet.models import Event, Server, utcnow
from fleet.states import INITIAL, ServerState, allowed_targets, is_allowed


def enroll(session: Session, server: Server, actor: str, reason: str) -> Event:
    """Give a newly created server its initial state and record its arrival."""
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

    The server row is locked for the move (SELECT … FOR UPDATE on Postgres) so two writers
    cannot both read `serving` and both move on from it.
    """
    name = server if isinstance(server, str) else server.name
    # populate_existing: re-read the locked row even if this session already holds a (possibly
    # stale) copy, so the legality check always sees the state as it is now.
    row = session.exec(
        select(Server)
        .where(Server.name == name)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"no server named {name!r}")
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
    row.state = to
    row.state_changed_at = now
    row.updated_at = now
    session.add(row)
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
    if not isinstance(server, str) and server is not row:
        server.state, server.state_changed_at = row.state, row.state_changed_at
    return event
