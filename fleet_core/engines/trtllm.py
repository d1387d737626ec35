"""TensorRT-LLM's `trtllm-serve`: the command line for one replica of a deployment, and the
checks of its `engine_params` (pure: data in, data out; `TRTLLM` is its EngineSpec).

Sources read (NVIDIA/TensorRT-LLM on GitHub):

- `tensorrt_llm/commands/serve.py`, the click options of `trtllm-serve serve`, at commit
  4c05a74891e4df8066f08ed4ce14b0972abe4e25 (the 1.0/1.1 line: `--tp_size`, `--pp_size`,
  `--kv_cache_free_gpu_memory_fraction`, `--extra_llm_api_options`) and at commit
  00209af149e7774406881a37283dce303571eb11 (main, 1.2+: the same spellings survive as aliases of
  `--tensor_parallel_size`, `--pipeline_parallel_size`, `--free_gpu_memory_fraction` and
  `--config`). Only spellings that both accept are emitted, so one agent drives either.
  `trtllm-serve` is a click group whose default command is `serve`: `trtllm-serve MODEL ...`.
- `docs/source/commands/trtllm-serve/trtllm-serve.rst` (main): `/health`, `/metrics` (iteration
  statistics, "stored in an internal queue and removed once retrieved"), turned on for the
  PyTorch backend by `enable_iter_perf_stats: true` in the YAML file.
- `tensorrt_llm/serve/openai_server.py` (main, commit 00057725d9a6591f033e44f31c219e2426827bb7):
  `return_perf_metrics: true` creates the Prometheus `MetricsCollector` (`trtllm_*` families,
  tensorrt_llm/metrics/collector.py) and mounts `/prometheus/metrics`.
- `tensorrt_llm/llmapi/llm_args.py`: `enable_iter_perf_stats`, `enable_iter_req_stats`,
  `print_iter_log` (TorchLlmArgs), `return_perf_metrics`, `perf_metrics_max_requests`,
  `iter_stats_max_iterations` (BaseLlmArgs). The TensorRT backend's args have no
  `enable_iter_perf_stats` (it always collects iteration stats) and reject unknown keys.
- `update_llm_args_with_extra_dict` (llm_args.py / llm_utils.py): a YAML key REPLACES what the
  flags built (e.g. a YAML `kv_cache_config` drops the flag's free-memory fraction), so no key
  is ever given both ways here.
- Version: `trtllm-serve` (commit 4c05a748's serve.py) is a click `DefaultGroup` without a
  version option, and any first word that is not a subcommand is routed to `serve`, which has
  no --version either: `trtllm-serve --version` fails. So the agent asks the Python beside the
  `trtllm-serve` script (`<its dir>/python3`, or `python3` on PATH for a bare name) for
  importlib.metadata's version of tensorrt_llm, importing nothing of TensorRT-LLM or CUDA; any
  other command (the stand-in) is asked `--version`. 1.0 is the first release with the flags
  above (`--extra_llm_api_options` is not in 0.17/0.18's CLI), so the range is 1.0 to 1.2.
- Priority: `tensorrt_llm/serve/openai_protocol.py` (commit
  54cf7be08a3582024dfa6791e8bb8b2034bfad67): CompletionRequest and ChatCompletionRequest have
  no priority field and forbid unknown fields (`OpenAIBaseModel`, `extra="forbid"`), so a
  "priority" would be refused (400); ResponsesRequest's `service_tier` is OpenAI's billing
  tier, not a scheduling priority. `priority_fields` is therefore {} for trtllm: the router's
  waiting room is the only place its classes are ordered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from fleet_core.engines.base import (
    EngineSpec,
    Launch,
    LaunchSpec,
    check_parallel_keys,
    metadata_version_argv,
)

# engine_params key -> the trtllm-serve flag (see the module docstring for where each is read).
INT_FLAGS: dict[str, str] = {
    "tp_size": "--tp_size",
    "pp_size": "--pp_size",
    "ep_size": "--ep_size",
    "max_batch_size": "--max_batch_size",
    "max_num_tokens": "--max_num_tokens",
    "max_seq_len": "--max_seq_len",
    "max_beam_width": "--max_beam_width",
}
FLOAT_FLAGS: dict[str, str] = {
    "kv_cache_free_gpu_memory_fraction": "--kv_cache_free_gpu_memory_fraction",
}
BOOL_FLAGS: dict[str, str] = {"trust_remote_code": "--trust_remote_code"}  # is_flag options
BACKENDS = frozenset({"pytorch", "tensorrt", "trt", "_autodeploy"})  # ChoiceWithAlias in serve.py
# Flags the supervisor sets itself (never from engine_params).
HOST_FLAG, PORT_FLAG, BACKEND_FLAG = "--host", "--port", "--backend"
EXTRA_OPTIONS_FLAG = "--extra_llm_api_options"

# engine_params keys that are LlmArgs fields without a flag of their own: they go to the YAML.
YAML_KEYS = frozenset(
    {
        "kv_cache_config",  # mapping: enable_block_reuse, dtype, ...
        "enable_chunked_prefill",
        "enable_attention_dp",
        "disable_overlap_scheduler",
        "cuda_graph_config",
        "moe_config",
        "attn_backend",
        "speculative_config",
        "enable_iter_req_stats",
        "iter_stats_max_iterations",
        "perf_metrics_max_requests",
        "print_iter_log",
    }
)
# Anything else LlmArgs knows goes verbatim under this key (a mapping): an operator's escape
# hatch for options this list does not name yet. It may not touch what the flags set.
PASS_THROUGH_KEY = "llm_api_options"
# What the supervisor needs from every engine: iteration stats (/metrics) and Prometheus metrics
# (/prometheus/metrics with the request-latency histograms).
STATS_KEYS = ("enable_iter_perf_stats", "return_perf_metrics")

FLAG_KEYS = frozenset({"backend", *INT_FLAGS, *FLOAT_FLAGS, *BOOL_FLAGS})
KNOWN_KEYS = FLAG_KEYS | YAML_KEYS | {PASS_THROUGH_KEY}

# LlmArgs names the flags fill in (get_llm_args in serve.py): never set through the YAML either.
_FLAG_LLM_ARGS = frozenset(
    {
        "model",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "moe_expert_parallel_size",
        "build_config",
        "free_gpu_memory_fraction",
    }
)


def check_engine_params(params: Mapping[str, Any]) -> None:
    """ValueError naming every unknown key, or the first bad value."""
    unknown = sorted(set(params) - KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"unknown engine_params {', '.join(unknown)}: trtllm-serve flags are "
            f"{', '.join(sorted(FLAG_KEYS))}; LlmArgs options are {', '.join(sorted(YAML_KEYS))} "
            f"or a mapping under {PASS_THROUGH_KEY!r}"
        )
    backend = params.get("backend")
    # A string first: `{} in BACKENDS` is a TypeError (unhashable), not the ValueError callers
    # catch.
    if backend is not None and (not isinstance(backend, str) or backend not in BACKENDS):
        raise ValueError(f"engine_params.backend {backend!r}: expected one of {sorted(BACKENDS)}")
    for key in INT_FLAGS:
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"engine_params.{key} must be an integer, not {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"engine_params.{key} must be positive, not {value}")
    fraction = params.get("kv_cache_free_gpu_memory_fraction")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(
                f"engine_params.kv_cache_free_gpu_memory_fraction must be a number, "
                f"not {fraction!r}"
            )
        if not (0.0 < float(fraction) <= 1.0) or not math.isfinite(float(fraction)):
            raise ValueError(
                f"engine_params.kv_cache_free_gpu_memory_fraction must be in (0, 1], not {fraction}"
            )
    for key in BOOL_FLAGS:
        if key in params and not isinstance(params[key], bool):
            raise ValueError(f"engine_params.{key} must be true or false, not {params[key]!r}")
    kv = params.get("kv_cache_config")
    if kv is not None and not isinstance(kv, Mapping):
        raise ValueError("engine_params.kv_cache_config must be a mapping")
    extra = params.get(PASS_THROUGH_KEY)
    if extra is not None:
        if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
            raise ValueError(f"engine_params.{PASS_THROUGH_KEY} must be a mapping of options")
        # Flags and YAML keys are given once, by their own route: a duplicate would replace
        # what the flag built (see the module docstring).
        clash = sorted(set(extra) & (FLAG_KEYS | YAML_KEYS | _FLAG_LLM_ARGS))
        if clash:
            raise ValueError(
                f"engine_params.{PASS_THROUGH_KEY} may not set {', '.join(clash)}: "
                "give them as engine_params of their own"
            )
        off = sorted(k for k in STATS_KEYS if k in extra and extra[k] is not True)
        if off:
            raise ValueError(
                f"engine_params.{PASS_THROUGH_KEY} may not turn off {', '.join(off)}: "
                "the agent reads every engine's statistics"
            )


def _uses_torch_args(params: Mapping[str, Any]) -> bool:
    # No backend flag: trtllm-serve's default, pytorch in every release this agent supports.
    return (params.get("backend") or "pytorch") in {"pytorch", "_autodeploy"}


def extra_llm_api_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """The `--extra_llm_api_options` YAML content for a deployment's engine_params."""
    check_engine_params(params)
    options: dict[str, Any] = {}
    if _uses_torch_args(params):
        options["enable_iter_perf_stats"] = True  # else /metrics stays empty (PyTorch backend)
    options["return_perf_metrics"] = True  # mounts /prometheus/metrics with the histograms
    for key in sorted(YAML_KEYS):
        if key in params:
            options[key] = _plain(params[key])
    kv = options.get("kv_cache_config")
    fraction = params.get("kv_cache_free_gpu_memory_fraction")
    if isinstance(kv, dict) and fraction is not None:
        # The YAML kv_cache_config replaces the one the flag built: carry the fraction into it.
        given = kv.get("free_gpu_memory_fraction")
        if given is not None and float(given) != float(fraction):
            raise ValueError(
                "engine_params.kv_cache_config.free_gpu_memory_fraction "
                f"({given}) disagrees with kv_cache_free_gpu_memory_fraction ({fraction})"
            )
        kv["free_gpu_memory_fraction"] = float(fraction)
    for key, value in (params.get(PASS_THROUGH_KEY) or {}).items():
        options[key] = _plain(value)
    return options


