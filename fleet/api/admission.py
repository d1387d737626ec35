"""Admission: at most `limit` API requests in flight; past that a short wait, then 503.

Why: a request holds a database connection from its token lookup to its end and hops onto a
worker thread several times in between (dependencies, the handler, the session's teardown).
With more requests admitted than the pool has connections, those holding connections wait for
threads while the threads wait for connections: the service wedges (issue 19: 15 connections
"idle in transaction", every other request 30 s then 500). So the service admits no more than
the pool can serve (`Settings.max_in_flight`: the pool less the control loops' share, and
fewer than the worker threads), and everything else is answered at once by this middleware:

- a request waits for a slot at most `wait_s` (first come, first served), then gets 503 with
  `Retry-After`, without its body having been read;
- a client that disconnects while waiting is dropped then, costing nothing more (its body is
  not read beyond what arrived: while waiting, the middleware listens for the disconnect
  only until a body chunk arrives that is not the last);
- `exempt` paths (the probes) bypass it.

Pure asyncio on the event loop: no thread, no connection, so it answers however busy the
workers are. It must wrap every middleware that touches the database (add it last).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PROBES = frozenset({"/healthz", "/readyz"})

Outcome = Literal["admitted", "refused", "disconnected"]


@dataclass
class AdmissionStats:
    admitted: int = 0
    refused: int = 0
    abandoned: int = 0  # clients that disconnected while waiting


class Admission:
    """ASGI middleware: see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        wait_s: float,
        retry_after_s: int,
        exempt: frozenset[str] = PROBES,
        on_refused: Callable[[Scope, float], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("admission: the limit must be at least 1")
        self.app = app
        self.limit = limit
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self.exempt = exempt
        self.stats = AdmissionStats()
        self._on_refused = on_refused
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._refusal = json.dumps(
            {
                "detail": f"the service is at capacity ({limit} requests in flight): "
                f"retry after {retry_after_s} s"
            }
        ).encode()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        outcome, receive = await self._admit(scope, receive)
        if outcome == "disconnected":
            self.stats.abandoned += 1
            return
        if outcome == "refused":
            self.stats.refused += 1
            await self._refuse(send)
            if self._on_refused is not None:
                self._on_refused(scope, time.perf_counter() - started)
            return
        self.stats.admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._release()

    # -----------------------------------------------------------------------------------------

    async def _admit(self, scope: Scope, receive: Receive) -> tuple[Outcome, Receive]:
        """A slot (and the `receive` that replays what was read while waiting), or why not."""
        if self._in_flight < self.limit and not self._waiters:
            self._in_flight += 1
            return "admitted", receive
        loop = asyncio.get_running_loop()
        slot: asyncio.Future[None] = loop.create_future()
        self._waiters.append(slot)
        buffered: list[Message] = []
        # Reading would answer `Expect: 100-continue`, asking for the body: not while waiting.
        listen = (b"expect", b"100-continue") not in [
            (k.lower(), v.lower()) for k, v in scope.get("headers", ())
        ]
        listener = loop.create_task(_listen(receive, buffered)) if listen else None
        deadline = loop.time() + self.wait_s
        outcome: Outcome = "refused"
        try:
            waits: set[asyncio.Future[Any]] = {slot}
            if listener is not None:
                waits.add(listener)
            while not slot.done() and (remaining := deadline - loop.time()) > 0:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if listener is not None and listener.done() and not slot.done():
                    # The client hung up (or the server lost it), or a body is still coming:
                    # then the rest stays unread and only the slot is waited for.
                    if listener.exception() is not None or listener.result():
                        outcome = "disconnected"
                        break
                    waits.discard(listener)
            else:
                if slot.done():
                    outcome = "admitted"
        finally:
            if listener is not None:
                if not listener.done():
                    listener.cancel()  # what it read is in `buffered` already
                elif not listener.cancelled():
                    listener.exception()  # retrieved (a lost client shows again to the app)
            if slot.done() and not slot.cancelled():
                if outcome != "admitted":  # handed a slot just as it gave up or went away
                    self._release()
            else:
                slot.cancel()
                self._waiters.remove(slot)
        return outcome, _replaying(buffered, receive) if buffered else receive

    def _release(self) -> None:
        """Hand the slot to the longest waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._in_flight -= 1

    async def _refuse(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self._refusal)).encode()),
                    (b"retry-after", str(self.retry_after_s).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self._refusal})


async def _listen(receive: Receive, buffered: list[Message]) -> bool:
    """What arrives while a request waits, into `buffered`: True when the client hangs up;
    False (and no more reading) once a body chunk says more is coming."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True
        buffered.append(message)
        if message.get("more_body", False):
            return False


def _replaying(buffered: list[Message], receive: Receive) -> Receive:
    """`receive` that first hands out what the middleware read while the request waited."""

    async def replay() -> Message:
        if buffered:
            return buffered.pop(0)
        return await receive()

    return replay
