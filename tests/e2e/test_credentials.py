"""BMC credentials stay with the BMC they were given for (docs/design.md, docs/api.md).

An operator may move a server's BMC (address, port, protocol, system id, plain HTTP on): the
stored password is dropped unless the same request brings a new one, and only an admin may set
one. A server without a password gets no BMC call at all (power actions, the reconciler, the
provisioner: a clear error, nothing sent). The BMC a server was moved to is a tiny HTTP server
of this module's own that records every connection and request (tests/fake_bmcs.py).

Driver-level rules (plain HTTP only with the opt-in, no session → basic-auth fallback) are in
tests/e2e/test_bmc_redfish.py with its fake BMCs.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
import yaml
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, feed
from fake_bmcs import RecordingBmc
from live import YAML, Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.bmc.base import BmcTarget, PowerDriver
from fleet.crypto import SecretBox
from fleet.inventory.servers import NO_PASSWORD
from fleet.lab.sushy import FakeSystem, SushyEmulator
from fleet.models import Deployment, Role, Server, utcnow
from fleet.power.reconciler import reconcile_once
from fleet.provisioning.boots import boot_spares
from fleet.provisioning.tick import provision_once
from fleet.settings import Settings

API = "/api/v1"
USER, PASSWORD = "admin", "stored-bmc-Secret-1"
NEW_PASSWORD = "rotated-bmc-Secret-2"
SERVER = "rf-01"


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("credentials")) as server:
        yield server


@pytest.fixture(scope="module")
def sushy() -> Iterator[SushyEmulator]:
    with SushyEmulator([FakeSystem.new(SERVER)], username=USER, password=PASSWORD) as emulator:
        yield emulator


@dataclass
class Api:
    live: Live
    admin: httpx.Client
    operator: httpx.Client
    sushy: SushyEmulator

    def bmc(self, **changes: Any) -> dict[str, Any]:
        """The server's BMC entry: the emulator (plain HTTP, opted in), with `changes`."""
        entry = {
            "protocol": "redfish",
            "address": "http://127.0.0.1",
            "port": self.sushy.port,
            "system_id": self.sushy.systems[0],
            "plain_http": True,
            "username": USER,
            "password": PASSWORD,
        }
        return {k: v for k, v in (entry | changes).items() if v is not None}

    def inventory(self, **bmc: Any) -> bytes:
        server = {
            "name": SERVER,
            "u": 1,
            "gpu": {"model": "H100", "count": 8},
            "power": {"idle_w": 500, "standby_w": 50, "max_w": 1000},
            "bmc": self.bmc(**bmc),
        }
        rack = {"name": "r1", "feeds": [{"name": "a1", "side": "A", "volts": 230, "amps": 32}]}
        doc = {"sites": [{"name": "lab", "racks": [rack | {"servers": [server]}]}]}
        return yaml.safe_dump(doc, sort_keys=False).encode()

    def power(self, client: httpx.Client, action: str = "status") -> dict[str, Any]:
        reply = client.post(f"{API}/servers/{SERVER}/power", json={"action": action})
        assert reply.status_code == 200, reply.text
        report: dict[str, Any] = reply.json()
        return report

    def server(self) -> dict[str, Any]:
        body: dict[str, Any] = ok(self.admin.get(f"{API}/servers/{SERVER}"))
        return body

    def updates(self) -> list[dict[str, Any]]:
        params = {"subject": SERVER, "kind": "server.updated"}
        rows: list[dict[str, Any]] = ok(self.admin.get(f"{API}/events", params=params))["results"]
        return rows


@pytest.fixture
def api(live: Live, db: Engine, sushy: SushyEmulator) -> Iterator[Api]:
    api = Api(
        live,
        live.client(live.token(Role.ADMIN, name="admin")),
        live.client(live.token(Role.OPERATOR, name="ops")),
        sushy,
    )
    ok(api.operator.post(f"{API}/inventory/import", content=api.inventory(), headers=YAML))
    yield api
    live.close_clients()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json()


def forbidden(response: httpx.Response) -> str:
    text: str = ok(response, 403)["detail"]
    assert "admin role" in text, text
    return text


def basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"{USER}:{password}".encode()).decode()


def at(moment: datetime) -> Callable[[], datetime]:
    """A clock stopped at `moment`."""
    return lambda: moment


def assert_nothing_reached(bmc: RecordingBmc) -> None:
    """No connection at all, so no header and no body: the password went nowhere."""
    assert bmc.requests() == [] and bmc.connections == 0


# ---------------------------------------------------------------------------------------------
# Moving a BMC drops its password


def test_an_operators_bmc_move_sends_the_password_nowhere(api: Api) -> None:
    assert api.power(api.operator)["ok"] is True  # the emulator, opted into plain HTTP
    with RecordingBmc(USER, PASSWORD) as theirs:
        # The move an attacker with an operator token would make: a host of theirs, in clear.
        move = {"bmc_address": "127.0.0.1", "bmc_port": theirs.port, "bmc_plain_http": True}
        moved = ok(api.operator.patch(f"{API}/servers/{SERVER}", json=move))
        assert moved["bmc_password_set"] is False and moved["bmc_plain_http"] is True

        for action in ("status", "on", "cycle"):
            report = api.power(api.operator, action)
            assert report["ok"] is False and report["sent"] is False
            assert f"no BMC password for {SERVER}: set one (admin)" in report["error"]
        bulk = ok(api.operator.post(f"{API}/power", json={"action": "on", "servers": [SERVER]}))
        assert bulk["results"][0]["ok"] is False
        [verify] = ok(api.operator.post(f"{API}/verify", json={"servers": [SERVER]}))["results"]
        assert verify["ok"] is False and "no BMC password" in verify["message"]
        # The reconciler reads it as a BMC it cannot reach: counted, no crash, nothing sent;
        # `reconcile_failures` reads (one a tick, ticks a while apart) mark it unreachable.
        settings, box = api.live.settings, api.live.app.state.box
        start = utcnow()
        for k in range(settings.reconcile_failures):
            later = start + timedelta(seconds=k * 2 * settings.reconcile_interval_s)
            tick = reconcile_once(api.live.engine, box, settings, now=at(later))
            assert tick.failed == 1
        assert api.server()["bmc_reachable"] is False
        assert_nothing_reached(theirs)

    [event] = api.updates()
    endpoints = event["details"]["bmc_endpoint"]
    system = f"system {api.sushy.systems[0]} (plain HTTP)"
    assert endpoints["from"] == f"redfish http://127.0.0.1:{api.sushy.port} {system}"
    assert endpoints["to"] == f"redfish 127.0.0.1:{theirs.port} {system}"
    assert event["details"]["bmc_password"] == "dropped"
    assert event["details"]["fields"] == ["bmc_address", "bmc_port", "bmc_password"]
    assert "dropped" in event["message"] and str(theirs.port) in event["message"]
    assert event["actor"] == "operator:ops" and PASSWORD not in str(event)


@pytest.mark.parametrize(
    "move",
    [
        {"bmc_port": 1},
        {"bmc_protocol": "ipmi"},
        {"bmc_system_id": "another-system"},
        {"bmc_system_id": None},
        {"bmc_address": "http://127.0.0.2"},
    ],
    ids=["port", "protocol", "system-id", "no-system-id", "address"],
)
def test_every_endpoint_change_drops_the_password(api: Api, move: dict[str, Any]) -> None:
    moved = ok(api.operator.patch(f"{API}/servers/{SERVER}", json=move))
    assert moved["bmc_password_set"] is False
    [event] = api.updates()
    assert event["details"]["bmc_password"] == "dropped"


def test_edits_that_keep_the_endpoint_keep_the_password(api: Api) -> None:
    same = {"bmc_address": "http://127.0.0.1", "bmc_port": api.sushy.port, "pool": "baseline"}
    assert ok(api.operator.patch(f"{API}/servers/{SERVER}", json=same))["bmc_password_set"]
    # Turning plain HTTP off only adds TLS: kept (and the emulator, without TLS, is refused).
    off = ok(api.operator.patch(f"{API}/servers/{SERVER}", json={"bmc_plain_http": False}))
    assert off["bmc_password_set"] is True
    report = api.power(api.operator)
    assert report["ok"] is False and "plain_http: true" in report["error"]
    assert [e["details"]["fields"] for e in api.updates()] == [["bmc_plain_http"], ["pool"]]


