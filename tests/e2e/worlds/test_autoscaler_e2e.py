"""The autoscaler end to end: a real `fleetctl serve` (embedded SQLite, its control loops on:
reconciler, provisioner, autoscaler) drives the virtual colo (one ipmi_sim per server, real
agents with STAND-IN engines) with the issue's windows shortened by settings.

The lab (tests/colo_world.py): four warm 2 × L40S servers (IPMI, so a power-off applies at
once). The deployment serves Llama-3.1-70B FP8 with tp_size 2 (one replica per server) and
max_batch_size 2: each replica runs two requests at a time (~10 tokens/s each on the stand-in's
cost model) and queues the rest, which the engine reports as numQueuedRequests (/metrics) → the
agent's replica stats `queued` → the heartbeat → Server.replicas → the autoscaler's queue per
GPU. Its SLAs are an hour, so that the queue alone drives the scaling.

One scenario, in order:

0. The deployment is created through the API (min_replicas 1, max_replicas 3) and started by
   `fleetctl spares boot --count 1` (target 1), the autopilot paused meanwhile (see there why).
1. Steady light load (one client, never more than the batch): no scale.
2. A spike: SPIKE_CLIENTS closed-loop streaming clients (ignore_eos) on the serving server's
   engine: ~6 waiting per GPU against a target of 2. After the up window (and within a tick
   or two of it) the target goes 1 → 3 (+4, capped at max_replicas 3: rule `max`, the reason
   names `queue_high`), with a `deployment.scaled` Event; two spares boot and serve.
3. The clients follow the serving set as a router would (re-read from the API every
   WATCH_S): spread over three servers the queue per GPU falls to ~1.3, between the low water
   (1) and the target (2), so the autoscaler holds.
4. The load stops: after the down window the target goes 3 → 2 → 1 (rule `scale_down`, one
   server at a time, COOLDOWN_DOWN_S apart) and the surplus drains and powers off back to warm.

`fleetctl autoscaler status/history/explain` are run once, at the end. `pytest -s` prints the
timeline.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
from colo_world import World, colo_world, ipmi_inventory, parse_at

from fleet.autoscaler.signals import Signals, aggregate
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    SERVING_SETTINGS,
)
from fleet.lab.harness import wait_for as _wait_for

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

# The autoscaler, shortened: a tick a second, up after 5 s over, down after 15 s under.
INTERVAL_S = 1.0
UP_WINDOW_S = 5.0
DOWN_WINDOW_S = 15.0
COOLDOWN_DOWN_S = 3.0
QUEUE_PER_GPU = 2.0
# The harness's fast loops, with this test's autoscaler.
SERVICE_SETTINGS = (
    FAST_SERVICE_SETTINGS
    | SERVING_SETTINGS
    | {
        "FLEET_AUTOSCALE_INTERVAL_S": str(INTERVAL_S),
        "FLEET_AUTOSCALE_QUEUE_PER_GPU": str(QUEUE_PER_GPU),
        "FLEET_AUTOSCALE_UP_WINDOW_S": str(UP_WINDOW_S),
        "FLEET_AUTOSCALE_DOWN_WINDOW_S": str(DOWN_WINDOW_S),
        "FLEET_AUTOSCALE_COOLDOWN_DOWN_S": str(COOLDOWN_DOWN_S),
    }
)
# The lab: the harness's fast agents; the stand-in plays a 70B model on the inventory's L40S
# GPUs (slow: ~0.1 s an iteration).
BOOT_DELAY_S = 0.5
AGENT_ENV = FAST_AGENT_SETTINGS | {"FLEET_STANDIN_MODEL": "llama-3.1-70b"}

SITE, RACK = "as", "as-r01"
SERVERS = tuple(f"{RACK}-l40s-{i}" for i in range(1, 5))
GPUS_PER_SERVER = 2
DEPLOYMENT = "llama-70b"
MODEL_URI = "s3://models/llama-3.1-70b"
MAX_BATCH = 2  # requests an engine runs at once; the rest wait
MAX_REPLICAS = 3  # one replica per server: at most three servers
MAX_TOKENS = 16  # ~1.7 s a request at batch 2
# 14 clients: on one server 12 wait (6/GPU, 3× the target: +4, capped at 3 servers); on three,
# 8 wait (1.33/GPU: over the low water, under the target: hold), and never more than 12 (2/GPU,
# not over it) while the router moves clients over to the new servers.
SPIKE_CLIENTS = 14
LIGHT_CLIENTS = 1
WATCH_S = 0.5  # the watcher's (and the router's) view of the fleet is refreshed this often
SERVE_TIMEOUT_S = 90.0  # one spare from warm to serving, on a busy 2-core machine
# Polled every 0.2 s: waits read the API at most five times a second on the busy machine.
wait_for = partial(_wait_for, every=0.2)


# ---------------------------------------------------------------------------------------------
# The world (tests/colo_world.py): `fleetctl serve` on its embedded SQLite database, loops on,
# and the lab; what the test asks of them about the deployment (through the API and the CLI)


class ScalingWorld(World):
    """colo_world's World, with the deployment's autoscaler row, decisions and Events."""

    def autoscaler(self) -> dict[str, Any]:
        rows = self.api("GET", "/autoscaler")["results"]
        [row] = [r for r in rows if r["deployment"] == DEPLOYMENT]
        return dict(row)

    def decisions(self, after: int = 0) -> list[dict[str, Any]]:
        """The deployment's scaling decisions with an id above `after`, oldest first."""
        return [d for d in self.api.decisions(DEPLOYMENT) if d["id"] > after]

    def last_decision_id(self) -> int:
        rows = self.decisions()
        return int(rows[-1]["id"]) if rows else 0

    def events(self, subject: str, kind: str) -> list[dict[str, Any]]:
        return self.api.events(subject=subject, kind=kind)

    def why(self) -> str:
        try:
            states = ", ".join(f"{n}: {s}" for n, s in sorted(self.states().items()))
            decisions = "\n".join(
                f"  {d['at']} {d['rule']} {d['target_before']}→{d['target_after']}: {d['reason']}"
                for d in self.decisions()[-12:]
            )
        except (httpx.HTTPError, AssertionError) as exc:
            states, decisions = repr(exc), ""
        return f"servers: {states}\ndecisions:\n{decisions}\n{self.service.tail()}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScalingWorld]:
    """The service, the lab (every server warm) and nothing else; everything stopped at the
    end, whatever happened: agents first (the lab, no process of it left), then the service."""
    base = tmp_path_factory.mktemp("autoscaler-e2e")
    inventory = ipmi_inventory(SITE, RACK, SERVERS, "L40S", GPUS_PER_SERVER)
    with colo_world(
        base, inventory, SERVICE_SETTINGS, boot_delay_s=BOOT_DELAY_S, agent_env=AGENT_ENV
    ) as w:
        yield ScalingWorld(w.service, w.colo, w.api, w.database)


