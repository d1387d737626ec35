"""fleet.autoscaler.service on both databases: heartbeat stats in, targets and decisions out.

The policy itself is table-tested in tests/unit/test_autoscaler_policy.py; here a clock is stepped
through the windows and the database shows what the autoscaler did and why.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from factories import add_rack, add_server, add_site
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.autoscaler.service import History, autoscale_once, status
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, Pool, RouterReport, ScalingDecision, Server
from fleet.provisioning.autopilot import set_paused
from fleet.registry.routing_table import routing_table
from fleet.settings import Settings

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def settings() -> Settings:
    return Settings(
        autoscale_up_window_s=60.0,
        autoscale_down_window_s=300.0,
        autoscale_cooldown_down_s=0.0,
        heartbeat_interval_s=5.0,
    )


@pytest.fixture
def deployment(session: Session) -> str:
    site = add_site(session, "s1")
    rack = add_rack(session, site, "r1")
    dep = Deployment(
        name="llama",
        model_uri="s3://m/llama-8b",
        model_checksum="sha256:1",
        engine_params={"backend": "pytorch"},
        gpus_per_replica=8,
        gpu_models=["H100"],
        min_replicas=1,
        max_replicas=6,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=500,
        target_servers=2,
    )
    session.add(dep)
    session.commit()
    for i in range(2):
        server = add_server(
            session,
            rack,
            f"gpu{i}",
            "serving",
            u_position=1 + 8 * i,
            bmc_system_id=f"gpu{i}",
            pool=Pool.WARM,
        )
        server.deployment_id = dep.id
        session.add(server)
    for i in range(2, 5):
        add_server(
            session,
            rack,
            f"gpu{i}",
            "warm",
            u_position=1 + 8 * i,
            bmc_system_id=f"gpu{i}",
            pool=Pool.WARM,
        )
    session.commit()
    return dep.name


def load(db: Engine, at: datetime, queued_per_replica: int, kv: float = 0.3) -> None:
    """What the serving servers' heartbeats would say at `at`."""
    with Session(db) as session:
        for server in session.exec(select(Server).where(Server.state == ServerState.SERVING)):
            server.last_heartbeat_at = at
            server.replicas = [
                {
                    "index": 0,
                    "state": "ready",
                    "queued": queued_per_replica,
                    "running": 8,
                    "kv_used_fraction": kv,
                    "ttft_p95_s": 0.1,
                    "e2e_p95_s": 0.5,
                }
            ]
            session.add(server)
        session.commit()


def run(
    db: Engine, history: History, start: datetime, seconds: int, queued: int, step: int = 15
) -> datetime:
    at = start
    for _ in range(0, seconds, step):
        load(db, at, queued)
        autoscale_once(db, settings(), history, now=lambda at=at: at)  # type: ignore[misc]
        at += timedelta(seconds=step)
    return at


def target(db: Engine, name: str) -> int:
    with Session(db) as session:
        return session.exec(select(Deployment).where(Deployment.name == name)).one().target_servers


def decisions(db: Engine) -> list[ScalingDecision]:
    with Session(db) as session:
        rows = list(session.exec(select(ScalingDecision).order_by(col(ScalingDecision.id))))
        for row in rows:
            session.expunge(row)
        return rows


def test_sustained_queue_scales_up_and_records_why(db: Engine, deployment: str) -> None:
    history = History.new(3600)
    # 8 GPUs per server, 200 queued per server: 25 per GPU, 2.5x the target of 10.
    at = run(db, history, T0, 45, queued=200)
    assert target(db, deployment) == 2  # not sustained for the up window yet
    run(db, history, at, 60, queued=200)
    assert target(db, deployment) > 2
    up = [d for d in decisions(db) if d.target_after > d.target_before]
    assert up and up[0].rule in ("queue_high", "trend")
    assert up[0].inputs and "queue_per_gpu" in str(up[0].inputs)
    with Session(db) as session:
        events = session.exec(select(Event).where(Event.kind == "deployment.scaled")).all()
    assert events and "target 2 →" in events[0].message


def test_missing_heartbeats_never_scale_down(db: Engine, deployment: str) -> None:
    history = History.new(3600)
    at = T0
    for _ in range(40):  # 10 minutes with no fresh heartbeat at all
        autoscale_once(db, settings(), history, now=lambda at=at: at)  # type: ignore[misc]
        at += timedelta(seconds=15)
    assert target(db, deployment) == 2
    assert decisions(db)[-1].rule == "no_data"


