"""The trtllm-serve stand-in as a real process on 127.0.0.1: lifecycle, API shapes, drain.

Every wait is bounded; every process is killed by PID at teardown.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import ROOT

from fleet.lab.harness import free_port, wait_for
from fleet_agent.engine.standin import settings as standin
from fleet_agent.telemetry import sim_gpu_state
from fleet_core import cost_model as cm
from fleet_core import power_model as pm

REPO = ROOT
MODEL = "/models/demo/llama-3.1-8b"  # served as "llama-3.1-8b", as trtllm-serve would
SERVED = "llama-3.1-8b"
STANDIN = [sys.executable, "-m", "fleet_agent.engine.standin"]


def standin_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_STANDIN_")}
    # MODEL is a path no host here has: served without weights (the agent's external path).
    # Reading a real checkpoint: tests/e2e/test_agent_weights.py.
    env["FLEET_STANDIN_MISSING_WEIGHTS"] = "ignore"
    env.update(extra)
    return env


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    observed: dict[str, Any] = field(default_factory=dict)

    def connection(self, timeout: float = 10) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        conn: http.client.HTTPConnection | None = None,
    ) -> tuple[int, bytes]:
        own = conn is None
        c = conn or self.connection()
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            c.request(method, path, body=payload, headers=headers)
            resp = c.getresponse()
            return resp.status, resp.read()
        finally:
            if own:
                c.close()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, raw = self.request("POST", path, body)
        return status, json.loads(raw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def launch(tmp: Path, env: dict[str, str], *args: str) -> Engine:
    port = free_port()
    log = tmp / f"standin-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*STANDIN, MODEL, "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=REPO,
            env=standin_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Engine(proc, port, log)


def health(engine: Engine) -> int | None:
    try:
        return engine.request("GET", "/health")[0]
    except OSError:
        return None


def wait_ready(engine: Engine, timeout: float = 30) -> None:
    wait_for(
        "/health",
        lambda: health(engine) == 200 or engine.proc.poll() is not None,
        timeout,
        every=0.02,
    )
    assert engine.proc.poll() is None, engine.log_text()


def sse(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of an SSE response, as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        if line.startswith(b"data: "):
            yield line[6:].decode().rstrip("\n")


def open_stream(engine: Engine, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
    conn = engine.connection()
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("content-type", "").startswith("text/event-stream")
    return resp


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One stand-in for the API tests, started the way the agent's supervisor starts engines."""
    tmp = tmp_path_factory.mktemp("standin")
    extra = tmp / "extra.yaml"
    extra.write_text("enable_iter_perf_stats: true\nreturn_perf_metrics: true\n")
    e = launch(
        tmp,
        {
            "CUDA_VISIBLE_DEVICES": "0,1",
            "FLEET_STANDIN_GPU": "H100",
            "FLEET_STANDIN_SPEEDUP": "10",
            "FLEET_STANDIN_LOAD_S": "15",  # 1.5 s of wall time
        },
        *("--backend", "pytorch", "--tp_size", "2", "--pp_size", "1"),
        *("--max_batch_size", "64", "--max_num_tokens", "8192"),
        *("--kv_cache_free_gpu_memory_fraction", "0.9", "--extra_llm_api_options", str(extra)),
    )
    try:
        # The port is bound before the load starts, and logged once bound.
        wait_for(
            "loading",
            lambda: "loading" in e.log_text() or e.proc.poll() is not None,
            30,
            every=0.02,
        )
        assert e.proc.poll() is None, e.log_text()
        try:
            socket.create_connection(("127.0.0.1", e.port), timeout=2).close()
            e.observed["refused"] = False
        except ConnectionRefusedError:
            e.observed["refused"] = True
        probe = socket.socket()  # no SO_REUSEADDR: binding fails while the stand-in holds it
        try:
            probe.bind(("127.0.0.1", e.port))
            e.observed["bound"] = False
        except OSError as exc:
            e.observed["bound"] = exc.errno == errno.EADDRINUSE
        finally:
            probe.close()
        e.observed["health_while_loading"] = health(e)
        wait_ready(e)
        yield e
    finally:
        e.stop()


def test_port_is_bound_but_refuses_connections_while_loading(engine: Engine) -> None:
    assert engine.observed == {"refused": True, "bound": True, "health_while_loading": None}
    assert health(engine) == 200
    assert "Llama-3.1-8B fp8 on 2 × H100 SXM" in engine.log_text()


