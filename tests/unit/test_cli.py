"""fleetctl against a real service (uvicorn in a thread), through typer's CliRunner.

Most cases need one database only and run on SQLite; the import → export → re-import round trip
runs on both. Every error is one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from cryptography.fernet import Fernet
from live import Live, closed_port, database_env, load_demo, serve
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from typer.testing import CliRunner, Result

from fleet import cli
from fleet import db as fleet_db
from fleet.auth import MAX_TOKEN_NAME
from fleet.cli.common import handled
from fleet.data import DEMO_INVENTORY, SCENARIOS_DIR, bundled_scenarios, scenario_path
from fleet.lifecycle.states import OPERATOR_TARGETS, ServerState, allowed_targets, draws_max_power
from fleet.models import Role
from fleet.power.budget import ServerDraw, rack_power
from fleet.settings import get_settings

DEMO = load_demo()
DEMO_FILE = str(DEMO_INVENTORY)
# Every server right after an import: enrolled, and no BMC read yet.
IMPORTED = (ServerState.ENROLLED, "unknown")
sqlite_only = pytest.mark.parametrize("engine", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("cli")) as server:
        yield server


@dataclass
class Fleetctl:
    live: Live
    token: str
    runner: CliRunner

    def __call__(self, *args: str, token: str | None = None, url: str | None = None) -> Result:
        env = {"FLEET_URL": url or self.live.url, "FLEET_TOKEN": token or self.token}
        return self.runner.invoke(cli.app, list(args), env=env)

    def ok(self, *args: str, token: str | None = None) -> Result:
        result = self(*args, token=token)
        assert result.exit_code == 0, f"{args}: {result.stdout}{result.stderr}"
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "-o", "json").stdout)

    def import_demo(self) -> Result:
        return self.ok("inventory", "import", DEMO_FILE)


@pytest.fixture
def fleetctl(live: Live, db: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleetctl]:
    with database_env(db, monkeypatch):  # for `token create` and `db current`
        yield Fleetctl(live, live.token(Role.ADMIN, name="cli-admin"), CliRunner())


def one_line_error(result: Result, *needles: str) -> str:
    """The command failed with exactly one line, on stderr, naming every needle."""
    assert result.exit_code != 0, result.stdout
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, line
    return line


def table_rows(text: str) -> dict[str, list[str]]:
    """A rich table -> {first cell: cells}, header row included."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│")[1:-1]]
        if cells and cells[0]:
            rows[cells[0]] = cells
    return rows


def watts(value: float) -> str:
    """How fleetctl shows watts: the API's one decimal, then no decimals with separators."""
    return f"{round(value, 1):,.0f}"


# ---------------------------------------------------------------------------------------------
# Tables and JSON


@sqlite_only
def test_racks_table_shows_power(fleetctl: Fleetctl) -> None:
    fleetctl.import_demo()
    rows = table_rows(fleetctl.ok("racks").stdout)
    header = rows.pop("rack")
    assert header == [
        "rack",
        "site",
        "status",
        "servers #",
        "budget W",
        "committed W",
        "headroom W",
        "all-on W",
        "mode",
        "drawn W",
        "peak 24h W",
        "p99 7d W",
        "GPU cap",
    ]
    assert sorted(rows) == sorted(r.name for r in DEMO.racks)
    # demo.yaml's own figures: 36,803 W budget, 40.8 kW all on; no BMC read yet, so every
    # server counts at its maximum and the rack shows negative headroom.
    assert rows["fra1-r01"][4:8] == ["36,803", "40,800", "-3,997", "40,800"]
    assert rows["fra1-r01"][8:] == ["nameplate", "-", "-", "-", "-"]
    assert rows["ams1-r04"][4] == "34,776"
    for rack in DEMO.racks:
        draws = [ServerDraw(s.max_w, s.standby_w, draws_max_power(*IMPORTED)) for s in rack.servers]
        power = rack_power(rack.feeds, draws)
        expected = [
            watts(power.budget_w),
            watts(power.committed_w),
            watts(power.headroom_w),
            watts(power.all_on_w),
        ]
        assert rows[rack.name][1:5] == [rack.site, "active", str(len(rack.servers)), expected[0]]
        assert rows[rack.name][5:8] == expected[1:]
    only = table_rows(fleetctl.ok("racks", "--site", "ams1").stdout)
    assert sorted(only) == sorted(["rack", *(r.name for r in DEMO.racks if r.site == "ams1")])


