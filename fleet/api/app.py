"""The FastAPI application: wiring only; the work happens in the services it calls."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy.engine import Engine
from starlette.responses import Response

import fleet
from fleet import db
from fleet.api.metrics import FleetCollector, HttpMetrics, LoopCollector
from fleet.api.routes import (
    agent,
    autoscaler,
    deployments,
    health,
    inventory,
    power,
    provisioning,
    routing,
    schedules,
    servers,
    sites,
)
from fleet.api.routes import events as events_routes
from fleet.control import build_loops
from fleet.crypto import SecretBox
from fleet.errors import FleetError, ValidationFailed
from fleet.settings import Settings, get_settings
from fleet.validation import error_messages

log = logging.getLogger("fleet.api")


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
        (422, "Invalid input"),
    )
}
access_log = logging.getLogger("fleet.access")


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

    # The singleton loops run while the server runs (and only in the leader: fleet/leader.py).
    loops = build_loops(settings, engine, box) if settings.run_loops else []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for loop in loops:
            loop.start()
        try:
            yield
        finally:
            for loop in loops:
                loop.stop(timeout=settings.bmc_total_timeout_s)

    app = FastAPI(
        title="Fleet",
        version=fleet.__version__,
        description="Inventory, power budgets and lifecycle of a bare-metal GPU inference fleet.",
        lifespan=lifespan,
    )
    app.state.settings, app.state.engine, app.state.box = settings, engine, box
    app.state.loops = loops
    registry = CollectorRegistry()
    registry.register(FleetCollector(engine))
    registry.register(LoopCollector(loops))
    app.state.registry = registry
    http_metrics = HttpMetrics(registry)

    @app.middleware("http")
    async def access(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        seconds = time.perf_counter() - start
        http_metrics.observe(request, response.status_code, seconds)
        # Method, path and status only: bodies (which may carry BMC passwords) are never logged.
        access_log.info(
            "%s %s %d %.1fms",
            request.method,
            request.url.path,
            response.status_code,
            seconds * 1000,
        )
        return response

    @app.exception_handler(ValidationFailed)
    async def _invalid(_: Request, exc: ValidationFailed) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "errors": exc.errors}, status_code=422)

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
    ):
        app.include_router(module.router, prefix="/api/v1", responses=ERROR_RESPONSES)
    return app
