"""fleet/power/valve.py on both databases: racks' drawn power in, caps, GPU power limits and
Events out; and its loop in fleet/control/service_loops.py.

The rack is fed 10 kW a side (250 V × 40 A, single phase, 100 %), so its budget is 10 kW and
watts read as tenths of a percent. Its servers are 8 × H100 (TDP 700 W: a 90 % cap is 630 W a
GPU): gpu0 and gpu1 serving, gpu2 loading (all three capped), gpu3 warm and gpu4 draining (left
alone). Readings are BMC readings split evenly over the three powered servers. Marks are the
defaults: cap at 90 % drawn, lift below 80 %, 10 % a step, floor 50 %; the reconciler reads
every 60 s (a reading is fresh for 3 of those) and agents heartbeat every 5 s.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, feed
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.control.service_loops import build_loops
from fleet.crypto import SecretBox
from fleet.models import Event, GpuModelSpec, Rack, Server
from fleet.power.racks import rack_views
from fleet.power.valve import limit_w, run_valve, settled
from fleet.settings import Settings

T0 = datetime(2027, 3, 26, 12, 0, tzinfo=UTC)
POWERED = ("gpu0", "gpu1", "gpu2")
STATES = {
    "gpu0": "serving",
    "gpu1": "serving",
    "gpu2": "loading",
    "gpu3": "warm",
    "gpu4": "draining",
}


def settings(**overrides: Any) -> Settings:
    return Settings(**overrides)


def ten_kw() -> list[dict[str, Any]]:
    return [
        feed(side, volts=250.0, amps=40.0, phase="single", max_utilisation_pct=100.0)
        for side in "AB"
    ]


def s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def rack(session: Session) -> str:
    site = add_site(session, "s1")
    r = add_rack(session, site, "r1", feeds=ten_kw())
    for i, (name, state) in enumerate(STATES.items()):
        add_server(session, r, name, state, u_position=1 + 8 * i, bmc_system_id=name)
    return r.name


def read(db: Engine, total_w: float, at: datetime, names: tuple[str, ...] = POWERED) -> None:
    """BMC readings taken at `at`, `total_w` split evenly over `names`."""
    with Session(db) as session:
        for server in session.exec(select(Server).where(col(Server.name).in_(names))):
            server.drawn_w = total_w / len(names)
            server.drawn_source = "bmc"
            server.drawn_at = at
            session.add(server)
        session.commit()


def cap_rack(db: Engine, name: str, cap: float | None, changed_at: datetime) -> None:
    """A rack capped earlier, its servers' limits in step with the cap."""
    with Session(db) as session:
        rack = session.exec(select(Rack).where(Rack.name == name)).one()
        rack.gpu_cap_pct = cap
        rack.gpu_cap_changed_at = changed_at
        session.add(rack)
        for server in session.exec(select(Server).where(col(Server.name).in_(POWERED))):
            server.gpu_power_limit_w = limit_w(cap, 700.0)
            session.add(server)
        session.commit()


def state(db: Engine, name: str = "r1") -> tuple[float | None, dict[str, float | None]]:
    """The rack's cap and every server's GPU limit."""
    with Session(db) as session:
        rack = session.exec(select(Rack).where(Rack.name == name)).one()
        limits = {sv.name: sv.gpu_power_limit_w for sv in session.exec(select(Server))}
    return rack.gpu_cap_pct, limits


def cap_events(db: Engine) -> list[Event]:
    with Session(db) as session:
        return list(
            session.exec(select(Event).where(Event.kind == "rack.gpu_cap").order_by(col(Event.id)))
        )


