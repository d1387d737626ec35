"""Chaos: an agent partitioned from the fleet but not from the router, and the reverse.

The world: a real `fleetctl serve` (embedded SQLite, fast control loops, silence before a power
cycle FLEET_HEARTBEAT_CYCLE_AFTER_S = 10 s), two servers of the virtual colo (IPMI BMCs:
`ipmi_sim`; real agents, stand-in engines) serving one deployment, a real `fleetctl router
run` reading the fleet's routing table, and clients sending completions through it all along.
Server PART reaches the fleet only through one TCP fault proxy (its agent's FLEET_URL), and
the router reaches PART's agent only through another (the URL the agent registers, its
ADVERTISE_URL); the router reaches the engines directly. STEADY is never touched.

Faults injected, and what is checked ("nothing lost": requests, state, events):

1. PART's agent cut off from the fleet (black hole) for a few seconds, then healed.
   Documented (docs/design.md, docs/provisioning.md "Not yet", docs/router.md): the routing
   table lists only servers with a fresh heartbeat, so the router stops sending PART new
   requests within a few heartbeat intervals and a poll; the lifecycle state does not move
   before FLEET_HEARTBEAT_CYCLE_AFTER_S of silence; the agent keeps its engines serving (a
   request straight to its engine is answered). Checked: all of that; every client request
   answered 200; once healed the agent registers again exactly once, PART is back in the
   table and the router sends it requests again; no lifecycle step.
2. The router cut off from PART's agent (black hole), then healed. Documented: an agent that
   does not answer two /state polls in a row marks its replicas not ready in the router.
   Checked: the router marks PART not ready and sends it nothing new; every client request
   answered 200 (by STEADY); the fleet still sees PART serving, heartbeating, ready and in
   the routing table; healed, the router sends PART requests again; no event on PART.
3. PART cut off from the fleet for longer than FLEET_HEARTBEAT_CYCLE_AFTER_S. Documented
   (docs/provisioning.md, remediation): drained ("no heartbeat for N s"; the agent cannot hear
   it, so after the drain deadline), power cycled through its BMC, and once the partition
   heals the new agent registers and the server loads and serves again. Checked: each of
   those steps once, one power cycle at the emulator, one registration; every client
   request answered 200 throughout.

`pytest -s` prints the figures: time to leave the table and the router, requests each server
took before/during/after, time to rejoin, the remediation's timeline.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tcp_faults import TcpFaultProxy
from typer.testing import CliRunner

from fleet import cli, db
from fleet.cli.lab import lab_token_maker
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    RouterProcess,
    ServeProcess,
    free_port,
    start_lab,
)
from fleet.lab.harness import wait_for as _wait_for

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

HEARTBEAT_S = 0.5  # the fleet's heartbeat interval: a heartbeat is fresh for 3 of them
CYCLE_AFTER_S = 10.0  # silence before remediation drains and power cycles
DRAIN_DEADLINE_S = 5.0  # a partitioned agent never hears the drain: the deadline ends it
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | {
    "FLEET_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
    "FLEET_HEARTBEAT_CYCLE_AFTER_S": str(CYCLE_AFTER_S),
    "FLEET_DRAIN_DEADLINE_S": str(DRAIN_DEADLINE_S),
    # The service has just become leader: silence counts at once, not after the grace.
    "FLEET_LEADER_GRACE_S": "0",
    "FLEET_PROBE_INTERVAL_S": "0",  # the fleet never calls the agents here
    "FLEET_LOG_LEVEL": "WARNING",
}
ROUTER_POLL_S = 0.5
BOOT_DELAY_S = 0.5
SERVE_TIMEOUT_S = 60.0  # a boot to serving on a busy 2-core machine: a bound, not a claim
MOVE_TIMEOUT_S = 20.0  # the table, the router or the fleet taking note of a fault

SITE = "chaos"
PART, STEADY = "chaos-part-01", "chaos-steady-01"
DEPLOYMENT = "chaos-llm"
GPUS = 4

wait_for = partial(_wait_for, every=0.1)


def inventory(rack: str, name: str) -> str:
    """One 4-GPU H100 server with an IPMI BMC (the lab rewrites its address) in a rack of its
    own: each lab imports its own rack."""
    server = {
        "name": name,
        "u": 1,
        "u_height": 4,
        "gpu": {"model": "H100", "count": GPUS},
        "power": {"idle_w": 1100, "standby_w": 80, "max_w": 5600},
        "bmc": {
            "protocol": "ipmi",
            "address": "10.0.0.1",
            "port": 623,
            "username": "root",
            "password": "not-used-by-the-lab",
        },
    }
    feeds = [
        {"name": f"{s.lower()}1", "side": s, "volts": 415, "amps": 63, "phase": "three"}
        for s in "AB"
    ]
    rack_doc = {"name": rack, "feeds": feeds, "servers": [server]}
    return yaml.safe_dump({"sites": [{"name": SITE, "racks": [rack_doc]}]}, sort_keys=False)


@dataclass
class Load:
    """Closed-loop clients through the router: short completions, one after another, each
    answer kept as (when, HTTP status; 0 for no answer at all)."""

    url: str
    clients: int = 2
    answers: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
            for i in range(self.clients)
        ]

    def _run(self) -> None:
        body = {"model": DEPLOYMENT, "prompt": "through the router", "max_tokens": 16}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    status = client.post(f"{self.url}/v1/completions", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                with self._lock:
                    self.answers.append((time.monotonic(), status))
                self._stop.wait(0.05)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(40)

    def count(self, since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for at, _ in self.answers if at >= since)

    def failed(self) -> list[tuple[float, int]]:
        with self._lock:
            return [a for a in self.answers if a[1] != 200]


@dataclass
class World:
    service: ServeProcess
    colos: list[VirtualColo]
    token: str
    fleet_proxy: TcpFaultProxy  # PART's agent → the fleet
    agent_proxy: TcpFaultProxy  # the router → PART's agent
    agent_port: int  # where PART's agent listens
    router: RouterProcess | None = None

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        reply = httpx.request(
            method, f"{self.service.url}/api/v1{path}", headers=headers, timeout=30, **kwargs
        )
        assert reply.status_code < 400, f"{method} {path}: {reply.status_code} {reply.text}"
        return reply.json()

    def server(self, name: str) -> dict[str, Any]:
        row: dict[str, Any] = self.api("GET", f"/servers/{name}")
        return row

    def events(self, name: str, after: int) -> list[dict[str, Any]]:
        rows = self.api("GET", "/events", params={"subject": name, "limit": 1000})["results"]
        return sorted((r for r in rows if r["id"] > after), key=lambda r: r["id"])

    def last_event_id(self) -> int:
        rows = self.api("GET", "/events", params={"limit": 1})["results"]
        return int(rows[0]["id"]) if rows else 0

    def in_table(self) -> set[str]:
        """The servers the fleet's routing table lists now."""
        rows = self.api("GET", "/routing")["results"]
        return {r["server"] for row in rows for r in row["replicas"]}

    def routed(self, name: str) -> dict[str, Any] | None:
        """The router's view of the server's replica (None: not in its table)."""
        assert self.router is not None
        state = httpx.get(f"{self.router.url}/state", timeout=5).json()
        for row in state["deployments"]:
            for replica in row["replicas"]:
                if replica["server"] == name:
                    return dict(replica)
        return None

    def engine_figure(self, name: str, metric: str) -> float:
        """A figure of the server's engines' own Prometheus page (read directly), summed."""
        total = 0.0
        for replica in self.server(name)["replicas"]:
            text = httpx.get(f"{replica['url']}/prometheus/metrics", timeout=5).text
            total += sum(float(v) for v in re.findall(rf"^{metric}\{{[^}}]*\}} (\S+)$", text, re.M))
        return total

    def finished(self, name: str) -> int:
        """Requests the server's engines finished."""
        return int(self.engine_figure(name, "trtllm_request_success_total"))

    def engine_idle(self, name: str) -> bool:
        metrics = ("trtllm_num_requests_running", "trtllm_num_requests_waiting")
        return all(self.engine_figure(name, m) == 0 for m in metrics)

    def agent_state(self) -> dict[str, Any]:
        """PART's agent's /state, straight to its port (not through the router's proxy)."""
        state: dict[str, Any] = httpx.get(
            f"http://127.0.0.1:{self.agent_port}/state", timeout=5
        ).json()
        return state

    def chassis_calls(self, name: str) -> list[str]:
        """The server's ipmi_sim chassis_control calls, oldest first (`set power 1`)."""
        for colo in self.colos:
            entry = colo.state()["servers"].get(name)
            if entry is not None:
                log = Path(entry["chassis_dir"]) / "chassis.log"
                return [" ".join(line.split()[1:]) for line in log.read_text().splitlines()]
        raise AssertionError(f"no server {name} in the labs")

    def why(self) -> str:
        try:
            rows = {n: self.server(n) for n in (PART, STEADY)}
            events = [
                f"{e['kind']} {e['from_state'] or ''}→{e['to_state'] or ''} {e['message'][:100]}"
                for e in self.events(PART, 0)[-10:]
            ]
        except (httpx.HTTPError, AssertionError) as exc:
            return f"{exc!r}\n{self.service.tail()}"
        states = {
            n: (r["state"], r["last_heartbeat_at"], r["agent_ready"]) for n, r in rows.items()
        }
        return f"servers: {states}\n{PART} events:\n  " + "\n  ".join(events)

    def both_serving(self) -> None:
        """Both servers serving, in the fleet's table and ready in the router."""

        def ready() -> bool:
            states = {n: self.server(n)["state"] for n in (PART, STEADY)}
            routed = [self.routed(n) for n in (PART, STEADY)]
            return set(states.values()) == {"serving"} and all(r and r["ready"] for r in routed)

        wait_for("both servers serving and routed", ready, SERVE_TIMEOUT_S, why=self.why)

    def takes_requests(self, name: str) -> int:
        """Waits until the server's engine finishes requests sent through the router now;
        returns its count then."""
        start = self.finished(name)
        wait_for(f"{name} taking requests", lambda: self.finished(name) > start, MOVE_TIMEOUT_S)
        return self.finished(name)

    def takes_none(self, name: str, load: Load, answers: int = 20) -> int:
        """With the router's view already changed: requests in flight on the server finish
        (its engines idle), then `answers` more client answers while the server's engines
        finish none. Returns those answers' count."""
        wait_for("in-flight requests to finish", lambda: self.engine_idle(name), 30)
        mark, since = self.finished(name), time.monotonic()
        wait_for(f"{answers} more answers", lambda: load.count(since) >= answers, 60)
        assert self.finished(name) == mark, f"{name} took requests while it should not"
        return load.count(since)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("agent-partition")
    with ExitStack() as stack:
        service = ServeProcess("serve", base / "fleet", SERVICE_SETTINGS)
        stack.callback(service.stop)
        service.start(admin_token=True)
        token = service.admin_token()
        engine = db.make_engine(f"sqlite:///{service.data_dir / 'fleet.db'}")
        stack.callback(engine.dispose)
        token_for = lab_token_maker(engine)

        fleet_proxy = TcpFaultProxy(service.port, name="agent-to-fleet").start()
        stack.callback(fleet_proxy.close)
        agent_port = free_port()
        agent_proxy = TcpFaultProxy(agent_port, name="router-to-agent").start()
        stack.callback(agent_proxy.close)
        labs = [
            # PART: its agent reaches the fleet through one proxy and registers the other.
            (
                PART,
                fleet_proxy.url,
                FAST_AGENT_SETTINGS
                | {
                    "FLEET_AGENT_LISTEN_PORT": str(agent_port),
                    "FLEET_AGENT_ADVERTISE_URL": agent_proxy.url,
                },
            ),
            (STEADY, service.url, FAST_AGENT_SETTINGS),
        ]
        colos = []
        for i, (name, fleet_url, agent_env) in enumerate(labs):
            colo = start_lab(
                fleet_url,
                token,
                inventory(f"chaos-r{i + 1:02d}", name),
                base / f"lab-{name}",
                token_for=token_for,
                boot_delay_s=BOOT_DELAY_S,
                agent_env=agent_env,
            )
            stack.callback(colo.down)  # before the service stops: agents go first
            colos.append(colo)
        world = World(service, colos, token, fleet_proxy, agent_proxy, agent_port)

        runner = CliRunner()
        env = {"FLEET_URL": service.url, "FLEET_TOKEN": token}
        for _ in range(10):  # a BMC the reconciler reads at that moment is busy: again
            verified = runner.invoke(cli.app, ["servers", "verify", "-o", "json"], env=env)
            if verified.exit_code == 0:
                break
            assert "another power action is in progress" in verified.stdout, verified.stdout
            time.sleep(0.3)
        assert verified.exit_code == 0, verified.stdout + verified.stderr
        created = runner.invoke(
            cli.app,
            [
                *("deployments", "create", DEPLOYMENT, "--model-uri", "s3://models/chaos-llm"),
                *("--checksum", "sha256:" + "ef" * 32),
                *("--sla-p95-ms", "2000", "--sla-ttft-ms", "300"),
                *("--gpus-per-replica", str(GPUS), "--gpu-model", "H100", "--max", "4"),
                *("--engine", "backend=pytorch", "--engine", f"tp_size={GPUS}"),
            ],
            env=env,
        )
        assert created.exit_code == 0, created.stdout + created.stderr
        booted = world.api("POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": 2})
        assert sorted(booted["booted"]) == sorted([PART, STEADY]), booted
        world.router = RouterProcess(
            base / "router.log",
            {
                "FLEET_ROUTER_FLEET_URL": service.url,
                "FLEET_ROUTER_TOKEN": token,
                "FLEET_ROUTER_FLEET_POLL_S": str(ROUTER_POLL_S),
                "FLEET_ROUTER_CLIENT_AUTH": "none",
                "FLEET_ROUTER_LOG_LEVEL": "WARNING",
            },
        )
        stack.callback(world.router.stop)
        world.both_serving()
        yield world


