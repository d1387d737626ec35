"""The Redfish driver's power and temperature readings against captured real BMC answers: the
DMTF's public Redfish mockups (tests/fixtures/redfish_mockups/README.md names the source commit
and licence), served unchanged over HTTP on 127.0.0.1 with session login, the way the DMTF's own
Redfish-Mockup-Server serves them. The real driver (and the DMTF `redfish` client under it) does
every request; a test may make one resource answer 404, as a BMC lacking it would.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from repo_paths import FIXTURES

from fleet.bmc.base import BmcTarget, Timeouts
from fleet.bmc.redfish import RedfishDriver
from fleet.models import BmcProtocol

MOCKUPS = FIXTURES / "redfish_mockups"
USER, PASSWORD = "mockup-user", "mockup-pw"
SESSIONS = "/redfish/v1/SessionService/Sessions"


@dataclass
class MockupBmc:
    """One mockup directory served as a Redfish service on 127.0.0.1 (plain HTTP)."""

    root: Path
    missing: set[str] = field(default_factory=set)  # URIs that answer 404 although linked
    gets: list[str] = field(default_factory=list)
    tokens: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> int:
        bmc = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                bmc.get(self)

            def do_POST(self) -> None:
                bmc.post(self)

            def do_DELETE(self) -> None:
                bmc.delete(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_for(self, uri: str) -> Path | None:
        path = uri.split("?", 1)[0].split("#", 1)[0].rstrip("/")
        if path in self.missing or not (path == "/redfish/v1" or path.startswith("/redfish/v1/")):
            return None
        relative = path.removeprefix("/redfish/v1").strip("/")
        if ".." in relative.split("/"):
            return None
        candidate = self.root / relative / "index.json"
        return candidate if candidate.is_file() else None

    def send(
        self, h: BaseHTTPRequestHandler, status: int, body: Any = None, **headers: str
    ) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        h.send_response(status)
        if body is not None:
            h.send_header("Content-Type", "application/json")
        for name, value in headers.items():
            h.send_header(name.replace("_", "-"), value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def get(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0].rstrip("/")
        with self.lock:
            self.gets.append(path)
            authorised = h.headers.get("X-Auth-Token") in self.tokens
        if path != "/redfish/v1" and not authorised:  # the service root is open, as specified
            self.send(h, 401, {"error": {"code": "Base.1.0.NoValidSession", "message": "401"}})
            return
        found = self.file_for(path)
        if found is None:
            self.send(h, 404, {"error": {"code": "Base.1.0.ResourceMissingAtURI", "message": path}})
            return
        self.send(h, 200, json.loads(found.read_text()))

    def post(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length) or b"{}")
        if h.path.rstrip("/") != SESSIONS:
            self.send(h, 405)
            return
        if body.get("UserName") != USER or body.get("Password") != PASSWORD:
            self.send(h, 401, {"error": {"code": "Base.1.0.InvalidCredentials", "message": "no"}})
            return
        token = secrets.token_hex(16)
        with self.lock:
            self.tokens.add(token)
        location = f"{SESSIONS}/{token[:8]}"
        self.send(h, 201, {"@odata.id": location, "Id": token[:8]}, X_Auth_Token=token,
                  Location=location)  # fmt: skip

    def delete(self, h: BaseHTTPRequestHandler) -> None:
        token = h.headers.get("X-Auth-Token")
        with self.lock:
            self.tokens.discard(token or "")
        self.send(h, 204)


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[MockupBmc] = []

    def start(mockup: str, *, missing: tuple[str, ...] = ()) -> tuple[MockupBmc, int]:
        bmc = MockupBmc(MOCKUPS / mockup, missing=set(missing))
        started.append(bmc)
        return bmc, bmc.start()

    yield start
    for bmc in started:
        bmc.close()


def driver(port: int, system_id: str | None = None) -> RedfishDriver:
    return RedfishDriver(
        BmcTarget(
            server="mockup-01",
            protocol=BmcProtocol.REDFISH,
            address="http://127.0.0.1",
            port=port,
            username=USER,
            password=PASSWORD,
            system_id=system_id,
            timeouts=Timeouts(call=2.0, total=4.0, attempts=2, backoff=0.05),
            plain_http=True,  # the in-test server has no TLS
        )
    )


RACKMOUNT = "/redfish/v1/Chassis/1U"
SUPPLIES = f"{RACKMOUNT}/PowerSubsystem/PowerSupplies"


def test_rackmount_reads_environment_metrics_first(serve: Any) -> None:
    bmc, port = serve("public-rackmount1")
    with driver(port) as d:  # the Systems collection has one member: no system_id needed
        sensors = d.sensors()
    assert sensors.power_w == 374.0  # EnvironmentMetrics PowerWatts.Reading
    assert sensors.temperatures_c == {"CPU1 Temp": 41.0, "Chassis Intake Temp": 25.0}
    assert f"{RACKMOUNT}/EnvironmentMetrics" in bmc.gets
    assert f"{RACKMOUNT}/Power" not in bmc.gets  # the first source that answers is enough
    assert not bmc.tokens  # the session was deleted at close


def test_rackmount_falls_back_to_power_control(serve: Any) -> None:
    bmc, port = serve("public-rackmount1", missing=(f"{RACKMOUNT}/EnvironmentMetrics",))
    with driver(port, "437XR1138R2") as d:
        assert d.sensors().power_w == 344.0  # Power PowerControl[0].PowerConsumedWatts
    assert f"{RACKMOUNT}/PowerSubsystem" not in bmc.gets


def test_rackmount_falls_back_to_the_power_supplies(serve: Any) -> None:
    bmc, port = serve(
        "public-rackmount1", missing=(f"{RACKMOUNT}/EnvironmentMetrics", f"{RACKMOUNT}/Power")
    )
    with driver(port, "437XR1138R2") as d:
        # Bay1's InputPowerWatts; Bay2 is "Absent" and draws nothing.
        assert d.sensors().power_w == 937.4
    assert f"{SUPPLIES}/Bay2" in bmc.gets
    assert f"{SUPPLIES}/Bay2/Metrics" not in bmc.gets


def test_an_installed_supply_without_a_reading_gives_no_total(serve: Any) -> None:
    _, port = serve(
        "public-rackmount1",
        missing=(
            f"{RACKMOUNT}/EnvironmentMetrics",
            f"{RACKMOUNT}/Power",
            f"{SUPPLIES}/Bay1/Metrics",
        ),
    )
    with driver(port, "437XR1138R2") as d:
        assert d.sensors().power_w is None  # a partial sum would understate the draw


def test_a_server_with_only_the_power_resource(serve: Any) -> None:
    bmc, port = serve("public-catfish")
    with driver(port, "1") as d:
        sensors = d.sensors()
    assert sensors.power_w == 224.0
    assert sensors.temperatures_c == {
        "Inlet Temp": 25.0,
        "Board Temp": 35.0,
        "CPU1 Temp": 45.0,
        "CPU2 Temp": 46.0,
    }
    assert "/redfish/v1/Chassis/1/EnvironmentMetrics" not in bmc.gets  # not linked: not asked


def test_a_blade_without_power_of_its_own_has_no_reading(serve: Any) -> None:
    bmc, port = serve("public-bladed")
    with driver(port, "529QB9450R6") as d:
        sensors = d.sensors()
    assert sensors.power_w is None
    assert sensors.temperatures_c == {"CPU Temp": 62.0}
    # Nothing linked: one look at <chassis>/Power, never the enclosure's Power.
    assert "/redfish/v1/Chassis/Blade1/Power" in bmc.gets
    assert not [g for g in bmc.gets if "MultiBladeEncl" in g]
