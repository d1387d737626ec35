"""The reconciler against real BMC EMULATORS (sushy-tools, OpenIPMI ipmi_sim), on both databases.

Changes are made behind Fleet's back with the emulators' own doors (a direct Redfish Reset,
`ipmitool chassis power`), then `reconcile_once` must notice them; a server whose own power
action is settling must be left alone; a dead BMC must be marked unreachable after K failures
and then read on the slower cadence.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site
from live import closed_port
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.lab.ipmi_sim import IpmiSim
from fleet.lab.sushy import FakeSystem, SushyEmulator
from fleet.lifecycle.states import ServerState
from fleet.models import BmcProtocol, Event, PowerState, Server, utcnow
from fleet.power.actions import power, server_power_lock
from fleet.power.measure import Meter
from fleet.power.reconciler import TickReport, reconcile_once
from fleet.settings import Settings

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

ON, OFF = PowerState.ON, PowerState.OFF
RF_PASSWORD = "rf-s3cret-pw"
IPMI_PASSWORD = "Sim-pass.42"
SETTLE_S = 15.0  # sushy applies a Reset 1-11 s late
BOX = SecretBox(TEST_SECRET_KEY)


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "bmc_call_timeout_s": 2.0,
        "bmc_total_timeout_s": 4.0,
        "bmc_backoff_s": 0.05,
        "power_on_rack_delay_s": 0.0,
        "power_settle_s": 60.0,
        "reconcile_failures": 3,
        "reconcile_unreachable_interval_s": 300.0,
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
def sushy() -> Iterator[SushyEmulator]:
    systems = [FakeSystem.new(f"rec-{i}") for i in range(2)]
    with SushyEmulator(systems, password=RF_PASSWORD) as emulator:
        yield emulator


@pytest.fixture
def ipmi() -> Iterator[IpmiSim]:
    with IpmiSim(IPMI_PASSWORD) as sim:
        yield sim


@pytest.fixture
def rack(session: Session) -> Any:
    return add_rack(session, add_site(session, "lab"), "r1")


def redfish_server(
    session: Session, rack: Any, name: str, emulator: SushyEmulator, system: str, state: str
) -> Server:
    return add_server(
        session,
        rack,
        name,
        state,
        u_position=1 + 8 * len(session.exec(select(Server)).all()),
        bmc_protocol=BmcProtocol.REDFISH,
        bmc_address="http://127.0.0.1",
        bmc_plain_http=True,
        bmc_port=emulator.port,
        bmc_username=emulator.username,
        bmc_system_id=system,
        bmc_password_encrypted=BOX.encrypt(RF_PASSWORD),
    )


def ipmi_server(session: Session, rack: Any, name: str, sim: IpmiSim, state: str) -> Server:
    return add_server(
        session,
        rack,
        name,
        state,
        u_position=1 + 8 * len(session.exec(select(Server)).all()),
        bmc_protocol=BmcProtocol.IPMI,
        bmc_address="127.0.0.1",
        bmc_port=sim.port,
        bmc_username=sim.username,
        bmc_system_id=None,
        bmc_password_encrypted=BOX.encrypt(IPMI_PASSWORD),
    )


def tick(db: Engine, **overrides: Any) -> TickReport:
    return reconcile_once(db, BOX, settings(**overrides))


def row(db: Engine, name: str) -> Server:
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        session.expunge(server)
        return server


def kinds(db: Engine, name: str, actor: str = "reconciler") -> list[str]:
    with Session(db) as session:
        return list(
            session.exec(
                select(Event.kind)
                .where(Event.subject == name, Event.actor == actor)
                .order_by(col(Event.id))
            )
        )


def test_a_change_behind_fleets_back_is_recorded_and_not_forced(
    db: Engine, session: Session, rack: Any, sushy: SushyEmulator, ipmi: IpmiSim
) -> None:
    system = sushy.fake_systems[0].uuid
    redfish_server(session, rack, "rf-warm", sushy, system, "warm")
    ipmi_server(session, rack, "ipmi-warm", ipmi, "warm")

    first = tick(db)  # both are off, as a warm spare should be
    assert (first.read, first.changed, first.mismatched, first.failed) == (2, 2, 0, 0)
    assert row(db, "rf-warm").power_state is OFF and row(db, "ipmi-warm").power_state is OFF
    quiet = tick(db)
    assert (quiet.read, quiet.changed) == (2, 0)  # nothing new: nothing recorded

    # Behind Fleet's back: ipmitool powers one on; a direct Redfish Reset the other.
    ipmi.set_power_behind_our_back(on=True)
    sushy.set_power_behind_our_back(system, "on")
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        tick(db)
        if row(db, "rf-warm").power_state is ON and row(db, "ipmi-warm").power_state is ON:
            break
        time.sleep(0.5)
    for name in ("rf-warm", "ipmi-warm"):
        server = row(db, name)
        assert server.power_state is ON, name  # the hardware wins for observed fields
        assert server.state == ServerState.WARM  # the lifecycle is not touched
        assert kinds(db, name)[-2:] == ["server.power_changed", "server.power_mismatch"]
    # Flagged, never forced: nothing switched the servers back off.
    assert ipmi.chassis_power() is True
    assert ipmi.log_calls() == ["set power 1"]  # only the operator's ipmitool call
    assert [r.method for r in sushy.resets(system)] == ["POST"]  # only the direct Reset
    assert sushy.read_power_state(system) == "On"


def test_a_server_whose_own_reset_is_settling_is_left_alone(
    db: Engine, session: Session, rack: Any, sushy: SushyEmulator
) -> None:
    system = sushy.fake_systems[1].uuid
    redfish_server(session, rack, "rf-boot", sushy, system, "warm")
    before = len(sushy.requests())
    reports = power(db, BOX, settings(), ["rf-boot"], "on", "operator:test")
    assert reports[0].ok and reports[0].sent
    server = row(db, "rf-boot")
    assert server.power_settle_until is not None and server.power_settle_until > utcnow()
    requests_after_action = len(sushy.requests())
    assert requests_after_action > before

    report = tick(db)
    assert (report.settling, report.read) == (1, 0)
    assert len(sushy.requests()) == requests_after_action  # not even a read went out
    assert kinds(db, "rf-boot") == []
    # Once the settle window has passed it is read again.
    later = reconcile_once(db, BOX, settings(), now=lambda: utcnow() + timedelta(seconds=61))
    assert later.read == 1 and later.settling == 0


def test_a_dead_bmc_is_marked_unreachable_after_k_failures_then_backs_off(
    db: Engine, session: Session, rack: Any
) -> None:
    add_server(
        session,
        rack,
        "dead",
        "warm",
        bmc_protocol=BmcProtocol.REDFISH,
        bmc_address="http://127.0.0.1",
        bmc_plain_http=True,
        bmc_port=closed_port(),
        bmc_password_encrypted=BOX.encrypt(RF_PASSWORD),
    )
    started = time.monotonic()
    for expected_failures in (1, 2):
        report = tick(db)
        assert report.failed == 1
        assert row(db, "dead").bmc_failures == expected_failures
    assert kinds(db, "dead") == []  # below K: counted quietly
    assert row(db, "dead").bmc_reachable is None
    third = tick(db)
    assert third.failed == 1
    dead = row(db, "dead")
    assert dead.bmc_reachable is False and dead.bmc_failures == 3
    assert kinds(db, "dead") == ["server.bmc_unreachable"]
    assert time.monotonic() - started < 3 * 4.0 + 5  # each read bounded by the total timeout

    backoff = tick(db)  # within the slower cadence: not even tried
    assert (backoff.backoff, backoff.read, backoff.failed) == (1, 0, 0)
    retried = reconcile_once(db, BOX, settings(), now=lambda: utcnow() + timedelta(seconds=301))
    assert retried.failed == 1 and kinds(db, "dead") == ["server.bmc_unreachable"]


def test_a_bmc_that_answers_again_is_marked_reachable(
    db: Engine, session: Session, rack: Any, ipmi: IpmiSim
) -> None:
    server = ipmi_server(session, rack, "flaky", ipmi, "warm")
    server.bmc_failures, server.bmc_reachable = 3, False
    server.bmc_checked_at = utcnow() - timedelta(seconds=600)
    session.add(server)
    session.commit()
    report = tick(db)
    assert report.read == 1 and report.failed == 0
    back = row(db, "flaky")
    assert back.bmc_reachable is True and back.bmc_failures == 0
    assert kinds(db, "flaky")[0] == "server.bmc_reachable"


def test_a_server_in_a_power_action_is_skipped_this_tick(
    db: Engine, session: Session, rack: Any, ipmi: IpmiSim
) -> None:
    server = ipmi_server(session, rack, "busy", ipmi, "warm")
    with server_power_lock(db, server):
        report = tick(db)
    assert (report.busy, report.read, report.failed) == (1, 0, 0)
    assert row(db, "busy").bmc_checked_at is None


def test_retired_servers_are_not_read(db: Engine, session: Session, rack: Any) -> None:
    add_server(session, rack, "gone", "retired", bmc_port=closed_port())
    report = tick(db)
    assert (report.read, report.failed, report.settling, report.backoff) == (0, 0, 0, 0)


def test_the_draw_of_a_server_found_on_is_read_from_its_bmc_and_nonsense_refused(
    db: Engine, session: Session, rack: Any, sushy: SushyEmulator
) -> None:
    """The lab's sushy-emulator serves the chassis Power resource (fleet/lab/sushy_power.py):
    the sweep reads it for a server that is on and stores it labelled "bmc"; an absurd figure
    changes nothing and is recorded once."""
    system = sushy.fake_systems[0].uuid
    redfish_server(session, rack, "rf-draw", sushy, system, "warm")
    meter = Meter(settings())
    sushy.set_power_watts(system, 4321.0)
    report = reconcile_once(db, BOX, settings(), meter=meter)
    assert report.metered == 0 and row(db, "rf-draw").drawn_w is None  # off: not asked

    sushy.set_power_behind_our_back(system, "on")
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and row(db, "rf-draw").drawn_w is None:
        reconcile_once(db, BOX, settings(), meter=meter)
        time.sleep(0.5)
    server = row(db, "rf-draw")
    assert (server.power_state, server.drawn_w, server.drawn_source) == (ON, 4321.0, "bmc")

    sushy.set_power_watts(system, -50.0)
    reconcile_once(db, BOX, settings(), meter=meter)
    reconcile_once(db, BOX, settings(), meter=meter)
    assert row(db, "rf-draw").drawn_w == 4321.0  # never believed
    with Session(db) as s:
        messages = list(
            s.exec(
                select(Event.message).where(
                    Event.subject == "rf-draw", Event.kind == "server.power_reading_refused"
                )
            )
        )
    assert len(messages) == 1 and "-50 W" in messages[0]
