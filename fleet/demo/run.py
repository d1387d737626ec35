"""`fleetctl demo`: the whole fleet through a traffic day, a spike and a GPU fault, in minutes.

1. The fleet service (embedded SQLite, its control loops on, windows and delays shortened) and
   the virtual colo (the demo's servers behind a Redfish emulator, agents with STAND-IN engines)
   start; the inventory is imported and every BMC verified: all servers are warm spares.
2. The deployments are created, one per engine (trtllm, vllm, sglang; or all on --engine),
   each with min_replicas 1: the autoscaler's floors boot a spare each through its BMC (their
   boot-to-ready times are measured: the calendar's lead).
3. The router starts; a calendar entry ("launch") is added for a window in the traffic.
4. The Azure conversation trace is replayed through the router (time-compressed, thinned), a
   draw of it per deployment, with a spike and a fall (fleet/demo/plan.py); a fatal Xid is
   injected into a serving server.
5. A summary, a chart, and (unless --keep) everything stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.live import Live

from fleet.data import DEMO_INVENTORY
from fleet.demo import plan
from fleet.demo.load import Replay
from fleet.demo.report import Summary, chart, summarize
from fleet.demo.view import Sample, line, observe, render
from fleet.demo.world import (
    AGENT_SETTINGS,
    BOOT_DELAY_S,
    CLIENT_KEY_FILE,
    DEMO_TENANT,
    SERVICE_SETTINGS,
    DemoError,
    World,
    start_lab,
    start_router,
    start_service,
    wait_until,
)
from fleet.traces import load_trace
from fleet_core import cost_model

DEMO_FLEET = DEMO_INVENTORY.parent / "demo-fleet.yaml"  # the demo's deployments
FAULT_XID = 79  # "GPU has fallen off the bus": fatal, the agent drains itself
# After the traffic, at most: in-flight requests finish and the scale-down ends. The latency
# signals look back a minute (the engines' and the router's p95 windows), so the scale-down
# starts about a minute after the spike; then a server every down window, and its BMC reports
# it off 1-11 s after the power-off (sushy). Measured on an idle 2-core VM: the first server back
# in the warm pool 88 s after the traffic; a busy CI runner took longer than 90 s. The loop ends
# as soon as the fleet is at rest, so the bound only matters when it is not.
WIND_DOWN_S = 150.0
# Set in this process, inherited by every process the demo starts (service, router, emulators,
# agents, engines; none of them strips it): `tests/e2e/worlds/test_demo.py` finds leftovers by it.
MARKER = "FLEETDEMO_DIR"


@dataclass(frozen=True)
class Options:
    duration_s: float = 120.0
    servers: int = 6
    engine: str | None = None  # every deployment on this engine; None: each on its own
    live: bool = True
    keep: bool = False
    workdir: Path | None = None
    inventory: Path = DEMO_INVENTORY
    fleet: Path = DEMO_FLEET
    trace: str = "conv"
    seed: int = 0


def capacity_rps(deployment: dict[str, Any], prompt: float, output: float) -> float:
    """Requests a second one demo server answers at its batch limit (the cost model)."""
    tp, batch = plan.replica_shape(deployment)
    shape = cost_model.EngineShape(
        gpu=cost_model.gpu_spec("L40S"),
        model=cost_model.guess_model(deployment["model_uri"]),
        tp_size=tp,
        max_batch_size=batch,
    )
    tokens_per_s = cost_model.predicted_decode_tokens_per_s(shape, batch, prompt, output)
    return tokens_per_s / output


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the demo as Ctrl-C does (everything is stopped on the way out)."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_demo(options: Options, console: Console) -> Summary:
    workdir = (options.workdir or Path(tempfile.mkdtemp(prefix="fleet-demo-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[MARKER] = str(workdir)
    timeline = plan.Timeline(options.duration_s)
    deployments = plan.deployments(
        yaml.safe_load(options.fleet.read_text()), options.servers, options.engine
    )
    floors = sum(d["min_replicas"] for d in deployments)
    if options.servers < floors + 1:
        raise DemoError(f"--servers must be at least {floors + 1}: {floors} floors and a spare")
    deployment = deployments[0]
    sla_s = deployment["sla_p95_latency_ms"] / 1000
    inventory = plan.demo_inventory(yaml.safe_load(options.inventory.read_text()), options.servers)
    trace = load_trace(options.trace)
    probe = plan.arrivals(trace, plan.Timeline(3600.0), 1.0, seed=options.seed)
    mean_prompt = sum(a.prompt_tokens for a in probe) / max(1, len(probe))
    mean_output = sum(a.output_tokens for a in probe) / max(1, len(probe))
    per_server = capacity_rps(deployment, mean_prompt, mean_output)
    # Two servers' worth at 60 % before the spike, shared by the deployments: the spike needs
    # about twice the fleet it starts on.
    base_rps = 0.6 * 2 * per_server / len(deployments)
    world = World(workdir)

    def say(text: str) -> None:
        console.print(f"[bold cyan]demo[/] {text}")

    completed = False
    with _signals_interrupt():
        try:
            say(f"working directory {workdir} (logs, the database, the chart)")
            say(
                "time is compressed: the trace's hour is replayed in "
                f"{options.duration_s:.0f} s, thinned to {base_rps:.1f} requests/s a "
                f"deployment ({len(deployments)}) before the "
                f"spike ×{timeline.spike_factor:g} and the fall ×{timeline.fall_factor:g}; "
                f"servers boot in {BOOT_DELAY_S:g} s plus the Redfish emulator's 1-11 s "
                "(real ones take 10-15 min); the autoscaler scales up after "
                f"{SERVICE_SETTINGS['FLEET_AUTOSCALE_UP_WINDOW_S']} s over its threshold and "
                f"down after {SERVICE_SETTINGS['FLEET_AUTOSCALE_DOWN_WINDOW_S']} s under it "
                "(60 s and 10 min by default)"
            )
            _bring_up(world, inventory, deployments, say)
            names = [d["name"] for d in deployments]
            summary = _run_traffic(
                world,
                options,
                timeline,
                trace,
                names,
                floors,
                base_rps,
                per_server,
                sla_s,
                say,
                console,
            )
            completed = True
            return summary
        except KeyboardInterrupt:
            say("interrupted: stopping everything")
            raise
        finally:
            if completed and options.keep:
                _keep(world, say)
            world.close()
            say("stopped: the service, the router, the lab's emulators, agents and engines")


def _verify(world: World, servers: list[str], attempts: int = 5) -> None:
    """Verify every server's BMC. A server whose power lock the reconciler holds at that moment
    (its first read of a freshly imported server) answers "another power action is in
    progress": verify that one again, as an operator would, a bounded number of times."""
    pending = list(servers)
    for attempt in range(attempts):
        verified = world.api("POST", "/verify", json={"servers": pending}, timeout=120)
        failed = [r for r in verified["results"] if not r["ok"]]
        busy = [r for r in failed if "another power action is in progress" in r["message"]]
        if not failed:
            return
        if len(busy) < len(failed) or attempt == attempts - 1:
            raise DemoError(f"BMC verification failed: {failed}")
        pending = [r["server"] for r in busy]
        time.sleep(1.0)


