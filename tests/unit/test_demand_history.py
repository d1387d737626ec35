"""fleet/autoscaler/demand.py on both databases: the routers' arrival counters become a
per-minute demand history, the history becomes forecasts, and a forecast acts in the
autoscaler's tick (rule "forecast"), is explained, and switches itself off with an Event when
it keeps missing. The model itself: tests/unit/test_forecast.py."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from factories import add_rack, add_server, add_site
from live import serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner

from fleet import cli
from fleet.autoscaler import demand
from fleet.autoscaler import forecast as fc
from fleet.autoscaler.demand import Closed, DemandBook, Forecasts
from fleet.autoscaler.service import History, autoscale_once
from fleet.lifecycle.states import ServerState
from fleet.models import (
    DemandHour,
    Deployment,
    Event,
    Pool,
    Role,
    RouterReport,
    ScalingDecision,
    Server,
)
from fleet.provisioning.autopilot import set_paused
from fleet.settings import Settings

MONDAY = datetime(2026, 12, 7, tzinfo=UTC)


def report(router: str, arrived: int | None, tokens: int = 0) -> RouterReport:
    return RouterReport(router=router, deployment="llama", arrived=arrived, arrived_tokens=tokens)


# ---------------------------------------------------------------------------------------------
# counting (no database)


def test_counters_become_differences_per_deployment() -> None:
    book = DemandBook()
    t = MONDAY.timestamp()
    # First sight: a baseline (a new leader cannot tell old counts from new ones).
    assert book.count([report("a", 100, 1000)], t) == {"llama": (0.0, 0.0)}
    assert book.count([report("a", 130, 1300), report("b", 5, 50)], t + 15) == {
        "llama": (30.0, 300.0)
    }
    assert book.count([report("a", 140, 1400), report("b", 9, 90)], t + 30) == {
        "llama": (14.0, 140.0)
    }
    # A restarted router's counter starts again: all of it is new.
    assert book.count([report("a", 3, 30)], t + 45) == {"llama": (3.0, 30.0)}
    # A router that counts nothing says nothing about demand.
    assert book.count([report("c", None)], t + 60) == {}
    # After a gap (leadership lost and back), counters only set baselines again.
    assert book.count([report("a", 500, 5000)], t + 600) == {"llama": (0.0, 0.0)}


def test_a_minute_closes_when_the_next_begins() -> None:
    book = DemandBook()
    t = MONDAY.timestamp() + 60 * 10
    assert book.add("llama", t, (10.0, 100.0), 2, 0.4) is None
    assert book.add("llama", t + 30, (5.0, 50.0), 3, 0.5) is None
    closed = book.add("llama", t + 60, None, 3, 0.5)
    assert closed == Closed("llama", t, 15.0, 150.0, 3, 0.5)
    # No router reported the deployment for a whole minute: not seen (NaN), not zero.
    unseen = book.add("llama", t + 120, (0.0, 0.0), 3, None)
    assert unseen is not None and math.isnan(unseen.requests)
    zero = book.add("llama", t + 180, None, 3, None)
    assert zero is not None and zero.requests == 0.0  # reported, and nothing came


def test_packing_round_trips_and_a_foreign_row_reads_as_not_seen() -> None:
    values = [float(i) for i in range(60)]
    assert demand.unpack(demand.pack(values)) == values
    assert all(math.isnan(v) for v in demand.unpack(b"\x00" * 7))


# ---------------------------------------------------------------------------------------------
# the service's tick (both databases)


def settings(**kw: object) -> Settings:
    base: dict[str, object] = {
        "autoscale_up_window_s": 60.0,
        "autoscale_down_window_s": 300.0,
        "autoscale_cooldown_down_s": 0.0,
        "heartbeat_interval_s": 5.0,
        "boot_estimate_s": 900.0,
    }
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


@pytest.fixture
def llama(session: Session) -> str:
    site = add_site(session, "s1")
    rack = add_rack(session, site, "r1")
    dep = Deployment(
        name="llama",
        model_uri="s3://m/llama-8b",
        model_checksum="sha256:1",
        engine_params={"max_batch_size": 16},
        gpus_per_replica=8,
        gpu_models=["H100"],
        min_replicas=1,
        max_replicas=8,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=500,
        target_servers=2,
    )
    session.add(dep)
    session.commit()
    for i in range(8):
        server = add_server(
            session,
            rack,
            f"gpu{i}",
            "serving" if i < 2 else "warm",
            u_position=1 + 4 * i,
            bmc_system_id=f"gpu{i}",
            pool=Pool.WARM,
        )
        if i < 2:
            server.deployment_id = dep.id
            session.add(server)
    session.commit()
    return dep.name


def heartbeat(db: Engine, at: datetime, running: int = 4) -> None:
    """Quiet engines: no queue, low latency, `running` of 16 batch slots busy."""
    with Session(db) as session:
        for server in session.exec(select(Server).where(Server.state == ServerState.SERVING)):
            server.last_heartbeat_at = at
            server.replicas = [
                {
                    "index": 0,
                    "state": "ready",
                    "queued": 0,
                    "running": running,
                    "kv_used_fraction": 0.1,
                    "ttft_p95_s": 0.05,
                    "e2e_p95_s": 0.4,
                }
            ]
            session.add(server)
        session.commit()


def router_says(db: Engine, at: datetime, arrived: int) -> None:
    with Session(db) as session:
        row = session.exec(select(RouterReport)).first() or RouterReport(
            router="r1", deployment="llama"
        )
        row.at, row.arrived, row.arrived_tokens = at, arrived, arrived * 100
        session.add(row)
        session.commit()


def tick(db: Engine, at: datetime, forecasts: Forecasts, history: History, **kw: object) -> None:
    autoscale_once(db, settings(**kw), history, now=lambda: at, forecasts=forecasts)


def quiet_ticks(
    db: Engine, at: datetime, ticks: int, count: int, per_tick: int, history: History
) -> Forecasts:
    """`ticks` 15-s ticks from `at`, quiet engines, the router's counter from `count` rising
    `per_tick` a tick; the Forecasts the ticks kept."""
    forecasts = Forecasts.new()
    for _ in range(ticks):
        heartbeat(db, at)
        router_says(db, at, count)
        tick(db, at, forecasts, history)
        at += timedelta(seconds=15)
        count += per_tick
    return forecasts


def test_the_tick_writes_each_minute_into_its_hours_row(db: Engine, llama: str) -> None:
    # Four minutes of 15-s ticks, 12 requests a tick.
    quiet_ticks(db, MONDAY + timedelta(hours=9, minutes=58), 4 * 4, 1000, 12, History.new(900))
    with Session(db) as session:
        rows = list(session.exec(select(DemandHour).order_by(col(DemandHour.hour))))
        assert [r.hour for r in rows] == [MONDAY + timedelta(hours=9), MONDAY + timedelta(hours=10)]
        minutes = demand.read(session, llama, MONDAY)
    seen = [(datetime.fromtimestamp(t, UTC).strftime("%H:%M"), r, s, u) for t, r, s, u in minutes]
    seen = [x for x in seen if not math.isnan(x[1])]
    with Session(db) as session:
        recent = [x for x in demand.read_recent(session, llama, MONDAY) if not math.isnan(x[1])]
    # The p95s as the ticks saw them (the heartbeats' 0.4 s and 0.05 s), as float32.
    assert [(r, round(p, 6), round(t, 6)) for _, r, p, t in recent] == [
        (36.0, 0.4, 0.05),
        (48.0, 0.4, 0.05),
        (48.0, 0.4, 0.05),
    ]
    # 09:58 starts with the baseline (three ticks counted), then 48 a minute; 10:01 is open.
    assert seen == [
        ("09:58", 36.0, 2.0, 0.25),
        ("09:59", 48.0, 2.0, 0.25),
        ("10:00", 48.0, 2.0, 0.25),
    ]


def test_a_paused_autopilot_still_keeps_the_demand_history(db: Engine, llama: str) -> None:
    """Paused, nothing is decided, but the minutes are counted and written: the forecast gets
    no hole for an incident's pause, and a resume decides on the last minutes."""
    history = History.new(900)
    with Session(db) as session:
        set_paused(session, True, "operator:test", "incident")
    quiet_ticks(db, MONDAY + timedelta(hours=14), 3 * 4, 0, 10, history)  # three minutes
    with Session(db) as session:
        assert session.exec(select(ScalingDecision)).first() is None  # decided nothing
        minutes = [r for _, r, _, _ in demand.read(session, llama, MONDAY) if not math.isnan(r)]
    assert minutes == [30.0, 40.0]  # the first minute counts from the baseline
    assert len(history.series[llama]) == 12  # the signals kept too


