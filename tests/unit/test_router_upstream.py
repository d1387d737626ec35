"""The router's forwarding client (fleet/router/upstream.py) against real asyncio servers on
127.0.0.1 whose answers each test scripts byte by byte: Content-Length, chunked and read-to-close
bodies, SSE chunk by chunk with backpressure, keep-alive reuse, an engine closing an idle
connection under a request, connect refused, timeouts, cancellation."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from fleet.router.upstream import (
    HIGH_WATER,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeout,
)

BODY = b'{"model": "llama", "prompt": "hi", "max_tokens": 1}'
ANSWER = b'{"choices": [{"text": " hello"}]}'


class _ServerConn(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.buf = b""
        self.requests: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.conns.append(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            size = 0
            for line in self.buf[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    size = int(value)
            if len(self.buf) < end + 4 + size:
                return
            request, self.buf = self.buf[: end + 4 + size], self.buf[end + 4 + size :]
            self.requests.append(request)
            answered = self.server.answer(self, request)
            if answered is not None:
                self.server.tasks.append(asyncio.ensure_future(answered))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        assert self.transport is not None
        self.transport.close()


Answer = Callable[[_ServerConn, bytes], Coroutine[Any, Any, None] | None]


class Server:
    """A real HTTP/1.1 server on 127.0.0.1: `answer(conn, request)` writes each answer (or
    returns a coroutine that does)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.conns: list[_ServerConn] = []
        self.tasks: list[asyncio.Future[None]] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Server:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        for task in self.tasks:
            task.cancel()
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.abort()
        self._server.close()
        await self._server.wait_closed()


def ok(body: bytes = ANSWER, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-ID: req-1\r\n"
        b"Server: test\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(test(), 4)

    asyncio.run(bounded())


def client(total: float = 2.0) -> UpstreamClient:
    return UpstreamClient(connect_timeout_s=1.0, total_timeout_s=total)


# ---------------------------------------------------------------------------------------------


def test_a_content_length_answer_and_the_request_as_sent() -> None:
    async def main() -> None:
        async with Server(lambda conn, _: conn.write(ok())) as server:
            c = client()
            reply = await c.post(server.url, "/v1/completions?x=1", BODY, "application/json")
            assert reply.status == 200
            assert reply.content_type == "application/json"
            assert reply.headers == [
                ("content-type", "application/json"),
                ("x-request-id", "req-1"),
            ]
            assert await reply.read() == ANSWER
            reply.release()
            [conn] = server.conns
            [request] = conn.requests
            head, body = request.split(b"\r\n\r\n", 1)
            assert body == BODY
            lines = head.split(b"\r\n")
            assert lines[0] == b"POST /v1/completions?x=1 HTTP/1.1"
            assert set(lines[1:]) == {
                f"Host: 127.0.0.1:{server.port}".encode(),
                b"Content-Type: application/json",
                b"Content-Length: %d" % len(BODY),
            }
            assert c.idle_connections(server.url) == 1
            await c.close()

    run(main)


def test_a_chunked_answer_in_pieces_and_a_read_to_close_one() -> None:
    async def chunked(conn: _ServerConn, _: bytes) -> None:
        conn.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n")
        conn.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in (ANSWER[:10], ANSWER[10:]):
            await asyncio.sleep(0.01)
            conn.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.write(b"0\r\n\r\n")

    def until_close(conn: _ServerConn, _: bytes) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + ANSWER)
        conn.close()

    async def main() -> None:
        async with Server(chunked) as server:
            c = client()
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert reply.status == 201
            assert await reply.read() == ANSWER
            assert c.idle_connections(server.url) == 1  # chunked keeps the connection
        async with Server(until_close) as server:
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert (reply.status, await reply.read()) == (200, ANSWER)
            assert c.idle_connections(server.url) == 0
        await c.close()

    run(main)


