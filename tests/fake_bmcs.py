"""Misbehaving BMCs that no emulator can play, shared by the driver and API tests: one that
never answers (StalledBmc), one that records what reaches it (RecordingBmc), a Redfish BMC
with knobs (FakeRedfish); and ActingBmc, the in-process driver base the provisioning tests'
fakes build on."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fleet.bmc.base import ActionResult, BmcInfo, PowerDriver, Sensors
from fleet.models import PowerState


class ActingBmc(PowerDriver):
    """An in-process PowerDriver whose every power action is one `_send(action, want)`, the
    state the action leaves the server in: subclasses say how a BMC answers (at once, slowly,
    refusing) and what they record."""

    def _send(self, action: str, want: PowerState) -> ActionResult:
        raise NotImplementedError

    def power_on(self) -> ActionResult:
        return self._send("on", PowerState.ON)

    def power_off(self, force: bool = False) -> ActionResult:
        return self._send("force_off" if force else "off", PowerState.OFF)

    def power_cycle(self) -> ActionResult:
        return self._send("cycle", PowerState.ON)

    def identify(self, on: bool = True) -> None: ...

    def info(self) -> BmcInfo:
        return BmcInfo()

    def sensors(self) -> Sensors:
        return Sensors()


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


SESSIONS = "/redfish/v1/SessionService/Sessions"
RESETS_OFF = frozenset({"ForceOff", "GracefulShutdown"})
RESETS_ON = frozenset({"On", "ForceOn", "ForceRestart", "GracefulRestart", "PowerCycle"})


@dataclass(frozen=True)
class RedfishRequest:
    at: float  # time.monotonic() on arrival
    method: str
    path: str
    body: Any  # the JSON body, parsed (None: none)
    headers: dict[str, str]


@dataclass
class FakeRedfish:
    """A Redfish BMC on 127.0.0.1 (plain HTTP) with knobs no emulator has: basic auth and, if
    `sessions`, SessionService tokens; `systems` (id -> PowerState, None: not reported) whose
    Resets apply at once (unless not `resets_apply`); the ResetTypes advertised inline
    (`allowed`) or through @Redfish.ActionInfo; status codes, a stalled Reset; and every
    request with its arrival time. `start()` serves it, `close()` stops it."""

    systems: dict[str, str | None] = field(default_factory=lambda: {"1": "On"})
    username: str = "admin"
    password: str = "password"
    allowed: list[str] | None = None  # ResetType@Redfish.AllowableValues (None: not given)
    action_info: list[str] | None = None  # advertise through @Redfish.ActionInfo instead
    members: int | None = None  # list ids 1..members (None: the ids of `systems`)
    system_status: int = 200
    reset_status: int = 204
    reset_stall_s: float = 0.0  # a Reset waits this long, or until `release` is set
    resets_apply: bool = True  # a Reset changes the system's PowerState
    sessions: bool = False
    session_status: int = 201
    extra: dict[str, Any] = field(default_factory=dict)  # more ComputerSystem properties
    seen: list[RedfishRequest] = field(default_factory=list)
    tokens: set[str] = field(default_factory=set)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    # -- what it received ------------------------------------------------------------------

    def count(self, method: str, path: str) -> int:
        return len(self.requests_to(method, path))

    def requests_to(self, method: str, path: str) -> list[RedfishRequest]:
        with self.lock:
            return [s for s in self.seen if s.method == method and s.path == path]

    def requests(self, system: str, method: str | None = None) -> list[RedfishRequest]:
        """Requests to system `system` or below it (of `method`, if given)."""
        base = f"/redfish/v1/Systems/{system}"
        with self.lock:
            return [
                s
                for s in self.seen
                if (s.path == base or s.path.startswith(base + "/"))
                and (method is None or s.method == method)
            ]

    def resets(self, system: str) -> int:
        return len(self.requests(system, "POST"))

    # -- serving ---------------------------------------------------------------------------

    def start(self) -> int:
        """Serve on a free port (returned) until close()."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.answer(self, "GET")

            def do_POST(self) -> None:
                fake.answer(self, "POST")

            def do_PATCH(self) -> None:
                fake.answer(self, "PATCH")

            def do_DELETE(self) -> None:
                fake.answer(self, "DELETE")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-redfish",
            daemon=True,
        )
        self._thread.start()
        return int(self._server.server_address[1])

    def close(self) -> None:
        self.release.set()  # a stalled Reset answers now
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- answering -------------------------------------------------------------------------

    def system_body(self, system: str, path: str) -> dict[str, Any]:
        reset: dict[str, Any] = {"target": f"{path}/Actions/ComputerSystem.Reset"}
        if self.allowed is not None:
            reset["ResetType@Redfish.AllowableValues"] = self.allowed
        if self.action_info is not None:
            reset["@Redfish.ActionInfo"] = f"{path}/ResetActionInfo"
        body: dict[str, Any] = {
            "@odata.id": path,
            "Id": system,
            "Actions": {"#ComputerSystem.Reset": reset},
        }
        if self.systems[system] is not None:
            body["PowerState"] = self.systems[system]
        return {**body, **self.extra}

    def authorised(self, h: BaseHTTPRequestHandler) -> bool:
        token = h.headers.get("X-Auth-Token")
        if token is not None:
            with self.lock:
                return token in self.tokens
        basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        return h.headers.get("Authorization") == f"Basic {basic}"

    def answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        arrived = time.monotonic()
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        path = h.path.rstrip("/") or "/"
        with self.lock:
            self.seen.append(RedfishRequest(arrived, method, path, body, dict(h.headers.items())))

        def send(status: int, payload: Any = None, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode() if payload is not None else b""
            h.send_response(status)
            for key, value in (headers or {}).items():
                h.send_header(key, value)
            if data:
                h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)

        if path == "/redfish/v1" and method == "GET":
            root: dict[str, Any] = {"Systems": {"@odata.id": "/redfish/v1/Systems"}}
            if self.sessions:
                root["SessionService"] = {"@odata.id": "/redfish/v1/SessionService"}
                root["Links"] = {"Sessions": {"@odata.id": SESSIONS}}
            return send(200, root)
        if path == SESSIONS and method == "POST":
            if not self.sessions:
                return send(404)
            if body != {"UserName": self.username, "Password": self.password}:
                return send(401)
            if self.session_status != 201:
                return send(self.session_status, {"error": {"message": "no sessions today"}})
            token = uuid.uuid4().hex
            with self.lock:
                self.tokens.add(token)
            location = f"{SESSIONS}/{token[:8]}"
            return send(201, {"@odata.id": location}, {"X-Auth-Token": token, "Location": location})
        if not self.authorised(h):
            return send(401, {"error": {"message": "unauthorised"}})
        if path.startswith(SESSIONS + "/") and method == "DELETE":
            with self.lock:
                self.tokens.discard(h.headers.get("X-Auth-Token", ""))
            return send(204)
        if path == "/redfish/v1/Systems" and method == "GET":
            listed = (
                [str(i) for i in range(1, self.members + 1)]
                if self.members is not None
                else list(self.systems)
            )
            members = [{"@odata.id": f"/redfish/v1/Systems/{i}"} for i in listed]
            return send(200, {"Members": members, "Members@odata.count": len(members)})
        parts = path.split("/")  # "", redfish, v1, Systems, ID[, Actions, ComputerSystem.Reset]
        if len(parts) < 5 or parts[3] != "Systems" or parts[4] not in self.systems:
            return send(404)
        system, system_path, rest = parts[4], "/".join(parts[:5]), parts[5:]
        if not rest and method == "GET":
            if self.system_status != 200:
                return send(self.system_status, {"error": {"message": "BMC busy"}})
            return send(200, self.system_body(system, system_path))
        if rest == ["ResetActionInfo"] and method == "GET":
            parameters = [{"Name": "ResetType", "AllowableValues": self.action_info}]
            return send(200, {"Parameters": parameters})
        if rest == ["Actions", "ComputerSystem.Reset"] and method == "POST":
            if self.reset_stall_s:
                self.release.wait(self.reset_stall_s)
            if self.reset_status != 204:
                return send(self.reset_status, {})
            reset_type = (body or {}).get("ResetType")
            if self.resets_apply and self.systems[system] is not None:
                if reset_type in RESETS_OFF:
                    self.systems[system] = "Off"
                elif reset_type in RESETS_ON:
                    self.systems[system] = "On"
            return send(204)
        if not rest and method == "PATCH":
            return send(204)
        return send(404)
