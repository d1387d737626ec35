"""Measured draw end to end on SQLite and Postgres: the reconciler reads the power sensor of the
servers it finds on (an in-process fake BMC), the Meter stores it on the server and in the
bucketed history (servers and racks), nonsense watts are refused with a rate-limited Event, and
the agent's heartbeat stands in with a labelled estimate where the BMC gives no reading, never
over a fresh one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site
from fake_bmcs import ActingBmc
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.auth import Principal
from fleet.bmc.base import ActionResult, BmcTarget, BmcUnsupported, Sensors
from fleet.crypto import SecretBox
from fleet.models import Event, PowerSample, PowerState, Role, Server, utcnow
from fleet.power.measure import (
    ESTIMATE,
    REFUSED_KIND,
    Meter,
    drawn_fresh_s,
    meter_for,
)
from fleet.power.reconciler import TickReport, reconcile_once
from fleet.power.series import RACK, SERVER, bucket_start
from fleet.registry import agent_reports
from fleet.registry.agent_reports import Heartbeat, Reply
from fleet.settings import Settings

ON, OFF = PowerState.ON, PowerState.OFF
BOX = SecretBox(TEST_SECRET_KEY)
SETTINGS = Settings(power_bucket_s=300, reconcile_interval_s=60, power_settle_s=0)
FRESH_S = drawn_fresh_s(SETTINGS)  # 180 s: three sweeps
UNSUPPORTED = "unsupported"
# The clock: a bucket start a day ahead of the wall clock, so that nothing the setup wrote
# (power_state_at of the lifecycle's walk) is "after" a sweep.
T0 = bucket_start(utcnow() + timedelta(days=1), 300)


@dataclass
class World:
    """What each fake BMC answers: its power state, and its sensor's watts (None: no reading;
    UNSUPPORTED: the sensor read fails)."""

    state: dict[str, PowerState] = field(default_factory=dict)
    watts: dict[str, float | str | None] = field(default_factory=dict)
    sensor_calls: list[str] = field(default_factory=list)


class MeteredBmc(ActingBmc):
    """A BMC that is only read: its power state and its power sensor, from the World."""

    def __init__(self, target: BmcTarget, world: World) -> None:
        super().__init__(target)
        self.world = world

    def power_state(self) -> PowerState:
        return self.world.state[self.target.server]

    def sensors(self) -> Sensors:
        name = self.target.server
        self.world.sensor_calls.append(name)
        answer = self.world.watts.get(name)
        if isinstance(answer, str):
            raise BmcUnsupported(self.target, "no Power resource")
        return Sensors(power_w=answer)

    def _send(self, action: str, want: PowerState) -> ActionResult:
        raise AssertionError("the reconciler never acts")


@dataclass
class Clock:
    at: datetime = T0

    def __call__(self) -> datetime:
        return self.at

    def to(self, seconds: float) -> datetime:
        self.at = T0 + timedelta(seconds=seconds)
        return self.at


@dataclass
class Lab:
    db: Engine
    world: World
    clock: Clock
    meter: Meter

    def sweep(self, seconds: float) -> TickReport:
        self.clock.to(seconds)
        self.world.sensor_calls.clear()
        return reconcile_once(
            self.db,
            BOX,
            SETTINGS,
            drivers=lambda target: MeteredBmc(target, self.world),
            now=self.clock,
            meter=self.meter,
        )

    def server(self, name: str) -> Server:
        with Session(self.db) as session:
            row = session.exec(select(Server).where(Server.name == name)).one()
            session.expunge(row)
            return row

    def drawn(self, name: str) -> tuple[float | None, str | None]:
        row = self.server(name)
        return row.drawn_w, row.drawn_source

    def samples(self, kind: str) -> list[PowerSample]:
        with Session(self.db) as session:
            query = (
                select(PowerSample)
                .where(PowerSample.kind == kind)
                .order_by(col(PowerSample.subject), col(PowerSample.bucket_start))
            )
            return list(session.exec(query))

    def events(self, name: str, kind: str = REFUSED_KIND) -> list[Event]:
        with Session(self.db) as session:
            query = select(Event).where(Event.subject == name, Event.kind == kind)
            return list(session.exec(query.order_by(col(Event.id))))

    def heartbeat(self, name: str, gpu_watts: list[float | None]) -> Reply:
        report = Heartbeat.model_validate(
            {
                "server": name,
                "verdict": "healthy",
                "gpus": [
                    {"index": i, "health": "healthy", "power_w": w} for i, w in enumerate(gpu_watts)
                ],
            }
        )
        with Session(self.db) as session:
            server = session.exec(select(Server).where(Server.name == name)).one()
            agent = Principal(
                token_id=1, name=f"agent-{name}", role=Role.AGENT, server_id=server.id
            )
            return agent_reports.heartbeat(
                session, agent, report, 10.0, peer="127.0.0.1", drawn_fresh=FRESH_S
            )


@pytest.fixture
def lab(db: Engine, session: Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    """Rack r1: s-on (on, 5 kW), s-quiet (on, its BMC has no power sensor), s-off (off);
    rack r2: t-on (on, 3 kW)."""
    site = add_site(session, "lab")
    r1, r2 = add_rack(session, site, "r1"), add_rack(session, site, "r2")
    for i, name in enumerate(["s-on", "s-quiet", "s-off"]):
        add_server(session, r1, name, "warm", u_position=1 + 8 * i, bmc_port=8000 + i)
    add_server(session, r2, "t-on", "warm", bmc_port=8100)
    world = World(
        state={"s-on": ON, "s-quiet": ON, "s-off": OFF, "t-on": ON},
        watts={"s-on": 5000.0, "s-quiet": None, "s-off": 60.0, "t-on": 3000.0},
    )
    clock = Clock()
    monkeypatch.setattr(agent_reports, "utcnow", clock)  # the heartbeat's time is the lab's
    yield Lab(db, world, clock, Meter(SETTINGS))


def test_the_sweep_reads_the_power_sensor_of_servers_found_on(lab: Lab) -> None:
    report = lab.sweep(10)
    assert sorted(lab.world.sensor_calls) == ["s-on", "s-quiet", "t-on"]  # s-off is not asked
    assert report.metered == 2 and report.failed == 0
    assert lab.drawn("s-on") == (5000, "bmc") and lab.server("s-on").drawn_at == T0 + timedelta(
        seconds=10
    )
    assert lab.drawn("t-on") == (3000, "bmc")
    assert lab.drawn("s-quiet") == (None, None)  # no sensor: nothing invented
    assert lab.drawn("s-off") == (None, None)


def test_closed_buckets_become_history_rows_for_servers_and_racks(lab: Lab) -> None:
    lab.sweep(10)
    lab.world.watts["s-on"] = 6000.0
    lab.sweep(70)
    assert lab.samples(SERVER) == [] and lab.samples(RACK) == []  # the bucket is still open
    lab.world.watts["s-on"] = 4000.0
    lab.sweep(310)  # past the first bucket: it closes, one row per subject
    servers = {s.subject: s for s in lab.samples(SERVER)}
    assert set(servers) == {"s-on", "t-on"}
    s_on = servers["s-on"]
    assert (s_on.bucket_start, s_on.bucket_s) == (T0, 300)
    assert (s_on.max_w, s_on.mean_w, s_on.samples, s_on.estimated) == (6000, 5500, 2, False)
    racks = {s.subject: s for s in lab.samples(RACK)}
    assert (racks["r1"].max_w, racks["r1"].mean_w) == (6000, 5500)  # Σ of r1's readings
    assert (racks["r2"].max_w, racks["r2"].samples) == (3000, 2)


def test_a_server_switched_off_shows_no_draw(lab: Lab) -> None:
    lab.sweep(10)
    lab.world.state["s-on"] = OFF
    lab.sweep(70)
    assert lab.drawn("s-on") == (None, None)
    assert "s-on" not in lab.world.sensor_calls


def test_a_small_move_is_not_written_a_real_one_is(lab: Lab) -> None:
    lab.sweep(10)
    lab.world.watts["s-on"] = 5050.0  # 1 %
    lab.sweep(70)
    assert lab.drawn("s-on") == (5000, "bmc")
    assert lab.server("s-on").drawn_at == T0 + timedelta(seconds=10)
    lab.world.watts["s-on"] = 5200.0  # 4 %
    lab.sweep(130)
    assert lab.drawn("s-on") == (5200, "bmc")
    # Unmoved: rewritten every other sweep all the same, so its age stays honest.
    lab.sweep(190)
    assert lab.server("s-on").drawn_at == T0 + timedelta(seconds=130)
    lab.sweep(250)
    assert lab.server("s-on").drawn_at == T0 + timedelta(seconds=250)
    # The history saw every reading, written or not.
    lab.sweep(310)
    first = next(s for s in lab.samples(SERVER) if s.subject == "s-on")
    assert (first.samples, first.max_w) == (5, 5200)


@pytest.mark.parametrize("nonsense", [-5.0, 102_001.0, float("nan")])
def test_nonsense_watts_are_refused_with_an_event_once_an_hour(lab: Lab, nonsense: float) -> None:
    lab.sweep(10)
    lab.world.watts["s-on"] = nonsense
    lab.sweep(70)
    assert lab.drawn("s-on") == (5000, "bmc")  # never believed
    (event,) = lab.events("s-on")
    assert event.actor == "reconciler" and "ignored" in event.message
    if nonsense == nonsense:  # a number: the message names it
        assert f"{nonsense:g} W" in event.message
    lab.sweep(130)
    lab.sweep(1800)
    assert len(lab.events("s-on")) == 1  # a broken BMC does not flood the events
    lab.sweep(10 + 3600 + 70)
    assert len(lab.events("s-on")) == 2
    # The series never took it: the bucket's maximum is the believed reading.
    assert all(s.max_w <= 5000 for s in lab.samples(SERVER) if s.subject == "s-on")


def test_a_failing_sensor_costs_the_reading_not_the_power_state(lab: Lab) -> None:
    lab.world.watts["s-on"] = UNSUPPORTED
    report = lab.sweep(10)
    assert report.failed == 0 and report.metered == 1  # t-on still metered
    row = lab.server("s-on")
    assert row.power_state is ON and row.bmc_failures == 0 and row.drawn_w is None


def test_the_agents_estimate_stands_in_labelled_and_enters_the_racks_series(lab: Lab) -> None:
    lab.clock.to(5)
    reply = lab.heartbeat("s-quiet", [300.0] * 8)
    # 8 × 300 W of GPUs + the non-GPU idle: 2000 W idle − 8 × 70 W of H100 idle = 1440 W.
    assert lab.drawn("s-quiet") == (3840, ESTIMATE)
    assert reply.gpu_power_limit_w is None
    lab.sweep(10)
    lab.sweep(310)
    quiet = next(s for s in lab.samples(SERVER) if s.subject == "s-quiet")
    assert (quiet.max_w, quiet.estimated) == (3840, True)
    r1 = next(s for s in lab.samples(RACK) if s.subject == "r1")
    assert (r1.max_w, r1.estimated) == (5000 + 3840, True)
    r2 = next(s for s in lab.samples(RACK) if s.subject == "r2")
    assert not r2.estimated


def test_the_estimate_never_replaces_a_fresh_bmc_reading(lab: Lab) -> None:
    lab.sweep(10)
    lab.clock.to(20)
    lab.heartbeat("s-on", [700.0] * 8)
    assert lab.drawn("s-on") == (5000, "bmc")
    # The BMC stops giving readings: once its last one is stale, the estimate takes over.
    lab.world.watts["s-on"] = None
    lab.sweep(70)
    lab.clock.to(10 + FRESH_S - 1)
    lab.heartbeat("s-on", [700.0] * 8)
    assert lab.drawn("s-on") == (5000, "bmc")
    lab.clock.to(10 + FRESH_S)
    lab.heartbeat("s-on", [700.0] * 8)
    assert lab.drawn("s-on") == (5600 + 1440, ESTIMATE)
    # And a BMC reading wins again as soon as there is one.
    lab.world.watts["s-on"] = 5100.0
    lab.sweep(10 + FRESH_S + 30)
    assert lab.drawn("s-on") == (5100, "bmc")


def test_a_heartbeat_without_gpu_power_leaves_drawn_alone(lab: Lab) -> None:
    lab.clock.to(5)
    lab.heartbeat("s-quiet", [None, None])
    assert lab.drawn("s-quiet") == (None, None)


def test_the_heartbeat_reply_carries_the_cap_valves_limit(lab: Lab) -> None:
    with Session(lab.db) as session:
        row = session.exec(select(Server).where(Server.name == "s-quiet")).one()
        row.gpu_power_limit_w = 490.0
        session.add(row)
        session.commit()
    assert lab.heartbeat("s-quiet", [300.0]).gpu_power_limit_w == 490.0


def test_one_meter_per_database_per_process(db: Engine) -> None:
    first = meter_for(db, SETTINGS)
    assert meter_for(db, SETTINGS) is first
    wider = Settings(power_bucket_s=600)
    assert meter_for(db, wider) is not first  # a new bucket width: new buckets


def test_prune_runs_from_the_sweep(lab: Lab, session: Session) -> None:
    stale: dict[str, Any] = {
        "kind": SERVER,
        "subject": "gone",
        "bucket_start": T0 - timedelta(days=2),
        "bucket_s": 300.0,
        "max_w": 1.0,
        "mean_w": 1.0,
        "samples": 1,
    }
    session.add(PowerSample(**stale))
    session.commit()
    lab.sweep(10)
    assert [s.subject for s in lab.samples(SERVER)] == []
