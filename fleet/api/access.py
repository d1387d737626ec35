"""Every answer logged and counted, and every failure turned into an answer that tells the truth.

`AccessMiddleware` is a pure ASGI middleware around the routes and the edge (fleet/api/edge.py):
it sees each response's status, and each exception nothing inside handled, which it answers
itself (`error_response`, the one mapping from an exception to a status):

- the database unreachable or refusing connections (SQLAlchemy's OperationalError,
  InterfaceError, DisconnectionError, a connection invalidated under a statement), the pool
  out of connections (its TimeoutError) or its disk full (said so in the detail): 503 with
  `Retry-After`;
- a value the database cannot hold (DataError: an integer beyond its column, a string too
  long; OverflowError: SQLite's 64-bit integers): 422 — input validation should have refused it
  first, so it is logged too;
- anything else: 500, logged with its traceback; the body says nothing about the internals.

The access log line and `fleet_http_requests_total` then carry the status the client got, 500s
included (an exception used to bypass both).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import sqlalchemy as sa
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.api.metrics import HttpMetrics

log = logging.getLogger("fleet.api")
access_log = logging.getLogger("fleet.access")

# The database is down, restarting or out of connections: the request may well work later.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.DisconnectionError,
    sa.exc.TimeoutError,
)
# The request carried a value its column cannot hold.
OUT_OF_RANGE: tuple[type[BaseException], ...] = (sa.exc.DataError, OverflowError)
INTERNAL = "internal error: the service logged it (no details are given here)"
# Postgres SQLSTATEs of DataError, said without quoting the value (it may be a secret).
_DATA_ERRORS = {
    "22003": "a number is out of range for its database column",
    "22001": "a text is longer than its database column allows",
    "22P02": "a value has the wrong form for its database column",
}
# A client went away before any answer (nginx's convention; nothing was sent).
CLIENT_CLOSED = 499
MAX_LOGGED_PATH = 300
_SQLITE_FULL = 13
_PG_DISK_FULL = "53100"
# One "database unavailable" warning per this many seconds: an outage is hundreds of 503s.
UNAVAILABLE_LOG_EVERY_S = 10.0
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f]")


def printable(text: str, limit: int = MAX_LOGGED_PATH) -> str:
    """`text` safe for a log line: control characters as `\\xNN`, cut at `limit`."""
    text = _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cause(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one, as task groups raise."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def is_unavailable(exc: BaseException) -> bool:
    exc = _cause(exc)
    if isinstance(exc, UNAVAILABLE):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated


class _Throttle:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last = -every_s
        self._lock = threading.Lock()

    def due(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s:
                return False
            self._last = now
            return True


_unavailable_log = _Throttle(UNAVAILABLE_LOG_EVERY_S)


def disk_full(exc: BaseException) -> bool:
    """The database refused a write for want of disk: SQLite's SQLITE_FULL, Postgres's
    SQLSTATE 53100 (disk_full)."""
    orig = getattr(exc, "orig", None)
    return (
        getattr(orig, "sqlite_errorcode", None) == _SQLITE_FULL
        or getattr(orig, "sqlstate", None) == _PG_DISK_FULL
    )


def unavailable_response(exc: BaseException, retry_after_s: int) -> JSONResponse:
    """503 + Retry-After for a database that cannot be reached or has no connection free."""
    cause = _cause(exc)
    if isinstance(cause, sa.exc.TimeoutError):
        detail = "the service is busy (no database connection free): retry later"
    elif disk_full(cause):
        # Reads still work and /readyz says ready: say which part is down, and why.
        detail = (
            "the database's disk is full: writes are refused until an operator frees space "
            f"(reads still work); retry after {retry_after_s} s"
        )
    else:
        detail = f"the database is unavailable: retry after {retry_after_s} s"
    if _unavailable_log.due():
        first = str(getattr(cause, "orig", None) or cause).strip().splitlines()
        log.warning(
            "database unavailable, answering 503 (%s: %s)",
            type(cause).__name__,
            printable(first[0] if first else ""),
        )
    return JSONResponse(
        {"detail": detail}, status_code=503, headers={"Retry-After": str(retry_after_s)}
    )


def error_response(exc: BaseException, retry_after_s: int, where: str) -> JSONResponse:
    """The answer to an exception nothing else handled (`where`: `METHOD /path`, for the log)."""
    cause = _cause(exc)
    if is_unavailable(cause):
        return unavailable_response(cause, retry_after_s)
    if isinstance(cause, OUT_OF_RANGE):
        code = getattr(getattr(cause, "orig", None), "sqlstate", None)
        detail = _DATA_ERRORS.get(code or "", "a value cannot be stored by the database")
        if isinstance(cause, OverflowError):
            detail = "a number is too large"
        # Validation let it through: worth a line, not a traceback.
        log.warning("%s: %s answered 422 (%s)", where, type(cause).__name__, detail)
        return JSONResponse({"detail": f"{detail}: check the request's numbers and texts"}, 422)
    log.error("%s: unhandled %s", where, type(cause).__name__, exc_info=exc)
    return JSONResponse({"detail": INTERNAL}, status_code=500)


class AccessMiddleware:
    """See the module docstring. `retry_after_s` goes with every 503."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, retry_after_s: int) -> None:
        self.app = app
        self.metrics = metrics
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            where = f"{scope['method']} {printable(scope['path'])}"
            if status is not None:
                # The answer was under way (a stream): too late for another; the client sees
                # it cut short, and the count and the log say 500.
                log.error("%s: unhandled %s mid-response", where, type(exc).__name__, exc_info=exc)
                self.record(scope, 500, start)
                raise
            response = error_response(exc, self.retry_after_s, where)
            status = response.status_code
            await response(scope, receive, send)
        self.record(scope, CLIENT_CLOSED if status is None else status, start)

    def record(self, scope: Scope, status: int, start: float) -> None:
        seconds = time.perf_counter() - start
        self.metrics.record(scope, status, seconds)
        # Method, path and status only: bodies (which may carry BMC passwords) are never logged.
        access_log.info(
            "%s %s %d %.1fms", scope["method"], printable(scope["path"]), status, seconds * 1000
        )


def log_answer(scope: dict[str, Any], status: int, seconds: float, note: str = "") -> None:
    """An access log line for an answer given outside this middleware (admission's 503)."""
    access_log.info(
        "%s %s %d %.1fms%s",
        scope["method"],
        printable(scope["path"]),
        status,
        seconds * 1000,
        f" ({note})" if note else "",
    )
