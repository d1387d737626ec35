"""Power actions end to end: the REST API and `fleetctl servers power` of a real service
(uvicorn in a thread, tests/live.py) against real BMC EMULATORS, on SQLite and on Postgres.

Peers: one module-wide sushy-emulator (Redfish; each test takes fresh ComputerSystems from it,
so no power state leaks between tests), OpenIPMI `ipmi_sim` instances started per test, and tiny
in-test servers for what no emulator does (a BMC that accepts TCP and never answers, a silent
UDP port, Redfish 503s, a system advertising only some ResetTypes, precise request times for
the power-on stagger). Everything listens on 127.0.0.1 and is stopped in teardown.

sushy applies a Reset 1-11 s late (the new PowerState shows on the first read after its apply
time): tests that need the outcome poll `fleetctl servers power status`, bounded by SETTLE_S.
Timing assertions are lower bounds, except that a fault must end within the configured BMC
timeout (that bound is the point of the fault cases).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from fake_bmcs import FakeRedfish, StalledBmc
from live import YAML, Live, closed_port, live_settings, serve
from pgbouncer_peer import pgbouncer_binary, pgbouncer_peer
from sqlalchemy.engine import Engine
from typer.testing import CliRunner, Result

from fleet import cli
from fleet.db import engine_from_settings
from fleet.lab.ipmi_sim import IpmiSim, free_udp_port
from fleet.lab.sushy import FakeSystem, SushyEmulator, fake_systems
from fleet.models import Role

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

API = "/api/v1"
USER = "admin"
RF_PASSWORD = "rf-s3cret-pw"
IPMI_PASSWORD = "Sim-pass.42"  # ipmi_sim takes at most 19 characters
# Roomy enough that a healthy sushy-emulator (bcrypt on every request) answers on a loaded
# 2-core CI machine; the fault cases are bounded by these same figures.
CALL_S, TOTAL_S = 3.0, 6.0
MARGIN_S = 2.5  # allowed past the configured total timeout (scheduling, the DB write, a busy CI)
SETTLE_S = 15.0  # sushy applies a Reset 1-11 s late
SETTINGS: dict[str, Any] = {
    "bmc_call_timeout_s": CALL_S,
    "bmc_total_timeout_s": TOTAL_S,
    "bmc_attempts": 3,
    "bmc_backoff_s": 0.05,
    "power_on_per_rack": 8,
    "power_on_rack_delay_s": 0.02,
}
STAGGER_DELAY_S = 0.3
SITE = "lab1"
OFF_SYSTEMS, ON_SYSTEMS = 90, 16


# ---------------------------------------------------------------------------------------------
# Inventory: servers whose BMCs are the emulators and fakes of this module


def redfish_bmc(
    port: int, system_id: str | None = None, *, password: str = RF_PASSWORD
) -> dict[str, Any]:
    bmc: dict[str, Any] = {
        "protocol": "redfish",
        "address": "http://127.0.0.1",
        "plain_http": True,  # the emulator and the fakes have no TLS
        "port": port,
        "username": USER,
        "password": password,
    }
    if system_id is not None:
        bmc["system_id"] = system_id
    return bmc


def ipmi_bmc(port: int, *, password: str = IPMI_PASSWORD) -> dict[str, Any]:
    return {
        "protocol": "ipmi",
        "address": "127.0.0.1",
        "port": port,
        "username": USER,
        "password": password,
    }


def inventory_yaml(racks: dict[str, dict[str, dict[str, Any]]]) -> bytes:
    """{rack: {server: bmc}} -> an inventory file, one 1U H100 box per server."""

    def feeds() -> list[dict[str, Any]]:  # a fresh list per rack: no YAML aliases
        return [
            {"name": side.lower() + "1", "side": side, "volts": 415, "amps": 32, "phase": "three"}
            for side in "AB"
        ]

    doc = {
        "sites": [
            {
                "name": SITE,
                "racks": [
                    {
                        "name": rack,
                        "u_height": 42,
                        "feeds": feeds(),
                        "servers": [
                            {
                                "name": name,
                                "u": u,
                                "u_height": 1,
                                "pool": "warm",
                                "gpu": {"model": "H100", "count": 8},
                                "power": {"idle_w": 500, "standby_w": 50, "max_w": 1000},
                                "bmc": bmc,
                            }
                            for u, (name, bmc) in enumerate(servers.items(), start=1)
                        ],
                    }
                    for rack, servers in racks.items()
                ],
            }
        ]
    }
    return yaml.safe_dump(doc, sort_keys=False).encode()


# ---------------------------------------------------------------------------------------------
# Peers: the emulators, and tiny local servers for what they cannot do


@dataclass
class Sushy:
    """The module's sushy-emulator and the systems no test has used yet."""

    emulator: SushyEmulator
    free: dict[str, list[FakeSystem]]

    def take(self, power_state: str = "Off") -> FakeSystem:
        if not self.free[power_state]:
            raise RuntimeError(f"the module emulator has no fresh {power_state} system left")
        return self.free[power_state].pop(0)

    def bmc(self, system: FakeSystem, *, password: str = RF_PASSWORD) -> dict[str, Any]:
        return redfish_bmc(self.emulator.port, system.uuid, password=password)


@pytest.fixture(scope="module")
def sushy() -> Iterator[Sushy]:
    off = fake_systems(OFF_SYSTEMS, prefix="off", power_state="Off")
    on = fake_systems(ON_SYSTEMS, prefix="on", power_state="On")
    with SushyEmulator(off + on, username=USER, password=RF_PASSWORD) as emulator:
        yield Sushy(emulator, {"Off": list(off), "On": list(on)})
    assert not emulator.running()


# ---------------------------------------------------------------------------------------------
# The service, and one test's view of it


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("power-api"), **SETTINGS) as server:
        yield server


