"""A plain HTTP server for weights that misbehaves on purpose (tests and benchmarks only).

It serves a directory with Range support (the standard library's SimpleHTTPRequestHandler has
none) and, per file, a script of faults for its GET requests in order: `cut` (send the headers
for the whole range, then close the connection after `cut_after` bytes: a link that drops),
`flip` (invert one byte of the body `flip_at` bytes into the file: a corrupting middlebox),
then plain answers. Every GET is recorded with its Range header, so a test can show that a
download resumed where it was cut. Not a test module; importing it starts nothing.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 4 << 20


@dataclass
class Seen:
    path: str
    range: str | None
    fault: str | None


@dataclass
class FaultyFiles:
    root: Path
    cut_after: int = 64 << 20
    flip_at: int = 0
    faults: dict[str, list[str]] = field(default_factory=dict)  # file name → faults, in order
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_fault(self, name: str, range_header: str | None) -> str | None:
        with self.lock:
            script = self.faults.get(name) or []
            fault = script.pop(0) if script else None
            self.seen.append(Seen(name, range_header, fault))
            return fault


def _handler(files: FaultyFiles) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def _target(self) -> Path | None:
            name = self.path.split("?", 1)[0].lstrip("/")
            path = (files.root / name).resolve()
            if files.root.resolve() not in path.parents or not path.is_file():
                self.send_error(404)
                return None
            return path

        def do_HEAD(self) -> None:
            path = self._target()
            if path is None:
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self) -> None:
            path = self._target()
            if path is None:
                return
            size = path.stat().st_size
            start, end = 0, size - 1
            header = self.headers.get("Range")
            if header:
                m = _RANGE.match(header.strip())
                if not m or int(m.group(1)) >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            fault = files.next_fault(path.name, header)
            self.send_response(206 if header else 200)
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            if header:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            sent, limit = 0, end - start + 1
            if fault == "cut":
                limit = min(limit, files.cut_after)
            with open(path, "rb") as f:
                f.seek(start)
                while sent < limit:
                    chunk = f.read(min(_CHUNK, limit - sent))
                    if not chunk:
                        break
                    if fault == "flip" and start + sent <= files.flip_at < start + sent + len(
                        chunk
                    ):
                        i = files.flip_at - start - sent
                        chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    sent += len(chunk)
            if fault == "cut":  # fewer bytes than Content-Length said, then the link is gone
                self.close_connection = True
                self.wfile.flush()
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


class FaultyServer:
    """The server on 127.0.0.1 (a free port), in a thread; `stop()` ends it."""

    def __init__(self, files: FaultyFiles) -> None:
        self.files = files
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(files))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)
