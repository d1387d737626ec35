"""The routing table the router reads: deployments and their replicas that may take traffic."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from fleet.api.deps import SessionDep, Viewer, get_settings, require
from fleet.auth import Principal
from fleet.models import Role
from fleet.registry.routing_table import LoadReport, ReportOutcome, record_report, routing_table
from fleet.settings import Settings

router = APIRouter(tags=["routing"])


@router.get("/routing")
def routing(
    _: Viewer, session: SessionDep, settings: Annotated[Settings, Depends(get_settings)]
) -> dict[str, Any]:
    """Per deployment: the names requests may use for it, engine limits, SLAs, and the replicas
    (engine and agent URLs) of its serving servers whose agent is ready and whose heartbeat is
    fresh; each replica's own readiness is its agent's /state to say (the router polls it)."""
    rows = routing_table(session, settings)
    return {"count": len(rows), "results": rows}


@router.post("/routing/report")
def report(
    body: LoadReport,
    _: Annotated[Principal, Depends(require(Role.ROUTER))],
    session: SessionDep,
) -> ReportOutcome:
    """A router's load per deployment (requests waiting in it, its clients' p95s): autoscaler
    signals. Needs a router token (or operator, admin). Bounded: at most 1000 entries, waiting
    0 to 100000, p95s finite and at most 3600 s (422 naming the field otherwise); deployments
    the fleet does not have are ignored and counted in the answer (`ignored`, `unknown`)."""
    return record_report(session, body)