@sqlite_only
def test_json_output(fleetctl: Fleetctl) -> None:
    fleetctl.import_demo()
    racks = fleetctl.json("racks")
    assert [r["name"] for r in racks] == sorted(r.name for r in DEMO.racks)
    assert {"budget_w", "committed_w", "headroom_w"} <= set(racks[0])
    servers = fleetctl.json("servers", "list", "--gpu-model", "L40S", "--pool", "warm")
    expected = sorted(s.name for s in DEMO.servers if s.gpu_model == "L40S" and s.pool == "warm")
    assert [s["name"] for s in servers] == expected
    assert len(fleetctl.json("servers", "list", "--limit", "5")) == 5
    assert len(fleetctl.json("servers", "list")) == len(DEMO.servers)  # all pages
    shown = fleetctl.json("servers", "show", "fra1-r01-h100-01")
    assert shown["rack"] == "fra1-r01" and shown["bmc_password_set"] is True
    assert [s["name"] for s in fleetctl.json("sites")] == sorted(DEMO.sites)
    deployments = fleetctl.json("deployments", "list")
    assert [d["name"] for d in deployments] == sorted(DEMO.deployments)
    assert fleetctl.json("deployments", "show", "llama-8b")["gpus_per_replica"] == 1
    events = fleetctl.json("events", "--kind", "server.enrolled", "--limit", "3")
    assert len(events) == 3 and {e["kind"] for e in events} == {"server.enrolled"}
    table = fleetctl.ok("servers", "list", "--rack", "fra1-r01").stdout
    assert sorted(table_rows(table)) == sorted(
        ["server", *(s.name for s in DEMO.rack("fra1-r01").servers)]
    )


@sqlite_only
def test_transition(fleetctl: Fleetctl) -> None:
    fleetctl.import_demo()
    name = "fra1-r02-h100-01"
    moved = fleetctl.ok("servers", "transition", name, "maintenance", "--reason", "fans")
    assert moved.stdout == f"{name}: enrolled → maintenance\n"
    again = fleetctl.ok("servers", "transition", name, "maintenance", "--reason", "fans")
    assert again.stdout == f"{name} is already maintenance\n"
    released = fleetctl.ok("servers", "transition", name, "enrolled", "--reason", "fixed")
    assert released.stdout == f"{name}: maintenance → enrolled\n"
    events = fleetctl.json("events", "--subject", name)
    assert [(e["kind"], e["to_state"]) for e in events] == [
        ("server.transition", "enrolled"),
        ("server.transition", "maintenance"),
        ("server.enrolled", "enrolled"),
    ]
    assert events[1]["actor"] == "admin:cli-admin" and events[1]["message"] == "fans"
    assert events[0]["message"] == "fixed"
    # Dates without a time or a zone are UTC midnight: every event is after 2020-01-01.
    since = fleetctl.json("events", "--since", "2020-01-01", "--subject", name)
    assert since == events
    table = fleetctl.ok("events", "--since", "2020-01-01", "--subject", name).stdout
    assert table.count("server.transition") == 2 and "server.enrolled" in table


@sqlite_only
@pytest.mark.parametrize("target", ["booting", "serving", "warm"])
def test_transition_to_a_fleet_only_state_is_refused(fleetctl: Fleetctl, target: str) -> None:
    """The lifecycle allows enrolled → booting and → warm, but only the fleet records them."""
    fleetctl.import_demo()
    name = "fra1-r01-h100-01"
    assert ServerState(target) not in OPERATOR_TARGETS
    result = fleetctl("servers", "transition", name, target, "--reason", "by hand")
    line = one_line_error(
        result,
        f"{target} is reached by the fleet itself",
        "operators may move a server to: ",
    )
    assert result.exit_code == 1
    assert all(s.value in line for s in OPERATOR_TARGETS), line
    assert fleetctl.json("servers", "show", name)["state"] == "enrolled"
    assert [e["kind"] for e in fleetctl.json("events", "--subject", name)] == ["server.enrolled"]


