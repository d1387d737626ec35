"""The rack budget gate end to end: a real `fleetctl serve` on a throwaway Postgres database in
front of the virtual colo (one real sushy-emulator holding every server's Redfish BMC; agents
start when a server powers on), driven through `fleetctl` as an operator and an admin would.

Two racks shaped like the demo's fra1-r01 (issue 21): four DGX H100 at 10.2 kW maximum (90 W
standby) on 2 × 415 V 32 A three-phase feeds a side, a 36,803 W budget. Three fit on (30,690 W
with the fourth at standby), the fourth does not: it needs 10,110 W and 6,113 W are left.

1. `fleetctl servers verify` of a rack of four baseline servers powers on three (booting) and
   leaves the fourth enrolled, unpowered (no Reset reached its BMC), with the refusal as its
   message.
2. `fleetctl servers power on --rack R` on a rack of four read off powers on three and refuses
   the fourth naming the watts. sushy applies a Reset 1-11 s late, so the BMCs of the first
   ones still read off when the last ones are admitted: the gate's write-ahead commitments must
   hold until the BMCs say on, or the fourth would be let in.
3. An operator's `--override-budget` is refused (403: an admin is needed); an admin's, with a
   reason, powers the fourth on, and the rack shows who overrode it, why and when, with a
   `rack.budget_override` Event.

The service runs without its control loops: nothing but the commands here powers a server on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from factories import TEST_SECRET_KEY
from live import make_token
from pg import world_database
from typer.testing import CliRunner, Result

from fleet import cli, db
from fleet.cli.lab import lab_token_maker
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import FAST_AGENT_SETTINGS, FAST_SERVICE_SETTINGS, ServeProcess, start_lab
from fleet.models import Role

pytestmark = pytest.mark.postgres

SITE = "gate1"
VERIFIED, POWERED = "gate1-r01", "gate1-r02"  # scenario 1's rack, scenarios 2 and 3's
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | {
    "FLEET_RUN_LOOPS": "false",
    "FLEET_LOG_LEVEL": "WARNING",
    # Both power-ons of a rack's stagger at once, the way an operator's bulk action runs.
    "FLEET_POWER_ON_PER_RACK": "2",
    "FLEET_POWER_ON_RACK_DELAY_S": "0.1",
    # An unconfirmed power-on holds its commitment for settle + one reconcile interval: longer
    # than this module runs.
    "FLEET_POWER_SETTLE_S": "15",
    "FLEET_RECONCILE_INTERVAL_S": "120",
}
NEEDS = "needs 10,110 W, headroom 6,113 W (budget 36,803 W, committed 30,690 W)"


def servers(rack: str) -> list[str]:
    return [f"{rack}-h100-0{i}" for i in range(1, 5)]


def inventory() -> str:
    """Two racks of four DGX H100 behind Redfish (the lab rewrites the BMCs to its sushy)."""
    feeds = [
        {"name": f"{side.lower()}{i}", "side": side, "volts": 415, "amps": 32, "phase": "three"}
        for side in "AB"
        for i in (1, 2)
    ]
    racks = [
        {
            "name": rack,
            "feeds": [dict(f) for f in feeds],  # no shared objects: no YAML aliases
            "servers": [
                {
                    "name": name,
                    "u": 1 + 8 * i,
                    "u_height": 8,
                    "pool": "baseline",
                    "gpu": {"model": "H100", "count": 8},
                    "power": {"idle_w": 1900, "standby_w": 90, "max_w": 10200},
                    "bmc": {
                        "protocol": "redfish",
                        "address": "10.0.0.1",
                        "port": 443,
                        "username": "admin",
                        "password": "not-used-by-the-lab",
                    },
                }
                for i, name in enumerate(servers(rack))
            ],
        }
        for rack in (VERIFIED, POWERED)
    ]
    return yaml.safe_dump({"sites": [{"name": SITE, "racks": racks}]}, sort_keys=False)


@dataclass
class World:
    service: ServeProcess
    colo: VirtualColo
    admin: str
    operator: str
    runner: CliRunner = field(default_factory=CliRunner)

    def fleetctl(self, *args: str, token: str | None = None) -> Result:
        env = {"FLEET_URL": self.service.url, "FLEET_TOKEN": token or self.admin}
        return self.runner.invoke(cli.app, list(args), env=env)

    def json(self, *args: str, token: str | None = None) -> tuple[int, Any]:
        result = self.fleetctl(*args, "-o", "json", token=token)
        try:
            return result.exit_code, json.loads(result.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"fleetctl {' '.join(args)}: {result.stdout}{result.stderr}")

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.admin}"}
        reply = httpx.request(
            method, f"{self.service.url}/api/v1{path}", headers=headers, timeout=30, **kwargs
        )
        assert reply.status_code < 400, f"{method} {path}: {reply.status_code} {reply.text}"
        return reply.json()

    def resets(self, name: str) -> int:
        """Reset POSTs sushy logged for the server's system (each one a power-on here)."""
        sushy = self.colo._sushy
        assert sushy is not None
        return len(sushy.resets(self.colo.state()["servers"][name]["system_id"]))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base: Path = tmp_path_factory.mktemp("gate-e2e")
    with ExitStack() as stack:
        url = world_database(stack, "fleet_gate_e2e")
        engine = db.make_engine(url)
        stack.callback(engine.dispose)
        db.upgrade(engine)
        service = ServeProcess(
            "serve",
            base,
            SERVICE_SETTINGS
            | {"FLEET_DATABASE_URL": url, "FLEET_SECRET_KEY": TEST_SECRET_KEY.decode()},
        )
        stack.callback(service.stop)
        service.start(admin_token=True)
        admin = service.admin_token()
        colo = start_lab(
            service.url,
            admin,
            inventory(),
            base / "lab",
            token_for=lab_token_maker(engine),
            boot_delay_s=0.5,
            agent_env=FAST_AGENT_SETTINGS,
        )
        stack.callback(colo.down)  # runs before service.stop: agents go first
        yield World(service, colo, admin, make_token(engine, Role.OPERATOR, name="ops"))


