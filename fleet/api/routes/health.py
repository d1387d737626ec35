"""Liveness, readiness and metrics: no token needed (probes and Prometheus scrape them).

`/healthz` and `/readyz` run on the event loop: no worker thread, no connection from the
requests' pool, so they answer while the API is saturated (a probe that waited behind the
load would have the orchestrator restart a service that is merely busy). `/readyz` answers
from the last database check of a `Readiness` thread with a connection of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.engine import Engine
from starlette.responses import Response

from fleet import db
from fleet.api.responses import Liveness, ReadinessAnswer

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)

# The database is checked this often; an answer older than STALE_S (the checks hang: the
# database does not answer in their own timeout) is no answer.
CHECK_INTERVAL_S = 2.0
CHECK_TIMEOUT_S = 3.0
STALE_S = CHECK_INTERVAL_S + 2 * CHECK_TIMEOUT_S
# A first /readyz waits this long for the first check.
FIRST_CHECK_WAIT_S = 2 * CHECK_TIMEOUT_S


class Readiness:
    """The database checks behind /readyz, kept fresh by a daemon thread on a connection of its
    own (no pool: it never waits behind the requests), started with the service or by the
    first /readyz."""

    def __init__(self, engine: Engine, interval_s: float = CHECK_INTERVAL_S) -> None:
        self._engine = db.probe_engine(engine, CHECK_TIMEOUT_S)
        self._interval_s = interval_s
        self._guard = threading.Lock()
        self._latest: tuple[float, dict[str, str]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._guard:
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="readiness", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        with self._guard:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        self._engine.dispose()

    def check(self) -> dict[str, str]:
        """One check, blocking: the database answers, and its schema is the code's."""
        checks: dict[str, str] = {}
        try:
            with self._engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
                checks["database"] = "ok"
                current, head = db.current_revision_on(conn), db.head_revision()
            checks["migrations"] = "ok" if current == head else f"at {current}, need {head}"
        except sa.exc.SQLAlchemyError as exc:
            checks["database"] = f"unreachable: {type(exc).__name__}"
        return checks

    def latest(self) -> dict[str, str] | None:
        """The last check's result, if it is fresh."""
        with self._guard:
            latest = self._latest
        if latest is None or time.monotonic() - latest[0] > STALE_S:
            return None
        return latest[1]

    async def answer(self) -> dict[str, str]:
        """The fresh result, waiting (on the event loop) a little for a first one."""
        self.start()
        deadline = time.monotonic() + FIRST_CHECK_WAIT_S
        while (checks := self.latest()) is None:
            if time.monotonic() > deadline:
                return {"database": f"unknown: no check answered within {STALE_S:g} s"}
            await asyncio.sleep(0.02)
        return checks

    def _run(self) -> None:
        while not self._stop.is_set():
            checks = self.check()
            with self._guard:
                self._latest = (time.monotonic(), checks)
            self._stop.wait(self._interval_s)


@router.get("/healthz")
async def healthz() -> Liveness:
    return Liveness(status="ok")


@router.get(
    "/readyz",
    # The answer is a JSONResponse (its status depends on the checks): the models document it.
    responses={
        200: {"model": ReadinessAnswer, "description": "Database reachable and migrated"},
        503: {"model": ReadinessAnswer, "description": "Database unreachable or not migrated"},
    },
)
async def readyz(request: Request) -> JSONResponse:
    readiness: Readiness = request.app.state.readiness
    checks = await readiness.answer()
    ready = all(v == "ok" for v in checks.values()) and len(checks) == 2
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
