"""fleet.power.actions on both databases, with a fake driver (the real drivers are tested
against real emulators in test_bmc_redfish.py / test_bmc_ipmi.py)."""

from __future__ import annotations

import threading
from typing import cast

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, walk_to
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.bmc.base import ActionResult, BmcInfo, BmcTarget, BmcUnreachable, PowerDriver, Sensors
from fleet.bmc.bulk import Stagger
from fleet.crypto import SecretBox
from fleet.errors import NotFoundError
from fleet.lifecycle.states import ServerState
from fleet.models import BmcProtocol, Event, Pool, PowerState, Server
from fleet.power.actions import Action, PowerReport, power, server_power_lock, verify
from fleet.settings import Settings

ON, OFF = PowerState.ON, PowerState.OFF


class FakeBmc(PowerDriver):
    """A BMC that applies at once; `state` and `calls` are shared per server name."""

    state: dict[str, PowerState] = {}
    calls: list[tuple[str, str]] = []
    unreachable: set[str] = set()
    gate: threading.Event | None = None

    def _check(self) -> None:
        if self.target.server in self.unreachable:
            raise BmcUnreachable(self.target, "connection refused")

    def power_state(self) -> PowerState:
        self._check()
        if self.gate is not None:
            self.gate.wait(timeout=5)
        return self.state.get(self.target.server, OFF)

    def _set(self, action: str, want: PowerState) -> ActionResult:
        before = self.power_state()
        sent = before != want
        if sent:
            self.calls.append((self.target.server, action))
            self.state[self.target.server] = want
        return ActionResult(action, sent, before, self.power_state())  # type: ignore[arg-type]

    def power_on(self) -> ActionResult:
        return self._set("on", ON)

    def power_off(self, force: bool = False) -> ActionResult:
        return self._set("force_off" if force else "off", OFF)

    def power_cycle(self) -> ActionResult:
        before = self.power_state()
        self.calls.append((self.target.server, "cycle"))
        self.state[self.target.server] = ON
        return ActionResult("cycle", True, before, ON)

    def identify(self, on: bool = True) -> None: ...

    def info(self) -> BmcInfo:
        return BmcInfo()

    def sensors(self) -> Sensors:
        return Sensors()


@pytest.fixture
def fleet(session: Session) -> list[str]:
    FakeBmc.state, FakeBmc.calls, FakeBmc.unreachable, FakeBmc.gate = {}, [], set(), None
    site = add_site(session, "s1")
    names = []
    for r in range(2):
        rack = add_rack(session, site, f"r{r}")
        for i in range(3):
            name = f"r{r}-gpu{i}"
            # 3 × 5 kW: each rack's budget (18.4 kW) holds all three on; the budget gate
            # itself is tested in test_power_gate.py.
            add_server(session, rack, name, u_position=1 + 8 * i, bmc_system_id=name, max_w=5000.0)
            names.append(name)
    return names


def run(db: Engine, names: list[str], action: str) -> list[PowerReport]:
    return power(
        db,
        SecretBox(TEST_SECRET_KEY),
        Settings(),
        names,
        cast(Action, action),  # tests pass bad actions on purpose
        "operator:test",
        stagger=Stagger(workers=8, per_rack=2, rack_delay=0),
        drivers=FakeBmc,
    )


def events(session: Session, kind: str) -> list[Event]:
    return list(session.exec(select(Event).where(Event.kind == kind).order_by(col(Event.id))))


def test_power_on_acts_reads_back_and_records(
    db: Engine, session: Session, fleet: list[str]
) -> None:
    FakeBmc.state[fleet[0]] = ON  # already on: nothing may be sent to it
    reports = run(db, fleet, "on")
    assert [r.server for r in reports] == fleet
    assert all(r.ok and r.state_after is ON for r in reports)
    assert [r.sent for r in reports] == [False] + [True] * 5
    assert sorted(FakeBmc.calls) == sorted((n, "on") for n in fleet[1:])
    rows = {s.name: s for s in session.exec(select(Server))}
    assert all(rows[n].power_state is ON and rows[n].bmc_reachable for n in fleet)
    assert all(rows[n].state == "enrolled" for n in fleet)  # observations only, never state
    recorded = events(session, "server.power")
    assert len(recorded) == 6
    first = next(e for e in recorded if e.subject == fleet[0])
    assert "nothing sent" in first.message and first.details["sent"] is False


