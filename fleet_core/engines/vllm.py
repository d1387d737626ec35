"""vLLM's OpenAI-compatible server, `vllm serve MODEL ...` (pure; `VLLM` is its EngineSpec).

Sources read (the released wheels from PyPI, and vllm-project/vllm on GitHub):

- vllm 0.11.0 and 0.34.0 wheels: `vllm/engine/arg_utils.py` (EngineArgs.add_cli_args: the
  engine's flags, each bool field an argparse BooleanOptionalAction, `--x` and `--no-x`),
  `vllm/config/{model,cache,scheduler}.py` (the Literal choices: ModelDType, CacheDType,
  SchedulerPolicy), the frontend's flags (`FrontendArgs` in
  `vllm/entrypoints/openai/cli_args.py` in 0.11, `vllm/entrypoints/common/cli_args.py` in
  0.34; `--host`, `--port`) and `vllm/entrypoints/cli/main.py` (`-v/--version`, argparse's
  version action printing importlib.metadata's version of vllm). The same files at GitHub
  commit 99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b (0.11.x) agree. Every flag emitted here is
  in both releases' lists (tests/fixtures/engines/cli/vllm_flags.txt is 0.34.0's, with
  SOURCES.md), and each choice list is the choices both accept.
- Served names: `--served-model-name` takes several (nargs "+"); the first is the name vLLM
  reports. A request whose "model" is none of them (nor a loaded LoRA adapter) is refused
  with 404 NotFoundError "The model `x` does not exist." (`_check_model`,
  `vllm/entrypoints/openai/serving_engine.py` in 0.11, `vllm/entrypoints/serve/engine/
  serving.py` in 0.34); an absent or empty "model" is accepted. So every name the router may
  forward is given.
- Priority: the request field `priority` (int, default 0, "lower means earlier handling"),
  in the completion and chat protocols of both releases; "any priority other than 0 will
  raise an error if the served model does not use priority scheduling" (`--scheduling-policy
  priority`; the default is fcfs). The priority policy orders by (priority, arrival), so
  requests of one class keep their FCFS order, and preempts the lowest-priority running
  request when KV runs out. The agent therefore always passes `--scheduling-policy priority`
  unless the deployment's engine_params say `scheduling_policy: fcfs`, and then
  `priority_fields(..., params)` sends no priority (batch's 10 would be refused).
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
    check_parallel_keys,
)
from fleet_core.engines.flags import FlagTable

FLAGS = FlagTable(
    ints={
        "tensor_parallel_size": "--tensor-parallel-size",
        "pipeline_parallel_size": "--pipeline-parallel-size",
        "max_num_seqs": "--max-num-seqs",
        "max_num_batched_tokens": "--max-num-batched-tokens",
        "max_model_len": "--max-model-len",
        "seed": "--seed",
    },
    int_minimums={"seed": 0},
    fractions={"gpu_memory_utilization": "--gpu-memory-utilization"},
    bools={"trust_remote_code": "--trust-remote-code"},
    # BooleanOptionalAction: true -> --x, false -> --no-x (prefix caching and chunked prefill
    # are on by default in the V1 engine; false turns them off).
    toggles={
        "enable_prefix_caching": "--enable-prefix-caching",
        "enable_chunked_prefill": "--enable-chunked-prefill",
        "enforce_eager": "--enforce-eager",
        "async_scheduling": "--async-scheduling",
    },
    choices={
        "dtype": ("--dtype", ("auto", "half", "float16", "bfloat16", "float", "float32")),
        "kv_cache_dtype": (
            "--kv-cache-dtype",
            ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
        ),
        "scheduling_policy": ("--scheduling-policy", ("fcfs", "priority")),
    },
    strings={"quantization": "--quantization"},
)
KNOWN = FLAGS.keys
# What the agent passes itself (never from engine_params).
AGENT_FLAGS = ("--host", "--port", "--served-model-name")
POLICY_KEY = "scheduling_policy"
# The router's classes as vLLM's `priority` request field: lower runs first (priority policy).
PRIORITY_VALUES: dict[str, int] = {"interactive": 0, "batch": 10}


class VllmEngine(EngineSpec):
    name = "vllm"
    program = "vllm serve"
    default_command = ("vllm",)
    # Verified: 0.11.0 and 0.34.0 (see the module docstring); the gpu-vllm extra pins the same.
    supported_versions = ">=0.11,<0.35"
    parallel_keys = ("tensor_parallel_size", "pipeline_parallel_size")
    batch_key = "max_num_seqs"

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_known(self, params, KNOWN)
        check_parallel_keys(self, params)
        FLAGS.check(params)

    def launch(self, spec: LaunchSpec) -> Launch:
        """`vllm serve MODEL --host H --port P [--served-model-name N...] --scheduling-policy
        priority [flags of engine_params]`."""
        self.check_params(spec.params)
        check_served_names(spec.served_names)
        params = dict(spec.params)
        # The router's class reaches the engine (priority_fields) only under this policy.
        if params.get(POLICY_KEY) is None:  # absent or null: priority (not vLLM's fcfs)
            params[POLICY_KEY] = "priority"
        argv = [*spec.command, "serve", spec.model_path, "--host", spec.host]
        argv += ["--port", str(spec.port)]
        if spec.served_names:
            argv += ["--served-model-name", *spec.served_names]
        argv += FLAGS.argv(params)
        return Launch(argv)

    def version_argv(self, command: Sequence[str]) -> list[str]:
        # `vllm --version` prints importlib.metadata.version("vllm") (argparse's version action).
        return [*command, "--version"]

    def priority_fields(
        self, priority: Priority, params: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        if params is not None and params.get(POLICY_KEY) == "fcfs":
            return {}  # vLLM refuses any priority but 0 under fcfs
        return {"priority": PRIORITY_VALUES[priority]}

    def params_schema(self) -> dict[str, Any]:
        return FLAGS.schema(frozenset({"tensor_parallel_size", "pipeline_parallel_size"}))


def check_served_names(names: Sequence[str]) -> None:
    """A served name is one argv word that argparse will not read as a flag."""
    for name in names:
        if not name or name.startswith("-"):
            raise ValueError(f"served model name {name!r} must be non-empty, not start with '-'")


VLLM = VllmEngine()