def test_an_admin_moves_the_bmc_with_a_new_password_and_it_is_used(api: Api) -> None:
    with RecordingBmc(USER, NEW_PASSWORD) as new:
        move = {
            "bmc_address": "127.0.0.1",
            "bmc_port": new.port,
            "bmc_system_id": "1",
            "bmc_plain_http": True,
            "bmc_password": NEW_PASSWORD,
        }
        forbidden(api.operator.patch(f"{API}/servers/{SERVER}", json=move))
        assert api.server()["bmc_port"] == api.sushy.port  # the refused edit changed nothing
        assert ok(api.admin.patch(f"{API}/servers/{SERVER}", json=move))["bmc_password_set"]
        report = api.power(api.operator)
        assert report["ok"] is True and report["state_after"] == "on"
        sent = {s.headers.get("Authorization") for s in new.requests()}
        assert sent <= {None, basic(NEW_PASSWORD)} and basic(NEW_PASSWORD) in sent
    [event] = api.updates()
    assert event["details"]["bmc_password"] == "replaced" and event["actor"] == "admin:admin"
    assert NEW_PASSWORD not in str(event)


def test_plain_http_needs_the_opt_in_then_works(api: Api) -> None:
    with RecordingBmc(USER, NEW_PASSWORD) as bmc:
        move = {
            "bmc_address": "http://127.0.0.1",
            "bmc_port": bmc.port,
            "bmc_system_id": "1",
            "bmc_plain_http": False,
            "bmc_password": NEW_PASSWORD,
        }
        ok(api.admin.patch(f"{API}/servers/{SERVER}", json=move))
        report = api.power(api.operator)
        assert report["ok"] is False and report["sent"] is False
        assert "plain HTTP" in report["error"] and "plain_http: true" in report["error"]
        assert_nothing_reached(bmc)
        # Opting in is a change of protocol: it drops the password unless one comes with it.
        opt_in = {"bmc_plain_http": True}
        assert not ok(api.operator.patch(f"{API}/servers/{SERVER}", json=opt_in))[
            "bmc_password_set"
        ]
        assert_nothing_reached(bmc)
        ok(api.admin.patch(f"{API}/servers/{SERVER}", json={"bmc_password": NEW_PASSWORD}))
        assert api.power(api.operator)["ok"] is True
        assert basic(NEW_PASSWORD) in {s.headers.get("Authorization") for s in bmc.requests()}


# ---------------------------------------------------------------------------------------------
# Credentials are an admin's


@pytest.mark.parametrize(
    "edit",
    [
        {"bmc_password": NEW_PASSWORD},
        {"bmc_username": "root"},
        {"bmc_address": "127.0.0.3", "bmc_password": NEW_PASSWORD},
    ],
    ids=["password", "username", "move-with-password"],
)
def test_an_operator_cannot_change_credentials(api: Api, edit: dict[str, Any]) -> None:
    before = api.server()
    text = forbidden(api.operator.patch(f"{API}/servers/{SERVER}", json=edit))
    assert NEW_PASSWORD not in text
    assert api.server() == before and api.updates() == []
    assert ok(api.admin.patch(f"{API}/servers/{SERVER}", json=edit))["bmc_password_set"] is (
        "bmc_address" in edit or "bmc_password" in edit or before["bmc_password_set"]
    )


def test_inventory_credential_changes_need_an_admin(api: Api) -> None:
    def send(client: httpx.Client, route: str, body: bytes) -> httpx.Response:
        return client.post(f"{API}/inventory/{route}", content=body, headers=YAML)

    # The same file again, an operator's to import: its password is not even looked at, so
    # a file with another one gets the very same answer (no oracle for the stored password).
    ignored = "bmc.password ignored (only admins change BMC credentials)"
    same = ok(send(api.operator, "import", api.inventory()))
    assert same["changes"] == [] and any(ignored in w for w in same["warnings"])
    changed = api.inventory(password=NEW_PASSWORD)
    for route in ("validate", "import"):
        answer = ok(send(api.operator, route, changed))
        assert answer["changes"] == [] and any(ignored in w for w in answer["warnings"])
    assert api.power(api.operator)["ok"] is True  # the stored password was kept
    forbidden(send(api.operator, "import", api.inventory(username="root")))
    assert api.server()["bmc_username"] == USER and api.power(api.operator)["ok"] is True

    report = ok(send(api.admin, "import", changed))
    assert [(c["name"], c["fields"]) for c in report["changes"]] == [(SERVER, ["bmc_password"])]


