"""Per-iteration cost model of a TensorRT-LLM engine, for the stand-in and the simulator.

Pure: plain data in, numbers out; no clock, no I/O. The formula and every hardware figure come
from docs/hardware.md ("The per-iteration cost model", itself derived from NVIDIA's published
specifications and TensorRT-LLM's `docs/source/performance/perf-overview.md`, v0.17). For a
tensor-parallel group of T GPUs one continuous-batching iteration takes

    t_iter = t_fix + t_TP + (W/T + KV_read/T) / (0.8·BW) + 2·(P/T)·(B_decode + N_prefill) / (0.6·F)

W the weight bytes streamed per iteration, P the parameters that do arithmetic per token, KV_read
the KV-cache bytes of the scheduled requests' contexts, B_decode the decoding requests, N_prefill
the prompt tokens scheduled this iteration, BW the HBM bandwidth and F the dense TFLOPS at the
serving precision (80 % of peak bandwidth and 60 % of peak FLOPS are reachable).

Our own choices, each reproducing a figure of the notes (see tests/unit/test_engine_cost_model.py):

- W and P leave out the input embedding table: a decode step looks up one row of it, it does not
  stream it. With t_fix = 1.5 ms this puts Llama-3.1-70B FP8 batch 1 on one H200 at 50.7 tokens/s
  (published 51, the notes' check 50-53).
- t_TP: two all-reduces per layer (after attention and after the MLP), each costing
  α_link · 2(T-1)/T (a ring all-reduce moves 2(T-1)/T of the data). α is set so that 70B TP4 pays
  the notes' 8 ms over NVLink and 8 + 70 ms over PCIe; T = 1 pays nothing.
- Runtime overhead per GPU (CUDA context, activations, workspaces): 3 GB, which reproduces the
  notes' derived KV capacities at kv_cache_free_gpu_memory_fraction 0.9 (8B FP8: 1.0M tokens on an
  H100, 1.9M on an H200, 0.5M on an L40S; 70B FP8 TP2 on H100: 0.5M).
- Pipeline parallelism only adds memory: the PP stages of one iteration run one after the other,
  so an iteration takes what it takes at PP 1 (no micro-batch overlap is modelled).
- Steady state (the predictions used by bench/engine.py) follows trtllm-serve's default capacity
  scheduler, GUARANTEED_NO_EVICT: a request is admitted only once blocks for prompt + max_tokens
  are free, so at most ⌊KV blocks / blocks(prompt + output)⌋ requests run at once. This gives 8B
  FP8 128/2048 at 19.7k/27.0k/5.0k tokens/s on H100/H200/L40S (the notes derive 20.4k/27.9k/4.9k;
  published 21.1k/25.4k/5.4k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The GPU table lives in fleet_core.gpus (one table for inventory, cost model and telemetry);
# re-exported here because callers name it through the cost model (cost_model.gpu_spec("H100")).
from fleet_core.gpus import GPUS as GPUS
from fleet_core.gpus import MIB as MIB
from fleet_core.gpus import GpuSpec as GpuSpec
from fleet_core.gpus import Interconnect as Interconnect
from fleet_core.gpus import Precision as Precision
from fleet_core.gpus import gpu_spec as gpu_spec

GB = 1e9
KIB = 2**10


@dataclass(frozen=True)
class ModelSpec:
    """One model. Shapes from Meta's published config.json; KV bytes per token from docs/hardware.md
    (2 · layers · kv_heads · head_dim · bytes)."""

    name: str
    params: int
    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token_fp16: int
    max_position_embeddings: int

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def active_params(self) -> int:
        """Parameters streamed and multiplied per token (all but the input embedding table)."""
        return self.params - self.embedding_params

    def kv_bytes_per_token(self, precision: Precision) -> int:
        return (
            self.kv_bytes_per_token_fp16 // 2
            if precision == "fp8"
            else self.kv_bytes_per_token_fp16
        )


MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        name="Llama-3.1-8B",
        params=8_030_261_248,
        layers=32,
        hidden=4096,
        vocab=128_256,
        kv_bytes_per_token_fp16=128 * KIB,
        max_position_embeddings=131_072,
    ),
    "llama-3.1-70b": ModelSpec(
        name="Llama-3.1-70B",
        params=70_553_706_496,
        layers=80,
        hidden=8192,
        vocab=128_256,
        kv_bytes_per_token_fp16=320 * KIB,
        max_position_embeddings=131_072,
    ),
}

T_FIX_S = 1.5e-3  # per-iteration fixed cost (launches, sampling): docs/hardware.md 1.5-2 ms
BW_EFFICIENCY = 0.8  # docs/hardware.md: 0.8 · BW
FLOPS_EFFICIENCY = 0.6  # docs/hardware.md: 0.6 · F
RUNTIME_OVERHEAD_BYTES = 3 * GB  # per GPU; our assumption, see the module docstring
TOKENS_PER_BLOCK = 32  # TensorRT-LLM's default tokens_per_block
NVME_BYTES_PER_S = 7 * GB  # docs/hardware.md: 145 GB from a local NVMe stripe in ≈ 20 s cold

# α per all-reduce, from docs/hardware.md's t_TP for 70B TP4: 8 ms over NVLink, about 70 ms
# more over PCIe; 70B TP4 runs 2·80 all-reduces at ring factor 2·3/4 = 1.5 (see the module
# docstring).
_ALLREDUCES_70B_TP4 = 2 * 80 * 1.5
ALLREDUCE_S: dict[Interconnect, float] = {
    "nvlink": 8e-3 / _ALLREDUCES_70B_TP4,
    "pcie": 78e-3 / _ALLREDUCES_70B_TP4,
}


@dataclass(frozen=True)
class EngineShape:
    """What one engine process runs: a model on a TP × PP group of one GPU model, with its limits
    (trtllm-serve's flags; defaults are TensorRT-LLM's BuildConfig defaults)."""

    gpu: GpuSpec
    model: ModelSpec
    precision: Precision = "fp8"
    tp_size: int = 1
    pp_size: int = 1
    max_batch_size: int = 2048
    max_num_tokens: int = 8192
    kv_cache_free_gpu_memory_fraction: float = 0.9
    tokens_per_block: int = TOKENS_PER_BLOCK

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tp_size and pp_size must be at least 1")
        if not 0.0 < self.kv_cache_free_gpu_memory_fraction <= 1.0:
            raise ValueError("kv_cache_free_gpu_memory_fraction must be in (0, 1]")
        if self.max_batch_size < 1 or self.max_num_tokens < 1 or self.tokens_per_block < 1:
            raise ValueError("max_batch_size, max_num_tokens and tokens_per_block must be >= 1")

    @property
    def gpus(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def bytes_per_param(self) -> int:
        return 1 if self.precision == "fp8" else 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.precision)


def model_spec(name: str) -> ModelSpec:
    """ "llama-3.1-8b", "Llama-3.1-70B" (case-insensitive) → the model's spec."""
    try:
        return MODELS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def guess_model(model_arg: str) -> ModelSpec:
    """The model a trtllm-serve <model> argument (HF name or checkpoint path) most likely names:
    "70b" in it → Llama-3.1-70B, anything else → Llama-3.1-8B."""
    return MODELS["llama-3.1-70b" if "70b" in model_arg.lower() else "llama-3.1-8b"]


