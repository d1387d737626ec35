"""The request edge: what the service refuses before it reads a request's body.

A pure ASGI middleware in front of the routes (inside the admission cap: authentication needs
a database connection). In this order, each step before any byte of the body is read:

1. NUL and control characters (C0, DEL, C1) in the path or the query string: 422 naming the
   place (`path`, `query.site`).
2. A declared `Content-Length` over the route's limit: 413 (no database work).
3. Under /api/v1, the bearer token: 401 without one that is valid; the inventory uploads need
   the operator role (403), and only they get the large limit (`FLEET_MAX_INVENTORY_BYTES`).
   The principal goes to the handler in the request state (`PRINCIPAL`): fleet/api/deps.py
   reads it there instead of asking the database again.
4. The body, counted as it streams (chunked bodies declare nothing): 413 the moment it passes
   the limit, and the connection closes so the rest is never read. JSON bodies (every route
   but the inventory uploads, whose YAML fleet/inventory checks) are then scanned for control
   characters in any string, keys included: 422 naming each place (`body.reason`).

The scan works on the raw bytes (a control character in a JSON string is always escaped or a
raw DEL/C1 byte), so a clean body, the agents' heartbeats included, costs a few byte scans and
no JSON parse here; only a body that has one is parsed, to name the places.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import anyio.to_thread
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.auth import Principal, authenticate
from fleet.models import Role

API_PREFIX = "/api/v1/"
# Where the edge leaves the authenticated caller for fleet/api/deps.py (request.state).
PRINCIPAL = "fleet_principal"
# The inventory uploads (fleet/api/routes/inventory.py): a YAML file, up to the inventory
# limit, for callers with this role only.
UPLOADS = frozenset({"/api/v1/inventory/import", "/api/v1/inventory/validate"})
UPLOAD_ROLE = Role.OPERATOR
# A token is "flt_" and 43 characters; anything far longer is not worth a database query.
MAX_TOKEN_CHARS = 256
# Places named in one 422: enough to fix a request, bounded for a hostile one.
MAX_REPORTED = 20
MAX_KEY_IN_PLACE = 40

UNAUTHORIZED = "missing or invalid bearer token (create one with `fleetctl token create`)"
# Refusing a body that is still arriving: close the connection after the answer, so that the
# server stops reading (and discarding) the rest of it.
CLOSE = {"Connection": "close"}

# C0 (every one, tab and newline included), DEL and C1.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# A control character in JSON text is one of: a raw C0 byte other than JSON's whitespace (invalid
# JSON anyway, and so is UTF-16/32 JSON, which no client of ours sends), a raw DEL, a raw C1
# character (JSON allows both raw; C1 is 0xC2 0x80-0x9F in UTF-8, where 0xC2 is never a
# continuation byte), or an escape of one inside a string (`\u001b`, `\n`, ...). Escaped
# backslashes are matched as pairs so that `\\n` (a backslash, then n) is no hit.
_FINE_BYTES = bytes(b for b in range(256) if not ((b < 0x20 and b not in b"\t\n\r") or b == 0x7F))
_C1_UTF8 = re.compile(rb"\xc2[\x80-\x9f]")
_ESCAPES = re.compile(rb"\\(?:u00[01][0-9A-Fa-f]|u007[Ff]|u00[89][0-9A-Fa-f]|[bfnrt]|\\)")


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes its limit: FastAPI re-raises an
    HTTPException from body reading unchanged, so the route's reading ends in this 413."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(413, _too_large(limit, setting), headers=CLOSE)


def _too_large(limit: int, setting: str) -> str:
    return f"request body too large: the limit is {limit} bytes here ({setting})"


@dataclass(frozen=True, slots=True)
class Limits:
    """Request body limits in bytes: every JSON body, and the inventory uploads."""

    json_bytes: int
    inventory_bytes: int


def control_at(text: str) -> str | None:
    """The first control character of `text` as `U+001B`, or None."""
    match = _CONTROL.search(text)
    return None if match is None else f"U+{ord(match.group()):04X}"


def _problem(place: str, code: str) -> str:
    return f"{place}: control character {code} is not allowed"


def _key(name: str) -> str:
    return name if len(name) <= MAX_KEY_IN_PLACE else name[: MAX_KEY_IN_PLACE - 1] + "…"


def path_problems(path: str, query_string: bytes) -> list[str]:
    """Control characters in the (decoded) path and in each query parameter."""
    problems = []
    code = control_at(path)
    if code is not None:
        problems.append(_problem("path", code))
    if query_string:
        # Decoded as Starlette decodes it for the routes.
        for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
            code = control_at(name)
            if code is not None:
                problems.append(f"query: a parameter name has control character {code}")
                continue
            code = control_at(value)
            if code is not None:
                problems.append(_problem(f"query.{_key(name)}", code))
    return problems


def _json_hit(body: bytes) -> bool:
    """Whether JSON text `body` may hold a control character: no parse, only byte scans that
    the C library does (a few µs for a heartbeat, a tenth of parsing it)."""
    if body.translate(None, _FINE_BYTES):  # what is left: raw C0 and DEL
        return True
    if b"\xc2" in body and _C1_UTF8.search(body):
        return True
    return b"\\" in body and any(m.group() != b"\\\\" for m in _ESCAPES.finditer(body))


def body_problems(body: bytes) -> list[str]:
    """Control characters in every string of a JSON body, keys included, by place."""
    if not _json_hit(body):
        return []
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        # Not JSON we can read, with a control character in it: the whole body is the place.
        return ["body: control characters are not allowed"]
    problems = list(_walk(document))
    return problems or ["body: control characters are not allowed"]


def _walk(document: Any) -> Iterator[str]:
    """(iterative: a deeply nested document must not exhaust the stack)"""
    stack: list[tuple[str, Any]] = [("body", document)]
    while stack:
        place, value = stack.pop()
        if isinstance(value, str):
            code = control_at(value)
            if code is not None:
                yield _problem(place, code)
        elif isinstance(value, dict):
            items = []
            for name, item in value.items():
                code = control_at(name)
                if code is not None:
                    yield f"{place}: a key has control character {code}"
                else:
                    items.append((f"{place}.{_key(name)}", item))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{place}[{i}]", item) for i, item in enumerate(value)]))


def invalid(problems: list[str]) -> dict[str, Any]:
    """A 422 body like every other (`detail`, `errors`), with at most MAX_REPORTED places."""
    more = len(problems) - 1
    detail = problems[0] + (f" (and {more} more)" if more else "")
    errors = problems[:MAX_REPORTED]
    if len(problems) > MAX_REPORTED:
        errors.append(f"… {len(problems) - MAX_REPORTED} more not listed")
    return {"detail": detail, "errors": errors}


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer …` header, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def lookup(engine: Engine, token: str) -> Principal | None:
    """The token's caller: a session of its own, closed (its connection back in the pool)
    before it returns. Blocking: run it in a worker thread."""
    with Session(engine) as session:
        return authenticate(session, token)


async def authenticate_token(engine: Engine, token: str | None) -> Principal | None:
    if token is None or len(token) > MAX_TOKEN_CHARS:
        return None
    return await anyio.to_thread.run_sync(lookup, engine, token)


def role_refusal(principal: Principal, role: Role) -> str:
    """The 403 detail: who the caller is and the role it would need."""
    article = "an" if principal.role.value[0] in "aeiou" else "a"
    return f"{article} {principal.role.value} token cannot do this; it needs the {role.value} role"


def declared_length(headers: Headers) -> int | None:
    value = headers.get("content-length", "").strip()
    # ASCII digits only ("²".isdigit() is true); the HTTP parser has refused worse already.
    return int(value) if value.isascii() and value.isdigit() else None


class EdgeMiddleware:
    """See the module's docstring. `engine` is the service's; `limits` its body limits."""

    def __init__(self, app: ASGIApp, engine: Engine, limits: Limits) -> None:
        self.app = app
        self.engine = engine
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        problems = path_problems(path, scope.get("query_string", b""))
        headers = Headers(scope=scope)
        declared = declared_length(headers)
        has_body = bool(declared) or "transfer-encoding" in headers
        if problems:
            await _answer(scope, receive, send, 422, invalid(problems), has_body)
            return
        upload = scope["method"] == "POST" and path in UPLOADS
        limit, setting = (
            (self.limits.inventory_bytes, "FLEET_MAX_INVENTORY_BYTES")
            if upload
            else (self.limits.json_bytes, "FLEET_MAX_BODY_BYTES")
        )
        if declared is not None and declared > limit:
            await _answer(scope, receive, send, 413, _too_large(limit, setting), has_body)
            return
        if path.startswith(API_PREFIX):
            principal = await authenticate_token(self.engine, bearer_token(headers))
            if principal is None:
                headers_out = {"WWW-Authenticate": "Bearer"}
                await _answer(scope, receive, send, 401, UNAUTHORIZED, has_body, headers_out)
                return
            if upload and not principal.may(UPLOAD_ROLE):
                refusal = role_refusal(principal, UPLOAD_ROLE)
                await _answer(scope, receive, send, 403, refusal, has_body)
                return
            scope.setdefault("state", {})[PRINCIPAL] = principal
        if not has_body:
            await self.app(scope, receive, send)
        elif upload:
            await self._stream(scope, receive, send, limit, setting)
        else:
            await self._buffered(scope, receive, send, limit, setting)

    async def _stream(
        self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str
    ) -> None:
        """The route reads the body itself; each chunk is counted on its way in."""
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, setting)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as exc:  # read outside FastAPI's body handling: answer it here
            if started:
                raise
            await _answer(scope, receive, send, 413, exc.detail, True)

    async def _buffered(
        self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str
    ) -> None:
        """Read the (small) body, refuse it past the limit or with a control character in a
        string, then hand it to the route as one message."""
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            chunk: bytes = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                await _answer(scope, receive, send, 413, _too_large(limit, setting), True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problems = body_problems(body)
        if problems:
            await _answer(scope, receive, send, 422, invalid(problems), False)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _answer(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    detail: str | dict[str, Any],
    unread_body: bool,
    headers: dict[str, str] | None = None,
) -> None:
    content = detail if isinstance(detail, dict) else {"detail": detail}
    out = dict(headers or {})
    if unread_body:
        out.update(CLOSE)
    await JSONResponse(content, status_code=status, headers=out)(scope, receive, send)
