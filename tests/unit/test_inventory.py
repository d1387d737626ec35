"""Inventory files end to end: parse → plan → apply on both databases.

The demo colo (fleet/data/inventory/demo.yaml) is the big valid file; the rejection cases break one
thing
at a time and check that the error names its exact place, never echoes a BMC password, and
leaves every row of every table (and, on Postgres, every sequence) as it was.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from factories import event_count
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from fleet.crypto import SecretBox
from fleet.data import DEMO_INVENTORY
from fleet.db import session_scope
from fleet.errors import RulesBroken, ValidationFailed
from fleet.inventory import (
    ImportReport,
    InventoryFile,
    dump_yaml,
    export_inventory,
    import_inventory,
    parse_inventory,
)
from fleet.inventory.gpu_models import BUILTIN
from fleet.lifecycle.states import PowerState, ServerState
from fleet.models import (
    Deployment,
    Event,
    Gpu,
    GpuModelSpec,
    PowerFeed,
    Rack,
    Server,
    Site,
)

Doc = dict[str, Any]

DEMO_PATH = DEMO_INVENTORY
DEMO_TEXT = DEMO_PATH.read_text()
DEMO_DOC: Doc = yaml.safe_load(DEMO_TEXT)
DEMO_PASSWORD = "demo-bmc-password"
# The passwords of the small fleet below: distinctive enough that any echo is caught.
SECRET = "Tr0ub4dor&3-never-echo"
NEW_SECRET = "correct-horse-battery-staple-42"
ACTOR = "tests:inventory"

DEMO_GPUS = sum(
    v["gpu"]["count"] for s in DEMO_DOC["sites"] for r in s["racks"] for v in r["servers"]
)
DEMO_FEEDS = sum(len(r["feeds"]) for s in DEMO_DOC["sites"] for r in s["racks"])
# Rows the demo creates, one per site, rack, feed, server and deployment.
DEMO_ROWS = 2 + 8 + DEMO_FEEDS + 56 + 2

# fra1-r01: four DGX H100 at 10,200 W max on two 415 V 32 A three-phase feeds per side.
FEED_415_32_W = 415 * 32 * math.sqrt(3) * 0.8
SIDE_415_32_W = 2 * FEED_415_32_W
DGX_MAX_W = 10_200


# ---------------------------------------------------------------------------------------------
# Helpers


# libyaml's dumper when present: five times faster on a file the size of the demo.
_BASE_DUMPER: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _NoAliasDumper(_BASE_DUMPER):  # type: ignore[misc]
    """Never writes anchors/aliases (the parser refuses them): repeated objects are written out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class Prefix(str):
    """An expected error that only has to start with this text (YAML problem wording differs
    between libyaml and the pure-Python parser; the place does not)."""

    __slots__ = ()


def matches(errors: list[str], expected: list[str]) -> bool:
    return len(errors) == len(expected) and all(
        e.startswith(x) if isinstance(x, Prefix) else e == x
        for e, x in zip(errors, expected, strict=True)
    )


def to_yaml(doc: Doc) -> str:
    text: str = yaml.dump(doc, Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)
    return text


_DEMO_PARSED: list[InventoryFile] = []


def demo_inventory() -> InventoryFile:
    """demo.yaml through parse_inventory, parsed once (InventoryFile is frozen)."""
    if not _DEMO_PARSED:
        _DEMO_PARSED.append(parse_inventory(DEMO_TEXT))
    return _DEMO_PARSED[0]


def demo() -> Doc:
    """A private copy of the demo inventory, as parsed YAML."""
    return copy.deepcopy(DEMO_DOC)


def demo_servers(doc: Doc) -> list[Doc]:
    return [srv for site in doc["sites"] for rack in site["racks"] for srv in rack["servers"]]


def last_server_place(doc: Doc) -> tuple[int, int, int]:
    """(site, rack, server) indexes of the last server in the file."""
    assert "servers" not in doc, "demo.yaml lists every server under its rack"
    si = len(doc["sites"]) - 1
    ri = len(doc["sites"][si]["racks"]) - 1
    vi = len(doc["sites"][si]["racks"][ri]["servers"]) - 1
    return si, ri, vi


def find_server(doc: Doc, name: str) -> Doc:
    return next(srv for srv in demo_servers(doc) if srv["name"] == name)


def find_rack(doc: Doc, name: str) -> Doc:
    return next(r for site in doc["sites"] for r in site["racks"] if r["name"] == name)


def server_entry(
    name: str,
    u: int,
    *,
    u_height: int = 8,
    serial: str | None = None,
    protocol: str = "redfish",
    port: int = 8000,
    system_id: str | None = None,
    gpu: str = "H100",
    count: int = 8,
    power: tuple[float, float, float] = (1900, 90, 10_200),
    password: str | None = SECRET,
) -> Doc:
    bmc: Doc = {"protocol": protocol, "address": "127.0.0.1", "port": port, "username": "admin"}
    if system_id is not None:
        bmc["system_id"] = system_id
    if password is not None:
        bmc["password"] = password
    entry: Doc = {"name": name}
    if serial is not None:
        entry["serial"] = serial
    idle, standby, max_w = power
    entry.update(
        {
            "u": u,
            "u_height": u_height,
            "bmc": bmc,
            "gpu": {"model": gpu, "count": count},
            "power": {"idle_w": idle, "standby_w": standby, "max_w": max_w},
        }
    )
    return entry


def feeds(amps: float = 40) -> list[Doc]:
    return [
        {"name": "a1", "side": "A", "volts": 415, "amps": amps, "phase": "three"},
        {"name": "b1", "side": "B", "volts": 415, "amps": amps, "phase": "three"},
    ]


def small() -> Doc:
    """One site, two racks, three servers, one deployment; no warnings."""
    return {
        "sites": [
            {
                "name": "lab",
                "racks": [
                    {
                        "name": "r1",
                        "feeds": feeds(),
                        "servers": [
                            server_entry("s1", 1, serial="SN-1", system_id="sys-1"),
                            server_entry("s2", 9, serial="SN-2", system_id="sys-2"),
                        ],
                    },
                    {
                        "name": "r2",
                        "feeds": feeds(),
                        "servers": [
                            server_entry(
                                "s3",
                                1,
                                u_height=2,
                                serial="SN-3",
                                protocol="ipmi",
                                port=9001,
                                gpu="L40S",
                                count=4,
                                power=(600, 30, 2400),
                            )
                        ],
                    },
                ],
            }
        ],
        "deployments": [deployment_entry("llama-8b")],
    }