# ---------------------------------------------------------------------------------------------
# Watching the fleet as the autoscaler does, and a router on top of it


@dataclass(frozen=True)
class Sample:
    at: float  # epoch seconds
    states: dict[str, str]
    urls: dict[str, list[str]]  # serving server -> its ready replicas' engine URLs
    signals: Signals  # aggregate() over the serving servers' last heartbeats
    waiting: int
    running: int
    target: int

    @property
    def serving(self) -> list[str]:
        return sorted(self.urls)


class Watcher:
    """Samples the fleet every WATCH_S through the API: the servers' states and last replica
    stats (aggregated with the autoscaler's own `aggregate`) and the deployment's target."""

    def __init__(self, world: ScalingWorld) -> None:
        self.world = world
        self.samples: list[Sample] = []
        self.errors = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        wait_for("a first sample", lambda: self.samples, 30)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=35)
        assert not self._thread.is_alive(), "the watcher did not stop"

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                sample = self._sample()
            except (httpx.HTTPError, AssertionError, KeyError, ValueError):
                self.errors += 1
            else:
                with self.lock:
                    self.samples.append(sample)
            self._stop.wait(max(0.0, WATCH_S - (time.monotonic() - began)))

    def _sample(self) -> Sample:
        servers = self.world.servers()
        target = int(self.world.autoscaler()["target"])
        at = time.time()
        serving = [s for s in servers if s["state"] == "serving"]
        urls = {
            s["name"]: sorted(r["url"] for r in s["replicas"] if r.get("state") == "ready")
            for s in serving
            if s["agent_ready"]
        }
        ready = [r for s in serving for r in s["replicas"] if r.get("state") in (None, "ready")]
        return Sample(
            at=at,
            states={s["name"]: s["state"] for s in servers},
            urls={n: u for n, u in urls.items() if u},
            signals=aggregate(
                [{"gpu_count": s["gpu_count"], "replicas": s["replicas"]} for s in serving], at
            ),
            waiting=sum(int(r.get("queued") or 0) for r in ready),
            running=sum(int(r.get("running") or 0) for r in ready),
            target=target,
        )

    def latest(self) -> Sample:
        with self.lock:
            return self.samples[-1]

    def since(self, at: float) -> list[Sample]:
        with self.lock:
            return [s for s in self.samples if s.at >= at]

    def router(self) -> list[str]:
        """What a router would send to: every ready replica of every serving server."""
        return [u for urls in self.latest().urls.values() for u in urls]


