"""vLLM's OpenAI-compatible server, `vllm serve MODEL ...` (pure; `VLLM` is its EngineSpec).

FIRST CUT, to be checked against vLLM's own `vllm/engine/arg_utils.py` (EngineArgs.add_cli_args)
and `vllm/entrypoints/openai/cli_args.py` of the supported releases: see docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleet_core.engines.base import (
    EngineSpec,
    Launch,
    LaunchSpec,
    Priority,
    check_known,
)
from fleet_core.engines.flags import FlagTable

FLAGS = FlagTable(
    ints={
        "tensor_parallel_size": "--tensor-parallel-size",
        "pipeline_parallel_size": "--pipeline-parallel-size",
        "max_num_seqs": "--max-num-seqs",
        "max_num_batched_tokens": "--max-num-batched-tokens",
        "max_model_len": "--max-model-len",
        "block_size": "--block-size",
        "seed": "--seed",
    },
    fractions={"gpu_memory_utilization": "--gpu-memory-utilization"},
    bools={
        "enable_chunked_prefill": "--enable-chunked-prefill",
        "enforce_eager": "--enforce-eager",
        "trust_remote_code": "--trust-remote-code",
    },
    choices={
        "dtype": ("--dtype", ("auto", "half", "float16", "bfloat16", "float", "float32")),
        "kv_cache_dtype": ("--kv-cache-dtype", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
        "scheduling_policy": ("--scheduling-policy", ("fcfs", "priority")),
    },
    strings={"quantization": "--quantization"},
)
# Prefix caching is on by default in vLLM's V1 engine; `false` turns it off.
PREFIX_CACHING = "enable_prefix_caching"
KNOWN = FLAGS.keys | {PREFIX_CACHING}
# The router's classes as vLLM's `priority` request field: lower runs first (priority policy).
PRIORITY_VALUES: dict[str, int] = {"interactive": 0, "batch": 10}


class VllmEngine(EngineSpec):
    name = "vllm"
    program = "vllm serve"
    default_command = ("vllm",)
    supported_versions = ">=0.10,<0.12"
    parallel_keys = ("tensor_parallel_size", "pipeline_parallel_size")

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_known(self, params, KNOWN)
        FLAGS.check(params)
        if PREFIX_CACHING in params and not isinstance(params[PREFIX_CACHING], bool):
            raise ValueError(f"engine_params.{PREFIX_CACHING} must be true or false")

    def max_batch_size(self, params: Mapping[str, Any]) -> int | None:
        value = params.get("max_num_seqs")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def launch(self, spec: LaunchSpec) -> Launch:
        self.check_params(spec.params)
        params = dict(spec.params)
        # The router's class reaches the engine (priority_fields) only under this policy.
        params.setdefault("scheduling_policy", "priority")
        argv = [*spec.command, "serve", spec.model_path, "--host", spec.host]
        argv += ["--port", str(spec.port)]
        if spec.served_names:
            argv += ["--served-model-name", *spec.served_names]
        argv += FLAGS.argv(params)
        if params.get(PREFIX_CACHING) is False:
            argv.append("--no-enable-prefix-caching")
        return Launch(argv)

    def version_argv(self, command: Sequence[str]) -> list[str]:
        return [*command, "--version"]

    def priority_fields(self, priority: Priority) -> dict[str, Any]:
        return {"priority": PRIORITY_VALUES[priority]}

    def params_schema(self) -> dict[str, Any]:
        schema = FLAGS.schema(frozenset({"tensor_parallel_size", "pipeline_parallel_size"}))
        schema["properties"][PREFIX_CACHING] = {"type": "boolean"}
        return schema


VLLM = VllmEngine()
