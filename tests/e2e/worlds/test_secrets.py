"""Acceptance: BMC passwords appear in no response, no output, no log line and no dump column.

On each database: import servers with known random BMC passwords, rotate some (API PATCH and
re-import), then, with every logger at DEBUG and every record captured (the service's thread
included), call every route of the app as every kind of caller and run every fleetctl command
against the live service. No password may appear in any HTTP response, CLI output, log record,
stdout/stderr, or the database dump; the dump must hold each server's ciphertext, and that
ciphertext must decrypt to the server's current password. Client keys likewise: a key's value
only in its create answer, its hash only in the routers' view (GET /routing/callers), and the
value not in the dump.

The power routes and `fleetctl servers power` talk to real BMC peers, so the BMC libraries'
own DEBUG logging (redfish, requests/urllib3; pyghmi prints, if anything) is searched too: a
sushy-tools Redfish emulator serving both Redfish servers but knowing only the first one's
password (the second fails authentication), an ipmi_sim knowing the third server's password,
and, for the fourth, a UDP port nothing listens on (unreachable).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import secrets
import sqlite3
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import typer.main
import uvicorn
import yaml
from factories import TEST_SECRET_KEY
from live import (
    YAML,
    Live,
    database_env,
    database_url,
    debug_logging,
    fill_path,
    operations,
    serve,
)
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from fleet import cli
from fleet.cli import serve as serve_command
from fleet.crypto import SecretBox
from fleet.data import SCENARIOS_DIR
from fleet.lab.ipmi_sim import IpmiSim, free_udp_port
from fleet.lab.sushy import FakeSystem, SushyEmulator
from fleet.models import Role

SITE, RACK = "sec1", "sec1-r01"
SERVERS = ("sec1-r01-h100-01", "sec1-r01-h100-02", "sec1-r01-l40s-01", "sec1-r01-l40s-02")
# Redfish (the emulator knows its password), Redfish (it does not), IPMI (ipmi_sim knows it),
# IPMI (nothing listens).
REDFISH_OK, REDFISH_BAD_AUTH, IPMI_OK, IPMI_DOWN = SERVERS
BMC_USER = "admin"
DEPLOYMENT = "sec-llama"
TENANT = "sec-tenant"
API = "/api/v1"
# The operator move the route sweep makes (enrolled → maintenance is allowed).
SWEEP_MOVE = "maintenance"
# The BMC libraries' loggers, beyond those tests/live.py's debug_logging sets: fleet.bmc.redfish
# keeps "redfish" at INFO unless a level is set for it, so it is set here, as an operator
# chasing a BMC problem would.
BMC_LIBRARY_LOGGERS = ("redfish", "urllib3", "requests", "pyghmi")
# Commands that never reach the service or the database need nothing but a run.
NOT_EXERCISED: frozenset[tuple[str, ...]] = frozenset()


def new_password() -> str:
    # 18 characters: ipmi_sim holds at most 19 of [A-Za-z0-9._~+=@%^,:/-].
    return f"pw{secrets.token_hex(8)}"


class Passwords:
    """Each server's current BMC password, and every password this test ever sent; what the
    emulated BMCs hold, and where each server's BMC is (`endpoints`, set once they run)."""

    def __init__(self) -> None:
        self.current = {name: new_password() for name in SERVERS}
        # The servers are rotated to these before any power call (REDFISH_OK by the sweep's
        # PATCH, IPMI_OK by the first re-import): the BMCs' own passwords.
        self.bmc = {REDFISH_OK: new_password(), IPMI_OK: new_password()}
        self.every = {*self.current.values(), *self.bmc.values()}
        self.system_ids = {REDFISH_OK: str(uuid.uuid4()), REDFISH_BAD_AUTH: str(uuid.uuid4())}
        self.endpoints: dict[str, dict[str, Any]] = {}

    def spare(self) -> str:
        """A new password, searched for like the others but given to no server (yet)."""
        password = new_password()
        self.every.add(password)
        return password

    def rotate(self, name: str, to: str | None = None) -> str:
        self.current[name] = to or self.spare()
        self.every.add(self.current[name])
        return self.current[name]

    def inventory_yaml(self) -> bytes:
        assert self.endpoints, "the BMC emulators are not running"
        return yaml.safe_dump(inventory(self.current, self.endpoints), sort_keys=False).encode()

    def needles(self) -> dict[str, str]:
        """What to search for: each password, and each as a Basic auth credential."""
        found = {p: p for p in self.every}
        for p in self.every:
            basic = base64.b64encode(f"{BMC_USER}:{p}".encode()).decode()
            found[basic] = f"{p} (as Basic {basic})"
        return found