# ---------------------------------------------------------------------------------------------
# Errors: one line on stderr, non-zero exit


@sqlite_only
def test_unreachable_service(fleetctl: Fleetctl) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    one_line_error(fleetctl("racks", url=url), "cannot reach", url, "connection refused")
    one_line_error(fleetctl("inventory", "import", DEMO_FILE, url=url), "cannot reach")


@sqlite_only
def test_missing_and_bad_tokens(fleetctl: Fleetctl) -> None:
    result = fleetctl.runner.invoke(
        cli.app, ["racks"], env={"FLEET_URL": fleetctl.live.url, "FLEET_TOKEN": None}
    )
    one_line_error(result, "no token", "--token", "FLEET_TOKEN")
    one_line_error(fleetctl("racks", token="flt_wrong"), "missing or invalid bearer token")
    one_line_error(
        fleetctl("servers", "show", "x", token="flt_wrong"), "missing or invalid bearer token"
    )


@sqlite_only
def test_role_too_low(fleetctl: Fleetctl) -> None:
    fleetctl.import_demo()
    viewer = fleetctl.ok("token", "create", "--role", "viewer", "--name", "ro").stdout.strip()
    assert viewer.startswith("flt_")
    assert "fra1-r01" in fleetctl.ok("racks", token=viewer).stdout  # the new token works
    one_line_error(
        fleetctl(
            "servers",
            "transition",
            "fra1-r01-h100-01",
            "maintenance",
            "--reason",
            "x",
            token=viewer,
        ),
        "a viewer token cannot do this; it needs the operator role",
    )


@sqlite_only
def test_illegal_transition_409(fleetctl: Fleetctl) -> None:
    fleetctl.import_demo()
    allowed = ", ".join(s.value for s in allowed_targets(ServerState.ENROLLED))
    assert allowed.startswith("warm, booting")
    result = fleetctl("servers", "transition", "fra1-r01-h100-01", "draining", "--reason", "x")
    one_line_error(
        result,
        "cannot move from enrolled to draining",
        f"(allowed from enrolled: {allowed})",
    )
    assert result.exit_code == 1
    assert fleetctl.json("servers", "show", "fra1-r01-h100-01")["state"] == "enrolled"
    # Retired is terminal: not even maintenance.
    fleetctl.ok("servers", "transition", "fra1-r01-h100-02", "retired", "--reason", "eol")
    one_line_error(
        fleetctl("servers", "transition", "fra1-r01-h100-02", "maintenance", "--reason", "x"),
        "cannot move from retired to maintenance",
        "(allowed from retired: none (terminal))",
    )
    assert fleetctl.json("servers", "show", "fra1-r01-h100-02")["state"] == "retired"
    one_line_error(
        fleetctl("servers", "transition", "ghost", "maintenance", "--reason", "x"), "ghost"
    )
    one_line_error(
        fleetctl("servers", "transition", "fra1-r01-h100-01", "flying", "--reason", "x"),
        "body.to: must be one of",
    )
    one_line_error(fleetctl("servers", "show", "ghost"), "no server named 'ghost'")


@sqlite_only
def test_inventory_file_errors(fleetctl: Fleetctl, tmp_path: Path) -> None:
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("sites:\n  - name: fra1\n    racks: [unclosed\n  - name: ams1\n")
    for command in ("import", "validate"):
        one_line_error(
            fleetctl("inventory", command, str(not_yaml)), str(not_yaml), "not valid YAML at line"
        )
    line = one_line_error(fleetctl("inventory", "import", str(not_yaml)))
    assert "column" in line
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text(
        "sites:\n  - name: fra1\n    racks:\n      - name: r1\n        u_height: tall\n"
    )
    one_line_error(
        fleetctl("inventory", "import", str(invalid)),
        "sites[0].racks[0].u_height: must be an integer",
    )
    missing = tmp_path / "nope.yaml"
    one_line_error(fleetctl("inventory", "import", str(missing)), "No such file", str(missing))
    one_line_error(fleetctl("inventory", "validate", str(missing)), "No such file")
    assert fleetctl.json("servers", "list") == []  # nothing was imported