class Load:
    """`clients` closed-loop clients, each a thread streaming one completion after another
    (ignore_eos: exactly MAX_TOKENS tokens) to the replica the router's round robin names."""

    def __init__(self, name: str, clients: int, route: Callable[[], list[str]]) -> None:
        self.name = name
        self.route = route
        self.ok = 0
        self.errors: list[str] = []
        self.per_url: dict[str, int] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(clients)
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> list[str]:
        """No new request; the ones in flight finish (bounded). The clients still running."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _client(self, index: int) -> None:
        timeout = httpx.Timeout(60.0, connect=5.0)
        with httpx.Client(timeout=timeout) as client:
            for n in itertools.count():
                if self._stop.is_set():
                    return
                urls = self.route()
                if not urls:
                    self._stop.wait(0.2)
                    continue
                with self._lock:
                    url = urls[next(self._turn) % len(urls)]
                error = self._one(client, url, f"{self.name} client {index} request {n}")
                with self._lock:
                    if error is None:
                        self.ok += 1
                        self.per_url[url] = self.per_url.get(url, 0) + 1
                    else:
                        self.errors.append(f"{url}: {error}")
                if error is not None:
                    self._stop.wait(0.5)

    def _one(self, client: httpx.Client, url: str, prompt: str) -> str | None:
        body = {
            "model": DEPLOYMENT,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks: list[str] = []
        try:
            with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    return f"HTTP {reply.status_code}"
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
        except httpx.HTTPError as exc:
            return repr(exc)
        if chunks[-1:] != ["[DONE]"]:
            return f"ended without [DONE]: {chunks[-2:]}"
        usage = json.loads(chunks[-2])["usage"]
        if usage["completion_tokens"] != MAX_TOKENS:
            return f"cut short: {usage}"
        return None


# ---------------------------------------------------------------------------------------------
# The scenario


def _queue(s: Sample) -> float:
    return s.signals.queue_per_gpu or 0.0


def test_a_queue_spike_scales_out_after_the_up_window_and_back_in_after_the_down_window(
    world: ScalingWorld,
) -> None:
    # 0. The deployment, created through the API with min_replicas 1, started by an operator's
    # `spares boot --count 1` (target 1). The autopilot is paused meanwhile: else the
    # autoscaler's next tick may raise the target 0 → 1 first (rule min) and the boot make it
    # 2; and a raise by the min rule counts as a scale-up, whose 60 s up cooldown would hold
    # the spike's scale-up (see the report: fleet/autoscaler/service.py _record).
    paused = world.fleetctl("autopilot", "pause", "--reason", "autoscaler e2e: set-up")
    assert paused.exit_code == 0, paused.stdout + paused.stderr
    world.api(
        "POST",
        "/deployments",
        json={
            "name": DEPLOYMENT,
            "model_uri": MODEL_URI,
            "model_checksum": "sha256:1",
            "engine_params": {"backend": "pytorch", "tp_size": 2, "max_batch_size": MAX_BATCH},
            "gpus_per_replica": GPUS_PER_SERVER,
            "gpu_models": ["L40S"],
            "min_replicas": 1,
            "max_replicas": MAX_REPLICAS,
            # An hour: latency never scales anything here, and is always under the low water.
            "sla_p95_latency_ms": 3_600_000,
            "sla_ttft_ms": 3_600_000,
        },
    )
    booted = world.fleetctl(
        *("spares", "boot", "--deployment", DEPLOYMENT, "--count", "1", "--wait", "0"),
        *("-o", "json"),
    )
    assert booted.exit_code == 0, booted.stdout + booted.stderr
    [boot] = json.loads(booted.stdout)
    resumed = world.fleetctl("autopilot", "resume", "--reason", "autoscaler e2e: go")
    assert resumed.exit_code == 0, resumed.stdout + resumed.stderr
    created = time.time()
    assert world.autoscaler()["target"] == 1

    timeline: list[tuple[float, str]] = []

    def mark(what: str, at: float | None = None) -> float:
        at = time.time() if at is None else at
        timeline.append((at, what))
        return at

    with Watcher(world) as watch:
        initial = wait_for(
            "one server serving",
            lambda: watch.latest().serving if len(watch.latest().serving) == 1 else None,
            SERVE_TIMEOUT_S,
            why=world.why,
        )
        assert initial == [boot["server"]], (initial, boot)
        mark(f"{initial[0]} serving ({time.time() - created:.1f} s after spares boot)")

        # 1. Steady light load: never more than the engine's batch, nothing waits: no scale.
        mark_id = world.last_decision_id()
        light_from = mark("light load: 1 client")
        light = Load("light", LIGHT_CLIENTS, watch.router).start()
        try:
            time.sleep(UP_WINDOW_S + 4 * INTERVAL_S)
        finally:
            left = light.stop()
        assert not left, f"light clients still streaming: {left}"
        samples = watch.since(light_from)
        assert light.ok > 0 and not light.errors, (light.ok, light.errors)
        assert max(_queue(s) for s in samples) <= QUEUE_PER_GPU
        assert {s.target for s in samples} == {1}
        changes = [d for d in world.decisions(mark_id) if d["target_after"] != d["target_before"]]
        assert not changes, changes
        print(f"\nlight load: {light.ok} requests, queue/GPU max {max(map(_queue, samples)):.2f}")

        # 2. The spike, all on the one serving server (the only one a router knows).
        mark_id = world.last_decision_id()
        spike_at = mark(f"spike: {SPIKE_CLIENTS} clients")
        spike = Load("spike", SPIKE_CLIENTS, watch.router).start()
        try:
            over = wait_for(
                f"queue/GPU over {QUEUE_PER_GPU:g}",
                lambda: next((s for s in watch.since(spike_at) if _queue(s) > QUEUE_PER_GPU), None),
                30,
                why=world.why,
            )
            mark(f"queue/GPU first over the target: {_queue(over):.2f} ({over.waiting} waiting)")

            def raised() -> dict[str, Any] | None:
                return next(
                    (d for d in world.decisions(mark_id) if d["target_after"] > d["target_before"]),
                    None,
                )

            up = wait_for("the scale-up decision", raised, UP_WINDOW_S + 30, why=world.why)
            up_at = mark(
                f"decision {up['rule']}: target 1 → {up['target_after']}", parse_at(up["at"])
            )
            _check_scale_up(world, up, over.at, mark_id)

            # The spares boot and serve; the router follows them.
            serving = wait_for(
                f"{MAX_REPLICAS} servers serving",
                lambda: watch.latest() if len(watch.latest().serving) == MAX_REPLICAS else None,
                SERVE_TIMEOUT_S,
                why=world.why,
            )
            spares = sorted(set(serving.serving) - set(initial))
            all_serving = up_at
            for name in spares:
                became = min(s.at for s in watch.since(up_at) if s.states[name] == "serving")
                all_serving = max(all_serving, mark(f"{name} serving", became))

            # 3. Spread over three servers, the queue per GPU falls under the target.
            time.sleep(3 * INTERVAL_S + 2)  # the router moved; the engines' queues settle
            settled = time.time()
            time.sleep(4)
            spread = [s for s in watch.since(settled) if len(s.serving) == MAX_REPLICAS]
        finally:
            stop_at = mark("load stopped")
            left = spike.stop()
        assert not left, f"clients still streaming 60 s after the load stopped: {left}"
        mark("last request of the spike finished")
        assert spike.ok > 0 and not spike.errors, (spike.ok, spike.errors[:5])
        peak = max(_queue(s) for s in watch.since(spike_at) if s.at <= up_at)
        assert spread, "no sample with three servers serving"
        after = sum(_queue(s) for s in spread) / len(spread)
        print(
            f"queue/GPU: {peak:.2f} at the peak on 1 server, {after:.2f} on "
            f"{MAX_REPLICAS} (mean of {len(spread)} samples); requests per engine: "
            + ", ".join(f"{u.rsplit(':', 1)[1]} {n}" for u, n in sorted(spike.per_url.items()))
        )
        assert after < QUEUE_PER_GPU < peak
        assert after < peak / 2
        urls = {u for s in spread for urls in s.urls.values() for u in urls}
        assert all(spike.per_url.get(u, 0) > 0 for u in urls), (urls, spike.per_url)
        # Nothing scaled in while the load was spread (it sat over the low water).
        during = [s.target for s in watch.since(all_serving) if s.at <= stop_at]
        assert set(during) == {MAX_REPLICAS}, during

        # 4. The load has stopped: after the down window, back to 1, one server at a time.
        surplus = MAX_REPLICAS - 1
        down_id = world.last_decision_id()

        def back_to_one() -> list[dict[str, Any]] | None:
            downs = [d for d in world.decisions(down_id) if d["rule"] == "scale_down"]
            return downs if downs and downs[-1]["target_after"] == 1 else None

        downs = wait_for(
            "target back to 1",
            back_to_one,
            DOWN_WINDOW_S + surplus * COOLDOWN_DOWN_S + 45,
            why=world.why,
        )
        for d in downs:
            mark(
                f"decision scale_down: {d['target_before']} → {d['target_after']}",
                parse_at(d["at"]),
            )
        assert [(d["target_before"], d["target_after"]) for d in downs] == [(3, 2), (2, 1)]
        first_down = parse_at(downs[0]["at"])
        assert first_down - stop_at >= DOWN_WINDOW_S - 0.5, (first_down - stop_at, downs[0])
        assert parse_at(downs[1]["at"]) - first_down >= COOLDOWN_DOWN_S - 0.5
        for d in downs:
            assert "every signal under 50% of its target for 15 s" in d["reason"], d["reason"]

        def returned() -> Sample | None:
            s = watch.latest()
            warm = [n for n, state in s.states.items() if state == "warm"]
            return s if len(s.serving) == 1 and len(warm) == len(SERVERS) - 1 else None

        wait_for("the surplus back in the warm pool", returned, 90, why=world.why)
        gone = [n for n in serving.serving if world.states()[n] == "warm"]
        assert len(gone) == surplus, gone
        for name in gone:
            moves = [
                (e["from_state"], e["to_state"], parse_at(e["at"]))
                for e in world.events(name, "server.transition")
                if parse_at(e["at"]) >= stop_at
            ]
            assert [(a, b) for a, b, _ in moves] == [
                ("serving", "draining"),
                ("draining", "drained"),
                ("drained", "powering_off"),
                ("powering_off", "warm"),
            ], moves
            mark(f"{name} draining", moves[0][2])
            mark(f"{name} warm", moves[-1][2])

    # The operator's view: status, history and explain name the rules.
    _check_cli(world, up)
    print("decisions:")
    for d in world.decisions():
        print(f"  t = {parse_at(d['at']) - spike_at:+7.1f} s  {d['rule']}: {d['reason']}")

    t0 = spike_at
    print(f"timeline (t = 0 at the spike; up window {UP_WINDOW_S:g} s, down {DOWN_WINDOW_S:g} s):")
    for at, what in sorted(timeline):
        print(f"  t = {at - t0:+7.1f} s  {what}")


def _check_scale_up(world: ScalingWorld, up: dict[str, Any], over_at: float, after_id: int) -> None:
    """The decision that raised the target: the queue's rule, its numbers, its timing (from
    when this test first saw the queue over the target, and from the autoscaler's own first
    observation over it), its Event."""
    up_at = parse_at(up["at"])
    before = [d for d in world.decisions(after_id) if d["id"] < up["id"]]
    # The autoscaler's first tick over the target writes a `window` row ("... for 0 s of the
    # 5 s up window: wait"); missing data in between (a late heartbeat) would start it again.
    runs = [d for d in before if d["rule"] == "window" and "up window" in d["reason"]]
    restarted = any(d["rule"] == "no_data" for d in before if runs and d["id"] > runs[0]["id"])
    delay = up_at - over_at
    print(
        f"scale-up {delay:.1f} s after this test saw the queue over the target"
        + (f", {up_at - parse_at(runs[-1]['at']):.1f} s after the autoscaler did" if runs else "")
        + f" (up window {UP_WINDOW_S:g} s, tick {INTERVAL_S:g} s)"
        + (" (the window started again: missing data)" if restarted else "")
        + f": {up['rule']}: {up['reason']}"
    )
    # +4 at 3×, capped at max_replicas: rule `max`, and the reason names queue_high. (A ratio
    # under 2 would have been +1 or +2 by queue_high itself.)
    assert up["target_before"] == 1 and up["target_after"] == MAX_REPLICAS, up
    assert up["rule"] in ("max", "queue_high"), up
    assert "queue " in up["reason"] and f"> {QUEUE_PER_GPU:g}/GPU" in up["reason"], up["reason"]
    if up["rule"] == "max":
        # The policy's reason, then where the first new replica goes (the placement note).
        policy, _, placement = up["reason"].partition("; placement: ")
        assert policy.endswith(f"capped at max {MAX_REPLICAS} (queue_high)"), up["reason"]
        assert placement, up["reason"]
    inputs = up["inputs"]
    assert inputs["queue_per_gpu"] > QUEUE_PER_GPU and inputs["serving"] == 1, inputs
    assert inputs["up_window_s"] == UP_WINDOW_S
    assert UP_WINDOW_S <= inputs["over_for_s"] <= UP_WINDOW_S + 2 * INTERVAL_S, inputs
    # Never before the window is full; within a tick of it (plus a tick's jitter).
    assert delay >= UP_WINDOW_S - 1.5, delay
    if runs:
        assert UP_WINDOW_S <= up_at - parse_at(runs[-1]["at"]) <= UP_WINDOW_S + 2 * INTERVAL_S
    if not restarted:  # the test may see the queue a heartbeat and a tick before the loop
        assert delay <= UP_WINDOW_S + 2 * INTERVAL_S + 2, delay
    [event] = [
        e
        for e in world.events(DEPLOYMENT, "deployment.scaled")
        if e["details"]["delta"] > 0 and abs(parse_at(e["at"]) - up_at) < 0.01
    ]
    assert event["actor"] == "autoscaler"
    assert event["message"].startswith(f"target 1 → {MAX_REPLICAS}: "), event["message"]
    assert event["details"] == {"rule": up["rule"], "delta": MAX_REPLICAS - 1}, event


def _check_cli(world: ScalingWorld, up: dict[str, Any]) -> None:
    status = world.fleetctl("autoscaler", "status")
    assert status.exit_code == 0, status.stdout + status.stderr
    print(f"fleetctl autoscaler status:\n{status.stdout}")
    last = world.decisions()[-1]
    line = next(line for line in status.stdout.splitlines() if DEPLOYMENT in line)
    assert last["rule"] in line and "auto" in line, status.stdout

    history = world.fleetctl("autoscaler", "history", DEPLOYMENT, "--limit", "1000")
    assert history.exit_code == 0, history.stdout + history.stderr
    for rule in (up["rule"], "scale_down"):
        assert f" {rule} " in history.stdout, f"{rule} not in\n{history.stdout}"

    explain = world.fleetctl("autoscaler", "explain", DEPLOYMENT)
    assert explain.exit_code == 0, explain.stdout + explain.stderr
    head = f"{DEPLOYMENT}: {last['rule']} at "
    assert explain.stdout.startswith(head), explain.stdout
    assert f"why: {last['reason'][:60]}" in explain.stdout, explain.stdout
    assert "queue_per_gpu_target" in explain.stdout, explain.stdout
    print(f"fleetctl autoscaler explain {DEPLOYMENT}:\n{explain.stdout}")
