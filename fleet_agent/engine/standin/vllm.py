"""The stand-in speaking vLLM's dialect:

    python -m fleet_agent.engine.standin.vllm serve <model> [vllm serve flags]

The flags are the ones fleet_core/engines/vllm.py emits (its FLAGS table, plus --host, --port
and --served-model-name); any other is refused with exit status 2.
What it models of vLLM V1 (docs/engine.md, "Dialects"): continuous batching with chunked
prefill and prefix caching on, KV blocks of --block-size (16) tokens taken as tokens arrive,
preemption by recompute when they run out, and the `priority` request field under
`--scheduling-policy priority` (lower first; the lowest-priority running request is the one
preempted). /health (200, empty), /version, /v1/models, /metrics with `vllm:*` families, and
vLLM's error bodies; a request for a model it does not serve gets 404.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from fleet_agent.engine.standin.cli_flags import add_flag_table
from fleet_agent.engine.standin.dialect import VLLM_VERSION, Dialect, version_line
from fleet_agent.engine.standin.settings import EngineArgs, Settings, settings_for
from fleet_core.engines import vllm as spec

# vLLM's defaults where the command line says nothing (vllm/engine/arg_utils.py, CacheConfig,
# SchedulerConfig): for the API server on a large GPU, 1024 sequences and 8192 batched tokens.
DEFAULT_MAX_NUM_SEQS = 1024
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fleet_agent.engine.standin.vllm",
        description="Stand-in for `vllm serve` (no GPU, simulated timing).",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=version_line("vLLM", VLLM_VERSION))
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", allow_abbrev=False, help="serve a model (OpenAI API)")
    serve.add_argument("model")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", dest="served_model_name", nargs="+", default=None)
    add_flag_table(serve, spec.FLAGS)
    return p


def engine_args(args: argparse.Namespace) -> EngineArgs:
    names = tuple(args.served_model_name or (args.model,))
    priority = args.scheduling_policy == "priority"
    return EngineArgs(
        model=args.model,
        served_name=names[0],
        served_names=names,
        host=args.host or "0.0.0.0",
        port=args.port,
        log_level="info",
        tp_size=args.tensor_parallel_size or 1,
        pp_size=args.pipeline_parallel_size or 1,
        max_batch_size=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_num_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_seq_len=args.max_model_len,
        kv_fraction=args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        # Both on by default in vLLM V1; --no-enable-... turns them off.
        chunked_prefill=args.enable_chunked_prefill is not False,
        block_reuse=args.enable_prefix_caching is not False,
        tokens_per_block=getattr(args, "block_size", None) or DEFAULT_BLOCK_SIZE,
        seed=args.seed,
        policy="priority" if priority else "fcfs",
        kv_policy="preempt",
    )


def dialect(args: argparse.Namespace) -> Dialect:
    priority = args.scheduling_policy == "priority"
    return Dialect(
        "vllm",
        VLLM_VERSION,
        priority="low_first" if priority else "off",
        check_model=True,
        refuse_priority=not priority,
    )


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    return settings_for(engine_args(args), env, dialect(args))


def main(argv: Sequence[str] | None = None) -> int:
    from fleet_agent.engine.standin.server import run

    args = build_parser().parse_args(argv)  # exits 2 on an unknown or malformed flag
    return run(args.model, "info", lambda env: build_settings(args, env))


if __name__ == "__main__":
    sys.exit(main())