def hour_row(
    deployment: str, hour: datetime, requests: float, servers: float, slot_use: float
) -> DemandHour:
    """An hour of history: every minute the same."""
    return DemandHour(
        deployment=deployment,
        hour=hour,
        requests=demand.pack([requests] * 60),
        tokens=demand.pack([0.0] * 60),
        servers=demand.pack([servers] * 60),
        slot_use=demand.pack([slot_use] * 60),
        p95_s=demand.pack([0.4] * 60),
        ttft_p95_s=demand.pack([0.05] * 60),
    )


def seed_history(
    session: Session,
    deployment: str,
    until: datetime,
    *,
    busy_rpm: float = 1200.0,
    busy_servers: float = 2.0,
) -> None:
    """Two weeks of hourly rows: 60 req/min all day, `busy_rpm` at 10:00-11:00 (UTC) each
    weekday, on 2 servers (`busy_servers` at the busy hour) whose batches are then 60 % busy.
    By default a server at full carries 1,200 ÷ 60 ÷ 2 ÷ 0.6 = 16.7 req/s, 12.5 at 75 %."""
    hour = until - timedelta(weeks=2)
    while hour < until:
        busy = hour.hour == 10 and hour.weekday() < 5
        session.add(
            hour_row(
                deployment,
                hour,
                busy_rpm if busy else 60.0,
                busy_servers if busy else 2.0,
                0.6 if busy else 0.05,
            )
        )
        hour += timedelta(hours=1)
    session.commit()


