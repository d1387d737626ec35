"""The router's forwarding client: keep-alive HTTP/1.1 to the engines, on asyncio protocols.

Why not aiohttp's ClientSession (which the polls and load reports still use): on the
forwarding path it was about half of the router's CPU per request (bench/router_overhead.py).
This client does only what forwarding needs:

- POST only. The request goes out as one buffer: a request line, `Host`, `Content-Type`,
  `Content-Length`, and the body unchanged. No `Accept-Encoding`: the engine answers identity.
- Responses are parsed by `httptools` (llhttp): the status, the headers the router passes on
  (`PASSED`), Content-Length, chunked, or read-to-close bodies. SSE streams are read chunk by
  chunk as they arrive; while more than `HIGH_WATER` bytes wait for the router to pass them
  on (it waits for its client to drain before it takes more), the connection stops reading
  from the engine (TCP backpressure), and resumes once the router takes what waits.
- One pool of idle connections per replica URL, most recently used first. A connection goes
  back to its pool only after a complete answer that keeps the connection alive; anything else
  (an answer read in part, an error, a timeout, a cancelled request) closes it. Idle
  connections older than `IDLE_S` are closed rather than reused, below trtllm-serve's 5 s
  keep-alive timeout, so that the engine rarely closes one under us.
- Timeouts: `connect_timeout_s` for a new connection, `total_timeout_s` for the whole
  exchange, connecting and the last body byte included (aiohttp's `total`).

Errors: every failure raises `UpstreamError` (`UpstreamTimeout` for timeouts), with `answered`
telling whether any byte of the answer had arrived. The router maps an error before anything
went to its client to "try another replica".

A reused connection the engine closed: an engine may close an idle keep-alive connection just
as the router sends a request on it (its keep-alive timeout, a restart). The router then sees
the connection closed or reset without a byte of answer. That is not the replica failing, so
the request is sent once more on a fresh connection to the same replica, and only if that
fails too does the error reach the router (which counts it against the replica and tries
another). The retry happens only when all of these hold: the connection had served an answer
before (it is reused), not one byte of this answer arrived, and the failure is the connection
closing (not a timeout: a replica that is slow to answer is not tried twice). Sending the
request again is safe in the same sense as the router's own retries: an engine that closed the
connection without answering has not delivered anything, and the router already sends a request
that failed before its first byte to another replica. A fresh connection that fails is never
retried here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from urllib.parse import urlsplit

import httptools

PASSED = frozenset({b"content-type", b"cache-control", b"x-request-id"})
HIGH_WATER = 256 * 1024  # body bytes read from the engine and not yet taken: stop reading
IDLE_S = 4.0  # an idle connection older than this is closed, not reused
MAX_IDLE = 512  # idle connections kept per replica at most


class UpstreamError(Exception):
    """The exchange with the engine failed. `answered`: some byte of the answer had arrived."""

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class UpstreamTimeout(UpstreamError):
    """The connect timeout or the total timeout passed."""


class _Host:
    """One replica URL: where to connect, the `Host` header, the path prefix, idle connections."""

    __slots__ = ("authority", "host", "idle", "port", "prefix", "ssl", "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"{url}: not an http:// or https:// URL")
        self.url = url
        self.host = parts.hostname
        self.ssl = parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        try:
            self.authority = parts.netloc.rpartition("@")[2].encode("idna")
        except UnicodeError as exc:
            raise UpstreamError(f"{url}: {exc}") from None
        # The target is the URL's path followed by the request's (the URL + path the router
        # used to build): a replica "http://host:8100" gets "/v1/completions".
        self.prefix = parts.path.encode("latin-1")
        self.idle: collections.deque[_Conn] = collections.deque()


class _Conn(asyncio.Protocol):
    """One connection to an engine; one exchange at a time (no pipelining)."""

    def __init__(self, host: _Host, loop: asyncio.AbstractEventLoop) -> None:
        self.host = host
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.uses = 0  # answers completed on this connection
        self.idle_since = 0.0
        self.lost = False
        self.in_idle = False
        # The exchange in progress.
        self.busy = False
        self.answered = False  # a byte of the answer arrived
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.until_close = False  # no Content-Length, not chunked: the body ends at close
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.content_type = ""
        self.framed = False
        self.buffer: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.streaming = False
        self.paused = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing asked: an engine that talks out of turn is not reused
            self.abort()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError(f"bad answer from {self.host.url}: {exc}", answered=True))

    def eof_received(self) -> bool:
        return False  # close; connection_lost sorts out what it means

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.in_idle:
            self.in_idle = False
            with contextlib.suppress(ValueError):
                self.host.idle.remove(self)
        if not self.busy or self.complete:
            return
        if self.head_done and self.until_close and exc is None:
            self.complete, self.keep_alive = True, False  # the body was "until close"
            self._wake()
            return
        why = f": {exc}" if exc else ""
        self.fail(
            UpstreamError(f"{self.host.url} closed the connection{why}", answered=self.answered)
        )

    def pause_writing(self) -> None:  # a large body on its way out: asyncio buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.head_done:  # a second answer to one request
            raise httptools.HttpParserError("more than one answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in PASSED:
            text = value.decode("latin-1")
            self.headers.append((name.decode(), text))
            if name == b"content-type":
                self.content_type = text
        elif name == b"content-length" or name == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: informational, the real answer follows
            self.headers.clear()
            self.content_type = ""
            self.framed = False
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.until_close = not self.framed and status not in (204, 304)
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.buffer.append(body)
        self.buffered += len(body)
        if self.streaming and not self.paused and self.buffered > HIGH_WATER:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done:  # the end of a 1xx
            return
        self.complete = True
        self._wake()

    # -- the exchange ----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.abort()
        self._wake()

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def timed_out(self) -> None:
        self.timer = None
        self.fail(
            UpstreamTimeout(f"{self.host.url} did not answer in time", answered=self.answered)
        )

    async def exchange(self, data: bytes, deadline: float) -> Response:
        """Send one request; return once the answer's status and headers are in."""
        assert self.transport is not None
        self.busy = True
        self.answered = self.head_done = self.complete = self.keep_alive = False
        self.until_close = self.framed = self.streaming = self.paused = False
        self.status, self.buffered, self.error = 0, 0, None
        self.headers = []
        self.content_type = ""
        self.buffer.clear()
        self.timer = self.loop.call_at(deadline, self.timed_out)
        try:
            self.transport.write(data)
            while not self.head_done:
                if self.error is not None:
                    raise self.error
                if self.lost:
                    raise UpstreamError(f"{self.host.url} closed the connection")
                await self.wait()
        except BaseException:
            self.finish()
            raise
        return Response(self)

    def finish(self) -> None:
        """The exchange is over: back to the idle pool if the answer was whole and the
        connection may be kept, else closed."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.busy:
            return
        self.busy = False
        self.buffer.clear()
        host = self.host
        if (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.lost
            and self.transport is not None
            and not self.transport.is_closing()
            and len(host.idle) < MAX_IDLE
        ):
            if self.paused:
                self.transport.resume_reading()
                self.paused = False
            self.uses += 1
            self.idle_since = self.loop.time()
            self.in_idle = True
            host.idle.append(self)
        else:
            self.abort()


class Response:
    """The answer of one exchange, status and headers in. Call `read()` for the whole body
    or `read_chunk()` until it returns b""; and `release()` when done, whatever happened.

    Once the answer is whole (or released) the Response lets go of its connection, which may
    carry the next request at once: nothing done with this Response afterwards reaches it."""

    __slots__ = ("_conn", "content_type", "headers", "status")

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status = conn.status
        self.headers = conn.headers  # only the PASSED ones, lower-case names
        self.content_type = conn.content_type

    async def read(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise UpstreamError("the answer was released", answered=True)
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            if conn.lost:
                raise UpstreamError(f"{conn.host.url} closed the connection", answered=True)
            await conn.wait()
        buffer = conn.buffer
        body = buffer[0] if len(buffer) == 1 else b"".join(buffer)
        self.release()
        return body

    async def read_chunk(self) -> bytes:
        """What has arrived of the body since the last call (waiting for something if need
        be); b"" at the end."""
        conn = self._conn
        if conn is None:
            return b""
        conn.streaming = True
        buffer = conn.buffer
        while not buffer:
            if conn.complete:
                self.release()
                return b""
            if conn.error is not None:
                raise conn.error
            if conn.lost:
                raise UpstreamError(f"{conn.host.url} closed the connection", answered=True)
            await conn.wait()
        chunk = buffer.popleft() if len(buffer) == 1 else b"".join(buffer)
        buffer.clear()
        conn.buffered = 0
        if conn.paused:  # all taken: read from the engine again
            conn.paused = False
            assert conn.transport is not None
            conn.transport.resume_reading()
        return chunk

    def release(self) -> None:
        """Done with the answer: a whole one frees the connection for the next request; one
        read in part (or not at all) closes it. Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()