def test_verify_leaves_the_baseline_servers_past_the_budget_enrolled_with_the_reason(
    world: World,
) -> None:
    names = servers(VERIFIED)
    code, reply = world.json("servers", "verify", "--rack", VERIFIED)
    assert code == 1  # one server not verified into its state: the table says why
    results = {r["server"]: r for r in reply}
    booted = sorted(n for n, r in results.items() if r["moved_to"] == "booting")
    [left] = [n for n in names if n not in booted]
    assert len(booted) == 3, results
    assert results[left]["power_state"] == "off" and not results[left]["ok"]
    assert results[left]["message"].startswith(
        f"rack {VERIFIED}: powering on {left} {NEEDS}; it stays enrolled: make room in the rack, "
        f"or an admin powers it on with `fleetctl servers power on {left} --override-budget "
        "--reason TEXT`; then verify again"
    )
    row = world.api("GET", f"/servers/{left}")
    assert (row["state"], row["power_state"]) == ("enrolled", "off")
    assert world.resets(left) == 0  # nothing ever reached its BMC
    assert all(world.resets(n) == 1 for n in booted)


def test_power_on_of_a_rack_powers_on_what_fits_and_refuses_the_rest_naming_the_watts(
    world: World,
) -> None:
    names = servers(POWERED)
    code, read = world.json("servers", "power", "status", "--rack", POWERED)
    assert code == 0 and {r["state_after"] for r in read} == {"off"}
    code, reply = world.json("servers", "power", "on", "--rack", POWERED)
    assert code == 1
    assert [r["server"] for r in reply] == names  # the rack's servers, in name order
    on = [r["server"] for r in reply if r["ok"]]
    [refused] = [r for r in reply if not r["ok"]]
    assert len(on) == 3 and all(r["sent"] for r in reply if r["ok"])
    assert refused["error"] == (
        f"rack {POWERED}: powering on {refused['server']} {NEEDS}; an admin may override with "
        "--override-budget --reason TEXT"
    )
    assert not refused["sent"] and world.resets(refused["server"]) == 0
    rack = world.api("GET", f"/racks/{POWERED}")
    assert rack["committed_w"] == pytest.approx(30_690, abs=1)
    assert rack["budget_override_at"] is None


def test_an_admin_override_powers_it_on_and_is_recorded(world: World) -> None:
    # The one the gate refused: no Reset ever reached its BMC (sushy applies the others' late,
    # so the power state recorded for them may still say off).
    [refused] = [n for n in servers(POWERED) if world.resets(n) == 0]
    args = ("servers", "power", "on", refused, "--override-budget", "--reason", "load test, 1 h")
    # An operator may not.
    denied = world.fleetctl(*args, token=world.operator)
    assert denied.exit_code != 0 and "needs an admin" in denied.stdout + denied.stderr
    assert world.resets(refused) == 0
    # Without a reason, not even an admin (the CLI says so before asking).
    bare = world.fleetctl("servers", "power", "on", refused, "--override-budget")
    assert bare.exit_code != 0 and "--reason" in bare.stdout + bare.stderr
    reply = httpx.post(
        f"{world.service.url}/api/v1/power",
        json={"servers": [refused], "action": "on", "override_budget": True},
        headers={"Authorization": f"Bearer {world.admin}"},
        timeout=30,
    )
    assert reply.status_code == 422 and "reason" in reply.json()["detail"]
    # An admin with a reason: powered on, recorded on the rack and in an Event.
    code, [result] = world.json(*args)
    assert code == 0 and result["ok"] and result["sent"], result
    assert world.resets(refused) == 1
    rack = world.api("GET", f"/racks/{POWERED}")
    assert rack["budget_override_reason"] == "load test, 1 h"
    assert rack["budget_override_by"].startswith("admin:")
    assert rack["budget_override_at"] is not None
    assert rack["headroom_w"] < 0  # past the budget, as the admin asked
    [event] = world.api(
        "GET", "/events", params={"kind": "rack.budget_override", "subject": POWERED}
    )["results"]
    assert event["subject_type"] == "rack" and event["actor"] == rack["budget_override_by"]
    assert event["message"] == (
        f"budget overridden to power on {refused}: 3,997 W over (needs 10,110 W, headroom "
        "6,113 W); reason: load test, 1 h"
    )
    secrets = ("not-used-by-the-lab", TEST_SECRET_KEY.decode())
    assert not any(s in json.dumps([rack, event, result]) for s in secrets)
