"""Phase-aware GPU power per engine iteration, and what a power limit does to an iteration.

Pure: plain data in, numbers out; no clock, no I/O. Read by the stand-in engine (its power gauge
and its capped iterations), the simulated telemetry and the simulator. docs/hardware.md ("Power
per iteration") gives the figures below with their sources and the table they produce.

**Power of one GPU.** Above its idle draw a GPU spends energy on arithmetic and on moving bytes.
With c the fraction of wall time its tensor cores are busy (at the cost model's 60 % of peak
FLOPS) and m the fraction its HBM streams (at 80 % of peak bandwidth, SMs mostly stalled):

    P = idle + (TDP − idle) · min(1, K_COMPUTE · c · clock^CLOCK_EXPONENT + K_MEMORY · m)

- idle: the middle of the GPU table's observed idle range (fleet_core/gpus.py `idle_mid_w`).
- K_COMPUTE = 1: a compute-bound iteration runs at TDP. Prefill is compute-bound, and on an
  H100/H200 dense tensor-core work is where the power limit is the first constraint to bind
  (TechnoLynx, "Power, Thermals, and the Hidden Governors of Performance", 2026); the default
  limit is the TDP, where the cost model's published throughputs were measured, so clock = 1
  means "as calibrated". An 8k-token prefill draws 97-98 % of TDP.
- K_MEMORY = 0.175, fit to Ma et al., "The Illusion of Power Capping in LLM Decode", arXiv
  2605.11999 (2026): decode draws 137–300 W on a 700 W H200 across four attention architectures,
  because it is memory-bound. With this constant the cost model's decode on an H200 spans that
  range: Llama-3.1-8B FP8 at batch 1 draws 140 W, Llama-3.1-70B FP8 at batch 64 with 2k-token
  contexts 299 W (tests/unit/test_power_model.py).
- The fixed per-iteration time (launches, sampling) and the tensor-parallel all-reduces count as
  neither: the GPU waits on the host or the link near its idle draw (our assumption).

**Under a power limit** the GPU lowers its SM clock until the draw fits (NVML power capping is a
clock throttle; HBM keeps its clock). With clock fraction s the compute time stretches to
compute_s / s, memory, fixed and all-reduce time do not move, and a busy SM draws ∝ s^1.3 above
idle. CLOCK_EXPONENT = 1.3 is fit to the published effect of capping a compute-bound H100 at
600 W, 10–15 % longer training steps (Factryze, "Power Capping",
https://factryze.ai/scale-atlas/power/power-capping): this rule gives 11 % for a BF16 prefill.
CMOS dynamic power goes as f·V², up to f³ where voltage follows frequency; the fit is lower
because part of a busy board's power (leakage, the fabric around the SMs) does not follow the
SM clock. So a capped prefill slows clearly while decode, far below any cap, does not move: why
capping and oversubscription cost inference little (POLCA, Patel et al., arXiv 2308.12908).
The clock stops at MIN_CLOCK_FRACTION; a limit that even the lowest clock cannot meet is met by
idling between kernels, stretching the whole iteration so that its energy above idle fits under
the limit (unreachable with the boards' own minimum limits, which sit above what memory traffic
alone draws). Limits are clamped to the board's range [power_limit_min_w, tdp_w] as NVML clamps
them.
"""

from __future__ import annotations

import math

from fleet_core.cost_model import EngineShape, IterationSplit, iteration_split
from fleet_core.gpus import GpuSpec

K_COMPUTE = 1.0  # compute-bound → TDP (module docstring)
K_MEMORY = 0.175  # fit to Ma et al. 2026's 137–300 W decode on H200 (module docstring)
CLOCK_EXPONENT = 1.3  # busy SM power ∝ clock^1.3; fit to a 600 W H100 cap costing 10–15 %
MIN_CLOCK_FRACTION = 0.2  # lowest SM clock the cap model goes to (≈ 400 of 1,980 MHz)
_BISECTION_STEPS = 50


def idle_power_w(gpu: GpuSpec) -> float:
    """A GPU with nothing to do (an engine loaded and waiting draws this too)."""
    return gpu.idle_mid_w