def test_version_models_and_health_generate(engine: Engine) -> None:
    status, raw = engine.request("GET", "/version")
    assert status == 200 and json.loads(raw)["version"].startswith("stand-in ")
    status, raw = engine.request("GET", "/v1/models")
    models = json.loads(raw)
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        (SERVED, "model", "tensorrt_llm")
    ]
    status, raw = engine.request("GET", "/health_generate")
    assert (status, raw) == (200, b"Generation health check OK")


def test_completion(engine: Engine) -> None:
    body = {"model": SERVED, "prompt": "Where is New York?", "max_tokens": 16, "temperature": 0}
    status, out = engine.post("/v1/completions", body)
    assert status == 200
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert isinstance(out["created"], int) and out["model"] == SERVED
    [choice] = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("length", "stop")
    usage = out["usage"]
    assert usage["prompt_tokens"] == 5  # 18 characters
    assert 1 <= usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(choice["text"].split()) == usage["completion_tokens"]
    # Same prompt, same text.
    assert engine.post("/v1/completions", body)[1]["choices"][0]["text"] == choice["text"]


def test_chat_completion(engine: Engine) -> None:
    body = {
        "model": SERVED,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Where is New York?"}]},
        ],
        "max_completion_tokens": 2000,
        "seed": 3,
        "user": "tests",
    }
    status, out = engine.post("/v1/chat/completions", body)
    assert status == 200
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    [choice] = out["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"  # the natural length, 16..1024, is under the cap
    assert 16 <= out["usage"]["completion_tokens"] <= 1024


def test_chat_stream_with_usage_ends_in_done(engine: Engine) -> None:
    body: dict[str, Any] = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "ignore_eos": True,
    }
    plain = engine.post("/v1/chat/completions", body)[1]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = list(sse(open_stream(engine, "/v1/chat/completions", streamed)))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == SERVED for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 12
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 11 + ["length"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    assert text == plain["choices"][0]["message"]["content"]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == plain["usage"]


def test_completion_stream_without_usage(engine: Engine) -> None:
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 5, "stream": True}
    events = list(sse(open_stream(engine, "/v1/completions", body)))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["text"].startswith(" ") for c in chunks)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokenz": 5}, "max_tokenz"),
        ("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"model": SERVED, "prompt": 7}, "prompt"),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/completions", {"model": SERVED, "prompt": "hi", "n": 2}, None),
        ("/v1/completions", {"model": SERVED, "prompt": "hi", "stream_options": {}}, None),
        ("/v1/chat/completions", {"model": SERVED, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": SERVED, "messages": [], "tools": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": SERVED, "messages": [{"role": "user"}], "logprobs": True},
            None,
        ),
    ],
)
def test_bad_requests_get_trtllm_serves_validation_error(
    engine: Engine, path: str, body: dict[str, Any], param: str | None
) -> None:
    # trtllm-serve's RequestValidationError handler: 400 {"error": "<text>"}.
    status, out = engine.post(path, body)
    assert status == 400 and list(out) == ["error"]
    assert isinstance(out["error"], str) and out["error"]
    if param is not None:
        assert param in out["error"]


