"""Simulator speed: simulated requests per wall second and the multiple of real time.

    .venv/bin/python bench/sim.py [--slice-s 60] [--slices 8] [--big-slice-s 10]
                                  [--big-gpus 100000] [--skip-big] [--mode both|native|pure]

Case 1: a diurnal day on 1,000 GPUs (H100, Llama-3.1-8B FP8, one engine per GPU, max batch 64,
estimated_completion_time) at a mean of 500 requests/s (±50 %: 750/s at the 14:00 peak, 250/s
at the 02:00 trough), sizes drawn from the Azure conv trace (Azure LLM inference 2023,
CC BY 4.0). The fleet is 50 deployments of 20 engines (each deployment routes over its own 20
replicas, as the router does). A full day is 43 M requests.

What is MEASURED: `--slices` slices of `--slice-s` simulated seconds each, evenly spaced over
the day starting at the peak (8 slices: 14:00, 17:00, ..., 11:00, so the peak and the trough
are among them). Each slice is its own run from an empty fleet; its first seconds fill the
engines, and that is included (in-flight latency is ~2 s at p95, a small part of a slice).
Each slice gives the wall seconds per simulated second at its time of day.

What is EXTRAPOLATED: the day. Its wall time is the mean of the slices' wall seconds per
simulated second times 86,400 (the rectangle rule over one period, which is exact for a rate
curve that is a low-order trigonometric polynomial, as the diurnal one is, when the cost per
simulated second follows the rate smoothly). Multiple of real time = 86,400 / that.

Case 2: 100,000 GPUs at proportional load (50,000 requests/s mean, 75,000/s at the peak),
5,000 deployments of 20: ONE slice of `--big-slice-s` at the peak is measured (the fleet's setup
alone takes seconds); the day figure given for it is extrapolated from the peak alone, at the
peak's cost per request (off-peak requests are cheaper, so it is an underestimate). The
default slice, 10 s, is mostly steady state (the fleet fills in ~2 s); a 1 s slice is mostly
fill and drain, with fewer requests in flight, and ran 15–40 % faster per request here.

Case 2 is bound by the CPU's caches, not its arithmetic: its state (~2.8 KB an engine, ~270 MB
at 100,000) fits a large last-level cache and not a small one, and each request touches its
deployment's 20 replicas and engines afresh. The run prints the CPU and its cache sizes, and
`--big-gpus` sizes the fleet (at the same load per GPU): 1,000,000 GPUs puts the state out of
any cache, which shows what the 100,000-GPU case costs on a CPU whose cache it does not fit.

Per-request fidelity is kept: every request is routed by the production strategy over its
deployment's replicas and its engine's iterations are timed by the cost model (decode runs in
closed form between batch changes). One process, one core; wall time is time.perf_counter
around `Simulation.run` (arrivals and setup are shown apart). The goal (issue): ≥ 100× real
time for case 1.

Modes: `native` runs the hot modules compiled with mypyc (fleet/sim/native.py; built first if
this source version is not, and the build time is printed), `pure` the Python modules. `both`
(the default) runs each in a process of its own, Python first as the baseline, and prints
the ratio; the two must simulate the same requests to the same latency.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.sim import native
from fleet.sim.arrivals import DAY_S, Diurnal, TraceSizes, poisson

if TYPE_CHECKING:
    from fleet.sim.core import DeploymentSpec

# The hot modules (fleet.sim.core, fleet.sim.engine, fleet.router.*) are imported in `run`,
# after `--mode` has decided which build of them this process gets.

PEAK_S = 14 * 3600.0


def machine() -> str:
    """The CPU's model and cache sizes (case 2's speed depends on the last level's)."""
    model = "unknown CPU"
    caches = []
    try:  # Linux's files; elsewhere the line says what is not known
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            level, kind, size = (
                (index / name).read_text().strip() for name in ("level", "type", "size")
            )
            if kind != "Instruction":
                caches.append(f"L{level} {size}")
    except OSError:
        pass
    return f"{model}; {', '.join(caches) or 'cache sizes unknown'}"


def _slice(
    deps: list[DeploymentSpec], curve: Diurnal, start_s: float, slice_s: float
) -> tuple[int, float, float, float]:
    """One slice from an empty fleet: (requests, wall and CPU seconds of the run, latency
    p95)."""
    from fleet.sim.core import Simulation, summarize
    from fleet.sim.engine import SimRequest

    arrivals = poisson(curve, TraceSizes("conv"), slice_s, seed=1, start_s=start_s)
    rng = random.Random(2)
    reqs = [
        SimRequest(k, a.at, a.prompt, a.output, a.output, deployment=rng.randrange(len(deps)))
        for k, a in enumerate(arrivals)
    ]
    sim = Simulation(deps)
    cpu = time.process_time()
    result = sim.run(reqs)
    cpu = time.process_time() - cpu
    return len(reqs), result.wall_s, cpu, summarize(result, warmup=0.2).latency_p95