@dataclass
class Lab:
    live: Live
    sushy: Sushy
    operator: httpx.Client
    viewer: httpx.Client
    token: str
    runner: CliRunner = field(default_factory=CliRunner)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def on(cls, service: Live, sushy: Sushy) -> Lab:
        """A lab on a service of the test's own (operator and viewer clients; no CLI token)."""
        return cls(
            live=service,
            sushy=sushy,
            operator=service.client(service.token(Role.OPERATOR, name="ops")),
            viewer=service.client(service.token(Role.VIEWER, name="viewer")),
            token="",
        )

    # -- peers -----------------------------------------------------------------------------

    def sim(self, *, powered_on: bool = False) -> IpmiSim:
        sim = IpmiSim(IPMI_PASSWORD, username=USER, powered_on=powered_on)
        self.cleanups.append(sim.stop)
        return sim.start()

    def stalled(self) -> StalledBmc:
        stalled = StalledBmc()
        self.cleanups.append(stalled.close)
        return stalled

    def silent_udp(self) -> int:
        """A UDP port that takes every packet and never answers."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        self.cleanups.append(sock.close)
        port: int = sock.getsockname()[1]
        return port

    def fake_redfish(self, systems: dict[str, str], **knobs: Any) -> tuple[FakeRedfish, int]:
        fake = FakeRedfish(dict(systems), USER, RF_PASSWORD, **knobs)
        port = fake.start()
        self.cleanups.append(fake.close)
        return fake, port

    # -- the service -----------------------------------------------------------------------

    def import_inventory(self, racks: dict[str, dict[str, dict[str, Any]]]) -> None:
        response = self.operator.post(
            f"{API}/inventory/import", content=inventory_yaml(racks), headers=YAML
        )
        assert response.status_code == 200, response.text

    def power(self, names: list[str], action: str) -> dict[str, dict[str, Any]]:
        """A bulk action by name: {server: report}, after checking the envelope."""
        body = ok(self.operator.post(f"{API}/power", json={"action": action, "servers": names}))
        assert body["count"] == len(names)
        assert [r["server"] for r in body["results"]] == names  # in the order given
        assert body["failed"] == sum(not r["ok"] for r in body["results"])
        return {r["server"]: r for r in body["results"]}

    def server(self, name: str) -> dict[str, Any]:
        row: dict[str, Any] = ok(self.viewer.get(f"{API}/servers/{name}"))
        return row

    def events(self, name: str, kind: str | None = None) -> list[dict[str, Any]]:
        """The server's events, oldest first."""
        params: dict[str, Any] = {"subject": name, "limit": 1000}
        if kind is not None:
            params["kind"] = kind
        page = ok(self.viewer.get(f"{API}/events", params=params))
        assert page["count"] == len(page["results"])
        return list(reversed(page["results"]))

    def fleetctl(self, *args: str, url: str | None = None) -> Result:
        env = {"FLEET_URL": url or self.live.url, "FLEET_TOKEN": self.token}
        return self.runner.invoke(cli.app, list(args), env=env)

    def fleetctl_json(self, *args: str, url: str | None = None) -> list[dict[str, Any]]:
        result = self.fleetctl(*args, "-o", "json", url=url)
        assert result.exit_code == 0, f"{args}: {result.stdout}{result.stderr}"
        rows: list[dict[str, Any]] = json.loads(result.stdout)
        return rows

    def settle(self, want: dict[str, str]) -> dict[str, str]:
        """Read the power state (fleetctl ... status) until every server shows the one wanted,
        or SETTLE_S has passed; the last states read."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            rows = self.fleetctl_json("servers", "power", "status", *want)
            seen = {r["server"]: r["state_after"] for r in rows}
            assert all(r["ok"] and not r["sent"] for r in rows), rows
            if seen == want or time.monotonic() > deadline:
                return seen
            time.sleep(0.25)


@pytest.fixture
def lab(live: Live, db: Engine, sushy: Sushy) -> Iterator[Lab]:
    lab = Lab(
        live=live,
        sushy=sushy,
        operator=live.client(live.token(Role.OPERATOR, name="ops")),
        viewer=live.client(live.token(Role.VIEWER, name="viewer")),
        token=live.token(Role.OPERATOR, name="cli-ops"),
    )
    try:
        yield lab
    finally:
        live.close_clients()
        for cleanup in reversed(lab.cleanups):
            cleanup()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json()


def detail(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    text = response.json()["detail"]
    assert isinstance(text, str) and text and "\n" not in text, text
    return text


def assert_failed(report: dict[str, Any], bmc: str, *causes: str) -> str:
    """A failed report: one line naming the server, its BMC and the cause, within the
    configured timeout, nothing reported as sent."""
    error = report["error"]
    assert not report["ok"] and isinstance(error, str), report
    assert "\n" not in error, error
    assert error.startswith(f"server {report['server']} ({bmc}"), error
    for cause in causes:
        assert cause in error, error
    assert RF_PASSWORD not in error and IPMI_PASSWORD not in error
    assert report["sent"] is False
    assert report["state_before"] is None and report["state_after"] is None
    assert report["seconds"] <= TOTAL_S + MARGIN_S, report
    return error


def assert_untouched(lab: Lab, name: str, *, reachable: bool) -> None:
    """Never read successfully: no power state observed; the lifecycle state unchanged."""
    row = lab.server(name)
    assert (row["state"], row["power_state"], row["power_state_at"]) == (
        "enrolled",
        "unknown",
        None,
    ), row
    assert row["bmc_reachable"] is reachable, row


def assert_failure_event(lab: Lab, name: str, action: str, error_type: str, error: str) -> None:
    (event,) = lab.events(name, "server.power_failed")
    assert event["details"] == {"action": action, "error": error_type}
    assert event["message"] == error
    assert event["subject_type"] == "server" and event["actor"]
    assert lab.events(name, "server.power") == []


def rf_where(port: int, system: str | None = None) -> str:
    return f"redfish http://127.0.0.1:{port}" + (f" system {system}" if system else "")


def ipmi_where(port: int) -> str:
    return f"ipmi 127.0.0.1:{port}"


def cli_failure_summary(result: Result, failed: int, count: int) -> None:
    assert result.exit_code == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"error: {failed} of {count} servers failed (see the table)"
    ], result.stderr


def table_rows(text: str) -> dict[str, list[str]]:
    """A rich table -> {first cell: cells}; wrapped continuation lines are skipped."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│")[1:-1]]
        if cells and cells[0]:
            rows[cells[0]] = cells
    return rows