def deployment_entry(name: str, *, gpu_models: list[str] | None = None) -> Doc:
    return {
        "name": name,
        "model": {"uri": f"s3://models/{name}", "checksum": "sha256:00"},
        "engine": {"backend": "pytorch", "tp_size": 1, "pp_size": 1},
        "gpus_per_replica": 1,
        "gpu_models": ["H100", "L40S"] if gpu_models is None else gpu_models,
        "replicas": {"min": 1, "max": 4},
        "sla": {"p95_latency_ms": 4000, "ttft_ms": 500},
    }


def run_import(
    engine: Engine, box: SecretBox, source: Doc | str, *, dry_run: bool = False
) -> ImportReport:
    """Parse and import in one real transaction (committed, or rolled back on error)."""
    with session_scope(engine) as session:
        if source is DEMO_TEXT:
            inv = demo_inventory()
        else:
            inv = parse_inventory(source if isinstance(source, str) else to_yaml(source))
        return import_inventory(session, inv, box, ACTOR, dry_run=dry_run)


_REFLECTED: dict[str, sa.MetaData] = {}


def _tables(engine: Engine) -> list[sa.Table]:
    """Every table the database has (reflected, so migration-only tables count too)."""
    key = engine.url.render_as_string(hide_password=False)
    if key not in _REFLECTED:
        meta = sa.MetaData()
        with warnings.catch_warnings():  # SQLite cannot reflect the expression index: expected
            warnings.filterwarnings("ignore", message=".*expression-based index.*")
            meta.reflect(engine)
        _REFLECTED[key] = meta
    return list(_REFLECTED[key].sorted_tables)


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, in primary-key order."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        for table in _tables(engine):
            order = list(table.primary_key.columns) or list(table.columns)
            out[table.name] = [
                tuple(row) for row in conn.execute(sa.select(table).order_by(*order))
            ]
    return out


def counts(snap: dict[str, list[tuple[Any, ...]]]) -> dict[str, int]:
    return {name: len(rows) for name, rows in snap.items()}


def assert_rejected(
    engine: Engine,
    box: SecretBox,
    source: Doc | str,
    expected: list[str],
    secrets: tuple[str, ...] = (SECRET, DEMO_PASSWORD),
) -> ValidationFailed:
    """The import (and its dry run) fail with exactly `expected`, echo no secret, write nothing."""
    before = snapshot(engine)
    with pytest.raises(ValidationFailed) as info:
        run_import(engine, box, source)
    with pytest.raises(ValidationFailed) as dry:
        run_import(engine, box, source, dry_run=True)
    exc = info.value
    assert matches(exc.errors, expected), exc.errors
    assert dry.value.errors == exc.errors
    texts = [str(exc), repr(exc), *exc.errors]
    for secret in secrets:
        assert not [t for t in texts if secret in t], f"a password leaked into {texts}"
    after = snapshot(engine)
    assert counts(after) == counts(before)
    assert after == before
    return exc


def count(session: Session, model: type[Any]) -> int:
    return session.exec(select(func.count()).select_from(model)).one()


def server(session: Session, name: str) -> Server:
    return session.exec(
        select(Server).where(Server.name == name).execution_options(populate_existing=True)
    ).one()


def gpu_indexes(session: Session, srv: Server) -> list[int]:
    rows = session.exec(
        select(Gpu).where(Gpu.server_id == srv.id).execution_options(populate_existing=True)
    )
    return sorted(g.index for g in rows)


def change_set(report: ImportReport) -> set[tuple[str, str, str, frozenset[str]]]:
    return {(c.action, c.kind, c.name, frozenset(c.fields)) for c in report.changes}


def oversubscribed(rack: str, servers: int, side_w: float, need_w: float) -> str:
    return (
        f"rack {rack}: {servers} servers at max draw need {need_w:,.0f} W, "
        f"budget {side_w:,.0f} W (A {side_w:,.0f} W, B {side_w:,.0f} W): "
        f"oversubscribed by {need_w - side_w:,.0f} W"
    )


@pytest.fixture
def box(secret_key: bytes) -> SecretBox:
    return SecretBox(secret_key)


@pytest.fixture
def demo_fleet(db: Engine, box: SecretBox) -> Engine:
    """The demo colo, imported."""
    run_import(db, box, DEMO_TEXT)
    return db


@pytest.fixture
def small_fleet(db: Engine, box: SecretBox) -> Engine:
    run_import(db, box, small())
    return db


# ---------------------------------------------------------------------------------------------
# Parsing alone (no database)


def test_demo_parses_into_the_layout_its_header_describes() -> None:
    inv = parse_inventory(DEMO_TEXT)
    assert [s.name for s in inv.sites] == ["fra1", "ams1"]
    assert sum(len(s.racks) for s in inv.sites) == 8
    servers = [v for s in inv.sites for r in s.racks for v in r.servers]
    assert len(servers) == 56
    assert sum(v.pool == "warm" for v in servers) == 14
    assert [d.name for d in inv.deployments] == ["llama-8b", "llama-70b"]
    assert all(v.bmc.password is not None for v in servers)
    # SecretStr: the parsed model never shows the password.
    assert DEMO_PASSWORD not in repr(inv)


def test_empty_file_is_an_empty_inventory() -> None:
    assert parse_inventory("") == InventoryFile()
    assert parse_inventory("# nothing yet\n") == InventoryFile()


def test_every_problem_is_listed_not_only_the_first() -> None:
    doc = small()
    srv = doc["sites"][0]["racks"][0]["servers"][0]
    srv["bmc"]["port"] = 0
    srv["u"] = "one"
    doc["sites"][0]["racks"][1]["feeds"][0]["side"] = "C"
    with pytest.raises(ValidationFailed) as info:
        parse_inventory(to_yaml(doc))
    assert info.value.errors == [
        "sites[0].racks[0].servers[0].u: must be an integer",
        "sites[0].racks[0].servers[0].bmc.port: must be 1-65535",
        "sites[0].racks[1].feeds[0].side: must be one of 'A' or 'B'",
    ]
    assert str(info.value).endswith("(and 2 more)")


