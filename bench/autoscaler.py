"""One autoscaler tick at fleet scale: heartbeats → Signals → decisions, timed.

    .venv/bin/python bench/autoscaler.py [--deployments 100] [--servers 10000]
                                         [--observations 61] [--every 10] [--repeat 7]

Setup (seeded, pure data: no database, no HTTP): `--servers` 8-GPU servers spread evenly over
`--deployments` deployments, each deployment with 1, 2, 4 or 8 GPUs per replica (8 to 1
replicas per server). Every server carries its last heartbeat's replica stats as the fleet
stores them (`Server.replicas`: queued, running, kv_used_fraction, ttft_p95_s, e2e_p95_s,
state), about 1 % of replicas loading and 1 % without latency figures yet. Each deployment has
a signal history of `--observations` observations `--every` s apart (61 × 10 s: the 10-minute
down window, both ends), in one of six shapes: quiet, busy, hot (over its queue target), a
ramp, a square wave, and busy with holes (missing signals).

Timed, `--repeat` times each (median and best shown):
  (1) aggregate   fleet.autoscaler.signals.aggregate for every deployment's servers (what the
                  service does each tick with the fresh heartbeats);
  (2) decide      fleet.autoscaler.policy.decide for every deployment on its history;
  (3) decide/1 h  the same on an hour of history at 15 s (240 observations: what the service's
                  History keeps), to show what a longer history costs;
  (4) the trend   the least-squares fit alone (trend.fit_trend: one pass of float sums over
                  the 5-minute window) against the baseline a first version would write with
                  the standard library (statistics.linear_regression + statistics.correlation,
                  which sum exactly, in fractions), on the same points; the two must agree.
Prints wall time per tick and per deployment (and per server for aggregate), and the rules the
decisions came to. Never fails on timing; exit 1 only if the two trend fits disagree.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from fleet.autoscaler.policy import decide
from fleet.autoscaler.signals import DeploymentState, PolicyConfig, Signals, aggregate
from fleet.autoscaler.trend import fit_trend

GPUS_PER_SERVER = 8
SHAPES = ("quiet", "busy", "hot", "ramp", "square", "holes")


def replica_stats(rng: random.Random, index: int, load: float) -> dict[str, Any]:
    """One replica's heartbeat entry at `load` (0: idle, 1: at the queue target)."""
    if rng.random() < 0.01:
        return {"index": index, "state": "loading", "queued": None, "running": None}
    queued = max(0, round(rng.gauss(load * 10, 2)))
    running = max(0, round(rng.gauss(16 * min(load, 1.0), 2)))
    latency = rng.random() >= 0.01
    return {
        "index": index,
        "state": "ready",
        "queued": queued,
        "running": running,
        "kv_used_fraction": min(1.0, max(0.0, rng.gauss(0.3 + 0.4 * load, 0.05))),
        "ttft_p95_s": 0.08 + 0.2 * load if latency else None,
        "e2e_p95_s": 0.9 + 1.0 * load if latency else None,
        "tokens_per_s": 900.0 * min(load, 1.0),
    }


