"""PNG charts of a simulation run (`fleetctl simulate SCENARIO --charts DIR`).

One PNG per run, three panels on one time axis (minutes of simulated time):

1. Demand vs capacity: arrivals per bucket as requests/s (every deployment summed) against the
   serving capacity: the replicas serving (joined the router's pool, not draining) × each
   replica's steady-state capacity for the deployment's request mix, the figure a scenario's
   `load` is a share of (`scenario.capacity_rps`, one engine at a time; a deployment with
   several GPU models counts the mean of its engines). A fixed fleet's capacity is flat; an
   autoscaled deployment's follows `RunResult.timeline` (the replicas serving after each tick,
   so a boot that finishes between ticks shows at the next one), with the target's capacity
   dotted.
2. p95 latency and TTFT p95 (from arrival, as `summarize` measures them) over a rolling window
   of the requests finished by then (`p95_window_s`: 60 s, shorter for a short run, at least a
   bucket), per deployment (the first `MAX_LINES`), against the deployment's SLA lines.
3. Spares in use: for each warm pool (the scenario's shared pool, or a deployment's own), its
   size at the start less the spares left after each tick (`ScalePoint.warm_left`); this goes
   below zero when the autoscaler gives back more than it drew (a drained replica of the
   initial fleet goes to the warm pool too). With the replicas booting and draining, and the
   ticks short of spares (warm-pool exhaustion). A run without the autoscaler says so.
4. With a scenario's `power:` (fleet/sim/power.py): each rack's drawn power (its samples, kW)
   against its budget (dashed), exceedances marked.

The series functions take plain data and return plain lists (tests/unit/test_sim_charts.py);
`render` draws them with matplotlib (Agg backend, imported only when drawing).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fleet.sim.autoscale import ScalePoint
from fleet.sim.core import DeploymentSpec, RunResult, percentile
from fleet.sim.scenario import capacity_rps

NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
TARGET_BUCKETS = 120  # about this many demand buckets across the run
P95_WINDOW_S = 60.0  # the rolling p95's window (the agent's stats window)
MAX_LINES = 4  # deployments with their own p95 lines
SHARED = "shared"  # the scenario's warm pool


class ChartError(ValueError):
    """A chart directory that cannot be used (one line)."""


# --- series (plain data in, plain lists out) ---------------------------------------------------


def bucket_s(span_s: float, target: int = TARGET_BUCKETS) -> float:
    """The smallest round bucket giving at most `target` buckets over `span_s`."""
    for b in NICE_BUCKETS_S:
        if span_s / b <= target:
            return float(b)
    return float(NICE_BUCKETS_S[-1])


def p95_window_s(span_s: float, bucket: float) -> float:
    """The rolling p95's window: P95_WINDOW_S, shorter for a run under ten of them (a round
    tenth of it), never under a bucket."""
    return max(bucket, min(P95_WINDOW_S, bucket_s(span_s, 10)))


def demand(
    arrivals: Sequence[float], start: float, end: float, bucket: float
) -> tuple[list[float], list[float]]:
    """Arrivals per bucket [start + k·bucket, start + (k+1)·bucket) as requests/s, up to `end`:
    (bucket starts in seconds, rates). An arrival at `end` counts in the last bucket."""
    n = max(1, math.ceil((end - start) / bucket))
    counts = [0] * n
    for a in arrivals:
        k = int((a - start) // bucket)
        if k == n and a <= end:
            k = n - 1
        if 0 <= k < n:
            counts[k] += 1
    return [start + k * bucket for k in range(n)], [c / bucket for c in counts]


def step_at(
    points: Sequence[tuple[float, float]], initial: float, times: Sequence[float]
) -> list[float]:
    """A step function's value at each of `times`: that of the last point at or before it
    (`points` sorted by time; of several at one time, the last), `initial` before the first."""
    at = [p[0] for p in points]
    out = []
    for t in times:
        k = bisect.bisect_right(at, t)
        out.append(points[k - 1][1] if k else initial)
    return out


def step_sum(
    curves: Sequence[tuple[float, Sequence[tuple[float, float]]]], start: float, end: float
) -> tuple[list[float], list[float]]:
    """The sum of step functions, each (initial, sorted points), at `start`, at every time one of
    them changes within [start, end], and at `end`: (times, sums), for a post-step plot."""
    times = sorted({start, end} | {t for _, pts in curves for t, _ in pts if start <= t <= end})
    if not curves:
        return times, [0.0] * len(times)
    columns = [step_at(pts, initial, times) for initial, pts in curves]
    return times, [sum(col) for col in zip(*columns, strict=True)]


def rolling_p95(
    finished: Sequence[tuple[float, float]], times: Sequence[float], window_s: float
) -> list[float]:
    """The p95 (nearest rank, as `summarize`) of the values of the (finish time, value) pairs
    finished in (t − window_s, t], at each of `times`; NaN (a gap) where none finished."""
    done = sorted(finished)
    at = [f for f, _ in done]
    out = []
    for t in times:
        lo = bisect.bisect_right(at, t - window_s)
        hi = bisect.bisect_right(at, t)
        out.append(percentile(sorted(v for _, v in done[lo:hi]), 95))
    return out


def replica_rps(
    spec: DeploymentSpec, gpus: Sequence[str], sizes: Sequence[tuple[int, int]]
) -> float:
    """Requests/s one replica serves in the cost model's steady state for this request mix
    (`scenario.capacity_rps` for one engine), the mean over `gpus` (the deployment's engines);
    0 without requests."""
    if not gpus or not any(o > 0 for _, o in sizes):
        return 0.0
    per_gpu = {
        g: capacity_rps(dataclasses.replace(spec, replicas=((g, 1),)), sizes) for g in set(gpus)
    }
    return sum(per_gpu[g] for g in gpus) / len(gpus)


def pool_of(spec: DeploymentSpec) -> str:
    """The warm pool an autoscaled deployment draws from: its own (its name) or SHARED."""
    a = spec.autoscale
    return SHARED if a is None or a.warm_pool is None else spec.name


def spares_in_use(points: Sequence[tuple[float, int]], size: int) -> tuple[list[float], list[int]]:
    """(tick times, spares in use) for one warm pool of `size` spares at the start, from the
    (time, warm_left) after each tick of the deployments drawing from it (in event order; of
    several at one time, the last counts)."""
    last: dict[float, int] = {}
    for at, left in points:
        last[at] = left
    times = sorted(last)
    return times, [size - last[t] for t in times]


@dataclass
class Line:
    label: str
    t_min: list[float]
    values: list[float]


@dataclass
class ChartData:
    """Everything `render` draws, in minutes of simulated time."""

    demand: Line
    capacity: Line
    target: Line | None  # autoscaled runs: the target replicas' capacity
    p95: list[tuple[str, Line, Line]]  # (deployment, latency p95, TTFT p95)
    slas: list[tuple[str, str, float]]  # (deployment, "latency" | "TTFT", seconds)
    spares: list[tuple[Line, int]]  # (spares in use, the pool's size at the start)
    booting: Line | None
    draining: Line | None
    exhaustions: list[tuple[float, int]] = field(default_factory=list)  # (minute, short)
    more: int = 0  # deployments without their own p95 lines
    bucket_s: float = 60.0
    window_s: float = P95_WINDOW_S


def _minutes(ts: Sequence[float]) -> list[float]:
    return [t / 60 for t in ts]


def chart_data(result: RunResult, shared_warm_pool: Mapping[str, int] | None = None) -> ChartData:
    """The three panels' series for a run. `shared_warm_pool`: the scenario's `warm_pool` (its
    size at the start), for the autoscaled deployments without their own."""
    reqs = result.requests
    specs = result.deployments
    first = min((r.arrival for r in reqs), default=0.0)
    last = max(
        [r.finish for r in reqs if r.finish == r.finish]
        + [r.arrival for r in reqs]
        + [p.at for p in result.timeline]
        + [first]
    )
    bucket = bucket_s(last - first)
    start = math.floor(first / bucket) * bucket
    end = max(last, start + bucket)

    # 1. demand vs capacity
    bt, rates = demand([r.arrival for r in reqs], start, end, bucket)
    bt.append(start + len(rates) * bucket)  # the last bucket's end, for the step plot
    rates.append(rates[-1])
    gpus: list[list[str]] = [[] for _ in specs]
    for k, (gpu, _) in enumerate(result.engines):
        index = result.engine_deployments[k] if result.engine_deployments else 0
        gpus[index].append(gpu)
    sizes: list[list[tuple[int, int]]] = [[] for _ in specs]
    for r in reqs:
        sizes[r.deployment].append((r.prompt, r.output))
    per_replica = [replica_rps(s, g, z) for s, g, z in zip(specs, gpus, sizes, strict=True)]
    by_dep: dict[str, list[ScalePoint]] = {s.name: [] for s in specs}
    for p in result.timeline:
        by_dep.setdefault(p.deployment, []).append(p)
    serving_curves = []
    target_curves = []
    for spec, rps in zip(specs, per_replica, strict=True):
        pts = by_dep.get(spec.name, [])
        serving_curves.append((rps * spec.engines, [(p.at, rps * p.serving) for p in pts]))
        target_curves.append((rps * spec.engines, [(p.at, rps * p.target) for p in pts]))
    ct, cap = step_sum(serving_curves, start, end)
    scaled = [s for s in specs if s.autoscale is not None]
    target = None
    if scaled:
        tt, tv = step_sum(target_curves, start, end)
        target = Line("target capacity", _minutes(tt), tv)

    # 2. p95 vs SLA
    window = p95_window_s(last - first, bucket)
    grid = [start + k * bucket for k in range(1, len(rates))]
    p95: list[tuple[str, Line, Line]] = []
    slas: list[tuple[str, str, float]] = []
    for index, spec in enumerate(specs[:MAX_LINES]):
        done = [r for r in reqs if r.deployment == index and r.finish == r.finish]
        lat = rolling_p95([(r.finish, r.finish - r.arrival) for r in done], grid, window)
        ttft = rolling_p95([(r.finish, r.first_token - r.arrival) for r in done], grid, window)
        p95.append(
            (
                spec.name,
                Line("p95 latency", _minutes(grid), lat),
                Line("TTFT p95", _minutes(grid), ttft),
            )
        )
        a = spec.autoscale
        latency_sla = spec.latency_sla_s or (a.sla_p95_s if a else None)
        ttft_sla = spec.ttft_sla_s or (a.sla_ttft_s if a else None)
        if latency_sla is not None:
            slas.append((spec.name, "latency", latency_sla))
        if ttft_sla is not None:
            slas.append((spec.name, "TTFT", ttft_sla))

    # 3. spares in use
    spares: list[tuple[Line, int]] = []
    booting = draining = None
    if scaled:
        pools: dict[str, tuple[int, list[tuple[float, int]]]] = {}
        shared_size = sum((shared_warm_pool or {}).values())
        for spec in scaled:
            key = pool_of(spec)
            a = spec.autoscale
            assert a is not None
            size = shared_size if a.warm_pool is None else sum(n for _, n in a.warm_pool)
            pools.setdefault(key, (size, []))
        for p in result.timeline:
            spec = next(s for s in specs if s.name == p.deployment)
            pools[pool_of(spec)][1].append((p.at, p.warm_left))
        for key, (size, left) in pools.items():
            t, used = spares_in_use(left, size)
            label = "shared warm pool" if key == SHARED else f"{key}'s warm pool"
            spares.append(
                (
                    Line(
                        f"spares in use, net of returns ({label}: {size} at the start)",
                        _minutes(t),
                        [float(u) for u in used],
                    ),
                    size,
                )
            )
        bt_, bv = step_sum(
            [(0.0, [(p.at, float(p.booting)) for p in by_dep[s.name]]) for s in scaled], start, end
        )
        dt_, dv = step_sum(
            [(0.0, [(p.at, float(p.draining)) for p in by_dep[s.name]]) for s in scaled], start, end
        )
        booting = Line("booting", _minutes(bt_), bv)
        draining = Line("draining", _minutes(dt_), dv)
    return ChartData(
        demand=Line(f"demand (arrivals per {bucket:g} s, requests/s)", _minutes(bt), rates),
        capacity=Line("serving capacity (requests/s, steady state)", _minutes(ct), cap),
        target=target,
        p95=p95,
        slas=slas,
        spares=spares,
        booting=booting,
        draining=draining,
        exhaustions=[(e.at / 60, e.short) for e in result.exhaustions],
        more=max(0, len(specs) - MAX_LINES),
        bucket_s=bucket,
        window_s=window,
    )


# --- files -------------------------------------------------------------------------------------


def chart_dir(path: Path) -> Path:
    """`path` as a directory to write charts in (made if missing); ChartError says why not."""
    if path.exists() and not path.is_dir():
        raise ChartError(f"--charts {path}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ChartError(f"--charts {path}: cannot make it ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ChartError(f"--charts {path}: not writable")
    return path


def variant_name(specs: Sequence[DeploymentSpec]) -> str:
    """A run's variant as `--compare` spells it: strategy, "/static" when static batching
    (deployments that differ joined with "+")."""
    names = []
    for s in specs:
        name = s.strategy + ("/static" if s.batching == "static" else "")
        if name not in names:
            names.append(name)
    return "+".join(names)


def file_name(scenario: str, variant: str) -> str:
    """<scenario>-<variant>.png, with anything but letters, digits, "_", "." and "-" as "-"."""

    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "run"

    return f"{slug(scenario)}-{slug(variant)}.png"


# --- drawing -----------------------------------------------------------------------------------


def render(
    result: RunResult,
    path: Path,
    *,
    title: str = "",
    shared_warm_pool: Mapping[str, int] | None = None,
) -> Path:
    """Write the run's PNG (three panels sharing the time axis) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = chart_data(result, shared_warm_pool)
    power = result.power
    if power is None:
        fig, (top, middle, bottom) = plt.subplots(
            3, 1, figsize=(11, 10), sharex=True, height_ratios=(1.2, 1.2, 0.9)
        )
    else:
        fig, (top, middle, bottom, racks) = plt.subplots(
            4, 1, figsize=(11, 13), sharex=True, height_ratios=(1.2, 1.2, 0.9, 1.1)
        )

    # 1. demand vs capacity
    top.step(
        data.demand.t_min, data.demand.values, where="post", label=data.demand.label, color="C0"
    )
    top.step(
        data.capacity.t_min,
        data.capacity.values,
        where="post",
        label=data.capacity.label,
        color="C2",
    )
    if data.target is not None:
        top.step(
            data.target.t_min,
            data.target.values,
            where="post",
            label=data.target.label,
            color="C2",
            linestyle=":",
        )
    top.set_ylabel("requests/s")
    top.set_ylim(bottom=0)
    top.legend(loc="best", fontsize=8)
    top.set_title(f"{title}: demand vs capacity" if title else "demand vs capacity")

    # 2. p95 vs SLA
    for k, (name, lat, ttft) in enumerate(data.p95):
        color = f"C{k}"
        who = f" ({name})" if len(data.p95) > 1 else ""
        middle.plot(lat.t_min, lat.values, color=color, label=f"p95 latency{who}")
        middle.plot(ttft.t_min, ttft.values, color=color, linestyle="--", label=f"TTFT p95{who}")
    names = [name for name, _, _ in data.p95]
    for name, kind, seconds in data.slas:
        color = f"C{names.index(name)}" if name in names else "0.4"
        who = f" ({name})" if len(data.p95) > 1 else ""
        middle.axhline(
            seconds,
            color=color,
            linestyle="-." if kind == "latency" else ":",
            linewidth=1,
            label=f"SLA {kind} {seconds:g} s{who}",
        )
    if any(v == v and v > 0 for _, lat, ttft in data.p95 for v in lat.values + ttft.values):
        middle.set_yscale("log")
    more = f"; {data.more} more deployments not shown" if data.more else ""
    middle.set_title(
        f"p95 over the last {data.window_s:g} s of finished requests (from arrival) vs SLA{more}",
        fontsize=10,
    )
    middle.set_ylabel("seconds")
    middle.legend(loc="best", fontsize=7, ncol=2)

    # 3. spares in use
    if not data.spares:
        bottom.text(
            0.5,
            0.5,
            "fixed fleet: no spares drawn",
            transform=bottom.transAxes,
            ha="center",
            va="center",
            fontsize=11,
            color="0.35",
        )
        bottom.set_yticks([])
    else:
        for k, (spare, size) in enumerate(data.spares):
            color = f"C{k}"
            bottom.step(spare.t_min, spare.values, where="post", color=color, label=spare.label)
            bottom.axhline(size, color=color, linestyle=":", linewidth=1)
        for count, color in ((data.booting, "C1"), (data.draining, "C4")):
            if count is not None and any(count.values):
                bottom.step(
                    count.t_min,
                    count.values,
                    where="post",
                    color=color,
                    linestyle="--",
                    label=f"replicas {count.label}",
                )
        if data.exhaustions:
            bottom.plot(
                [t for t, _ in data.exhaustions],
                [0] * len(data.exhaustions),
                "v",
                color="C3",
                markersize=5,
                label=f"warm pool exhausted ({len(data.exhaustions)} ticks)",
            )
        bottom.set_ylabel("replicas")
        bottom.legend(loc="best", fontsize=8)
    bottom.set_title("spares in use (dotted: the pool at the start)", fontsize=10)
    if power is not None:
        for k, rack in enumerate(power.racks[: 2 * MAX_LINES]):
            color = f"C{k}"
            t_min = _minutes(rack.times)
            racks.plot(t_min, [w / 1000 for w in rack.drawn_w], color=color, label=rack.rack)
            racks.axhline(rack.budget_w / 1000, color=color, linestyle="--", linewidth=1)
            over = [
                (t, w / 1000) for t, w in zip(t_min, rack.drawn_w, strict=True) if w > rack.budget_w
            ]
            if over:
                racks.plot(
                    [t for t, _ in over], [w for _, w in over], "x", color="C3", markersize=5
                )
        racks.set_ylim(bottom=0)
        racks.set_ylabel("kW")
        racks.legend(loc="best", fontsize=7, ncol=2)
        racks.set_title(
            f"drawn power per rack (dashed: its budget; x: an exceedance; "
            f"{power.exceedances} in all)",
            fontsize=10,
        )
        racks.set_xlabel("minutes of simulated time")
    else:
        bottom.set_xlabel("minutes of simulated time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
