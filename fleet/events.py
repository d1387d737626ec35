"""The event log: append-only; recorded by the services, queried by subject, kind and time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.models import Event, EventPublic, as_utc, utcnow


def deployment_event(
    name: str, at: datetime, actor: str, kind: str, message: str, details: dict[str, Any]
) -> Event:
    """An Event about a deployment (scaled, its floor moved, …), its message cut to fit."""
    return Event(
        at=at,
        subject_type="deployment",
        subject=name,
        actor=actor,
        kind=kind,
        message=message[:2000],
        details=details,
    )


def server_event(
    name: str, actor: str, kind: str, message: str, details: dict[str, Any] | None = None
) -> Event:
    """An Event about a server, now, its message cut to fit."""
    return Event(
        at=utcnow(),
        subject_type="server",
        subject=name,
        actor=actor,
        kind=kind,
        message=message[:2000],
        details=details or {},
    )


def set_fields(row: Any, changes: dict[str, Any]) -> list[str]:
    """Set the values in `changes` that differ on `row`; returns the names of those fields."""
    changed = [key for key, value in changes.items() if getattr(row, key) != value]
    for key in changed:
        setattr(row, key, changes[key])
    return changed


def record_update(
    session: Session,
    row: Any,
    subject_type: str,
    subject: str,
    fields: list[str],
    actor: str,
    message: str,
    at: datetime | None = None,
) -> None:
    """Stamp `row` as updated and log which fields changed: names only, never values (a field
    may be a BMC password). Nothing changed, nothing recorded."""
    if not fields:
        return
    now = at or utcnow()
    row.updated_at = now
    session.add(row)
    session.add(
        Event(
            at=now,
            subject_type=subject_type,
            subject=subject,
            actor=actor,
            kind=f"{subject_type}.updated",
            message=message,
            details={"fields": fields},
        )
    )


@dataclass(frozen=True, slots=True)
class EventFilter:
    subject_type: str | None = None
    subject: str | None = None
    kind: str | None = None
    since: datetime | None = None
    until: datetime | None = None


def list_events(
    session: Session, where: EventFilter, limit: int, offset: int
) -> tuple[int, list[EventPublic]]:
    conditions: list[Any] = []
    if where.subject_type is not None:
        conditions.append(Event.subject_type == where.subject_type)
    if where.subject is not None:
        conditions.append(Event.subject == where.subject)
    if where.kind is not None:
        # "server" matches server.transition, server.updated, …. A substring equality, not
        # LIKE (no wildcards, case-sensitive on SQLite) nor a range (collation-dependent).
        prefix = where.kind + "."
        conditions.append(
            sa.or_(
                col(Event.kind) == where.kind,
                sa.func.substr(col(Event.kind), 1, len(prefix)) == prefix,
            )
        )
    if where.since is not None:
        conditions.append(col(Event.at) >= as_utc(where.since))
    if where.until is not None:
        conditions.append(col(Event.at) < as_utc(where.until))
    count = (
        session.connection()
        .execute(sa.select(sa.func.count()).select_from(Event).where(*conditions))
        .scalar_one()
    )
    rows = session.exec(
        select(Event).where(*conditions).order_by(col(Event.id).desc()).limit(limit).offset(offset)
    )
    return count, [EventPublic.model_validate(e.model_dump()) for e in rows]
