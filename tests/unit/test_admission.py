"""The admission cap (fleet/api/admission.py), the pool it protects, and the probes beside it.

- `Admission` as a bare ASGI middleware, driven with hand-made ASGI messages: past the cap a
  request waits (first come, first served), then gets 503 with Retry-After without its body
  being read or the app being called; a client that disconnects while waiting costs nothing
  more; what was read while waiting reaches the app; the probes bypass it.
- Under uvicorn: a waiting client that hangs up is dropped at once.
- The service: a pool with no connection free answers 503 + Retry-After (not a 500 after
  30 s), and /healthz and /readyz answer while every pool connection is taken.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
import uvicorn
from live import serve
from sqlalchemy.engine import Engine
from starlette.types import Message, Receive, Scope, Send

from fleet.api.admission import Admission
from fleet.db import make_engine
from fleet.lab.harness import wait_for
from fleet.models import Role


def scope(path: str = "/api/v1/servers", headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {"type": "http", "method": "POST", "path": path, "headers": headers or []}


class Client:
    """One request's side of ASGI: queued incoming messages, recorded outgoing ones."""

    def __init__(self, *messages: Message) -> None:
        self.incoming: asyncio.Queue[Message] = asyncio.Queue()
        for message in messages:
            self.incoming.put_nowait(message)
        self.reads = 0
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        self.reads += 1
        return await self.incoming.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    def header(self, name: bytes) -> bytes | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"]).get(name) if starts else None


class Held:
    """An ASGI app whose requests run until released; records what each one received."""

    def __init__(self) -> None:
        self.running = 0
        self.started: list[str] = []
        self.bodies: list[bytes] = []
        self.release = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.running += 1
        self.started.append(scope["path"])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        await self.release.wait()
        self.running -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def body(data: bytes, more: bool = False) -> Message:
    return {"type": "http.request", "body": data, "more_body": more}


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_past_the_cap_a_request_waits_then_gets_503_with_retry_after() -> None:
    async def test() -> None:
        app = Held()
        admission = Admission(app, limit=2, wait_s=0.2, retry_after_s=7)
        clients = [Client(body(b"{}")) for _ in range(3)]
        tasks = [asyncio.create_task(admission(scope(), c.receive, c.send)) for c in clients]
        await settle()
        assert (app.running, admission.in_flight, admission.waiting) == (2, 2, 1)

        await tasks[2]  # refused once its wait is over; the app never saw it
        assert clients[2].status == 503
        assert clients[2].header(b"retry-after") == b"7"
        assert b"at capacity" in clients[2].sent[1]["body"]
        assert app.started == ["/api/v1/servers"] * 2
        assert (admission.stats.refused, admission.waiting) == (1, 0)

        app.release.set()
        await asyncio.gather(*tasks[:2])
        assert [c.status for c in clients[:2]] == [200, 200]
        assert admission.in_flight == 0

    run(test)


def test_a_freed_slot_goes_to_the_longest_waiter_with_the_body_read_while_waiting() -> None:
    async def test() -> None:
        app = Held()
        admission = Admission(app, limit=1, wait_s=5, retry_after_s=1)
        first = Client(body(b"first"))
        second = Client(body(b"sec", more=True), body(b"ond"))
        third = Client(body(b"third"))
        tasks = [asyncio.create_task(admission(scope(), first.receive, first.send))]
        await settle()
        for client in (second, third):
            tasks.append(asyncio.create_task(admission(scope(), client.receive, client.send)))
            await settle()
        assert (admission.in_flight, admission.waiting) == (1, 2)
        # While waiting, at most one chunk is read: not the rest of a body still coming.
        assert second.reads == 1

        app.release.set()
        await asyncio.gather(*tasks)
        assert app.bodies == [b"first", b"second", b"third"]
        assert [c.status for c in (first, second, third)] == [200, 200, 200]
        assert (admission.in_flight, admission.waiting, admission.stats.admitted) == (0, 0, 3)

    run(test)