def inventory(passwords: dict[str, str], endpoints: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One rack of four servers (two Redfish behind one BMC endpoint, two IPMI; the last one
    listed at the top level and placed by rack name), and one deployment."""
    dgx = {"idle_w": 1900, "standby_w": 90, "max_w": 10200}
    l40s = {"idle_w": 600, "standby_w": 40, "max_w": 2800}

    def server(name: str, u: int, height: int, gpu: str, count: int, bmc: dict[str, Any]) -> Any:
        return {
            "name": name,
            "serial": f"SN-{name}",
            "u": u,
            "u_height": height,
            "pool": "warm",
            "gpu": {"model": gpu, "count": count},
            "power": dict(dgx if gpu == "H100" else l40s),  # a copy: no YAML aliases
            "bmc": {**bmc, "username": BMC_USER, "password": passwords[name]},
        }

    s1, s2, s3, s4 = SERVERS
    return {
        "sites": [
            {
                "name": SITE,
                "racks": [
                    {
                        "name": RACK,
                        # Room for all four at their maximum (36.2 kW): this test is about
                        # secrets, and the budget gate must not keep a BMC call from happening.
                        "feeds": [
                            {"name": "a1", "side": "A", "volts": 415, "amps": 63, "phase": "three"},
                            {"name": "b1", "side": "B", "volts": 415, "amps": 63, "phase": "three"},
                        ],
                        "servers": [
                            server(s1, 1, 8, "H100", 8, endpoints[s1]),
                            server(s2, 9, 8, "H100", 8, endpoints[s2]),
                            server(s3, 17, 2, "L40S", 4, endpoints[s3]),
                        ],
                    }
                ],
            }
        ],
        "servers": [
            {**server(s4, 19, 2, "L40S", 4, endpoints[s4]), "rack": RACK},
        ],
        "deployments": [
            {
                "name": DEPLOYMENT,
                "model": {"uri": "s3://m/llama", "checksum": "sha256:00"},
                "engine": {"tp_size": 1, "pp_size": 1},
                "gpu_models": ["H100", "L40S"],
                "sla": {"p95_latency_ms": 4000, "ttft_ms": 500},
            }
        ],
    }


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    # Short BMC timeouts: the unreachable IPMI server fails in seconds; no power-on stagger.
    with serve(
        engine,
        tmp_path_factory.mktemp("secrets"),
        bmc_call_timeout_s=2.0,
        bmc_total_timeout_s=4.0,
        power_on_rack_delay_s=0.0,
    ) as server:
        yield server


@pytest.fixture
def passwords() -> Passwords:
    return Passwords()


@pytest.fixture
def redfish_bmc(passwords: Passwords) -> Iterator[SushyEmulator]:
    """Both Redfish servers' systems, behind one account: REDFISH_OK's user and password."""
    ids = passwords.system_ids
    systems = [FakeSystem(uuid=ids[name], name=name) for name in (REDFISH_OK, REDFISH_BAD_AUTH)]
    with SushyEmulator(systems, username=BMC_USER, password=passwords.bmc[REDFISH_OK]) as bmc:
        yield bmc


@pytest.fixture
def ipmi_bmc(passwords: Passwords) -> Iterator[IpmiSim]:
    with IpmiSim(passwords.bmc[IPMI_OK], username=BMC_USER) as sim:
        yield sim


@pytest.fixture
def pw(passwords: Passwords, redfish_bmc: SushyEmulator, ipmi_bmc: IpmiSim) -> Passwords:
    """`passwords`, with every server's BMC endpoint (no credentials) filled in."""
    ids = passwords.system_ids
    redfish = {
        "protocol": "redfish",
        "address": "http://127.0.0.1",
        "port": redfish_bmc.port,
        "plain_http": True,
    }
    passwords.endpoints = {
        REDFISH_OK: {**redfish, "system_id": ids[REDFISH_OK]},
        REDFISH_BAD_AUTH: {**redfish, "system_id": ids[REDFISH_BAD_AUTH]},
        IPMI_OK: {"protocol": "ipmi", "address": "127.0.0.1", "port": ipmi_bmc.port},
        IPMI_DOWN: {"protocol": "ipmi", "address": "127.0.0.1", "port": free_udp_port()},
    }
    return passwords


@pytest.fixture
def fleet_env(live: Live, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """FLEET_DATABASE_URL and FLEET_SECRET_KEY of the live service, for the database-direct
    commands (token, db, serve); the settings cache is cleared on the way in and out."""
    with database_env(live.engine, monkeypatch):
        yield


class Evidence:
    """Everything the test saw come back: responses, CLI output."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []
        self.statuses: list[tuple[str, str, str, int]] = []

    def response(
        self, who: str, method: str, template: str, response: httpx.Response
    ) -> httpx.Response:
        where = f"{who} {method} {response.request.url}"
        headers = "\n".join(f"{k}: {v}" for k, v in response.headers.items())
        self.texts.append((where, f"{headers}\n\n{response.text}"))
        self.statuses.append((who, method, template, response.status_code))
        return response

    def output(self, where: str, text: str) -> None:
        self.texts.append((where, text))


def test_bmc_passwords_never_leak(
    live: Live,
    db: Engine,
    pw: Passwords,
    redfish_bmc: SushyEmulator,
    ipmi_bmc: IpmiSim,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    fleet_env: None,
) -> None:
    evidence = Evidence()
    names = {"servers": SERVERS[0], "racks": RACK, "sites": SITE, "deployments": DEPLOYMENT}
    names["tenants"] = TENANT

    with debug_logging() as logs, _bmc_libraries_at_debug():
        admin_token = live.token(Role.ADMIN, name="admin")
        clients = {
            "admin": live.client(admin_token),
            "operator": live.client(live.token(Role.OPERATOR, name="operator")),
            "viewer": live.client(live.token(Role.VIEWER, name="viewer")),
            "anonymous": live.client(),
            "bad-token": live.client("flt_" + secrets.token_urlsafe(32)),
        }

        def send(who: str, method: str, template: str, **kwargs: Any) -> httpx.Response:
            path = fill_path(template, names, SERVERS[0])
            response = clients[who].request(method, path, **kwargs)
            return evidence.response(who, method, template, response)

        # Import (validate first), rotate one password through the API and one through a
        # re-import (dry run first): an admin's, as credential changes are.
        for template in (f"{API}/inventory/validate", f"{API}/inventory/import"):
            response = send("operator", "POST", template, content=pw.inventory_yaml(), headers=YAML)
            assert response.status_code == 200, response.text
        patch = {"bmc_password": pw.rotate(SERVERS[0])}
        response = send("admin", "PATCH", f"{API}/servers/{{name}}", json=patch)
        assert response.status_code == 200 and response.json()["bmc_password_set"] is True
        pw.rotate(IPMI_OK, to=pw.bmc[IPMI_OK])
        for dry_run in ("true", "false"):
            response = send(
                "admin",
                "POST",
                f"{API}/inventory/import",
                content=pw.inventory_yaml(),
                headers=YAML,
                params={"dry_run": dry_run},
            )
            changes = [(c["name"], c["fields"]) for c in response.json()["changes"]]
            assert changes == [(SERVERS[2], ["bmc_password"])]
        clients["agent"] = live.client(live.token(Role.AGENT, name="agent", server=SERVERS[0]))
        # A tenant with an active client key before the sweep: the routers' view holds its hash.
        response = send("admin", "POST", f"{API}/tenants", json={"name": TENANT})
        assert response.status_code == 201, response.text
        body = {"tenant": TENANT, "name": "sweep-bot", "requests_per_minute": 60}
        response = send("operator", "POST", f"{API}/client-keys", json=body)
        assert response.status_code == 201, response.text

        # Every route, as every caller: a valid request where we know one, and for every write
        # a body with passwords in the wrong places (refused, and never echoed).
        ops = operations(live.app)
        assert ("GET", "/metrics") in ops and ("PATCH", f"{API}/servers/{{name}}") in ops
        for method, template in ops:
            for who in clients:
                request, new_password = _valid_request(method, template, pw)
                response = send(who, method, template, **request)
                if new_password is not None and response.status_code == 200:
                    pw.current[SERVERS[0]] = new_password
                if method != "GET":
                    junk = send(who, method, template, **_junk_request(template, pw))
                    assert junk.status_code in (401, 403, 404, 409, 422), junk.text
        for who, method, template, status in evidence.statuses:
            assert status < 500, f"{who} {method} {template}: {status}"
        assert ("admin", "PATCH", f"{API}/servers/{{name}}", 200) in evidence.statuses
        # The sweep made real calls, not only refused ones: an operator move was accepted (the
        # admin's moved the server, the operator's repeated it) and the operator validated.
        # The power routes answer 200 with one result per server, failed BMCs included.
        transition = f"{API}/servers/{{name}}/transition"
        validate = f"{API}/inventory/validate"
        power_one, power_many = f"{API}/servers/{{name}}/power", f"{API}/power"
        verify = f"{API}/verify"
        for expected in (
            ("admin", "POST", transition, 200),
            ("operator", "POST", transition, 200),
            ("viewer", "POST", transition, 403),
            ("operator", "POST", validate, 200),
            ("admin", "POST", validate, 200),
            ("viewer", "POST", validate, 403),
            *(
                (who, "POST", route, status)
                for route in (power_one, power_many, verify)
                for who, status in (
                    ("admin", 200),
                    ("operator", 200),
                    ("viewer", 403),
                    ("agent", 403),
                    ("anonymous", 401),
                    ("bad-token", 401),
                )
            ),
        ):
            assert expected in evidence.statuses, expected
        moved = clients["admin"].get(f"{API}/servers/{SERVERS[0]}")
        assert (
            evidence.response("admin", "GET", f"{API}/servers/{{name}}", moved).json()["state"]
            == SWEEP_MOVE
        )

        # Every fleetctl command against the live service (and the database for db/token/serve).
        run_cli = _cli_runner(live, admin_token, evidence)
        _run_every_command(run_cli, tmp_path, pw, monkeypatch)
        send("admin", "GET", f"{API}/servers/{{name}}")  # the service still answers
    out, err = capfd.readouterr()
    evidence.output("captured stdout/stderr", out + err)

    # The capture saw the service's thread, SQL at DEBUG, the HTTP client and our access log,
    # and the BMC calls: the Redfish library's requests and responses at DEBUG, urllib3 under it.
    for logger in (
        "fleet.access",
        "uvicorn.access",
        "sqlalchemy.engine.Engine",
        "httpx",
        "redfish.rest.v1",
        "urllib3.connectionpool",
    ):
        assert logger in logs.loggers, sorted(logs.loggers)
    assert any("PATCH /api/v1/servers/" in line for line in logs.lines)
    assert any(line.startswith("DEBUG") and "HTTP REQUEST (GET)" in line for line in logs.lines)
    assert len(pw.every) >= len(SERVERS) + 5  # rotated through the API, files and the CLI
    # The BMCs saw real calls: a Reset for the Redfish server, a refused login for the other,
    # a power-on and a cycle on the IPMI one.
    assert redfish_bmc.resets(pw.system_ids[REDFISH_OK]), redfish_bmc.requests()
    assert any(r.status == 401 for r in redfish_bmc.requests())
    assert not redfish_bmc.resets(pw.system_ids[REDFISH_BAD_AUTH])
    assert "set power 1" in ipmi_bmc.log_calls() and "set power 0" in ipmi_bmc.log_calls()

    searched = [*evidence.texts, *(("log", line) for line in logs.lines)]
    _no_client_key_leaks(searched, db)
    needles = pw.needles()
    leaks = [
        f"{where}: {what}" for where, text in searched for n, what in needles.items() if n in text
    ]
    assert leaks == [], "BMC password leaked:\n" + "\n".join(leaks[:20])

    # The dump: ciphertext only, and the ciphertext is the current password.
    dump = _dump(db)
    assert not [n for n in needles if n in dump], "a BMC password is in the database dump"
    box = SecretBox(TEST_SECRET_KEY)
    with db.connect() as conn:
        rows = conn.execute(sa.text("SELECT name, bmc_password_encrypted FROM server")).all()
    stored: dict[str, str] = {name: ciphertext for name, ciphertext in rows}
    assert sorted(stored) == sorted(SERVERS)
    for name, ciphertext in stored.items():
        assert ciphertext in dump, f"{name}: ciphertext missing from the dump (is the dump real?)"
        assert box.decrypt(ciphertext) == pw.current[name], name


@contextmanager
def _bmc_libraries_at_debug() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in BMC_LIBRARY_LOGGERS]
    saved = [(logger.level, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.disabled = False
    try:
        yield
    finally:
        for logger, (level, disabled) in zip(loggers, saved, strict=True):
            logger.setLevel(level)
            logger.disabled = disabled


# A client key's value is in its create answer only (the API's and `fleetctl keys create`'s);
# its hash only in the routers' view. Neither anywhere else: lists, events, exports, logs.
CLIENT_KEY = re.compile(r"fk_[A-Za-z0-9_-]{43}")


def _no_client_key_leaks(searched: list[tuple[str, str]], db: Engine) -> None:
    def creates(where: str) -> bool:
        return where.startswith("fleetctl keys create") or (
            " POST " in where and where.endswith(f"{API}/client-keys")
        )

    keys = {k for where, text in searched if creates(where) for k in CLIENT_KEY.findall(text)}
    assert len(keys) >= 4, keys  # the sweep's (before, admin's, operator's) and the CLI's
    hashes = {hashlib.sha256(k.encode()).hexdigest(): k for k in keys}
    routers_view = [text for where, text in searched if where.endswith(f"{API}/routing/callers")]
    assert any(h in text for h in hashes for text in routers_view), "the view shows no hash"
    leaks = [
        f"{where}: {kind} of {key}"
        for where, text in searched
        for kind, found in (("value", {k: k for k in keys}), ("hash", hashes))
        if not (kind == "value" and creates(where))
        and not (kind == "hash" and where.endswith(f"{API}/routing/callers"))
        for needle, key in found.items()
        if needle in text
    ]
    assert leaks == [], "client key leaked:\n" + "\n".join(leaks[:20])
    dump = _dump(db)
    assert not [k for k in keys if k in dump], "a client key's value is in the database dump"


def _valid_request(method: str, template: str, pw: Passwords) -> tuple[dict[str, Any], str | None]:
    """A request that succeeds for a caller allowed to make it, and the password it sets."""
    if template.startswith(f"{API}/inventory/") and method == "POST":
        return {"content": pw.inventory_yaml(), "headers": YAML}, None
    if method == "GET":
        return {}, None
    if template == f"{API}/servers/{{name}}" and method == "PATCH":
        # The BMC's own password: the sweep's power calls (POST sorts after PATCH) log in.
        password = pw.bmc[REDFISH_OK]
        return {"json": {"bmc_password": password, "pool": "baseline"}}, password
    if template.endswith("/transition"):
        return {"json": {"to": SWEEP_MOVE, "reason": "sweep"}}, None
    if template == f"{API}/servers/{{name}}/power":
        return {"json": {"action": "status"}}, None
    if template == f"{API}/power":
        return {"json": {"action": "on", "servers": list(SERVERS)}}, None
    if template == f"{API}/verify":
        return {"json": {"servers": list(SERVERS)}}, None
    if template == f"{API}/deployments" and method == "POST":
        body = {
            "name": f"sweep-{secrets.token_hex(3)}",
            "model_uri": "s3://m/x",
            "model_checksum": "sha256:11",
            "sla_p95_latency_ms": 1000,
            "sla_ttft_ms": 100,
        }
        return {"json": body}, None
    if template == f"{API}/deployments/{{name}}" and method == "PATCH":
        return {"json": {"max_replicas": 3}}, None
    if template == f"{API}/tenants" and method == "POST":
        return {"json": {"name": f"sweep-{secrets.token_hex(3)}"}}, None
    if template == f"{API}/tenants/{{name}}" and method == "PATCH":
        return {"json": {"concurrency_share": 0.5}}, None
    if template == f"{API}/client-keys" and method == "POST":
        return {"json": {"tenant": TENANT, "name": "sweep", "expires_in": "1d"}}, None
    return {"json": {}}, None  # a route this test does not know yet: at least call it


def _junk_request(template: str, pw: Passwords) -> dict[str, Any]:
    """A request carrying passwords where no password belongs (always refused)."""
    a, b = pw.spare(), pw.current[SERVERS[1]]
    if template.startswith(f"{API}/inventory/"):
        text = (
            f"sites:\n  - name: x\n    password: {a}\n"  # an unknown field, then broken YAML
            f"    racks: [{{name: y, servers: [{{bmc: {{password: {b}}}"
        )
        return {"content": text.encode(), "headers": YAML}
    body = {
        "bmc_password": a,
        "password": b,
        "bmc_port": a,
        "to": a,
        "reason": "",
        "name": a * 4,
        "max_replicas": b,
        "model_uri": "",
        "pool": b,
        "action": a,
        "servers": [a, b],
        "select": {"rack": b},
    }
    return {"json": body}


CliRun = Callable[..., Any]


def _cli_runner(live: Live, token: str, evidence: Evidence) -> CliRun:
    runner = CliRunner()
    env = {"FLEET_URL": live.url, "FLEET_TOKEN": token}

    def run(*args: str, code: int = 0) -> Any:
        result = runner.invoke(cli.app, list(args), env=env)
        evidence.output(f"fleetctl {' '.join(args)}", result.stdout + result.stderr)
        assert result.exit_code == code, f"{args}: {result.stdout}{result.stderr}"
        return result

    return run


def _command_paths(group: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every leaf command under a click-style group (typer may vendor its own click)."""
    paths: set[tuple[str, ...]] = set()
    for name, command in group.commands.items():
        if isinstance(getattr(command, "commands", None), dict):
            paths |= _command_paths(command, (*prefix, name))
        else:
            paths.add((*prefix, name))
    return paths


def _run_every_command(
    run: CliRun, tmp_path: Path, pw: Passwords, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: set[tuple[str, ...]] = set()

    def cmd(path: tuple[str, ...], *args: str, code: int = 0) -> Any:
        ran.add(path)
        return run(*path, *args, code=code)

    def inventory_file() -> Path:
        path = tmp_path / f"inventory-{secrets.token_hex(4)}.yaml"
        path.write_bytes(pw.inventory_yaml())
        return path

    s1, s2, s3, _ = SERVERS
    # Power first, so that the listings and events below show what it recorded. Two servers
    # fail (a refused login, a BMC that never answers): exit 1, every result shown.
    verified = cmd(("servers", "verify"), *SERVERS, "-o", "json", code=1)
    checked = {r["server"]: r for r in json.loads(verified.stdout)}
    # The route sweep already moved the first server (maintenance) and powered the IPMI one on.
    assert [checked[name]["ok"] for name in SERVERS] == [True, False, False, False], checked
    assert "already maintenance" in checked[s1]["message"]
    assert "a warm spare must be off" in checked[s3]["message"]
    status = cmd(("servers", "power"), "status", *SERVERS, "-o", "json", code=1)
    results = {r["server"]: r for r in json.loads(status.stdout)}
    assert [results[name]["ok"] for name in SERVERS] == [True, False, True, False], results
    assert "refused" in results[REDFISH_BAD_AUTH]["error"], results
    assert IPMI_DOWN in (results[IPMI_DOWN]["error"] or ""), results
    cmd(("servers", "power"), "on", "--rack", RACK, code=1)
    cmd(("servers", "power"), "cycle", IPMI_OK)
    cmd(("racks", "set"), RACK, "--mode", "measured", "--margin", "1.2")
    cmd(("racks", "set"), RACK, "--mode", "nameplate")
    for output in ("table", "json"):
        cmd(("sites",), "-o", output)
        cmd(("racks",), "-o", output, "--site", SITE)
        cmd(("servers", "list"), "-o", output, "--rack", RACK)
        for name in SERVERS:
            cmd(("servers", "show"), name, "-o", output)
            cmd(("servers", "gpus"), name, "-o", output)
        cmd(("deployments", "list"), "-o", output)
        cmd(("deployments", "show"), DEPLOYMENT, "-o", output)
        cmd(("events",), "-o", output, "--limit", "1000")
    cmd(("servers", "transition"), s3, "maintenance", "--reason", "cli")
    cmd(("servers", "transition"), s3, "enrolled", "--reason", "cli")  # release
    cmd(("servers", "transition"), s3, "serving", "--reason", "cli", code=1)  # the fleet's own
    cmd(("servers", "transition"), s3, "draining", "--reason", "cli", code=1)  # not from enrolled
    cmd(
        ("deployments", "create"),
        "cli-dep",
        "--model-uri",
        "s3://m/cli",
        "--checksum",
        "sha256:22",
        "--sla-p95-ms",
        "900",
        "--sla-ttft-ms",
        "90",
        "--engine",
        "backend=pytorch",
    )

    # Rotate a password through a file (validate, dry run, import), then the other outputs.
    pw.rotate(s2)
    rotated = inventory_file()
    assert "1 change" in cmd(("inventory", "validate"), str(rotated)).stdout
    dry = cmd(("inventory", "import"), str(rotated), "--dry-run")
    assert f"update server {s2} (bmc_password)" in dry.stdout
    cmd(("inventory", "import"), str(rotated))
    cmd(("inventory", "import"), str(inventory_file()), "-o", "json")
    cmd(("inventory", "validate"), str(inventory_file()), "-o", "json")
    # A broken file full of passwords: one line, no echo.
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"sites: [{{name: x, bmc: {{password: {pw.spare()}}}, password: {s1}")
    cmd(("inventory", "import"), str(broken), code=1)
    cmd(("inventory", "validate"), str(broken), code=1)
    # Export has no passwords, and re-importing it keeps them.
    exported = yaml.safe_load(cmd(("inventory", "export")).stdout)
    assert all("password" not in s["bmc"] for s in exported["sites"][0]["racks"][0]["servers"])
    export_file = tmp_path / "export.yaml"
    cmd(("inventory", "export"), "--file", str(export_file))
    assert (
        "created nothing; updated nothing" in cmd(("inventory", "import"), str(export_file)).stdout
    )

    cmd(("token", "create"), "--role", "viewer", "--name", "cli-viewer")
    agent_token = cmd(("token", "create"), "--role", "agent", "--server", s1).stdout.split()[-1]
    # The agent on a machine without GPUs: NVML refuses to start, in one line.
    monkeypatch.setenv("FLEET_AGENT_TOKEN", agent_token)
    refused = cmd(("agent", "run"), "--server", s1, "--telemetry", "nvml", "--port", "0", code=1)
    assert "NVML is not available" in refused.stdout + refused.stderr
    tokens = json.loads(cmd(("token", "list"), "-o", "json").stdout)
    cmd(("token", "list"))
    cmd(("token", "revoke"), str(tokens[-1]["id"]))
    # Agent tokens through the API: the value on stdout only, never in a list.
    minted = cmd(("agent-tokens", "mint"), s2, "--expires-in", "1d").stdout.strip()
    listed = cmd(("agent-tokens", "list"), "--server", s2, "-o", "json").stdout
    assert minted.startswith("flt_") and minted not in listed
    [agent_row] = json.loads(listed)
    cmd(("agent-tokens", "mint"), s2, code=1)  # one live token per server
    cmd(("agent-tokens", "list"))
    rotated = json.loads(cmd(("agent-tokens", "rotate"), str(agent_row["id"]), "-o", "json").stdout)
    cmd(("agent-tokens", "revoke"), str(rotated["id"]))
    # SSH from the fleet, on a server without an SSH address: each refusal one line, naming
    # the server (the real sshd runs are tests/e2e/test_ssh.py and test_ansible.py).
    cmd(("servers", "ssh-trust"), s2, code=1)
    cmd(("servers", "known-hosts"), s2, "-o", str(tmp_path / "known_hosts"), code=1)
    cmd(("servers", "diagnose"), s2, code=1)
    cmd(("servers", "diagnostics"), s2)
    cmd(("servers", "diagnostics-get"), "999999", "-o", str(tmp_path / "b.tar.gz"), code=1)
    cmd(("lab", "ssh-key"), "--dir", str(tmp_path / "lab-key"))
    # Tenants and client keys: the key alone on stdout at creation, in no list.
    cmd(("tenants", "create"), "cli-tenant", "--share", "0.5")
    cmd(("tenants", "create"), "cli-tenant", code=1)  # exists: one line
    cmd(("tenants", "set"), "cli-tenant", "--share", "0.25")
    cmd(("tenants", "list"))
    cmd(("tenants", "list"), "-o", "json")
    made = cmd(("keys", "create"), "--tenant", "cli-tenant", "--name", "cli", "--rpm", "60")
    client_key = made.stdout.strip()
    assert client_key.startswith("fk_") and client_key not in made.stderr
    made_json = cmd(("keys", "create"), "--tenant", "cli-tenant", "--name", "j", "-o", "json")
    other_key = json.loads(made_json.stdout)
    cmd(("keys", "create"), "--tenant", "ghost", "--name", "x", code=1)  # unknown tenant
    listed = cmd(("keys", "list"), "--tenant", "cli-tenant", "-o", "json").stdout
    assert client_key not in listed and other_key["key"] not in listed
    cmd(("keys", "list"))
    cli_key_id = str(next(r["id"] for r in json.loads(listed) if r["name"] == "cli"))
    cmd(("keys", "set"), cli_key_id, "--rpm", "none", "--tpm", "1000")
    cmd(("keys", "set"), cli_key_id, code=1)  # nothing to change: one line
    cmd(("tenants", "delete"), "cli-tenant", code=1)  # active keys: one line
    cmd(("keys", "revoke"), cli_key_id)
    cmd(("keys", "revoke"), str(other_key["id"]))
    cmd(("tenants", "delete"), "cli-tenant")
    cmd(("db", "current"))
    cmd(("db", "upgrade"))
    cmd(("secret-key",))

    # Warm spares, workflow moves and the autopilot.
    cmd(("spares",))
    cmd(("spares",), "-o", "json")
    cmd(
        ("prometheus-config",), "--out", str(tmp_path / "prom"), "--router", "http://127.0.0.1:8000"
    )
    cmd(("prometheus-config",), "--router", "not-a-url", code=1)
    cmd(("spares", "boot"), "--deployment", "no-such-deployment", "--wait", "0", code=1)
    cmd(("servers", "drain"), s3, code=1)  # not serving: 409, one line
    cmd(("servers", "undrain"), s3, code=1)
    cmd(("servers", "maintenance"), s3, "--reason", "cli")
    cmd(("servers", "release"), s3)
    cmd(("servers", "retire"), "no-such-server", code=1)
    cmd(("autopilot", "status"))
    cmd(("autopilot", "pause"), "--reason", "cli")
    cmd(("autopilot", "resume"))
    cmd(("events",), "--follow", "--follow-for", "0.5", "--limit", "5")
    cmd(("autoscaler", "status"))
    cmd(("autoscaler", "status"), "-o", "json")
    cmd(("autoscaler", "history"), DEPLOYMENT)
    cmd(("autoscaler", "explain"), DEPLOYMENT, code=1)  # no decision yet: one line
    cmd(("deployments", "scale"), DEPLOYMENT, "--replicas", "2")
    cmd(("deployments", "scale"), DEPLOYMENT, "--auto")
    cmd(("deployments", "scale"), DEPLOYMENT, code=1)  # neither: one line
    # Model versions and a rollout (started, looked at, rolled back by hand; no server moves
    # while none serves) of a new version of the deployment's model.
    shown = json.loads(cmd(("deployments", "show"), DEPLOYMENT, "-o", "json").stdout)
    model = shown["model_version"].split("@")[0]
    artifact = f"name=w.bin,uri=s3://weights/{model}/v9/w.bin,sha256={'ab' * 32},size=1"
    cmd(("models", "create"), f"{model}@v9", "--artifact", artifact)
    cmd(("models", "create"), f"{model}@v9", "--artifact", artifact, code=1)  # immutable
    cmd(("models", "list"))
    cmd(("models", "show"), f"{model}@v9")
    cmd(("models", "where"), f"{model}@v9")
    cmd(("deployments", "rollout"), DEPLOYMENT, "--version", "v9", "--canary", "10%")
    cmd(("deployments", "rollout-status"), DEPLOYMENT)
    cmd(("deployments", "rollback"), DEPLOYMENT, "--reason", "cli")
    cmd(("deployments", "rollback"), DEPLOYMENT, code=1)  # none running: one line
    cmd(("models", "delete"), f"{model}@v9")
    # The calendar (the re-imports above put the deployment's max_replicas back to 1).
    spec = ("--cron", "0 9 * * 1-5", "--tz", "Europe/Berlin")
    new = (DEPLOYMENT, "--min-replicas", "1", *spec)
    entry = json.loads(cmd(("schedule", "add"), *new, "--for", "9h", "-o", "json").stdout)["id"]
    cmd(("schedule", "list"))
    cmd(("schedule", "list"), "-o", "json")
    cmd(("schedule", "preview"), str(entry), "--count", "3")
    cmd(("schedule", "preview"), "--deployment", DEPLOYMENT, *spec, "--until", "0 18 * * 1-5")
    cmd(("schedule", "add"), *new, "--for", "9x", code=1)  # not a duration: one line
    cmd(("schedule", "rm"), "999999", code=1)  # no such entry: one line
    cmd(("schedule", "add"), *new, "--for", "1h", "-o", "json")
    cmd(("schedule", "rm"), str(entry))
    # The router refuses to start without a token or a table, and on an unknown strategy.
    monkeypatch.delenv("FLEET_ROUTER_TOKEN", raising=False)
    cmd(("router", "run"), "--port", "0", code=1)
    cmd(("router", "run"), "--port", "0", "--strategy", "fastest", code=1)
    # The simulator on the example scenario, and on a file that is not there (one line).
    scenario = SCENARIOS_DIR / "mixed-code.yaml"
    cmd(("simulate",), str(scenario), "--compare", "round_robin,estimated_completion_time")
    cmd(("simulate",), str(tmp_path / "no-such-scenario.yaml"), code=1)
    # Its compiler, where there is none (one line; tests/e2e/test_sim_native.py builds for real).
    with monkeypatch.context() as env:
        env.setenv("FLEET_SIM_NATIVE_DIR", str(tmp_path / "native"))
        env.setenv("PATH", str(tmp_path / "no-bin"))
        env.delenv("CC", raising=False)
        cmd(("simulate-compile",), code=1)
    # The demo's own run is tests/e2e/worlds/test_demo.py (minutes); here its refusal of a bad
    # directory.
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file")
    cmd(("demo",), "--no-live", "--dir", str(blocked), code=1)

    # The virtual colo's commands on a file full of passwords and on a lab that is not up:
    # one line each, no echo (the lab's own run is tests/e2e/worlds/test_lab.py).
    no_lab = tmp_path / "no-lab"
    cmd(("lab", "up"), str(broken), "--dir", str(no_lab), "--no-import", code=1)
    cmd(("lab", "status"), "--dir", str(no_lab), code=1)
    cmd(("lab", "inject"), s1, "xid", "79", "--dir", str(no_lab), code=1)
    cmd(("lab", "down"), "--dir", str(no_lab), code=1)

    # `serve` with the server's run stubbed: the import, the admin token and the banner run for
    # real.
    served: list[Any] = []
    monkeypatch.setattr(
        serve_command, "serve_bounded", lambda config, _timeout: served.append(config.app)
    )
    # uvicorn's Config applies its own logging config (uvicorn.access stops propagating), which
    # would blind this test's capture in the next parametrisation.
    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda _self: None)
    pw.rotate(s1)
    cmd(("serve",), "--import", str(inventory_file()), "--admin-token", "--port", "1")
    assert len(served) == 1
    served[0].state.engine.dispose()

    every_command = _command_paths(typer.main.get_command(cli.app))
    missing = every_command - ran - NOT_EXERCISED
    assert not missing, f"fleetctl commands this test does not run yet: {sorted(missing)}"


def _dump(engine: Engine) -> str:
    if engine.dialect.name == "sqlite":
        path = engine.url.database
        assert path
        conn = sqlite3.connect(path)
        try:
            return "\n".join(conn.iterdump())
        finally:
            conn.close()
    url = database_url(engine).replace("postgresql+psycopg://", "postgresql://", 1)
    result = subprocess.run(
        ["pg_dump", "--no-owner", "--dbname", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
