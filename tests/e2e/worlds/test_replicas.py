"""Three `fleetctl serve` replicas on one Postgres behind Debian's nginx, for real (issue 26).

Everything that talks to the fleet goes through nginx (tests/nginx_front.py, round-robin over
the three): the lab's inventory import, the agents' registrations and heartbeats, the router's
routing-table reads and load reports, the clients' API calls and `fleetctl`. The control loops
run in whichever replica holds the `leader:control` lease (docs/design.md).

1. The leader SIGKILLed in a boot storm: 20 warm spares asked to boot at once; once the first
   power-ons reached the emulators the leader is killed. Checked: another replica leads within
   the lease and two reconciler ticks (the figure printed); every spare serves; each got
   exactly one power-on in its emulator's log and each lifecycle step (booting, loading,
   serving) exactly once; no other server was powered on. The killed replica, restarted on
   its port, follows.
2. A non-leader SIGKILLed under load: client threads create tenants and list servers through
   nginx, retrying a refused, cut or 502 request (and taking a 409 on a retried create as done,
   checked below); completions flow through the router meanwhile. The replica is SIGSTOPped
   for 1.5 s before the SIGKILL, so that requests nginx sent it are in flight when it dies.
   Checked: at least one request was retried, and every client operation succeeded in the
   end (the retries counted and printed); every tenant a client was told exists is in the
   database once, and none other; every completion answered 200; the leader did not change;
   every serving server kept heartbeating (through the other replicas) and still serves.

`pytest -s` prints the figures.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from factories import TEST_SECRET_KEY
from nginx_front import NginxFront, nginx_front
from pg import world_database
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner
from weights_peers import nginx_binary

from fleet import cli, db
from fleet.cli.lab import lab_token_maker
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    RouterProcess,
    ServeProcess,
    start_lab,
)
from fleet.lab.harness import wait_for as _wait_for
from fleet.models import Event, Server, Tenant, utcnow

pytestmark = pytest.mark.postgres

_missing = [b for b in ("ipmi_sim", "ipmitool") if shutil.which(b) is None]
if nginx_binary() is None:
    _missing.append("nginx")
if _missing:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{', '.join(_missing)} required in CI", pytrace=False)
    pytest.skip(f"not installed: {', '.join(_missing)}", allow_module_level=True)

REPLICAS = ("a", "b", "c")
# The lease and the reconciler's tick: a dead leader's lease runs out after LEASE_S, and a
# replica tries for it at each of its ticks.
LEASE_S = 2.0
RECONCILE_S = 1.0
SLACK_S = 2.0  # a loaded 2-core machine running three services, a lab and a router
FAILOVER_BOUND_S = LEASE_S + 2 * RECONCILE_S + SLACK_S
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | {
    "FLEET_LEADER_LEASE_S": str(LEASE_S),
    "FLEET_RECONCILE_INTERVAL_S": str(RECONCILE_S),
    # A power-on the dead leader wrote ahead but never confirmed is asked again by the next
    # leader only after FLEET_POWER_RETRY_AFTER_S (15 s) and sushy applies one 1-11 s late:
    # 43 s from the storm to serving was seen here, and one boot missed a 40 s deadline; with
    # 20 agents and engines starting at once beside other tests, one missed 75 s.
    "FLEET_BOOT_DEADLINE_S": "150",
    "FLEET_LOAD_DEADLINE_S": "150",
    "FLEET_LOG_LEVEL": "WARNING",
    # Each replica's pool small: three of them share the test's Postgres with other tests.
    "FLEET_DB_POOL_SIZE": "6",
    "FLEET_DB_MAX_OVERFLOW": "4",
    "FLEET_API_MAX_IN_FLIGHT": "2",
    "FLEET_PROBE_INTERVAL_S": "0",
}
BOOT_DELAY_S = 0.5
SERVE_TIMEOUT_S = 200.0
STORM = 20

SITE = "replicas"
RACKS = ("rep-r01", "rep-r02", "rep-r03", "rep-r04")
SERVERS_PER_RACK = 6
DEPLOYMENT = "llama-rep"
GPUS = 4

# Polled every 0.2 s.
wait_for = partial(_wait_for, every=0.2)


def inventory() -> str:
    """Four racks of six 4-GPU H100 servers, Redfish and IPMI alternating, power for all
    (415 V × 63 A three-phase × 80 % ≈ 36 kW a side; six at 5.6 kW fit)."""
    feeds = [
        {"name": f"{side.lower()}1", "side": side, "volts": 415, "amps": 63, "phase": "three"}
        for side in "AB"
    ]
    racks = []
    for r, rack in enumerate(RACKS):
        servers = []
        for i in range(SERVERS_PER_RACK):
            protocol = "redfish" if (i + r) % 2 == 0 else "ipmi"
            servers.append(
                {
                    "name": f"{rack}-h100-{i + 1}",
                    "u": 1 + 4 * i,
                    "u_height": 4,
                    "gpu": {"model": "H100", "count": GPUS},
                    "power": {"idle_w": 1100, "standby_w": 80, "max_w": 5600},
                    "bmc": {
                        "protocol": protocol,
                        "address": "10.0.0.1",  # the lab rewrites it
                        "port": 623,
                        "username": "root",
                        "password": "not-used-by-the-lab",
                    },
                }
            )
        racks.append({"name": rack, "feeds": [dict(f) for f in feeds], "servers": servers})
    return yaml.safe_dump({"sites": [{"name": SITE, "racks": racks}]}, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# The world


@dataclass
class World:
    replicas: dict[str, ServeProcess]
    front: NginxFront
    colo: VirtualColo
    engine: Engine
    token: str
    router: RouterProcess | None = None
    runner: CliRunner = field(default_factory=CliRunner)

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        reply = httpx.request(
            method,
            f"{self.front.url}/api/v1{path}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
            **kwargs,
        )
        assert reply.status_code < 400, f"{method} {path}: {reply.status_code} {reply.text}"
        return reply.json()

    def states(self) -> dict[str, str]:
        with Session(self.engine) as session:
            return {s.name: s.state.value for s in session.exec(select(Server))}

    def serving(self) -> list[str]:
        return sorted(n for n, s in self.states().items() if s == "serving")

    def leaders(self) -> list[str]:
        """The replicas whose /metrics say they lead (asked directly, not through nginx)."""
        out = []
        for name, replica in self.replicas.items():
            if not replica.running:
                continue
            metrics = replica.metrics("reconciler")
            if metrics is not None and metrics.leader:
                out.append(name)
        return out

    def one_leader(self) -> str:
        def probe() -> str | None:
            leading = self.leaders()
            assert len(leading) <= 1, f"two leaders at once: {leading}\n{self.why()}"
            return leading[0] if leading else None

        leader: str = wait_for("one leader", probe, 30, why=self.why)
        return leader

    def leader_events(self) -> list[tuple[str, str]]:
        with Session(self.engine) as session:
            rows = session.exec(
                select(Event).where(col(Event.subject_type) == "service").order_by(col(Event.id))
            ).all()
        return [(e.kind, str(e.details.get("process"))) for e in rows]

    def power_ons(self, name: str) -> int:
        """Power-ons at the server's emulator (warm spares are off: VirtualColo.power_ons)."""
        return self.colo.power_ons(name)

    def moves(self, name: str, after: int) -> list[tuple[str | None, str | None]]:
        with Session(self.engine) as session:
            rows = session.exec(
                select(Event)
                .where(Event.subject == name, Event.kind == "server.transition")
                .where(col(Event.id) > after)
                .order_by(col(Event.id))
            ).all()
        return [(e.from_state, e.to_state) for e in rows]

    def led_at(self, after: int) -> datetime | None:
        """When the first replica to lead after Event `after` said so (its service.leader
        Event, written as it takes the lead, on this host's clock)."""
        with Session(self.engine) as session:
            event = session.exec(
                select(Event)
                .where(Event.kind == "service.leader", col(Event.id) > after)
                .order_by(col(Event.id))
            ).first()
        return None if event is None else event.at

    def last_event_id(self) -> int:
        with Session(self.engine) as session:
            return session.exec(select(sa.func.max(Event.id))).one() or 0

    def why(self) -> str:
        with Session(self.engine) as session:
            failed = {
                s.name: s.failed_reason
                for s in session.exec(select(Server).where(Server.state == "failed"))
            }
        tails = "\n".join(r.tail(8) for r in self.replicas.values())
        errors = "\n".join(self.front.upstream_errors()[-5:])
        return (
            f"states: {self.states()}\nfailed: {failed}\n{tails}\nnginx upstream errors:\n{errors}"
        )

    def ensure_serving(self, count: int) -> list[str]:
        missing = count - len(self.serving())
        if missing > 0:
            booted = self.api(
                "POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": missing}
            )["booted"]
            assert len(booted) == missing, self.why()
            self.wait_serving(booted)
        return self.serving()

    def wait_serving(self, names: list[str]) -> None:
        def all_serving() -> bool:
            states = self.states()
            return all(states[n] == "serving" for n in names)

        def hopeless() -> str | None:
            failed = [n for n, s in self.states().items() if n in names and s == "failed"]
            return f"{', '.join(failed)} failed" if failed else None

        def why() -> str:
            # A late server's Events, and its agent's last words on its engine and the fleet.
            states = self.states()
            late = [n for n in names if states[n] != "serving"]
            return self.why() + "".join(
                f"\n{n}: {self.history(n)}\n{n}'s agent: {self.colo.agent_log_tail(n, 'replica')}"
                f" | {self.colo.agent_log_tail(n, 'WARNING')}"
                for n in late
            )

        wait_for(
            f"{len(names)} servers serving",
            all_serving,
            SERVE_TIMEOUT_S,
            why=why,
            give_up=hopeless,
        )

    def history(self, name: str) -> list[str]:
        """The server's Events, briefly (a failure's explanation)."""
        with Session(self.engine) as session:
            rows = session.exec(
                select(Event).where(Event.subject == name).order_by(col(Event.id))
            ).all()
        return [
            f"{e.at:%H:%M:%S} {e.kind} {e.from_state}->{e.to_state} {e.message[:80]}" for e in rows
        ]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("replicas")
    with ExitStack() as stack:
        url = world_database(stack, "fleet_replicas")
        engine = db.make_engine(url)
        stack.callback(engine.dispose)
        db.upgrade(engine)
        replicas: dict[str, ServeProcess] = {}
        for name in REPLICAS:
            replica = ServeProcess(
                f"replica-{name}",
                base / f"replica-{name}",
                SERVICE_SETTINGS
                | {
                    "FLEET_DATABASE_URL": url,
                    "FLEET_SECRET_KEY": TEST_SECRET_KEY.decode(),
                    "FLEET_DB_APPLICATION_NAME": f"fleet-{name}",
                },
            )
            stack.callback(replica.stop)
            replicas[name] = replica
        # One replica mints the admin token (it lands in the shared database).
        for name, replica in replicas.items():
            replica.start(admin_token=name == REPLICAS[0])
        token = replicas[REPLICAS[0]].admin_token()
        front = stack.enter_context(nginx_front([r.url for r in replicas.values()], base))
        colo = start_lab(
            front.url,
            token,
            inventory(),
            base / "lab",
            token_for=lab_token_maker(engine),
            boot_delay_s=BOOT_DELAY_S,
            agent_env=FAST_AGENT_SETTINGS,
        )
        stack.callback(colo.down)  # before the replicas stop: agents go first
        world = World(replicas, front, colo, engine, token)
        env = {"FLEET_URL": front.url, "FLEET_TOKEN": token}
        for _ in range(5):  # a BMC the reconciler reads at that moment is busy: again
            verified = world.runner.invoke(cli.app, ["servers", "verify", "-o", "json"], env=env)
            if verified.exit_code == 0:
                break
            assert "another power action is in progress" in verified.stdout, verified.stdout
            time.sleep(0.5)
        assert verified.exit_code == 0, verified.stdout + verified.stderr
        created = world.runner.invoke(
            cli.app,
            [
                *("deployments", "create", DEPLOYMENT, "--model-uri", "s3://models/llama-rep"),
                *("--checksum", "sha256:" + "ab" * 32),
                *("--sla-p95-ms", "2000", "--sla-ttft-ms", "300"),
                *("--gpus-per-replica", str(GPUS), "--gpu-model", "H100", "--max", "32"),
                *("--engine", "backend=pytorch", "--engine", f"tp_size={GPUS}"),
            ],
            env=env,
        )
        assert created.exit_code == 0, created.stdout + created.stderr
        wait_for(
            "every server warm",
            lambda: set(world.states().values()) == {"warm"},
            60,
            why=world.why,
        )
        router = RouterProcess(
            base / "router.log",
            {
                "FLEET_ROUTER_FLEET_URL": front.url,
                "FLEET_ROUTER_TOKEN": token,
                "FLEET_ROUTER_FLEET_POLL_S": "0.5",
                "FLEET_ROUTER_REPORT_S": "0.5",
                "FLEET_ROUTER_CLIENT_AUTH": "none",
                "FLEET_ROUTER_LOG_LEVEL": "WARNING",
            },
        )
        stack.callback(router.stop)
        world.router = router
        yield world


