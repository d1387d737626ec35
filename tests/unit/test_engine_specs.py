"""The engine specs (fleet_core/engines): argv, params checks, versions and priority per engine.

The real flag lists are tests/fixtures/engines/cli/*_flags*.txt, extracted from the released
engines' own source (SOURCES.md there): every flag a spec can emit must be in the oldest and the
newest release its supported range names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_core.engines import ENGINES, check_engine_params, spec
from fleet_core.engines.base import EngineSpec, LaunchSpec
from fleet_core.engines.sglang import AGENT_FLAGS as SGLANG_AGENT_FLAGS
from fleet_core.engines.sglang import FLAGS as SGLANG_FLAGS
from fleet_core.engines.sglang import PRIORITY_FLAGS, SGLANG
from fleet_core.engines.trtllm import TRTLLM
from fleet_core.engines.vllm import AGENT_FLAGS as VLLM_AGENT_FLAGS
from fleet_core.engines.vllm import FLAGS as VLLM_FLAGS
from fleet_core.engines.vllm import VLLM

CLI = Path(__file__).resolve().parents[1] / "fixtures" / "engines" / "cli"


def real_flags(name: str) -> frozenset[str]:
    lines = (CLI / name).read_text().splitlines()
    return frozenset(line for line in lines if line.startswith("--"))


VLLM_RELEASES = {
    "0.34.0": real_flags("vllm_flags.txt"),
    "0.11.0": real_flags("vllm_flags_0.11.0.txt"),
}
SGLANG_RELEASES = {
    "0.5.23": real_flags("sglang_flags.txt"),
    "0.5.3": real_flags("sglang_flags_0.5.3.txt"),
}


def one(
    engine: EngineSpec, params: dict[str, Any], names: tuple[str, ...] = ("llama",)
) -> list[str]:
    return engine.launch(
        LaunchSpec(
            command=engine.default_command,
            model_path="/models/llama",
            served_names=names,
            params=params,
            host="127.0.0.1",
            port=8100,
            config_dir="/run/fleet/r0",
        )
    ).argv


def long_flags(argv: list[str]) -> set[str]:
    return {word.split("=", 1)[0] for word in argv if word.startswith("--")}


# ---------------------------------------------------------------------------------------------
# The fixtures themselves


def test_fixtures_hold_real_flag_lists() -> None:
    # A few flags every release has, and flags it must not have: the extraction read the
    # right files (and did not, say, pick up help texts).
    for flags in VLLM_RELEASES.values():
        assert {"--tensor-parallel-size", "--port", "--no-enable-prefix-caching"} <= flags
        assert "--tp-size" not in flags and "--tp_size" not in flags
    for flags in SGLANG_RELEASES.values():
        assert {"--tp-size", "--model-path", "--enable-metrics"} <= flags
        assert "--no-enable-metrics" not in flags
    assert "--kv-cache-memory-bytes" in VLLM_RELEASES["0.34.0"]


# ---------------------------------------------------------------------------------------------
# vLLM


def test_vllm_exact_argv() -> None:
    params = {
        "tensor_parallel_size": 2,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.85,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "dtype": "bfloat16",
    }
    assert one(VLLM, params, ("llama", "llama-8b")) == [
        "vllm",
        "serve",
        "/models/llama",
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--served-model-name",
        "llama",
        "llama-8b",
        "--tensor-parallel-size",
        "2",
        "--max-num-seqs",
        "64",
        "--gpu-memory-utilization",
        "0.85",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--scheduling-policy",
        "priority",
    ]


def test_vllm_policy_is_priority_unless_the_operator_says_fcfs() -> None:
    argv = one(VLLM, {})
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    argv = one(VLLM, {"scheduling_policy": "fcfs"})
    assert argv[argv.index("--scheduling-policy") + 1] == "fcfs"
    assert argv.count("--scheduling-policy") == 1


@pytest.mark.parametrize("release", sorted(VLLM_RELEASES))
def test_every_vllm_flag_is_real(release: str) -> None:
    real = VLLM_RELEASES[release]
    assert VLLM_FLAGS.flags() | set(VLLM_AGENT_FLAGS) <= real
    every: dict[str, Any] = {
        **{k: 1 for k in VLLM_FLAGS.ints},
        **{k: 0.5 for k in VLLM_FLAGS.fractions},
        **{k: True for k in VLLM_FLAGS.bools},
        **{k: c[0] for k, (_, c) in VLLM_FLAGS.choices.items()},
        "quantization": "fp8",
    }
    for toggle in (True, False):
        argv = one(VLLM, every | {k: toggle for k in VLLM_FLAGS.toggles})
        assert long_flags(argv) <= real, long_flags(argv) - real


# ---------------------------------------------------------------------------------------------
# SGLang


def test_sglang_exact_argv() -> None:
    params = {"tp_size": 2, "max_running_requests": 128, "mem_fraction_static": 0.8}
    assert one(SGLANG, params, ("llama", "llama-8b")) == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/llama",
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--enable-metrics",
        "--served-model-name",
        "llama",  # one name: SGLang's --served-model-name takes a single string
        "--enable-priority-scheduling",
        "--schedule-low-priority-values-first",
        "--tp-size",
        "2",
        "--max-running-requests",
        "128",
        "--mem-fraction-static",
        "0.8",
    ]


def test_sglang_priority_scheduling_can_be_turned_off() -> None:
    argv = one(SGLANG, {"enable_priority_scheduling": False})
    assert not set(PRIORITY_FLAGS) & set(argv)
    assert "--enable-metrics" in argv


@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
def test_every_sglang_flag_is_real(release: str) -> None:
    real = SGLANG_RELEASES[release]
    assert SGLANG_FLAGS.flags() | set(SGLANG_AGENT_FLAGS) | set(PRIORITY_FLAGS) <= real
    every: dict[str, Any] = {
        **{k: 1 for k in SGLANG_FLAGS.ints},
        **{k: 0.5 for k in SGLANG_FLAGS.fractions},
        **{k: True for k in SGLANG_FLAGS.bools},
        **{k: c[-1] for k, (_, c) in SGLANG_FLAGS.choices.items()},
        "quantization": "fp8",
    }
    argv = one(SGLANG, every)
    assert long_flags(argv) <= real, long_flags(argv) - real


# ---------------------------------------------------------------------------------------------
# Every engine: params, parallelism, batch size


@pytest.mark.parametrize(
    ("engine", "key"),
    [("trtllm", "tensor_parallel_size"), ("vllm", "tp_size"), ("sglang", "max_num_seqs")],
)
def test_an_option_of_another_engine_is_refused_by_name(engine: str, key: str) -> None:
    with pytest.raises(ValueError) as err:
        check_engine_params(engine, {key: 2})
    assert key in str(err.value)
    assert spec(engine).name in str(err.value) or spec(engine).program in str(err.value)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_unknown_options_are_all_named_with_the_engine(engine: str) -> None:
    with pytest.raises(ValueError) as err:
        check_engine_params(engine, {"flux": 1, "warp_factor": 9})
    text = str(err.value)
    assert "flux" in text and "warp_factor" in text and f"engine {engine}" in text


def test_unknown_engine_is_named() -> None:
    with pytest.raises(ValueError, match="'tgi'"):
        spec("tgi")


@pytest.mark.parametrize(
    ("engine", "params", "message"),
    [
        ("vllm", {"max_num_seqs": 0}, "at least 1"),
        ("vllm", {"max_num_seqs": True}, "integer"),
        ("vllm", {"max_num_seqs": "8"}, "integer"),
        ("vllm", {"seed": -1}, "at least 0"),
        ("vllm", {"gpu_memory_utilization": 1.5}, r"\(0, 1\]"),
        ("vllm", {"gpu_memory_utilization": 0}, r"\(0, 1\]"),
        ("vllm", {"enable_prefix_caching": "no"}, "true or false"),
        ("vllm", {"dtype": "fp4"}, "expected one of"),
        ("vllm", {"scheduling_policy": "lottery"}, "expected one of"),
        ("vllm", {"kv_cache_dtype": ["fp8"]}, "expected one of"),
        ("vllm", {"quantization": "--evil"}, "may not start"),
        ("vllm", {"quantization": ""}, "1-200"),
        ("sglang", {"tp_size": 0}, "at least 1"),
        ("sglang", {"tp_size": None}, "not null"),
        ("vllm", {"pipeline_parallel_size": None}, "not null"),
        ("sglang", {"random_seed": -3}, "at least 0"),
        ("sglang", {"mem_fraction_static": "0.8"}, "number"),
        ("sglang", {"schedule_policy": "sjf"}, "expected one of"),
        ("sglang", {"kv_cache_dtype": "fp8"}, "expected one of"),
        ("sglang", {"enable_priority_scheduling": 1}, "true or false"),
        ("sglang", {"disable_radix_cache": None}, "true or false"),
    ],
)
def test_bad_values_are_refused(engine: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_engine_params(engine, params)


@pytest.mark.parametrize(
    ("engine", "params", "expected"),
    [
        ("trtllm", {}, (1, 1)),
        ("trtllm", {"tp_size": 4, "pp_size": 2}, (4, 2)),
        ("vllm", {"tensor_parallel_size": 2}, (2, 1)),
        ("vllm", {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}, (2, 3)),
        ("sglang", {"tp_size": 8}, (8, 1)),
        ("sglang", {"pp_size": 2}, (1, 2)),
    ],
)
def test_parallelism(engine: str, params: dict[str, Any], expected: tuple[int, int]) -> None:
    assert spec(engine).parallelism(params) == expected


@pytest.mark.parametrize(
    ("engine", "params", "expected"),
    [
        ("trtllm", {"max_batch_size": 64}, 64),
        ("vllm", {"max_num_seqs": 32}, 32),
        ("sglang", {"max_running_requests": 16}, 16),
        ("vllm", {}, None),
        ("sglang", {"max_total_tokens": 9000}, None),
    ],
)
def test_max_batch_size(engine: str, params: dict[str, Any], expected: int | None) -> None:
    assert spec(engine).max_batch_size(params) == expected


@pytest.mark.parametrize("name", ["-oops", ""])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_served_name_that_argparse_would_misread_is_refused(engine: str, name: str) -> None:
    with pytest.raises(ValueError, match="served model name"):
        one(spec(engine), {}, ("llama", name))


# ---------------------------------------------------------------------------------------------
# Versions


@pytest.mark.parametrize(
    ("engine", "output", "version"),
    [
        ("vllm", "0.11.0\n", "0.11.0"),
        ("vllm", "0.34.0\n", "0.34.0"),
        ("sglang", "sglang 0.5.3\n", "0.5.3"),
        ("sglang", "sglang 0.5.23\n", "0.5.23"),
        ("sglang", "Fleet stand-in (no GPU) for SGLang, version 0.5.4.post1", "0.5.4.post1"),
        ("trtllm", "tensorrt_llm 1.0.0\n", "1.0.0"),
        ("trtllm", "tensorrt_llm 1.2.0rc3\n", "1.2.0rc3"),
    ],
)
def test_check_version_in_range(engine: str, output: str, version: str) -> None:
    assert spec(engine).check_version(output) == version


@pytest.mark.parametrize(
    ("engine", "output", "installed"),
    [
        ("vllm", "0.10.2\n", "0.10.2"),
        ("vllm", "0.35.0\n", "0.35.0"),
        ("sglang", "sglang 0.5.1\n", "0.5.1"),
        ("sglang", "sglang 0.6.0\n", "0.6.0"),
        ("trtllm", "tensorrt_llm 0.18.2\n", "0.18.2"),
        ("trtllm", "tensorrt_llm 1.3.0\n", "1.3.0"),
    ],
)
def test_check_version_out_of_range_is_one_line(engine: str, output: str, installed: str) -> None:
    engine_spec = spec(engine)
    with pytest.raises(ValueError) as err:
        engine_spec.check_version(output)
    text = str(err.value)
    assert "\n" not in text
    assert installed in text and engine_spec.supported_versions in text
    assert f"fleet[gpu-{engine}]" in text


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("output", ["", "command not found", "version: unknown"])
def test_check_version_of_garbage_is_a_value_error(engine: str, output: str) -> None:
    with pytest.raises(ValueError, match="no version"):
        spec(engine).check_version(output)


def test_version_argv() -> None:
    assert VLLM.version_argv(("vllm",)) == ["vllm", "--version"]
    # SGLang's launch_server has no --version: its interpreter reads the metadata.
    argv = SGLANG.version_argv(("/opt/venv/bin/python", "-m", "sglang.launch_server"))
    assert argv[:2] == ["/opt/venv/bin/python", "-c"]
    assert "importlib.metadata" in argv[2] and "'sglang'" in argv[2]
    standin = ("python", "-m", "fleet_agent.engine.standin.sglang")
    assert SGLANG.version_argv(standin) == [*standin, "--version"]
    # trtllm-serve has no --version: the python beside the script reads the metadata.
    argv = TRTLLM.version_argv(("/opt/trt/bin/trtllm-serve",))
    assert argv[:2] == ["/opt/trt/bin/python3", "-c"] and "'tensorrt_llm'" in argv[2]
    assert TRTLLM.version_argv(("trtllm-serve",))[0] == "python3"
    assert TRTLLM.version_argv(("mpirun", "-n", "2", "trtllm-serve"))[:4] == [
        "mpirun",
        "-n",
        "2",
        "python3",
    ]
    standin = ("python", "-m", "fleet_agent.engine.standin")
    assert TRTLLM.version_argv(standin) == [*standin, "--version"]


def test_the_metadata_script_prints_a_version_check_version_reads() -> None:
    import subprocess
    import sys

    # Run it for a distribution installed here (pytest), as the agent runs it for the engine's.
    argv = SGLANG.version_argv((sys.executable, "-m", "sglang.launch_server"))
    argv[2] = argv[2].replace("'sglang'", "'pytest'")
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    assert SGLANG.parse_version(out) == pytest.__version__


# ---------------------------------------------------------------------------------------------
# Priority


def test_priority_fields() -> None:
    assert VLLM.priority_fields("interactive") == {"priority": 0}
    assert VLLM.priority_fields("batch") == {"priority": 10}
    assert SGLANG.priority_fields("interactive") == {"priority": 0}
    assert SGLANG.priority_fields("batch") == {"priority": 10}
    # trtllm-serve's requests have no priority field and forbid unknown ones.
    assert TRTLLM.priority_fields("interactive") == TRTLLM.priority_fields("batch") == {}


def test_priority_fields_follow_the_deployments_params() -> None:
    assert VLLM.priority_fields("batch", {"scheduling_policy": "fcfs"}) == {}
    assert VLLM.priority_fields("batch", {"scheduling_policy": "priority"}) == {"priority": 10}
    assert VLLM.priority_fields("batch", {}) == {"priority": 10}
    assert SGLANG.priority_fields("batch", {"enable_priority_scheduling": False}) == {}
    assert SGLANG.priority_fields("batch", {"enable_priority_scheduling": True}) == {"priority": 10}
    assert TRTLLM.priority_fields("batch", {"tp_size": 2}) == {}


# ---------------------------------------------------------------------------------------------
# params_schema agrees with check_params


def _values() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 300),
        # JSON Schema counts 1.0 an integer; check_params, stricter, does not: no such floats.
        st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=2).filter(
            lambda x: not x.is_integer()
        ),
        st.sampled_from(["auto", "fp8", "fcfs", "priority", "bfloat16", "lpm", "-x", "", "awq"]),
    )


def _params(engine: EngineSpec) -> st.SearchStrategy[dict[str, Any]]:
    keys = [*sorted(engine.params_schema()["properties"]), "no_such_flag"]
    return st.dictionaries(st.sampled_from(keys), _values(), max_size=4)


@pytest.mark.parametrize("engine", [VLLM, SGLANG], ids=lambda e: e.name)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_params_schema_accepts_what_check_params_accepts(engine: EngineSpec, data: Any) -> None:
    params = data.draw(_params(engine))
    try:
        engine.check_params(params)
        accepted = True
    except ValueError:
        accepted = False
    errors = list(jsonschema_rs.validator_for(engine.params_schema()).iter_errors(params))
    assert accepted == (not errors), (params, [e.message for e in errors])


# ---------------------------------------------------------------------------------------------
# The gpu extras pin what the specs support


def test_each_engines_extra_pins_its_supported_versions() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    distribution = {"trtllm": "tensorrt-llm", "vllm": "vllm", "sglang": "sglang"}
    for name, engine in ENGINES.items():
        assert extras[f"gpu-{name}"] == [f"{distribution[name]}{engine.supported_versions}"]
    assert extras["gpu"] == extras["gpu-trtllm"]
