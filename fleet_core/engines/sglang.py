"""SGLang's server, `python -m sglang.launch_server --model-path MODEL ...` (pure; `SGLANG` is
its EngineSpec).

Sources read (the released wheels from PyPI, and sgl-project/sglang on GitHub):

- sglang 0.5.3, 0.5.4, 0.5.10 and 0.5.23 wheels: the server's flags, `ServerArgs.add_cli_args`
  in `sglang/srt/server_args.py` (explicit `add_argument` calls up to 0.5.10; in 0.5.23 most
  come from the annotated fields of `sglang/srt/arg_groups/fields/*.py`, `--<field-name>` plus
  `Arg(aliases=...)`, bools store_true). Every flag emitted here is in each release's list
  (tests/fixtures/engines/cli/sglang_flags.txt is 0.5.23's, sglang_flags_0.5.3.txt 0.5.3's,
  with SOURCES.md), and each choice list is the choices all of them accept. 0.5.1 lacks the
  priority flags, hence the lower bound.
- Version: `sglang/launch_server.py` has no --version (it parses ServerArgs only);
  `sglang/version.py` reads importlib.metadata's version of sglang. So the agent asks the
  interpreter of the command (`python3 -c "...importlib.metadata..."`), importing nothing of
  SGLang or CUDA; any other command (the stand-in) is asked `--version`.
- Served names: `--served-model-name` takes ONE name (type str) and only /v1/models and
  /v1/models/{model} (404 for another name) use it. Generation requests do not check "model"
  (`sglang/srt/entrypoints/openai/serving_base.py`): 0.5.3 ignores it; 0.5.23 reads
  "base:adapter" as a LoRA adapter unless it equals the served name. So the first served
  name is passed, and other names reach the replica unchanged (an alias with a ':' would be
  taken for an adapter).
- Priority: the request field `priority` (Optional[int], `sglang/srt/entrypoints/openai/
  protocol.py`), honoured under `--enable-priority-scheduling`, where HIGHER values run first
  unless `--schedule-low-priority-values-first`; a request without one goes last
  (`_set_or_validate_priority`, `sglang/srt/managers/scheduler.py`), and an incoming request
  preempts running ones whose priority differs by at least
  `--priority-scheduling-preemption-threshold` (default 10). With the flag off, a request
  carrying a priority is aborted (503) in 0.5.3, and in later releases when
  `--abort-on-priority-when-disabled`. The agent passes both flags so that SGLang orders as
  vLLM does (lower first: interactive 0, batch 10); `enable_priority_scheduling: false` in
  engine_params drops them, and then `priority_fields(..., params)` sends no priority.
- `--enable-metrics` turns on /metrics (`sglang:*` families); the agent always passes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleet_core.engines.base import (
    EngineSpec,
    Launch,
    LaunchSpec,
    Priority,
    check_bool,
    check_known,
    check_parallel_keys,
    metadata_version_argv,
)
from fleet_core.engines.flags import FlagTable
from fleet_core.engines.vllm import check_served_names

FLAGS = FlagTable(
    ints={
        "tp_size": "--tp-size",
        "pp_size": "--pp-size",
        "max_running_requests": "--max-running-requests",
        "max_queued_requests": "--max-queued-requests",
        "max_total_tokens": "--max-total-tokens",
        "chunked_prefill_size": "--chunked-prefill-size",
        "max_prefill_tokens": "--max-prefill-tokens",
        "context_length": "--context-length",
        "random_seed": "--random-seed",
        "priority_scheduling_preemption_threshold": "--priority-scheduling-preemption-threshold",
    },
    int_minimums={"random_seed": 0, "priority_scheduling_preemption_threshold": 0},
    fractions={"mem_fraction_static": "--mem-fraction-static"},
    bools={
        "disable_radix_cache": "--disable-radix-cache",
        "trust_remote_code": "--trust-remote-code",
    },
    choices={
        "dtype": ("--dtype", ("auto", "half", "float16", "bfloat16", "float", "float32")),
        "kv_cache_dtype": ("--kv-cache-dtype", ("auto", "fp8_e5m2", "fp8_e4m3")),
        "schedule_policy": (
            "--schedule-policy",
            ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority"),
        ),
    },
    strings={"quantization": "--quantization"},
)
# Priority scheduling is the agent's (on unless this key says false).
PRIORITY_KEY = "enable_priority_scheduling"
PRIORITY_FLAGS = ("--enable-priority-scheduling", "--schedule-low-priority-values-first")
KNOWN = FLAGS.keys | {PRIORITY_KEY}
# What the agent passes itself (never from engine_params).
AGENT_FLAGS = ("--model-path", "--host", "--port", "--served-model-name", "--enable-metrics")
MODULE = "sglang.launch_server"
DISTRIBUTION = "sglang"
# The router's classes as SGLang's `priority` field, lower first (as vLLM's).
PRIORITY_VALUES: dict[str, int] = {"interactive": 0, "batch": 10}


class SglangEngine(EngineSpec):
    name = "sglang"
    program = "sglang.launch_server"
    default_command = ("python3", "-m", MODULE)
    # Verified: 0.5.3, 0.5.4, 0.5.10, 0.5.23 (see the module docstring); gpu-sglang pins the same.
    supported_versions = ">=0.5.3,<0.6"
    parallel_keys = ("tp_size", "pp_size")
    batch_key = "max_running_requests"

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_known(self, params, KNOWN)
        check_parallel_keys(self, params)
        FLAGS.check(params)
        check_bool(params, PRIORITY_KEY)

    def launch(self, spec: LaunchSpec) -> Launch:
        """`<command> --model-path MODEL --host H --port P --enable-metrics
        [--served-model-name N] --enable-priority-scheduling
        --schedule-low-priority-values-first [flags of engine_params]`."""
        self.check_params(spec.params)
        check_served_names(spec.served_names)
        argv = [*spec.command, "--model-path", spec.model_path, "--host", spec.host]
        argv += ["--port", str(spec.port), "--enable-metrics"]
        if spec.served_names:
            argv += ["--served-model-name", spec.served_names[0]]
        if _priority_on(spec.params):
            argv += PRIORITY_FLAGS
        argv += FLAGS.argv(spec.params)
        return Launch(argv)

    def version_argv(self, command: Sequence[str]) -> list[str]:
        if len(command) >= 3 and tuple(command[-2:]) == ("-m", MODULE):
            return metadata_version_argv(command[:-2], DISTRIBUTION)
        return [*command, "--version"]

    def priority_fields(
        self, priority: Priority, params: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        if params is not None and not _priority_on(params):
            return {}  # a priority sent to a server without priority scheduling may be aborted
        return {"priority": PRIORITY_VALUES[priority]}

    def params_schema(self) -> dict[str, Any]:
        schema = FLAGS.schema(frozenset({"tp_size", "pp_size"}))
        schema["properties"][PRIORITY_KEY] = {"type": "boolean"}
        return schema


def _priority_on(params: Mapping[str, Any]) -> bool:
    return params.get(PRIORITY_KEY, True) is not False


SGLANG = SglangEngine()
