"""Liveness, readiness and metrics: no token needed (probes and Prometheus scrape them)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from fleet import db

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Database unreachable or not migrated"}})
def readyz(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    checks: dict[str, Any] = {}
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        checks["database"] = "ok"
        current, head = db.current_revision(engine), db.head_revision()
        checks["migrations"] = "ok" if current == head else f"at {current}, need {head}"
    except sa.exc.SQLAlchemyError as exc:
        checks["database"] = f"unreachable: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values()) and len(checks) == 2
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
