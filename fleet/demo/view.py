"""What the demo shows while it runs: one `Sample` a second from the fleet's API, the router's
/state and the clients' results; drawn as a live terminal view (rich) or as plain log lines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fleet.demo.load import Replay, Result
from fleet.demo.plan import DEPLOYMENT
from fleet.demo.world import World
from fleet_core.stats import quantile

STATE_ORDER = (
    "warm",
    "booting",
    "loading",
    "serving",
    "draining",
    "drained",
    "powering_off",
    "failed",
    "quarantined",
    "enrolled",
)
WINDOW_S = 15.0  # the clients' p95 and rate are over the last this many seconds


@dataclass
class Sample:
    t: float  # seconds into the traffic
    phase: str
    states: dict[str, int]
    target: int
    serving: int
    on_the_way: int
    floor: int
    queue_per_gpu: float | None
    engine_p95_s: float | None
    router_waiting: int
    offered_rps: float
    client_p95_s: float | None
    done: int
    failed: int
    power_w: float
    gpus_on: int
    racks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    decision: str = ""
    # Per deployment (engine, serving, target): the demo's fleet mixes engines.
    deployments: dict[str, tuple[str, int, int]] = field(default_factory=dict)


def p95(values: Sequence[float]) -> float | None:
    return quantile(values, 0.95)


def observe(world: World, replay: Replay, phase: str) -> Sample:
    t = replay.elapsed()
    results = replay.snapshot()
    recent = [r for r in results if r.ok and r.sent_at + (r.latency_s or 0) >= t - WINDOW_S]
    sent_recent = sum(1 for a in replay.arrivals if t - WINDOW_S <= a.at_s < t)
    servers = world.api("GET", "/servers", params={"limit": 1000})["results"]
    # Every deployment of the demo's fleet (it has no other): the fleet's figures summed, the
    # worst signals; the calendar's floor and the last decision are the first deployment's.
    scalers = world.api("GET", "/autoscaler")["results"]
    engines = {
        d["name"]: d.get("engine", "trtllm") for d in world.api("GET", "/deployments")["results"]
    }
    deployment = world.api("GET", f"/deployments/{DEPLOYMENT}")
    decisions = world.api("GET", f"/autoscaler/{DEPLOYMENT}/decisions", params={"limit": 1})
    events = world.api("GET", "/events", params={"limit": 8})["results"]
    racks = world.api("GET", "/racks")["results"]
    waiting = 0
    try:
        router = httpx.get(f"{world.router_url}/state", timeout=2).json()
        waiting = sum(sum(d["queue"].values()) for d in router["deployments"])
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    lab = world.colo.state()["servers"] if world.colo is not None else {}
    signals = [r.get("signals") or {} for r in scalers]
    return Sample(
        t=t,
        phase=phase,
        states=dict(Counter(s["state"] for s in servers)),
        target=sum(int(r["target"]) for r in scalers),
        serving=sum(int(r["serving"]) for r in scalers),
        on_the_way=sum(int(r["on_the_way"]) for r in scalers),
        floor=int(deployment.get("floor_servers", 0) or 0),
        queue_per_gpu=_worst(s.get("queue_per_gpu") for s in signals),
        engine_p95_s=_worst(s.get("p95_latency_s") for s in signals),
        router_waiting=waiting,
        offered_rps=sent_recent / min(WINDOW_S, max(t, 1e-9)),
        client_p95_s=p95([r.latency_s for r in recent if r.latency_s is not None]),
        done=sum(1 for r in results if r.ok),
        failed=sum(1 for r in results if not r.ok),
        power_w=sum(float(s.get("power_w") or 0.0) for s in lab.values()),
        gpus_on=sum(int(s["gpu_count"]) for s in servers if s.get("power_state") == "on"),
        racks=racks,
        events=events,
        decision=(decisions["results"][0]["reason"] if decisions["results"] else ""),
        deployments={
            r["deployment"]: (engines.get(r["deployment"], "?"), r["serving"], r["target"])
            for r in scalers
        },
    )


def _worst(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def per_deployment(sample: Sample) -> str:
    """`name (engine) serving/target` for each deployment."""
    return "  ".join(
        f"{name} ({engine}) {serving}/{target}"
        for name, (engine, serving, target) in sorted(sample.deployments.items())
    )


def _kw(watts: float | None) -> str:
    return "-" if watts is None else f"{watts / 1000:.2f}"


def drawn_kw(rack: dict[str, Any]) -> str:
    """A rack's drawn power now as the fleet measured it, `~` where part is an estimate."""
    drawn = rack.get("drawn_w")
    if drawn is None:
        return "-"
    return f"{'~' if rack.get('drawn_estimated_w') else ''}{drawn / 1000:.2f}"


