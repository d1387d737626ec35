"""The phase-aware power model against the facts it is calibrated to (docs/hardware.md, "Power
per iteration"): decode 137–300 W on a 700 W H200 (Ma et al., arXiv 2605.11999), prefill near
TDP, idle at idle, and a power cap that slows prefill and leaves decode alone (POLCA, Patel et
al., arXiv 2308.12908)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fleet_core import cost_model as cm
from fleet_core import power_model as pm
from fleet_core.cost_model import EngineShape


def shape(gpu: str, model: str = "llama-3.1-8b", **kw: Any) -> EngineShape:
    return EngineShape(gpu=cm.gpu_spec(gpu), model=cm.model_spec(model), **kw)


def decode(batch: int, context: int = 2048) -> tuple[int, int, int]:
    """A decode-only iteration: `batch` requests each with `context` tokens cached."""
    return batch, 0, batch * context


PREFILL = (0, 8192, 8192)  # one full max_num_tokens chunk of prompt


def test_split_adds_up_to_iteration_seconds() -> None:
    s = shape("H100", "llama-3.1-70b", tp_size=4)
    split = cm.iteration_split(s, 7, 300, 5000)
    assert split.tp_s > 0 and split.memory_s > 0 and split.compute_s > 0
    assert split.total_s == cm.iteration_seconds(s, 7, 300, 5000)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-3.1-70b"])
@pytest.mark.parametrize("batch", [1, 8, 32, 64])
def test_decode_on_h200_draws_137_to_300_w(model: str, batch: int) -> None:
    watts = pm.iteration_power_w(shape("H200", model), *decode(batch, 2000))
    assert 137 <= watts <= 300


def test_decode_range_spans_ma_et_al() -> None:
    # The fit: the smallest decode sits at the bottom of the published range, 70B at batch 64 at
    # its top (module docstring).
    low = pm.iteration_power_w(shape("H200"), *decode(1, 2000))
    high = pm.iteration_power_w(shape("H200", "llama-3.1-70b"), *decode(64, 2000))
    assert low == pytest.approx(140, abs=6)
    assert high == pytest.approx(299, abs=6)


@pytest.mark.parametrize(
    ("gpu", "model", "tp"),
    [
        ("H100", "llama-3.1-8b", 1),
        ("H200", "llama-3.1-8b", 1),
        ("H200", "llama-3.1-70b", 1),
        ("H100", "llama-3.1-70b", 2),
        ("L40S", "llama-3.1-8b", 1),
    ],
)
def test_long_prefill_draws_near_tdp(gpu: str, model: str, tp: int) -> None:
    s = shape(gpu, model, tp_size=tp)
    watts = pm.iteration_power_w(s, *PREFILL)
    assert 0.9 * s.gpu.tdp_w <= watts <= s.gpu.tdp_w
    # and decode on the same engine draws well under half of it
    assert pm.iteration_power_w(s, *decode(8)) < 0.5 * s.gpu.tdp_w


@pytest.mark.parametrize("gpu", ["H100", "H200", "L40S"])
def test_idle_is_the_tables_idle(gpu: str) -> None:
    spec = cm.gpu_spec(gpu)
    assert spec.idle_w[0] <= pm.idle_power_w(spec) <= spec.idle_w[1]
    assert pm.gpu_power_w(spec, 0.0, 0.0) == pm.idle_power_w(spec)
    assert pm.gpu_power_w(spec, 1.0, 0.0) == spec.tdp_w
    assert pm.gpu_power_w(spec, 1.0, 1.0) == spec.tdp_w  # never past TDP


def test_gpu_power_is_monotonic_in_both_busy_fractions_and_clock() -> None:
    h200 = cm.gpu_spec("H200")
    steps = [i / 10 for i in range(11)]
    for m in steps:
        series = [pm.gpu_power_w(h200, c, m) for c in steps]
        assert series == sorted(series) and series[-1] > series[0]
    for c in steps[1:]:
        series = [pm.gpu_power_w(h200, c, m) for m in steps]
        assert series == sorted(series)
    clocks = [pm.gpu_power_w(h200, 0.8, 0.1, clock=k / 10) for k in range(2, 11)]
    assert clocks == sorted(clocks) and clocks[-1] > clocks[0]
    with pytest.raises(ValueError):
        pm.gpu_power_w(h200, 1.5, 0.0)
    with pytest.raises(ValueError):
        pm.gpu_power_w(h200, 0.5, 0.5, clock=0.0)


def test_iteration_power_rises_with_batch_and_prompt() -> None:
    s = shape("H200")
    by_batch = [pm.iteration_power_w(s, *decode(b)) for b in (1, 4, 16, 64, 256)]
    assert by_batch == sorted(by_batch)
    by_prompt = [pm.iteration_power_w(s, 0, n, n) for n in (128, 512, 2048, 8192)]
    assert by_prompt == sorted(by_prompt)
    assert pm.iteration_power_w(s, *decode(256)) < pm.iteration_power_w(s, *PREFILL)


@pytest.mark.parametrize(("gpu", "model"), [("H200", "llama-3.1-8b"), ("H100", "llama-3.1-70b")])
def test_half_tdp_cap_slows_prefill_clearly_and_decode_barely(gpu: str, model: str) -> None:
    s = shape(gpu, model, tp_size=2 if model.endswith("70b") else 1)
    half = s.gpu.tdp_w / 2
    free_s = cm.iteration_seconds(s, *PREFILL)
    capped_s, capped_w = pm.capped_iteration(s, *PREFILL, half)
    assert capped_w == half
    assert capped_s > 1.3 * free_s
    for batch in (1, 32, 64):
        free = cm.iteration_seconds(s, *decode(batch))
        secs, watts = pm.capped_iteration(s, *decode(batch), half)
        assert secs < 1.10 * free
        assert watts <= half


def test_a_600_w_cap_costs_compute_bound_h100_10_to_15_percent() -> None:
    # The clock exponent's calibration (module docstring): capping an H100 at 600 W costs a
    # compute-bound workload 10–15 %; FP8 prefill here is fully compute-bound.
    s = shape("H100", precision="bf16")
    free = cm.iteration_seconds(s, *PREFILL)
    secs, _ = pm.capped_iteration(s, *PREFILL, 600)
    assert 1.08 <= secs / free <= 1.15


def test_no_limit_or_a_limit_above_the_draw_changes_nothing() -> None:
    s = shape("H200")
    for counts in (decode(32), PREFILL, (0, 0, 0)):
        free = (cm.iteration_seconds(s, *counts), pm.iteration_power_w(s, *counts))
        assert pm.capped_iteration(s, *counts, None) == free
        assert pm.capped_iteration(s, *counts, s.gpu.tdp_w) == free
        assert pm.capped_iteration(s, *counts, 10_000) == free  # clamped to TDP


def test_capped_seconds_fall_and_watts_rise_as_the_limit_rises() -> None:
    s = shape("H200")
    limits = [200, 250, 300, 400, 500, 600, 700]
    results = [pm.capped_iteration(s, *PREFILL, w) for w in limits]
    seconds = [r[0] for r in results]
    watts = [r[1] for r in results]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] > seconds[-1]
    assert watts == sorted(watts)
    assert all(w <= limit for w, limit in zip(watts, limits, strict=True))


def test_limits_are_clamped_to_the_boards_range() -> None:
    h200 = cm.gpu_spec("H200")
    assert pm.clamp_limit_w(h200, None) == 700
    assert pm.clamp_limit_w(h200, 50) == h200.power_limit_min_w == 200
    assert pm.clamp_limit_w(h200, 900) == 700
    # A limit under the board's minimum is enforced at the minimum.
    s = shape("H200")
    assert pm.capped_iteration(s, *PREFILL, 50) == pm.capped_iteration(s, *PREFILL, 200)


def test_a_limit_below_what_the_lowest_clock_reaches_idles_between_kernels() -> None:
    # The boards' minimum limits sit above what memory traffic alone draws (≈ 185 W on an
    # H200), so a lower SM clock always suffices there; on a board that accepted 120 W the
    # iteration stretches further, idling between kernels, and the limit still holds.
    low_floor = dataclasses.replace(cm.gpu_spec("H200"), power_limit_min_w=100.0)
    s = EngineShape(gpu=low_floor, model=cm.model_spec("llama-3.1-70b"))
    counts = decode(64, 2000)
    lowest_clock_s = cm.iteration_split(s, *counts).compute_s / pm.MIN_CLOCK_FRACTION
    secs, watts = pm.capped_iteration(s, *counts, 120)
    assert watts == 120
    assert secs > cm.iteration_seconds(s, *counts) + lowest_clock_s * (1 - pm.MIN_CLOCK_FRACTION)
    by_limit = [pm.capped_iteration(s, *counts, w)[0] for w in (110, 120, 150, 200, 300)]
    assert by_limit == sorted(by_limit, reverse=True)