@pytest.mark.parametrize(
    "sigil",
    [
        pytest.param(
            "*",
            id="alias",
        ),
        pytest.param(
            "!",
            id="tag",
        ),
    ],
)
def test_yaml_errors_never_quote_an_unquoted_password(sigil: str) -> None:
    secret = "hunter2-Zq9"
    doc = small()
    doc["sites"][0]["racks"][0]["servers"][0]["bmc"]["password"] = "PLACEHOLDER"
    text = to_yaml(doc).replace("PLACEHOLDER", sigil + secret)
    with pytest.raises(ValidationFailed) as info:
        parse_inventory(text)
    assert secret not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Importing the demo colo


def test_demo_import_creates_the_colo(demo_fleet: Engine, session: Session) -> None:
    servers = demo_servers(DEMO_DOC)
    assert count(session, Site) == 2
    assert count(session, Rack) == 8
    assert count(session, Server) == 56
    assert count(session, PowerFeed) == DEMO_FEEDS
    assert count(session, Deployment) == 2
    assert count(session, GpuModelSpec) == 0
    assert count(session, Gpu) == sum(srv["gpu"]["count"] for srv in servers) == DEMO_GPUS
    kinds = session.exec(select(Event.kind, func.count()).group_by(Event.kind)).all()
    assert dict(kinds) == {"server.enrolled": 56, "inventory.imported": 1}
    enrolled = session.exec(select(Event.subject).where(Event.kind == "server.enrolled")).all()
    assert sorted(enrolled) == sorted(srv["name"] for srv in servers)
    # GPU memory left out of the file comes from the built-in specs.
    h200 = server(session, "fra1-r03-h200-01")
    assert h200.gpu_memory_mib == BUILTIN["H200"].memory_mib
    assert {g.memory_mib for g in session.exec(select(Gpu).where(Gpu.server_id == h200.id))} == {
        BUILTIN["H200"].memory_mib
    }
    # Stored passwords are ciphertext.
    assert all(DEMO_PASSWORD not in s.bmc_password_encrypted for s in session.exec(select(Server)))


def test_new_servers_are_enrolled_with_the_models_defaults(
    demo_fleet: Engine, session: Session
) -> None:
    """They go in as plain rows (lifecycle.enroll_many), not ORM objects: the table's defaults
    must still be the model's."""
    rows = session.exec(select(Server)).all()
    assert {s.state for s in rows} == {ServerState.ENROLLED}
    assert {s.power_state for s in rows} == {PowerState.UNKNOWN}
    for s in rows:
        assert (s.health_reasons, s.replicas, s.cache_entries) == ([], [], [])
        assert (s.bmc_failures, s.reboot_count, s.agent_draining) == (0, 0, False)
        assert s.state_changed_at is not None and s.created_at is not None


@pytest.mark.parametrize("was_on", [True, False], ids=["collector-on", "collector-off"])
@pytest.mark.parametrize("accepted", [True, False], ids=["accepted", "rejected"])
def test_an_import_leaves_the_cycle_collector_as_it_found_it(
    db: Engine, box: SecretBox, was_on: bool, accepted: bool
) -> None:
    """Imports pause Python's cycle collector (fleet/inventory/apply.py): never for longer."""
    doc = small()
    if not accepted:
        doc["sites"][0]["racks"][0]["servers"][0]["gpu"]["model"] = "no-such-gpu"
    before = gc.isenabled()
    (gc.enable if was_on else gc.disable)()
    try:
        if accepted:
            run_import(db, box, doc)
        else:
            with pytest.raises(RulesBroken):
                run_import(db, box, doc)
        assert gc.isenabled() is was_on
    finally:
        (gc.enable if before else gc.disable)()


def test_demo_import_report(db: Engine, box: SecretBox) -> None:
    report = run_import(db, box, DEMO_TEXT)
    assert not report.dry_run
    assert report.created == {
        "gpu_model": 0,
        "model_version": 0,
        "site": 2,
        "rack": 8,
        "feed": DEMO_FEEDS,
        "server": 56,
        "deployment": 2,
    }
    assert sum(report.updated.values()) == 0
    assert sum(report.unchanged.values()) == 0
    assert len(report.changes) == DEMO_ROWS
    assert all(c.action == "create" for c in report.changes)


def test_demo_warns_about_exactly_the_two_oversubscribed_racks(db: Engine, box: SecretBox) -> None:
    report = run_import(db, box, DEMO_TEXT)
    need = 4 * DGX_MAX_W
    assert report.warnings == [
        oversubscribed("ams1-r02", 4, SIDE_415_32_W, need),
        oversubscribed("fra1-r01", 4, SIDE_415_32_W, need),
    ]
    # The numbers the demo header promises: 40.8 kW at max draw on a 36.8 kW budget.
    assert report.warnings[1] == (
        "rack fra1-r01: 4 servers at max draw need 40,800 W, budget 36,803 W "
        "(A 36,803 W, B 36,803 W): oversubscribed by 3,997 W"
    )


def test_warning_counts_servers_already_in_the_rack(demo_fleet: Engine, box: SecretBox) -> None:
    # fra1-r02 carries 4 × 10,200 W on 2 × 23,001 W per side: a fifth DGX tips it over.
    extra = server_entry("fra1-r02-h100-05", 33, system_id="5e7f1ee7-extra")
    extra["rack"] = "fra1-r02"
    report = run_import(demo_fleet, box, {"servers": [extra]})
    side_w = 2 * 415 * 40 * math.sqrt(3) * 0.8
    assert report.warnings == [oversubscribed("fra1-r02", 5, side_w, 5 * DGX_MAX_W)]


def test_reimport_changes_nothing(demo_fleet: Engine, box: SecretBox, session: Session) -> None:
    before = snapshot(demo_fleet)
    report = run_import(demo_fleet, box, DEMO_TEXT)
    assert report.changes == []
    assert not report.changed
    assert sum(report.created.values()) == sum(report.updated.values()) == 0
    assert sum(report.unchanged.values()) == DEMO_ROWS
    assert event_count(session) == 57
    assert snapshot(demo_fleet) == before