def parse_at(value: str) -> datetime:
    return datetime.fromisoformat(value)


# ---------------------------------------------------------------------------------------------
# Acceptance: fleetctl against each emulator, the state read back from the BMC


def test_fleetctl_power_against_the_redfish_emulator(lab: Lab) -> None:
    emu = lab.sushy.emulator
    systems = {
        "rf-on": lab.sushy.take("Off"),
        "rf-off": lab.sushy.take("On"),
        "rf-cycle": lab.sushy.take("On"),
        "rf-already-on": lab.sushy.take("On"),
    }
    lab.import_inventory({"r1": {n: lab.sushy.bmc(s) for n, s in systems.items()}})

    on = {r["server"]: r for r in lab.fleetctl_json("servers", "power", "on", "rf-on")}
    off = {r["server"]: r for r in lab.fleetctl_json("servers", "power", "off", "rf-off")}
    cycle = {r["server"]: r for r in lab.fleetctl_json("servers", "power", "cycle", "rf-cycle")}
    noop = {r["server"]: r for r in lab.fleetctl_json("servers", "power", "on", "rf-already-on")}
    for reports, name, before in [
        (on, "rf-on", "off"),
        (off, "rf-off", "on"),
        (cycle, "rf-cycle", "on"),
    ]:
        report = reports[name]
        assert (report["ok"], report["sent"], report["state_before"]) == (True, True, before)
        assert report["error"] is None
        # Read back at once: sushy may not have applied it yet, but it is what the BMC said.
        assert report["state_after"] in ("on", "off")
        assert len(emu.resets(systems[name].uuid)) == 1, name
    # Asking for the state the server is in sends nothing: no Reset in sushy's access log.
    assert {k: noop["rf-already-on"][k] for k in ("ok", "sent", "state_before", "state_after")} == {
        "ok": True,
        "sent": False,
        "state_before": "on",
        "state_after": "on",
    }
    assert emu.resets(systems["rf-already-on"].uuid) == []

    want = {"rf-on": "on", "rf-off": "off", "rf-cycle": "on", "rf-already-on": "on"}
    assert lab.settle(want) == want
    for name, system in systems.items():  # the BMC itself agrees
        assert emu.read_power_state(system.uuid) == want[name].capitalize()

    # Fleet's own power-on, now applied: asking again sends no second Reset.
    resets = len(emu.requests())
    (again,) = lab.fleetctl_json("servers", "power", "on", "rf-on")
    assert (again["ok"], again["sent"], again["state_after"]) == (True, False, "on")
    assert len(emu.resets(systems["rf-on"].uuid)) == 1
    assert [r for r in emu.requests()[resets:] if r.method == "POST"] == []

    # The table form: every server, exit 0.
    result = lab.fleetctl("servers", "power", "status", *systems)
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    assert rows.pop("server")[:5] == ["server", "ok", "sent", "before", "after"]
    assert {name: row[1:5] for name, row in rows.items()} == {
        name: ["True", "False", state, state] for name, state in want.items()
    }

    # Observed fields follow the BMC; the lifecycle state does not move.
    for name, state in want.items():
        row = lab.server(name)
        assert (row["state"], row["power_state"], row["bmc_reachable"]) == (
            "enrolled",
            state,
            True,
        )
        assert row["power_state_at"] is not None
    (event,) = [
        e for e in lab.events("rf-cycle", "server.power") if e["details"]["action"] != "status"
    ]
    assert event["details"]["action"] == "cycle"
    assert (event["details"]["sent"], event["details"]["before"]) == (True, "on")
    assert event["details"]["power_state"] == cycle["rf-cycle"]["state_after"]


def test_fleetctl_power_against_ipmi_sim(lab: Lab) -> None:
    sims = {
        "ip-on": lab.sim(powered_on=False),
        "ip-off": lab.sim(powered_on=True),
        "ip-cycle": lab.sim(powered_on=True),
        "ip-already-on": lab.sim(powered_on=True),
    }
    lab.import_inventory({"r1": {n: ipmi_bmc(s.port) for n, s in sims.items()}})

    reports = {
        r["server"]: r
        for r in lab.fleetctl_json("servers", "power", "on", "ip-on", "ip-already-on")
    }
    (off,) = lab.fleetctl_json("servers", "power", "off", "ip-off")
    (cycle,) = lab.fleetctl_json("servers", "power", "cycle", "ip-cycle")
    reports.update({"ip-off": off, "ip-cycle": cycle})
    summary = {
        name: (r["ok"], r["sent"], r["state_before"], r["state_after"])
        for name, r in reports.items()
    }
    assert summary == {
        "ip-on": (True, True, "off", "on"),
        "ip-already-on": (True, False, "on", "on"),
        "ip-off": (True, True, "on", "off"),
        "ip-cycle": (True, True, "on", "on"),
    }
    # What reached the "hardware" (ipmi_sim's chassis_control log).
    assert sims["ip-on"].log_calls() == ["set power 1"]
    assert sims["ip-off"].log_calls() == ["set shutdown 1"]  # a graceful (ACPI) power-off
    assert sims["ip-cycle"].log_calls() == ["set power 0", "set power 1"]
    assert sims["ip-already-on"].log_calls() == []  # already on: nothing sent

    want = {"ip-on": "on", "ip-off": "off", "ip-cycle": "on", "ip-already-on": "on"}
    status = {r["server"]: r for r in lab.fleetctl_json("servers", "power", "status", *sims)}
    assert {n: (r["ok"], r["sent"], r["state_after"]) for n, r in status.items()} == {
        n: (True, False, state) for n, state in want.items()
    }
    for name, sim in sims.items():
        assert sim.chassis_power() is (want[name] == "on")

    (again,) = lab.fleetctl_json("servers", "power", "on", "ip-on")
    assert (again["sent"], again["state_after"]) == (False, "on")
    assert sims["ip-on"].log_calls() == ["set power 1"]  # no new line
    for name, state in want.items():
        row = lab.server(name)
        assert (row["state"], row["power_state"], row["bmc_reachable"]) == (
            "enrolled",
            state,
            True,
        )


