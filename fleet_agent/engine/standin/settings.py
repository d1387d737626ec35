"""The stand-in's command line (trtllm-serve's `serve` flags), its extra-options YAML and its
FLEET_STANDIN_* environment, turned into Settings: what to serve, on which simulated engine.
The other dialects' command lines (vllm.py, sglang.py) end in the same EngineArgs →
settings_for()."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleet_agent.engine.core import CoreConfig, KvPolicy, SchedulingPolicy
from fleet_agent.engine.standin.dialect import TRTLLM, Dialect, version_line
from fleet_agent.engine.standin.weights import Weights
from fleet_agent.telemetry import sim_gpu_state
from fleet_core import cost_model

# trtllm-serve's `serve` options (tensorrt_llm/commands/serve.py). The stand-in uses the ones
# marked "used"; the rest are accepted so that any command line the real server takes works here.
_LOG_LEVELS = ["internal_error", "error", "warning", "info", "verbose", "debug", "trace"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fleet_agent.engine.standin",
        description="Stand-in for trtllm-serve (no GPU, simulated timing).",
        allow_abbrev=False,  # click, which trtllm-serve uses, takes no abbreviations
    )
    p.add_argument(
        "--version", action="version", version=version_line("trtllm-serve", TRTLLM.version)
    )
    p.add_argument("model", help="model name | HF checkpoint path | engine path")
    p.add_argument("--host", default="localhost")  # used
    p.add_argument("--port", type=int, default=8000)  # used
    p.add_argument(
        "--backend", choices=["pytorch", "tensorrt", "trt", "_autodeploy"], default="pytorch"
    )
    p.add_argument("--log_level", choices=_LOG_LEVELS, default="info")  # used
    p.add_argument("--max_beam_width", type=int, default=1)
    p.add_argument("--max_batch_size", type=int, default=2048)  # used; BuildConfig default
    p.add_argument("--max_num_tokens", type=int, default=8192)  # used; BuildConfig default
    p.add_argument("--max_seq_len", type=int, default=None)  # used
    p.add_argument("--tensor_parallel_size", "--tp_size", dest="tp_size", type=int, default=1)
    p.add_argument("--pipeline_parallel_size", "--pp_size", dest="pp_size", type=int, default=1)
    p.add_argument("--context_parallel_size", "--cp_size", dest="cp_size", type=int, default=1)
    p.add_argument("--moe_expert_parallel_size", "--ep_size", dest="ep_size", type=int)
    p.add_argument("--moe_cluster_parallel_size", "--cluster_size", dest="cluster_size", type=int)
    p.add_argument("--gpus_per_node", type=int)
    p.add_argument(
        "--free_gpu_memory_fraction",
        "--kv_cache_free_gpu_memory_fraction",
        dest="kv_cache_free_gpu_memory_fraction",
        type=float,
        default=0.9,
    )  # used
    p.add_argument("--num_postprocess_workers", type=int, default=0)
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--revision")
    p.add_argument("--tokenizer")
    p.add_argument("--custom_tokenizer")
    p.add_argument("--custom_module_dirs", action="append", default=[])
    p.add_argument("--config", "--extra_llm_api_options", dest="extra_llm_api_options")  # used
    p.add_argument("--reasoning_parser")
    p.add_argument("--tool_parser")
    p.add_argument("--metadata_server_config_file")
    p.add_argument("--server_role")
    p.add_argument("--fail_fast_on_attention_window_too_large", action="store_true")
    p.add_argument("--otlp_traces_endpoint")
    p.add_argument("--disagg_cluster_uri")
    p.add_argument("--enable_chunked_prefill", action="store_true")  # used
    p.add_argument("--media_io_kwargs")
    p.add_argument("--chat_template")
    return p


class ConfigError(Exception):
    """The command line parsed but cannot be served (bad environment, YAML, GPU count)."""


@dataclass(frozen=True)
class Settings:
    served_model: str
    host: str
    port: int
    core: CoreConfig
    load_s: float  # simulated
    speedup: float
    drain_s: float  # wall
    log_level: str
    # The simulated GPUs' shared state (fleet_agent/telemetry/sim_gpu_state.py): their power
    # limits in, this engine's power out. None: no limit, power only on /prometheus/metrics.
    gpu_state_dir: Path | None = None
    gpu_indexes: tuple[int, ...] = (0,)  # the GPUs it runs on (CUDA_VISIBLE_DEVICES)
    # The checkpoint directory read at load (weights.py; None: a name, nothing to read) and
    # the read rate cap (MB/s; None: as fast as the disk goes).
    weights: Weights | None = None
    read_mb_s: float | None = None
    dialect: Dialect = TRTLLM
    served_models: tuple[str, ...] = ()  # every name it answers to (default: served_model)


@dataclass(frozen=True)
class EngineArgs:
    """What a dialect's command line says about the engine, in EngineCore's terms."""

    model: str  # the model argument as given
    served_name: str  # the first name it serves under
    host: str
    port: int
    log_level: str
    max_batch_size: int
    max_num_tokens: int
    chunked_prefill: bool
    tp_size: int = 1
    pp_size: int = 1
    max_seq_len: int | None = None
    kv_fraction: float = 0.9
    block_reuse: bool = True
    tokens_per_block: int = cost_model.TOKENS_PER_BLOCK
    seed: int | None = None  # the command line's; None: FLEET_STANDIN_SEED
    policy: SchedulingPolicy = "fcfs"
    kv_policy: KvPolicy = "reserve"
    priority_preemption_threshold: int | None = None
    kv_capacity_tokens: int | None = None
    served_names: tuple[str, ...] = ()


def _env_float(env: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name}={raw!r} must be a finite number >= {minimum}")
    return value


def served_model_name(model: str) -> str:
    """As trtllm-serve: a checkpoint directory serves under its base name, anything else (a
    Hugging Face name) as is. An absolute path counts as a checkpoint directory even where it
    does not exist (main() refuses it then, unless FLEET_STANDIN_MISSING_WEIGHTS=ignore)."""
    path = Path(model)
    return path.name if path.is_dir() or path.is_absolute() else model


def _extra_options(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--extra_llm_api_options {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--extra_llm_api_options {path}: not YAML ({exc})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--extra_llm_api_options {path}: expected a mapping")
    return loaded


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """Command line + YAML + FLEET_STANDIN_* → what to serve. Raises ConfigError."""
    extra = _extra_options(args.extra_llm_api_options)
    # The YAML overrides the flags, as in trtllm-serve; keys the stand-in has no use for
    # (enable_iter_perf_stats, return_perf_metrics, ...) are accepted and ignored.
    kv_cfg = extra.get("kv_cache_config") or {}
    if not isinstance(kv_cfg, dict):
        raise ConfigError("extra_llm_api_options: kv_cache_config must be a mapping")
    try:
        max_batch_size = int(extra.get("max_batch_size", args.max_batch_size))
        max_num_tokens = int(extra.get("max_num_tokens", args.max_num_tokens))
        max_seq_len_raw = extra.get("max_seq_len", args.max_seq_len)
        max_seq_len = None if max_seq_len_raw is None else int(max_seq_len_raw)
        # A YAML kv_cache_config replaces the one the flag built (update_llm_args_with_extra_dict),
        # so its own fraction, or KvCacheConfig's default 0.9, wins over the flag.
        fraction = float(
            kv_cfg.get("free_gpu_memory_fraction", 0.9)
            if "kv_cache_config" in extra
            else args.kv_cache_free_gpu_memory_fraction
        )
        chunked = bool(extra.get("enable_chunked_prefill", args.enable_chunked_prefill))
        block_reuse = bool(kv_cfg.get("enable_block_reuse", True))
        tokens_per_block = int(extra.get("tokens_per_block", cost_model.TOKENS_PER_BLOCK))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"extra_llm_api_options: {exc}") from None

    return settings_for(
        EngineArgs(
            model=args.model,
            served_name=served_model_name(args.model),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            tp_size=args.tp_size,
            pp_size=args.pp_size,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len,
            kv_fraction=fraction,
            chunked_prefill=chunked,
            block_reuse=block_reuse,
            tokens_per_block=tokens_per_block,
        ),
        env,
        TRTLLM,
    )


def settings_for(engine: EngineArgs, env: Mapping[str, str], dialect: Dialect) -> Settings:
    """A dialect's EngineArgs + FLEET_STANDIN_* → what to serve. Raises ConfigError."""

    try:
        gpu = cost_model.gpu_spec(env.get("FLEET_STANDIN_GPU") or "H100")
        model_env = env.get("FLEET_STANDIN_MODEL")
        model = (
            cost_model.model_spec(model_env) if model_env else cost_model.guess_model(engine.model)
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    precision = (env.get("FLEET_STANDIN_PRECISION") or "fp8").lower()
    if precision not in ("fp8", "bf16"):
        raise ConfigError(f"FLEET_STANDIN_PRECISION={precision!r}: expected fp8 or bf16")

    # A real engine needs tp × pp GPUs; the supervisor hands them over in CUDA_VISIBLE_DEVICES.
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpu_indexes = tuple(range(engine.tp_size * engine.pp_size))
    if visible is not None:
        listed = [d.strip() for d in visible.split(",") if d.strip()]
        if listed and all(d.isdigit() for d in listed):
            gpu_indexes = tuple(int(d) for d in listed[: engine.tp_size * engine.pp_size])
        count = len([d for d in visible.split(",") if d.strip()])
        if count < engine.tp_size * engine.pp_size:
            raise ConfigError(
                f"tp_size {engine.tp_size} × pp_size {engine.pp_size} needs "
                f"{engine.tp_size * engine.pp_size} GPUs; "
                f"CUDA_VISIBLE_DEVICES={visible!r} has {count}"
            )
    try:
        shape = cost_model.EngineShape(
            gpu=gpu,
            model=model,
            precision="fp8" if precision == "fp8" else "bf16",
            tp_size=engine.tp_size,
            pp_size=engine.pp_size,
            max_batch_size=engine.max_batch_size,
            max_num_tokens=engine.max_num_tokens,
            kv_cache_free_gpu_memory_fraction=engine.kv_fraction,
            tokens_per_block=engine.tokens_per_block,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cost_model.kv_capacity_blocks(shape) < 1:
        raise ConfigError(
            f"{model.name} {precision} does not fit on {shape.gpus} × {gpu.name} "
            "(out of GPU memory); raise tp_size"
        )
    seed = int(_env_float(env, "FLEET_STANDIN_SEED", 0, -(2**62)))
    return Settings(
        served_model=engine.served_name,
        host=engine.host,
        port=engine.port,
        core=CoreConfig(
            shape=shape,
            max_seq_len=engine.max_seq_len,
            enable_chunked_prefill=engine.chunked_prefill,
            enable_block_reuse=engine.block_reuse,
            seed=seed if engine.seed is None else engine.seed,
            policy=engine.policy,
            kv_policy=engine.kv_policy,
            priority_preemption_threshold=engine.priority_preemption_threshold,
            kv_capacity_tokens=engine.kv_capacity_tokens,
        ),
        load_s=_env_float(env, "FLEET_STANDIN_LOAD_S", cost_model.load_seconds(shape), 0.0),
        speedup=_env_float(env, "FLEET_STANDIN_SPEEDUP", 1.0, 1e-6),
        drain_s=_env_float(env, "FLEET_STANDIN_DRAIN_S", 30.0, 0.0),
        log_level=engine.log_level,
        gpu_state_dir=Path(state_dir) if (state_dir := env.get(sim_gpu_state.ENV)) else None,
        gpu_indexes=gpu_indexes,
        dialect=dialect,
        served_models=engine.served_names or (engine.served_name,),
    )