def limits_of(cap_w: float | None, **others: float | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {name: cap_w for name in POWERED}
    out.update({"gpu3": None, "gpu4": None})
    out.update(others)
    return out


# ---------------------------------------------------------------------------------------------
# Pure helpers


def test_limit_is_the_cap_times_tdp_and_none_when_uncapped() -> None:
    assert limit_w(90.0, 700.0) == 630.0
    assert limit_w(70.0, 700.0) == 490.0  # not 489.99999999999994
    assert limit_w(50.0, 350.0) == 175.0
    assert limit_w(None, 700.0) is None


def test_a_rack_is_settled_once_every_reading_postdates_the_change_and_a_heartbeat() -> None:
    assert settled(None, s(0), 5.0)  # never capped
    assert not settled(s(0), s(0), 5.0)
    assert not settled(s(0), s(4.9), 5.0)
    assert settled(s(0), s(5), 5.0)


# ---------------------------------------------------------------------------------------------
# Passes


def test_a_rack_at_95_pct_is_capped_its_loading_and_serving_servers_limited(
    db: Engine, rack: str
) -> None:
    read(db, 9_500.0, s(0))
    moves = run_valve(db, settings(), s(1))
    cap, limits = state(db)
    assert cap == 90.0
    assert limits == limits_of(630.0)  # warm gpu3 and draining gpu4 untouched
    [event] = cap_events(db)
    assert (event.subject_type, event.subject, event.actor) == ("rack", "r1", "valve")
    assert event.at == s(1)
    assert moves == [event.message]
    assert "9.5 kW of its 10.0 kW budget (95 %)" in event.message
    assert "none → 90 % of TDP on 3 server(s)" in event.message
    assert event.details["from_pct"] is None and event.details["to_pct"] == 90.0
    assert event.details["share_pct"] == 95.0
    assert event.details["servers"] == {"gpu0": 630.0, "gpu1": 630.0, "gpu2": 630.0}
    assert event.details["readings"] == 3
    with Session(db) as session:
        changed_at = session.exec(select(Rack)).one().gpu_cap_changed_at
    assert changed_at == s(1)


def test_the_valve_acts_on_the_drawn_power_the_rack_view_shows(
    db: Engine, session: Session, rack: str
) -> None:
    """Fresh readings only, BMC and estimate alike: gpu1's is 200 s old (three reconciler
    intervals are 180 s), so 4.0 + 5.5 kW are drawn, 95 %."""
    read(db, 4_000.0, s(0), names=("gpu0",))
    read(db, 3_000.0, s(-200), names=("gpu1",))
    read(db, 5_500.0, s(0), names=("gpu2",))
    with Session(db) as edit:
        estimate = edit.exec(select(Server).where(Server.name == "gpu2")).one()
        estimate.drawn_source = "estimate"
        edit.add(estimate)
        edit.commit()
    run_valve(db, settings(), s(1))
    [event] = cap_events(db)
    assert event.details["drawn_w"] == 9_500.0
    assert event.details["readings"] == 2
    [view] = rack_views(session, now=s(1), settings=settings())
    assert view.power.drawn_w == event.details["drawn_w"]


def test_a_rack_steps_again_only_on_readings_taken_after_the_cap_took_hold(
    db: Engine, rack: str
) -> None:
    read(db, 9_500.0, s(0))
    run_valve(db, settings(), s(1))
    assert run_valve(db, settings(), s(16)) == []  # the same readings: no second step
    read(db, 9_500.0, s(5))  # read before the agents' next heartbeat (change + 5 s)
    assert run_valve(db, settings(), s(31)) == []
    read(db, 9_500.0, s(6))  # one straggler from before keeps the rack waiting
    read(db, 9_500.0, s(20), names=("gpu0", "gpu1"))
    with Session(db) as session:
        straggler = session.exec(select(Server).where(Server.name == "gpu2")).one()
        straggler.drawn_at = s(4)
        session.add(straggler)
        session.commit()
    assert run_valve(db, settings(), s(46)) == []
    read(db, 9_500.0, s(50))
    assert len(run_valve(db, settings(), s(61))) == 1
    cap, limits = state(db)
    assert cap == 80.0
    assert limits == limits_of(560.0)
    assert [(e.details["from_pct"], e.details["to_pct"]) for e in cap_events(db)] == [
        (None, 90.0),
        (90.0, 80.0),
    ]


def test_a_rack_that_stays_hot_steps_down_to_the_floor_and_stops(db: Engine, rack: str) -> None:
    caps: list[float | None] = []
    for i in range(8):
        read(db, 9_900.0, s(30 * i))
        run_valve(db, settings(), s(30 * i + 1))
        caps.append(state(db)[0])
    assert caps == [90.0, 80.0, 70.0, 60.0, 50.0, 50.0, 50.0, 50.0]
    assert state(db)[1] == limits_of(350.0)
    assert len(cap_events(db)) == 5


def test_falling_to_70_pct_lifts_the_cap_step_by_step_to_none(db: Engine, rack: str) -> None:
    cap_rack(db, rack, 70.0, s(-600))
    with Session(db) as session:  # a draining server keeps whatever limit it had
        draining = session.exec(select(Server).where(Server.name == "gpu4")).one()
        draining.gpu_power_limit_w = 490.0
        session.add(draining)
        session.commit()
    caps: list[float | None] = []
    seen: list[dict[str, float | None]] = []
    for i in range(4):
        read(db, 7_000.0, s(30 * i))
        run_valve(db, settings(), s(30 * i + 1))
        cap, limits = state(db)
        caps.append(cap)
        seen.append(limits)
    assert caps == [80.0, 90.0, None, None]
    assert seen[0] == limits_of(560.0, gpu4=490.0)
    assert seen[1] == limits_of(630.0, gpu4=490.0)
    assert seen[2] == limits_of(None, gpu4=490.0)
    events = cap_events(db)
    assert [(e.details["from_pct"], e.details["to_pct"]) for e in events] == [
        (70.0, 80.0),
        (80.0, 90.0),
        (90.0, None),
    ]
    assert "90 % → none of TDP" in events[-1].message
    assert events[-1].details["servers"] == {"gpu0": None, "gpu1": None, "gpu2": None}


def test_a_rack_between_the_marks_is_untouched(db: Engine, rack: str) -> None:
    read(db, 8_500.0, s(0))
    assert run_valve(db, settings(), s(1)) == []  # uncapped stays uncapped
    assert state(db) == (None, limits_of(None))
    cap_rack(db, rack, 80.0, s(-600))
    assert run_valve(db, settings(), s(2)) == []  # capped stays capped
    assert state(db) == (80.0, limits_of(560.0))
    assert cap_events(db) == []


def test_no_fresh_reading_no_move(db: Engine, rack: str) -> None:
    """A reading older than three reconciler intervals is not believed; nor is no reading."""
    assert run_valve(db, settings(), s(0)) == []
    read(db, 9_900.0, s(0))
    assert run_valve(db, settings(), s(181)) == []
    cap_rack(db, rack, 60.0, s(-600))
    assert run_valve(db, settings(), s(181)) == []  # nor is a cap lifted on nothing
    assert state(db)[0] == 60.0
    assert cap_events(db) == []


def test_a_server_that_starts_serving_in_a_capped_rack_gets_its_limit_next_pass(
    db: Engine, rack: str
) -> None:
    cap_rack(db, rack, 90.0, s(-600))
    read(db, 8_500.0, s(0))
    with Session(db) as session:  # gpu2 came up after the change, with no limit yet
        joined = session.exec(select(Server).where(Server.name == "gpu2")).one()
        joined.gpu_power_limit_w = None
        session.add(joined)
        session.commit()
    moves = run_valve(db, settings(), s(1))
    assert moves == ["rack r1: server gpu2 GPU limit 630 W (rack capped at 90 %)"]
    assert state(db) == (90.0, limits_of(630.0))
    assert cap_events(db) == []  # the rack's cap did not change
    assert run_valve(db, settings(), s(16)) == []


def test_gpu_models_an_inventory_added_are_capped_and_unknown_ones_skipped(
    db: Engine, session: Session, rack: str
) -> None:
    session.add(GpuModelSpec(name="MI300X", memory_mib=196_608, tdp_w=750.0, idle_w=90.0))
    session.commit()
    r1 = session.exec(select(Rack)).one()
    for name, model, u in (("amd0", "MI300X", 41), ("odd0", "Z9", 42)):
        add_server(
            session,
            r1,
            name,
            "serving",
            u_position=u,
            u_height=1,
            bmc_system_id=name,
            gpu_model=model,
        )
    read(db, 9_500.0, s(0))
    run_valve(db, settings(), s(1))
    limits = state(db)[1]
    assert limits["amd0"] == 675.0
    assert limits["odd0"] is None
    [event] = cap_events(db)
    assert event.details["skipped"] == {"odd0": "unknown GPU model 'Z9': no TDP to cap from"}
    assert "on 4 server(s); 1 skipped (unknown GPU model)" in event.message


def test_a_rack_without_a_budget_is_left_alone(db: Engine, session: Session) -> None:
    site = add_site(session, "s1")
    bare = add_rack(session, site, "bare", feeds=[])
    add_server(session, bare, "gpu0", "serving")
    read(db, 50_000.0, s(0), names=("gpu0",))
    assert run_valve(db, settings(), s(1)) == []
    assert state(db, "bare") == (None, {"gpu0": None})


def test_each_rack_is_decided_on_its_own_draw(db: Engine, session: Session) -> None:
    site = add_site(session, "s1")
    for name in ("hot", "cool"):
        r = add_rack(session, site, name, feeds=ten_kw())
        add_server(session, r, f"{name}0", "serving", bmc_system_id=name)
    read(db, 9_600.0, s(0), names=("hot0",))
    read(db, 6_000.0, s(0), names=("cool0",))
    moves = run_valve(db, settings(), s(1))
    assert len(moves) == 1 and moves[0].startswith("rack hot draws 9.6 kW")
    assert state(db, "hot") == (90.0, {"hot0": 630.0, "cool0": None})
    assert state(db, "cool")[0] is None


# ---------------------------------------------------------------------------------------------
# The loop


def test_the_valve_runs_as_a_leader_loop_beside_the_others(db: Engine, rack: str) -> None:
    loops = build_loops(settings(power_valve_interval_s=7.0), db, SecretBox(TEST_SECRET_KEY))
    try:
        assert [loop.name for loop in loops] == [
            "reconciler",
            "provisioner",
            "autoscaler",
            "calendar",
            "rollouts",
            "valve",
            "wakeups",
        ]
        valve = loops[-2]
        assert valve.interval_s == 7.0
        read(db, 9_500.0, datetime.now(UTC))
        assert valve.run_once() is True
        assert (valve.stats.ticks, valve.stats.failed_ticks) == (1, 0)
        assert state(db)[0] == 90.0
    finally:
        for loop in loops:
            loop.stop(timeout=5)


def test_a_server_back_in_an_uncapped_rack_has_its_old_limit_lifted(db: Engine, rack: str) -> None:
    with Session(db) as session:  # gpu2 served under a cap before it was drained and rebooted
        back = session.exec(select(Server).where(Server.name == "gpu2")).one()
        back.gpu_power_limit_w = 560.0
        session.add(back)
        session.commit()
    read(db, 6_000.0, s(0))
    assert run_valve(db, settings(), s(1)) == [
        "rack r1: server gpu2 GPU limit lifted (rack uncapped)"
    ]
    assert state(db) == (None, limits_of(None))
    assert cap_events(db) == []


def test_the_pass_clears_an_admin_override_once_its_rack_is_back_inside_its_budget(
    db: Engine, session: Session, rack: str
) -> None:
    """r1 commits three powered servers at 10.2 kW each on 10 kW: its override stays. A rack
    with one powered server on its 18.4 kW budget (the default feeds) is back inside."""
    fine = add_rack(session, add_site(session, "s2"))  # "rack1", the default feeds
    add_server(session, fine, "ok0", "serving", bmc_system_id="ok0")
    for r in session.exec(select(Rack)):
        r.budget_override_reason, r.budget_override_by = "burn-in", "admin:alice"
        r.budget_override_at = s(-60)
        session.add(r)
    session.commit()
    moves = run_valve(db, settings(), s(0))
    assert moves == ["rack rack1: budget override cleared"]
    with Session(db) as check:
        overrides = {r.name: r.budget_override_by for r in check.exec(select(Rack))}
        [event] = check.exec(select(Event).where(Event.kind == "rack.budget_override_cleared"))
    assert overrides == {"r1": "admin:alice", "rack1": None}
    assert (event.subject, event.actor) == ("rack1", "valve")