# ---------------------------------------------------------------------------------------------
# Events and observed fields; the lifecycle state is the state machine's alone


def test_every_action_and_outcome_is_an_event_and_the_lifecycle_state_never_moves(
    lab: Lab,
) -> None:
    rf_system = lab.sushy.take("On")
    sim = lab.sim(powered_on=False)
    lab.import_inventory({"r1": {"rf-1": lab.sushy.bmc(rf_system), "ip-1": ipmi_bmc(sim.port)}})
    moved = ok(
        lab.operator.post(
            f"{API}/servers/ip-1/transition", json={"to": "maintenance", "reason": "rewiring"}
        )
    )
    changed_at = moved["server"]["state_changed_at"]
    assert lab.server("rf-1")["power_state"] == "unknown"

    # One server at a time: POST /servers/{name}/power.
    started = datetime.now().astimezone()
    on = ok(lab.operator.post(f"{API}/servers/ip-1/power", json={"action": "on"}))
    assert on == {
        "server": "ip-1",
        "action": "on",
        "ok": True,
        "sent": True,
        "state_before": "off",
        "state_after": "on",
        "error": None,
        "started": on["started"],
        "seconds": on["seconds"],
    }
    assert on["started"] < 0.5  # a single server starts at once (a busy machine: a few ms)
    assert sim.log_calls() == ["set power 1"]
    status = ok(lab.operator.post(f"{API}/servers/rf-1/power", json={"action": "status"}))
    assert (status["ok"], status["sent"], status["state_before"], status["state_after"]) == (
        True,
        False,
        "on",
        "on",
    )
    noop = ok(lab.operator.post(f"{API}/servers/rf-1/power", json={"action": "on"}))
    assert (noop["sent"], noop["state_after"]) == (False, "on")
    assert lab.sushy.emulator.resets(rf_system.uuid) == []

    ip = lab.server("ip-1")
    assert (ip["state"], ip["state_changed_at"]) == ("maintenance", changed_at)
    assert (ip["power_state"], ip["bmc_reachable"]) == ("on", True)
    assert parse_at(ip["power_state_at"]) >= started
    rf = lab.server("rf-1")
    assert (rf["state"], rf["power_state"], rf["bmc_reachable"]) == ("enrolled", "on", True)

    [event] = lab.events("ip-1", "server.power")
    assert event["details"] == {"action": "on", "sent": True, "before": "off", "power_state": "on"}
    assert (event["subject_type"], event["from_state"], event["to_state"]) == (
        "server",
        None,
        None,
    )
    assert "ops" in event["actor"]
    assert [e["details"] for e in lab.events("rf-1", "server.power")] == [
        {"action": "status", "power_state": "on"},
        {"action": "on", "sent": False, "before": "on", "power_state": "on"},
    ]
    assert "nothing sent" in lab.events("rf-1", "server.power")[-1]["message"]

    # A failure is an event too, and leaves the last observation (and its time) in place.
    sim.stop()
    failed = ok(lab.operator.post(f"{API}/servers/ip-1/power", json={"action": "status"}))
    error = assert_failed(failed, ipmi_where(sim.port), f"no answer within {CALL_S:g} s")
    [event] = lab.events("ip-1", "server.power_failed")
    assert event["details"] == {"action": "status", "error": "BmcUnreachable"}
    assert event["message"] == error
    after = lab.server("ip-1")
    assert (after["power_state"], after["power_state_at"]) == ("on", ip["power_state_at"])
    assert after["bmc_reachable"] is False
    assert (after["state"], after["state_changed_at"]) == ("maintenance", changed_at)

    # The BMC found unreachable is said once, as the reconciler says it (which then says
    # when it answers again: tests/unit/test_power_sync.py).
    [gone] = lab.events("ip-1", "server.bmc_unreachable")
    assert "status" in gone["message"] and "reconciler keeps reading it" in gone["message"]

    # Power never moved the lifecycle: the only transition is the operator's.
    kinds = [e["kind"] for e in lab.events("ip-1")]
    assert kinds == [
        "server.enrolled",
        "server.transition",
        "server.power",
        "server.power_failed",
        "server.bmc_unreachable",
    ]
    assert [e["kind"] for e in lab.events("rf-1")] == ["server.enrolled"] + ["server.power"] * 2


# ---------------------------------------------------------------------------------------------
# Faults: each ends within the configured timeout, one line naming the server and the cause;
# the other servers of the same bulk call are unaffected