@pytest.mark.parametrize("fleet", ["empty", "demo"])
def test_dry_run_reports_the_real_changes_and_writes_nothing(
    fleet: str, db: Engine, box: SecretBox
) -> None:
    if fleet == "demo":
        run_import(db, box, DEMO_TEXT)
    doc = demo()
    find_server(doc, "fra1-r01-h100-02")["pool"] = "baseline"
    find_rack(doc, "fra1-r01")["feeds"][0]["amps"] = 40
    before = snapshot(db)
    dry = run_import(db, box, doc, dry_run=True)
    assert dry.dry_run
    assert dry.changes
    assert snapshot(db) == before
    real = run_import(db, box, doc)
    assert not real.dry_run
    assert real.model_dump(exclude={"dry_run"}) == dry.model_dump(exclude={"dry_run"})
    assert snapshot(db) != before


def test_export_reimports_with_zero_changes(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    exported = dump_yaml(export_inventory(session))
    assert DEMO_PASSWORD not in exported
    assert "password" not in exported.split("\n", 1)[1]  # only the header mentions passwords
    inv = parse_inventory(exported)
    assert sum(len(r.servers) for s in inv.sites for r in s.racks) == 56
    before = snapshot(demo_fleet)
    report = run_import(demo_fleet, box, exported)
    assert report.changes == []
    assert report.warnings == run_import(demo_fleet, box, DEMO_TEXT, dry_run=True).warnings
    assert snapshot(demo_fleet) == before
    with Session(demo_fleet) as fresh:
        assert dump_yaml(export_inventory(fresh)) == exported


def test_export_of_a_fleet_cannot_create_servers_elsewhere(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    """Exports carry no password, so importing one into an empty fleet is refused, by place."""
    exported = dump_yaml(export_inventory(session))
    session.close()
    with session_scope(demo_fleet) as s:
        if demo_fleet.dialect.name == "postgresql":
            # Events are append-only on Postgres unless the transaction says it is maintenance.
            s.execute(sa.text("SET LOCAL fleet.event_maintenance = 'on'"))
        for table in reversed(_tables(demo_fleet)):
            if table.name != "alembic_version":
                s.execute(sa.delete(table))
    with pytest.raises(ValidationFailed) as info:
        run_import(demo_fleet, box, exported)
    assert len(info.value.errors) == 56
    assert (
        info.value.errors[0]
        == "sites[0].racks[0].servers[0].bmc.password: required for a new server"
    )


# ---------------------------------------------------------------------------------------------
# Updates


def test_reimport_applies_updates_of_each_kind(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    doc = demo()
    find_server(doc, "fra1-r01-h100-02")["pool"] = "baseline"
    find_rack(doc, "fra1-r01")["feeds"][0]["amps"] = 40
    doc["deployments"][1]["replicas"]["max"] = 32
    find_server(doc, "ams1-r03-l40s-01")["gpu"]["count"] = 2
    events_before = event_count(session)

    report = run_import(demo_fleet, box, doc)

    assert change_set(report) == {
        ("update", "server", "fra1-r01-h100-02", frozenset({"pool"})),
        ("update", "feed", "fra1-r01/a1", frozenset({"amps"})),
        ("update", "deployment", "llama-70b", frozenset({"max_replicas"})),
        ("update", "server", "ams1-r03-l40s-01", frozenset({"gpu_count"})),
    }
    assert report.updated == {
        "gpu_model": 0,
        "model_version": 0,
        "site": 0,
        "rack": 0,
        "feed": 1,
        "server": 2,
        "deployment": 1,
    }
    assert sum(report.created.values()) == 0
    assert server(session, "fra1-r01-h100-02").pool == "baseline"
    rack = session.exec(select(Rack).where(Rack.name == "fra1-r01")).one()
    feed = session.exec(
        select(PowerFeed).where(PowerFeed.rack_id == rack.id, PowerFeed.name == "a1")
    ).one()
    assert feed.amps == 40
    dep = session.exec(select(Deployment).where(Deployment.name == "llama-70b")).one()
    assert (dep.min_replicas, dep.max_replicas) == (2, 32)
    l40s = server(session, "ams1-r03-l40s-01")
    assert l40s.gpu_count == 2
    assert gpu_indexes(session, l40s) == [0, 1]
    assert count(session, Gpu) == DEMO_GPUS - 2
    # One server.updated per server, naming its fields, plus one inventory.imported.
    new_events = session.exec(select(Event).where(col(Event.id) > events_before)).all()
    assert sorted((e.kind, e.subject, tuple(e.details.get("fields", []))) for e in new_events) == [
        ("inventory.imported", "inventory", ()),
        ("server.updated", "ams1-r03-l40s-01", ("gpu_count",)),
        ("server.updated", "fra1-r01-h100-02", ("pool",)),
    ]
    # ... and the updated file is now the fleet: a second import changes nothing.
    assert run_import(demo_fleet, box, doc).changes == []


def test_gpu_rows_follow_the_gpu_count_down_and_up(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    doc = demo()
    for wanted in (3, 6, 0, 8):
        find_server(doc, "fra1-r02-h100-01")["gpu"]["count"] = wanted
        run_import(demo_fleet, box, doc)
        srv = server(session, "fra1-r02-h100-01")
        assert srv.gpu_count == wanted
        assert gpu_indexes(session, srv) == list(range(wanted))
        assert count(session, Gpu) == DEMO_GPUS - 8 + wanted


def test_gpu_rows_follow_a_model_change(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    doc = demo()
    find_server(doc, "fra1-r02-h100-01")["gpu"]["model"] = "H200"
    report = run_import(demo_fleet, box, doc)
    assert change_set(report) == {
        ("update", "server", "fra1-r02-h100-01", frozenset({"gpu_model", "gpu_memory_mib"}))
    }
    srv = server(session, "fra1-r02-h100-01")
    rows = session.exec(
        select(Gpu).where(Gpu.server_id == srv.id).execution_options(populate_existing=True)
    ).all()
    assert {(g.model, g.memory_mib) for g in rows} == {("H200", BUILTIN["H200"].memory_mib)}
    assert len(rows) == 8


def test_changed_password_is_detected_and_reencrypted(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    name = "fra1-r01-h100-01"
    old_cipher = server(session, name).bmc_password_encrypted
    assert box.decrypt(old_cipher) == DEMO_PASSWORD

    # The same password again is no change (Fernet ciphertexts differ, the plaintext does not).
    assert run_import(demo_fleet, box, DEMO_TEXT).changes == []
    assert server(session, name).bmc_password_encrypted == old_cipher

    doc = demo()
    find_server(doc, name)["bmc"]["password"] = NEW_SECRET
    dry = run_import(demo_fleet, box, doc, dry_run=True)
    assert server(session, name).bmc_password_encrypted == old_cipher
    report = run_import(demo_fleet, box, doc)
    assert (
        change_set(report)
        == change_set(dry)
        == {("update", "server", name, frozenset({"bmc_password"}))}
    )
    assert NEW_SECRET not in report.model_dump_json()
    new_cipher = server(session, name).bmc_password_encrypted
    assert new_cipher != old_cipher
    assert NEW_SECRET not in new_cipher
    assert box.decrypt(new_cipher) == NEW_SECRET
    event = session.exec(select(Event).where(Event.kind == "server.updated")).one()
    assert event.details == {"fields": ["bmc_password"]}
    assert NEW_SECRET not in f"{event.message} {event.details}"


def test_omitted_password_keeps_the_stored_one(
    demo_fleet: Engine, box: SecretBox, session: Session
) -> None:
    ciphers = {s.name: s.bmc_password_encrypted for s in session.exec(select(Server))}
    doc = demo()
    for srv in demo_servers(doc):
        del srv["bmc"]["password"]
    report = run_import(demo_fleet, box, doc)
    assert report.changes == []
    session.expire_all()
    assert {s.name: s.bmc_password_encrypted for s in session.exec(select(Server))} == ciphers


def test_server_moves_to_another_rack(demo_fleet: Engine, box: SecretBox, session: Session) -> None:
    doc = demo()
    src, dst = find_rack(doc, "ams1-r04"), find_rack(doc, "ams1-r03")
    moved = src["servers"].pop()
    assert moved["name"] == "ams1-r04-l40s-12"
    moved["u"] = 25  # ams1-r03 fills U1-U24
    dst["servers"].append(moved)
    old = server(session, "ams1-r04-l40s-12")
    report = run_import(demo_fleet, box, doc)
    assert change_set(report) == {
        ("update", "server", "ams1-r04-l40s-12", frozenset({"rack", "u_position"}))
    }
    new_rack = session.exec(select(Rack).where(Rack.name == "ams1-r03")).one()
    moved_row = server(session, "ams1-r04-l40s-12")
    assert (moved_row.id, moved_row.rack_id, moved_row.u_position) == (old.id, new_rack.id, 25)
    assert gpu_indexes(session, moved_row) == [0, 1, 2, 3]
    assert count(session, Server) == 56


def test_two_servers_swap_places(demo_fleet: Engine, box: SecretBox, session: Session) -> None:
    """Occupancy is checked against where servers will be, not where they are."""
    doc = demo()
    a, b = find_server(doc, "fra1-r01-h100-01"), find_server(doc, "fra1-r01-h100-02")
    a["u"], b["u"] = b["u"], a["u"]
    report = run_import(demo_fleet, box, doc)
    assert change_set(report) == {
        ("update", "server", "fra1-r01-h100-01", frozenset({"u_position"})),
        ("update", "server", "fra1-r01-h100-02", frozenset({"u_position"})),
    }
    assert server(session, "fra1-r01-h100-01").u_position == 9
    assert server(session, "fra1-r01-h100-02").u_position == 1


def test_top_level_server_joins_a_rack_of_the_fleet(
    small_fleet: Engine, box: SecretBox, session: Session
) -> None:
    entry = server_entry("s4", 17, serial="SN-4", system_id="sys-4")
    entry["rack"] = "r1"
    report = run_import(small_fleet, box, {"servers": [entry]})
    assert change_set(report) == {("create", "server", "s4", frozenset())}
    srv = server(session, "s4")
    assert box.decrypt(srv.bmc_password_encrypted) == SECRET
    assert gpu_indexes(session, srv) == list(range(8))
    assert count(session, Server) == 4


def test_custom_gpu_model_is_accepted_once_defined(
    small_fleet: Engine, box: SecretBox, session: Session
) -> None:
    doc = small()
    doc["sites"][0]["racks"][0]["servers"][1]["gpu"]["model"] = "B200"
    with pytest.raises(ValidationFailed):
        run_import(small_fleet, box, doc)
    doc["gpu_models"] = [{"name": "B200", "memory_mib": 183_359, "tdp_w": 1000, "idle_w": 90}]
    report = run_import(small_fleet, box, doc)
    assert change_set(report) == {
        ("create", "gpu_model", "B200", frozenset()),
        ("update", "server", "s2", frozenset({"gpu_model", "gpu_memory_mib"})),
    }
    srv = server(session, "s2")
    assert (srv.gpu_model, srv.gpu_memory_mib) == ("B200", 183_359)
    assert {g.model for g in session.exec(select(Gpu).where(Gpu.server_id == srv.id))} == {"B200"}
    # Once in the fleet, the model is known to later files too, and exports round-trip.
    doc2 = small()
    doc2["sites"][0]["racks"][0]["servers"][1]["gpu"]["model"] = "B200"
    assert run_import(small_fleet, box, doc2).changes == []
    exported = dump_yaml(export_inventory(session))
    assert "B200" in exported
    assert run_import(small_fleet, box, exported).changes == []


# ---------------------------------------------------------------------------------------------
# Rejections: a malformed demo file whose bad row is the LAST one


def _last_row_wrong_type(doc: Doc) -> list[str]:
    si, ri, vi = last_server_place(doc)
    doc["sites"][si]["racks"][ri]["servers"][vi]["gpu"]["count"] = "eight"
    return [f"sites[{si}].racks[{ri}].servers[{vi}].gpu.count: must be an integer"]


def _last_row_duplicate_u(doc: Doc) -> list[str]:
    si, ri, vi = last_server_place(doc)
    rack = doc["sites"][si]["racks"][ri]
    prev, last = rack["servers"][vi - 1], rack["servers"][vi]
    prev_hi = prev["u"] + prev["u_height"] - 1
    last["u"] = prev_hi  # one U shared with the server above it
    hi = last["u"] + last["u_height"] - 1
    return [
        f"sites[{si}].racks[{ri}].servers[{vi}].u: U{prev_hi}-U{hi} in rack {rack['name']!r} "
        f"overlaps sites[{si}].racks[{ri}].servers[{vi - 1}] ({prev['name']!r}) "
        f"(U{prev['u']}-U{prev_hi})"
    ]


def _last_row_unknown_rack(doc: Doc) -> list[str]:
    si, ri, _ = last_server_place(doc)
    last = doc["sites"][si]["racks"][ri]["servers"].pop()
    doc["servers"] = [{**last, "rack": "nope"}]
    return ["servers[0].rack: unknown rack 'nope' (not in this file or the fleet)"]


def _last_row_not_yaml() -> tuple[str, list[str]]:
    """The demo text, with the last password line broken: `password: …: oops`."""
    lines = DEMO_TEXT.splitlines(keepends=True)
    index = max(i for i, line in enumerate(lines) if line.strip() == f"password: {DEMO_PASSWORD}")
    lines[index] = lines[index].rstrip("\n") + ": oops\n"
    column = lines[index].index(": oops") + 1
    text = "".join(lines)
    return text, [Prefix(f"not valid YAML at line {index + 1}, column {column}: mapping values")]


LAST_ROW_CASES: dict[str, Callable[[Doc], list[str]]] = {
    "wrong-type": _last_row_wrong_type,
    "duplicate-u": _last_row_duplicate_u,
    "unknown-rack": _last_row_unknown_rack,
}


def last_row_case(case: str) -> tuple[str, list[str]]:
    if case == "not-yaml":
        return _last_row_not_yaml()
    doc = demo()
    expected = LAST_ROW_CASES[case](doc)
    return to_yaml(doc), expected


def test_last_row_places_are_computed_from_the_file() -> None:
    """Guard the computed indexes: the last server of demo.yaml is sites[1].racks[3].servers[11]."""
    assert last_server_place(DEMO_DOC) == (1, 3, 11)
    assert last_row_case("wrong-type")[1] == [
        "sites[1].racks[3].servers[11].gpu.count: must be an integer"
    ]
    assert last_row_case("duplicate-u")[1] == [
        "sites[1].racks[3].servers[11].u: U22-U23 in rack 'ams1-r04' overlaps "
        "sites[1].racks[3].servers[10] ('ams1-r04-l40s-11') (U21-U22)"
    ]
    text, expected = last_row_case("not-yaml")
    bad_line = next(i for i, line in enumerate(text.splitlines()) if line.endswith(": oops"))
    last_password = max(
        i for i, line in enumerate(DEMO_TEXT.splitlines()) if line.strip().startswith("password:")
    )
    assert bad_line == last_password
    assert expected == [f"not valid YAML at line {bad_line + 1}, column 42: mapping values"]


LAST_ROW_IDS = ["wrong-type", "duplicate-u", "unknown-rack", "not-yaml"]


@pytest.mark.parametrize("case", LAST_ROW_IDS)
def test_last_row_rejected_on_an_empty_fleet(case: str, db: Engine, box: SecretBox) -> None:
    text, expected = last_row_case(case)
    assert_rejected(db, box, text, expected)
    assert sum(counts(snapshot(db)).values()) == 1  # alembic_version only


@pytest.mark.parametrize("case", LAST_ROW_IDS)
def test_last_row_rejected_over_the_imported_demo(
    case: str, demo_fleet: Engine, box: SecretBox
) -> None:
    text, expected = last_row_case(case)
    assert_rejected(demo_fleet, box, text, expected)


def test_rejected_files_leave_postgres_byte_identical(
    demo_fleet: Engine, pg_url: str, box: SecretBox
) -> None:
    """pg_dump before and after every malformed import: rows, sequences, everything."""
    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        if os.environ.get("CI") == "true":
            pytest.fail("pg_dump is required in CI", pytrace=False)
        pytest.skip("pg_dump not installed")
    libpq_url = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    args = [pg_dump, "--no-password", "--dbname", libpq_url]
    # pg_dump ≥ 15.14 wraps its output in \restrict <random key>; pin the key so two dumps of
    # the same database are byte-identical.
    help_text = subprocess.run([pg_dump, "--help"], capture_output=True, text=True).stdout
    if "--restrict-key" in help_text:
        args.append("--restrict-key=fleettest")

    def dump() -> bytes:
        return subprocess.run(
            args,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout

    before = dump()
    assert b"fra1-r01-h100-01" in before
    for case in LAST_ROW_IDS:
        text, expected = last_row_case(case)
        with pytest.raises(ValidationFailed) as info, session_scope(demo_fleet) as session:
            import_inventory(session, parse_inventory(text), box, ACTOR)
        assert matches(info.value.errors, expected), (case, info.value.errors)
    after = dump()
    if after != before:
        import difflib

        diff = "".join(
            difflib.unified_diff(
                before.decode().splitlines(keepends=True),
                after.decode().splitlines(keepends=True),
                "before",
                "after",
            )
        )
        pytest.fail(f"a rejected import changed the database:\n{diff}")


# ---------------------------------------------------------------------------------------------
# Rejections: one problem at a time, on a small fleet


def _r1_server(doc: Doc, index: int = 0) -> Doc:
    server_doc: Doc = doc["sites"][0]["racks"][0]["servers"][index]
    return server_doc


def _case_top_level_list(_: Doc) -> str:
    return "- name: lab\n  racks: []\n"


def _case_not_yaml(_: Doc) -> str:
    return "sites:\n  - name: lab\n    racks: [\n"


def _dup_site(doc: Doc) -> None:
    doc["sites"].append({"name": "lab"})


def _dup_rack(doc: Doc) -> None:
    doc["sites"].append({"name": "lab2", "racks": [{"name": "r1"}]})


def _dup_server_in_rack(doc: Doc) -> None:
    doc["sites"][0]["racks"][1]["servers"].append(server_entry("s1", 9, password=SECRET))


def _dup_server_top_level(doc: Doc) -> None:
    doc["servers"] = [{**server_entry("s3", 17, system_id="sys-9"), "rack": "r1"}]


def _dup_deployment(doc: Doc) -> None:
    doc["deployments"].append(deployment_entry("llama-8b"))


def _dup_feed(doc: Doc) -> None:
    doc["sites"][0]["racks"][0]["feeds"].append(feeds()[0])


def _beyond_height(doc: Doc) -> None:
    _r1_server(doc, 1)["u"] = 38


def _rack_shrunk(doc: Doc) -> None:
    doc["sites"][0]["racks"][0]["u_height"] = 12


def _rack_shrunk_under_fleet_server(doc: Doc) -> None:
    rack = doc["sites"][0]["racks"][0]
    rack["u_height"] = 12
    rack["servers"] = []  # s1 and s2 stay where they are in the fleet


def _unknown_gpu(doc: Doc) -> None:
    doc["sites"][0]["racks"][1]["servers"][0]["gpu"]["model"] = "B200"


def _builtin_gpu_redefined(doc: Doc) -> None:
    doc["gpu_models"] = [{"name": "H100", "memory_mib": 1, "tdp_w": 1, "idle_w": 1}]


def _dup_gpu_model(doc: Doc) -> None:
    spec = {"name": "B200", "memory_mib": 183_359, "tdp_w": 1000, "idle_w": 90}
    doc["gpu_models"] = [spec, dict(spec)]


def _deployment_unknown_gpu(doc: Doc) -> None:
    doc["deployments"][0]["gpu_models"] = ["H100", "B200"]


def _dup_endpoint_in_file(doc: Doc) -> None:
    _r1_server(doc, 1)["bmc"]["system_id"] = "sys-1"


def _dup_endpoint_in_fleet(doc: Doc) -> None:
    entry = server_entry("s4", 5, u_height=2, protocol="ipmi", port=9001, count=4, gpu="L40S")
    doc.clear()
    doc["servers"] = [{**entry, "rack": "r2"}]


def _dup_serial_in_file(doc: Doc) -> None:
    _r1_server(doc, 1)["serial"] = "SN-1"


def _dup_serial_in_fleet(doc: Doc) -> None:
    doc.clear()
    doc["servers"] = [{**server_entry("s4", 17, serial="SN-3", system_id="sys-4"), "rack": "r1"}]


def _overlap_in_fleet(doc: Doc) -> None:
    doc.clear()
    doc["servers"] = [{**server_entry("s4", 5, u_height=2, system_id="sys-4"), "rack": "r1"}]


def _new_server_without_password(doc: Doc) -> None:
    doc["sites"][0]["racks"][0]["servers"].append(
        server_entry("s4", 17, system_id="sys-4", password=None)
    )


def _port_out_of_range(doc: Doc) -> None:
    _r1_server(doc)["bmc"]["port"] = 70000


def _password_key_typo(doc: Doc) -> None:
    bmc = _r1_server(doc)["bmc"]
    bmc["passwrd"] = bmc.pop("password")


def _password_wrong_type(doc: Doc) -> None:
    _r1_server(doc)["bmc"]["password"] = [SECRET]


def _min_over_max(doc: Doc) -> None:
    doc["deployments"][0]["replicas"] = {"min": 5, "max": 4}


def _tp_pp_mismatch(doc: Doc) -> None:
    doc["deployments"][0]["gpus_per_replica"] = 2


def _engine_lacks_the_option(doc: Doc) -> None:
    doc["deployments"][0]["engine"] = "vllm"
    doc["deployments"][0]["engine_params"] = {"max_batch_size": 8}


def _legacy_engine_bad_value(doc: Doc) -> None:
    doc["deployments"][0]["engine"]["backend"] = "jax"


def _standby_over_idle(doc: Doc) -> None:
    _r1_server(doc)["power"]["standby_w"] = 2000


def _unknown_rack(doc: Doc) -> None:
    doc["servers"] = [{**server_entry("s4", 1, system_id="sys-4"), "rack": "nope"}]


MAX_DESCRIPTION = 500


def _long_site_description(doc: Doc) -> None:
    doc["sites"][0]["description"] = "s" * (MAX_DESCRIPTION + 1)


def _long_rack_description(doc: Doc) -> None:
    doc["sites"][0]["racks"][1]["description"] = "r" * (MAX_DESCRIPTION + 1)


def _two_problems(doc: Doc) -> None:
    _port_out_of_range(doc)
    doc["sites"][0]["racks"][1]["servers"][0]["u"] = "one"


def _two_cross_row_problems(doc: Doc) -> None:
    _standby_over_idle(doc)
    _dup_serial_in_file(doc)


S = "sites[0].racks[0].servers"
REJECTIONS: dict[str, tuple[Callable[[Doc], str | None], list[str]]] = {
    "top-level-list": (
        _case_top_level_list,
        ["(top level): must be a mapping with sites, servers, deployments, models or gpu_models"],
    ),
    "not-yaml": (
        _case_not_yaml,
        [Prefix("not valid YAML at line 4, column 1: ")],
    ),
    "duplicate-site": (_dup_site, ["sites[1].name: duplicate site name 'lab' (first at sites[0])"]),
    "duplicate-rack": (
        _dup_rack,
        ["sites[1].racks[0].name: duplicate rack name 'r1' (first at sites[0].racks[0])"],
    ),
    "duplicate-server-in-rack": (
        _dup_server_in_rack,
        [f"sites[0].racks[1].servers[1].name: duplicate server name 's1' (first at {S}[0])"],
    ),
    "duplicate-server-top-level": (
        _dup_server_top_level,
        ["servers[0].name: duplicate server name 's3' (first at sites[0].racks[1].servers[0])"],
    ),
    "duplicate-deployment": (
        _dup_deployment,
        ["deployments[1].name: duplicate deployment name 'llama-8b' (first at deployments[0])"],
    ),
    "duplicate-feed": (
        _dup_feed,
        ["sites[0].racks[0].feeds[2].name: duplicate feed 'a1' in rack 'r1'"],
    ),
    "beyond-rack-height": (_beyond_height, [f"{S}[1].u: U38-U45 does not fit rack 'r1' (42 U)"]),
    "rack-shrunk-under-server": (
        _rack_shrunk,
        [f"{S}[1].u: U9-U16 does not fit rack 'r1' (12 U)"],
    ),
    "rack-shrunk-under-fleet-server": (
        _rack_shrunk_under_fleet_server,
        ["sites[0].racks[0].u_height: 12 U is too short for server 's2' at U9-U16"],
    ),
    "unknown-gpu-model": (
        _unknown_gpu,
        [
            "sites[0].racks[1].servers[0].gpu.model: unknown GPU model 'B200' "
            "(known: H100, H200, L40S; define it under gpu_models)"
        ],
    ),
    "builtin-gpu-model-redefined": (
        _builtin_gpu_redefined,
        ["gpu_models[0].name: 'H100' is a built-in GPU model; use another name"],
    ),
    "duplicate-gpu-model": (
        _dup_gpu_model,
        ["gpu_models[1].name: duplicate GPU model name 'B200' (first at gpu_models[0])"],
    ),
    "deployment-unknown-gpu-model": (
        _deployment_unknown_gpu,
        ["deployments[0].gpu_models: unknown GPU model 'B200' (known: H100, H200, L40S)"],
    ),
    "duplicate-bmc-in-file": (
        _dup_endpoint_in_file,
        [f"{S}[1].bmc: 127.0.0.1:8000 system sys-1 is already the BMC of {S}[0] ('s1')"],
    ),
    "duplicate-bmc-in-fleet": (
        _dup_endpoint_in_fleet,
        ["servers[0].bmc: 127.0.0.1:9001 is already the BMC of server 's3'"],
    ),
    "duplicate-serial-in-file": (
        _dup_serial_in_file,
        [f"{S}[1].serial: 'SN-1' is already used by {S}[0] ('s1')"],
    ),
    "duplicate-serial-in-fleet": (
        _dup_serial_in_fleet,
        ["servers[0].serial: 'SN-3' is already used by server 's3'"],
    ),
    "overlaps-server-in-fleet": (
        _overlap_in_fleet,
        ["servers[0].u: U5-U6 in rack 'r1' overlaps server 's1' (U1-U8)"],
    ),
    "new-server-without-password": (
        _new_server_without_password,
        [f"{S}[2].bmc.password: required for a new server"],
    ),
    "port-70000": (_port_out_of_range, [f"{S}[0].bmc.port: must be 1-65535"]),
    "password-key-typo": (_password_key_typo, [f"{S}[0].bmc.passwrd: unknown field"]),
    "password-wrong-type": (_password_wrong_type, [f"{S}[0].bmc.password: must be a string"]),
    "min-over-max-replicas": (
        _min_over_max,
        ["deployments[0]: min_replicas (5) exceeds max_replicas (4)"],
    ),
    "tp-pp-mismatch": (
        _tp_pp_mismatch,
        [
            "deployments[0]: gpus_per_replica (2) must equal tp_size × pp_size (1 × 1) "
            "for engine trtllm"
        ],
    ),
    # The engine's own check (as the agent makes it): a rule across fields, with the place.
    "engine-lacks-the-option": (
        _engine_lacks_the_option,
        [Prefix("deployments[0]: engine_params max_batch_size: vllm serve has no such option")],
    ),
    "legacy-engine-bad-value": (
        _legacy_engine_bad_value,
        [Prefix("deployments[0]: engine_params.backend 'jax': expected one of")],
    ),
    "standby-over-idle": (
        _standby_over_idle,
        [f"{S}[0].power: expected standby_w ≤ idle_w ≤ max_w"],
    ),
    "unknown-rack": (
        _unknown_rack,
        ["servers[0].rack: unknown rack 'nope' (not in this file or the fleet)"],
    ),
    "site-description-too-long": (
        _long_site_description,
        [f"sites[0].description: must be at most {MAX_DESCRIPTION} characters"],
    ),
    "rack-description-too-long": (
        _long_rack_description,
        [f"sites[0].racks[1].description: must be at most {MAX_DESCRIPTION} characters"],
    ),
    "two-problems": (
        _two_problems,
        [f"{S}[0].bmc.port: must be 1-65535", "sites[0].racks[1].servers[0].u: must be an integer"],
    ),
    "two-cross-row-problems": (
        _two_cross_row_problems,
        [
            f"{S}[0].power: expected standby_w ≤ idle_w ≤ max_w",
            f"{S}[1].serial: 'SN-1' is already used by {S}[0] ('s1')",
        ],
    ),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_rejection_names_the_place_and_writes_nothing(
    case: str, small_fleet: Engine, box: SecretBox
) -> None:
    mutate, expected = REJECTIONS[case]
    doc = small()
    text = mutate(doc)
    exc = assert_rejected(small_fleet, box, text if text is not None else doc, expected)
    if len(expected) > 1:
        assert str(exc) == f"{expected[0]} (and {len(expected) - 1} more)"


def test_descriptions_up_to_the_limit_are_stored(
    small_fleet: Engine, box: SecretBox, session: Session
) -> None:
    """The other side of the *-description-too-long rejections: 500 characters fit."""
    doc = small()
    doc["sites"][0]["description"] = "s" * MAX_DESCRIPTION
    doc["sites"][0]["racks"][1]["description"] = "r" * MAX_DESCRIPTION
    report = run_import(small_fleet, box, doc)
    assert change_set(report) == {
        ("update", "site", "lab", frozenset({"description"})),
        ("update", "rack", "r2", frozenset({"description"})),
    }
    site = session.exec(select(Site).where(Site.name == "lab")).one()
    rack = session.exec(select(Rack).where(Rack.name == "r2")).one()
    assert (site.description, rack.description) == ("s" * MAX_DESCRIPTION, "r" * MAX_DESCRIPTION)


def test_deployment_gpu_model_error_names_the_file_index(
    small_fleet: Engine, box: SecretBox
) -> None:
    doc = small()
    doc["deployments"] = [
        deployment_entry("llama-8b"),
        deployment_entry("llama-8b"),
        deployment_entry("other", gpu_models=["B200"]),
    ]
    exc = assert_rejected(
        small_fleet,
        box,
        doc,
        [
            "deployments[1].name: duplicate deployment name 'llama-8b' (first at deployments[0])",
            "deployments[2].gpu_models: unknown GPU model 'B200' (known: H100, H200, L40S)",
        ],
    )
    assert exc.errors