def test_a_client_that_disconnects_while_waiting_costs_nothing_more() -> None:
    async def test() -> None:
        app = Held()
        admission = Admission(app, limit=1, wait_s=5, retry_after_s=1)
        busy = Client(body(b"{}"))
        gone = Client(body(b"{}"))
        holder = asyncio.create_task(admission(scope(), busy.receive, busy.send))
        await settle()
        waiter = asyncio.create_task(admission(scope(), gone.receive, gone.send))
        await settle()
        assert admission.waiting == 1

        gone.incoming.put_nowait({"type": "http.disconnect"})
        await asyncio.wait_for(waiter, timeout=1)  # at once, not after its 5 s wait
        assert gone.sent == []
        assert (admission.waiting, admission.stats.abandoned, app.started) == (
            0,
            1,
            ["/api/v1/servers"],
        )
        app.release.set()
        await holder
        assert admission.in_flight == 0

    run(test)


def test_probes_bypass_the_cap_and_expect_continue_is_not_answered_while_waiting() -> None:
    async def test() -> None:
        app = Held()
        admission = Admission(app, limit=1, wait_s=0.1, retry_after_s=1)
        busy = Client(body(b"{}"))
        holder = asyncio.create_task(admission(scope(), busy.receive, busy.send))
        await settle()
        probe = Client(body(b""))
        probing = asyncio.create_task(admission(scope("/healthz"), probe.receive, probe.send))
        await settle()
        assert app.started == ["/api/v1/servers", "/healthz"]

        # Reading would send "100 Continue", inviting the body: a waiting request never reads.
        patient = Client(body(b"{}"))
        expect = [(b"expect", b"100-continue")]
        await admission(scope(headers=expect), patient.receive, patient.send)
        assert (patient.status, patient.reads) == (503, 0)

        app.release.set()
        await asyncio.gather(holder, probing)

    run(test)


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Admission(Held(), limit=0, wait_s=1, retry_after_s=1)


# ---------------------------------------------------------------------------------------------
# The service: the pool exhausted, and the probes beside it


def test_pool_exhausted_is_503_with_retry_after_and_probes_still_answer(
    db: Engine, tmp_path: Path
) -> None:
    # One connection, waited for 0.2 s at most.
    url = db.url.render_as_string(hide_password=False)
    tiny = make_engine(url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        with serve(tiny, tmp_path, api_retry_after_s=3) as live:
            token = live.token(Role.VIEWER)
            held = tiny.connect()  # the pool's only connection
            try:
                answer = live.client(token).get("/api/v1/servers")
                assert answer.status_code == 503, answer.text
                assert answer.headers["retry-after"] == "3"
                assert "busy" in answer.json()["detail"]
                # The probes use no pool connection (and no worker thread).
                assert live.client().get("/healthz").json() == {"status": "ok"}
                ready = live.client().get("/readyz")
                assert ready.status_code == 200, ready.text
                assert ready.json() == {
                    "status": "ready",
                    "checks": {"database": "ok", "migrations": "ok"},
                }
            finally:
                held.close()
            assert live.client(token).get("/api/v1/servers").status_code == 200
    finally:
        tiny.dispose()


def test_under_uvicorn_a_waiting_client_that_hangs_up_is_dropped_at_once() -> None:
    """The disconnect reaches the waiting request through a real server (uvicorn's `receive`),
    not just through the hand-made messages above."""
    release = threading.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    admission = Admission(slow, limit=1, wait_s=30, retry_after_s=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(admission, log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    request = b"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"

    wait_until = partial(wait_for, timeout=10, every=0.01)

    try:
        wait_until("uvicorn started", lambda: server.started)
        holder = socket.create_connection(("127.0.0.1", port))
        holder.sendall(request)
        wait_until("the first request admitted", lambda: admission.in_flight == 1)
        with socket.create_connection(("127.0.0.1", port)) as waiter:
            waiter.sendall(request)
            wait_until("the second request waiting", lambda: admission.waiting == 1)
        # Hung up: dropped long before its 30 s wait, and never reaches the app.
        wait_until("the hang-up noticed", lambda: admission.stats.abandoned == 1)
        assert (admission.waiting, admission.in_flight, admission.stats.admitted) == (0, 1, 1)
        release.set()
        assert holder.recv(1024).startswith(b"HTTP/1.1 200")
        holder.close()
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)
        sock.close()