# ---------------------------------------------------------------------------------------------
# 1. The leader SIGKILLed in a boot storm


def test_the_leader_sigkilled_in_a_boot_storm_moves_the_loops_and_boots_nothing_twice(
    world: World,
) -> None:
    leader = world.one_leader()
    before = world.last_event_id()
    warm = [n for n, s in world.states().items() if s == "warm"]
    counts = {n: world.power_ons(n) for n in warm}
    assert all(c == 0 for c in counts.values()), counts

    booted = world.api("POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": STORM})[
        "booted"
    ]
    assert len(booted) == STORM, world.why()
    wait_for(
        "the first power-ons at the emulators",
        lambda: sum(world.power_ons(n) for n in booted) >= 2,
        30,
        every=0.05,
        why=world.why,
    )
    in_flight = sum(world.power_ons(n) for n in booted)
    before_kill = world.last_event_id()
    killed_at, killed_wall = time.monotonic(), utcnow()
    world.replicas[leader].kill()

    new_leader = wait_for(
        "another replica to lead",
        lambda: next(iter(world.leaders()), None),
        FAILOVER_BOUND_S + 15,
        every=0.05,
        why=world.why,
    )
    seen_s = time.monotonic() - killed_at
    # The failover as the new leader recorded it taking the lead, not as this test's scrapes
    # of three /metrics on a busy machine happened to see it (those add seconds at times).
    led_at = world.led_at(before_kill)
    assert led_at is not None, world.why()
    failover_s = (led_at - killed_wall).total_seconds()
    world.wait_serving(booted)
    served_s = time.monotonic() - killed_at
    print(
        f"\nboot storm of {STORM}: leader replica-{leader} SIGKILLed after {in_flight} power-ons;"
        f" replica-{new_leader} led {failover_s:.2f} s later (bound {FAILOVER_BOUND_S:.1f} s;"
        f" seen by the test after {seen_s:.2f} s); all {STORM} serving {served_s:.1f} s after"
        " the kill"
    )
    assert new_leader != leader
    assert failover_s <= FAILOVER_BOUND_S, f"failover took {failover_s:.2f} s\n{world.why()}"

    # Nothing booted twice, nothing else booted, each step once.
    ons = {n: world.power_ons(n) for n in warm}
    assert {n: ons[n] for n in booted} == dict.fromkeys(booted, 1), ons
    assert all(ons[n] == 0 for n in warm if n not in booted), ons
    for name in booted:
        moves = world.moves(name, before)
        for step in (("warm", "booting"), ("booting", "loading"), ("loading", "serving")):
            assert moves.count(step) == 1, f"{name}: {moves}"
    kinds = [k for k, _ in world.leader_events()]
    assert kinds.count("service.leader") >= 2

    # Restarted on its port, the killed replica follows; nginx sends it requests again.
    # Polled, not read once: on a loaded machine one scrape of the leader's /metrics can miss
    # its 2 s timeout (CI once read [] here), but no sample may show the restarted one leading.
    world.replicas[leader].start()
    time.sleep(2 * RECONCILE_S)
    samples: list[list[str]] = []

    def follows() -> bool:
        samples.append(world.leaders())
        assert leader not in samples[-1], f"the restarted replica leads: {samples}\n{world.why()}"
        return samples[-1] == [new_leader]

    wait_for("the restarted replica to follow the new leader", follows, 15, why=world.why)


