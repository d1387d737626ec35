"""The trtllm-serve command line, pinned against the flags trtllm-serve documents.

Flag lists copied from the click options of `trtllm-serve serve` in NVIDIA/TensorRT-LLM
`tensorrt_llm/commands/serve.py`, at two commits read for this test (spellings only; aliases
listed as separate entries):

- 4c05a74891e4df8066f08ed4ce14b0972abe4e25 (the 1.0/1.1 release line);
- 00209af149e7774406881a37283dce303571eb11 (main, 1.2+, where `--tp_size` and friends became
  aliases of `--tensor_parallel_size` ... and `--config` an alias of `--extra_llm_api_options`).

Every flag the agent emits must be in BOTH lists, so one agent drives either release line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from fleet_core.engines.layout import (
    cuda_visible_devices,
    model_path,
    replica_layout,
    replica_ports,
)
from fleet_core.engines.trtllm import (
    FLAG_KEYS,
    YAML_KEYS,
    check_engine_params,
    extra_llm_api_options,
    trtllm_serve_argv,
)

SERVE_FLAGS_4C05A74 = frozenset(
    {
        "--tokenizer",
        "--host",
        "--port",
        "--backend",
        "--log_level",
        "--max_beam_width",
        "--max_batch_size",
        "--max_num_tokens",
        "--max_seq_len",
        "--tp_size",
        "--pp_size",
        "--ep_size",
        "--cluster_size",
        "--gpus_per_node",
        "--kv_cache_free_gpu_memory_fraction",
        "--num_postprocess_workers",
        "--trust_remote_code",
        "--extra_llm_api_options",
        "--reasoning_parser",
        "--metadata_server_config_file",
        "--server_role",
        "--fail_fast_on_attention_window_too_large",
        "--disagg_cluster_uri",
        "--enable_chunked_prefill",
        "--media_io_kwargs",
    }
)
SERVE_FLAGS_00209AF = frozenset(
    {
        "--tokenizer",
        "--custom_tokenizer",
        "--host",
        "--port",
        "--backend",
        "--custom_module_dirs",
        "--log_level",
        "--max_beam_width",
        "--max_batch_size",
        "--max_num_tokens",
        "--max_seq_len",
        "--tensor_parallel_size",
        "--tp_size",
        "--pipeline_parallel_size",
        "--pp_size",
        "--context_parallel_size",
        "--cp_size",
        "--moe_expert_parallel_size",
        "--ep_size",
        "--moe_cluster_parallel_size",
        "--cluster_size",
        "--gpus_per_node",
        "--free_gpu_memory_fraction",
        "--kv_cache_free_gpu_memory_fraction",
        "--num_postprocess_workers",
        "--trust_remote_code",
        "--revision",
        "--config",
        "--extra_llm_api_options",
        "--reasoning_parser",
        "--tool_parser",
        "--metadata_server_config_file",
        "--server_role",
        "--fail_fast_on_attention_window_too_large",
        "--otlp_traces_endpoint",
        "--disagg_cluster_uri",
        "--enable_chunked_prefill",
        "--media_io_kwargs",
        "--chat_template",
    }
)
DOCUMENTED = SERVE_FLAGS_4C05A74 & SERVE_FLAGS_00209AF
IS_FLAG = {"--trust_remote_code"}  # click is_flag options: no value follows

PARAMS: dict[str, Any] = {
    "backend": "pytorch",
    "tp_size": 2,
    "pp_size": 1,
    "max_batch_size": 256,
    "max_num_tokens": 8192,
    "kv_cache_free_gpu_memory_fraction": 0.9,
}
EVERY_FLAG_PARAM: dict[str, Any] = {
    **PARAMS,
    "ep_size": 2,
    "max_seq_len": 4096,
    "max_beam_width": 1,
    "trust_remote_code": True,
}


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_exact_argv_for_one_deployment() -> None:
    argv = trtllm_serve_argv(
        ("trtllm-serve",),
        "/srv/models/llama-8b/llama-3.1-8b",
        PARAMS,
        "127.0.0.1",
        8101,
        "/var/lib/fleet/engines/llama-8b/extra-llm-api-options.yaml",
    )
    assert argv == [
        "trtllm-serve",
        "/srv/models/llama-8b/llama-3.1-8b",
        "--host",
        "127.0.0.1",
        "--port",
        "8101",
        "--backend",
        "pytorch",
        "--tp_size",
        "2",
        "--pp_size",
        "1",
        "--max_batch_size",
        "256",
        "--max_num_tokens",
        "8192",
        "--kv_cache_free_gpu_memory_fraction",
        "0.9",
        "--extra_llm_api_options",
        "/var/lib/fleet/engines/llama-8b/extra-llm-api-options.yaml",
    ]


def test_every_emitted_flag_is_documented_by_both_release_lines() -> None:
    argv = trtllm_serve_argv(("trtllm-serve",), "m", EVERY_FLAG_PARAM, "::1", 9000, "x.yaml")
    flags = _flags(argv)
    assert set(flags) <= DOCUMENTED, sorted(set(flags) - DOCUMENTED)
    assert len(flags) == len(set(flags))  # each flag once
    for i, arg in enumerate(argv):  # every valued flag has its value
        if arg.startswith("--") and arg not in IS_FLAG:
            assert not argv[i + 1].startswith("--"), arg
    # Every flag key the module knows about is emitted by this deployment: none escaped the check.
    assert len(flags) == len(FLAG_KEYS) + 3  # + --host, --port, --extra_llm_api_options


def test_engine_command_prefix_and_absent_params() -> None:
    argv = trtllm_serve_argv(
        ("/usr/bin/python3", "-m", "fleet_agent.engine.standin"),
        "m",
        {},
        "127.0.0.1",
        8100,
        "o.yaml",
    )
    assert argv == [
        "/usr/bin/python3",
        "-m",
        "fleet_agent.engine.standin",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--extra_llm_api_options",
        "o.yaml",
    ]
    assert "--trust_remote_code" not in trtllm_serve_argv(
        ("t",), "m", {"trust_remote_code": False}, "h", 1, "o"
    )


def test_unknown_params_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown engine_params bogus, tensor_parallel") as err:
        trtllm_serve_argv(("t",), "m", {"tensor_parallel": 2, "bogus": 1}, "h", 1, "o")
    assert "tp_size" in str(err.value)  # says what is accepted
    with pytest.raises(ValueError, match="unknown engine_params bogus"):
        extra_llm_api_options({"bogus": 1})


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"tp_size": "2"}, "tp_size must be an integer"),
        ({"tp_size": True}, "tp_size must be an integer"),
        ({"max_batch_size": 0}, "max_batch_size must be positive"),
        ({"kv_cache_free_gpu_memory_fraction": 1.5}, r"must be in \(0, 1\]"),
        ({"kv_cache_free_gpu_memory_fraction": "0.9"}, "must be a number"),
        ({"backend": "vllm"}, "backend 'vllm'"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be true or false"),
        ({"kv_cache_config": [1]}, "kv_cache_config must be a mapping"),
        ({"llm_api_options": {"max_batch_size": 8}}, "may not set max_batch_size"),
        ({"llm_api_options": {"tensor_parallel_size": 8}}, "may not set tensor_parallel_size"),
        ({"llm_api_options": {"kv_cache_config": {}}}, "may not set kv_cache_config"),
        ({"llm_api_options": {"return_perf_metrics": False}}, "may not turn off return_perf"),
        ({"llm_api_options": ["x"]}, "must be a mapping"),
    ],
)
def test_bad_values_are_rejected(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trtllm_serve_argv(("t",), "m", params, "h", 1, "o")


@pytest.mark.parametrize("backend", [{}, [], ["pytorch"], 3])
def test_a_backend_that_is_no_string_is_a_value_error(backend: Any) -> None:
    """Not a TypeError from `{} in BACKENDS`: callers turn ValueError into a 4xx."""
    with pytest.raises(ValueError, match=r"engine_params\.backend .*: expected one of"):
        check_engine_params({"backend": backend})


def test_argument_checks() -> None:
    with pytest.raises(ValueError, match="engine_command is empty"):
        trtllm_serve_argv((), "m", {}, "h", 1, "o")
    with pytest.raises(ValueError, match="port 70000"):
        trtllm_serve_argv(("t",), "m", {}, "h", 70000, "o")


def test_extra_options_turn_on_iteration_stats_and_prometheus() -> None:
    assert extra_llm_api_options(PARAMS) == {
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
    }
    assert extra_llm_api_options({}) == {
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
    }
    # The TensorRT backend always collects iteration stats and its args reject the key.
    assert extra_llm_api_options({"backend": "tensorrt"}) == {"return_perf_metrics": True}


def test_extra_options_pass_through_and_yaml_round_trip() -> None:
    params = {
        **PARAMS,
        "kv_cache_config": {"enable_block_reuse": True},
        "enable_attention_dp": True,
        "iter_stats_max_iterations": 2000,
        "llm_api_options": {"stream_interval": 4, "guided_decoding_backend": "xgrammar"},
    }
    options = extra_llm_api_options(params)
    assert options == {
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
        # The YAML kv_cache_config replaces the flag's: the fraction is carried into it.
        "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.9},
        "enable_attention_dp": True,
        "iter_stats_max_iterations": 2000,
        "stream_interval": 4,
        "guided_decoding_backend": "xgrammar",
    }
    assert yaml.safe_load(yaml.safe_dump(options)) == options
    assert params["kv_cache_config"] == {"enable_block_reuse": True}  # input left alone
    # Every YAML key is accepted and none doubles as a flag.
    assert not (YAML_KEYS & FLAG_KEYS)
    with pytest.raises(ValueError, match="disagrees"):
        extra_llm_api_options(
            {
                "kv_cache_free_gpu_memory_fraction": 0.9,
                "kv_cache_config": {"free_gpu_memory_fraction": 0.5},
            }
        )


def test_replica_layout() -> None:
    assert replica_layout(range(8), 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert replica_layout(range(8), 3) == [(0, 1, 2), (3, 4, 5)]  # GPUs 6 and 7 stay idle
    assert replica_layout(range(8), 8) == [tuple(range(8))]
    assert replica_layout([3, 1, 2, 0], 2) == [(0, 1), (2, 3)]  # sorted first
    assert replica_layout([0, 2, 3, 5], 2) == [(0, 2), (3, 5)]  # a lost GPU: consecutive indexes
    # Too few GPUs is an error, not an empty layout (that would read as "all replicas ready").
    with pytest.raises(ValueError, match=r"1 GPU\(s\) cannot hold one replica of 2 GPUs"):
        replica_layout([0], 2)
    with pytest.raises(ValueError, match="cannot hold"):
        replica_layout([], 1)
    with pytest.raises(ValueError, match="repeat"):
        replica_layout([0, 0], 1)
    with pytest.raises(ValueError, match="positive"):
        replica_layout(range(8), 0)


@given(gpus=st.sets(st.integers(0, 63), max_size=64), per=st.integers(1, 8))
def test_replica_layout_properties(gpus: set[int], per: int) -> None:
    if len(gpus) < per:
        with pytest.raises(ValueError):
            replica_layout(list(gpus), per)
        return
    layout = replica_layout(list(gpus), per)
    assert len(layout) == len(gpus) // per
    used = [g for group in layout for g in group]
    assert len(set(used)) == len(used) and set(used) <= gpus
    assert all(len(group) == per for group in layout)
    assert used == sorted(gpus)[: len(used)]


def test_ports_and_pinning() -> None:
    assert replica_ports(8100, 4) == [8100, 8101, 8102, 8103]
    assert replica_ports(8100, 0) == []
    with pytest.raises(ValueError, match="out of range"):
        replica_ports(65535, 2)
    assert cuda_visible_devices((2, 3)) == "2,3"
    assert cuda_visible_devices((7,)) == "7"


def test_model_path() -> None:
    root = Path("/srv/models")
    assert model_path(root, "llama-8b", "s3://bucket/llama-3.1-8b") == Path(
        "/srv/models/llama-8b/llama-3.1-8b"
    )
    assert model_path(root, "llama-8b", "s3://bucket/org/llama-3.1-8b/") == Path(
        "/srv/models/llama-8b/llama-3.1-8b"
    )
    assert model_path(root, "q", "hf://Qwen/Qwen2.5-7B") == Path("/srv/models/q/Qwen2.5-7B")
    assert model_path(root, "q", "s3://bucket") == Path("/srv/models/q/bucket")
    assert model_path(root, "q", "/data/weights/qwen") == Path("/srv/models/q/qwen")
    with pytest.raises(ValueError, match="cannot name a directory"):
        model_path(root, "q", "s3://bucket/..")
    with pytest.raises(ValueError, match="deployment"):
        model_path(root, "../etc", "s3://bucket/m")