def rack_drawn_kw(sample: Sample) -> str:
    """The racks' drawn power summed, as the fleet measured it (`~`: part is an estimate)."""
    drawn = [r for r in sample.racks if r.get("drawn_w") is not None]
    if not drawn:
        return "-"
    estimated = any(r.get("drawn_estimated_w") for r in drawn)
    return f"{'~' if estimated else ''}{sum(float(r['drawn_w']) for r in drawn) / 1000:.2f}"


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render(sample: Sample, sla_s: float, header: str) -> Group:
    """The live view: servers, capacity and latency, racks, events."""
    states = Table(title="servers", expand=True)
    for state in STATE_ORDER:
        if sample.states.get(state):
            states.add_column(state, justify="right")
    states.add_row(*(str(sample.states[s]) for s in STATE_ORDER if sample.states.get(s)))

    capacity = Table(title="the fleet: demand, capacity, latency", expand=True)
    for name in (
        "offered req/s",
        "target",
        "booting",
        "serving",
        "calendar floor",
        "queue/GPU",
        "router waiting",
        "p95 s (clients)",
        "SLA s",
    ):
        capacity.add_column(name, justify="right")
    over = sample.client_p95_s is not None and sample.client_p95_s > sla_s
    capacity.add_row(
        _f(sample.offered_rps),
        str(sample.target),
        str(sample.on_the_way),
        str(sample.serving),
        str(sample.floor),
        _f(sample.queue_per_gpu, 2),
        str(sample.router_waiting),
        Text(_f(sample.client_p95_s), style="bold red" if over else "green"),
        _f(sla_s),
    )

    racks = Table(title="racks (drawn: the BMCs' readings, ~ where part is an agent estimate)")
    for name in ("rack", "budget kW", "committed kW", "headroom kW", "drawn kW", "peak kW", "cap"):
        racks.add_column(name, justify="right")
    for rack in sample.racks:
        racks.add_row(
            rack["name"],
            _f(rack["budget_w"] / 1000),
            _f(rack["committed_w"] / 1000),
            _f(rack["headroom_w"] / 1000),
            drawn_kw(rack),
            _kw(rack.get("peak_24h_w")),
            "-" if rack.get("gpu_cap_pct") is None else f"{rack['gpu_cap_pct']:.0f} %",
        )

    events = Table(title="latest events", expand=True, show_header=False)
    events.add_column("when", no_wrap=True)
    events.add_column("what", overflow="fold")
    for event in sample.events[:8]:
        events.add_row(event["at"][11:19], f"{event['subject']}: {event['message']}"[:160])
    fleet = Text(f"serving/target: {per_deployment(sample)}"[:300])
    why = Text(f"last decision ({DEPLOYMENT}): {sample.decision}"[:300], style="italic")
    title = f"{header}  t = {sample.t:5.0f} s  {sample.phase}"
    return Group(Panel(Text(title, style="bold")), states, capacity, fleet, racks, why, events)


def line(sample: Sample) -> str:
    """The same, as one log line (--no-live)."""
    states = " ".join(f"{s}={sample.states[s]}" for s in STATE_ORDER if sample.states.get(s))
    return (
        f"t={sample.t:5.0f}s {sample.phase:<22} offered={_f(sample.offered_rps)}/s "
        f"target={sample.target} booting={sample.on_the_way} serving={sample.serving} "
        f"floor={sample.floor} queue/GPU={_f(sample.queue_per_gpu, 2)} "
        f"waiting={sample.router_waiting} p95={_f(sample.client_p95_s)}s "
        f"drawn={rack_drawn_kw(sample)}kW [{states}] {per_deployment(sample)}"
    )


def results_p95(results: Sequence[Result]) -> float | None:
    return p95([r.latency_s for r in results if r.ok and r.latency_s is not None])