# ---------------------------------------------------------------------------------------------
# Inventory round trips


@sqlite_only
def test_dry_run_writes_nothing(fleetctl: Fleetctl) -> None:
    result = fleetctl.ok("inventory", "import", DEMO_FILE, "--dry-run")
    lines = result.stdout.splitlines()
    counts = f"created 2 sites, 8 racks, 34 feeds, {len(DEMO.servers)} servers, 2 deployments"
    assert lines[0] == f"{DEMO_FILE}: would change: {counts}; updated nothing; 0 unchanged"
    assert "  create server fra1-r01-h100-01" in lines
    assert "  create deployment llama-70b" in lines
    assert len(lines) == 1 + 2 + 8 + 34 + len(DEMO.servers) + 2
    warnings = result.stderr.splitlines()
    assert [w.split(":")[0] for w in warnings] == ["warning", "warning"]
    assert "fra1-r01" in result.stderr and "ams1-r02" in result.stderr
    assert fleetctl.json("servers", "list") == []
    assert fleetctl.json("racks") == []
    valid = fleetctl.ok("inventory", "validate", DEMO_FILE)
    assert valid.stdout == f"{DEMO_FILE}: valid; an import would make {len(lines) - 1} changes\n"


def test_import_export_round_trip(fleetctl: Fleetctl, tmp_path: Path) -> None:
    """On both databases: import, re-import (no change), export, import the export (no change)."""
    first = fleetctl.import_demo()
    assert first.stdout.startswith(f"{DEMO_FILE}: changed: created 2 sites, 8 racks")
    again = fleetctl.import_demo()
    unchanged = 2 + 8 + 34 + len(DEMO.servers) + 2
    assert again.stdout == (
        f"{DEMO_FILE}: changed: created nothing; updated nothing; {unchanged} unchanged\n"
    )
    exported = tmp_path / "export.yaml"
    wrote = fleetctl.ok("inventory", "export", "--file", str(exported))
    assert wrote.stderr == f"wrote {exported}\n"
    assert fleetctl.ok("inventory", "export").stdout == exported.read_text()
    assert "password:" not in exported.read_text()
    reimport = fleetctl.ok("inventory", "import", str(exported))
    assert reimport.stdout == (
        f"{exported}: changed: created nothing; updated nothing; {unchanged} unchanged\n"
    )
    dry = fleetctl.ok("inventory", "import", str(exported), "--dry-run")
    assert dry.stdout.splitlines()[1:] == []  # no change lines
    report = fleetctl.json("inventory", "validate", str(exported))
    assert report["changes"] == [] and report["dry_run"] is True
    # Lifecycle state is not inventory: a transition leaves the export as it was.
    fleetctl.ok("servers", "transition", "fra1-r01-h100-01", "maintenance", "--reason", "x")
    assert fleetctl.json("servers", "show", "fra1-r01-h100-01")["state"] == "maintenance"
    assert fleetctl.ok("inventory", "export").stdout == exported.read_text()


# ---------------------------------------------------------------------------------------------
# Deployments, tokens, keys, database


