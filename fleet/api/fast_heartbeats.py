"""The agents' steady heartbeats, answered before the edge and the routes (Postgres only).

A pure ASGI middleware between the access log and the edge (fleet/api/edge.py): for `POST
/api/v1/agent/heartbeat` with a bearer token and a declared length within the JSON limit, it
reads the body, and when the body is clean (the edge's control-character scan), valid (the
route's own model) and steady (fleet/registry/heartbeat_ingest.py says so, after checking the
token and the rows on its own connection), answers it with the answer kept for that server.
Everything else (no token, a body the edge or the route would refuse, a report that is not
steady, the database busy or down) goes on to the edge and the route with the body as it came,
which answer exactly as they would have: this path only ever saves work, it never refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.api.edge import MAX_TOKEN_CHARS, bearer_token, body_problems, declared_length
from fleet.registry.heartbeat_ingest import HeartbeatIngest
from fleet_core.wire import Heartbeat

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
_HEADERS = [(b"content-type", b"application/json")]


class FastHeartbeats:
    """See the module docstring. `routes`: the app's (the heartbeat's is named in the metrics
    for the answers given here as for the route's own); `limit`: the JSON body limit
    (FLEET_MAX_BODY_BYTES)."""

    def __init__(
        self, app: ASGIApp, ingest: HeartbeatIngest | None, routes: Sequence[object], limit: int
    ) -> None:
        self.app = app
        self.ingest = ingest
        self.limit = limit
        self._routes = routes
        self._route: object | None = None

    @property
    def route(self) -> object | None:
        # Looked up at the first answer: the routes are added after the middleware.
        if self._route is None:
            self._route = next(
                (r for r in self._routes if getattr(r, "path", None) == HEARTBEAT_PATH), None
            )
        return self._route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ingest = self.ingest
        if (
            ingest is None
            or scope["type"] != "http"
            or scope["path"] != HEARTBEAT_PATH
            or scope["method"] != "POST"
            or scope.get("query_string")
        ):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        token = bearer_token(headers)
        declared = declared_length(headers)
        if (
            token is None
            or len(token) > MAX_TOKEN_CHARS
            or not declared
            or declared > self.limit
            or "transfer-encoding" in headers
            or not _json_type(headers.get("content-type"))
        ):
            await self.app(scope, receive, send)
            return
        messages, body = await _read(receive, declared)
        answer = None
        if body is not None and not body_problems(body):
            try:
                report = Heartbeat.model_validate_json(body)
            except ValidationError:
                report = None
            if report is not None:
                client = scope.get("client")
                answer = await ingest.answer(token, report, client[0] if client else None)
        if answer is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        scope["route"] = self.route
        length = str(len(answer)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_HEADERS, (b"content-length", length)],
            }
        )
        await send({"type": "http.response.body", "body": answer})


def _json_type(value: str | None) -> bool:
    """Whether FastAPI would read a body of this content type as JSON (none given, or
    application/json or application/*+json): any other, the route answers 422, so must we."""
    if value is None:
        return True
    kind = value.split(";", 1)[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def _read(receive: Receive, declared: int) -> tuple[list[Message], bytes | None]:
    """The messages read, and the body when it came whole at its declared length (None: the
    client went away, or sent more or less than it declared: the edge and the server judge)."""
    messages: list[Message] = []
    received = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        received += len(message.get("body", b""))
        if received > declared:
            return messages, None
        if not message.get("more_body", False):
            break
    if received != declared:
        return messages, None
    return messages, b"".join(m.get("body", b"") for m in messages)


def _replay(messages: Sequence[Message], receive: Receive) -> Receive:
    """`receive` that gives `messages` again first."""
    queued = list(messages)

    async def replay() -> Message:
        if queued:
            return queued.pop(0)
        return await receive()

    return replay