def test_wrong_password_on_both_protocols(lab: Lab) -> None:
    rf_bad, rf_good = lab.sushy.take("Off"), lab.sushy.take("Off")
    sim_bad, sim_good = lab.sim(), lab.sim()
    port = lab.sushy.emulator.port
    lab.import_inventory(
        {
            "r1": {
                "rf-bad": lab.sushy.bmc(rf_bad, password="not-the-password"),
                "ip-bad": ipmi_bmc(sim_bad.port, password="Not-the-pass.1"),
                "rf-good": lab.sushy.bmc(rf_good),
                "ip-good": ipmi_bmc(sim_good.port),
            }
        }
    )
    reports = lab.power(["rf-bad", "ip-bad", "rf-good", "ip-good"], "on")

    rf_error = assert_failed(reports["rf-bad"], rf_where(port, rf_bad.uuid), "credentials")
    assert f"refused user '{USER}'" in rf_error
    ip_error = assert_failed(reports["ip-bad"], ipmi_where(sim_bad.port))
    assert "password" in ip_error.lower()
    assert lab.sushy.emulator.resets(rf_bad.uuid) == [] and sim_bad.log_lines() == []
    for name in ("rf-bad", "ip-bad"):
        assert_untouched(lab, name, reachable=True)  # it answered: it is reachable
    assert_failure_event(lab, "rf-bad", "on", "BmcAuthFailed", rf_error)
    assert_failure_event(lab, "ip-bad", "on", "BmcAuthFailed", ip_error)

    for name in ("rf-good", "ip-good"):
        report = reports[name]
        assert (report["ok"], report["sent"], report["state_before"]) == (True, True, "off")
    assert len(lab.sushy.emulator.resets(rf_good.uuid)) == 1
    assert sim_good.log_calls() == ["set power 1"]
    assert lab.server("ip-good")["power_state"] == "on"


def test_bmc_down_closed_ports_through_fleetctl(lab: Lab) -> None:
    rf_port, ip_port = closed_port(), free_udp_port()  # nothing listens on either
    good = lab.sushy.take("On")
    sim = lab.sim(powered_on=True)
    lab.import_inventory(
        {
            "r1": {
                "rf-down": redfish_bmc(rf_port, "1"),
                "ip-down": ipmi_bmc(ip_port),
                "rf-good": lab.sushy.bmc(good),
                "ip-good": ipmi_bmc(sim.port),
            }
        }
    )
    started = time.monotonic()
    result = lab.fleetctl("servers", "power", "status", "rf-down", "ip-down", "rf-good", "ip-good")
    elapsed = time.monotonic() - started
    cli_failure_summary(result, failed=2, count=4)
    assert elapsed <= TOTAL_S + MARGIN_S + 1.0  # the slowest fault bounds the whole call
    rows = table_rows(result.stdout)
    assert rows.pop("server")[:3] == ["server", "ok", "sent"]
    assert {name: row[1:5] for name, row in rows.items()} == {
        "rf-down": ["False", "False", "-", "-"],
        "ip-down": ["False", "False", "-", "-"],
        "rf-good": ["True", "False", "on", "on"],
        "ip-good": ["True", "False", "on", "on"],
    }

    for name, where, cause in [
        ("rf-down", rf_where(rf_port, "1"), "connection refused"),
        ("ip-down", ipmi_where(ip_port), f"no answer within {CALL_S:g} s"),
    ]:
        [event] = lab.events(name, "server.power_failed")
        message = event["message"]
        assert "\n" not in message and message.startswith(f"server {name} ({where}"), message
        assert cause in message, message
        assert event["details"] == {"action": "status", "error": "BmcUnreachable"}
        assert_untouched(lab, name, reachable=False)
    for name in ("rf-good", "ip-good"):
        row = lab.server(name)
        assert (row["power_state"], row["bmc_reachable"]) == ("on", True)


def test_a_bmc_that_never_answers_holds_up_no_one(lab: Lab) -> None:
    stalled = lab.stalled()
    silent = lab.silent_udp()
    healthy = {f"rf-{i:02d}": lab.sushy.take("Off") for i in range(1, 21)}
    sims = {"ip-01": lab.sim(), "ip-02": lab.sim(powered_on=True)}
    servers: dict[str, dict[str, Any]] = {
        "rf-hung": redfish_bmc(stalled.port, "1"),
        "ip-hung": ipmi_bmc(silent),
    }
    servers.update({n: lab.sushy.bmc(s) for n, s in healthy.items()})
    servers.update({n: ipmi_bmc(s.port) for n, s in sims.items()})
    lab.import_inventory({"r1": servers})

    reports = lab.power(list(servers), "status")
    for name, where in [
        ("rf-hung", rf_where(stalled.port, "1")),
        ("ip-hung", ipmi_where(silent)),
    ]:
        report = reports[name]
        error = assert_failed(report, where, f"within {CALL_S:g} s")
        assert report["seconds"] >= CALL_S * 0.9  # it was waited on, for the call timeout
        assert_untouched(lab, name, reachable=False)
        assert_failure_event(lab, name, "status", "BmcUnreachable", error)
    assert len(stalled.connections) == 1  # no blind retry of a request that got no answer

    want = {**dict.fromkeys(healthy, "off"), "ip-01": "off", "ip-02": "on"}
    for name, state in want.items():
        report = reports[name]
        assert (report["ok"], report["sent"], report["state_after"]) == (True, False, state)
        assert report["error"] is None
        # Each finished while the hung BMCs were still being waited on.
        assert report["seconds"] < reports["rf-hung"]["seconds"], report
        assert lab.server(name)["bmc_reachable"] is True


def test_stalled_bmcs_beyond_the_database_pool_are_waited_on_at_once(lab: Lab, pg_url: str) -> None:
    """20 BMCs that never answer, one bulk call (bmc_workers 32): every one of them ends after
    its own call timeout, none waits for another to time out first."""
    stalled = lab.stalled()
    servers = {f"hung-{i:02d}": redfish_bmc(stalled.port, str(i)) for i in range(20)}
    lab.import_inventory({"r1": servers})
    reports = lab.power(list(servers), "status")
    for i, report in enumerate(reports.values()):
        assert_failed(report, rf_where(stalled.port, str(i)), f"within {CALL_S:g} s")
    slowest = max(r["seconds"] for r in reports.values())
    # Below 2 × CALL_S: none waited for another's timeout (a pool of 15 made it 2 × CALL_S).
    assert slowest < 2 * CALL_S, sorted(r["seconds"] for r in reports.values())


