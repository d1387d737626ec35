"""The stand-in's command lines per dialect: each takes exactly what the agent's EngineSpec
launch() emits (fleet_core/engines), refuses other flags with exit status 2, and claims a
version the spec supports; and each dialect's error bodies."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import FIXTURES

from fleet_agent.engine.standin import settings as trtllm_cli
from fleet_agent.engine.standin import sglang as sglang_cli
from fleet_agent.engine.standin import vllm as vllm_cli
from fleet_agent.engine.standin.dialect import Dialect
from fleet_agent.engine.standin.dialect_metrics import SglangMetrics, VllmMetrics
from fleet_agent.engine.standin.settings import Settings
from fleet_core.engines import ENGINES, LaunchSpec, spec

METRICS = FIXTURES / "engines" / "metrics"
ENV = {"FLEET_STANDIN_GPU": "H100", "CUDA_VISIBLE_DEVICES": "0,1"}
Builder = Callable[[argparse.Namespace, Mapping[str, str]], Settings]
CLIS: dict[str, tuple[tuple[str, ...], Callable[[], argparse.ArgumentParser], Builder]] = {
    "trtllm": (
        ("python", "-m", "fleet_agent.engine.standin"),
        trtllm_cli.build_parser,
        trtllm_cli.build_settings,
    ),
    "vllm": (
        ("python", "-m", "fleet_agent.engine.standin.vllm"),
        vllm_cli.build_parser,
        vllm_cli.build_settings,
    ),
    "sglang": (
        ("python", "-m", "fleet_agent.engine.standin.sglang"),
        sglang_cli.build_parser,
        sglang_cli.build_settings,
    ),
}
PARAMS: dict[str, dict[str, Any]] = {
    "trtllm": {"tp_size": 2, "max_batch_size": 32, "max_num_tokens": 4096},
    "vllm": {
        "tensor_parallel_size": 2,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 4096,
        "max_model_len": 8192,
        "seed": 7,
        "gpu_memory_utilization": 0.85,
        "enable_chunked_prefill": False,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "quantization": "fp8",
        "enable_prefix_caching": False,
    },
    "sglang": {
        "tp_size": 2,
        "max_running_requests": 32,
        "chunked_prefill_size": 4096,
        "max_total_tokens": 64_000,
        "context_length": 8192,
        "random_seed": 7,
        "mem_fraction_static": 0.8,
        "disable_radix_cache": True,
        "dtype": "bfloat16",
        "schedule_policy": "fcfs",
        "max_queued_requests": 100,
        "priority_scheduling_preemption_threshold": 5,
    },
}


def launched(engine: str, tmp_path: Any) -> Settings:
    command, parser, build = CLIS[engine]
    launch = spec(engine).launch(
        LaunchSpec(
            command=command,
            model_path="/models/llama-8b",
            served_names=("llama",),
            params=PARAMS[engine],
            host="127.0.0.1",
            port=8123,
            config_dir=str(tmp_path),
        )
    )
    for name, text in launch.files.items():
        (tmp_path / name).write_text(text)
    assert launch.argv[: len(command)] == list(command)
    args = parser().parse_args(launch.argv[len(command) :])
    return build(args, ENV)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_dialect_takes_what_the_spec_launches(engine: str, tmp_path: Any) -> None:
    settings = launched(engine, tmp_path)
    shape = settings.core.shape
    assert settings.dialect.engine == engine
    assert (settings.host, settings.port) == ("127.0.0.1", 8123)
    assert shape.tp_size == 2 and shape.max_batch_size == 32 and shape.max_num_tokens == 4096
    assert settings.gpu_indexes == (0, 1)
    assert settings.served_model == ("llama-8b" if engine == "trtllm" else "llama")


def test_vllm_settings_follow_its_flags(tmp_path: Any) -> None:
    settings = launched("vllm", tmp_path)
    core = settings.core
    # launch() turns the priority policy on; vLLM V1 preempts and always chunks prefills.
    assert core.policy == "priority" and core.kv_policy == "preempt"
    assert not core.enable_chunked_prefill and not core.enable_block_reuse  # --no-enable-...
    assert core.max_seq_len == 8192 and core.seed == 7 and core.shape.tokens_per_block == 16
    assert settings.served_models == ("llama",)
    assert settings.dialect.priority == "low_first" and settings.dialect.check_model


def test_sglang_settings_follow_its_flags(tmp_path: Any) -> None:
    settings = launched("sglang", tmp_path)
    core = settings.core
    assert core.kv_policy == "preempt" and core.kv_capacity_tokens == 64_000
    assert not core.enable_block_reuse and core.seed == 7 and core.max_seq_len == 8192
    assert settings.dialect.metrics  # launch() passes --enable-metrics
    assert settings.dialect.max_queued == 100 and core.priority_preemption_threshold == 5
    # launch() asks for lower-first priorities, as vLLM's (SGLang's default is higher first).
    assert core.policy == "priority" and settings.dialect.priority == "low_first"


def test_sglang_priority_direction() -> None:
    parser = sglang_cli.build_parser()
    base = ["--model-path", "m", "--enable-priority-scheduling"]
    high = sglang_cli.dialect(parser.parse_args(base))
    low = sglang_cli.dialect(parser.parse_args([*base, "--schedule-low-priority-values-first"]))
    off = sglang_cli.dialect(parser.parse_args(["--model-path", "m"]))
    assert (high.priority_key(10), high.priority_key(0)) == (-10, 0)  # 10 runs first
    assert (low.priority_key(10), low.priority_key(0)) == (10, 0)
    assert off.priority_key(10) == 0 and not off.metrics
    assert high.priority_key(None) > high.priority_key(10**6)  # no priority: last in SGLang
    vllm = vllm_cli.dialect(vllm_cli.build_parser().parse_args(["serve", "m"]))
    assert vllm.priority_key(None) == 0 and vllm.refuse_priority


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_unknown_flag_exits_2(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, parser, _ = CLIS[engine]
    head = {"trtllm": ["m"], "vllm": ["serve", "m"], "sglang": ["--model-path", "m"]}[engine]
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args([*head, "--no-such-flag", "1"])
    assert exit_.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_version_is_one_the_spec_supports(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, parser, _ = CLIS[engine]
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["--version"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "stand-in" in out
    spec(engine).check_version(out)  # raises when outside supported_versions


def body(response: Any) -> Any:
    return json.loads(bytes(response.body))


def test_error_bodies_per_dialect() -> None:
    trtllm, vllm, sglang = Dialect("trtllm", "1"), Dialect("vllm", "1"), Dialect("sglang", "1")
    flat = {
        "object": "error",
        "message": "m",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert body(trtllm.error(400, "m")) == flat
    assert body(sglang.error(400, "m")) == flat
    assert body(vllm.error(404, "m", "model")) == {
        "error": {"message": "m", "type": "NotFoundError", "param": "model", "code": 404}
    }
    assert body(trtllm.invalid("bad")) == {"error": "bad"}
    assert body(vllm.invalid("bad", "x"))["error"]["type"] == "Bad Request"
    assert body(sglang.invalid("bad"))["object"] == "error"
    assert trtllm.error(503, "m").status_code == 503


@pytest.mark.parametrize(
    ("metrics", "fixture"),
    [
        (VllmMetrics, "vllm_design_metrics_doc.txt"),
        (SglangMetrics, "sglang_production_metrics_doc.txt"),
    ],
)
def test_metric_families_match_the_engines_published_texts(
    metrics: type[VllmMetrics | SglangMetrics], fixture: str
) -> None:
    # The engines' own example /metrics texts (tests/fixtures/engines/metrics/SOURCES.md): every
    # family both expose has the same type (and, for vLLM's, the same help text and buckets).
    real = {f.name: f for f in text_string_to_metric_families((METRICS / fixture).read_text())}
    text = generate_latest(metrics("llama").registry).decode()
    mine = {f.name: f for f in text_string_to_metric_families(text)}
    shared = set(real) & set(mine)
    assert len(shared) >= 4, sorted(shared)
    for name in shared:
        assert real[name].type == mine[name].type, name
        if metrics is VllmMetrics:
            assert real[name].documentation == mine[name].documentation, name
    if metrics is VllmMetrics:
        ttft = "vllm:time_to_first_token_seconds"
        bounds = [s.labels["le"] for s in real[ttft].samples if s.name.endswith("_bucket")]
        mine_bounds = [s.labels["le"] for s in mine[ttft].samples if s.name.endswith("_bucket")]
        assert bounds == mine_bounds[: len(bounds)]  # the published text stops at le="0.1"