def test_failures_are_per_server_one_line_and_recorded(
    db: Engine, session: Session, fleet: list[str]
) -> None:
    FakeBmc.unreachable = {fleet[2]}
    reports = run(db, fleet, "status")
    bad = reports[2]
    assert not bad.ok and bad.error is not None and "\n" not in bad.error
    assert bad.error.startswith(f"server {fleet[2]} (") and "connection refused" in bad.error
    assert all(r.ok for i, r in enumerate(reports) if i != 2)
    [failed] = events(session, "server.power_failed")
    assert failed.subject == fleet[2] and failed.details["error"] == "BmcUnreachable"
    session.expire_all()
    assert session.exec(select(Server).where(Server.name == fleet[2])).one().bmc_reachable is False


def test_unknown_servers_are_refused_before_any_call(db: Engine, fleet: list[str]) -> None:
    with pytest.raises(NotFoundError, match="'ghost'"):
        run(db, [fleet[0], "ghost"], "on")
    assert FakeBmc.calls == []


def test_one_power_action_per_server_at_a_time(
    db: Engine, session: Session, fleet: list[str]
) -> None:
    """While one action holds a server, a second one for it is refused (not queued)."""
    server = session.exec(select(Server).where(Server.name == fleet[0])).one()
    with server_power_lock(db, server):
        [report] = run(db, [fleet[0]], "on")
    assert not report.ok and "another power action is in progress" in (report.error or "")
    assert FakeBmc.calls == [] and events(session, "server.power") == []
    [again] = run(db, [fleet[0]], "on")  # released: works now
    assert again.ok and again.sent


def test_unknown_action_is_refused(db: Engine, fleet: list[str]) -> None:
    with pytest.raises(ValueError, match="unknown power action"):
        run(db, fleet, "explode")


def test_target_never_carries_the_password_in_its_repr(fleet: list[str]) -> None:
    target = BmcTarget("x", BmcProtocol.REDFISH, "h", 1, "u", "hunter2")
    assert "hunter2" not in repr(target)


def test_a_server_named_twice_is_acted_on_once(
    db: Engine, session: Session, fleet: list[str]
) -> None:
    reports = run(db, [fleet[0], fleet[0], fleet[1]], "on")
    assert [r.server for r in reports] == [fleet[0], fleet[1]]
    assert all(r.ok and r.sent for r in reports)
    assert sorted(FakeBmc.calls) == [(fleet[0], "on"), (fleet[1], "on")]


def test_verify_moves_enrolled_servers_by_pool_and_power(
    db: Engine, session: Session, fleet: list[str]
) -> None:
    """warm pool + off → warm; warm pool + on → stays enrolled (a spare must be off);
    baseline → powered on, booting; unreachable → stays enrolled; not enrolled → untouched."""
    spare_off, spare_on, baseline, dead, already = fleet[:5]
    rows = {s.name: s for s in session.exec(select(Server))}
    patch_pool(db, baseline, "baseline")
    FakeBmc.state[spare_on] = ON
    FakeBmc.unreachable = {dead}
    walk_to(session, rows[already], ServerState.MAINTENANCE)

    reports = {
        r.server: r
        for r in verify(
            db,
            SecretBox(TEST_SECRET_KEY),
            Settings(power_on_rack_delay_s=0),
            [spare_off, spare_on, baseline, dead, already],
            "operator:test",
            drivers=FakeBmc,
        )
    }
    assert reports[spare_off].ok and reports[spare_off].moved_to is ServerState.WARM
    assert not reports[spare_on].ok and "must be off" in reports[spare_on].message
    assert reports[baseline].ok and reports[baseline].moved_to is ServerState.BOOTING
    assert (baseline, "on") in FakeBmc.calls and (spare_off, "on") not in FakeBmc.calls
    assert not reports[dead].ok and "connection refused" in reports[dead].message
    assert reports[already].ok and reports[already].moved_to is None

    session.expire_all()
    states = {s.name: s.state for s in session.exec(select(Server))}
    assert states[spare_off] == "warm" and states[baseline] == "booting"
    assert states[spare_on] == "enrolled" and states[dead] == "enrolled"
    assert states[already] == "maintenance"
    moves = [(e.subject, e.to_state) for e in events(session, "server.transition")]
    assert (spare_off, "warm") in moves and (baseline, "booting") in moves


def patch_pool(db: Engine, name: str, pool: str) -> None:
    with Session(db) as s:
        row = s.exec(select(Server).where(Server.name == name)).one()
        row.pool = Pool(pool)
        s.add(row)
        s.commit()