BULK_POOL = {"db_pool_size": 8, "db_max_overflow": 2, "api_max_in_flight": 3}


def test_a_bulk_action_on_100_stalled_bmcs_holds_no_more_connections_than_its_pool(
    live: Live, sushy: Sushy, pg_url: str, db: Engine, tmp_path: Path
) -> None:
    """100 BMCs that never answer, all called at once (bmc_workers 100), beside a neighbour
    holding 30 idle connections on the same Postgres: each ends on its own BMC timeout, and the
    service never holds more connections than its pool (db_pool_size + db_max_overflow,
    docs/api.md), read from pg_stat_activity. Per-server power locks used to be session
    advisory locks, a connection each for the whole BMC call: 100 here."""
    name = f"fleet-bulk-{os.getpid()}"
    settings = {**SETTINGS, **BULK_POOL, "bmc_workers": 100, "db_application_name": name}
    engine = engine_from_settings(live_settings(db, tmp_path, **settings))
    neighbour = sa.create_engine(
        pg_url, poolclass=sa.NullPool, connect_args={"application_name": f"{name}-neighbour"}
    )
    watcher = sa.create_engine(pg_url, poolclass=sa.NullPool)
    idle = [neighbour.connect() for _ in range(30)]
    # The service's own (by its application name), and every session on this test database
    # but the neighbour's and the watcher's (a pool of some other kind would show there).
    count_sql = sa.text(
        "SELECT count(*) FILTER (WHERE application_name = :n), count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name <> :n || '-neighbour'"
        " AND pid <> pg_backend_pid()"
    )
    peak, done = [0, 0], threading.Event()

    def watch() -> None:
        with watcher.connect() as conn:
            while not done.is_set():
                own, every = conn.execute(count_sql, {"n": name}).one()
                peak[:] = max(peak[0], own), max(peak[1], every)
                done.wait(0.02)

    stalled = StalledBmc()
    try:
        with serve(engine, tmp_path, **settings) as service:
            lab = Lab.on(service, sushy)
            servers = {f"hung-{i:03d}": redfish_bmc(stalled.port, str(i)) for i in range(100)}
            names = list(servers)
            lab.import_inventory(  # 42 U racks
                {
                    f"r{k + 1}": {n: servers[n] for n in names[k * 40 : k * 40 + 40]}
                    for k in range(3)
                }
            )
            with watcher.connect() as conn:
                _, before = conn.execute(count_sql, {"n": name}).one()
            watching = threading.Thread(target=watch, daemon=True)
            watching.start()
            reports = lab.power(list(servers), "status")
            done.set()
            watching.join(timeout=10)
            for i, report in enumerate(reports.values()):
                assert_failed(report, rf_where(stalled.port, str(i)), f"within {CALL_S:g} s")
            # All at once: none waited for another's BMC (nor for a connection).
            assert max(r["seconds"] for r in reports.values()) < 2 * CALL_S
            with db.connect() as conn:
                assert conn.execute(sa.text("SELECT count(*) FROM lease")).scalar() == 0
    finally:
        done.set()
        stalled.close()
        for conn in idle:
            conn.close()
        for each in (engine, neighbour, watcher):
            each.dispose()
    bound = BULK_POOL["db_pool_size"] + BULK_POOL["db_max_overflow"]
    assert 1 <= peak[0] <= bound, f"{peak[0]} connections at the peak, the pool is {bound}"
    assert peak[1] - before <= bound, f"{peak[1] - before} more sessions than before the call"


def test_the_service_works_behind_pgbouncer_in_transaction_mode(
    sushy: Sushy, pg_url: str, db: Engine, tmp_path: Path
) -> None:
    """Debian's PgBouncer in transaction mode with 3 server connections, in front of a service
    whose pool is larger (so transactions move between server connections): an inventory
    import (a transaction advisory lock), power-ons through sushy and a bulk action on 20
    stalled BMCs at once and 20 rounds of reads of two (leases, taken and given back), and 8
    clients x 25 reads while it runs; everything answers and no lease is left behind.
    Server-side prepared statements are off (FLEET_DB_PREPARED_STATEMENTS=false), as PgBouncer
    before 1.21 needs."""
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer not installed (Debian pgbouncer)")
    database = sa.make_url(pg_url).database
    assert database
    settings = {**SETTINGS, "db_prepared_statements": False, "bmc_workers": 32}
    stalled = StalledBmc()
    with pgbouncer_peer(server_connections=3) as bouncer:
        through = sa.create_engine(bouncer.url(database))
        engine = engine_from_settings(live_settings(through, tmp_path, **settings))
        through.dispose()
        try:
            with serve(engine, tmp_path, **settings) as service:
                lab = Lab.on(service, sushy)
                off = {f"rf-{i}": sushy.take("Off") for i in range(2)}
                hung = {f"hung-{i:02d}": redfish_bmc(stalled.port, str(i)) for i in range(20)}
                lab.import_inventory({"r1": {n: sushy.bmc(s) for n, s in off.items()}, "r2": hung})
                token = service.token(Role.VIEWER, name="readers")
                answers: list[int] = []

                def read() -> None:
                    with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as client:
                        for _ in range(25):
                            reply = client.get(f"{service.url}{API}/servers", timeout=30)
                            answers.append(reply.status_code)

                readers = [threading.Thread(target=read, daemon=True) for _ in range(8)]
                for reader in readers:
                    reader.start()
                stalled_reports = lab.power(list(hung), "status")
                on_reports = lab.power(list(off), "on")
                # Writes repeated on pooled connections: a lease taken and given back (each a
                # commit) 40 times (tests/e2e/test_pgbouncer.py: what prepared statements do).
                for _ in range(20):
                    assert all(r["ok"] for r in lab.power(list(off), "status").values())
                for reader in readers:
                    reader.join(timeout=60)
                assert answers == [200] * 200
                for i, report in enumerate(stalled_reports.values()):
                    assert_failed(report, rf_where(stalled.port, str(i)), f"within {CALL_S:g} s")
                assert all(r["ok"] and r["sent"] for r in on_reports.values()), on_reports
                for system in off.values():
                    assert len(sushy.emulator.resets(system.uuid)) == 1
                with db.connect() as conn:
                    assert conn.execute(sa.text("SELECT count(*) FROM lease")).scalar() == 0
                pooled = engine.pool.checkedin() + engine.pool.checkedout()  # type: ignore[attr-defined]
                servers = bouncer.servers(database)
                print(f"\nthe service's pool: {pooled} connections; PgBouncer's: {servers}")
                assert servers <= 3
        finally:
            stalled.close()
            engine.dispose()


