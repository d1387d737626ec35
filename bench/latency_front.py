"""Latency-adding fronts for BMC emulators: real BMCs are slow, local emulators are not.

- `HttpFront`: a threaded HTTP proxy on 127.0.0.1 that sleeps `latency` seconds, then forwards
  the request (method, path, headers including Authorization, body) to one upstream and sends
  back its status, headers and body. One connection per request (HTTP/1.0), as sushy-emulator
  itself answers `Connection: close`.
- `UdpFront`: a UDP relay on 127.0.0.1 for one IPMI BMC. Each datagram from a client reaches the
  BMC `latency` seconds late; replies go back at once, through the front's socket, to the client
  address that sent the request (one upstream socket per client address).

Both count what they forward (`count`), so a benchmark can tell how many BMC calls an action
made; `distinct` leaves out UDP retransmits (a datagram identical to one already seen: pyghmi
resends a request it has had no answer to within 0.5-1 s, less than a 1 s front's round trip).
Used by bench/power.py.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOST = "127.0.0.1"
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
}


class DelayLine:
    """Runs callables at a given time, in order, from one scheduler thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="delay-line", daemon=True)
        self._thread.start()

    def at(self, due: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), fn))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    wait = self._heap[0][0] - now if self._heap else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            with contextlib.suppress(OSError):  # a socket closed: the datagram is lost
                fn()


class Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.value += n


class HttpFront:
    """`latency` seconds, then forward to http://HOST:`upstream_port`."""

    def __init__(self, upstream_port: int, latency: float, timeout: float = 30.0) -> None:
        self.count = Counter()
        self.distinct = self.count
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def _forward(self) -> None:
                front.count.add()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                time.sleep(latency)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn = http.client.HTTPConnection(HOST, upstream_port, timeout=timeout)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for key, value in resp.getheaders():
                        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                except OSError as exc:
                    self.send_error(502, f"front: upstream failed: {exc}")
                finally:
                    conn.close()

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = do_HEAD = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256

        self._server = Server((HOST, 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="http-front", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


class UdpFront:
    """Client → BMC datagrams delayed by `latency` s (via `line`); replies forwarded at once."""

    def __init__(self, upstream_port: int, latency: float, line: DelayLine) -> None:
        self.count = Counter()
        self.distinct = Counter()
        self._seen: set[bytes] = set()
        self._upstream = (HOST, upstream_port)
        self._latency = latency
        self._line = line
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((HOST, 0))
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._clients: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._from_clients, name="udp-front", daemon=True)]
        self._threads[0].start()

    def _from_clients(self) -> None:
        while not self._closed.is_set():
            try:
                data, addr = self._sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            self.count.add()
            if data not in self._seen:
                self._seen.add(data)
                self.distinct.add()
            upstream = self._upstream_for(addr)
            self._line.at(
                time.monotonic() + self._latency,
                lambda up=upstream, d=data: up.send(d),  # type: ignore[misc]
            )

    def _upstream_for(self, addr: tuple[str, int]) -> socket.socket:
        with self._lock:
            sock = self._clients.get(addr)
            if sock is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.connect(self._upstream)
                sock.settimeout(0.2)
                self._clients[addr] = sock
                thread = threading.Thread(
                    target=self._to_client, args=(sock, addr), name="udp-front-back", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            return sock

    def _to_client(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        while not self._closed.is_set():
            try:
                data = sock.recv(65535)
            except TimeoutError:
                continue
            except OSError:
                continue  # e.g. ICMP port unreachable while the BMC restarts
            try:
                self._sock.sendto(data, addr)
            except OSError:
                return

    def close(self) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join(1.0)
        self._sock.close()
        with self._lock:
            for sock in self._clients.values():
                sock.close()
            self._clients.clear()