def clamp_limit_w(gpu: GpuSpec, limit_w: float | None) -> float:
    """The limit the board enforces for a requested one: None → the default (TDP); otherwise
    within [power_limit_min_w, tdp_w], as NVML's constraints clamp it."""
    if limit_w is None:
        return gpu.tdp_w
    return min(gpu.tdp_w, max(gpu.power_limit_min_w, limit_w))


def gpu_power_w(gpu: GpuSpec, compute_busy: float, memory_busy: float, clock: float = 1.0) -> float:
    """Watts of one GPU whose tensor cores are busy `compute_busy` and whose HBM streams
    `memory_busy` of the time (fractions in [0, 1]), at SM clock fraction `clock`."""
    if not (0.0 <= compute_busy <= 1.0 and 0.0 <= memory_busy <= 1.0):
        raise ValueError("busy fractions must be within [0, 1]")
    if not 0.0 < clock <= 1.0:
        raise ValueError("clock must be within (0, 1]")
    activity = K_COMPUTE * compute_busy * math.pow(clock, CLOCK_EXPONENT) + K_MEMORY * memory_busy
    return idle_power_w(gpu) + (gpu.tdp_w - idle_power_w(gpu)) * min(1.0, activity)


def _at_clock(gpu: GpuSpec, split: IterationSplit, clock: float) -> tuple[float, float]:
    """(seconds, watts) of an iteration with the SM clock at `clock` of full."""
    compute_s = split.compute_s / clock
    seconds = split.fixed_s + split.tp_s + split.memory_s + compute_s
    if seconds <= 0:
        return 0.0, idle_power_w(gpu)
    watts = gpu_power_w(
        gpu, min(1.0, compute_s / seconds), min(1.0, split.memory_s / seconds), clock
    )
    return seconds, watts


def split_power_w(gpu: GpuSpec, split: IterationSplit) -> float:
    """Per-GPU watts of an iteration whose time splits as `split` (uncapped)."""
    return _at_clock(gpu, split, 1.0)[1]


def iteration_power_w(
    shape: EngineShape, decode_requests: int, prefill_tokens: int, kv_tokens_read: int
) -> float:
    """Per-GPU watts during one iteration (no power limit below the default), from the cost
    model's split of its time."""
    split = iteration_split(shape, decode_requests, prefill_tokens, kv_tokens_read)
    return split_power_w(shape.gpu, split)


def capped_split(gpu: GpuSpec, split: IterationSplit, limit_w: float | None) -> tuple[float, float]:
    """(seconds, per-GPU watts) of an iteration split as `split` under a power limit
    (None: the default limit, the TDP)."""
    seconds, watts = _at_clock(gpu, split, 1.0)
    limit = clamp_limit_w(gpu, limit_w)
    if watts <= limit:
        return seconds, watts
    low_s, low_w = _at_clock(gpu, split, MIN_CLOCK_FRACTION)
    if low_w > limit:
        # Below the lowest clock: idle between kernels so the energy above idle fits the limit.
        idle = idle_power_w(gpu)
        return low_s * (low_w - idle) / (limit - idle), limit
    # Watts fall monotonically with the clock (the compute part's power drops as clock^0.3 per
    # second busy while its time grows); find the highest clock that fits.
    lo, hi = MIN_CLOCK_FRACTION, 1.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if _at_clock(gpu, split, mid)[1] <= limit:
            lo = mid
        else:
            hi = mid
    return _at_clock(gpu, split, lo)[0], limit


def capped_iteration(
    shape: EngineShape,
    decode_requests: int,
    prefill_tokens: int,
    kv_tokens_read: int,
    limit_w: float | None,
) -> tuple[float, float]:
    """(seconds, per-GPU watts) of one iteration under a per-GPU power limit (None: the
    default). Uncapped watts at or under the limit: the cost model's seconds and the uncapped
    watts. Over it: the SM clock drops, the compute part stretches, watts = the enforced limit."""
    split = iteration_split(shape, decode_requests, prefill_tokens, kv_tokens_read)
    return capped_split(shape.gpu, split, limit_w)