def test_redfish_503_is_retried_then_fails_leaving_the_last_observation(lab: Lab) -> None:
    fake, port = lab.fake_redfish({"1": "On"})
    sim = lab.sim(powered_on=True)
    lab.import_inventory(
        {"r1": {"rf-busy": redfish_bmc(port, "1"), "ip-good": ipmi_bmc(port=sim.port)}}
    )
    ok(lab.operator.post(f"{API}/servers/rf-busy/power", json={"action": "status"}))
    seen = lab.server("rf-busy")
    assert (seen["power_state"], seen["bmc_reachable"]) == ("on", True)

    fake.system_status = 503
    gets = len(fake.requests("1", "GET"))
    reports = lab.power(["rf-busy", "ip-good"], "off")
    error = assert_failed(reports["rf-busy"], rf_where(port, "1"), "HTTP 503")
    assert 1 < len(fake.requests("1", "GET")) - gets <= SETTINGS["bmc_attempts"]  # retried, bounded
    assert fake.resets("1") == 0  # nothing sent to a BMC that could not be read
    after = lab.server("rf-busy")
    assert (after["power_state"], after["power_state_at"], after["bmc_reachable"]) == (
        "on",
        seen["power_state_at"],
        True,  # it answered: busy, not unreachable
    )
    assert after["state"] == "enrolled"
    [event] = lab.events("rf-busy", "server.power_failed")
    assert event["details"] == {"action": "off", "error": "BmcTransient"}
    assert event["message"] == error

    good = reports["ip-good"]
    assert (good["ok"], good["sent"], good["state_after"]) == (True, True, "off")
    assert sim.log_calls() == ["set shutdown 1"]


def test_a_reset_type_the_system_does_not_advertise(lab: Lab) -> None:
    fake, port = lab.fake_redfish({"1": "On"}, allowed=["On"])
    sim = lab.sim(powered_on=True)
    lab.import_inventory(
        {"r1": {"rf-limited": redfish_bmc(port, "1"), "ip-good": ipmi_bmc(sim.port)}}
    )

    for action in ("off", "force_off", "cycle"):
        reports = lab.power(["rf-limited", "ip-good"], action)
        error = assert_failed(reports["rf-limited"], rf_where(port, "1"), "advertises only On")
        assert reports["ip-good"]["ok"], reports["ip-good"]
        events = lab.events("rf-limited", "server.power_failed")
        assert events[-1]["details"] == {"action": action, "error": "BmcUnsupported"}
        assert events[-1]["message"] == error
    assert fake.resets("1") == 0  # nothing POSTed
    assert_untouched(lab, "rf-limited", reachable=True)
    # "on" is advertised, and the system is on already: nothing to send either.
    (noop,) = lab.power(["rf-limited"], "on").values()
    assert (noop["ok"], noop["sent"], noop["state_after"]) == (True, False, "on")
    assert fake.resets("1") == 0
    # off (ACPI), force_off (already off: nothing), cycle (off: simply powered on).
    assert sim.log_calls() == ["set shutdown 1", "set power 1"]


# ---------------------------------------------------------------------------------------------
# Choosing servers: by name, by filter; what is refused before any BMC is called


