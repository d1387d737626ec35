"""The rack budget gate (fleet/power/gate.py): its pure rule, and every path that powers a
server on through it (operator on/cycle, single and bulk; verify of baseline servers), on SQLite
and on Postgres, with in-process fake BMCs (tests/fake_bmcs.py).

The rack is the demo's fra1-r01: four DGX H100 (10.2 kW max, 90 W standby) on 2 × 415 V 32 A
three-phase feeds a side, 36,803 W: three fit on, the fourth does not (40.8 kW).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, ClassVar

import httpx
import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, walk_to
from fake_bmcs import ActingBmc
from live import Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.bmc.base import ActionResult, BmcUnreachable
from fleet.bmc.bulk import Stagger
from fleet.crypto import SecretBox
from fleet.errors import ConflictError
from fleet.lifecycle.states import ServerState
from fleet.models import Event, Pool, PowerState, Rack, Role, Server, utcnow
from fleet.power import gate
from fleet.power.actions import PowerReport, power, server_power_lock, verify
from fleet.power.gate import BudgetRefused, Override, power_on_need
from fleet.power.racks import RackView, rack_views
from fleet.settings import Settings

ON, OFF = PowerState.ON, PowerState.OFF
RACK = "fra1-r01"
SERVERS = [f"{RACK}-h100-0{i}" for i in range(1, 5)]
FEED = {"volts": 415, "amps": 32, "phase": "three"}
BUDGET_W = 36_803  # 2 × 18,401.6 W a side
MAX_W, STANDBY_W = 10_200.0, 90.0
EXTRA_W = MAX_W - STANDBY_W  # 10,110 W: what powering one on adds
SETTINGS = Settings(
    power_settle_s=20, bmc_total_timeout_s=30, reconcile_interval_s=60, power_on_rack_delay_s=0
)
ADMIN, OPERATOR = "admin:root", "operator:ops"


class RackBmc(ActingBmc):
    """A BMC that applies at once, except for the servers in `late` (a power-on the BMC has
    taken but not applied yet: it reads off, as sushy-tools does for 1-11 s); `unreachable`
    ones refuse the connection. Every command that went out is in `calls`."""

    state: ClassVar[dict[str, PowerState]] = {}
    calls: ClassVar[list[tuple[str, str]]] = []
    late: ClassVar[set[str]] = set()
    unreachable: ClassVar[set[str]] = set()
    lock = threading.Lock()

    def power_state(self) -> PowerState:
        if self.target.server in self.unreachable:
            raise BmcUnreachable(self.target, "connection refused")
        with self.lock:
            return self.state.get(self.target.server, OFF)

    def _send(self, action: str, want: PowerState) -> ActionResult:
        before = self.power_state()
        if before is want and action != "cycle":
            return ActionResult(action, False, before, before)  # type: ignore[arg-type]
        with self.lock:
            self.calls.append((self.target.server, action))
            if self.target.server not in self.late:
                self.state[self.target.server] = want
        return ActionResult(action, True, before, self.power_state())  # type: ignore[arg-type]


@pytest.fixture
def rack(session: Session) -> list[str]:
    """fra1-r01 with its four DGX H100, enrolled, no BMC read yet; one more rack with power to
    spare beside it (the gate is per rack)."""
    RackBmc.state, RackBmc.calls, RackBmc.late, RackBmc.unreachable = {}, [], set(), set()
    site = add_site(session, "fra1")
    feeds = [{"side": side, **FEED} for side in "AABB"]
    r01 = add_rack(session, site, RACK, feeds=feeds)
    for i, name in enumerate(SERVERS):
        add_server(
            session,
            r01,
            name,
            u_position=1 + 8 * i,
            bmc_system_id=name,
            pool=Pool.BASELINE,
            max_w=MAX_W,
            standby_w=STANDBY_W,
        )
    big = [{"side": side, **FEED, "amps": 63} for side in "AB"]
    roomy = add_rack(session, site, "fra1-r02", feeds=big)
    add_server(session, roomy, "fra1-r02-h100-01", bmc_system_id="r02-1", pool=Pool.BASELINE)
    return SERVERS


def act(db: Engine, names: list[str], action: str, **kwargs: Any) -> list[PowerReport]:
    return power(
        db,
        SecretBox(TEST_SECRET_KEY),
        SETTINGS,
        names,
        action,  # type: ignore[arg-type]
        OPERATOR,
        # One power-on per rack at a time: the admissions (and so the refusals) in name order.
        # Racing admissions are test_two_admissions_racing_for_the_last_headroom_one_wins's.
        stagger=Stagger(workers=8, per_rack=1, rack_delay=0),
        drivers=RackBmc,
        **kwargs,
    )


def headroom(session: Session, rack: str = RACK) -> float:
    session.expire_all()
    [view] = rack_views(session, rack=rack)
    return view.power.headroom_w


def server(session: Session, name: str) -> Server:
    session.expire_all()
    return session.exec(select(Server).where(Server.name == name)).one()


def events(session: Session, kind: str) -> list[Event]:
    return list(session.exec(select(Event).where(Event.kind == kind).order_by(col(Event.id))))


# ---------------------------------------------------------------------------------------------
# The rule


def need(**kw: Any) -> gate.Need:
    base: dict[str, Any] = {
        "rack": "r",
        "server": "s",
        "budget_w": 36_800.0,
        "committed_w": 30_690.0,
        "on_w": MAX_W,
        "standby_w": STANDBY_W,
        "counted_on": False,
        "known_on": False,
    }
    return power_on_need(**(base | kw))


def test_a_server_off_needs_its_max_less_its_standby() -> None:
    refused = need()
    assert (refused.needed_w, refused.headroom_w, refused.fits) == (EXTRA_W, 6_110.0, False)
    assert refused.over_w == EXTRA_W - 6_110.0
    assert need(committed_w=26_690.0).fits  # 10,110 W in 10,110 W: fits exactly
    assert need(committed_w=26_690.0).over_w == 0.0


def test_a_server_known_on_adds_nothing_even_past_the_budget() -> None:
    cycle = need(committed_w=40_800.0, counted_on=True, known_on=True)
    assert cycle.needed_w == 0.0 and cycle.fits


def test_a_server_counted_on_for_want_of_a_reading_is_checked_as_off() -> None:
    # The rack counts it at its maximum already (no reading): it fits only where the rack,
    # counting it on, is still inside its budget.
    assert need(committed_w=36_000.0, counted_on=True).fits
    unknown = need(committed_w=40_800.0, counted_on=True)
    assert not unknown.fits
    assert (unknown.needed_w, unknown.committed_w) == (EXTRA_W, 40_800.0 - EXTRA_W)


def test_the_refusal_names_the_rack_the_server_the_watts_and_the_headroom() -> None:
    message = gate.refusal_message(need(rack="fra1-r01", server="fra1-r01-s04"))
    assert message == (
        "rack fra1-r01: powering on fra1-r01-s04 needs 10,110 W, headroom 6,110 W (budget "
        "36,800 W, committed 30,690 W); an admin may override with --override-budget "
        "--reason TEXT"
    )
    assert issubclass(BudgetRefused, ConflictError) and BudgetRefused.status_code == 409


def test_an_override_needs_a_reason() -> None:
    with pytest.raises(Exception, match="needs a reason"):
        Override(actor=ADMIN, reason="  ")


# ---------------------------------------------------------------------------------------------
# Operator power-ons


def test_bulk_power_on_powers_on_what_fits_and_refuses_the_rest(
    db: Engine, session: Session, rack: list[str]
) -> None:
    act(db, rack, "status")  # read first: a server with no reading counts as on
    assert headroom(session) == pytest.approx(BUDGET_W - 4 * STANDBY_W, abs=1)
    reports = act(db, rack, "on")
    on = [r.server for r in reports if r.ok]
    refused = [r for r in reports if not r.ok]
    assert on == rack[:3]
    [last] = refused
    assert last.server == rack[3] and not last.sent
    assert last.error == (
        f"rack {RACK}: powering on {rack[3]} needs 10,110 W, headroom 6,113 W (budget 36,803 W, "
        "committed 30,690 W); an admin may override with --override-budget --reason TEXT"
    )
    assert (rack[3], "on") not in RackBmc.calls and RackBmc.state.get(rack[3], OFF) is OFF
    # The BMCs said on: the recorded power state counts, the write-ahead commitment is gone.
    assert all(server(session, n).power_committed_until is None for n in rack)
    assert headroom(session) == pytest.approx(BUDGET_W - 3 * MAX_W - STANDBY_W, abs=1)
    assert not events(session, "server.power_failed")  # a refusal sends and records nothing
    # The other rack is not this one's business.
    [other] = act(db, ["fra1-r02-h100-01"], "on")
    assert other.ok and other.sent


def test_unknown_power_counts_as_on_so_an_unread_rack_refuses_everything(
    db: Engine, session: Session, rack: list[str]
) -> None:
    # 4 × 10.2 kW counted on a 36.8 kW budget: none may be powered on before a reading says
    # they are off, since any of them could be on already.
    reports = act(db, rack, "on")
    assert not any(r.ok for r in reports)
    assert all("needs 10,110 W, headroom 6,113 W" in (r.error or "") for r in reports)
    assert RackBmc.calls == []


def test_a_cycle_of_a_server_counted_on_adds_nothing(
    db: Engine, session: Session, rack: list[str]
) -> None:
    act(db, rack, "status")
    act(db, rack[:3], "on")
    [refused] = act(db, [rack[3]], "cycle")
    assert not refused.ok and "needs 10,110 W" in (refused.error or "")
    cycles = act(db, rack[:3], "cycle")
    assert all(r.ok and r.sent for r in cycles)


def test_an_unconfirmed_power_on_keeps_its_commitment(
    db: Engine, session: Session, rack: list[str]
) -> None:
    act(db, rack, "status")
    RackBmc.late = {rack[0]}  # the BMC applies it later: the read-back still says off
    [late] = act(db, [rack[0]], "on")
    assert late.ok and late.sent and late.state_after is OFF
    row = server(session, rack[0])
    assert row.power_state is OFF and row.power_committed_until is not None
    # Held past the settle window until the reconciler has read it again.
    assert row.power_committed_until > utcnow() + timedelta(seconds=SETTINGS.power_settle_s)
    # Still counted at its maximum: the fourth power-on does not fit.
    reports = act(db, rack[1:], "on")
    assert [r.ok for r in reports] == [True, True, False]


def test_a_failed_power_on_keeps_its_commitment_and_a_busy_one_drops_it(
    db: Engine, session: Session, rack: list[str]
) -> None:
    act(db, rack, "status")
    RackBmc.unreachable = {rack[0]}  # it may have gone out: keep counting it
    [failed] = act(db, [rack[0]], "on")
    assert not failed.ok and "connection refused" in (failed.error or "")
    assert server(session, rack[0]).power_committed_until is not None
    with server_power_lock(db, server(session, rack[1])):  # busy: nothing went out
        [busy] = act(db, [rack[1]], "on")
    assert not busy.ok and "another power action" in (busy.error or "")
    assert server(session, rack[1]).power_committed_until is None


# ---------------------------------------------------------------------------------------------
# The admin's override


def test_an_admin_override_powers_on_and_is_recorded_until_the_draw_is_back(
    db: Engine, session: Session, rack: list[str]
) -> None:
    act(db, rack, "status")
    act(db, rack[:3], "on")
    override = Override(actor=ADMIN, reason="customer demo, breaker rated 40 kW")
    [report] = act(db, [rack[3]], "on", override=override)
    assert report.ok and report.sent
    session.expire_all()
    row = session.exec(select(Rack).where(Rack.name == RACK)).one()
    assert row.budget_override_reason == "customer demo, breaker rated 40 kW"
    assert row.budget_override_by == ADMIN and row.budget_override_at is not None
    [event] = events(session, "rack.budget_override")
    assert (event.subject_type, event.subject, event.actor) == ("rack", RACK, ADMIN)
    assert event.message == (
        f"budget overridden to power on {rack[3]}: 3,997 W over (needs 10,110 W, headroom "
        "6,113 W); reason: customer demo, breaker rated 40 kW"
    )
    assert event.details["server"] == rack[3] and event.details["over_w"] == pytest.approx(3997, 1)
    # Past the budget: the record stays.
    assert gate.clear_settled_overrides(session) == []
    assert headroom(session) < 0
    # Back inside it (one powered off): cleared, with an Event.
    act(db, [rack[0]], "off")
    assert gate.clear_settled_overrides(session) == [RACK]
    session.expire_all()
    row = session.exec(select(Rack).where(Rack.name == RACK)).one()
    assert (row.budget_override_reason, row.budget_override_by, row.budget_override_at) == (
        None,
        None,
        None,
    )
    [cleared] = events(session, "rack.budget_override_cleared")
    assert cleared.subject == RACK and "back inside its budget 36,803 W" in cleared.message
    assert gate.clear_settled_overrides(session) == []


def test_an_override_that_is_not_needed_records_nothing(
    db: Engine, session: Session, rack: list[str]
) -> None:
    act(db, rack, "status")
    [report] = act(db, [rack[0]], "on", override=Override(actor=ADMIN, reason="just in case"))
    assert report.ok
    session.expire_all()
    assert session.exec(select(Rack).where(Rack.name == RACK)).one().budget_override_at is None
    assert events(session, "rack.budget_override") == []


# ---------------------------------------------------------------------------------------------
# Verify of baseline servers


def run_verify(db: Engine, names: list[str]) -> dict[str, Any]:
    reports = verify(db, SecretBox(TEST_SECRET_KEY), SETTINGS, names, OPERATOR, drivers=RackBmc)
    return {r.server: r for r in reports}


def test_verify_powers_on_the_baseline_servers_that_fit_and_leaves_the_rest_enrolled(
    db: Engine, session: Session, rack: list[str]
) -> None:
    reports = run_verify(db, rack)
    booted = [n for n in rack if reports[n].moved_to is ServerState.BOOTING]
    assert booted == rack[:3]
    left = reports[rack[3]]
    assert not left.ok and left.moved_to is None and left.power_state is OFF
    assert left.message.startswith(f"rack {RACK}: powering on {rack[3]} needs 10,110 W")
    assert left.message.endswith(
        f"`fleetctl servers power on {rack[3]} --override-budget --reason TEXT`; then verify again"
    )
    assert server(session, rack[3]).state == ServerState.ENROLLED
    # Its state was read and recorded (no longer unknown), and nothing was sent to it.
    assert server(session, rack[3]).power_state is OFF
    assert (rack[3], "on") not in RackBmc.calls
    assert headroom(session) == pytest.approx(BUDGET_W - 3 * MAX_W - STANDBY_W, abs=1)
    # Verifying again once there is room (one booted server failed and was powered off).
    with Session(db) as again:
        failed = again.exec(select(Server).where(Server.name == rack[0])).one()
        walk_to(again, failed, ServerState.FAILED)
    act(db, [rack[0]], "off")
    assert run_verify(db, [rack[3]])[rack[3]].moved_to is ServerState.BOOTING


def test_verify_moves_a_baseline_server_found_on_without_a_power_on(
    db: Engine, session: Session, rack: list[str]
) -> None:
    RackBmc.state = dict.fromkeys(rack, ON)  # all four on already: nothing to gate
    reports = run_verify(db, rack)
    assert all(reports[n].moved_to is ServerState.BOOTING for n in rack)
    assert all(reports[n].message == "BMC verified; baseline server already on" for n in rack)
    assert RackBmc.calls == []


def test_verify_reports_an_unreadable_bmc_and_moves_a_spare_found_off(
    db: Engine, session: Session, rack: list[str]
) -> None:
    with Session(db) as again:
        spare = again.exec(select(Server).where(Server.name == rack[1])).one()
        spare.pool = Pool.WARM
        again.add(spare)
        again.commit()
    RackBmc.unreachable = {rack[0]}
    reports = run_verify(db, rack[:2])
    assert not reports[rack[0]].ok and "connection refused" in reports[rack[0]].message
    assert reports[rack[1]].moved_to is ServerState.WARM


# ---------------------------------------------------------------------------------------------
# Two admissions racing for the last headroom


def test_two_admissions_racing_for_the_last_headroom_one_wins(
    db: Engine, session: Session, rack: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    act(db, rack, "status")
    act(db, rack[:2], "on")  # 16,223 W left: room for one more, not two

    def slow_views(*args: Any, **kwargs: Any) -> list[RackView]:
        # Between the read and the write: without the lock both would read the same headroom.
        views = rack_views(*args, **kwargs)
        time.sleep(0.3)
        return views

    monkeypatch.setattr(gate, "rack_views", slow_views)
    start = threading.Barrier(2)
    won: list[gate.Admission] = []
    lost: list[BudgetRefused] = []

    def race(name: str) -> None:
        start.wait(timeout=10)
        try:
            won.append(gate.admit(db, SETTINGS, name, OPERATOR))
        except BudgetRefused as refused:
            lost.append(refused)

    threads = [threading.Thread(target=race, args=(n,)) for n in rack[2:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1 and len(lost) == 1, (won, lost)
    assert lost[0].need.server != won[0].server and lost[0].need.needed_w == EXTRA_W
    # The winner's commitment counts at once, before any BMC has answered.
    assert server(session, won[0].server).power_committed_until is not None
    assert headroom(session) == pytest.approx(BUDGET_W - 3 * MAX_W - STANDBY_W, abs=1)


# ---------------------------------------------------------------------------------------------
# The API: who may override, and the reason


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with serve(engine, tmp_path_factory.mktemp("gate")) as server:
        yield server


def client(live: Live, role: Role) -> httpx.Client:
    return live.client(live.token(role, name=role.value))


@pytest.mark.parametrize("path", ["/api/v1/power", f"/api/v1/servers/{SERVERS[3]}/power"])
def test_an_override_without_a_reason_is_422_naming_the_field(
    live: Live, rack: list[str], path: str
) -> None:
    body: dict[str, Any] = {"action": "on", "override_budget": True}
    if path == "/api/v1/power":
        body["servers"] = [SERVERS[3]]
    reply = client(live, Role.ADMIN).post(path, json=body)
    assert reply.status_code == 422 and "reason" in reply.json()["detail"], reply.text
    blank = client(live, Role.ADMIN).post(path, json=body | {"reason": "   "})
    assert blank.status_code == 422 and "reason" in blank.json()["detail"], blank.text


@pytest.mark.parametrize("path", ["/api/v1/power", f"/api/v1/servers/{SERVERS[3]}/power"])
def test_an_override_by_an_operator_is_403_naming_the_admin(
    live: Live, rack: list[str], path: str
) -> None:
    body: dict[str, Any] = {"action": "on", "override_budget": True, "reason": "because"}
    if path == "/api/v1/power":
        body["servers"] = [SERVERS[3]]
    reply = client(live, Role.OPERATOR).post(path, json=body)
    assert reply.status_code == 403, reply.text
    assert "needs an admin" in reply.json()["detail"]
    assert RackBmc.calls == []


def test_power_request_schema_states_the_reason_rule() -> None:
    from fleet.api.routes.power import BulkPowerRequest, PowerRequest

    for model in (PowerRequest, BulkPowerRequest):
        schema = model.model_json_schema()
        assert {"properties": {"override_budget": {"const": False}}} in schema["anyOf"]
    assert "oneOf" in BulkPowerRequest.model_json_schema()  # servers or select, still