def _fleet(gpus: int, per_dep: int = 20) -> list[DeploymentSpec]:
    from fleet.sim.core import DeploymentSpec

    return [
        DeploymentSpec(f"d{k}", "llama-3.1-8b", (("H100", per_dep),), max_batch_size=64)
        for k in range(gpus // per_dep)
    ]


def day(slice_s: float, slices: int) -> dict[str, float]:
    deps = _fleet(1000)
    curve = Diurnal(mean_rps=500.0, amplitude=0.5, peak_s=PEAK_S)
    print(
        f"1,000 GPUs, diurnal mean 500 req/s: {slices} slices of {slice_s:g} s "
        "(measured), the day integrated from them (extrapolated)"
    )
    walls, cpus = [], []
    total_reqs = 0
    for k in range(slices):
        mid = (PEAK_S + k * DAY_S / slices) % DAY_S
        n, wall, cpu, p95 = _slice(deps, curve, mid - slice_s / 2, slice_s)
        walls.append(wall)
        cpus.append(cpu)
        total_reqs += n
        print(
            f"  {mid / 3600:5.1f} h  {curve.rate(mid):4.0f} req/s: {n:>7,} requests in "
            f"{wall:5.2f} s wall ({cpu:5.2f} s CPU) = {n / wall:>7,.0f} req/s, "
            f"{slice_s / wall:6.1f}× real time (latency p95 {p95:.2f} s)"
        )
    wall, cpu = sum(walls), sum(cpus)
    print(
        f"  measured: {total_reqs:,} requests in {wall:.2f} s wall = "
        f"{total_reqs / wall:,.0f} simulated requests per wall second "
        f"({total_reqs / cpu:,.0f} per CPU second); peak slice {slice_s / walls[0]:.1f}× "
        f"real time ({slice_s / cpus[0]:.1f}× by CPU time)"
    )
    # The rectangle rule over the day: wall seconds per simulated second, averaged.
    day_wall = DAY_S * wall / (slice_s * slices)
    day_cpu = DAY_S * cpu / (slice_s * slices)
    print(
        f"  extrapolated: a day (~{curve.mean_rps * DAY_S / 1e6:.1f} M requests) in "
        f"~{day_wall / 60:.1f} min wall = ~{DAY_S / day_wall:.0f}× real time "
        f"(by CPU time: ~{DAY_S / day_cpu:.0f}×; goal: ≥ 100× on one core)"
    )
    return {"rps": total_reqs / wall, "day_x": DAY_S / day_wall, "p95": p95}


def big(slice_s: float, gpus: int) -> dict[str, float]:
    from fleet.sim.core import Simulation
    from fleet.sim.engine import SimRequest

    t0 = time.perf_counter()
    deps = _fleet(gpus)
    curve = Diurnal(mean_rps=gpus / 2, amplitude=0.5, peak_s=PEAK_S)
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
    peak = slice_s / result.wall_s
    print(
        f"{gpus:,} GPUs, peak {curve.peak():,.0f} req/s, one {slice_s:g} s slice (measured): "
        f"{len(reqs):,} requests in {result.wall_s:.2f} s wall "
        f"(+{gen_s:.2f} s arrivals, {build_s:.2f} s setup) = "
        f"{len(reqs) / result.wall_s:,.0f} req/s, {peak:.3f}× real time at the peak; "
        f"a day at the peak's cost per request (extrapolated): "
        f"~{peak * curve.peak() / curve.mean_rps:.3f}×"
    )
    return {"big_rps": len(reqs) / result.wall_s, "big_x": peak, "big_gpus": gpus}


def run(args: argparse.Namespace) -> dict[str, float]:
    """This process's measurements, in the build `args.mode` names."""
    if args.mode == "native":
        started = time.perf_counter()
        if not native.is_built():
            native.build()
            print(f"(compiled the hot modules in {time.perf_counter() - started:.0f} s)")
        why_not = native.enable()
        if why_not is not None:
            raise SystemExit(f"bench: cannot run compiled: {why_not}")
    print(f"--- {'compiled (mypyc)' if args.mode == 'native' else 'Python'} ---", flush=True)
    print(f"(one core of: {machine()})")
    figures = day(args.slice_s, args.slices)
    if not args.skip_big:
        figures |= big(args.big_slice_s, args.big_gpus)
    return figures


def both(argv: list[str]) -> None:
    """Python, then compiled, each in a process of its own; then the ratio."""
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("pure", "native"):
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, *argv, "--mode", mode, "--figures", str(out)]
            subprocess.run(cmd, check=True)
            got[mode] = json.loads(out.read_text())
    pure, fast = got["pure"], got["native"]
    if fast["p95"] != pure["p95"]:
        raise SystemExit(f"bench: the builds disagree: p95 {fast['p95']} vs {pure['p95']}")
    line = (
        f"compiled vs Python (same requests, same latency p95): "
        f"{fast['rps']:,.0f} vs {pure['rps']:,.0f} simulated req/s "
        f"({fast['rps'] / pure['rps']:.2f}×); the day ~{fast['day_x']:.0f}× vs "
        f"~{pure['day_x']:.0f}× real time"
    )
    if "big_rps" in fast:
        line += f"; {fast['big_gpus']:,.0f} GPUs {fast['big_rps'] / pure['big_rps']:.2f}×"
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slice-s", type=float, default=60.0)
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--big-slice-s", type=float, default=10.0)
    ap.add_argument(
        "--big-gpus", type=int, default=100_000, help="case 2's fleet (a multiple of 20)"
    )
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--mode", choices=("both", "native", "pure"), default="both")
    ap.add_argument("--figures", type=Path, help=argparse.SUPPRESS)  # JSON out (for `both`)
    args = ap.parse_args()
    if args.mode == "both":
        argv = ["--slice-s", str(args.slice_s), "--slices", str(args.slices)]
        argv += ["--big-slice-s", str(args.big_slice_s), "--big-gpus", str(args.big_gpus)]
        argv += ["--skip-big"] * args.skip_big
        both(argv)
        return
    figures = run(args)
    if args.figures is not None:
        args.figures.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