def trtllm_serve_argv(
    engine_command: Sequence[str],
    model_path: str,
    params: Mapping[str, Any],
    host: str,
    port: int,
    extra_options_path: str,
) -> list[str]:
    """The argv of one replica's engine.

    `<engine command> <model> --host H --port P [--backend B] [--tp_size T] [--pp_size P] ...
    --extra_llm_api_options FILE`: only the engine_params that are present become flags
    (trtllm-serve's own defaults apply to the rest); LlmArgs-only options live in the YAML file
    (extra_llm_api_options()).
    """
    if not engine_command:
        raise ValueError("engine_command is empty")
    if not model_path:
        raise ValueError("model_path is empty")
    check_engine_params(params)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    argv = [*engine_command, model_path, HOST_FLAG, host, PORT_FLAG, str(port)]
    if params.get("backend") is not None:  # null: trtllm-serve's default, as when absent
        argv += [BACKEND_FLAG, str(params["backend"])]
    for key, flag in INT_FLAGS.items():
        if params.get(key) is not None:
            argv += [flag, str(int(params[key]))]
    for key, flag in FLOAT_FLAGS.items():
        if params.get(key) is not None:
            argv += [flag, repr(float(params[key]))]
    for key, flag in BOOL_FLAGS.items():
        if params.get(key) is True:
            argv.append(flag)
    argv += [EXTRA_OPTIONS_FLAG, extra_options_path]
    return argv


