"""The FastAPI application: wiring only; the work happens in the services it calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy.engine import Engine

import fleet
from fleet import db
from fleet.api.access import AccessMiddleware, log_answer
from fleet.api.admission import Admission
from fleet.api.edge import EdgeMiddleware, Limits
from fleet.api.fast_heartbeats import FastHeartbeats
from fleet.api.metrics import FleetCollector, HeartbeatCollector, HttpMetrics, LoopCollector
from fleet.api.openapi import AllowEveryMethod, document
from fleet.api.routes import (
    agent,
    autoscaler,
    callers,
    deployments,
    health,
    inventory,
    models,
    power,
    provisioning,
    rollouts,
    routing,
    schedules,
    servers,
    sites,
    ssh,
    tokens,
)
from fleet.api.routes import events as events_routes
from fleet.api.routes.health import Readiness
from fleet.console import routes as console_routes
from fleet.control.loops import stop_all
from fleet.control.service_loops import build_loops
from fleet.crypto import SecretBox
from fleet.errors import FleetError, ValidationFailed
from fleet.registry.heartbeat_ingest import HeartbeatIngest, conninfo_of
from fleet.settings import Settings, get_settings
from fleet.validation import error_messages


class ErrorBody(BaseModel):
    """Every 4xx: what to fix, and for invalid input each problem as `place: message`."""

    detail: str
    errors: list[str] | None = None


# Documented on every /api/v1 operation, so clients (and the OpenAPI schema) know the shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (400, "A rule the input breaks (e.g. an unknown GPU model)"),
        (401, "No or bad token"),
        (403, "The token's role may not do this"),
        (404, "No such object"),
        (409, "Conflict: an illegal move, a duplicate, a concurrent change"),
        (413, "Request body over the route's limit (refused before it is read)"),
        (422, "Invalid input"),
        (503, "Database unavailable or the service at capacity: retry after `Retry-After` s"),
    )
}


def prepare_database(settings: Settings, engine: Engine) -> None:
    """The embedded default migrates itself; any other database must already be migrated."""
    if settings.is_embedded:
        db.upgrade(engine)
    else:
        db.check_migrated(engine)


def create_app(
    settings: Settings | None = None, engine: Engine | None = None, *, migrate: bool = True
) -> FastAPI:
    settings = settings or get_settings()
    engine = engine or db.engine_from_settings(settings)
    box = SecretBox(settings.resolve_secret_key())
    if migrate:
        prepare_database(settings, engine)

    # The singleton loops run while the server runs (and only in the leader:
    # fleet/control/leader.py).
    loops = build_loops(settings, engine, box) if settings.run_loops else []
    readiness = Readiness(engine)
    heartbeats = (
        HeartbeatIngest(
            conninfo_of(engine),
            connections=settings.heartbeat_connections,
            flush_s=settings.heartbeat_batch_s,
            prepared=settings.db_prepared_statements,
            application_name=settings.db_application_name,
        )
        if settings.heartbeat_fast_path and engine.dialect.name == "postgresql"
        else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Every admitted request can have a worker thread (fleet/api/admission.py).
        limiter = to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, settings.api_max_in_flight + 1)
        readiness.start()
        for loop in loops:
            loop.start()
        try:
            yield
        finally:
            if heartbeats is not None:
                await heartbeats.stop()
            # Within the shutdown bound (fleet/cli/'s `serve` has a watchdog past it): a tick stuck
            # in a BMC call is left behind rather than waited for.
            stop_all(loops, max(1.0, settings.shutdown_timeout_s - settings.shutdown_grace_s - 1))
            readiness.stop()

    app = FastAPI(
        title="Fleet",
        version=fleet.__version__,
        description="Inventory, power budgets and lifecycle of a bare-metal GPU inference fleet.",
        lifespan=lifespan,
    )
    app.state.settings, app.state.engine, app.state.box = settings, engine, box
    app.state.loops = loops
    app.state.readiness = readiness
    app.state.heartbeats = heartbeats
    registry = CollectorRegistry()
    registry.register(FleetCollector(engine, settings))
    registry.register(LoopCollector(loops))
    registry.register(HeartbeatCollector(heartbeats))
    app.state.registry = registry
    http_metrics = HttpMetrics(registry)

    # Innermost first (each add_middleware wraps what is there, Admission below wraps all):
    # the edge refuses what it must before reading the body (fleet/api/edge.py); the access
    # middleware logs and counts every answer and answers every exception (fleet/api/access.py).
    # A 405 lists every method of the path (fleet/api/openapi.py); innermost, it only edits one.
    app.add_middleware(AllowEveryMethod, routes=app.router.routes)
    limits = Limits(settings.max_body_bytes, settings.max_inventory_bytes)
    app.add_middleware(EdgeMiddleware, engine=engine, limits=limits)
    # Steady heartbeats answered before the edge (fleet/api/fast_heartbeats.py): it refuses
    # nothing, and what it does not answer reaches the edge as it came.
    app.add_middleware(
        FastHeartbeats, ingest=heartbeats, routes=app.router.routes, limit=limits.json_bytes
    )
    app.add_middleware(
        AccessMiddleware, metrics=http_metrics, retry_after_s=settings.api_retry_after_s
    )

    # API requests in flight are capped below what the pool and the worker threads can carry:
    # past the cap a short wait, then 503 + Retry-After (docs/api.md). Added after the other
    # middleware, so that it wraps them all (some touch the database): keep it last.
    def refused(scope: Any, seconds: float) -> None:
        http_metrics.record(scope, 503, seconds)
        log_answer(scope, 503, seconds, "at capacity")

    app.add_middleware(
        Admission,
        limit=settings.api_max_in_flight,
        wait_s=settings.api_admission_wait_s,
        retry_after_s=settings.api_retry_after_s,
        on_refused=refused,
    )

    @app.exception_handler(ValidationFailed)
    async def _invalid(_: Request, exc: ValidationFailed) -> JSONResponse:
        # 422, or 400 for rules no schema states (RulesBroken).
        body = {"detail": str(exc), "errors": exc.errors}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(FleetError)
    async def _fleet_error(_: Request, exc: FleetError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the input; ours names the place and never the value.
        messages = error_messages(exc.errors())
        body: dict[str, Any] = {"detail": "; ".join(messages), "errors": messages}
        return JSONResponse(body, status_code=422)

    app.include_router(health.router)
    # The web console (fleet/console/, docs/console.md): HTML pages at /ui, not in the schema.
    app.include_router(console_routes.router)
    for module in (
        inventory,
        sites,
        servers,
        power,
        deployments,
        events_routes,
        agent,
        provisioning,
        autoscaler,
        schedules,
        routing,
        callers,
        tokens,
        ssh,
        models,
        rollouts,
    ):
        app.include_router(module.router, prefix="/api/v1", responses=ERROR_RESPONSES)
    # The schema states what the edge refuses, and the inventory file's shape (openapi.py).
    app.openapi = document(app)  # type: ignore[method-assign]
    return app