def test_invalid_json_and_too_long_requests_are_400(engine: Engine) -> None:
    conn = engine.connection()
    conn.request("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "JSON" in json.loads(resp.read())["error"]
    conn.close()
    status, out = engine.post(
        "/v1/completions", {"model": SERVED, "prompt": "x" * 40_000, "max_tokens": 10}
    )
    # trtllm-serve's ErrorResponse (create_error_response): flat, "object": "error".
    assert status == 400 and "max_num_tokens" in out["message"]
    assert out["object"] == "error" and out["type"] == "BadRequestError" and out["code"] == 400


def test_metrics_are_emptied_on_every_read(engine: Engine) -> None:
    engine.request("GET", "/metrics")  # whatever earlier tests left
    engine.post("/v1/completions", {"model": SERVED, "prompt": "count", "max_tokens": 5})
    status, raw = engine.request("GET", "/metrics")
    stats = json.loads(raw)
    assert status == 200 and len(stats) >= 5  # one prefill + four decode iterations
    iters = [s["iter"] for s in stats]
    assert iters == sorted(iters)
    last = stats[-1]
    assert last["numCompletedRequests"] == 1
    assert last["kvCacheStats"]["maxNumBlocks"] > 0
    assert last["inflightBatchingStats"]["numGenRequests"] == 1
    assert json.loads(engine.request("GET", "/metrics")[1]) == []


def test_prometheus_metrics(engine: Engine) -> None:
    engine.post("/v1/completions", {"model": SERVED, "prompt": "prom", "max_tokens": 4})
    status, raw = engine.request("GET", "/prometheus/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    for name in (
        "trtllm_num_requests_running",
        "trtllm_num_requests_waiting",
        "trtllm_kv_cache_utilization",
        "trtllm_time_to_first_token_seconds",
        "trtllm_e2e_request_latency_seconds",
        "trtllm_time_per_output_token_seconds",
    ):
        assert name in families, name
    for name in ("trtllm_request_success", "trtllm_prompt_tokens", "trtllm_generation_tokens"):
        assert families[name].type == "counter", name  # exposed as <name>_total
    text = raw.decode()
    assert 'trtllm_request_success_total{engine_type="undefined",finished_reason="length"' in text
    assert "trtllm_time_to_first_token_seconds_bucket" in text
    util = families["trtllm_kv_cache_utilization"].samples[0].value
    assert 0.0 <= util <= 1.0
    assert families["trtllm_generation_tokens"].samples[0].value >= 4


def gauge(engine: Engine, family: str, gpu: str) -> float | None:
    raw = engine.request("GET", "/prometheus/metrics")[1].decode()
    for f in text_string_to_metric_families(raw):
        for sample in f.samples:
            if sample.name == family and sample.labels.get("gpu") == gpu:
                return float(sample.value)
    return None


def prefill_ms(engine: Engine, tokens: int) -> float:
    """The iteration latency of the (only) iteration that prefilled `tokens` tokens."""
    stats = json.loads(engine.request("GET", "/metrics")[1])
    hits = [s for s in stats if s["inflightBatchingStats"]["numCtxTokens"] == tokens]
    assert len(hits) == 1, stats
    return float(hits[0]["iterLatencyMS"])


def test_the_simulated_gpus_power_limit_slows_prefill_and_power_is_reported(
    tmp_path: Path,
) -> None:
    state = tmp_path / "gpus"
    sim_gpu_state.write_limits(state, {0: 700.0, 1: 350.0})
    e = launch(
        tmp_path,
        {
            "CUDA_VISIBLE_DEVICES": "1",
            "FLEET_STANDIN_GPU": "H200",
            "FLEET_STANDIN_LOAD_S": "0.2",
            sim_gpu_state.ENV: str(state),
        },
    )
    try:
        wait_ready(e)
        limit = "fleet_standin_gpu_power_limit_watts"
        wait_for("the limit read", lambda: gauge(e, limit, "1") == 350.0, 10, every=0.05)
        shape = cm.EngineShape(gpu=cm.gpu_spec("H200"), model=cm.model_spec("llama-3.1-8b"))
        e.request("GET", "/metrics")  # empty the stats
        body = {"model": SERVED, "prompt": "x" * 32_000, "max_tokens": 2, "ignore_eos": True}
        assert e.post("/v1/completions", body)[0] == 200
        capped_s, watts = pm.capped_iteration(shape, 0, 8000, 8000, 350.0)
        assert watts == 350.0
        assert prefill_ms(e, 8000) == pytest.approx(capped_s * 1e3, rel=1e-9)

        # What the GPU drew goes back to the simulated driver: GPU 1 only, never past the limit.
        def reported() -> sim_gpu_state.GpuActivity | None:
            return sim_gpu_state.read_activity(state, 1, time.time(), 2.0)

        wait_for("a power report", lambda: reported() is not None, 10, every=0.05)
        activity = reported()
        assert activity is not None
        assert pm.idle_power_w(shape.gpu) <= activity.power_w <= 350.0
        assert activity.memory_used_mib == cm.gpu_memory_used_bytes(shape) // 2**20
        assert not (state / "gpu-0.json").exists()
        energy = gauge(e, "fleet_standin_gpu_energy_joules_total", "1")
        assert energy is not None and energy > 0

        # The limit lifted: the same work takes the uncapped time again.
        sim_gpu_state.write_limits(state, {0: 700.0, 1: 700.0})
        wait_for("the lift read", lambda: gauge(e, limit, "1") == 700.0, 10, every=0.05)
        e.request("GET", "/metrics")
        body["prompt"] = "y" * 32_000  # not a prefix of the first: no block reuse
        assert e.post("/v1/completions", body)[0] == 200
        free_s = cm.iteration_seconds(shape, 0, 8000, 8000)
        assert prefill_ms(e, 8000) == pytest.approx(free_s * 1e3, rel=1e-9)
        assert capped_s > 1.3 * free_s
    finally:
        e.stop()


def test_client_disconnect_frees_the_request(engine: Engine) -> None:
    body = {"model": SERVED, "prompt": "forever", "max_tokens": 20_000, "ignore_eos": True}
    resp = open_stream(engine, "/v1/completions", {**body, "stream": True})
    assert next(sse(resp))
    resp.close()  # ~13 s of generation left at this speed-up

    def running() -> float:
        raw = engine.request("GET", "/prometheus/metrics")[1].decode()
        families = {f.name: f for f in text_string_to_metric_families(raw)}
        return families["trtllm_num_requests_running"].samples[0].value

    wait_for("the aborted request to leave the engine", lambda: running() == 0, 5, every=0.02)


def test_sigterm_finishes_streams_in_flight_then_exits_0(tmp_path: Path) -> None:
    # An L40S in real time: 8B decodes at ~12 ms a token, so 150 tokens take ~2 s.
    e = launch(tmp_path, {"FLEET_STANDIN_GPU": "L40S", "FLEET_STANDIN_LOAD_S": "0.2"})
    try:
        wait_ready(e)
        keepalive = e.connection()
        assert e.request("GET", "/health", conn=keepalive)[0] == 200
        body = {"model": SERVED, "prompt": "drain me", "max_tokens": 150, "ignore_eos": True}
        stream = sse(open_stream(e, "/v1/completions", {**body, "stream": True}))
        first = json.loads(next(stream))
        e.proc.send_signal(signal.SIGTERM)
        wait_for(
            "/health 503",
            lambda: e.request("GET", "/health", conn=keepalive)[0] == 503,
            5,
            every=0.02,
        )
        late = {"model": SERVED, "prompt": "late"}
        status, raw = e.request("POST", "/v1/completions", late, keepalive)
        assert status == 503 and json.loads(raw)["code"] == 503
        rest = list(stream)
        assert rest[-1] == "[DONE]"
        chunks = [first] + [json.loads(r) for r in rest[:-1]]
        assert len(chunks) == 150
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert e.proc.wait(timeout=15) == 0
        assert "draining 1 request" in e.log_text()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", e.port), timeout=2).close()
    finally:
        e.stop()


def test_drain_is_bounded(tmp_path: Path) -> None:
    env = {
        "FLEET_STANDIN_GPU": "L40S",
        "FLEET_STANDIN_LOAD_S": "0.2",
        "FLEET_STANDIN_DRAIN_S": "0.3",
    }
    e = launch(tmp_path, env)
    try:
        wait_ready(e)
        body = {"model": SERVED, "prompt": "too long", "max_tokens": 2000, "ignore_eos": True}
        stream = sse(open_stream(e, "/v1/completions", {**body, "stream": True}))
        assert next(stream)
        started = time.monotonic()
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10  # 2000 tokens would take ~25 s
        assert "[DONE]" not in list(stream)
    finally:
        e.stop()


def test_sigterm_while_loading_exits_0(tmp_path: Path) -> None:
    e = launch(tmp_path, {"FLEET_STANDIN_LOAD_S": "60"})
    try:
        wait_for(
            "loading",
            lambda: "loading" in e.log_text() or e.proc.poll() is not None,
            30,
            every=0.02,
        )
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(timeout=10) == 0
    finally:
        e.stop()


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STANDIN, *args],
        cwd=REPO,
        env=standin_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_cli(MODEL, "--port", "1", "--no_such_flag", "3")
    assert done.returncode == 2
    assert "unrecognized arguments: --no_such_flag" in done.stderr
    for bad in (["--tp_size", "two"], ["--max_batch", "8"], ["--backend", "vllm"], []):
        with pytest.raises(SystemExit) as exit_:  # no abbreviations (--max_batch), as click
            standin.build_parser().parse_args([MODEL, *bad] if bad else bad)
        assert exit_.value.code == 2, bad
    capsys.readouterr()


