"""The event log, newest first."""

from __future__ import annotations

from fastapi import APIRouter

from fleet.api.deps import PagingDep, SessionDep, Viewer
from fleet.api.responses import Page
from fleet.events import EventFilter, list_events
from fleet.models import EventPublic, IsoDateTime

router = APIRouter(tags=["events"])


@router.get("/events")
def events(
    _: Viewer,
    session: SessionDep,
    paging: PagingDep,
    subject_type: str | None = None,
    subject: str | None = None,
    kind: str | None = None,
    since: IsoDateTime | None = None,
    until: IsoDateTime | None = None,
) -> Page[EventPublic]:
    where = EventFilter(subject_type, subject, kind, since, until)
    count, results = list_events(session, where, paging.limit, paging.offset)
    return paging.page(count, results)