def test_an_idle_deployment_scales_down_after_the_down_window(db: Engine, deployment: str) -> None:
    history = History.new(3600)
    at = run(db, history, T0, 240, queued=0)
    assert target(db, deployment) == 2  # under the down window
    run(db, history, at, 120, queued=0)
    assert target(db, deployment) == 1  # never below min_replicas (1 server)


def test_a_scale_in_reads_the_batch_slots_from_the_deployments_engine(
    db: Engine, deployment: str, session: Session
) -> None:
    """The replicas run 8 requests each: with max_batch_size 16 that is half their slots, and
    on one server fewer it would be all of them (the ceiling is 75 %): no scale-in."""
    dep = session.exec(select(Deployment).where(Deployment.name == deployment)).one()
    dep.engine_params = {"backend": "pytorch", "max_batch_size": 16}
    session.add(dep)
    session.commit()
    history = History.new(3600)
    at = run(db, history, T0, 360, queued=0)
    assert target(db, deployment) == 2
    last = decisions(db)[-1]
    assert last.rule == "hold" and "batch slots" in last.reason
    assert last.inputs["projected_slot_use"] == 1.0
    with Session(db) as s:
        [row] = status(s, settings(), at - timedelta(seconds=15))
        assert row["signals"]["slot_use"] == 0.5


def test_a_deployment_at_zero_boots_one_server_when_routers_hold_requests_for_it(
    db: Engine, deployment: str, session: Session
) -> None:
    """Scaled to zero (min 0): nothing serves it, so it has no signals; a router holding
    requests for it reports them waiting, and the next tick asks for one server (no up
    window). Meanwhile the routing table tells routers how long that boot takes."""
    dep = session.exec(select(Deployment).where(Deployment.name == deployment)).one()
    dep.min_replicas, dep.target_servers = 0, 0
    session.add(dep)
    for server in session.exec(select(Server).where(Server.deployment_id == dep.id)):
        server.deployment_id = None  # given back (their state does not matter here)
        session.add(server)
    session.commit()
    history = History.new(3600)
    autoscale_once(db, settings(), history, now=lambda: T0)
    assert target(db, deployment) == 0  # no demand: it stays at zero
    [row] = [r for r in routing_table(session, settings(), now=T0) if r["deployment"] == deployment]
    assert row["replicas"] == [] and row["cold_start_s"] > 0
    session.add(RouterReport(router="r1", deployment=deployment, at=T0, waiting=2))
    session.commit()
    autoscale_once(db, settings(), history, now=lambda: T0 + timedelta(seconds=15))
    assert target(db, deployment) == 1
    last = decisions(db)[-1]
    assert last.rule == "activate" and last.target_before == 0
    assert "2 request(s) wait in the routers" in last.reason
    # The table's Retry-After now comes from the boot the autoscaler reckoned with.
    session.expire_all()
    [row] = [r for r in routing_table(session, settings(), now=T0) if r["deployment"] == deployment]
    assert row["cold_start_s"] == last.inputs["boot_p90_s"]


def test_pinned_and_paused(db: Engine, deployment: str, session: Session) -> None:
    dep = session.exec(select(Deployment)).one()
    dep.pinned_replicas = 4
    session.add(dep)
    session.commit()
    history = History.new(3600)
    run(db, history, T0, 30, queued=0)
    assert target(db, deployment) == 4  # 1 replica per 8-GPU server: 4 servers
    assert decisions(db)[-1].rule == "pinned"
    with Session(db) as s:
        set_paused(s, True, "operator:test", "freeze")
    dep.pinned_replicas = 1
    session.add(dep)
    session.commit()
    run(db, history, T0 + timedelta(minutes=5), 30, queued=0)
    assert target(db, deployment) == 4  # paused: nothing moves


def test_status_shows_the_signals_of_now_not_of_the_last_decision(
    db: Engine, deployment: str
) -> None:
    history = History.new(3600)
    at = run(db, history, T0, 45, queued=200)  # 25 per GPU: over the target, not yet for long
    decision = decisions(db)[-1]
    assert decision.inputs["queue_per_gpu"] == 25.0
    load(db, at, queued_per_replica=16)  # the queue falls to 2 per GPU; no tick since
    with Session(db) as session:
        [row] = status(session, settings(), at)
        assert row["signals"]["queue_per_gpu"] == 2.0
        assert row["signals"]["serving_gpus"] == 16 and row["last_rule"] == decision.rule
        # heartbeats older than three intervals say nothing about now
        [row] = status(session, settings(), at + timedelta(seconds=16))
        assert row["signals"]["queue_per_gpu"] is None