# ---------------------------------------------------------------------------------------------
# 2. A non-leader SIGKILLed under load


RETRYABLE = frozenset({502, 503, 504})
STOPPED_S = 1.5
MAX_ATTEMPTS = 20


@dataclass
class Client:
    """A client of the fleet API through nginx that retries what was refused or cut."""

    front: str
    token: str
    name: str
    created: list[str] = field(default_factory=list)
    retries: int = 0
    conflicts_after_retry: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    operations: int = 0

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        """The final answer, retried (bounded) on a transport error or a 502/503/504."""
        with httpx.Client(
            base_url=f"{self.front}/api/v1",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        ) as http:
            for attempt in range(MAX_ATTEMPTS):
                if attempt:
                    self.retries += 1
                    time.sleep(0.2)
                try:
                    reply = http.request(method, path, **kwargs)
                except httpx.TransportError:
                    continue
                if reply.status_code in RETRYABLE:
                    continue
                if reply.status_code == 409 and attempt and method == "POST":
                    # A create whose first answer was lost and that had been done: verified
                    # against the database at the end.
                    self.conflicts_after_retry.append(kwargs["json"]["name"])
                    return reply
                return reply
        return None

    def run(self, stop: threading.Event) -> None:
        i = 0
        while not stop.is_set() and i < 500:
            i += 1
            name = f"{self.name}-{i}"
            self.operations += 2
            made = self.call("POST", "/tenants", json={"name": name})
            if made is None or made.status_code not in (201, 409):
                self.failures.append(f"create {name}: {made and made.status_code}")
            elif made.status_code == 201:
                self.created.append(name)
            listed = self.call("GET", "/servers", params={"limit": 5})
            if listed is None or listed.status_code != 200:
                self.failures.append(f"list: {listed and listed.status_code}")