def test_sse_arrives_chunk_by_chunk() -> None:
    go = [asyncio.Event() for _ in range(3)]

    async def sse(conn: _ServerConn, _: bytes) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        conn.write(b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, event in enumerate(go):
            await event.wait()
            data = b'data: {"n": %d}\n\n' % i
            conn.write(b"%x\r\n%s\r\n" % (len(data), data))
        conn.write(b"0\r\n\r\n")

    async def main() -> None:
        async with Server(sse) as server:
            c = client()
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert reply.content_type == "text/event-stream"
            assert ("cache-control", "no-cache") in reply.headers
            for i, event in enumerate(go):
                event.set()  # the server sends event i only now: the read sees it alone
                assert await reply.read_chunk() == b'data: {"n": %d}\n\n' % i
            assert await reply.read_chunk() == b""
            reply.release()
            assert c.idle_connections(server.url) == 1
            await c.close()

    run(main)


def test_a_stream_nobody_reads_stops_reading_from_the_engine() -> None:
    size = 64 * 1024
    total = 40 * size  # 2.5 MiB: far more than HIGH_WATER

    async def flood(conn: _ServerConn, _: bytes) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        conn.write(b"Content-Length: %d\r\n\r\n" % total)
        for _i in range(total // size):
            conn.write(b"x" * size)
            await asyncio.sleep(0)

    async def main() -> None:
        async with Server(flood) as server:
            c = client()
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            got = len(await reply.read_chunk())
            await asyncio.sleep(0.3)  # a slow client: the engine gets ahead
            conn = reply._conn
            assert conn is not None and conn.paused
            assert conn.buffered <= HIGH_WATER + 256 * 1024  # one read past the mark at most
            while chunk := await reply.read_chunk():
                got += len(chunk)
            assert got == total
            await c.close()

    run(main)


def test_a_late_release_does_not_touch_the_next_exchange_on_the_connection() -> None:
    def answer(conn: _ServerConn, _: bytes) -> None:
        conn.write(ok(b"%d" % len(conn.requests)))

    async def main() -> None:
        async with Server(answer) as server:
            c = client()
            first = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert await first.read_chunk() == b"1"
            assert await first.read_chunk() == b""  # whole: the connection is free again
            second = await c.post(server.url, "/v1/completions", BODY, "application/json")
            first.release()  # late (the router releases in a `finally`): a no-op now
            assert await first.read_chunk() == b""
            assert await second.read() == b"2"
            assert c.connects == 1 and c.idle_connections(server.url) == 1
            await c.close()

    run(main)


def test_keep_alive_reuses_one_connection() -> None:
    def answer(conn: _ServerConn, _: bytes) -> None:
        sixth = sum(len(c.requests) for c in server.conns) == 6
        conn.write(ok()[:-5] if sixth else ok())  # the sixth: the rest of the body comes late

    async def main() -> None:
        async with server:
            c = client()
            for _ in range(5):
                reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
                assert await reply.read() == ANSWER
            assert len(server.conns) == 1 and len(server.conns[0].requests) == 5
            assert c.connects == 1
            # An answer left unread in part closes its connection; the next one opens another.
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            reply.release()
            await server.conns[0].lost
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert await reply.read() == ANSWER
            assert c.connects == 2
            await c.close()

    server = Server(answer)
    run(main)


def test_an_engine_closing_an_idle_connection_is_not_a_failure() -> None:
    def answer_once(conn: _ServerConn, _: bytes) -> None:
        if len(conn.requests) == 1:
            conn.write(ok())
        else:
            conn.close()  # its keep-alive timeout struck as the request came: no answer

    async def main() -> None:
        async with Server(answer_once) as server:
            c = client()
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert await reply.read() == ANSWER
            # Closed under the request: sent once more on a fresh connection, answered there.
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert await reply.read() == ANSWER
            assert c.connects == 2
            # Closed while idle, seen before the next request: a fresh connection, no error.
            server.conns[-1].close()
            await server.conns[-1].lost
            await asyncio.sleep(0.01)
            assert c.idle_connections(server.url) == 0
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert await reply.read() == ANSWER
            assert c.connects == 3
            await c.close()

    run(main)


def test_a_fresh_connection_closed_without_an_answer_fails_once() -> None:
    async def main() -> None:
        async with Server(lambda conn, _: conn.close()) as server:
            c = client()
            with pytest.raises(UpstreamError) as failed:
                await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert not failed.value.answered
            assert len(server.conns) == 1  # not retried: the replica failed
            await c.close()

    run(main)


def test_an_answer_cut_mid_body_is_an_error_after_answering() -> None:
    def cut(conn: _ServerConn, _: bytes) -> None:
        conn.write(ok()[:-5])
        conn.close()

    async def main() -> None:
        async with Server(cut) as server:
            c = client()
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            with pytest.raises(UpstreamError) as failed:
                await reply.read()
            assert failed.value.answered
            await c.close()

    run(main)


def test_connect_refused_is_an_upstream_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        c = client()
        with pytest.raises(UpstreamError) as failed:
            await c.post(f"http://127.0.0.1:{port}", "/v1/completions", BODY, "application/json")
        assert not failed.value.answered and not isinstance(failed.value, UpstreamTimeout)
        await c.close()

    run(main)


def test_timeouts_before_and_after_the_head() -> None:
    def silent(conn: _ServerConn, _: bytes) -> None:
        if len(conn.requests) == 1:
            conn.write(ok())  # answers once, then never again on this connection

    def stalls(conn: _ServerConn, _: bytes) -> None:
        conn.write(ok()[:-5])  # the head and part of the body, then nothing

    async def main() -> None:
        c = client(total=0.2)
        loop = asyncio.get_running_loop()
        async with Server(silent) as server:
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert await reply.read() == ANSWER
            started = loop.time()
            with pytest.raises(UpstreamTimeout) as failed:
                await c.post(server.url, "/v1/completions", BODY, "application/json")
            assert 0.15 < loop.time() - started < 1.0
            assert not failed.value.answered
            assert len(server.conns) == 1  # a timeout on a reused connection: not retried
            await server.conns[0].lost  # and that connection is closed
        async with Server(stalls) as server:
            reply = await c.post(server.url, "/v1/completions", BODY, "application/json")
            with pytest.raises(UpstreamTimeout) as failed:
                await reply.read()  # the total timeout covers the body too
            assert failed.value.answered
        await c.close()

    run(main)


def test_a_cancelled_request_closes_its_connection() -> None:
    async def main() -> None:
        async with Server(lambda conn, _: None) as server:
            c = client()
            task = asyncio.create_task(
                c.post(server.url, "/v1/completions", BODY, "application/json")
            )
            while not (server.conns and server.conns[0].requests):
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await server.conns[0].lost
            assert c.idle_connections(server.url) == 0
            await c.close()

    run(main)