def test_supervisor_command_line_is_accepted(tmp_path: Path) -> None:
    """Every flag the supervisor passes, and the documented ones it may pass, parse; the YAML
    overrides the flags as in trtllm-serve."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("max_batch_size: 32\nkv_cache_config:\n  enable_block_reuse: false\n")
    argv = [MODEL, "--host", "127.0.0.1", "--port", "9000", "--backend", "pytorch"]
    argv += ["--tp_size", "2", "--pp_size", "1", "--max_batch_size", "64"]
    argv += ["--max_num_tokens", "4096", "--kv_cache_free_gpu_memory_fraction", "0.8"]
    argv += ["--extra_llm_api_options", str(extra), "--tokenizer", "/tok", "--log_level", "info"]
    argv += ["--trust_remote_code", "--num_postprocess_workers", "2", "--max_seq_len", "8192"]
    argv += ["--ep_size", "1", "--gpus_per_node", "8", "--reasoning_parser", "deepseek-r1"]
    argv += ["--cluster_size", "1", "--enable_chunked_prefill", "--max_beam_width", "1"]
    args = standin.build_parser().parse_args(argv)
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "FLEET_STANDIN_GPU": "h200", "FLEET_STANDIN_SEED": "7"}
    settings = standin.build_settings(args, env)
    shape = settings.core.shape
    assert (settings.served_model, settings.host, settings.port) == (SERVED, "127.0.0.1", 9000)
    assert (shape.gpu.name, shape.model.name, shape.precision) == ("H200", "Llama-3.1-8B", "fp8")
    assert (shape.tp_size, shape.max_batch_size, shape.max_num_tokens) == (2, 32, 4096)
    # The YAML's kv_cache_config replaced the flag's: KvCacheConfig's default fraction applies.
    assert shape.kv_cache_free_gpu_memory_fraction == 0.9
    core = settings.core
    assert (core.max_seq_len, core.enable_chunked_prefill, core.enable_block_reuse) == (
        8192,
        True,
        False,
    )
    assert core.seed == 7 and settings.speedup == 1.0 and settings.drain_s == 30.0
    assert settings.load_s == pytest.approx(8.03 / 7, rel=0.01)  # 8 GB at 7 GB/s

    plain = standin.build_settings(
        standin.build_parser().parse_args(["meta-llama/Llama-3.1-70B"]), {}
    )
    assert plain.served_model == "meta-llama/Llama-3.1-70B"  # not a directory: served as named
    assert plain.core.shape.model.name == "Llama-3.1-70B"
    assert plain.core.shape.kv_cache_free_gpu_memory_fraction == 0.9


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--tp_size", "2"], {"CUDA_VISIBLE_DEVICES": "0"}, "needs 2 GPUs"),
        (["--extra_llm_api_options", "/nonexistent/extra.yaml"], {}, "extra.yaml"),
        ([], {"FLEET_STANDIN_GPU": "A100"}, "unknown GPU"),
        ([], {"FLEET_STANDIN_SPEEDUP": "fast"}, "FLEET_STANDIN_SPEEDUP"),
        ([], {"FLEET_STANDIN_SPEEDUP": "0"}, "FLEET_STANDIN_SPEEDUP"),
        ([], {"FLEET_STANDIN_PRECISION": "int4"}, "FLEET_STANDIN_PRECISION"),
        (
            [],
            {"FLEET_STANDIN_MODEL": "llama-3.1-70b", "FLEET_STANDIN_GPU": "L40S"},
            "raise tp_size",
        ),
    ],
)
def test_configuration_errors(args: list[str], env: dict[str, str], message: str) -> None:
    parsed = standin.build_parser().parse_args([MODEL, *args])
    with pytest.raises(standin.ConfigError, match=message):
        standin.build_settings(parsed, env)


def test_configuration_error_exits_1() -> None:
    done = run_cli(MODEL, "--port", str(free_port()), "--tp_size", "4", CUDA_VISIBLE_DEVICES="0,1")
    assert done.returncode == 1
    assert done.stderr.startswith("stand-in: tp_size 4 × pp_size 1 needs 4 GPUs")


def test_port_in_use_exits_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = run_cli(MODEL, "--host", "127.0.0.1", "--port", str(taken.getsockname()[1]))
    assert done.returncode == 1
    assert "failed to bind" in done.stderr