def weights_bytes(shape: EngineShape) -> int:
    """All weight bytes of the model at the serving precision (what gets loaded)."""
    return shape.model.params * shape.bytes_per_param


def load_seconds(shape: EngineShape) -> float:
    """Weights from a local NVMe stripe, cold (docs/hardware.md: ≈ 7 GB/s): 8B FP8 ≈ 1.1 s."""
    return weights_bytes(shape) / NVME_BYTES_PER_S


def tp_seconds(shape: EngineShape) -> float:
    """All-reduce time per iteration: 2 per layer, each α_link · 2(T-1)/T; 0 for T = 1."""
    t = shape.tp_size
    if t == 1:
        return 0.0
    return 2 * shape.model.layers * (2 * (t - 1) / t) * ALLREDUCE_S[shape.gpu.interconnect]


@dataclass(frozen=True, slots=True)
class IterationSplit:
    """Where one iteration's time goes on each GPU of the group: the fixed per-iteration cost
    (launches, sampling), the tensor-parallel all-reduces, streaming weights and KV cache from HBM,
    and the tensor-core arithmetic. The power model (fleet_core/power_model.py) prices each part."""

    fixed_s: float
    tp_s: float
    memory_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.fixed_s + self.tp_s + self.memory_s + self.compute_s


def iteration_split(
    shape: EngineShape, decode_requests: int, prefill_tokens: int, kv_tokens_read: int
) -> IterationSplit:
    """The terms of t_iter (module docstring) for one iteration, per GPU of the group."""
    if decode_requests < 0 or prefill_tokens < 0 or kv_tokens_read < 0:
        raise ValueError("counts must be non-negative")
    t = shape.tp_size
    weights_read = shape.model.active_params * shape.bytes_per_param
    kv_read = kv_tokens_read * shape.kv_bytes_per_token
    memory_s = (weights_read / t + kv_read / t) / (BW_EFFICIENCY * shape.gpu.hbm_bandwidth)
    flops = 2 * (shape.model.active_params / t) * (decode_requests + prefill_tokens)
    compute_s = flops / (FLOPS_EFFICIENCY * shape.gpu.flops(shape.precision))
    return IterationSplit(T_FIX_S, tp_seconds(shape), memory_s, compute_s)