# ---------------------------------------------------------------------------------------------
# 1. The agent cut off from the fleet, not from the router


def test_an_agent_cut_off_from_the_fleet_leaves_the_table_keeps_serving_and_rejoins_once(
    world: World,
) -> None:
    world.both_serving()
    before = world.last_event_id()
    assert world.router is not None
    with Load(world.router.url) as load:
        world.takes_requests(PART)
        cut_at = time.monotonic()
        world.fleet_proxy.black_hole()
        wait_for(
            f"{PART} out of the routing table",
            lambda: PART not in world.in_table(),
            MOVE_TIMEOUT_S,
            why=world.why,
        )
        table_s = time.monotonic() - cut_at
        wait_for(
            f"{PART} out of the router's view",
            lambda: world.routed(PART) is None,
            MOVE_TIMEOUT_S,
            why=world.router.tail,
        )
        router_s = time.monotonic() - cut_at
        meanwhile = world.takes_none(PART, load)
        # The agent keeps its engines serving and its API answering; it knows the fleet is
        # away. The fleet has not moved the server (silence is shorter than CYCLE_AFTER_S).
        state = world.agent_state()
        replica = world.server(PART)["replicas"][0]
        body = {"model": DEPLOYMENT, "prompt": "straight to the engine", "max_tokens": 8}
        direct = httpx.post(f"{replica['url']}/v1/completions", json=body, timeout=30)
        silent_s = time.monotonic() - cut_at
        assert world.server(PART)["state"] == "serving", world.why()

        world.fleet_proxy.pass_through()
        healed_at = time.monotonic()
        wait_for(
            f"{PART} back in the table",
            lambda: PART in world.in_table(),
            MOVE_TIMEOUT_S,
            why=world.why,
        )
        back_s = time.monotonic() - healed_at
        world.takes_requests(PART)
        reused_s = time.monotonic() - healed_at
    events = world.events(PART, before)
    kinds = [e["kind"] for e in events]
    print(
        f"\n{PART} cut off from the fleet: out of the table {table_s:.1f} s later, out of the "
        f"router {router_s:.1f} s later; {meanwhile} answers meanwhile, none by {PART}; silent "
        f"for {silent_s:.1f} s in all; its agent: ready={state['ready']}, registered="
        f"{state['registered']}; healed: back in the table {back_s:.1f} s later, taking "
        f"requests {reused_s:.1f} s later; {len(load.answers)} answers in all, "
        f"{len(load.failed())} failed; events {kinds}"
    )
    assert direct.status_code == 200, direct.text  # the engine served all along
    assert state["ready"] is True
    assert load.failed() == [], load.failed()
    assert kinds.count("server.agent_registered") == 1, kinds  # registered again, once
    assert "server.transition" not in kinds, kinds
    assert world.server(PART)["state"] == "serving"


