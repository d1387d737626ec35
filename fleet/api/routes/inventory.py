"""Inventory files in and out: the body is the YAML file itself."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlmodel import Session

from fleet.api.deps import BoxDep, Operator, SessionDep, Viewer
from fleet.auth import Principal
from fleet.crypto import SecretBox
from fleet.inventory import ImportReport, dump_yaml, export_inventory, import_inventory
from fleet.inventory.schema import parse_inventory
from fleet.models import Role

router = APIRouter(prefix="/inventory", tags=["inventory"])

# The file as YAML text. fleet/api/openapi.py gives both YAML bodies the file's object schema.
# Optional: an empty body (or one of comments only) is the empty inventory, as an empty file is.
YAML_BODY = {
    "requestBody": {
        "required": False,
        "content": {"application/yaml": {"schema": {"type": "object"}}},
    }
}


async def _read(request: Request) -> bytes:
    # The edge (fleet/api/edge.py) has checked the caller, and counts the body as it arrives:
    # past FLEET_MAX_INVENTORY_BYTES the reading below ends in 413, before the rest is read.
    return await request.body()


def _import(
    session: Session, body: bytes, box: SecretBox, user: Principal, dry_run: bool
) -> ImportReport:
    inv = parse_inventory(body)
    # Changing an existing server's BMC credentials is an admin's (403 otherwise).
    admin = user.may(Role.ADMIN)
    report = import_inventory(
        session, inv, box, user.actor, dry_run=dry_run, credentials_allowed=admin
    )
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
    session: SessionDep,
    dry_run: Annotated[bool, Query(description="report the changes, write nothing")] = False,
) -> ImportReport:
    body = await _read(request)
    return await run_in_threadpool(_import, session, body, box, user, dry_run)


@router.post("/validate", openapi_extra=YAML_BODY)
async def validate_file(
    request: Request, user: Operator, box: BoxDep, session: SessionDep
) -> ImportReport:
    """Check a file against the fleet as an import would; writes nothing.

    Operators only, like import: a report says whether a supplied BMC password differs from
    the stored one (that is what keeps re-imports idempotent), which a viewer must not learn.
    Like import, a file that changes existing servers' BMC credentials needs an admin (403).
    """
    body = await _read(request)
    return await run_in_threadpool(_import, session, body, box, user, True)


YAML_OUT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/yaml": {"schema": {"type": "object"}}}}
}


@router.get("/export", response_class=Response, responses=YAML_OUT)
def export_file(_: Viewer, session: SessionDep) -> Response:
    """The fleet as an inventory file (no BMC passwords)."""
    return Response(dump_yaml(export_inventory(session)), media_type="application/yaml")
