"""The routing table the router reads: deployments and their replicas that may take traffic."""

from __future__ import annotations

from fastapi import APIRouter

from fleet.api.deps import RouterCaller, SessionDep, SettingsDep, Viewer
from fleet.api.responses import DeploymentRoutes, Listing
from fleet.callers import CallersTable, callers_table
from fleet.registry.routing_table import LoadReport, ReportOutcome, record_report, routing_table

router = APIRouter(tags=["routing"])


@router.get("/routing")
def routing(_: Viewer, session: SessionDep, settings: SettingsDep) -> Listing[DeploymentRoutes]:
    """Per deployment: the names requests may use for it, engine limits, SLAs, and the replicas
    (engine and agent URLs) of its serving servers whose agent is ready and whose heartbeat is
    fresh; each replica's own readiness is its agent's /state to say (the router polls it)."""
    rows = [DeploymentRoutes.model_validate(row) for row in routing_table(session, settings)]
    return Listing(count=len(rows), results=rows)


@router.post("/routing/report", response_model_exclude_none=True)
def report(
    body: LoadReport,
    _: RouterCaller,
    session: SessionDep,
    settings: SettingsDep,
) -> ReportOutcome:
    """A router's load per deployment (requests waiting in it, its clients' p95s): autoscaler
    signals. Needs a router token (or operator, admin). Bounded: at most 1000 entries, waiting
    0 to 100000, p95s finite and at most 3600 s (422 naming the field otherwise); deployments
    the fleet does not have are ignored and counted in the answer (`ignored`, `unknown`).

    With `callers` (its usage per client key over its last `window_s`, at most 100000 keys,
    figures 0 to 1e12): stored for this router, and the answer's `callers` is the other
    routers' usage reported within FLEET_ROUTER_REPORT_STALE_S, summed per key."""
    return record_report(session, body, stale_s=settings.router_report_stale_s)


@router.get("/routing/callers")
def callers(_: RouterCaller, session: SessionDep) -> CallersTable:
    """The tenants (their concurrency shares) and the active client keys (SHA-256 `hash`,
    tenant, limits per minute; null: unlimited) that routers authenticate requests with.
    Needs a router token (or operator, admin): not viewers, since it holds the hashes."""
    return callers_table(session)