@sqlite_only
def test_deployments_create_with_engine_params(fleetctl: Fleetctl) -> None:
    fleetctl.import_demo()
    created = fleetctl.json(
        "deployments",
        "create",
        "qwen-14b",
        "--model-uri",
        "s3://fleet-models/qwen/Qwen2.5-14B",
        "--checksum",
        "sha256:abcd",
        "--sla-p95-ms",
        "3000",
        "--sla-ttft-ms",
        "400",
        "--gpus-per-replica",
        "2",
        "--gpu-model",
        "H100",
        "--gpu-model",
        "H200",
        "--min",
        "1",
        "--max",
        "6",
        "--engine",
        "backend=pytorch",
        "--engine",
        "max_batch_size=64",
        "--engine",
        "kv_cache_free_gpu_memory_fraction=0.85",
    )
    assert created["engine_params"] == {
        "backend": "pytorch",
        "max_batch_size": 64,
        "kv_cache_free_gpu_memory_fraction": 0.85,
        "tp_size": 2,
        "pp_size": 1,
    }
    assert created["gpu_models"] == ["H100", "H200"]
    assert (created["min_replicas"], created["max_replicas"]) == (1, 6)
    assert fleetctl.json("deployments", "show", "qwen-14b") == created

    base = ["deployments", "create", "d2", "--model-uri", "s3://x", "--checksum", "c"]
    base += ["--sla-p95-ms", "1", "--sla-ttft-ms", "1"]
    one_line_error(fleetctl(*base, "--engine", "novalue"), "--engine 'novalue': expected an engine")
    one_line_error(fleetctl(*base, "--engine", "tp_size=4"), "tp_size × pp_size")
    # An option the engine does not have is refused, named, with the engine.
    one_line_error(
        fleetctl(*base, "--engine", "vllm", "--engine", "max_batch_size=8"),
        "engine_params max_batch_size: vllm serve has no such option",
    )
    one_line_error(
        fleetctl(*base, "--engine", "vllm", "--engine", "sglang"), "the engine is already 'vllm'"
    )
    vllm = fleetctl.json(
        *("deployments", "create", "qwen-vllm", "--model-uri", "s3://x/qwen", "--checksum", "c"),
        *("--sla-p95-ms", "3000", "--sla-ttft-ms", "400", "--gpus-per-replica", "2"),
        *("--engine", "vllm", "--engine", "max_num_seqs=64"),
    )
    assert vllm["engine"] == "vllm"
    assert vllm["engine_params"] == {
        "max_num_seqs": 64,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
    }
    one_line_error(fleetctl(*base, "--min", "3", "--max", "1"), "min_replicas (3) exceeds")
    one_line_error(fleetctl(*base, "--gpu-model", "TPUv5"), "unknown GPU model(s) TPUv5")
    one_line_error(
        fleetctl(*base[:2], "qwen-14b", *base[3:]), "deployment 'qwen-14b' already exists"
    )


@sqlite_only
def test_token_create_errors(fleetctl: Fleetctl) -> None:
    one_line_error(
        fleetctl("token", "create", "--role", "bogus"),
        "--role must be one of admin, operator, viewer, router, agent",
    )
    one_line_error(fleetctl("token", "create", "--role", "agent"), "agent token needs --server")
    one_line_error(
        fleetctl("token", "create", "--role", "agent", "--server", "ghost"), "no server named"
    )
    one_line_error(
        fleetctl("token", "create", "--role", "viewer", "--server", "x"),
        "--server applies only to agent tokens",
    )
    too_long = "n" * (MAX_TOKEN_NAME + 1)
    result = fleetctl("token", "create", "--role", "viewer", "--name", too_long)
    line = one_line_error(result, f"a token name must be 1-{MAX_TOKEN_NAME} characters")
    assert result.exit_code == 1 and too_long not in line
    longest = fleetctl.ok("token", "create", "--role", "viewer", "--name", "n" * MAX_TOKEN_NAME)
    assert longest.stdout.startswith("flt_")
    assert [t["name"] for t in fleetctl.json("token", "list")] == [
        "cli-admin",
        "n" * MAX_TOKEN_NAME,
    ]
    fleetctl.import_demo()
    agent = fleetctl.ok("token", "create", "--role", "agent", "--server", "fra1-r01-h100-01")
    assert agent.stdout.startswith("flt_") and agent.stdout.count("\n") == 1
    one_line_error(fleetctl("racks", token=agent.stdout.strip()), "agent token cannot do this")


@sqlite_only
def test_token_list_and_revoke(fleetctl: Fleetctl) -> None:
    viewer = fleetctl.ok("token", "create", "--role", "viewer", "--name", "ro").stdout.strip()
    fleetctl.ok("racks", token=viewer)
    listed = fleetctl.json("token", "list")
    assert [(t["name"], t["role"], t["revoked_at"]) for t in listed] == [
        ("cli-admin", "admin", None),
        ("ro", "viewer", None),
    ]
    table = fleetctl.ok("token", "list").stdout
    for text in (table, json.dumps(listed)):
        assert "flt_" not in text and "hash" not in text  # never a token, nor its hash
    revoked = fleetctl.ok("token", "revoke", str(listed[1]["id"]))
    assert revoked.stdout == f"revoked token {listed[1]['id']} (viewer ro)\n"
    one_line_error(fleetctl("racks", token=viewer), "missing or invalid bearer token")
    assert fleetctl.json("token", "list")[1]["revoked_at"] is not None
    fleetctl.ok("token", "revoke", str(listed[1]["id"]))  # twice is fine
    one_line_error(fleetctl("token", "revoke", "999"), "no token with id 999")
    fleetctl.ok("racks")  # the admin token still works


