"""Rack power views and budget modes on SQLite and Postgres (docs/power.md): drawn power from
the servers' fresh readings, peak and p99 from the stored history, measured mode's
commitments, headroom that respects what a rack draws (no boot at 100 %), placement packing
more spares into a measured rack, the inventory file's budget fields and the metrics."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from factories import add_rack, add_server, add_site, feed
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.api.metrics import FleetCollector
from fleet.crypto import SecretBox
from fleet.db import session_scope
from fleet.errors import NotFoundError, ValidationFailed
from fleet.inventory import dump_yaml, export_inventory, import_inventory, parse_inventory
from fleet.inventory.sites import get_rack, update_rack
from fleet.lifecycle.states import ServerState
from fleet.models import (
    BudgetMode,
    Deployment,
    Event,
    Pool,
    PowerSample,
    Rack,
    RackUpdate,
    Server,
    utcnow,
)
from fleet.power.caps import admits_boot
from fleet.power.racks import FRESH_INTERVALS, commit_watts, rack_views
from fleet.provisioning.boots import boot_spares, rack_rooms
from fleet.provisioning.operator_moves import warm_pool
from fleet.settings import Settings

S = ServerState
SETTINGS = Settings()
# 230 V × 50 A × 0.8 per side: a 9,200 W budget, exact in floating point.
BUDGET_W = 9200.0
SPARE = {"max_w": 4000.0, "standby_w": 50.0, "idle_w": 600.0}
P99_W = 1500.0  # what each spare drew at its worst (p99) when it last served
MARGIN = 1.15
ACTOR = "tests:rack-power"


def small_rack(session: Session, mode: BudgetMode = BudgetMode.NAMEPLATE, **rack: Any) -> Rack:
    site = add_site(session, "s1")
    feeds = [feed(side, volts=230, amps=50, phase="single") for side in "AB"]
    return add_rack(session, site, "r1", feeds=feeds, budget_mode=mode, **rack)


def add_spares(session: Session, rack: Rack, count: int) -> list[str]:
    names = []
    for i in range(count):
        name = f"r1-spare{i}"
        add_server(
            session,
            rack,
            name,
            S.WARM,
            u_position=1 + 4 * i,
            u_height=4,
            bmc_system_id=name,
            pool=Pool.WARM,
            **SPARE,
        )
        names.append(name)
    return names


def add_history(
    session: Session,
    kind: str,
    subject: str,
    now: datetime,
    maxima: list[float],
    *,
    bucket_s: float = 300.0,
) -> None:
    """Closed buckets ending at `now`, oldest first, one per maximum."""
    start = now - timedelta(seconds=bucket_s * len(maxima))
    for i, max_w in enumerate(maxima):
        session.add(
            PowerSample(
                kind=kind,
                subject=subject,
                bucket_start=start + timedelta(seconds=bucket_s * i),
                bucket_s=bucket_s,
                max_w=max_w,
                mean_w=max_w * 0.8,
                samples=10,
            )
        )
    session.commit()


def two_hours_at(watts: float) -> list[float]:
    """24 buckets of 5 min (2 h: past power_measured_min_s), the p99 of which is `watts`."""
    return [watts * 0.6] * 23 + [watts]


def read(session: Session, name: str, watts: float, source: str, at: datetime) -> None:
    server = session.exec(select(Server).where(Server.name == name)).one()
    server.drawn_w, server.drawn_source, server.drawn_at = watts, source, at
    session.add(server)
    session.commit()


def add_deployment(session: Session) -> str:
    session.add(
        Deployment(
            name="llama",
            model_uri="s3://m/llama-8b",
            model_checksum="sha256:1",
            engine_params={"backend": "pytorch"},
            gpus_per_replica=8,
            gpu_models=["H100"],
            max_replicas=16,
            sla_p95_latency_ms=2000,
            sla_ttft_ms=300,
            disruption_budget=1,
        )
    )
    session.commit()
    return "llama"


# ---------------------------------------------------------------------------------------------
# Drawn power, peak and p99


def test_drawn_power_sums_fresh_readings_and_names_the_estimated_part(session: Session) -> None:
    rack = small_rack(session)
    for i, name in enumerate(("bmc", "est", "stale", "none")):
        add_server(session, rack, name, S.SERVING, u_position=1 + 8 * i, bmc_system_id=name)
    [view] = rack_views(session, settings=SETTINGS)
    assert view.drawn_w is None and view.drawn_estimated_w == 0  # no server has a reading

    now = utcnow()
    stale = now - timedelta(seconds=FRESH_INTERVALS * SETTINGS.reconcile_interval_s + 1)
    read(session, "bmc", 5200.0, "bmc", now - timedelta(seconds=10))
    read(session, "est", 3100.0, "estimate", now)
    read(session, "stale", 9999.0, "bmc", stale)
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.drawn_w == pytest.approx(8300.0)
    assert view.drawn_estimated_w == pytest.approx(3100.0)
    assert view.power.drawn_w == view.drawn_w
    assert view.peak_24h_w is None and view.p99_7d_w is None  # no history yet


def test_peak_and_p99_come_from_the_racks_history(session: Session) -> None:
    small_rack(session)
    now = utcnow()
    # A week of hourly buckets at 4 kW, one 7 kW spike two days ago, one 6 kW today.
    week = [4000.0] * (7 * 24)
    week[-48] = 7000.0
    week[-3] = 6000.0
    add_history(session, "rack", "r1", now, week, bucket_s=3600.0)
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.peak_24h_w == 6000.0  # the 7 kW spike is older than 24 h
    assert view.p99_7d_w == 6000.0  # 168 buckets: index ⌊0.99 × 168⌋ = 166 of the sorted maxima


# ---------------------------------------------------------------------------------------------
# Measured mode: what a powered server commits


def test_measured_rack_commits_p99_times_margin_and_nameplate_without_history(
    session: Session,
) -> None:
    rack = small_rack(session, BudgetMode.MEASURED, budget_margin=MARGIN)
    for i, name in enumerate(("known", "new", "brief")):
        add_server(
            session, rack, name, S.SERVING, u_position=1 + 4 * i, u_height=4, bmc_system_id=name,
            **SPARE,
        )  # fmt: skip
    now = utcnow()
    add_history(session, "server", "known", now, two_hours_at(P99_W))
    add_history(session, "server", "brief", now, [P99_W] * 6)  # 30 min: too little to trust
    [view] = rack_views(session, now=now, settings=SETTINGS)
    # known: 1,500 × 1.15; new and brief: their maximum (nameplate until an hour of history).
    assert view.power.committed_w == pytest.approx(P99_W * MARGIN + 2 * SPARE["max_w"])
    assert view.power.all_on_w == 3 * SPARE["max_w"]  # all-on stays the nameplate figure
    # What the gate and placement weigh one server at, by the same rule.
    servers = {s.name: s for s in session.exec(select(Server))}
    pairs = [(servers[n], rack) for n in ("known", "new", "brief")]
    assert commit_watts(session, pairs, now=now, settings=SETTINGS) == {
        "known": pytest.approx(P99_W * MARGIN),
        "new": SPARE["max_w"],
        "brief": SPARE["max_w"],
    }

    # Never below idle: a server whose p99 was under its idle draw commits idle.
    add_history(session, "server", "new", now, two_hours_at(100.0))
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.power.committed_w == pytest.approx(
        P99_W * MARGIN + SPARE["idle_w"] + SPARE["max_w"]
    )

    # The same rack at nameplate commits every server's maximum, history or not.
    rack.budget_mode = BudgetMode.NAMEPLATE
    session.add(rack)
    session.commit()
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.power.committed_w == 3 * SPARE["max_w"]


# ---------------------------------------------------------------------------------------------
# Headroom counts what the rack draws; placement packs more into a measured rack


def test_headroom_counts_drawn_power_when_it_exceeds_the_commitment(session: Session) -> None:
    rack = small_rack(session)
    add_server(session, rack, "busy", S.SERVING, max_w=4000.0, standby_w=50.0, idle_w=600.0)
    now = utcnow()
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.power.headroom_w == pytest.approx(BUDGET_W - 4000.0)
    read(session, "busy", 3000.0, "bmc", now)  # drawing less than committed: committed counts
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.power.headroom_w == pytest.approx(BUDGET_W - 4000.0)
    read(session, "busy", 8000.0, "bmc", now)  # more than committed (a bad BMC record)
    [view] = rack_views(session, now=now, settings=SETTINGS)
    assert view.power.headroom_w == pytest.approx(BUDGET_W - 8000.0)
    assert view.power.committed_w == 4000.0


def boots(db: Engine, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    result = boot_spares(db, "llama", count, ACTOR, raise_target=False)
    return result.booted, result.reasons


@pytest.mark.parametrize(
    ("mode", "history", "expected"),
    [
        # 9,200 W less 5 × 50 W standby: two 3,950 W boots fit at nameplate ...
        (BudgetMode.NAMEPLATE, True, 2),
        # ... all five at 1,500 W × 1.15 measured (5 × 1,675 W = 8,375 W) ...
        (BudgetMode.MEASURED, True, 5),
        # ... and a measured rack without enough history is a nameplate rack.
        (BudgetMode.MEASURED, False, 2),
    ],
)
def test_measured_rack_admits_more_boots_than_nameplate(
    db: Engine, session: Session, mode: BudgetMode, history: bool, expected: int
) -> None:
    rack = small_rack(session, mode, budget_margin=MARGIN)
    spares = add_spares(session, rack, 5)
    add_deployment(session)
    if history:
        for name in spares:
            add_history(session, "server", name, utcnow(), two_hours_at(P99_W))
    booted, reasons = boots(db, 5)
    assert len(booted) == expected
    if expected < 5:
        [reason] = reasons
        assert "rack r1" in reason and "3,950 W" in reason
    with Session(db) as fresh:
        [view] = rack_views(fresh, settings=SETTINGS)
        assert view.power.committed_w <= view.power.budget_w  # the plan never exceeds it


def test_the_warm_pool_shows_a_measured_racks_boot_cost(session: Session) -> None:
    """`fleetctl spares` weighs a spare as placement does: its measured commitment."""
    rack = small_rack(session, BudgetMode.MEASURED, budget_margin=MARGIN)
    [measured, unmeasured] = add_spares(session, rack, 2)
    add_history(session, "server", measured, utcnow(), two_hours_at(P99_W))
    # Through JSON, as the API sends it: plain lists and dicts.
    pool = json.loads(json.dumps(warm_pool(session)))
    costs = {s["server"]: s["boot_cost_w"] for p in pool["pools"] for s in p["spares"]}
    assert costs[measured] == pytest.approx(P99_W * MARGIN - SPARE["standby_w"])
    assert costs[unmeasured] == SPARE["max_w"] - SPARE["standby_w"]  # no history: nameplate


@pytest.mark.parametrize(("drawn_w", "booted"), [(BUDGET_W - 1800, 1), (BUDGET_W, 0), (11000, 0)])
def test_no_boot_enters_a_rack_drawing_its_whole_budget(
    db: Engine, session: Session, drawn_w: float, booted: int
) -> None:
    rack = small_rack(session, BudgetMode.MEASURED, budget_margin=MARGIN)
    spares = add_spares(session, rack, 2)
    for name in spares:
        add_history(session, "server", name, utcnow(), two_hours_at(P99_W))
    add_deployment(session)
    # The warm spares' BMCs read their standby; a serving server reads the rest of `drawn_w`,
    # far above the 1 kW it commits (its record understates it).
    add_server(
        session, rack, "other", S.SERVING, u_position=20, u_height=2, bmc_system_id="other",
        max_w=1000.0, standby_w=10.0, idle_w=100.0,
    )  # fmt: skip
    read(session, "other", drawn_w - 100.0, "bmc", utcnow())
    for name in spares:
        read(session, name, 50.0, "bmc", utcnow())
    [view] = rack_views(session, settings=SETTINGS)
    assert view.drawn_w == drawn_w and view.power.committed_w == 1100.0
    assert admits_boot(view.drawn_w, view.power.budget_w) is (drawn_w < BUDGET_W)
    room = rack_rooms(session, settings=SETTINGS)["r1"]
    assert room.headroom_w == BUDGET_W - drawn_w  # drawn, not the 1,100 W committed
    # A spare here commits 1,500 W × 1.15 = 1,725 W once on: 1,675 W more than its standby.
    got, reasons = boots(db, 1)
    assert len(got) == booted
    if not booted:
        [reason] = reasons
        assert "rack r1" in reason and "headroom" in reason and "1,675 W" in reason


def test_a_stale_reading_does_not_close_the_rack(db: Engine, session: Session) -> None:
    rack = small_rack(session)
    add_spares(session, rack, 1)
    add_deployment(session)
    add_server(session, rack, "other", S.SERVING, u_position=20, u_height=2, max_w=1000.0,
               standby_w=10.0, idle_w=100.0, bmc_system_id="other")  # fmt: skip
    old = utcnow() - timedelta(seconds=FRESH_INTERVALS * SETTINGS.reconcile_interval_s + 5)
    read(session, "other", 2 * BUDGET_W, "bmc", old)
    assert rack_views(session, settings=SETTINGS)[0].drawn_w is None
    assert len(boots(db, 1)[0]) == 1


# ---------------------------------------------------------------------------------------------
# The rack edit (the API's PATCH /racks/{name} calls this)


def test_update_rack_sets_mode_and_margin_and_records_an_event(session: Session) -> None:
    small_rack(session)
    shown = update_rack(
        session,
        "r1",
        RackUpdate(budget_mode=BudgetMode.MEASURED, budget_margin=1.3),
        "operator:alice",
        settings=SETTINGS,
    )
    assert shown.budget_mode == BudgetMode.MEASURED and shown.budget_margin == 1.3
    [event] = session.exec(select(Event).where(Event.kind == "rack.updated")).all()
    assert event.subject == "r1" and event.actor == "operator:alice"
    assert event.details == {"fields": ["budget_mode", "budget_margin"]}
    assert "nameplate → measured" in event.message and "1.15 → 1.3" in event.message
    # The same values again: nothing changes, nothing is recorded.
    update_rack(session, "r1", RackUpdate(budget_margin=1.3), "operator:alice")
    assert len(session.exec(select(Event).where(Event.kind == "rack.updated")).all()) == 1
    assert get_rack(session, "r1").budget_margin == 1.3
    with pytest.raises(NotFoundError, match="no rack named 'r9'"):
        update_rack(session, "r9", RackUpdate(budget_margin=1.2), "operator:alice")


# ---------------------------------------------------------------------------------------------
# Inventory files


def rack_doc(**power: Any) -> str:
    rack = {"name": "r1", **power, "feeds": [{"name": "A1", "side": "A", "volts": 230, "amps": 32}]}
    return dump_yaml({"sites": [{"name": "s1", "racks": [rack]}]})


def run_import(db: Engine, secret_key: bytes, text: str) -> list[str]:
    with session_scope(db) as session:
        report = import_inventory(session, parse_inventory(text), SecretBox(secret_key), ACTOR)
    return [f"{c.action} {c.kind} {c.name} {c.fields}" for c in report.changes]


def stored(db: Engine) -> tuple[str, float]:
    with Session(db) as session:
        rack = session.exec(select(Rack).where(Rack.name == "r1")).one()
        return str(rack.budget_mode), rack.budget_margin


def test_inventory_sets_budget_mode_keeps_it_when_left_out_and_exports_it(
    db: Engine, secret_key: bytes
) -> None:
    run_import(db, secret_key, rack_doc())
    assert stored(db) == ("nameplate", 1.15)  # a new rack: the defaults
    changes = run_import(db, secret_key, rack_doc(budget_mode="measured", budget_margin=1.25))
    assert changes == ["update rack r1 ['budget_mode', 'budget_margin']"]
    assert stored(db) == ("measured", 1.25)
    # An older file that says nothing of the mode leaves the fleet's as it is.
    assert run_import(db, secret_key, rack_doc()) == []
    assert stored(db) == ("measured", 1.25)
    with Session(db) as session:
        exported = dump_yaml(export_inventory(session))
    rack = parse_inventory(exported).sites[0].racks[0]
    assert (rack.budget_mode, rack.budget_margin) == ("measured", 1.25)
    assert run_import(db, secret_key, exported) == []  # the export round-trips


@pytest.mark.parametrize(
    ("power", "message"),
    [
        ({"budget_mode": "auto"}, "budget_mode: must be one of 'nameplate' or 'measured'"),
        ({"budget_margin": 0.5}, "budget_margin: must be ≥ 1.0"),
        ({"budget_margin": 5}, "budget_margin: must be ≤ 2.0"),
        ({"budget_margin": "1.2"}, "budget_margin: must be a number"),
        ({"budget_margin": float("nan")}, "budget_margin: must be a finite number"),
    ],
)
def test_inventory_refuses_a_mode_or_margin_that_makes_no_sense(
    power: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationFailed) as refused:
        parse_inventory(rack_doc(**power))
    assert f"sites[0].racks[0].{message}" in str(refused.value.errors)


# ---------------------------------------------------------------------------------------------
# Metrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(collector: FleetCollector) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def named(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_rack_and_server_power_metrics(db: Engine, session: Session) -> None:
    rack = small_rack(session, BudgetMode.MEASURED, budget_margin=MARGIN)
    add_server(session, rack, "bmc", S.SERVING, bmc_system_id="bmc")
    add_server(session, rack, "est", S.SERVING, u_position=9, bmc_system_id="est")
    add_server(session, rack, "quiet", S.SERVING, u_position=17, bmc_system_id="quiet")
    collector = FleetCollector(db, SETTINGS)
    before = scrape(collector)
    # Unknown figures are absent, not 0; the mode, the cap and the override always have one.
    for name in (
        "fleet_rack_drawn_watts",
        "fleet_rack_drawn_estimated_watts",
        "fleet_rack_drawn_peak_24h_watts",
        "fleet_rack_drawn_p99_7d_watts",
        "fleet_server_drawn_watts",
    ):
        assert named(before, name) == {}, name
    assert value(before, "fleet_rack_budget_measured", rack="r1") == 1
    assert value(before, "fleet_rack_gpu_cap_ratio", rack="r1") == 1
    assert value(before, "fleet_rack_budget_override", rack="r1") == 0

    now = utcnow()
    read(session, "bmc", 5000.0, "bmc", now)
    read(session, "est", 2500.0, "estimate", now)
    add_history(session, "rack", "r1", now, [6000.0, 7000.0], bucket_s=3600.0)
    rack.gpu_cap_pct = 70.0
    rack.budget_override_reason, rack.budget_override_by = "maintenance window", "admin:bob"
    rack.budget_override_at = now
    session.add(rack)
    session.commit()
    after = scrape(collector)
    assert value(after, "fleet_rack_drawn_watts", rack="r1") == 7500
    assert value(after, "fleet_rack_drawn_estimated_watts", rack="r1") == 2500
    assert value(after, "fleet_rack_drawn_peak_24h_watts", rack="r1") == 7000
    assert value(after, "fleet_rack_drawn_p99_7d_watts", rack="r1") == 7000
    assert value(after, "fleet_rack_gpu_cap_ratio", rack="r1") == pytest.approx(0.7)
    assert value(after, "fleet_rack_budget_override", rack="r1") == 1
    assert named(after, "fleet_server_drawn_watts") == {
        frozenset({("server", "bmc"), ("rack", "r1"), ("source", "bmc")}): 5000,
        frozenset({("server", "est"), ("rack", "r1"), ("source", "estimate")}): 2500,
    }
