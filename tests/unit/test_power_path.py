"""One power path (fleet/power/actions.py `act_on`): an operator's power action and the
provisioner's boot record the same observed fields and the same `server.power` event, and
fail the same way; on both databases, with a scripted BMC."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, feed
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.bmc.base import ActionResult, BmcInfo, BmcUnreachable, PowerDriver, Sensors
from fleet.crypto import SecretBox
from fleet.models import Deployment, Event, Pool, PowerState, Server
from fleet.power.actions import power
from fleet.provisioning.boots import boot_spares
from fleet.provisioning.tick import provision_once
from fleet.settings import Settings

BOX = SecretBox(TEST_SECRET_KEY)
OPERATOR, PROVISIONED = "r1-gpu0", "r1-gpu1"


class Bmc(PowerDriver):
    """Applies at once; per server name: the state, and whether it answers."""

    state: dict[str, PowerState] = {}
    unreachable: set[str] = set()

    def power_state(self) -> PowerState:
        if self.target.server in self.unreachable:
            raise BmcUnreachable(self.target, "connection refused")
        return self.state.get(self.target.server, PowerState.OFF)

    def _set(self, action: str, want: PowerState) -> ActionResult:
        before = self.power_state()
        self.state[self.target.server] = want
        return ActionResult(action, before != want, before, want)  # type: ignore[arg-type]

    def power_on(self) -> ActionResult:
        return self._set("on", PowerState.ON)

    def power_off(self, force: bool = False) -> ActionResult:
        return self._set("force_off" if force else "off", PowerState.OFF)

    def power_cycle(self) -> ActionResult:
        return self._set("cycle", PowerState.ON)

    def identify(self, on: bool = True) -> None: ...

    def info(self) -> BmcInfo:
        return BmcInfo()

    def sensors(self) -> Sensors:
        return Sensors()


@pytest.fixture
def fleet(session: Session) -> None:
    """In one rack, a server just enrolled (for the operator) and a warm spare (for the
    provisioner), both BMCs last seen failing; a deployment for the spare."""
    Bmc.state, Bmc.unreachable = {}, set()
    rack = add_rack(session, add_site(session, "s1"), "r1", feeds=[feed("A"), feed("B")])
    for i, (name, state) in enumerate(((OPERATOR, None), (PROVISIONED, "warm"))):
        server = add_server(
            session,
            rack,
            name,
            state,
            u_position=1 + 8 * i,
            bmc_system_id=name,
            pool=Pool.WARM,
            max_w=4000.0,
            standby_w=50.0,
        )
        # What a few failed reconciler reads leave: the one power path must clear it.
        server.bmc_reachable, server.bmc_failures = False, 2
        session.add(server)
    session.add(
        Deployment(
            name="llama",
            model_uri="s3://m/llama-8b",
            model_checksum="sha256:1",
            engine_params={"backend": "pytorch"},
            gpus_per_replica=8,
            gpu_models=["H100"],
            max_replicas=8,
            sla_p95_latency_ms=2000,
            sla_ttft_ms=300,
            target_servers=0,
        )
    )
    session.commit()


def operator_powers_on(db: Engine) -> None:
    power(db, BOX, Settings(), [OPERATOR], "on", "operator:test", drivers=Bmc)


def provisioner_boots(db: Engine) -> None:
    result = boot_spares(db, "llama", 1, "operator:test", raise_target=True)
    assert result.booted == (PROVISIONED,)
    provision_once(db, BOX, Settings(), drivers=Bmc)


def observed(db: Engine, name: str) -> dict[str, Any]:
    """The fields a power action records; timestamps as whether they are set."""
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        fields: dict[str, Any] = {
            "power_state": server.power_state,
            "bmc_reachable": server.bmc_reachable,
            "bmc_failures": server.bmc_failures,
        }
        for stamp in ("power_state_at", "bmc_checked_at", "power_settle_until"):
            fields[stamp] = isinstance(getattr(server, stamp), datetime)
        return fields


def power_events(db: Engine, name: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, message without the actor's part, details) of the server's power events."""
    with Session(db) as session:
        rows = session.exec(
            select(Event)
            .where(Event.subject == name, col(Event.kind).startswith("server.power"))
            .order_by(col(Event.id))
        )
        return [(e.kind, e.message.replace(name, "<server>"), dict(e.details)) for e in rows]


def test_operator_and_provisioner_record_the_same_fields_and_event(db: Engine, fleet: None) -> None:
    operator_powers_on(db)
    provisioner_boots(db)
    assert Bmc.state == {OPERATOR: PowerState.ON, PROVISIONED: PowerState.ON}
    expected = {
        "power_state": PowerState.ON,
        "bmc_reachable": True,
        "bmc_failures": 0,
        "power_state_at": True,
        "bmc_checked_at": True,
        "power_settle_until": True,  # a command went out: the reconciler lets it settle
    }
    assert observed(db, OPERATOR) == observed(db, PROVISIONED) == expected
    event = (
        "server.power",
        "power on: sent; was off, BMC now reports on",
        {"action": "on", "power_state": "on", "sent": True, "before": "off"},
    )
    assert power_events(db, OPERATOR) == power_events(db, PROVISIONED) == [event]


def test_operator_and_provisioner_record_a_failure_the_same_way(db: Engine, fleet: None) -> None:
    Bmc.unreachable = {OPERATOR, PROVISIONED}
    operator_powers_on(db)
    provisioner_boots(db)
    assert observed(db, OPERATOR) == observed(db, PROVISIONED)
    assert observed(db, PROVISIONED)["bmc_reachable"] is False
    failed = power_events(db, PROVISIONED)
    assert power_events(db, OPERATOR) == failed
    assert [(kind, details) for kind, _, details in failed] == [
        ("server.power_failed", {"action": "on", "error": "BmcUnreachable"})
    ]