def test_bulk_by_filter_and_refusals(lab: Lab) -> None:
    systems = {"rf-a": lab.sushy.take("On"), "rf-b": lab.sushy.take("Off")}
    sims = {"ip-a": lab.sim(powered_on=True), "ip-b": lab.sim()}
    lab.import_inventory(
        {
            "r1": {n: lab.sushy.bmc(s) for n, s in systems.items()},
            "r2": {n: ipmi_bmc(s.port) for n, s in sims.items()},
        }
    )

    body = ok(
        lab.operator.post(f"{API}/power", json={"action": "status", "select": {"rack": "r1"}})
    )
    assert (body["count"], body["failed"]) == (2, 0)
    assert {r["server"]: r["state_after"] for r in body["results"]} == {"rf-a": "on", "rf-b": "off"}
    for name in sims:  # the other rack was not touched
        assert lab.events(name, "server.power") == []
        assert lab.server(name)["power_state"] == "unknown"
    rows = lab.fleetctl_json("servers", "power", "status", "--rack", "r2")
    assert {r["server"]: r["state_after"] for r in rows} == {"ip-a": "on", "ip-b": "off"}
    body = ok(
        lab.operator.post(
            f"{API}/power",
            json={
                "action": "status",
                "select": {"site": SITE, "pool": "warm", "gpu_model": "H100"},
            },
        )
    )
    assert sorted(r["server"] for r in body["results"]) == ["ip-a", "ip-b", "rf-a", "rf-b"]
    body = ok(
        lab.operator.post(f"{API}/power", json={"action": "on", "select": {"pool": "baseline"}})
    )
    assert (body["count"], body["results"]) == (0, [])

    events_before = {n: len(lab.events(n)) for n in [*systems, *sims]}
    # An unknown name: 404 naming it, and no BMC is called for the others.
    text = detail(
        lab.operator.post(f"{API}/power", json={"action": "on", "servers": ["rf-b", "nope"]}), 404
    )
    assert "'nope'" in text and "rf-b" not in text
    assert "'nope'" in detail(
        lab.operator.post(f"{API}/servers/nope/power", json={"action": "on"}), 404
    )
    assert lab.sushy.emulator.resets(systems["rf-b"].uuid) == []
    # Malformed requests: 422.
    for bad in [
        {"action": "status", "servers": ["rf-a"], "select": {"rack": "r1"}},  # both
        {"action": "status"},  # neither
        {"action": "status", "servers": []},
        {"action": "reboot", "servers": ["rf-a"]},  # unknown action
        {"action": "status", "select": {"rack": "r1", "colour": "red"}},
    ]:
        assert lab.operator.post(f"{API}/power", json=bad).status_code == 422, bad
    assert (
        lab.operator.post(f"{API}/servers/rf-a/power", json={"action": "reboot"}).status_code == 422
    )
    # Viewers may look, not switch: 403 (the role named), before any BMC call.
    for path, body_ in [
        (f"{API}/servers/rf-b/power", {"action": "on"}),
        (f"{API}/power", {"action": "on", "servers": ["rf-b"]}),
        (f"{API}/power", {"action": "status", "select": {"rack": "r1"}}),
    ]:
        assert "operator" in detail(lab.viewer.post(path, json=body_), 403)
    assert {n: len(lab.events(n)) for n in [*systems, *sims]} == events_before
    assert lab.sushy.emulator.resets(systems["rf-b"].uuid) == []
    assert all(s.log_lines() == [] for s in sims.values())

    # fleetctl: names or filters, one of them; an unknown action is the API's one-line 422.
    for args in [("on",), ("on", "rf-a", "--rack", "r1")]:
        result = lab.fleetctl("servers", "power", *args)
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr.startswith("error: name servers, or select them")
        assert len(result.stderr.splitlines()) == 1
    result = lab.fleetctl("servers", "power", "reboot", "rf-a")
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ")
    result = lab.fleetctl("servers", "power", "on", "nope")
    assert result.exit_code == 1 and result.stderr.splitlines() == [
        "error: no server named 'nope'"
    ], result.stderr


# ---------------------------------------------------------------------------------------------
# Power-ons in one rack are staggered (inrush current); racks proceed each on its own


def test_power_ons_in_a_rack_are_staggered(lab: Lab, db: Engine, tmp_path: Path) -> None:
    # One fake BMC per server, so that every request (the service root included) tells which
    # server's job made it, and when.
    racks = {"ra": ["a1", "a2", "a3"], "rb": ["b1", "b2", "b3"]}
    bmcs = {sid: lab.fake_redfish({"1": "Off"}) for ids in racks.values() for sid in ids}
    lab.import_inventory(
        {
            rack: {f"srv-{sid}": redfish_bmc(bmcs[sid][1], "1") for sid in ids}
            for rack, ids in racks.items()
        }
    )
    settings = {
        **SETTINGS,
        "power_on_per_rack": 1,
        "power_on_rack_delay_s": STAGGER_DELAY_S,
    }
    with serve(db, tmp_path, **settings) as staggered:
        sent_at = time.monotonic()
        rows = lab.fleetctl_json("servers", "power", "on", "--site", SITE, url=staggered.url)
    assert {r["server"]: (r["ok"], r["sent"], r["state_after"]) for r in rows} == {
        f"srv-{sid}": (True, True, "on") for sid in bmcs
    }
    assert all(fake.resets("1") == 1 for fake, _ in bmcs.values())
    for rack, ids in racks.items():
        seen = {sid: [r.at for r in bmcs[sid][0].seen] for sid in ids}
        order = sorted(ids, key=lambda sid: seen[sid][0])
        for i, sid in enumerate(order):
            # The i-th start in a rack comes at least i delays after the call was sent.
            assert seen[sid][0] - sent_at >= i * STAGGER_DELAY_S, (rack, sid, i)
        for a, b in pairwise(order):
            assert seen[a][-1] < seen[b][0], (rack, a, b)  # one at a time in a rack
    # Not checked: the gap between two consecutive first requests. A job's first request
    # reaches the BMC some ms after its reserved start (its lock, the HTTP client), more for
    # the first job of a call, so that gap can be a little under the delay although the starts
    # were not; the reports carry no start time to check it exactly.


def test_bulk_power_streams_one_line_per_server_as_it_finishes(lab: Lab) -> None:
    """`Accept: application/x-ndjson` (what fleetctl's progress bar reads): the count first,
    then each server's result the moment its BMC answers, then the summary."""
    fast = lab.sim(powered_on=True)
    stalled = lab.stalled()
    lab.import_inventory({"r1": {"quick": ipmi_bmc(fast.port), "slow": redfish_bmc(stalled.port)}})
    body = {"action": "status", "servers": ["slow", "quick"]}
    lines: list[tuple[float, dict[str, Any]]] = []
    started = time.monotonic()
    headers = {"Accept": "application/x-ndjson"}
    with lab.operator.stream("POST", f"{API}/power", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        for text in response.iter_lines():
            lines.append((time.monotonic() - started, json.loads(text)))
    assert lines[0][1] == {"count": 2}
    results = [line for _, line in lines[1:-1]]
    assert [r["result"]["server"] for r in results] == ["quick", "slow"]  # as they finish
    assert results[0]["result"]["ok"] and not results[1]["result"]["ok"]
    assert lines[-1][1] == {"count": 2, "failed": 1}
    # The quick one arrived well before the stalled one gave up (its call timeout).
    assert lines[1][0] < lines[2][0] - CALL_S / 2
    # Unknown names are refused before anything streams.
    refused = lab.operator.post(
        f"{API}/power", json={"action": "on", "servers": ["nope"]}, headers=headers
    )
    assert refused.status_code == 404 and "nope" in refused.json()["detail"]