def test_a_forecast_the_fleet_already_covers_is_explained_and_changes_nothing(
    db: Engine, session: Session, llama: str
) -> None:
    at = MONDAY + timedelta(hours=9, minutes=50)  # 10 min before Monday's busy hour
    seed_history(session, llama, MONDAY + timedelta(hours=9))
    forecasts, history = Forecasts.new(), History.new(900)
    heartbeat(db, at)
    router_says(db, at, 0)
    tick(db, at, forecasts, history)
    with Session(db) as s:
        dep = s.exec(select(Deployment)).one()
        last = s.exec(select(ScalingDecision).order_by(col(ScalingDecision.id).desc())).one()
    # 1,200 req/min = 20 req/s at 12.5 req/s a server: 2 servers, which serve already.
    assert dep.target_servers == 2 and last.rule != "forecast"
    assert last.inputs["forecast_servers"] == 2 and last.inputs["won"] == "reactive"
    assert last.inputs["forecast"] == "on: not scored yet"
    assert "weekly on 2 weeks" in last.inputs["forecast_basis"]
    assert "12.5 req/s per server" in last.inputs["forecast_basis"]


def test_a_bigger_busy_hour_raises_the_target_one_boot_ahead(
    db: Engine, session: Session, llama: str, tmp_path: Path
) -> None:
    seed_history(session, llama, MONDAY + timedelta(hours=9), busy_rpm=4500.0, busy_servers=6.0)
    forecasts, history = Forecasts.new(), History.new(900)
    at = MONDAY + timedelta(hours=9, minutes=50)
    heartbeat(db, at)
    router_says(db, at, 0)
    tick(db, at, forecasts, history)
    with Session(db) as s:
        dep = s.exec(select(Deployment)).one()
        last = s.exec(select(ScalingDecision).order_by(col(ScalingDecision.id).desc())).one()
        events = list(s.exec(select(Event).where(Event.kind == "deployment.scaled")))
    # 4,500 req/min = 75 req/s; 6 servers 60 % busy carried it, so a full server carries
    # 75 ÷ (6 × 0.6) = 20.8 req/s, 15.6 at the 75 % ceiling: 75 ÷ 15.6 = 4.8 → 5 servers.
    assert (dep.target_servers, last.rule) == (5, "forecast")
    assert last.inputs["reactive_target"] == 2 and last.inputs["forecast_servers"] == 5
    assert "forecast wants 5 servers" in last.reason
    assert events and "forecast" in events[-1].message
    # `fleetctl autoscaler explain` says both sides and which won.
    with serve(db, tmp_path) as live:
        env = {"FLEET_URL": live.url, "FLEET_TOKEN": live.token(Role.VIEWER, name="v")}
        shown = CliRunner().invoke(cli.app, ["autoscaler", "explain", llama], env=env)
    assert shown.exit_code == 0, shown.stdout
    line = next(x for x in shown.stdout.splitlines() if x.startswith("forecast:"))
    assert line.startswith("forecast: on: not scored yet; wants 5 servers (")
    assert "weekly on 2 weeks" in line and "against reactive 2 (window): forecast won" in line
    # An hour earlier the horizon (boot 900 s + one 15-min slot) does not reach 10:00 yet.
    with Session(db) as s:
        dep = s.exec(select(Deployment)).one()
        dep.target_servers = 2
        s.add(dep)
        s.commit()
    early = MONDAY + timedelta(hours=8, minutes=50)
    heartbeat(db, early)
    tick(db, early, Forecasts.new(), History.new(900))
    with Session(db) as s:
        assert s.exec(select(Deployment)).one().target_servers == 2