def _plain(value: Any) -> Any:
    """A deep copy made of plain dicts and lists (the YAML dumper's safe types)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


EXTRA_OPTIONS_FILE = "extra-llm-api-options.yaml"
DISTRIBUTION = "tensorrt_llm"


class TrtllmEngine(EngineSpec):
    name = "trtllm"
    program = "trtllm-serve"
    default_command = ("trtllm-serve",)
    supported_versions = ">=1.0,<1.3"
    parallel_keys = ("tp_size", "pp_size")
    batch_key = "max_batch_size"

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_parallel_keys(self, params)
        check_engine_params(params)

    def launch(self, spec: LaunchSpec) -> Launch:
        options = f"{spec.config_dir.rstrip('/')}/{EXTRA_OPTIONS_FILE}"
        argv = trtllm_serve_argv(
            spec.command, spec.model_path, spec.params, spec.host, spec.port, options
        )
        text = yaml.safe_dump(extra_llm_api_options(spec.params), sort_keys=True)
        return Launch(argv, {EXTRA_OPTIONS_FILE: text})

    def version_argv(self, command: Sequence[str]) -> list[str]:
        program = command[-1] if command else ""
        if program.rsplit("/", 1)[-1] != "trtllm-serve":
            return [*command, "--version"]
        # The console script's own interpreter is the python beside it (a venv's bin/).
        python = program.rsplit("/", 1)[0] + "/python3" if "/" in program else "python3"
        return metadata_version_argv([*command[:-1], python], DISTRIBUTION)

    def params_schema(self) -> dict[str, Any]:
        return params_schema()


def params_schema() -> dict[str, Any]:
    """The JSON schema of what `check_engine_params` accepts, from the tables above."""
    positive: dict[str, Any] = {"type": ["integer", "null"], "minimum": 1}
    properties: dict[str, Any] = {key: positive for key in INT_FLAGS}
    # Never null: gpus_per_replica must equal tp_size × pp_size (absent: 1).
    properties |= {key: {"type": "integer", "minimum": 1} for key in ("tp_size", "pp_size")}
    properties["kv_cache_free_gpu_memory_fraction"] = {
        "type": ["number", "null"],
        "exclusiveMinimum": 0,
        "maximum": 1,
    }
    properties |= {key: {"type": "boolean"} for key in BOOL_FLAGS}
    properties["backend"] = {"enum": [*sorted(BACKENDS), None]}
    properties |= {key: {} for key in YAML_KEYS}
    properties["kv_cache_config"] = {"type": ["object", "null"]}
    properties[PASS_THROUGH_KEY] = {
        "type": ["object", "null"],
        "description": "other LlmArgs options: none of the keys above, and "
        f"{' and '.join(STATS_KEYS)} stay true",
    }
    return {"type": "object", "properties": properties, "additionalProperties": False}


TRTLLM = TrtllmEngine()
