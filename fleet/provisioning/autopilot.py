"""The autopilot: the provisioner's pause/resume switch and its breaker.

A paused autopilot makes no automatic move at all; the breaker opens by itself when more than
`breaker_share` of the servers turn unhealthy within `breaker_window_s`, and stops automatic
drains and cycles until an operator resumes. The calendar and the autoscaler read the pause
here too (`get_autopilot`).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.lifecycle.states import ServerState
from fleet.models import Autopilot, Event, Server, utcnow
from fleet.settings import Settings

log = logging.getLogger(__name__)


def get_autopilot(session: Session) -> Autopilot:
    row = session.get(Autopilot, 1)
    if row is None:
        row = Autopilot(id=1)
        session.add(row)
        try:
            session.commit()
        except sa.exc.IntegrityError:
            session.rollback()
            row = session.get(Autopilot, 1)
            assert row is not None
    return row


def set_paused(session: Session, paused: bool, actor: str, reason: str) -> Autopilot:
    row = get_autopilot(session)
    row.paused = paused
    row.reason = reason
    row.changed_by, row.changed_at = actor, utcnow()
    if not paused:
        row.breaker_open, row.breaker_reason = False, None  # a person resumes: breaker closes
    session.add(row)
    session.add(
        Event(
            at=utcnow(),
            subject_type="service",
            subject="autopilot",
            actor=actor,
            kind="autopilot.paused" if paused else "autopilot.resumed",
            message=reason,
        )
    )
    session.commit()
    return row


def check_breaker(session: Session, settings: Settings, autopilot: Autopilot, actor: str) -> bool:
    """Open the breaker when too large a share of the fleet turned unhealthy within the window;
    True while it is open."""
    if autopilot.breaker_open:
        return True
    total = session.exec(
        select(sa.func.count()).select_from(Server).where(Server.state != ServerState.RETIRED)
    ).one()
    if not total:
        return False
    since = utcnow() - timedelta(seconds=settings.breaker_window_s)
    # A person who resumed has seen what was before: only what happens after counts.
    if autopilot.changed_at is not None and autopilot.changed_at > since:
        since = autopilot.changed_at
    # Count servers, not events: a flapping server is one.
    sick_servers = session.exec(
        select(sa.func.count(sa.distinct(col(Event.subject)))).where(
            Event.kind == "server.health",
            col(Event.at) >= since,
            col(Event.details)["verdict"].as_string() == "unhealthy",
        )
    ).one()
    share = int(sick_servers) / int(total)
    if share <= settings.breaker_share:
        return False
    autopilot.breaker_open = True
    autopilot.breaker_reason = (
        f"{sick_servers} of {total} servers ({share:.0%}) turned unhealthy within "
        f"{settings.breaker_window_s:g} s (limit {settings.breaker_share:.0%}): automatic "
        "remediation stopped; resume with `fleetctl autopilot resume`"
    )
    autopilot.breaker_at = utcnow()
    session.add(autopilot)
    session.add(
        Event(
            at=utcnow(),
            subject_type="service",
            subject="autopilot",
            actor=actor,
            kind="autopilot.breaker_open",
            message=autopilot.breaker_reason,
        )
    )
    session.commit()
    log.error("%s", autopilot.breaker_reason)
    return True


def autopilot_view(row: Autopilot) -> dict[str, object]:
    return {
        "paused": row.paused,
        "reason": row.reason,
        "changed_by": row.changed_by,
        "changed_at": row.changed_at,
        "breaker_open": row.breaker_open,
        "breaker_reason": row.breaker_reason,
        "breaker_at": row.breaker_at,
    }