@sqlite_only
def test_secret_key(fleetctl: Fleetctl) -> None:
    keys = [fleetctl.ok("secret-key").stdout for _ in range(2)]
    for key in keys:
        assert key.endswith("\n") and key.count("\n") == 1
        Fernet(key.strip().encode())  # a valid key
    assert keys[0] != keys[1]


@sqlite_only
def test_db_current(fleetctl: Fleetctl) -> None:
    head = fleet_db.head_revision()
    assert fleetctl.ok("db", "current").stdout == f"database: {head}  code: {head}\n"
    assert fleetctl.ok("db", "upgrade").stdout == f"database at {head}\n"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["servers", "transition", "gpu-1"], "Missing argument 'to'"),
        (["token", "create"], "Missing option '--role'"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["servers", "list", "--limit", "many"], "Invalid value for '--limit'"),
    ],
)
def test_console_script_usage_errors_are_one_line(args: list[str], expected: str) -> None:
    """The installed `fleetctl` (cli.main), not CliRunner: what an operator's shell sees."""
    fleetctl = Path(sys.executable).parent / "fleetctl"
    result = subprocess.run(
        [str(fleetctl), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and expected in line and "--help" in line


# ---------------------------------------------------------------------------------------------
# Configuration and database failures: one line, never a traceback, never a password

GOOD_KEY = Fernet.generate_key().decode()
DIRECT_COMMANDS = [
    ["db", "upgrade"],
    ["db", "current"],
    ["token", "create", "--role", "admin"],
    ["serve", "--port", "1"],  # never gets as far as listening
]


def console_script(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The installed `fleetctl` with these FLEET_* variables (on top of the test session's)."""
    fleetctl = Path(sys.executable).parent / "fleetctl"
    return subprocess.run(
        [str(fleetctl), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )


def one_line_failure(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, line
    return line


def test_console_script_invalid_secret_key(tmp_path: Path) -> None:
    result = console_script(
        ["serve", "--port", "1"],
        FLEET_DATABASE_URL=f"sqlite:///{tmp_path / 'fleet.db'}",
        FLEET_SECRET_KEY="not-a-fernet-key",
    )
    line = one_line_failure(result, "secret key is not a valid Fernet key")
    assert "not-a-fernet-key" not in line


@pytest.mark.parametrize("args", DIRECT_COMMANDS, ids=" ".join)
def test_console_script_unreachable_database(args: list[str]) -> None:
    url = f"postgresql+psycopg://postgres:secretpw@127.0.0.1:{closed_port()}/fleet"
    result = console_script(args, FLEET_DATABASE_URL=url, FLEET_SECRET_KEY=GOOD_KEY)
    line = one_line_failure(result, "cannot use the database", "Connection refused")
    assert "secretpw" not in result.stderr and "postgresql" not in line


@pytest.mark.parametrize("args", DIRECT_COMMANDS, ids=" ".join)
def test_console_script_unsupported_database_url(args: list[str]) -> None:
    result = console_script(args, FLEET_DATABASE_URL="mysql://u:secretpw@h/db")
    line = one_line_failure(result, "database_url: FLEET_DATABASE_URL must be sqlite:///")
    assert "secretpw" not in result.stderr and "mysql" not in line


def test_console_script_url_sqlalchemy_rejects() -> None:
    result = console_script(
        ["db", "current"],
        FLEET_DATABASE_URL="sqlite://u:secretpw@h/db",
        FLEET_SECRET_KEY=GOOD_KEY,
    )
    one_line_failure(result, "cannot use the database: Invalid SQLite URL")
    assert "secretpw" not in result.stderr


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    """fleet's settings are cached: read them again from the environment, in and out."""
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.usefixtures("fresh_settings")
def test_invalid_settings_are_one_line() -> None:
    runner = CliRunner()
    result = runner.invoke(cli.app, ["db", "current"], env={"FLEET_LISTEN_PORT": "eighty"})
    line = one_line_error(result, "listen_port: must be an integer")
    assert "eighty" not in line
    get_settings.cache_clear()
    result = runner.invoke(
        cli.app, ["db", "current"], env={"FLEET_DATABASE_URL": "mysql://u:secretpw@h/db"}
    )
    assert one_line_error(result) == (
        "error: database_url: FLEET_DATABASE_URL must be sqlite:///PATH or "
        "postgresql+psycopg://USER@HOST/DB"
    )


@pytest.mark.usefixtures("fresh_settings")
@pytest.mark.parametrize(
    "driver_message",
    [
        'connection to "postgresql://u:secretpw@db.example/fleet" failed\nDETAIL: more',
        "invalid dsn: host=db.example password=secretpw user=u",
        "server said: secretpw is not a valid password",
    ],
)
def test_database_errors_never_show_the_password(
    driver_message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever the driver puts in its message, the URL's password does not reach stderr."""
    monkeypatch.setenv("FLEET_DATABASE_URL", "postgresql+psycopg://u:secretpw@db.example/fleet")

    @handled
    def command() -> None:
        raise sa_exc.OperationalError("SELECT 1", None, Exception(driver_message))

    with pytest.raises(typer.Exit) as exited:
        command()
    assert exited.value.exit_code == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: cannot use the database: ")
    assert "secretpw" not in line and "DETAIL" not in line


@pytest.mark.usefixtures("fresh_settings")
def test_value_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    @handled
    def command() -> None:
        raise ValueError("the secret key is not a valid Fernet key\nsecond line")

    with pytest.raises(typer.Exit):
        command()
    assert capsys.readouterr().err == "error: the secret key is not a valid Fernet key\n"


def test_simulate_takes_a_bundled_scenario_by_name_and_refuses_an_unknown_one() -> None:
    """`fleetctl simulate racks-faults` finds the scenario in the package (an installed wheel has
    no scenarios/ beside it); a name that is neither a file nor bundled is one line, exit 1."""
    assert {"racks-faults", "mixed-code"} <= set(bundled_scenarios())
    assert scenario_path("racks-faults") == SCENARIOS_DIR / "racks-faults.yaml"
    assert scenario_path("racks-faults").is_file()
    assert scenario_path("my/racks.yaml") == Path("my/racks.yaml")  # a path stays a path
    result = CliRunner().invoke(cli.app, ["simulate", "no-such-scenario"])
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("error: no scenario 'no-such-scenario': ") and "racks-faults" in line


@sqlite_only
def test_servers_gpus_shows_each_gpus_readings(fleetctl: Fleetctl, live: Live) -> None:
    fleetctl.import_demo()
    name = "fra1-r01-h100-01"
    agent = live.client(live.token(Role.AGENT, name="cli-agent", server=name))
    gpus: list[dict[str, Any]] = [
        {"index": i, "health": "healthy", "temperature_c": 50.0 + i, "power_w": 600.0}
        for i in range(8)
    ]
    gpus[3] |= {
        "health": "unhealthy",
        "ecc_uncorrected_volatile": 4,
        "remapped_rows_correctable": 1,
        "remapped_rows_uncorrectable": 2,
        "remap_pending": True,
        "xids": [48, 94],
    }
    body = {"server": name, "verdict": "unhealthy", "action": "reboot", "gpus": gpus}
    assert agent.post("/api/v1/agent/heartbeat", json=body).status_code == 200
    rows = table_rows(fleetctl.ok("servers", "gpus", name).stdout)
    assert rows["3"][1:4] == ["H100", "unhealthy", "53"]
    assert rows["3"][7:] == ["4", "1 corr., 2 uncorr., pending", "48, 94"]
    assert rows["0"][2:5] == ["healthy", "50", "600"] and rows["0"][7:] == ["-", "-", "-"]
    shown = fleetctl.json("servers", "gpus", name)
    assert shown[3]["reading"]["xids"] == [48, 94] and len(shown) == 8
    one_line_error(fleetctl("servers", "gpus", "nope"), "no server named 'nope'")
