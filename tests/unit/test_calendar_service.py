"""fleet.calendar.service on both databases, with an injectable clock: entries in, floors,
targets, decisions and events out.

The deployment runs one replica per 8 × H100 server; four H100 spares are warm, two of them
with measured boots (17 and 15 min: the p90 is 17 min). The leader ticks every 30 s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from factories import add_rack, add_server, add_site
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.calendar.service import calendar_once
from fleet.models import Deployment, Event, Pool, ScalingDecision, ScheduleEntry, Server
from fleet.provisioning.autopilot import set_paused
from fleet.settings import Settings

TICK_S = 30.0
P90_S = 17 * 60.0
# Friday 2027-03-26 09:00 in Berlin.
NINE = datetime(2027, 3, 26, 8, 0, tzinfo=UTC)


def settings() -> Settings:
    # No boot margin: the lead is the measured p90 itself, which the tests below reckon with
    # (the margin is tested in tests/unit/test_staging.py and test_boot_history.py).
    return Settings(calendar_interval_s=TICK_S, boot_estimate_s=1200.0, boot_margin_pct=0.0)


@pytest.fixture
def deployment(session: Session) -> str:
    rack = add_rack(session, add_site(session, "s1"), "r1")
    dep = Deployment(
        name="llama",
        model_uri="s3://m/llama-70b",
        model_checksum="sha256:1",
        engine_params={"backend": "pytorch", "tp_size": 8},
        gpus_per_replica=8,
        gpu_models=["H100"],
        min_replicas=0,
        max_replicas=6,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=500,
    )
    session.add(dep)
    session.commit()
    for i, boot in enumerate((P90_S, 15 * 60.0, None, None)):
        add_server(
            session,
            rack,
            f"gpu{i}",
            "warm",
            u_position=1 + 8 * i,
            bmc_system_id=f"gpu{i}",
            pool=Pool.WARM,
            boot_to_ready_s=boot,
        )
    return dep.name


def add_entry(db: Engine, name: str, **fields: Any) -> int:
    with Session(db) as session:
        dep = session.exec(select(Deployment).where(Deployment.name == name)).one()
        assert dep.id is not None
        values: dict[str, Any] = {
            "cron": "0 9 * * 1-5",
            "timezone": "Europe/Berlin",
            "min_replicas": 3,
            "end_cron": "0 18 * * 1-5",
            "created_by": "test",
            "created_at": NINE - timedelta(days=1),
        }
        values.update(fields)
        entry = ScheduleEntry(deployment_id=dep.id, **values)
        session.add(entry)
        session.commit()
        assert entry.id is not None
        return entry.id


def tick(db: Engine, at: datetime) -> list[int]:
    """One calendar tick at `at`; the ids of the entries it fired."""
    return [f.entry.id or 0 for f in calendar_once(db, settings(), now=lambda: at)]


def step(db: Engine, start: datetime, end: datetime) -> dict[datetime, list[int]]:
    """Tick every TICK_S from `start` while before `end`; the ticks that fired something."""
    fired: dict[datetime, list[int]] = {}
    at = start
    while at < end:
        ids = tick(db, at)
        if ids:
            fired[at] = ids
        at += timedelta(seconds=TICK_S)
    return fired


def state(db: Engine, name: str) -> Deployment:
    with Session(db, expire_on_commit=False) as session:
        return session.exec(select(Deployment).where(Deployment.name == name)).one()


def decisions(db: Engine) -> list[ScalingDecision]:
    with Session(db, expire_on_commit=False) as session:
        return list(session.exec(select(ScalingDecision).order_by(col(ScalingDecision.id))))


def events(db: Engine, kind: str) -> list[Event]:
    with Session(db, expire_on_commit=False) as session:
        return list(session.exec(select(Event).where(Event.kind == kind).order_by(col(Event.id))))


def test_an_entry_fires_one_p90_boot_early_and_raises_the_target_to_its_floor(
    db: Engine, deployment: str
) -> None:
    entry = add_entry(db, deployment)
    # The clock steps through the morning at an odd phase: ticks at xx:xx:13 and :43.
    fired = step(db, NINE - timedelta(hours=1, seconds=-13), NINE + timedelta(minutes=30))
    assert list(fired.values()) == [[entry]]
    [at] = fired
    assert NINE - timedelta(seconds=P90_S + TICK_S) <= at <= NINE - timedelta(seconds=P90_S)
    dep = state(db, deployment)
    assert (dep.floor_servers, dep.target_servers) == (3, 3)
    [decision] = decisions(db)
    assert (decision.rule, decision.target_before, decision.target_after) == ("calendar", 0, 3)
    assert decision.reason.startswith("booting 3 at 08:42 for 09:00 (Europe/Berlin)")
    assert "p90 boot 17 min (H100, 2 boots measured)" in decision.reason
    assert "floor 3 servers for 3 replicas until 18:00" in decision.reason
    assert decision.inputs["lead_s"] == P90_S and decision.inputs["late_s"] == 0
    [event] = events(db, "schedule.fired")
    assert event.subject == str(entry) and event.actor == "calendar"
    assert [e.message for e in events(db, "deployment.scaled")] == [
        "target 0 → 3: calendar floor 3"
    ]


def test_the_default_lead_applies_before_any_boot_of_the_model_is_measured(
    db: Engine, deployment: str
) -> None:
    with Session(db) as session:
        for server in session.exec(select(Server)):
            server.boot_to_ready_s = None
            session.add(server)
        session.commit()
    add_entry(db, deployment)
    [at] = step(db, NINE - timedelta(hours=1), NINE)
    assert NINE - timedelta(seconds=1200 + TICK_S) <= at <= NINE - timedelta(seconds=1200)
    assert "p90 boot 20 min (H100 never measured: default)" in decisions(db)[0].reason


def test_no_window_fires_twice_across_ticks_and_restarts(db: Engine, deployment: str) -> None:
    entry = add_entry(db, deployment)
    first = step(db, NINE - timedelta(minutes=20), NINE + timedelta(minutes=5))
    assert list(first.values()) == [[entry]]
    # A restarted leader has nothing in memory: the stored window is what stops it.
    again = step(db, NINE - timedelta(minutes=20), NINE + timedelta(hours=8, minutes=30))
    assert again == {}
    assert len(events(db, "schedule.fired")) == 1
    # Monday's window is a new one.
    monday = NINE + timedelta(days=3) - timedelta(hours=1)  # 09:00 CEST is 07:00 UTC
    assert list(step(db, monday - timedelta(minutes=30), monday).values()) == [[entry]]


def test_two_leaders_at_the_same_tick_fire_a_window_once(db: Engine, deployment: str) -> None:
    add_entry(db, deployment)
    at = NINE - timedelta(seconds=P90_S + 10)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def leader() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(tick(db, at))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=leader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert sorted(len(r) for r in results) == [0, 1]
    assert len(events(db, "schedule.fired")) == 1
    assert len(decisions(db)) == 1


def test_the_window_end_lifts_the_floor_and_leaves_the_target_to_the_autoscaler(
    db: Engine, deployment: str
) -> None:
    entry = add_entry(db, deployment, end_cron=None, duration_s=3600)
    step(db, NINE - timedelta(minutes=20), NINE + timedelta(minutes=59, seconds=59))
    assert state(db, deployment).floor_servers == 3
    tick(db, NINE + timedelta(hours=1))
    dep = state(db, deployment)
    assert (dep.floor_servers, dep.target_servers) == (0, 3)
    [ended] = events(db, "schedule.ended")
    assert ended.subject == str(entry) and "ended at 10:00 (Europe/Berlin)" in ended.message
    with Session(db) as session:
        row = session.get(ScheduleEntry, entry)
        assert row is not None and row.active_until is None and row.fired_for == NINE


def test_a_window_open_while_no_leader_ran_is_caught_up_late(db: Engine, deployment: str) -> None:
    add_entry(db, deployment)
    # The service was down from 08:00 until 10:12 local.
    assert len(tick(db, NINE + timedelta(minutes=72))) == 1
    [fired] = decisions(db)
    assert fired.rule == "calendar" and fired.target_after == 3
    assert fired.reason.startswith("1 h 29 min late (no leader ran the calendar), booting 3")
    assert fired.inputs["late_s"] == pytest.approx(72 * 60 + P90_S)


def test_a_window_that_closed_during_the_outage_is_reported_missed(
    db: Engine, deployment: str
) -> None:
    entry = add_entry(db, deployment)
    assert tick(db, NINE + timedelta(hours=10)) == []  # Friday 19:00 local
    [missed] = events(db, "schedule.missed")
    assert missed.subject == str(entry)
    assert "window 09:00–18:00 (Europe/Berlin)" in missed.message
    assert decisions(db) == [] and state(db, deployment).floor_servers == 0
    # And only once.
    assert tick(db, NINE + timedelta(hours=11)) == []
    assert len(events(db, "schedule.missed")) == 1


def test_an_entry_added_inside_its_window_applies_at_once_and_older_windows_are_silent(
    db: Engine, deployment: str
) -> None:
    add_entry(db, deployment, created_at=NINE + timedelta(hours=3))
    assert len(tick(db, NINE + timedelta(hours=3))) == 1
    assert state(db, deployment).floor_servers == 3
    other = add_entry(db, deployment, created_at=NINE + timedelta(hours=12), cron="0 9 * * *")
    assert tick(db, NINE + timedelta(hours=12)) == []  # Friday's window closed before it existed
    assert events(db, "schedule.missed") == []
    with Session(db) as session:
        row = session.get(ScheduleEntry, other)
        assert row is not None and row.fired_for == NINE  # handled: not looked at again


def test_overlapping_entries_take_the_largest_floor_and_a_removed_entry_lifts_its_own(
    db: Engine, deployment: str
) -> None:
    small = add_entry(db, deployment, min_replicas=2)
    big = add_entry(db, deployment, min_replicas=5, end_cron=None, duration_s=2 * 3600)
    step(db, NINE - timedelta(minutes=20), NINE + timedelta(minutes=1))
    assert state(db, deployment).floor_servers == 5
    with Session(db) as session:
        row = session.get(ScheduleEntry, big)
        session.delete(row)
        session.commit()
    tick(db, NINE + timedelta(minutes=2))
    assert state(db, deployment).floor_servers == 2
    [floor] = events(db, "deployment.floor")
    assert floor.message == "calendar floor 5 → 2 servers"
    assert small


def test_a_pinned_deployment_records_the_firing_but_keeps_its_target(
    db: Engine, deployment: str
) -> None:
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        dep.pinned_replicas, dep.target_servers = 1, 1
        session.add(dep)
        session.commit()
    add_entry(db, deployment)
    step(db, NINE - timedelta(minutes=20), NINE)
    dep = state(db, deployment)
    assert (dep.floor_servers, dep.target_servers) == (3, 1)
    [decision] = decisions(db)
    assert decision.target_after == 1 and "pinned at 1 replica by an operator" in decision.reason


def test_a_floor_above_max_is_capped_and_a_met_floor_boots_nothing(
    db: Engine, deployment: str
) -> None:
    add_entry(db, deployment, min_replicas=9)
    add_entry(db, deployment, min_replicas=1, cron="0 10 * * 1-5")
    step(db, NINE - timedelta(minutes=20), NINE + timedelta(hours=1))
    first, second = decisions(db)
    assert first.target_after == 6 and "capped at max 6" in first.reason
    assert second.target_after == 6 and "target 6 already meets it" in second.reason


def test_a_paused_autopilot_holds_the_calendar_until_resumed(
    db: Engine, deployment: str, session: Session
) -> None:
    add_entry(db, deployment)
    set_paused(session, True, "test", "maintenance window")
    assert step(db, NINE - timedelta(minutes=20), NINE + timedelta(minutes=10)) == {}
    set_paused(session, False, "test", "done")
    later: Callable[[], datetime] = lambda: NINE + timedelta(minutes=10)  # noqa: E731
    [firing] = calendar_once(db, settings(), now=later)
    assert firing.due.late_s == pytest.approx(10 * 60 + P90_S)
