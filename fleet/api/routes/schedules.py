"""The scheduled-scaling calendar: entries, and previews of when they fire."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, NoReturn

from fastapi import APIRouter, HTTPException, Path, Query, status

from fleet.api.deps import Operator, SessionDep, SettingsDep, Viewer
from fleet.api.responses import Listing, ScheduleEntryPublic, SchedulePreview
from fleet.calendar import entries as service
from fleet.models import INT32_MAX, IsoDateTime, ScheduleEntryCreate, as_utc

router = APIRouter(prefix="/schedules", tags=["calendar"])
Count = Annotated[int, Query(ge=1, le=service.MAX_PREVIEW)]
Start = Annotated[
    IsoDateTime | None, Query(description="preview from here (ISO 8601; UTC if no offset)")
]
# Entry ids are 32-bit on Postgres: a larger one is no entry (422), not a database error.
EntryId = Annotated[int, Path(ge=1, le=INT32_MAX)]


@router.get("")
def list_entries(
    _: Viewer, session: SessionDep, settings: SettingsDep, deployment: str | None = None
) -> Listing[ScheduleEntryPublic]:
    rows = [
        ScheduleEntryPublic.model_validate(row)
        for row in service.list_entries(session, settings, deployment)
    ]
    return Listing(count=len(rows), results=rows)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_entry(
    spec: ScheduleEntryCreate, user: Operator, session: SessionDep, settings: SettingsDep
) -> ScheduleEntryPublic:
    return ScheduleEntryPublic.model_validate(
        service.create_entry(session, spec, user.actor, settings)
    )


@router.post("/preview")
def preview(
    spec: ScheduleEntryCreate,
    _: Viewer,
    session: SessionDep,
    settings: SettingsDep,
    count: Count = 10,
    start: Start = None,
) -> SchedulePreview:
    """The next windows of an entry not yet added."""
    return SchedulePreview.model_validate(
        service.preview(session, spec, settings, count=count, start=_utc(start))
    )


@router.api_route(
    "/preview",
    methods=["GET", "PUT", "PATCH", "DELETE"],
    include_in_schema=False,
    response_model=None,
)
def preview_is_a_post() -> NoReturn:
    # Without this, GET /schedules/preview would read "preview" as an entry id (a 422).
    raise HTTPException(status.HTTP_405_METHOD_NOT_ALLOWED, headers={"Allow": "POST"})


@router.get("/{entry_id}")
def get_entry(
    entry_id: EntryId, _: Viewer, session: SessionDep, settings: SettingsDep
) -> ScheduleEntryPublic:
    return ScheduleEntryPublic.model_validate(service.get_entry(session, entry_id, settings))


@router.get("/{entry_id}/preview")
def preview_entry(
    entry_id: EntryId,
    _: Viewer,
    session: SessionDep,
    settings: SettingsDep,
    count: Count = 10,
    start: Start = None,
) -> SchedulePreview:
    return SchedulePreview.model_validate(
        service.preview_entry(session, entry_id, settings, count=count, start=_utc(start))
    )


@router.delete("/{entry_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_entry(entry_id: EntryId, user: Operator, session: SessionDep) -> None:
    service.delete_entry(session, entry_id, user.actor)


def _utc(value: datetime | None) -> datetime | None:
    return None if value is None else as_utc(value)
