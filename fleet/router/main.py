"""`fleetctl router run`: the router as its own process (aiohttp on one event loop), or as
`--workers N` such processes sharing the port.

Workers: the parent holds the port (a socket bound with SO_REUSEPORT, never listening, so the
kernel gives it no connection) and forks N workers. Each worker is a whole router: its own
socket on the same address and port (SO_REUSEPORT: the kernel spreads new connections over
the workers), its own event loop, polls, waiting rooms, metrics and load reports. The parent
serves nothing: on SIGTERM or SIGINT it passes SIGTERM to every worker and waits for them; if
a worker dies on its own, it stops the others and exits 1 (whatever supervises the router
restarts it, as it would a single process). A parent that dies (even by SIGKILL) takes its
workers with it (Linux's parent-death signal).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import socket
import ssl
from collections.abc import Callable
from contextlib import suppress

from aiohttp import web

from fleet.router.config import RouterSettings
from fleet.router.proxy import Router
from fleet.tls import server_context

log = logging.getLogger(__name__)
FIRST_POLL_S = 10.0  # a worker waits this long at most for its first table read to listen


async def serve(
    settings: RouterSettings,
    sock: socket.socket | Callable[[], socket.socket],
    stop: asyncio.Event,
    *,
    first_poll_s: float = 0.0,
) -> None:
    """Serve on `sock` until `stop` is set. With `first_poll_s`, `sock` is made (a callable
    that binds and listens) only once the first routing-table read is over, or after that many
    seconds: a worker joins the shared port ready to route, not answering 404s meanwhile."""
    router = Router(settings)
    # handler_cancellation: a client that goes away cancels its request (and gives its place in
    # the waiting room back) instead of having it forwarded to nobody.
    runner = web.AppRunner(
        router.app(), access_log=None, handle_signals=False, handler_cancellation=True
    )
    await runner.setup()
    try:
        if first_poll_s > 0:
            with suppress(TimeoutError):
                await asyncio.wait_for(router.polled.wait(), first_poll_s)
        listening = sock() if callable(sock) else sock
        site = web.SockSite(runner, listening, backlog=2048, ssl_context=server_tls(settings))
        await site.start()
        await stop.wait()
    finally:
        await runner.cleanup()


def server_tls(settings: RouterSettings) -> ssl.SSLContext | None:
    """https when a certificate is configured (FleetError if it does not load)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return server_context(settings.tls_cert, settings.tls_key)


def _socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP (else every keep-alive answer waits for a delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def bind(settings: RouterSettings) -> socket.socket:
    """The listening socket; with workers, the parent's socket that holds the port (bound with
    SO_REUSEPORT, not listening: the workers listen on sockets of their own)."""
    sock = _socket(settings.listen_host, settings.listen_port, reuse_port=settings.workers > 1)
    if settings.workers == 1:
        sock.listen(2048)
        sock.setblocking(False)
    return sock


def _tune() -> None:
    # Everything loaded so far lives as long as the process: keep it out of the collector's
    # generations, and collect less often (measured: ~20 % more requests a second, and the
    # p99 at one connection halved — bench/router_overhead.py).
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def _serve_until_signalled(
    settings: RouterSettings,
    sock: socket.socket | Callable[[], socket.socket],
    first_poll_s: float = 0.0,
) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(settings, sock, stop, first_poll_s=first_poll_s)

    asyncio.run(main())


def run(settings: RouterSettings, sock: socket.socket | None = None) -> None:
    """Run until SIGTERM or SIGINT (with workers: until every worker has stopped)."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server_tls(settings)  # a certificate that does not load fails here, before any fork
    sock = sock or bind(settings)
    if settings.workers == 1:
        _tune()
        _serve_until_signalled(settings, sock)
        return
    code = _supervise(settings, sock)
    if code:
        raise SystemExit(code)


def _die_with(parent: int) -> None:
    """Linux: SIGTERM this worker when the parent dies (even by SIGKILL), so that no orphan
    keeps serving on the port."""
    with suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def _supervise(settings: RouterSettings, held: socket.socket) -> int:
    """Fork the workers, pass SIGTERM/SIGINT on to them, wait for them all. 0, or 1 when a
    worker stopped on its own."""
    host, port = settings.listen_host, held.getsockname()[1]
    parent = os.getpid()
    workers: set[int] = set()
    stopping = False

    def stop_all(*_: object) -> None:
        nonlocal stopping
        if os.getpid() != parent:  # a worker that got a signal before it set its own handlers
            os._exit(0)
        stopping = True
        for pid in workers:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    for _ in range(settings.workers):
        if stopping:
            break
        pid = os.fork()
        if pid == 0:  # a worker: a whole router on a socket of its own
            code = 0
            try:
                held.close()
                _die_with(parent)

                def listen() -> socket.socket:
                    sock = _socket(host, port, reuse_port=True)
                    sock.listen(2048)
                    sock.setblocking(False)
                    return sock

                _tune()
                _serve_until_signalled(settings, listen, FIRST_POLL_S)
            except BaseException:
                log.exception("router worker %d failed", os.getpid())
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        workers.add(pid)
    failed = 0
    while workers:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        workers.discard(pid)
        if not stopping:
            log.error(
                "router worker %d exited (%d): stopping the others",
                pid,
                os.waitstatus_to_exitcode(status),
            )
            failed = 1
            stop_all()
    held.close()
    return failed
