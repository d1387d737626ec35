"""The provisioner's tick sends its BMC actions concurrently, under the per-rack stagger.

A fake BMC that takes 0.2 s per action records when each call starts and ends; the figures
asserted are the overlaps it saw (never wall time): racks run at once, at most
`power_on_per_rack` power-ons of one rack run at once, a rack's starts are
`power_on_rack_delay_s` apart, and power-offs are not held by the inrush stagger. Every power-on
finds its write-ahead mark (`power_on_sent_at`) already committed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, feed
from fake_bmcs import ActingBmc
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.bmc.base import ActionResult
from fleet.crypto import SecretBox
from fleet.models import PowerState, Rack, Server
from fleet.provisioning.tick import provision_once
from fleet.settings import Settings

ON, OFF = PowerState.ON, PowerState.OFF
BOX = SecretBox(TEST_SECRET_KEY)
LATENCY_S = 0.2
# Starts are seen at the fake, after the power lock and the driver's setup, whose time varies
# (a Postgres round trip; 0.45 s once on a loaded CI machine): the gap between two calls can
# be shorter than the stagger's spacing by that much, so the tests bound each start from the
# tick's start instead; test_bmc_bulk.py pins the stagger's plan exactly.


@dataclass(frozen=True)
class Call:
    server: str
    action: str
    start: float
    end: float

    @property
    def rack(self) -> str:
        return self.server.split("-")[0]


class SlowBmc(ActingBmc):
    """A BMC that takes LATENCY_S per action and records each call's interval; on a power-on
    it also notes whether the server's write-ahead mark was committed before the call."""

    engine: ClassVar[Engine | None] = None
    state: ClassVar[dict[str, PowerState]] = {}
    calls: ClassVar[list[Call]] = []
    marked_first: ClassVar[dict[str, bool]] = {}
    lock = threading.Lock()

    def power_state(self) -> PowerState:
        with self.lock:
            return self.state.get(self.target.server, OFF)

    def _send(self, action: str, want: PowerState) -> ActionResult:
        start = time.monotonic()
        if action == "on":
            assert self.engine is not None
            with Session(self.engine) as session:
                row = session.exec(select(Server).where(Server.name == self.target.server)).one()
                marked = row.power_on_sent_at is not None
        time.sleep(LATENCY_S)
        with self.lock:
            before = self.state.get(self.target.server, OFF)
            self.state[self.target.server] = want
            self.calls.append(Call(self.target.server, action, start, time.monotonic()))
            if action == "on":
                self.marked_first[self.target.server] = marked
        return ActionResult(action, True, before, want)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def fresh_bmc(db: Engine) -> Iterator[None]:
    SlowBmc.engine, SlowBmc.state, SlowBmc.calls, SlowBmc.marked_first = db, {}, [], {}
    yield
    SlowBmc.engine = None


def peak(calls: Iterable[Call]) -> int:
    """The most calls in flight at once (an end before a start at the same instant)."""
    edges = sorted(
        itertools.chain.from_iterable(((c.start, 1), (c.end, -1)) for c in calls),
        key=lambda edge: (edge[0], edge[1]),
    )
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def add_racks(session: Session, *names: str) -> dict[str, Rack]:
    site = add_site(session, "s1")
    return {n: add_rack(session, site, n, feeds=[feed("A"), feed("B")]) for n in names}


def add_servers(session: Session, rack: Rack, state: str, slots: range) -> list[str]:
    """Servers named `<rack>-gpu<slot>` in `state`; any powering off is on at its BMC."""
    names = []
    for i in slots:
        name = f"{rack.name}-gpu{i}"
        add_server(session, rack, name, state, u_position=1 + 8 * i, bmc_system_id=name)
        if state == "powering_off":
            SlowBmc.state[name] = ON
        names.append(name)
    return names


def test_a_ticks_power_ons_run_concurrently_within_the_per_rack_limit(
    db: Engine, session: Session
) -> None:
    for rack in add_racks(session, "r1", "r2", "r3").values():
        add_servers(session, rack, "booting", range(4))
    settings = Settings(power_on_per_rack=2, power_on_rack_delay_s=0.1)
    began = time.monotonic()
    report = provision_once(db, BOX, settings, drivers=SlowBmc)
    # provision_once returned only once every action had ended.
    assert len(SlowBmc.calls) == 12 and len(report.power_actions) == 12, report
    assert all(c.action == "on" for c in SlowBmc.calls)
    assert SlowBmc.marked_first == {c.server: True for c in SlowBmc.calls}  # write-ahead first
    per_rack = {
        rack: peak(calls)
        for rack, calls in itertools.groupby(
            sorted(SlowBmc.calls, key=lambda c: c.rack), key=lambda c: c.rack
        )
    }
    assert per_rack == {"r1": 2, "r2": 2, "r3": 2}  # the limit, and reached
    assert peak(SlowBmc.calls) >= 4  # racks at once: the sequential tick never exceeded 1
    for rack in per_rack:
        # A rack's k-th power-on has the k-th slot, 0.1 s apart from the tick's start on
        # (bounds that a slow start of an earlier one cannot shrink: SLACK_S's note).
        starts = sorted(c.start for c in SlowBmc.calls if c.rack == rack)
        assert all(start - began >= k * 0.1 for k, start in enumerate(starts)), starts
    with Session(db) as check:
        servers = check.exec(select(Server)).all()
        assert {s.power_state for s in servers} == {ON}
        assert all(s.power_on_sent_at is not None for s in servers)


def test_power_offs_are_not_held_by_the_inrush_stagger(db: Engine, session: Session) -> None:
    """One power-on per rack at a time, 1 s apart: the power-offs of the same tick, in the
    same rack and another, run beside the power-ons and none waits out the spacing."""
    racks = add_racks(session, "r1", "r2")
    add_servers(session, racks["r1"], "booting", range(2))
    add_servers(session, racks["r1"], "powering_off", range(2, 4))
    add_servers(session, racks["r2"], "powering_off", range(3))
    settings = Settings(power_on_per_rack=1, power_on_rack_delay_s=1.0)
    began = time.monotonic()
    report = provision_once(db, BOX, settings, drivers=SlowBmc)
    assert len(report.power_actions) == 7, report
    ons = [c for c in SlowBmc.calls if c.action == "on"]
    offs = [c for c in SlowBmc.calls if c.action == "off"]
    assert len(ons) == 2 and len(offs) == 5
    assert peak(ons) == 1  # one power-on at a time in r1
    _, second_on = sorted(c.start for c in ons)
    # The second power-on's slot is 1 s after the first's, which is no earlier than the tick:
    # a bound that the time the first took to reach its BMC (its lease, a Postgres round trip,
    # 0.45 s once on a loaded CI machine) cannot shrink, unlike the gap between the two calls.
    assert second_on - began >= 1.0
    assert all(c.start < second_on for c in offs)  # no power-off waited out the spacing
    assert peak(c for c in SlowBmc.calls if c.rack == "r1") == 3  # r1's offs beside its first on