def _bring_up(
    world: World,
    inventory: dict[str, Any],
    deployments: list[dict[str, Any]],
    say: Callable[[str], None],
) -> None:
    started = time.monotonic()
    say("starting the fleet service (embedded SQLite)")
    start_service(world)
    servers = [s["name"] for s in inventory["sites"][0]["racks"][0]["servers"]]
    say(f"starting the virtual colo: {len(servers)} × 4 L40S servers behind a Redfish emulator")
    # The first server's BMC gives no power reading: the fleet falls back to its agent's estimate.
    start_lab(world, inventory, no_power_reading=servers[:1])
    _verify(world, servers)
    wait_until(
        "every server warm",
        lambda: {s["state"] for s in world.api("GET", "/servers")["results"]} == {"warm"},
        60,
    )
    floors = sum(int(d["min_replicas"]) for d in deployments)
    for deployment in deployments:
        tp, batch = plan.replica_shape(deployment)
        say(
            f"deployment {deployment['name']} on {deployment['engine']} (Llama-3.1-70B FP8, TP "
            f"{tp} on L40S, {batch} at once, min {deployment['min_replicas']}: "
            f"{deployment['engine_params']})"
        )
        world.api("POST", "/deployments", json=deployment)
    say(f"the autoscaler boots {floors} spares through their BMCs (each engine's stand-in)")

    def floors_serving() -> bool:
        rows = world.api("GET", "/servers")["results"]
        return sum(1 for s in rows if s["state"] == "serving") >= floors

    wait_until(f"{floors} servers serving", floors_serving, 180, every=0.5)
    say(
        "starting the router (estimated completion time behind model affinity; priority to engines)"
    )
    start_router(world)
    say(
        f"the clients send tenant {DEMO_TENANT}'s client key (made through the API; the router "
        f"requires one): it is in {world.workdir / CLIENT_KEY_FILE}"
    )
    say(f"ready in {time.monotonic() - started:.0f} s")