def test_an_inventory_move_without_a_password_drops_it(api: Api) -> None:
    with RecordingBmc(USER, PASSWORD) as theirs:
        moved = api.inventory(port=theirs.port, system_id="1", password=None)
        report = ok(api.operator.post(f"{API}/inventory/import", content=moved, headers=YAML))
        [change] = report["changes"]
        assert change["fields"] == ["bmc_port", "bmc_system_id", "bmc_password"]
        assert any("stored one is dropped" in w for w in report["warnings"])
        assert api.server()["bmc_password_set"] is False
        assert api.power(api.operator)["ok"] is False
        assert_nothing_reached(theirs)
        [event] = api.updates()
        assert event["details"]["bmc_password"] == "dropped"
        to = event["details"]["bmc_endpoint"]["to"]
        assert to == f"redfish http://127.0.0.1:{theirs.port} system 1 (plain HTTP)"
        # Setting one again (even the old one) is an admin's.
        again = api.inventory(port=theirs.port, system_id="1")
        forbidden(api.operator.post(f"{API}/inventory/import", content=again, headers=YAML))
        ok(api.admin.post(f"{API}/inventory/import", content=again, headers=YAML))
        assert api.power(api.operator)["ok"] is True
        assert basic(PASSWORD) in {s.headers.get("Authorization") for s in theirs.requests()}


def test_the_export_keeps_the_opt_in(api: Api) -> None:
    export = api.admin.get(f"{API}/inventory/export")
    [server] = yaml.safe_load(export.text)["sites"][0]["racks"][0]["servers"]
    assert server["bmc"]["plain_http"] is True and "password" not in server["bmc"]


# ---------------------------------------------------------------------------------------------
# The provisioner: a spare without a password fails its boot, with nothing sent


def test_the_provisioner_sends_nothing_for_a_server_without_a_password(
    db: Engine, session: Session
) -> None:
    rack = add_rack(session, add_site(session, "s1"), "r1", feeds=[feed("A"), feed("B")])
    add_server(session, rack, "nopw", "warm", bmc_password_encrypted=NO_PASSWORD, bmc_port=1)
    add_server(session, rack, "spare", "warm", u_position=9)
    session.add(
        Deployment(
            name="llama",
            model_uri="s3://m/llama",
            model_checksum="sha256:1",
            gpus_per_replica=8,
            gpu_models=["H100"],
            max_replicas=2,
            sla_p95_latency_ms=2000,
            sla_ttft_ms=300,
        )
    )
    session.commit()
    # Placement never picks a spare it could not power on.
    boot = boot_spares(db, "llama", 2, "operator:test", raise_target=True)
    assert boot.booted == ("spare",) and boot.short == 1
    # A booting server whose password went (its BMC moved meanwhile): failed, nothing sent.
    with Session(db) as edit:
        spare = edit.exec(select(Server).where(Server.name == "spare")).one()
        spare.bmc_password_encrypted = NO_PASSWORD
        edit.add(spare)
        edit.commit()
    targets: list[BmcTarget] = []

    def drivers(target: BmcTarget) -> PowerDriver:
        targets.append(target)
        raise AssertionError("no driver for a server without a password")

    provision_once(db, SecretBox(TEST_SECRET_KEY), Settings(), drivers=drivers)
    assert targets == []
    with Session(db) as check:
        rows = {s.name: s for s in check.exec(select(Server))}
    assert rows["spare"].state == "failed" and rows["nopw"].state == "warm"
    assert "no BMC password for spare" in (rows["spare"].failed_reason or "")
