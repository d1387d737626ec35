"""Misbehaving BMCs that no emulator can play, shared by the driver and API tests."""

from __future__ import annotations

import base64
import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StalledBmc:
    """Accepts TCP connections and never answers (a hung BMC web server)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="stalled-bmc", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self.connections:
            conn.close()
        self.sock.close()


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class RecordingBmc:
    """A tiny Redfish BMC on 127.0.0.1 (plain HTTP, basic auth, no SessionService, one system
    "1") that records every connection and every request: where a test points a server's BMC
    to see exactly what the fleet sends there (a host someone moved a BMC address to)."""

    def __init__(self, username: str = "admin", password: str | None = None) -> None:
        self.username, self.password = username, password  # None: refuse everyone
        self.seen: list[Seen] = []
        self.connections = 0
        self.lock = threading.Lock()
        bmc = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                bmc._answer(self, "GET")

            def do_POST(self) -> None:
                bmc._answer(self, "POST")

            def do_PATCH(self) -> None:
                bmc._answer(self, "PATCH")

            def do_DELETE(self) -> None:
                bmc._answer(self, "DELETE")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self) -> tuple[socket.socket, Any]:
                request = super().get_request()
                with bmc.lock:
                    bmc.connections += 1
                return request

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="recording-bmc", daemon=True
        )
        self._thread.start()

    def requests(self) -> list[Seen]:
        with self.lock:
            return list(self.seen)

    def authorization(self) -> str | None:
        """The basic-auth header that this BMC accepts."""
        if self.password is None:
            return None
        pair = f"{self.username}:{self.password}".encode()
        return f"Basic {base64.b64encode(pair).decode()}"

    def _answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        path = h.path.rstrip("/") or "/"
        with self.lock:
            self.seen.append(Seen(method, path, dict(h.headers.items()), body))
        system = "/redfish/v1/Systems/1"
        reply: tuple[int, Any]
        if path == "/redfish/v1" and method == "GET":
            reply = 200, {"Systems": {"@odata.id": "/redfish/v1/Systems"}}
        elif h.headers.get("Authorization") != self.authorization() or self.password is None:
            reply = 401, {"error": {"message": "unauthorised"}}
        elif path == system and method == "GET":
            reset = {"target": f"{system}/Actions/ComputerSystem.Reset"}
            actions = {"#ComputerSystem.Reset": reset}
            reply = 200, {"@odata.id": system, "PowerState": "On", "Actions": actions}
        else:
            reply = 404, {"error": {"message": "not here"}}
        data = json.dumps(reply[1]).encode()
        h.send_response(reply[0])
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> RecordingBmc:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