class UpstreamClient:
    """Keep-alive POSTs to replicas; see the module doc."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        total_timeout_s: float,
        idle_s: float = IDLE_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self.idle_s = idle_s
        self._ssl = ssl_context
        self._hosts: dict[str, _Host] = {}
        self._heads: dict[tuple[str, str, str], bytes] = {}
        self.connects = 0  # new connections made (tests, benchmarks)

    async def post(self, url: str, path: str, body: bytes, content_type: str) -> Response:
        """POST `body` to `url` + `path`; the answer once its status and headers are in.
        Raises UpstreamError (UpstreamTimeout) when the exchange fails."""
        loop = asyncio.get_running_loop()
        key = (url, path, content_type)
        head = self._heads.get(key)
        host = self._hosts.get(url)
        if head is None or host is None:
            if host is None:
                host = self._hosts[url] = _Host(url)
            head = (
                b"POST "
                + host.prefix
                + path.encode("latin-1")
                + b" HTTP/1.1\r\nHost: "
                + host.authority
                + b"\r\nContent-Type: "
                + content_type.encode("latin-1")
                + b"\r\nContent-Length: "
            )
            if len(self._heads) < 1024:
                self._heads[key] = head
        data = b"%s%d\r\n\r\n%s" % (head, len(body), body)
        now = loop.time()
        deadline = now + self.total_timeout_s
        conn = self._idle(host, now)
        if conn is not None:
            try:
                return await conn.exchange(data, deadline)
            except UpstreamError as exc:
                if isinstance(exc, UpstreamTimeout) or exc.answered:
                    raise
                # The engine closed a reused idle connection under us: once more, fresh.
        conn = await self._connect(host, loop, deadline)
        return await conn.exchange(data, deadline)

    def _idle(self, host: _Host, now: float) -> _Conn | None:
        idle = host.idle
        oldest = now - self.idle_s
        while idle and idle[0].idle_since < oldest:  # too old to trust: close
            stale = idle.popleft()
            stale.in_idle = False
            stale.abort()
        while idle:
            conn = idle.pop()
            conn.in_idle = False
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(
        self, host: _Host, loop: asyncio.AbstractEventLoop, deadline: float
    ) -> _Conn:
        timeout = min(self.connect_timeout_s, deadline - loop.time())
        context: ssl.SSLContext | None = None
        if host.ssl:
            context = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                _, conn = await loop.create_connection(
                    lambda: _Conn(host, loop), host.host, host.port, ssl=context
                )
        except TimeoutError:
            raise UpstreamTimeout(f"connecting to {host.url} timed out") from None
        except OSError as exc:
            raise UpstreamError(f"connecting to {host.url}: {exc}") from exc
        self.connects += 1
        return conn

    def idle_connections(self, url: str) -> int:
        host = self._hosts.get(url)
        return len(host.idle) if host is not None else 0

    async def close(self) -> None:
        """Close every idle connection (those in use close when their exchange ends)."""
        for host in self._hosts.values():
            while host.idle:
                conn = host.idle.pop()
                conn.in_idle = False
                conn.abort()
        self._hosts.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