# ---------------------------------------------------------------------------------------------
# 2. The router cut off from the agent, not the agent from the fleet


def test_a_router_cut_off_from_an_agent_stops_sending_to_it_while_the_fleet_sees_it_healthy(
    world: World,
) -> None:
    world.both_serving()
    before = world.last_event_id()
    assert world.router is not None
    with Load(world.router.url) as load:
        world.takes_requests(PART)
        cut_at = time.monotonic()
        world.agent_proxy.black_hole()

        def not_ready() -> bool:
            replica = world.routed(PART)
            return replica is not None and not replica["ready"]

        wait_for(f"{PART} not ready in the router", not_ready, MOVE_TIMEOUT_S, why=world.why)
        router_s = time.monotonic() - cut_at
        meanwhile = world.takes_none(PART, load)
        # The fleet hears the agent all along: serving, ready, fresh, in the table.
        server = world.server(PART)
        listed = PART in world.in_table()
        cut_s = time.monotonic() - cut_at

        world.agent_proxy.pass_through()
        healed_at = time.monotonic()

        def ready() -> bool:
            replica = world.routed(PART)
            return replica is not None and bool(replica["ready"])

        wait_for(f"{PART} ready in the router again", ready, MOVE_TIMEOUT_S, why=world.why)
        back_s = time.monotonic() - healed_at
        world.takes_requests(PART)
        reused_s = time.monotonic() - healed_at
    kinds = [e["kind"] for e in world.events(PART, before)]
    print(
        f"\nthe router cut off from {PART}'s agent: not ready in the router {router_s:.1f} s "
        f"later; {meanwhile} answers meanwhile, none by {PART}; cut for {cut_s:.1f} s while the "
        f"fleet saw it {server['state']}, agent_ready={server['agent_ready']}, in the table: "
        f"{listed}; healed: ready {back_s:.1f} s later, taking requests {reused_s:.1f} s later;"
        f" {len(load.answers)} answers in all, {len(load.failed())} failed; events {kinds}"
    )
    assert server["state"] == "serving" and server["agent_ready"] is True, server
    assert server["health_verdict"] == "healthy", server
    assert listed
    assert load.failed() == [], load.failed()
    assert kinds == [], kinds  # nothing happened to the server as far as the fleet knows


