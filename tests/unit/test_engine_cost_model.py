"""The engine cost model against the figures it is meant to reproduce (docs/hardware.md).

Published: TensorRT-LLM docs/source/performance/perf-overview.md (v0.17) and NVIDIA datasheets;
"derived": the hardware notes' own arithmetic with the same formula.
"""

from __future__ import annotations

from typing import Any

import pytest

from fleet_core import cost_model as cm
from fleet_core.cost_model import EngineShape


def shape(gpu: str, model: str = "llama-3.1-8b", **kw: Any) -> EngineShape:
    return EngineShape(gpu=cm.gpu_spec(gpu), model=cm.model_spec(model), **kw)


def test_gpu_and_model_figures_are_the_notes() -> None:
    h100, h200, l40s = cm.GPUS["H100"], cm.GPUS["H200"], cm.GPUS["L40S"]
    assert (h100.memory_usable_bytes, h100.hbm_bandwidth) == (81_559 * 2**20, 3.35e12)
    assert (h200.memory_usable_bytes, h200.hbm_bandwidth) == (143_771 * 2**20, 4.8e12)
    assert (l40s.memory_usable_bytes, l40s.hbm_bandwidth) == (46_068 * 2**20, 0.864e12)
    assert (h100.bf16_flops, h100.fp8_flops, l40s.bf16_flops, l40s.fp8_flops) == (
        989e12,
        1979e12,
        362e12,
        733e12,
    )
    assert (h100.tdp_w, l40s.tdp_w, h100.interconnect, l40s.interconnect) == (
        700,
        350,
        "nvlink",
        "pcie",
    )
    m8, m70 = cm.MODELS["llama-3.1-8b"], cm.MODELS["llama-3.1-70b"]
    assert m8.kv_bytes_per_token("bf16") == 128 * 1024
    assert m8.kv_bytes_per_token("fp8") == 64 * 1024
    assert m70.kv_bytes_per_token("bf16") == 320 * 1024
    assert m70.kv_bytes_per_token("fp8") == 160 * 1024


@pytest.mark.parametrize(
    ("gpu", "model", "tp", "expected"),
    [
        ("H100", "llama-3.1-8b", 1, 1.0e6),
        ("H200", "llama-3.1-8b", 1, 1.9e6),
        ("L40S", "llama-3.1-8b", 1, 0.5e6),
        ("H100", "llama-3.1-70b", 2, 0.5e6),
        ("H200", "llama-3.1-70b", 2, 1.2e6),
    ],
)
def test_kv_capacity_at_fraction_0_9(gpu: str, model: str, tp: int, expected: float) -> None:
    tokens = cm.kv_capacity_tokens(shape(gpu, model, tp_size=tp))
    assert tokens % cm.TOKENS_PER_BLOCK == 0
    assert tokens == pytest.approx(expected, rel=0.06)


def test_kv_capacity_scales_with_fraction_and_vanishes_when_weights_do_not_fit() -> None:
    full = cm.kv_capacity_tokens(shape("H100"))
    half = cm.kv_capacity_tokens(shape("H100", kv_cache_free_gpu_memory_fraction=0.45))
    assert half == pytest.approx(full / 2, rel=0.01)
    # 70B BF16 is 141 GB of weights: not on one H100, fine on four.
    assert cm.kv_capacity_tokens(shape("H100", "llama-3.1-70b", precision="bf16")) == 0
    assert cm.kv_capacity_tokens(shape("H100", "llama-3.1-70b", precision="bf16", tp_size=4)) > 0


def test_70b_fp8_batch_one_on_h200() -> None:
    """Notes: 50-53 tokens/s depending on t_fix; published ≈ 51 (Llama-3.3-70B FP8, one H200)."""
    s = shape("H200", "llama-3.1-70b")
    assert 50 <= 1 / cm.iteration_seconds(s, 1, 0, 600) <= 53
    assert 50 <= cm.predicted_decode_tokens_per_s(s, 1, 128, 128) <= 53


@pytest.mark.parametrize(
    ("gpu", "derived", "published"),
    [("H100", 20_400, 21_109), ("H200", 27_900, 25_399), ("L40S", 4_900, 5_366)],
)
def test_8b_fp8_max_throughput_128_2048(gpu: str, derived: float, published: float) -> None:
    tokens_per_s = cm.predicted_decode_tokens_per_s(shape(gpu), None, 128, 2048)
    assert tokens_per_s == pytest.approx(derived, rel=0.06)
    assert tokens_per_s == pytest.approx(published, rel=0.10)


@pytest.mark.parametrize(
    ("concurrency", "published_itl_s"),
    [(4, 0.008), (45, 0.011)],
)
def test_8b_bf16_h100_latency_under_load(concurrency: int, published_itl_s: float) -> None:
    """Published (Triton backend, BF16, 467 in / 256 out): ITL 8 / 11 ms at 2 / 16 requests/s.
    By Little's law that is about 2 × (23 ms + 255 × 8 ms) ≈ 4 and 16 × (30 ms + 255 × 11 ms)
    ≈ 45 requests in flight."""
    s = shape("H100", precision="bf16")
    assert cm.predicted_itl_s(s, concurrency, 467, 256) == pytest.approx(published_itl_s, rel=0.1)


