"""The stand-in speaking SGLang's dialect:

    python -m fleet_agent.engine.standin.sglang --model-path <model> [launch_server flags]

The flags are the ones fleet_core/engines/sglang.py emits (its FLAGS table, plus --host, --port,
--served-model-name, --enable-metrics and the priority-scheduling flags); any other is refused
with exit status 2. What it models of SGLang (docs/engine.md, "Dialects"): continuous batching
with chunked prefill (--chunked-prefill-size tokens an iteration), the radix cache as prefix
reuse, requests retracted when the KV pool (--max-total-tokens) runs out in decode, and the
`priority` request field under --enable-priority-scheduling: HIGHER values first, as SGLang,
unless --schedule-low-priority-values-first (the agent passes both); a waiting request preempts
a running one whose priority is worse by more than --priority-scheduling-preemption-threshold
(10); past --max-queued-requests waiting, a request is refused (503). /health,
/health_generate, /get_model_info, /v1/models, /metrics (`sglang:*`, only with
--enable-metrics) and SGLang's error bodies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from fleet_agent.engine.standin.cli_flags import add_flag_table
from fleet_agent.engine.standin.dialect import SGLANG_VERSION, Dialect, PriorityMode, version_line
from fleet_agent.engine.standin.settings import EngineArgs, Settings, settings_for
from fleet_core.engines import sglang as spec

# SGLang's defaults where the command line says nothing (python/sglang/srt/server_args.py; some
# depend on the GPU there, these are its large-GPU values).
DEFAULT_MAX_RUNNING_REQUESTS = 1024
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
DEFAULT_MEM_FRACTION_STATIC = 0.88
DEFAULT_PREEMPTION_THRESHOLD = 10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fleet_agent.engine.standin.sglang",
        description="Stand-in for SGLang's launch_server (no GPU, simulated timing).",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=version_line("SGLang", SGLANG_VERSION))
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", dest="served_model_name", default=None)
    p.add_argument("--enable-metrics", action="store_true")
    for flag in spec.PRIORITY_FLAGS:  # --enable-priority-scheduling, ...-values-first
        p.add_argument(flag, action="store_true")
    add_flag_table(p, spec.FLAGS)
    return p


def engine_args(args: argparse.Namespace) -> EngineArgs:
    name = args.served_model_name or args.model_path
    priority = args.enable_priority_scheduling
    return EngineArgs(
        model=args.model_path,
        served_name=name,
        host=args.host,
        port=args.port,
        log_level="info",
        tp_size=args.tp_size or 1,
        pp_size=args.pp_size or 1,
        max_batch_size=args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        max_num_tokens=args.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE,
        max_seq_len=args.context_length,
        kv_fraction=args.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC,
        chunked_prefill=True,
        block_reuse=not args.disable_radix_cache,
        seed=args.random_seed,
        policy="priority" if priority else "fcfs",
        kv_policy="preempt",
        priority_preemption_threshold=(
            _or(args.priority_scheduling_preemption_threshold, DEFAULT_PREEMPTION_THRESHOLD)
            if priority
            else None
        ),
        kv_capacity_tokens=args.max_total_tokens,
    )


def dialect(args: argparse.Namespace) -> Dialect:
    mode: PriorityMode
    if not args.enable_priority_scheduling:
        mode = "off"
    elif args.schedule_low_priority_values_first:
        mode = "low_first"
    else:
        mode = "high_first"
    return Dialect(
        "sglang",
        SGLANG_VERSION,
        priority=mode,
        metrics=args.enable_metrics,
        max_queued=args.max_queued_requests,
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    return settings_for(engine_args(args), env, dialect(args))


def main(argv: Sequence[str] | None = None) -> int:
    from fleet_agent.engine.standin.server import run

    args = build_parser().parse_args(argv)  # exits 2 on an unknown or malformed flag
    return run(args.model_path, "info", lambda env: build_settings(args, env))


if __name__ == "__main__":
    sys.exit(main())
