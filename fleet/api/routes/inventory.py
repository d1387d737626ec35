"""Inventory files in and out: the body is the YAML file itself."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlmodel import Session

from fleet.api.deps import BoxDep, Operator, SessionDep, Viewer, get_session
from fleet.crypto import SecretBox
from fleet.errors import FleetError
from fleet.inventory import ImportReport, dump_yaml, export_inventory, import_inventory
from fleet.inventory.schema import parse_inventory

router = APIRouter(prefix="/inventory", tags=["inventory"])

YAML_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/yaml": {"schema": {"type": "string"}}},
    }
}
MAX_BODY = 64 * 1024 * 1024


async def _read(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise FleetError(f"inventory file too large ({declared} bytes, limit {MAX_BODY})")
    body = await request.body()
    if len(body) > MAX_BODY:
        raise FleetError(f"inventory file too large ({len(body)} bytes, limit {MAX_BODY})")
    return body


def _import(
    session: Session, body: bytes, box: SecretBox, actor: str, dry_run: bool
) -> ImportReport:
    inv = parse_inventory(body)
    report = import_inventory(session, inv, box, actor, dry_run=dry_run)
    if dry_run:
        session.rollback()
    else:
        session.commit()
    return report


@router.post("/import", openapi_extra=YAML_BODY)
async def import_file(
    request: Request,
    user: Operator,
    box: BoxDep,
    session: Annotated[Session, Depends(get_session)],
    dry_run: Annotated[bool, Query(description="report the changes, write nothing")] = False,
) -> ImportReport:
    body = await _read(request)
    return await run_in_threadpool(_import, session, body, box, user.actor, dry_run)


@router.post("/validate", openapi_extra=YAML_BODY)
async def validate_file(
    request: Request, user: Operator, box: BoxDep, session: SessionDep
) -> ImportReport:
    """Check a file against the fleet as an import would; writes nothing.

    Operators only, like import: a report says whether a supplied BMC password differs from
    the stored one (that is what keeps re-imports idempotent), which a viewer must not learn.
    """
    body = await _read(request)
    return await run_in_threadpool(_import, session, body, box, user.actor, True)


YAML_OUT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/yaml": {"schema": {"type": "string"}}}}
}


@router.get("/export", response_class=Response, responses=YAML_OUT)
def export_file(_: Viewer, session: SessionDep) -> Response:
    """The fleet as an inventory file (no BMC passwords)."""
    return Response(dump_yaml(export_inventory(session)), media_type="application/yaml")