# ---------------------------------------------------------------------------------------------
# 3. Cut off from the fleet for longer than the silence the fleet accepts


def test_an_agent_silent_past_the_deadline_is_drained_cycled_once_and_serves_again_healed(
    world: World,
) -> None:
    world.both_serving()
    before = world.last_event_id()
    calls_before = len(world.chassis_calls(PART))
    assert world.router is not None
    with Load(world.router.url) as load:
        cut_at = time.monotonic()
        world.fleet_proxy.black_hole()
        timeline: dict[str, float] = {}
        for step in ("draining", "booting"):
            wait_for(
                f"{PART} {step}",
                lambda step=step: world.server(PART)["state"] == step,  # type: ignore[misc]
                CYCLE_AFTER_S + DRAIN_DEADLINE_S + MOVE_TIMEOUT_S,
                why=world.why,
            )
            timeline[step] = time.monotonic() - cut_at
        # The power cycle reached the emulator; the new agent is behind the same partition.
        wait_for(
            "the power cycle at the emulator",
            lambda: world.chassis_calls(PART)[calls_before:] == ["set power 0", "set power 1"],
            MOVE_TIMEOUT_S,
        )
        world.fleet_proxy.pass_through()
        healed_at = time.monotonic()
        wait_for(
            f"{PART} serving again",
            lambda: world.server(PART)["state"] == "serving",
            SERVE_TIMEOUT_S,
            why=world.why,
            give_up=lambda: "it failed" if world.server(PART)["state"] == "failed" else None,
        )
        timeline["serving"] = time.monotonic() - cut_at
        world.both_serving()
        world.takes_requests(PART)
        healed_s = time.monotonic() - healed_at
    events = world.events(PART, before)
    moves = [(e["from_state"], e["to_state"]) for e in events if e["kind"] == "server.transition"]
    drain = next(e for e in events if e["kind"] == "server.transition")
    registered = [e for e in events if e["kind"] == "server.agent_registered"]
    calls = world.chassis_calls(PART)[calls_before:]
    print(
        f"\n{PART} cut off from the fleet: "
        + ", ".join(f"{step} {t:.1f} s" for step, t in timeline.items())
        + f" after the cut (healed once booting; taking requests {healed_s:.1f} s after)"
        f"\nreason: {drain['message']!r}; chassis calls {calls}; registrations "
        f"{len(registered)}; {len(load.answers)} answers in all, {len(load.failed())} failed"
    )
    assert moves == [
        ("serving", "draining"),
        ("draining", "drained"),
        ("drained", "booting"),
        ("booting", "loading"),
        ("loading", "serving"),
    ], moves
    assert drain["message"].startswith("remediation: no heartbeat for"), drain
    # Never before the documented silence (counted from the last heartbeat, at most one
    # interval before the cut).
    assert timeline["draining"] >= CYCLE_AFTER_S - HEARTBEAT_S, timeline
    assert calls == ["set power 0", "set power 1"], calls  # one power cycle
    assert len(registered) == 1, registered  # the new agent, once
    assert load.failed() == [], load.failed()
