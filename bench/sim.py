"""Simulator speed: simulated requests per wall second and the multiple of real time.

    .venv/bin/python bench/sim.py [--slice-s 60] [--big-slice-s 2] [--skip-big]

Case 1: a diurnal day on 1,000 GPUs (H100, Llama-3.1-8B FP8, one engine per GPU, max batch 64,
estimated_completion_time) at a mean of 500 requests/s (±50 %, peak 750/s at 14:00), sizes drawn
from the Azure conv trace (Azure LLM inference 2023, CC BY 4.0). The fleet is 50 deployments of
20 engines (each deployment routes over its own 20 replicas, as the router does). A full day is
43 M requests; the bench runs a SLICE of `--slice-s` seconds at the PEAK rate (the slowest part
of the day) and extrapolates: multiple of real time = simulated seconds / wall seconds. The
first half of a slice also fills the empty fleet (the engines start idle), which is included.

Case 2: 100,000 GPUs at proportional load (50,000 requests/s mean, the peak 75,000/s), 5,000
deployments of 20, a `--big-slice-s` slice.

Per-request fidelity is kept: every request is routed by the production strategy over its
deployment's replicas and its engine's iterations are timed by the cost model (decode runs in
closed form between batch changes). One process, one core. The goal (issue): ≥ 100× real time
for case 1.
"""

from __future__ import annotations

import argparse
import random
import time

from fleet.sim.arrivals import Diurnal, TraceSizes, poisson
from fleet.sim.core import DeploymentSpec, Simulation, summarize
from fleet.sim.engine import SimRequest

PEAK_S = 14 * 3600.0


def case(gpus: int, mean_rps: float, slice_s: float, per_dep: int = 20) -> None:
    deps = [
        DeploymentSpec(f"d{k}", "llama-3.1-8b", (("H100", per_dep),), max_batch_size=64)
        for k in range(gpus // per_dep)
    ]
    curve = Diurnal(mean_rps=mean_rps, amplitude=0.5, peak_s=PEAK_S)
    t0 = time.perf_counter()
    arrivals = poisson(curve, TraceSizes("conv"), slice_s, seed=1, start_s=PEAK_S - slice_s / 2)
    rng = random.Random(2)
    reqs = [
        SimRequest(k, a.at, a.prompt, a.output, a.output, deployment=rng.randrange(len(deps)))
        for k, a in enumerate(arrivals)
    ]
    gen_s = time.perf_counter() - t0
    sim = Simulation(deps)
    build_s = time.perf_counter() - t0 - gen_s
    result = sim.run(reqs)
    s = summarize(result, warmup=0.5)
    sim_s = slice_s
    print(
        f"{gpus:>7} GPUs, peak {curve.peak():,.0f} req/s, slice {slice_s:g} s: "
        f"{len(reqs):,} requests, {result.events:,} events in {result.wall_s:.2f} s wall "
        f"(+{gen_s:.2f} s arrivals, {build_s:.2f} s setup)"
    )
    print(
        f"         {len(reqs) / result.wall_s:,.0f} simulated requests per wall second; "
        f"{sim_s / result.wall_s:.2f}× real time at the peak "
        f"(a day at the mean rate: ~{sim_s / result.wall_s * curve.peak() / mean_rps:.2f}×); "
        f"latency p50/p95 {s.latency_p50:.2f}/{s.latency_p95:.2f} s, TTFT p95 {s.ttft_p95:.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slice-s", type=float, default=60.0)
    ap.add_argument("--big-slice-s", type=float, default=2.0)
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args()
    case(1000, 500.0, args.slice_s)
    if not args.skip_big:
        case(100_000, 50_000.0, args.big_slice_s)
    print("goal: ≥ 100× real time for the 1,000-GPU case on one core")


if __name__ == "__main__":
    main()
