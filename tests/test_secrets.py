"""Acceptance: BMC passwords appear in no response, no output, no log line and no dump column.

On each database: import servers with known random BMC passwords, rotate some (API PATCH and
re-import), then, with every logger at DEBUG and every record captured (the service's thread
included), call every route of the app as every kind of caller and run every fleetctl command
against the live service. No password may appear in any HTTP response, CLI output, log record,
stdout/stderr, or the database dump; the dump must hold each server's ciphertext, and that
ciphertext must decrypt to the server's current password.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
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

import cli
from fleet.crypto import SecretBox
from fleet.models import Role

SITE, RACK = "sec1", "sec1-r01"
SERVERS = ("sec1-r01-h100-01", "sec1-r01-h100-02", "sec1-r01-l40s-01", "sec1-r01-l40s-02")
DEPLOYMENT = "sec-llama"
API = "/api/v1"
# The operator move the route sweep makes (enrolled → maintenance is allowed).
SWEEP_MOVE = "maintenance"
# Commands that never reach the service or the database need nothing but a run.
NOT_EXERCISED: frozenset[tuple[str, ...]] = frozenset()


def new_password() -> str:
    return f"bmcpw-{secrets.token_hex(12)}"


class Passwords:
    """Each server's current BMC password, and every password this test ever sent."""

    def __init__(self) -> None:
        self.current = {name: new_password() for name in SERVERS}
        self.every = set(self.current.values())

    def spare(self) -> str:
        """A new password, searched for like the others but given to no server (yet)."""
        password = new_password()
        self.every.add(password)
        return password

    def rotate(self, name: str) -> str:
        self.current[name] = self.spare()
        return self.current[name]

    def inventory_yaml(self) -> bytes:
        return yaml.safe_dump(inventory(self.current), sort_keys=False).encode()


def inventory(passwords: dict[str, str]) -> dict[str, Any]:
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
            "bmc": {**bmc, "username": "admin", "password": passwords[name]},
        }

    redfish = {"protocol": "redfish", "address": "127.0.0.1", "port": 8000}
    s1, s2, s3, s4 = SERVERS
    return {
        "sites": [
            {
                "name": SITE,
                "racks": [
                    {
                        "name": RACK,
                        "feeds": [
                            {"name": "a1", "side": "A", "volts": 415, "amps": 32, "phase": "three"},
                            {"name": "b1", "side": "B", "volts": 415, "amps": 32, "phase": "three"},
                        ],
                        "servers": [
                            server(s1, 1, 8, "H100", 8, {**redfish, "system_id": "sys-1"}),
                            server(s2, 9, 8, "H100", 8, {**redfish, "system_id": "sys-2"}),
                            server(
                                s3,
                                17,
                                2,
                                "L40S",
                                4,
                                {"protocol": "ipmi", "address": "127.0.0.1", "port": 9001},
                            ),
                        ],
                    }
                ],
            }
        ],
        "servers": [
            {
                **server(
                    s4, 19, 2, "L40S", 4, {"protocol": "ipmi", "address": "127.0.0.1", "port": 9002}
                ),
                "rack": RACK,
            }
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
    with serve(engine, tmp_path_factory.mktemp("secrets")) as server:
        yield server


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
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    fleet_env: None,
) -> None:
    pw = Passwords()
    evidence = Evidence()
    names = {"servers": SERVERS[0], "racks": RACK, "sites": SITE, "deployments": DEPLOYMENT}

    with debug_logging() as logs:
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
        # re-import (dry run first).
        for template in (f"{API}/inventory/validate", f"{API}/inventory/import"):
            response = send("operator", "POST", template, content=pw.inventory_yaml(), headers=YAML)
            assert response.status_code == 200, response.text
        patch = {"bmc_password": pw.rotate(SERVERS[0])}
        response = send("operator", "PATCH", f"{API}/servers/{{name}}", json=patch)
        assert response.status_code == 200 and response.json()["bmc_password_set"] is True
        pw.rotate(SERVERS[2])
        for dry_run in ("true", "false"):
            response = send(
                "operator",
                "POST",
                f"{API}/inventory/import",
                content=pw.inventory_yaml(),
                headers=YAML,
                params={"dry_run": dry_run},
            )
            changes = [(c["name"], c["fields"]) for c in response.json()["changes"]]
            assert changes == [(SERVERS[2], ["bmc_password"])]
        clients["agent"] = live.client(live.token(Role.AGENT, name="agent", server=SERVERS[0]))

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
        transition = f"{API}/servers/{{name}}/transition"
        validate = f"{API}/inventory/validate"
        for expected in (
            ("admin", "POST", transition, 200),
            ("operator", "POST", transition, 200),
            ("viewer", "POST", transition, 403),
            ("operator", "POST", validate, 200),
            ("admin", "POST", validate, 200),
            ("viewer", "POST", validate, 403),
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

    # The capture saw the service's thread, SQL at DEBUG, the HTTP client and our access log.
    for logger in ("fleet.access", "uvicorn.access", "sqlalchemy.engine.Engine", "httpx"):
        assert logger in logs.loggers, sorted(logs.loggers)
    assert any("PATCH /api/v1/servers/" in line for line in logs.lines)
    assert len(pw.every) >= len(SERVERS) + 5  # rotated through the API, files and the CLI

    searched = [*evidence.texts, *(("log", line) for line in logs.lines)]
    leaks = [f"{where}: {p}" for where, text in searched for p in pw.every if p in text]
    assert leaks == [], "BMC password leaked:\n" + "\n".join(leaks[:20])

    # The dump: ciphertext only, and the ciphertext is the current password.
    dump = _dump(db)
    assert not [p for p in pw.every if p in dump], "a BMC password is in the database dump"
    box = SecretBox(TEST_SECRET_KEY)
    with db.connect() as conn:
        rows = conn.execute(sa.text("SELECT name, bmc_password_encrypted FROM server")).all()
    stored: dict[str, str] = {name: ciphertext for name, ciphertext in rows}
    assert sorted(stored) == sorted(SERVERS)
    for name, ciphertext in stored.items():
        assert ciphertext in dump, f"{name}: ciphertext missing from the dump (is the dump real?)"
        assert box.decrypt(ciphertext) == pw.current[name], name


def _valid_request(method: str, template: str, pw: Passwords) -> tuple[dict[str, Any], str | None]:
    """A request that succeeds for a caller allowed to make it, and the password it sets."""
    if template.startswith(f"{API}/inventory/") and method == "POST":
        return {"content": pw.inventory_yaml(), "headers": YAML}, None
    if method == "GET":
        return {}, None
    if template == f"{API}/servers/{{name}}" and method == "PATCH":
        password = pw.spare()
        return {"json": {"bmc_password": password, "pool": "baseline"}}, password
    if template.endswith("/transition"):
        return {"json": {"to": SWEEP_MOVE, "reason": "sweep"}}, None
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
    for output in ("table", "json"):
        cmd(("sites",), "-o", output)
        cmd(("racks",), "-o", output, "--site", SITE)
        cmd(("servers", "list"), "-o", output, "--rack", RACK)
        for name in SERVERS:
            cmd(("servers", "show"), name, "-o", output)
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
    cmd(("token", "create"), "--role", "agent", "--server", s1)
    tokens = json.loads(cmd(("token", "list"), "-o", "json").stdout)
    cmd(("token", "list"))
    cmd(("token", "revoke"), str(tokens[-1]["id"]))
    cmd(("db", "current"))
    cmd(("db", "upgrade"))
    cmd(("secret-key",))

    # `serve` with uvicorn.run stubbed: the import, the admin token and the banner run for real.
    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
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