@dataclass
class Completions:
    url: str
    answers: list[int] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        body = {"model": DEPLOYMENT, "prompt": "hello", "max_tokens": 4}
        with httpx.Client(timeout=30) as http:
            while not stop.is_set() and len(self.answers) < 2000:
                try:
                    reply = http.post(f"{self.url}/v1/completions", json=body)
                    self.answers.append(reply.status_code)
                except httpx.TransportError:
                    self.answers.append(0)


def test_a_non_leader_sigkilled_under_load_loses_no_request_its_client_retried(
    world: World,
) -> None:
    assert world.router is not None
    serving = world.ensure_serving(2)
    leader = world.one_leader()
    victim = next(n for n in REPLICAS if n != leader and world.replicas[n].running)
    leader_events = world.leader_events()

    def router_serves() -> bool:
        assert world.router is not None
        body = {"model": DEPLOYMENT, "prompt": "hello", "max_tokens": 4}
        return httpx.post(f"{world.router.url}/v1/completions", json=body, timeout=30).is_success

    wait_for("completions through the router", router_serves, 30, why=world.why)

    clients = [Client(world.front.url, world.token, f"t{i}-{time.time_ns()}") for i in range(3)]
    completions = Completions(world.router.url)
    stop = threading.Event()
    threads = [threading.Thread(target=c.run, args=(stop,)) for c in clients]
    threads.append(threading.Thread(target=completions.run, args=(stop,)))
    for thread in threads:
        thread.start()
    try:
        time.sleep(3)
        # Stopped first, so that requests are in flight inside it when it dies (a replica
        # wedged, then killed): nginx has sent them, so it answers 502 and leaves a POST's
        # retry to its client (an idempotent GET it retries on the next replica itself).
        pid = world.replicas[victim].proc.pid
        logged_before = len(world.front.upstream_errors())
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(STOPPED_S)
        killed_at = utcnow()
        os.killpg(pid, signal.SIGKILL)
        world.replicas[victim].kill()  # reaped, and known as not running
        time.sleep(6)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client never finished"

    operations = sum(c.operations for c in clients)
    retries = sum(c.retries for c in clients)
    created = sorted(n for c in clients for n in c.created)
    conflicts = sorted(n for c in clients for n in c.conflicts_after_retry)
    # nginx logs each request the kill cut (it retried a GET itself, answered a POST 502 for
    # its client to retry): at least one, or the kill tested nothing.
    port = f":{world.replicas[victim].port}/"
    cut = [
        line
        for line in world.front.upstream_errors()[logged_before:]
        if port in line and ("prematurely closed" in line or "reset by peer" in line)
    ]
    print(
        f"\nreplica-{victim} (a follower) SIGKILLed under load: {operations} API operations by"
        f" 3 clients through nginx, {len(cut)} requests cut in it, {retries} client retries,"
        f" {len(created)} tenants created"
        f" ({len(conflicts)} confirmed by a 409 on retry); {len(completions.answers)}"
        f" completions through the router: {sorted(set(completions.answers))}"
    )
    failures = [f for c in clients for f in c.failures]
    assert not failures, failures[:10]
    assert cut, "no request was in flight in the killed replica: nothing was tested"
    assert set(completions.answers) == {200}, completions.answers

    # Nothing lost, nothing doubled: what the clients were told is what the database holds.
    prefixes = tuple(c.name + "-" for c in clients)
    with Session(world.engine) as session:
        names = [n for n in session.exec(select(Tenant.name)) if n.startswith(prefixes)]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(created + conflicts)

    # The leader stayed; the agents kept heartbeating through the other replicas.
    assert world.leaders() == [leader]
    assert world.leader_events() == leader_events
    with Session(world.engine) as session:
        rows = session.exec(select(Server).where(col(Server.name).in_(serving))).all()
    for row in rows:
        assert row.state.value == "serving", row.name
        assert row.last_heartbeat_at is not None
        assert row.last_heartbeat_at > killed_at + timedelta(seconds=3), row.name

    world.replicas[victim].start()