def fleet(
    rng: random.Random, deployments: int, servers: int
) -> list[tuple[DeploymentState, list[dict[str, Any]]]]:
    per = max(1, servers // deployments)
    out = []
    for d in range(deployments):
        gpus_per_replica = (1, 2, 4, 8)[d % 4]
        replicas = GPUS_PER_SERVER // gpus_per_replica
        load = (0.2, 0.7, 1.6, 0.8, 0.9, 0.7)[d % len(SHAPES)]
        rows = [
            {
                "gpu_count": GPUS_PER_SERVER,
                "replicas": [replica_stats(rng, i, load) for i in range(replicas)],
            }
            for _ in range(per)
        ]
        state = DeploymentState(
            name=f"dep{d:03d}",
            sla_p95_s=2.0,
            sla_ttft_s=0.5,
            gpus_per_server=GPUS_PER_SERVER,
            min_servers=1,
            max_servers=per * 2,
            target=per,
            serving=per,
            boot_p90_s=900.0,
        )
        out.append((state, rows))
    return out


def history(
    rng: random.Random, shape: str, now: float, n: int, every: float, gpus: int
) -> list[Signals]:
    out = []
    for i in range(n):
        t = now - (n - 1 - i) * every
        age = (n - 1 - i) * every
        if shape == "quiet":
            q = 1.0
        elif shape == "busy" or shape == "holes":
            q = 7.0
        elif shape == "hot":
            q = 16.0
        elif shape == "ramp":
            q = 2.0 + 6.0 * (1 - age / (n * every))
        else:  # square
            q = 14.0 if int(age // 60) % 2 else 3.0
        q = max(0.0, q + rng.gauss(0, 0.3))
        hole = shape == "holes" and rng.random() < 0.05
        out.append(
            Signals(
                at=t,
                queue_per_gpu=q,
                kv_use=min(1.0, 0.2 + 0.04 * q),
                p95_latency_s=None if hole else 0.8 + 0.08 * q,
                ttft_p95_s=0.1 + 0.02 * q,
                serving_gpus=gpus,
            )
        )
    return out


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Wall times of `repeat` runs, each after a collection (so no run pays for another's
    garbage)."""
    runs = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return runs


def show(label: str, runs: Sequence[float], per: int, unit: str) -> None:
    med, best = statistics.median(runs), min(runs)
    print(
        f"  {label:<34} median {med * 1e3:8.2f} ms  best {best * 1e3:8.2f} ms  "
        f"per {unit} {med / per * 1e6:8.2f} µs"
    )


def stdlib_fit(points: Sequence[tuple[float, float]], now: float) -> tuple[float, float, float]:
    """The baseline: slope, value at `now`, R², the way the standard library would have it."""
    xs = [at - now for at, _ in points]
    ys = [y for _, y in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    r = statistics.correlation(xs, ys)
    return slope, intercept, r * r


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--servers", type=int, default=10_000)
    ap.add_argument("--observations", type=int, default=61, help="per deployment history")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between observations")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)

    rng = random.Random(7)
    now = 1_800_000_000.0
    config = PolicyConfig()
    deps = fleet(rng, args.deployments, args.servers)
    n_servers = sum(len(rows) for _, rows in deps)
    n_replicas = sum(len(s["replicas"]) for _, rows in deps for s in rows)
    print(
        f"{len(deps)} deployments, {n_servers} servers ({GPUS_PER_SERVER} GPUs each), "
        f"{n_replicas} replicas; history {args.observations} × {args.every:.0f} s; "
        f"Python {sys.version.split()[0]}"
    )

    # (1) aggregate
    signals: list[Signals] = []

    def aggregate_all() -> None:
        signals[:] = [aggregate(rows, now) for _, rows in deps]

    agg = timed(aggregate_all, args.repeat)
    # (2) decide on 10 minutes, (3) on an hour
    short = [
        history(rng, SHAPES[i % len(SHAPES)], now, args.observations, args.every, s.serving * 8)
        for i, (s, _) in enumerate(deps)
    ]
    long = [
        history(rng, SHAPES[i % len(SHAPES)], now, 240, 15.0, s.serving * 8)
        for i, (s, _) in enumerate(deps)
    ]
    rules: Counter[str] = Counter()

    def decide_all(histories: list[list[Signals]]) -> Callable[[], None]:
        def go() -> None:
            rules.clear()
            for (state, _), h in zip(deps, histories, strict=True):
                rules[decide(state, h, now, config).rule] += 1

        return go

    dec = timed(decide_all(short), args.repeat)
    short_rules = dict(rules)
    dec_long = timed(decide_all(long), args.repeat)

    # (4) the trend fit alone, ours vs the standard library's
    windows = [[(o.at, o.queue_per_gpu or 0.0) for o in h if o.at >= now - 300] for h in short]
    ours = timed(lambda: [fit_trend(w, now) for w in windows], args.repeat)
    base = timed(lambda: [stdlib_fit(w, now) for w in windows], args.repeat)
    worst = 0.0
    for w in windows:
        fit = fit_trend(w, now)
        slope, level, r2 = stdlib_fit(w, now)
        assert fit is not None
        for a, b in ((fit.slope, slope), (fit.level, level), (fit.r2, r2)):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))

    print("per tick:")
    show(f"(1) aggregate {n_servers} servers", agg, n_servers, "server")
    show(f"(2) decide {len(deps)} × {args.observations} obs", dec, len(deps), "deployment")
    show(f"(3) decide {len(deps)} × 240 obs (1 h)", dec_long, len(deps), "deployment")
    tick = statistics.median(agg) + statistics.median(dec)
    print(
        f"  (1)+(2) one tick                   {tick * 1e3:8.2f} ms  per deployment "
        f"{tick / len(deps) * 1e6:8.2f} µs"
    )
    print("the trend fit alone (5-minute windows):")
    show("trend.fit_trend (float sums)", ours, len(windows), "fit")
    show("baseline statistics (exact sums)", base, len(windows), "fit")
    print(
        f"  baseline / ours: {statistics.median(base) / statistics.median(ours):.1f}×; "
        f"largest relative difference {worst:.1e}"
    )
    print("rules:", ", ".join(f"{k} {v}" for k, v in sorted(short_rules.items())))
    example = signals[2]
    print(
        f"aggregate of {deps[2][0].name}: queue/GPU {example.queue_per_gpu:.2f}, KV "
        f"{example.kv_use:.2f}, p95 {example.p95_latency_s:.2f} s, TTFT "
        f"{example.ttft_p95_s:.2f} s, {example.serving_gpus} GPUs"
    )
    if not math.isfinite(worst) or worst > 1e-6:
        print("the two trend fits disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
