"""The event log, newest first."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter

from fleet.api.deps import PagingDep, SessionDep, Viewer
from fleet.events import EventFilter, list_events

router = APIRouter(tags=["events"])


@router.get("/events")
def events(
    _: Viewer,
    session: SessionDep,
    paging: PagingDep,
    subject_type: str | None = None,
    subject: str | None = None,
    kind: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    where = EventFilter(subject_type, subject, kind, since, until)
    count, results = list_events(session, where, paging.limit, paging.offset)
    return paging.page(count, results)