def iteration_seconds(
    shape: EngineShape, decode_requests: int, prefill_tokens: int, kv_tokens_read: int
) -> float:
    """Duration of one iteration that decodes `decode_requests` tokens, prefills `prefill_tokens`
    prompt tokens and reads the KV cache of `kv_tokens_read` context tokens."""
    return iteration_split(shape, decode_requests, prefill_tokens, kv_tokens_read).total_s


def gpu_memory_used_bytes(shape: EngineShape) -> int:
    """What one GPU of the group holds once loaded: its weight shard, the runtime overhead and
    the KV pool, which TensorRT-LLM allocates up front (so this does not move with load)."""
    shard = weights_bytes(shape) // shape.gpus
    free = max(0, shape.gpu.memory_usable_bytes - shard - int(RUNTIME_OVERHEAD_BYTES))
    return shard + int(RUNTIME_OVERHEAD_BYTES) + int(free * shape.kv_cache_free_gpu_memory_fraction)


def kv_capacity_blocks(shape: EngineShape) -> int:
    """KV-cache blocks of the whole group at its kv_cache_free_gpu_memory_fraction."""
    shard = weights_bytes(shape) / shape.gpus
    free_per_gpu = shape.gpu.memory_usable_bytes - shard - RUNTIME_OVERHEAD_BYTES
    if free_per_gpu <= 0:
        return 0
    pool = free_per_gpu * shape.kv_cache_free_gpu_memory_fraction * shape.gpus
    return int(pool // (shape.kv_bytes_per_token * shape.tokens_per_block))


def kv_capacity_tokens(shape: EngineShape) -> int:
    """KV-cache capacity in tokens (whole blocks): 8B FP8 on one H100 ≈ 1.0M."""
    return kv_capacity_blocks(shape) * shape.tokens_per_block


def blocks_for(shape: EngineShape, tokens: float) -> int:
    return math.ceil(tokens / shape.tokens_per_block)


def max_concurrency(shape: EngineShape, input_len: float, output_len: float) -> int:
    """Requests that run at once under GUARANTEED_NO_EVICT: bounded by max_batch_size, by
    max_num_tokens (each running request decodes one token per iteration) and by the KV blocks
    reserved for prompt + output."""
    per_request = blocks_for(shape, input_len + output_len)
    by_kv = kv_capacity_blocks(shape) // per_request if per_request else shape.max_batch_size
    return max(0, min(shape.max_batch_size, shape.max_num_tokens, by_kv))


def _steady_batch(
    shape: EngineShape, concurrency: int | None, input_len: float, output_len: float
) -> int:
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be at least 1")
    cap = max_concurrency(shape, input_len, output_len)
    if cap < 1:
        raise ValueError(f"a {input_len}+{output_len}-token request does not fit this engine")
    return cap if concurrency is None else max(1, min(concurrency, cap))


def predicted_itl_s(
    shape: EngineShape, concurrency: int | None, input_len: float, output_len: float
) -> float:
    """Mean inter-token latency in steady state with `concurrency` streams (None: as many as fit)
    of input_len → output_len tokens. Each request's prompt is prefilled once per output_len
    iterations, so an average iteration carries B·input_len/output_len prompt tokens, and an
    average running request has input_len + output_len/2 tokens in its KV cache. For a mix of
    sizes pass effective_lengths(...) of the mix."""
    b = _steady_batch(shape, concurrency, input_len, output_len)
    prefill = round(b * input_len / output_len)
    kv_tokens = round(b * (input_len + output_len / 2))
    return iteration_seconds(shape, b, prefill, kv_tokens)


def predicted_decode_tokens_per_s(
    shape: EngineShape, concurrency: int | None, input_len: float, output_len: float
) -> float:
    """Output tokens per second in steady state (None: max-throughput, as many streams as fit)."""
    b = _steady_batch(shape, concurrency, input_len, output_len)
    return b / predicted_itl_s(shape, concurrency, input_len, output_len)


def effective_lengths(sizes: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(input, output) lengths whose steady state matches a mix of (input, output) requests.

    A request stays in the running set for its output_len iterations, so the prompt tokens per
    iteration go as Σin/Σout and the average cached context is Σ out·(in + out/2) / Σ out; the
    returned pair reproduces both in predicted_itl_s()."""
    total_out = sum(o for _, o in sizes)
    if not sizes or total_out <= 0:
        raise ValueError("need at least one request with output tokens")
    ratio = sum(i for i, _ in sizes) / total_out
    context = sum(o * (i + o / 2) for i, o in sizes) / total_out
    output = context / (ratio + 0.5)
    return ratio * output, output