def _add_launch(world: World, timeline: plan.Timeline, replicas: int) -> dict[str, Any]:
    """The calendar entry of the first deployment: at least `replicas` from the launch fraction
    of the traffic (or one lead time and a little from now, if that is later), as a 6-field
    cron at that UTC second."""
    lead = world.api(
        "POST",
        "/schedules/preview",
        json={
            "deployment": plan.DEPLOYMENT,
            "cron": "0 0 * * *",
            "min_replicas": 1,
            "duration_s": 60,
        },
        params={"count": 1},
    )["lead_s"]
    ahead = max(timeline.at(timeline.launch_at), lead + 5.0)
    start = datetime.now(UTC) + timedelta(seconds=ahead)
    start = start.replace(microsecond=0) + timedelta(seconds=1)
    entry: dict[str, Any] = world.api(
        "POST",
        "/schedules",
        json={
            "deployment": plan.DEPLOYMENT,
            "cron": f"{start:%S %M %H %d %m} *",
            "timezone": "UTC",
            "min_replicas": replicas,
            "duration_s": round(timeline.at(timeline.launch_until - timeline.launch_at)),
            "note": "demo: a product launch",
        },
    )
    return entry


def _phase(timeline: plan.Timeline, t: float) -> str:
    if t >= timeline.duration_s:
        return "wind-down"
    if t >= timeline.at(timeline.fall_at):
        return "load falls"
    if t >= timeline.at(timeline.spike_at):
        return "spike ×3"
    if t >= timeline.at(timeline.launch_at):
        return "launch window"
    return "morning traffic"


