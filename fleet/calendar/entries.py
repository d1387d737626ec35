"""Calendar entries: add, list, show, remove and preview (fleet/calendar/ runs them).

An entry is validated whole before anything is written: both cron expressions parse in its
time zone, the start fires at all, and its minimum fits the deployment's maximum.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from fleet.calendar.entry_spec import ScheduleEntryCreate, check_fits, checked_spec
from fleet.calendar.plan import Lead, Window, windows
from fleet.calendar.service import lead_for, spec_of
from fleet.errors import NotFoundError
from fleet.models import Deployment, Event, ScheduleEntry, utcnow
from fleet.settings import Settings

MAX_PREVIEW = 500


def _deployment(session: Session, name: str) -> Deployment:
    row = session.exec(select(Deployment).where(Deployment.name == name)).first()
    if row is None:
        raise NotFoundError(f"no deployment named {name!r}")
    return row


def _entry(session: Session, entry_id: int) -> ScheduleEntry:
    row = session.get(ScheduleEntry, entry_id)
    if row is None:
        raise NotFoundError(f"no calendar entry {entry_id}")
    return row


def public(
    session: Session, entry: ScheduleEntry, settings: Settings, *, now: datetime | None = None
) -> dict[str, Any]:
    """The entry, its state and its next window with the early start the leader would use."""
    deployment = session.get(Deployment, entry.deployment_id)
    assert deployment is not None
    at = now or utcnow()
    lead = lead_for(session, deployment, settings, min_replicas=entry.min_replicas)
    nxt = windows(spec_of(entry), at, lead.seconds, 1)
    active = entry.active_until is not None and entry.active_until > at
    return {
        "id": entry.id,
        "deployment": deployment.name,
        "cron": entry.cron,
        "timezone": entry.timezone,
        "min_replicas": entry.min_replicas,
        "end_cron": entry.end_cron,
        "duration_s": entry.duration_s,
        "note": entry.note,
        "created_at": entry.created_at,
        "created_by": entry.created_by,
        "active": active,
        "active_until": entry.active_until if active else None,
        "last_window_start": entry.fired_for,
        "last_fired_at": entry.fired_at,
        "lead_s": lead.seconds,
        "lead_basis": lead.basis,
        "next": _window(nxt[0], entry.timezone) if nxt else None,
    }


def _window(window: Window, timezone: str) -> dict[str, Any]:
    start, end, fire_at = window.local(timezone)
    return {
        "start": window.start,
        "start_local": start.isoformat(),
        "end": window.end,
        "end_local": end.isoformat(),
        "boot_at": window.fire_at,
        "boot_at_local": fire_at.isoformat(),
    }


def list_entries(
    session: Session, settings: Settings, deployment: str | None = None
) -> list[dict[str, Any]]:
    query = select(ScheduleEntry).order_by(col(ScheduleEntry.id))
    if deployment is not None:
        query = query.where(ScheduleEntry.deployment_id == _deployment(session, deployment).id)
    return [public(session, e, settings) for e in session.exec(query)]


def get_entry(session: Session, entry_id: int, settings: Settings) -> dict[str, Any]:
    return public(session, _entry(session, entry_id), settings)


def create_entry(
    session: Session, spec: ScheduleEntryCreate, actor: str, settings: Settings
) -> dict[str, Any]:
    deployment = _deployment(session, spec.deployment)
    checked_spec(spec)
    check_fits(spec, deployment.max_replicas)
    assert deployment.id is not None
    row = ScheduleEntry(
        deployment_id=deployment.id,
        cron=" ".join(spec.cron.split()),
        timezone=spec.timezone,
        min_replicas=spec.min_replicas,
        end_cron=" ".join(spec.end_cron.split()) if spec.end_cron else None,
        duration_s=spec.duration_s,
        note=spec.note,
        created_by=actor,
    )
    session.add(row)
    session.flush()
    end = f"until {row.end_cron!r}" if row.end_cron else f"for {row.duration_s} s"
    session.add(
        Event(
            subject_type="schedule",
            subject=str(row.id),
            actor=actor,
            kind="schedule.created",
            message=f"{deployment.name}: at least {row.min_replicas} replicas from "
            f"{row.cron!r} ({row.timezone}) {end}" + (f" — {row.note}" if row.note else ""),
            details={"deployment": deployment.name},
        )
    )
    session.commit()
    return public(session, row, settings)


def delete_entry(session: Session, entry_id: int, actor: str) -> None:
    """Remove an entry; an open window's floor goes at the calendar's next tick."""
    row = _entry(session, entry_id)
    deployment = session.get(Deployment, row.deployment_id)
    name = deployment.name if deployment else "?"
    session.delete(row)
    session.add(
        Event(
            subject_type="schedule",
            subject=str(entry_id),
            actor=actor,
            kind="schedule.deleted",
            message=f"{name}: entry {row.cron!r} ({row.timezone}) removed",
            details={"deployment": name},
        )
    )
    session.commit()


def preview(
    session: Session,
    spec: ScheduleEntryCreate,
    settings: Settings,
    *,
    count: int,
    start: datetime | None = None,
) -> dict[str, Any]:
    """The next `count` windows after `start` (now by default) with the early start the leader
    would use today (the deployment's measured p90 boot-to-ready)."""
    deployment = _deployment(session, spec.deployment)
    checked = checked_spec(spec)
    lead: Lead = lead_for(session, deployment, settings, min_replicas=spec.min_replicas)
    rows = windows(checked, start or utcnow(), lead.seconds, min(count, MAX_PREVIEW))
    return {
        "deployment": deployment.name,
        "timezone": spec.timezone,
        "lead_s": lead.seconds,
        "lead_basis": lead.basis,
        "count": len(rows),
        "results": [_window(w, spec.timezone) for w in rows],
    }


def preview_entry(
    session: Session,
    entry_id: int,
    settings: Settings,
    *,
    count: int,
    start: datetime | None = None,
) -> dict[str, Any]:
    row = _entry(session, entry_id)
    deployment = session.get(Deployment, row.deployment_id)
    assert deployment is not None
    spec = ScheduleEntryCreate(
        deployment=deployment.name,
        cron=row.cron,
        timezone=row.timezone,
        min_replicas=row.min_replicas,
        end_cron=row.end_cron,
        duration_s=row.duration_s,
    )
    return preview(session, spec, settings, count=count, start=start)