def test_tp_cost_scales_with_tp_and_link() -> None:
    m70 = "llama-3.1-70b"
    assert cm.tp_seconds(shape("H100", m70)) == 0.0
    assert cm.tp_seconds(shape("H100", m70, tp_size=4)) == pytest.approx(8e-3)
    assert cm.tp_seconds(shape("L40S", m70, tp_size=4)) == pytest.approx(78e-3)
    tp2, tp4, tp8 = (cm.tp_seconds(shape("H100", m70, tp_size=t)) for t in (2, 4, 8))
    assert 0 < tp2 < tp4 < tp8
    # Fewer layers, fewer all-reduces.
    assert cm.tp_seconds(shape("H100", tp_size=4)) < tp4


def test_iteration_time_grows_with_work_and_precision() -> None:
    s = shape("H100")
    base = cm.iteration_seconds(s, 1, 0, 0)
    assert base > cm.T_FIX_S
    assert cm.iteration_seconds(s, 64, 0, 0) > base
    assert cm.iteration_seconds(s, 1, 2048, 0) > base
    assert cm.iteration_seconds(s, 1, 0, 500_000) > base
    assert cm.iteration_seconds(shape("H100", precision="bf16"), 1, 0, 0) > base
    assert cm.iteration_seconds(shape("L40S"), 1, 0, 0) > base
    with pytest.raises(ValueError):
        cm.iteration_seconds(s, -1, 0, 0)


def test_steady_state_predictions() -> None:
    s = shape("H100")
    itl = [cm.predicted_itl_s(s, c, 128, 128) for c in (1, 8, 64)]
    tps = [cm.predicted_decode_tokens_per_s(s, c, 128, 128) for c in (1, 8, 64)]
    assert itl == sorted(itl)  # more streams, slower iterations ...
    assert tps == sorted(tps)  # ... but more tokens per second in all
    assert tps[0] == pytest.approx(1 / itl[0])
    # Beyond what fits, the prediction is the max-throughput one.
    cap = cm.max_concurrency(s, 128, 128)
    assert cap == s.max_batch_size  # 2048 requests of 256 tokens fit in 1.0M tokens
    assert cm.predicted_decode_tokens_per_s(s, 10**6, 128, 128) == pytest.approx(
        cm.predicted_decode_tokens_per_s(s, None, 128, 128)
    )
    # KV-bound: 128 + 2048 tokens reserve 68 blocks each.
    assert cm.max_concurrency(s, 128, 2048) == cm.kv_capacity_blocks(s) // 68
    with pytest.raises(ValueError):
        cm.predicted_itl_s(s, 1, 0, 128)


def test_load_time_from_nvme_bandwidth() -> None:
    assert cm.load_seconds(shape("H100")) == pytest.approx(8.03 / 7, rel=0.01)
    assert cm.load_seconds(shape("H100", "llama-3.1-70b", tp_size=2)) == pytest.approx(
        70.55 / 7, rel=0.01
    )
    assert cm.load_seconds(shape("H100", precision="bf16")) == pytest.approx(2 * 8.03 / 7, rel=0.01)


def test_names() -> None:
    assert cm.gpu_spec("h100").name == "H100 SXM"
    assert cm.gpu_spec("H100-SXM") is cm.GPUS["H100"]
    assert cm.model_spec("Llama-3.1-70B") is cm.MODELS["llama-3.1-70b"]
    assert cm.guess_model("/models/chat/Llama-3.1-70B-Instruct-FP8").name == "Llama-3.1-70B"
    assert cm.guess_model("meta-llama/Llama-3.1-8B-Instruct").name == "Llama-3.1-8B"
    assert cm.guess_model("mystery-model").name == "Llama-3.1-8B"
    with pytest.raises(ValueError, match="unknown GPU"):
        cm.gpu_spec("A100")
    with pytest.raises(ValueError, match="unknown model"):
        cm.model_spec("llama-2-7b")
    with pytest.raises(ValueError):
        shape("H100", tp_size=0)
    with pytest.raises(ValueError):
        shape("H100", kv_cache_free_gpu_memory_fraction=1.5)


def test_gpu_memory_used_is_weights_overhead_and_kv_pool() -> None:
    s = shape("H100")
    used = cm.gpu_memory_used_bytes(s)
    assert cm.weights_bytes(s) < used < s.gpu.memory_usable_bytes
    kv_pool = cm.kv_capacity_tokens(s) * s.kv_bytes_per_token
    assert used == pytest.approx(
        cm.weights_bytes(s) + cm.RUNTIME_OVERHEAD_BYTES + kv_pool, rel=1e-3
    )


def test_effective_lengths_of_a_mix() -> None:
    assert cm.effective_lengths([(128, 128)] * 3) == pytest.approx((128, 128))
    mix = [(1000, 10), (10, 1000)]
    i, o = cm.effective_lengths(mix)
    assert i / o == pytest.approx(1010 / 1010)  # prompt tokens per output token
    assert i + o / 2 == pytest.approx((10 * 1005 + 1000 * 510) / 1010)  # mean cached context
    s = shape("H100")
    assert cm.predicted_itl_s(s, 8, i, o) > cm.predicted_itl_s(s, 8, 10, 1000)
    with pytest.raises(ValueError):
        cm.effective_lengths([])
