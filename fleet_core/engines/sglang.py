"""SGLang's server, `python -m sglang.launch_server --model-path MODEL ...` (pure; `SGLANG` is
its EngineSpec).

FIRST CUT, to be checked against SGLang's `python/sglang/srt/server_args.py` (ServerArgs.
add_cli_args) of the supported releases: see docs/engine.md.
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
        "tp_size": "--tp-size",
        "pp_size": "--pp-size",
        "max_running_requests": "--max-running-requests",
        "max_total_tokens": "--max-total-tokens",
        "chunked_prefill_size": "--chunked-prefill-size",
        "max_prefill_tokens": "--max-prefill-tokens",
        "context_length": "--context-length",
        "random_seed": "--random-seed",
    },
    fractions={"mem_fraction_static": "--mem-fraction-static"},
    bools={
        "disable_radix_cache": "--disable-radix-cache",
        "trust_remote_code": "--trust-remote-code",
    },
    choices={
        "dtype": ("--dtype", ("auto", "half", "float16", "bfloat16", "float", "float32")),
        "kv_cache_dtype": ("--kv-cache-dtype", ("auto", "fp8_e5m2", "fp8_e4m3")),
        "schedule_policy": ("--schedule-policy", ("lpm", "random", "fcfs", "dfs-weight")),
    },
    strings={"quantization": "--quantization"},
)
KNOWN = FLAGS.keys
# The router's classes as SGLang's `priority` request field (with --enable-priority-scheduling).
PRIORITY_VALUES: dict[str, int] = {"interactive": 0, "batch": 10}


class SglangEngine(EngineSpec):
    name = "sglang"
    program = "sglang.launch_server"
    default_command = ("python3", "-m", "sglang.launch_server")
    supported_versions = ">=0.5,<0.6"
    parallel_keys = ("tp_size", "pp_size")

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_known(self, params, KNOWN)
        FLAGS.check(params)

    def max_batch_size(self, params: Mapping[str, Any]) -> int | None:
        value = params.get("max_running_requests")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def launch(self, spec: LaunchSpec) -> Launch:
        self.check_params(spec.params)
        argv = [*spec.command, "--model-path", spec.model_path, "--host", spec.host]
        argv += ["--port", str(spec.port), "--enable-metrics", "--enable-priority-scheduling"]
        if spec.served_names:
            argv += ["--served-model-name", spec.served_names[0]]
        argv += FLAGS.argv(spec.params)
        return Launch(argv)

    def version_argv(self, command: Sequence[str]) -> list[str]:
        return [*command, "--version"]

    def priority_fields(self, priority: Priority) -> dict[str, Any]:
        return {"priority": PRIORITY_VALUES[priority]}

    def params_schema(self) -> dict[str, Any]:
        return FLAGS.schema(frozenset({"tp_size", "pp_size"}))


SGLANG = SglangEngine()