def test_forecast_off_keeps_the_history_and_adds_nothing(
    db: Engine, session: Session, llama: str
) -> None:
    seed_history(session, llama, MONDAY + timedelta(hours=9))
    forecasts, history = Forecasts.new(), History.new(900)
    at = MONDAY + timedelta(hours=9, minutes=50)
    for i in range(5):
        heartbeat(db, at)
        router_says(db, at, 10 * i)
        tick(db, at, forecasts, history, forecast=False)
        at += timedelta(seconds=15)
    with Session(db) as s:
        last = s.exec(select(ScalingDecision).order_by(col(ScalingDecision.id).desc())).first()
        assert last is None or "forecast_servers" not in last.inputs
        minutes = demand.read(s, llama, MONDAY + timedelta(hours=9))
    assert [r for _, r, _, _ in minutes if not math.isnan(r)] == [30.0]  # 09:50's minute


def test_a_forecast_that_keeps_missing_switches_off_with_an_event(
    db: Engine, session: Session, llama: str
) -> None:
    seed_history(session, llama, MONDAY + timedelta(hours=9))
    forecasts, history = Forecasts.new(), History.new(900)
    predictor = forecasts.predictor(llama)
    predictor.accuracy = fc.Accuracy(forecasts.config)
    # Six hours of forecasts three times what came.
    start = (MONDAY + timedelta(hours=3)).timestamp()
    for i in range(360):
        predictor.accuracy.predict(start + 60 * i, 300.0)
        predictor.accuracy.observe(start + 60 * i, 100.0)
    at = MONDAY + timedelta(hours=9, minutes=50)
    for i in range(6):  # a minute closes, is scored, and the error switches it off
        heartbeat(db, at)
        router_says(db, at, 10 * i)
        tick(db, at, forecasts, history)
        at += timedelta(seconds=15)
    with Session(db) as s:
        events = list(s.exec(select(Event).where(Event.kind == "deployment.forecast_off")))
        last = s.exec(select(ScalingDecision).order_by(col(ScalingDecision.id).desc())).first()
    assert len(events) == 1 and "reactive scaling alone" in events[0].message
    assert "above 35%" in events[0].message
    assert predictor.accuracy.on is False
    assert last is None or last.rule != "forecast"


def test_history_past_the_retention_is_pruned(db: Engine, session: Session, llama: str) -> None:
    old = MONDAY - timedelta(days=40)
    for hour in (old, MONDAY - timedelta(days=1)):
        session.add(hour_row(llama, hour, 1.0, 1.0, 0.1))
    session.commit()
    at = MONDAY + timedelta(hours=1)
    heartbeat(db, at)
    tick(db, at, Forecasts.new(), History.new(900))
    with Session(db) as s:
        assert [r.hour for r in s.exec(select(DemandHour))] == [MONDAY - timedelta(days=1)]
