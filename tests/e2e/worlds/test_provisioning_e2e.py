"""Provisioning end to end: a real `fleetctl serve` on a throwaway Postgres database drives the
virtual colo (real BMC emulators: one sushy-emulator, one ipmi_sim per IPMI server; real agents
with stand-in engines) through fleet/provisioning/tick.py's workflows.

One service, one lab and one deployment are shared by the module (start-up is the expensive
part on a 2-core machine); each test waits for the fleet to settle first and asks for the
servers it needs, so the tests do not depend on their order.

1. `fleetctl spares boot --count 3` follows three spares booting → loading → serving; their
   engines answer completions; `fleetctl events --follow` shows every step.
2. A spare with a wrong BMC password and one whose agent is refused (a bogus token), chosen
   first by placement (the model is cached on them), both end `failed` with the reason; other
   spares take their places.
3. A fatal Xid on a serving server with streams in flight: no stream is cut, the server drains,
   is power cycled and serves again; the third time it is quarantined and a replacement serves.
4. SIGKILL of the service between the BMC call of a boot and its database write, then a
   restart on the same database and port: the boot finishes, with exactly one power-on per
   server in the emulators' logs.
5. Two concurrent `spares boot` calls for a rack's last headroom: one wins, the other's reply
   names the rack and the watts.
6. Faults on ~30 % of the servers at once open the breaker: no drain or cycle until
   `fleetctl autopilot resume`; then the remediation proceeds.

`pytest -s` prints the figures (boot times, where the SIGKILL landed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from factories import TEST_SECRET_KEY
from pg import world_database
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner, Result

from fleet import cli, db
from fleet.cli.lab import lab_token_maker
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    ServeProcess,
    start_lab,
)
from fleet.lab.harness import wait_for as _wait_for
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, Server

pytestmark = pytest.mark.postgres

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

# The service: the harness's fast loops, with deadlines of this module's own (the tests wait on
# them) that the lab's Redfish delays (sushy applies a Reset 1-11 s late, then the boot delay,
# the agent's start, the engines' load) fit in with room to spare.
BOOT_DEADLINE_S = 25.0
LOAD_DEADLINE_S = 30.0
DRAIN_DEADLINE_S = 30.0
BREAKER_WINDOW_S = 12.0
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | {
    "FLEET_BOOT_DEADLINE_S": str(BOOT_DEADLINE_S),
    "FLEET_LOAD_DEADLINE_S": str(LOAD_DEADLINE_S),
    "FLEET_DRAIN_DEADLINE_S": str(DRAIN_DEADLINE_S),
    "FLEET_LOG_LEVEL": "WARNING",  # not a line per request: the machine has 2 cores
    # The breaker counts servers turned unhealthy within this window (600 s by default): short
    # here, so that scenario 6 can wait it out (see the bug it works around there).
    "FLEET_BREAKER_WINDOW_S": str(BREAKER_WINDOW_S),
}
# The lab: the harness's fast agents (heartbeats every 0.5 s, samples every 0.2 s, stand-in
# engines that load in 0.5 s).
BOOT_DELAY_S = 0.5
AGENT_ENV = FAST_AGENT_SETTINGS
# One workflow from `spares boot` to serving, on a busy 2-core machine: an upper bound.
SERVE_TIMEOUT_S = 60.0

SITE = "e2e"
R1, R2, R3 = "e2e-r01", "e2e-r02", "e2e-r03"
DEPLOYMENT = "llama-8b"
MODEL_URI = "s3://models/llama-3.1-8b"
MODEL, MODEL_VERSION = "llama-3.1-8b", "v1"
# 4-GPU H100 boxes: one 4-GPU replica each, so one stand-in engine per agent (the processes a
# 2-core machine runs at once stay few).
H100_GPUS = 4
GPUS_PER_REPLICA = 4
# Scenario 2's spares (out of the warm pool until that test puts them in).
BAD_PASSWORD = f"{R1}-h100-bad-pw"  # Redfish
BAD_TOKEN = f"{R2}-h100-bad-token"  # IPMI
# Scenario 5's rack: two 4-GPU L40S spares, power for one more boot only.
L40S = (f"{R3}-l40s-1", f"{R3}-l40s-2")
L40S_MAX_W, L40S_STANDBY_W = 2500.0, 60.0
SETTLED = frozenset({"warm", "serving", "failed", "quarantined", "enrolled"})


# Polled every 0.2 s: waits read the API and the database at most five times a second.
wait_for = partial(_wait_for, every=0.2)


# ---------------------------------------------------------------------------------------------
# The inventory


def _server(u: int, name: str, protocol: str, gpu: str = "H100") -> dict[str, Any]:
    bmc = {"protocol": protocol, "address": "10.0.0.1", "port": 623}  # the lab rewrites it
    bmc |= {"username": "root", "password": "not-used-by-the-lab"}
    power: dict[str, float]
    if gpu == "H100":
        gpus, power = H100_GPUS, {"idle_w": 1100, "standby_w": 80, "max_w": 5600}
    else:
        gpus, power = 4, {"idle_w": 900, "standby_w": L40S_STANDBY_W, "max_w": L40S_MAX_W}
    return {
        "name": name,
        "u": u,
        "u_height": 4,
        "gpu": {"model": gpu, "count": gpus},
        "power": power,
        "bmc": bmc,
    }


def inventory() -> str:
    """Two racks of six H100 servers (Redfish and IPMI mixed; one of each rack is scenario
    2's), power for all of them; a third rack of two L40S with power for one boot."""
    # Names in placement's tie-break order alternate the protocols, so both boot early on.
    protocols = {
        R1: ["redfish", "ipmi", "redfish", "ipmi", "ipmi"],
        R2: ["ipmi", "redfish", "ipmi", "redfish", "redfish"],
    }
    h100 = {
        rack: [(f"{rack}-h100-{i}", p) for i, p in enumerate(ps, 1)]
        for rack, ps in protocols.items()
    }
    h100[R1].append((BAD_PASSWORD, "redfish"))
    h100[R2].append((BAD_TOKEN, "ipmi"))
    big = [  # 415 V × 63 A × √3 × 80 % ≈ 36 kW per side: six servers at 5.6 kW fit
        {"name": f"{side.lower()}1", "side": side, "volts": 415, "amps": 63, "phase": "three"}
        for side in "AB"
    ]
    # 230 V × 16 A × 80 % = 2,944 W per side; two spares off commit 120 W: 2,824 W headroom, a
    # boot commits 2,440 W more, so exactly one fits.
    small = [{"name": f"{s.lower()}1", "side": s, "volts": 230, "amps": 16} for s in "AB"]
    racks = [
        {
            "name": rack,
            "feeds": [dict(f) for f in big],  # no shared objects: no YAML aliases
            "servers": [
                _server(1 + 4 * i, name, protocol) for i, (name, protocol) in enumerate(servers)
            ],
        }
        for rack, servers in h100.items()
    ]
    racks.append(
        {
            "name": R3,
            "feeds": small,
            "servers": [_server(1 + 4 * i, n, "ipmi", "L40S") for i, n in enumerate(L40S)],
        }
    )
    return yaml.safe_dump({"sites": [{"name": SITE, "racks": racks}]}, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# The world: service + lab + database, and what the tests ask of them


@dataclass
class World:
    service: ServeProcess
    colo: VirtualColo
    engine: Engine
    token: str
    workdir: Path
    runner: CliRunner = field(default_factory=CliRunner)

    # -- API and CLI -------------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        reply = httpx.request(
            method, f"{self.service.url}/api/v1{path}", headers=headers, timeout=30, **kwargs
        )
        assert reply.status_code < 400, f"{method} {path}: {reply.status_code} {reply.text}"
        return reply.json()

    def fleetctl(self, *args: str) -> Result:
        env = {"FLEET_URL": self.service.url, "FLEET_TOKEN": self.token}
        return self.runner.invoke(cli.app, list(args), env=env)

    def server(self, name: str) -> dict[str, Any]:
        row: dict[str, Any] = self.api("GET", f"/servers/{name}")
        return row

    def patch_server(self, name: str, **fields: Any) -> None:
        self.api("PATCH", f"/servers/{name}", json=fields)

    def mark_cached(self, name: str, deployment: str = DEPLOYMENT) -> None:
        """Record, as its agent's last cache report would, that `name` holds the deployment's
        version: placement then picks it first. (A warm spare's agent is off: nothing
        overwrites it until the server boots and its agent reports its real cache.)"""
        key = self.api("GET", f"/deployments/{deployment}")["model_version"]
        with Session(self.engine) as session:
            server = session.exec(select(Server).where(Server.name == name)).one()
            server.cache_entries = [{"key": key, "state": "ready", "bytes": 1}]
            session.add(server)
            session.commit()

    def events(self, after: int, subject: str | None = None, kind: str | None = None) -> list[Any]:
        """Events with an id above `after`, oldest first."""
        params: dict[str, Any] = {"limit": 1000}
        if subject is not None:
            params["subject"] = subject
        if kind is not None:
            params["kind"] = kind
        rows: list[dict[str, Any]] = self.api("GET", "/events", params=params)["results"]
        return sorted((r for r in rows if r["id"] > after), key=lambda r: r["id"])

    def last_event_id(self) -> int:
        rows = self.api("GET", "/events", params={"limit": 1})["results"]
        return int(rows[0]["id"]) if rows else 0

    def moves(self, name: str, after: int) -> list[tuple[str, str]]:
        return [
            (e["from_state"], e["to_state"]) for e in self.events(after, name, "server.transition")
        ]

    def autopilot(self) -> dict[str, Any]:
        row: dict[str, Any] = self.api("GET", "/autopilot")
        return row

    # -- the database (what the API does not show: deployments' servers and targets) --------

    def states(self) -> dict[str, str]:
        with Session(self.engine) as session:
            return {s.name: s.state.value for s in session.exec(select(Server))}

    def deployment_states(self, deployment: str = DEPLOYMENT) -> dict[str, str]:
        with Session(self.engine) as session:
            rows = session.exec(
                select(Server.name, Server.state)
                .join(Deployment, col(Deployment.id) == Server.deployment_id)
                .where(Deployment.name == deployment)
            )
            return {name: ServerState(state).value for name, state in rows}

    def serving(self, deployment: str = DEPLOYMENT) -> list[str]:
        return sorted(n for n, s in self.deployment_states(deployment).items() if s == "serving")

    def target(self, deployment: str = DEPLOYMENT) -> int:
        with Session(self.engine) as session:
            row = session.exec(select(Deployment).where(Deployment.name == deployment)).one()
            return row.target_servers

    def why(self) -> str:
        with Session(self.engine) as session:
            rows = sorted(session.exec(select(Server)), key=lambda s: s.name)
        listing = ", ".join(
            f"{s.name}: {s.state.value}" + (f" ({s.failed_reason})" if s.failed_reason else "")
            for s in rows
        )
        # An engine that never became ready says why in its agent's log.
        for s in rows:
            if (s.failed_reason or "").startswith("load deadline"):
                listing += f"\n{s.name}'s agent: {self.colo.agent_log_tail(s.name, 'replica')}"
        try:
            autopilot = json.dumps(self.autopilot())
        except (httpx.HTTPError, AssertionError) as exc:
            autopilot = repr(exc)
        return f"servers: {listing}\nautopilot: {autopilot}\n{self.service.tail()}"

    # -- the lab -----------------------------------------------------------------------------

    def protocol(self, name: str) -> str:
        return str(self.colo.state()["servers"][name]["protocol"])

    def power_ons(self, name: str) -> int:
        """Power-ons at the server's emulator (warm spares are off: VirtualColo.power_ons)."""
        return self.colo.power_ons(name)

    def chassis_calls(self, name: str) -> list[str]:
        entry = self.colo.state()["servers"][name]
        return (Path(entry["chassis_dir"]) / "chassis.log").read_text().splitlines()

    # -- waiting -----------------------------------------------------------------------------

    def settle(self, timeout: float = SERVE_TIMEOUT_S) -> None:
        """Until no workflow is under way: every server at rest, every deployment at target."""

        def settled() -> bool:
            if any(s not in SETTLED for s in self.states().values()):
                return False
            with Session(self.engine) as session:
                targets = {d.name: d.target_servers for d in session.exec(select(Deployment))}
            return all(len(self.serving(name)) == n for name, n in targets.items())

        wait_for("the fleet to settle", settled, timeout, why=self.why)

    def wait_serving(self, names: list[str], timeout: float = SERVE_TIMEOUT_S) -> None:
        def all_serving() -> bool:
            states = self.states()
            return all(states[n] == "serving" for n in names)

        wait_for(
            f"{', '.join(names)} serving",
            all_serving,
            timeout,
            why=self.why,
            give_up=lambda: self.any_failed(names),
        )

    def any_failed(self, names: list[str]) -> str | None:
        """Why waiting for these servers is hopeless: one of them failed."""
        states = self.states()
        failed = [n for n in names if states[n] == "failed"]
        return f"{', '.join(failed)} failed" if failed else None

    def ensure_serving(self, count: int) -> list[str]:
        """At least `count` servers serve the deployment (spares booted for the rest)."""
        self.settle()
        missing = count - len(self.serving())
        if missing > 0:
            booted = self.api(
                "POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": missing}
            )["booted"]
            assert len(booted) == missing, f"not enough warm spares: {self.why()}"
            self.wait_serving(booted)
        return self.serving()

    @contextmanager
    def spares_parked(self) -> Iterator[list[str]]:
        """No H100 spare in the warm pool meanwhile (they are moved to the baseline pool), so
        that no replacement boots while a server is out: a replacement would make a surplus
        once the server is back, and the surplus that returns to the pool might be that very
        server."""
        parked = self.warm_spares()
        try:
            for spare in parked:
                self.patch_server(spare, pool="baseline")
            yield parked
        finally:
            for spare in parked:
                self.patch_server(spare, pool="warm")

    def warm_spares(self, gpu_model: str = "H100") -> list[str]:
        params = {"state": "warm", "pool": "warm", "gpu_model": gpu_model, "limit": 1000}
        return sorted(r["name"] for r in self.api("GET", "/servers", params=params)["results"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The module's service, lab and deployment; everything stopped (and the database
    dropped) at the end, whatever happened."""
    base = tmp_path_factory.mktemp("e2e")
    with ExitStack() as stack:
        url = world_database(stack, "fleet_e2e")
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
        token = service.admin_token()
        make_token = lab_token_maker(engine)

        def token_for(server: str) -> str:
            # Scenario 2: this server's agent gets a token the fleet never issued.
            return "flt_bogus-token-never-issued" if server == BAD_TOKEN else make_token(server)

        colo = start_lab(
            service.url,
            token,
            inventory(),
            base / "lab",
            token_for=token_for,
            boot_delay_s=BOOT_DELAY_S,
            agent_env=AGENT_ENV,
        )
        stack.callback(colo.down)  # runs before service.stop: agents go first
        world = World(service, colo, engine, token, base / "lab")
        # Verify every BMC (warm spares found off turn warm). A server the reconciler reads at
        # that moment is busy (its power lock is held): verified again, a bounded few times.
        for _ in range(5):
            verified = world.fleetctl("servers", "verify", "-o", "json")
            if verified.exit_code == 0:
                break
            assert "another power action is in progress" in verified.stdout, verified.stdout
            time.sleep(0.5)
        assert verified.exit_code == 0, verified.stdout + verified.stderr
        # Scenario 2's servers stay out of the warm pool until it puts them in.
        for name in (BAD_PASSWORD, BAD_TOKEN):
            world.patch_server(name, pool="baseline")
        # The deployment's weights are a version Fleet delivers (one small file): a spare
        # whose cache holds it is the one placement picks first (scenarios 2 and 4).
        weights = base / "weights.bin"
        weights.write_bytes(b"stand-in weights\n" * 256)
        world.api(
            "POST",
            "/models",
            json={
                "model": MODEL,
                "version": MODEL_VERSION,
                "artifacts": [
                    {
                        "name": "weights.bin",
                        "uri": weights.as_uri(),
                        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                        "size_bytes": weights.stat().st_size,
                    }
                ],
            },
        )
        created = world.fleetctl(
            *("deployments", "create", DEPLOYMENT, "--model-version", f"{MODEL}@{MODEL_VERSION}"),
            *("--sla-p95-ms", "2000", "--sla-ttft-ms", "300"),
            *("--gpus-per-replica", str(GPUS_PER_REPLICA), "--gpu-model", "H100", "--max", "32"),
            *("--disruption-budget", "2", "--engine", "backend=pytorch"),
            *("--engine", f"tp_size={GPUS_PER_REPLICA}"),
        )
        assert created.exit_code == 0, created.stdout + created.stderr
        yield world


# ---------------------------------------------------------------------------------------------
# 1. spares boot → booting → loading → serving


def test_spares_boot_follows_three_spares_to_serving_and_their_engines_answer(
    fleet: World,
) -> None:
    fleet.settle()
    target = fleet.target()
    before = fleet.last_event_id()
    since = datetime.now(UTC).isoformat()
    began = time.monotonic()
    result = fleet.fleetctl(
        *("spares", "boot", "--deployment", DEPLOYMENT, "--count", "3"),
        *("--wait", str(SERVE_TIMEOUT_S), "-o", "json"),
    )
    took = time.monotonic() - began
    assert result.exit_code == 0, result.stdout + result.stderr + fleet.why()
    rows = json.loads(result.stdout)
    names = [r["server"] for r in rows]
    assert len(set(names)) == 3, rows
    assert [r["state"] for r in rows] == ["serving"] * 3, rows
    assert f"booting 3 for {DEPLOYMENT}" in result.stderr
    assert all(r["boot_to_ready_s"] > 0 and r["failed_reason"] is None for r in rows)
    assert fleet.target() == target + 3
    print(
        f"\nspares boot --count 3: serving after {took:.1f} s; boot→ready "
        + ", ".join(
            f"{r['server']} ({fleet.protocol(r['server'])}) {r['boot_to_ready_s']:.1f} s"
            for r in rows
        )
    )

    # Each engine of each server answers (the replicas' URLs as the fleet knows them).
    for name in names:
        replicas = fleet.server(name)["replicas"]
        assert len(replicas) == H100_GPUS // GPUS_PER_REPLICA
        for replica in replicas:
            assert replica["state"] == "ready"
            reply = httpx.post(
                f"{replica['url']}/v1/completions",
                json={
                    "model": DEPLOYMENT,
                    "prompt": f"hello from {name}",
                    "max_tokens": 16,
                    "ignore_eos": True,
                },
                timeout=30,
            )
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 16

    # Every step is an event: `fleetctl events --follow` prints them.
    shown = fleet.fleetctl(
        *("events", "--type", "server", "--since", since, "--limit", "1000"),
        *("--follow", "--follow-for", "1", "-o", "json"),
    )
    assert shown.exit_code == 0, shown.stdout + shown.stderr
    events = [json.loads(line) for line in shown.stdout.splitlines() if line.strip()]
    for name in names:
        mine = [e for e in events if e["subject"] == name and e["id"] > before]
        steps = [
            (e["kind"], e["from_state"], e["to_state"])
            for e in mine
            if e["kind"] in ("server.transition", "server.power", "server.agent_registered")
        ]
        assert steps == [
            ("server.transition", "warm", "booting"),
            ("server.power", None, None),
            ("server.agent_registered", None, None),
            ("server.transition", "booting", "loading"),
            ("server.transition", "loading", "serving"),
        ], f"{name}: {steps}"
        [power] = [e for e in mine if e["kind"] == "server.power"]
        # The one power path's event (fleet/power/actions.py): the action, whether it was sent,
        # and the states the BMC reported before and after.
        assert power["details"]["action"] == "on" and power["details"]["sent"] is True
        assert power["details"]["before"] == "off"
        assert fleet.power_ons(name) == 1


# ---------------------------------------------------------------------------------------------
# 2. A spare whose BMC refuses the password, one whose agent is refused: failed, replaced


def test_a_wrong_bmc_password_and_a_refused_agent_fail_with_the_reason_and_are_replaced(
    fleet: World,
) -> None:
    fleet.settle()
    target = fleet.target()
    serving_before = set(fleet.serving())
    before = fleet.last_event_id()
    # Into the warm pool, with the deployment's model cached: placement picks them first.
    fleet.patch_server(BAD_PASSWORD, pool="warm", bmc_password="wrong-password")
    fleet.patch_server(BAD_TOKEN, pool="warm")
    fleet.mark_cached(BAD_PASSWORD)
    fleet.mark_cached(BAD_TOKEN)

    began = time.monotonic()
    result = fleet.fleetctl(
        *("spares", "boot", "--deployment", DEPLOYMENT, "--count", "2"),
        *("--wait", str(BOOT_DEADLINE_S + 30), "-o", "json"),
    )
    took = time.monotonic() - began
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "2 failed" in result.stderr and BAD_PASSWORD in result.stderr
    rows = {r["server"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {BAD_PASSWORD, BAD_TOKEN}
    assert {r["state"] for r in rows.values()} == {"failed"}
    print(f"\nboth failed {took:.1f} s after `spares boot`")

    # The reasons, on the server rows and in the events.
    password = fleet.server(BAD_PASSWORD)
    assert password["state"] == "failed"
    assert password["failed_reason"].startswith("BMC power on failed:"), password
    assert "401" in password["failed_reason"], password["failed_reason"]
    assert rows[BAD_PASSWORD]["failed_reason"] == password["failed_reason"]
    refused = fleet.server(BAD_TOKEN)
    assert refused["state"] == "failed" and refused["agent_registered_at"] is None
    assert refused["failed_reason"] == (
        f"boot deadline: no agent registration within {BOOT_DEADLINE_S:g} s"
    )
    for name, server in ((BAD_PASSWORD, password), (BAD_TOKEN, refused)):
        moves = fleet.events(before, name, "server.transition")
        assert [(e["from_state"], e["to_state"]) for e in moves] == [
            ("warm", "booting"),
            ("booting", "failed"),
        ]
        assert moves[-1]["message"] == server["failed_reason"]
    # The password was refused before anything was sent; the other one did power on, and
    # its agent was turned away by the fleet.
    assert fleet.power_ons(BAD_PASSWORD) == 0
    assert not fleet.events(before, BAD_PASSWORD, "server.power")
    assert fleet.power_ons(BAD_TOKEN) == 1
    log = (fleet.workdir / "servers" / BAD_TOKEN / "agent.log").read_text()
    assert "fleet refused" in log, log[-2000:]

    # Other spares take their places: the deployment's target serves.
    assert fleet.target() == target + 2

    def replaced() -> list[str] | None:
        serving = fleet.serving()
        return serving if len(serving) == target + 2 else None

    serving = wait_for("replacements serving", replaced, SERVE_TIMEOUT_S, why=fleet.why)
    replacements = set(serving) - serving_before
    assert len(replacements) == 2 and not replacements & {BAD_PASSWORD, BAD_TOKEN}
    assert fleet.deployment_states()[BAD_PASSWORD] == "failed"


# ---------------------------------------------------------------------------------------------
# 3. A fatal Xid under load: drained without a request lost, power cycled, serving again;
#    the third time it is quarantined and a replacement serves


MAX_TOKENS = 300


@dataclass
class Stream:
    """One streaming completion (ignore_eos: exactly MAX_TOKENS tokens), in a thread."""

    url: str
    prompt: str
    chunks: list[str] = field(default_factory=list)
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {
            "model": DEPLOYMENT,
            "prompt": self.prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}"
                    return
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(line[6:])
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()

    @property
    def done(self) -> bool:
        return bool(self.chunks) and self.chunks[-1] == "[DONE]"

    def check(self) -> None:
        assert self.thread is not None
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), f"{self.prompt}: still streaming after 60 s"
        assert self.error is None, f"{self.prompt}: {self.error}"
        assert self.done, f"{self.prompt}: ended without [DONE]: {self.chunks[-3:]}"
        usage = json.loads(self.chunks[-2])["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, f"{self.prompt}: cut short: {usage}"


def _fault_under_load(fleet: World, name: str, round_: int) -> int:
    """Four streams on the server's engines, then the Xid; every stream must finish whole.
    Returns the event id from before the fault."""
    urls = [r["url"] for r in fleet.server(name)["replicas"]]
    assert urls, f"{name} has no replicas"
    streams = [Stream(urls[i % len(urls)], f"round {round_} story {i}").start() for i in range(4)]
    for stream in streams:
        assert stream.started.wait(30), f"{stream.prompt}: no token within 30 s"
    mark = fleet.last_event_id()
    fleet.colo.inject(name, {"kind": "xid", "xid": 79, "gpu": 0})
    in_flight = sum(not s.done for s in streams)
    for stream in streams:
        stream.check()
    assert in_flight == 4, f"only {in_flight} of 4 streams were in flight at the fault"
    return mark


def test_a_fatal_xid_drains_without_losing_a_request_cycles_and_the_third_quarantines(
    fleet: World,
) -> None:
    fleet.ensure_serving(1)
    # A server never rebooted; IPMI when there is one: its cycle applies in ~1 s (sushy's in
    # 1-11 s).
    fresh = [n for n in fleet.serving() if fleet.server(n)["reboot_count"] == 0]
    if not fresh:  # every server rebooted before (an earlier test): one more
        fresh = fleet.api("POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": 1})[
            "booted"
        ]
        assert fresh, f"no warm spare: {fleet.why()}"
        fleet.wait_serving(fresh)
    name = next((n for n in fresh if fleet.protocol(n) == "ipmi"), fresh[0])
    target = fleet.target()
    # No spare for the first two faults, so that the reboots are this server's alone; the
    # third fault gets the spares back: its replacement comes from them.
    with fleet.spares_parked():
        for reboot in (1, 2):
            calls = len(fleet.chassis_calls(name)) if fleet.protocol(name) == "ipmi" else 0
            mark = _fault_under_load(fleet, name, reboot)

            def cycled(mark: int = mark) -> bool:
                return fleet.moves(name, mark)[-1:] == [("loading", "serving")]

            wait_for(
                f"{name} cycled and serving (reboot {reboot})",
                cycled,
                60,
                why=fleet.why,
                give_up=lambda: fleet.any_failed([name]),
            )
            moves = fleet.events(mark, name, "server.transition")
            assert [(e["from_state"], e["to_state"]) for e in moves] == [
                ("serving", "draining"),
                ("draining", "drained"),
                ("drained", "booting"),
                ("booting", "loading"),
                ("loading", "serving"),
            ]
            assert moves[0]["message"] == "remediation: agent asks for reboot (xid_79)"
            assert moves[2]["message"] == f"remediation: power cycle (reboot {reboot} for xid_79)"
            [power] = fleet.events(mark, name, "server.power")
            assert power["details"]["action"] == "cycle" and power["details"]["sent"] is True
            assert power["details"]["before"] == "on"
            row = fleet.server(name)
            assert (row["reboot_count"], row["last_fault"]) == (reboot, "xid_79")
            assert row["health_verdict"] == "healthy"
            if fleet.protocol(name) == "ipmi":  # the emulator saw the cycle: off, then on
                new = [line.split(" ", 1)[1] for line in fleet.chassis_calls(name)[calls:]]
                assert new == ["set power 0", "set power 1"], new
            assert len(fleet.serving()) == target  # nothing else moved

    mark = _fault_under_load(fleet, name, 3)
    wait_for(
        f"{name} quarantined",
        lambda: fleet.states()[name] == "quarantined",
        DRAIN_DEADLINE_S,
        why=fleet.why,
    )
    moves = fleet.events(mark, name, "server.transition")
    assert [(e["from_state"], e["to_state"]) for e in moves] == [
        ("serving", "draining"),
        ("draining", "drained"),
        ("drained", "quarantined"),
    ]
    assert moves[-1]["message"] == "quarantined: xid_79 again after 2 reboots"
    assert not fleet.events(mark, name, "server.power")  # no third cycle
    # A replacement serves: the deployment is back at its target.
    wait_for(
        "capacity restored",
        lambda: len(fleet.serving()) == target and name not in fleet.serving(),
        SERVE_TIMEOUT_S,
        why=fleet.why,
    )


# ---------------------------------------------------------------------------------------------
# 4. SIGKILL between the BMC call and the database write of a boot


def test_a_service_killed_between_the_power_on_and_its_write_powers_on_once(
    fleet: World,
) -> None:
    # One boot per protocol, so that the kill lands on a Redfish power-on (sushy applies it
    # 1-11 s later) and on an IPMI one (applied at once).
    for protocol in ("redfish", "ipmi"):
        fleet.settle()
        spares = fleet.warm_spares()
        name = next((n for n in spares if fleet.protocol(n) == protocol), spares[0])
        _kill_during_power_on(fleet, name)


def _kill_during_power_on(fleet: World, name: str) -> None:
    fleet.mark_cached(name)  # placement picks it first
    count = fleet.power_ons(name)
    watch = _PowerOnWatch(fleet, name)
    before = fleet.last_event_id()

    booted = fleet.api("POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": 1})
    assert booted["booted"] == [name], booted
    # Every ~5 ms: the power-on in the emulator's log kills the service.
    deadline = time.monotonic() + 20
    while not watch.seen():
        assert time.monotonic() < deadline, f"no power-on within 20 s: {fleet.why()}"
        time.sleep(0.005)
    fleet.service.kill()
    seen_at = datetime.now(UTC)

    with Session(fleet.engine) as session:
        row = session.exec(select(Server).where(Server.name == name)).one()
        # The service is down: the database says whether the kill came before its write.
        written = session.exec(
            select(Event.id).where(
                Event.subject == name, Event.kind == "server.power", col(Event.id) > before
            )
        ).all()
    where = "after the database write" if written else "between the BMC call and the DB write"
    print(
        f"\nSIGKILL at {seen_at:%H:%M:%S.%f}, on the power-on of {name} "
        f"({fleet.protocol(name)}): it landed {where} "
        f"(write-ahead power_on_sent_at {row.power_on_sent_at:%H:%M:%S.%f})"
    )
    assert row.state.value == "booting"
    assert row.power_on_sent_at is not None  # committed before the BMC heard of it

    began = time.monotonic()
    fleet.service.start()
    fleet.wait_serving([name])
    print(f"restarted; {name} serving {time.monotonic() - began:.1f} s later")
    assert fleet.power_ons(name) == count + 1, f"{name}: not exactly one power-on"
    assert fleet.moves(name, before) == [
        ("warm", "booting"),
        ("booting", "loading"),
        ("loading", "serving"),
    ]


class _PowerOnWatch:
    """The tail of a server's emulator log, read from where it was at creation."""

    def __init__(self, fleet: World, name: str) -> None:
        self.name = name
        entry = fleet.colo.state()["servers"][name]
        if entry["protocol"] == "redfish":
            sushy = fleet.colo._sushy
            assert sushy is not None
            self.path = sushy.log_path
            self.needle = f"POST /redfish/v1/Systems/{entry['system_id']}/Actions/"
        else:
            self.path = Path(entry["chassis_dir"]) / "chassis.log"
            self.needle = " set power 1"
        self.offset = self.path.stat().st_size
        self.buffer = ""

    def seen(self) -> bool:
        with self.path.open("rb") as src:
            src.seek(self.offset)
            data = src.read()
        self.offset += len(data)
        self.buffer = (self.buffer + data.decode(errors="replace"))[-4096:]
        return self.needle in self.buffer


# ---------------------------------------------------------------------------------------------
# 5. Two boots at once for a rack's last headroom


def test_two_concurrent_boots_for_the_last_headroom_one_wins_the_other_says_why(
    fleet: World,
) -> None:
    fleet.settle()
    name = "mistral-l40s"
    known = [d["name"] for d in fleet.api("GET", "/deployments", params={"limit": 1000})["results"]]
    if name not in known:
        created = fleet.fleetctl(
            *("deployments", "create", name, "--model-uri", MODEL_URI, "--checksum", "sha256:1"),
            *("--sla-p95-ms", "2000", "--sla-ttft-ms", "300", "--gpus-per-replica", "4"),
            *("--gpu-model", "L40S", "--engine", "backend=pytorch"),
        )
        assert created.exit_code == 0, created.stdout + created.stderr
    assert fleet.warm_spares("L40S") == sorted(L40S)
    barrier = threading.Barrier(2)
    replies: list[dict[str, Any]] = []

    def boot() -> None:
        barrier.wait(timeout=10)
        replies.append(fleet.api("POST", "/spares/boot", json={"deployment": name, "count": 1}))

    threads = [threading.Thread(target=boot) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(replies) == 2, replies
    [winner] = [r for r in replies if r["booted"]]
    [loser] = [r for r in replies if not r["booted"]]
    assert len(winner["booted"]) == 1 and winner["booted"][0] in L40S
    assert loser["short"] == 1
    reason = "; ".join(loser["reasons"])
    extra = L40S_MAX_W - L40S_STANDBY_W
    headroom = 2944 - (L40S_MAX_W + L40S_STANDBY_W)
    assert f"rack {R3}: {headroom:,.0f} W headroom" in reason, reason
    assert f"needs {extra:,.0f} W more" in reason, reason
    print(f"\nthe loser's reply: {reason}")
    assert fleet.target(name) == 1
    fleet.wait_serving(winner["booted"])


# ---------------------------------------------------------------------------------------------
# 6. Faults on ~30 % of the servers at once: the breaker


def test_faults_on_a_third_of_the_fleet_open_the_breaker_until_an_operator_resumes(
    fleet: World,
) -> None:
    serving = fleet.ensure_serving(4)
    total = len(fleet.states())
    sick = serving[:4]
    assert len(sick) / total > 0.2  # past the 20 % share (FLEET_BREAKER_SHARE's default)
    # All four may be remediated at once after the resume (one at a time would take minutes).
    fleet.api("PATCH", f"/deployments/{DEPLOYMENT}", json={"disruption_budget": len(sick)})
    with fleet.spares_parked():  # the four are cycled and come back: no replacements
        reopened = _breaker(fleet, sick, total)
    fleet.settle()
    assert not reopened  # a resume counts: the breaker does not re-open on the same events


def _breaker(fleet: World, sick: list[str], total: int) -> bool:
    """The breaker opens, nothing moves, an operator resumes, the remediation proceeds;
    whether the first resume was void (the breaker re-opened at once: a bug)."""
    before = fleet.last_event_id()
    threads = [
        threading.Thread(
            target=fleet.colo.inject, args=(n, {"kind": "xid", "xid": 79, "gpu": 1}), daemon=True
        )
        for n in sick
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    faulted_at = time.monotonic()
    opened = wait_for(
        "the breaker to open",
        lambda: fleet.events(before, "autopilot", "autopilot.breaker_open"),
        10,
        why=fleet.why,
    )
    print(f"\nbreaker: {opened[0]['message']}")
    # The tick that opens it may count the first three of the four (3 of 14 is past 20 %).
    counted = re.match(r"(\d+) of (\d+) servers", opened[0]["message"])
    assert counted is not None and int(counted[2]) == total, opened[0]["message"]
    assert 0.2 * total < int(counted[1]) <= len(sick)
    assert fleet.autopilot()["breaker_open"]
    _nothing_moves_while_open(fleet, sick, opened[0]["id"])

    # An operator resumes. Right away, inside the breaker window: a resume closes the breaker
    # for the faults it has seen (`set_paused` says so, as does `fleetctl autopilot resume`).
    mark = fleet.last_event_id()
    resumed = fleet.fleetctl("autopilot", "resume", "--reason", "checked: a bad batch of GPUs")
    assert resumed.exit_code == 0 and "autopilot running" in resumed.stdout
    time.sleep(1.5)  # 3 provisioner ticks
    reopened = fleet.events(mark, "autopilot", "autopilot.breaker_open")
    if reopened:
        # BUG (fleet/provisioning/autopilot.py, check_breaker): the next tick counts the same
        # health
        # events again and re-opens the breaker at once; a resume is void for the whole window
        # (600 s by default). Still nothing moves; once the window (FLEET_BREAKER_WINDOW_S
        # here) has passed, the latched breaker still waits for an operator, and a second
        # resume lets the remediation proceed.
        print(f"breaker re-opened {reopened[0]['at']} after the resume: {reopened[0]['message']}")
        _nothing_moves_while_open(fleet, sick, reopened[0]["id"])
        time.sleep(max(0.0, faulted_at + BREAKER_WINDOW_S + 1 - time.monotonic()))
        assert fleet.autopilot()["breaker_open"]  # latched: only an operator closes it
        mark = fleet.last_event_id()
        assert fleet.fleetctl("autopilot", "resume").exit_code == 0

    def all_cycled() -> bool:
        return all(
            any(e["details"]["action"] == "cycle" for e in fleet.events(mark, n, "server.power"))
            for n in sick
        )

    wait_for(
        "every sick server drained and power cycled",
        all_cycled,
        60,
        why=fleet.why,
        give_up=lambda: fleet.any_failed(sick),
    )
    assert not fleet.autopilot()["breaker_open"]
    assert not fleet.events(mark, "autopilot", "autopilot.breaker_open")
    fleet.wait_serving(sick)
    for name in sick:
        assert fleet.server(name)["health_verdict"] == "healthy"
        assert fleet.server(name)["reboot_count"] >= 1
    return bool(reopened)


def _nothing_moves_while_open(fleet: World, sick: list[str], since: int) -> None:
    """For 8 provisioner ticks after event `since` (the breaker opened): no remediation drain,
    no power cycle of the sick servers. (A drain a tick started before the last fault arrived
    may go on to `drained`; it is not cycled.)"""
    out = {n: s for n, s in fleet.states().items() if n in sick and s != "serving"}
    time.sleep(4)
    for name in sick:
        moves = fleet.moves(name, since)
        assert ("serving", "draining") not in moves, f"{name} drained with the breaker open"
        assert ("drained", "booting") not in moves, f"{name} cycled with the breaker open"
        assert not fleet.events(since, name, "server.power"), f"{name}: power action"
    assert set(out) == {n for n in sick if fleet.states()[n] != "serving"}
    assert fleet.autopilot()["breaker_open"]