def _run_traffic(
    world: World,
    options: Options,
    timeline: plan.Timeline,
    trace: list[Any],
    names: list[str],
    floors: int,
    base_rps: float,
    per_server: float,
    sla_s: float,
    say: Callable[[str], None],
    console: Console,
) -> Summary:
    arrivals = plan.mixed_arrivals(trace, timeline, base_rps, names, seed=options.seed)
    replay = Replay(world.router_url, plan.DEPLOYMENT, arrivals, world.client_key)
    # Two replicas for the first deployment's launch: the others keep their floors.
    entry = _add_launch(world, timeline, min(2, options.servers - len(names) + 1))
    say(
        f"calendar entry {entry['id']}: at least {entry['min_replicas']} replicas from "
        f"{entry['next']['start_local'][11:19]} UTC, booting from "
        f"{entry['next']['boot_at_local'][11:19]} ({entry['lead_basis']})"
    )
    say(f"replaying {len(arrivals)} requests through the router to {', '.join(names)}")
    samples: list[Sample] = []
    faulted: str | None = None
    header = f"Fleet demo — {options.servers} servers, {options.duration_s:.0f} s of traffic"
    replay.start()
    live = Live(console=console, refresh_per_second=2, transient=False) if options.live else None
    try:
        if live is not None:
            live.start()
        end = options.duration_s + WIND_DOWN_S
        while replay.elapsed() < end:
            tick = time.monotonic()
            t = replay.elapsed()
            if faulted is None and t >= timeline.at(timeline.fault_at):
                faulted = _inject_fault(world, say if live is None else console.log)
            try:
                sample = observe(world, replay, _phase(timeline, t))
            except DemoError as exc:  # a slow answer while the machine is busy: try again
                console.log(f"sample skipped: {exc}")
            else:
                samples.append(sample)
                if live is not None:
                    live.update(render(sample, sla_s, header))
                else:
                    say(line(sample))
                if t > options.duration_s and replay.done.is_set() and _settled(sample, floors):
                    break
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    finally:
        if live is not None:
            live.stop()
        replay.stop()
    events = _events_since(world, world.began)
    decisions = [
        row
        for name in names
        for row in world.api("GET", f"/autoscaler/{name}/decisions", params={"limit": 1000})[
            "results"
        ]
    ]
    summary = summarize(replay.snapshot(), samples, events, decisions, sla_s)
    picture = chart(
        world.workdir / "demo.png", samples, replay.snapshot(), timeline, sla_s, per_server
    )
    console.rule("summary")
    for text in summary.lines():
        console.print(text)
    story = [e for e in reversed(events) if e["kind"] in _STORY]
    console.rule("the story, from the fleet's event log")
    for event in story[-40:]:
        console.print(f"{event['at'][11:19]} {event['subject']:<18} {event['message']}"[:200])
    console.print(f"chart: {picture}")
    return summary


_STORY = {
    "server.transition",
    "deployment.scaled",
    "schedule.fired",
    "schedule.ended",
    "deployment.floor",
}


def _settled(sample: Sample, floors: int) -> bool:
    """The fleet is back at rest: nothing booting or draining, serving its deployments'
    floors (their min_replicas summed) and aiming at no more."""
    busy = {"booting", "loading", "draining", "drained", "powering_off"}
    at_rest = not any(sample.states.get(s) for s in busy)
    return at_rest and sample.serving == sample.target <= floors


def _inject_fault(world: World, say: Callable[[str], None]) -> str | None:
    rows = world.api("GET", "/servers")["results"]
    serving: list[str] = [s["name"] for s in rows if s["state"] == "serving"]
    if not serving or world.colo is None:
        return None
    victim = serving[0]
    world.colo.inject(victim, {"kind": "xid", "xid": FAULT_XID, "gpu": 2})
    say(f"injected a fatal Xid {FAULT_XID} on GPU 2 of {victim}: its agent drains it")
    return victim


def _events_since(world: World, since: datetime) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    offset = 0
    while True:
        page = world.api(
            "GET",
            "/events",
            params={"since": since.isoformat(), "limit": 1000, "offset": offset},
        )
        rows.extend(page["results"])
        offset += len(page["results"])
        if not page["results"] or offset >= page.get("count", offset):
            return rows


def _keep(world: World, say: Callable[[str], None]) -> None:
    say(
        f"--keep: the fleet keeps running. FLEET_URL={world.service_url} "
        f"FLEET_TOKEN={world.admin_token} fleetctl servers list; router at "
        f'{world.router_url}/v1 (curl -H "Authorization: Bearer $(cat '
        f'{world.workdir / CLIENT_KEY_FILE})" ...); Ctrl-C stops everything'
    )
    with contextlib.suppress(KeyboardInterrupt):
        while all(child.running for child in world.children):
            time.sleep(1.0)


__all__ = ["AGENT_SETTINGS", "Options", "run_demo"]
