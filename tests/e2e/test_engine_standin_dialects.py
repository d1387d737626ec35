"""The stand-in speaking vLLM's and SGLang's dialects as real processes on 127.0.0.1: command
line, health, models, a completion, metric names, error bodies, and priority inside a
saturated replica. (trtllm-serve's dialect: tests/e2e/test_engine_standin.py.)

Every wait is bounded; every process is killed by PID at teardown.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import ROOT
from test_engine_standin import Engine, standin_env, wait_ready

from fleet.lab.harness import free_port, wait_for
from fleet_agent.engine import scrape
from fleet_core.engines import spec

MODEL = "/models/demo/llama-3.1-8b"
SERVED = "llama"
MODULES = {
    "vllm": "fleet_agent.engine.standin.vllm",
    "sglang": "fleet_agent.engine.standin.sglang",
}
# What fleet_core/engines' launch() would pass, with one running request at a time so that a
# queue builds up behind it.
ARGS = {
    "vllm": [
        "serve", MODEL, "--host", "127.0.0.1", "--served-model-name", SERVED, "other-name",
        "--scheduling-policy", "priority", "--max-num-seqs", "1",
    ],
    "sglang": [
        "--model-path", MODEL, "--host", "127.0.0.1", "--enable-metrics",
        "--served-model-name", SERVED, "--enable-priority-scheduling",
        "--schedule-low-priority-values-first", "--max-running-requests", "1",
    ],
}  # fmt: skip
METRICS = {
    "vllm": {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds",
    },
    "sglang": {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:num_retracted_requests",
        "sglang:prompt_tokens",
        "sglang:generation_tokens",
        "sglang:time_to_first_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:e2e_request_latency_seconds",
    },
}
GAUGES = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}


def start(tmp: Path, dialect: str) -> Engine:
    port = free_port()
    log = tmp / f"{dialect}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULES[dialect], *ARGS[dialect], "--port", str(port)],
            cwd=ROOT,
            env=standin_env(FLEET_STANDIN_LOAD_S="0"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Engine(proc, port, log)


@pytest.fixture(scope="module", params=sorted(MODULES))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Engine]]:
    dialect = str(request.param)
    eng = start(tmp_path_factory.mktemp(dialect), dialect)
    try:
        wait_ready(eng)
        yield dialect, eng
    finally:
        eng.stop()


def metrics(eng: Engine) -> dict[str, dict[str, float]]:
    """Family name -> {sample name: value} of /metrics (one label set per sample name kept)."""
    status, raw = eng.request("GET", "/metrics")
    assert status == 200
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(raw.decode()):
        samples = out.setdefault(family.name, {})
        for sample in family.samples:
            samples[sample.name] = sample.value
    return out


def gauge(eng: Engine, name: str) -> float:
    return metrics(eng)[name][name]


def queued_is(eng: Engine, name: str, count: int) -> Callable[[], bool]:
    return lambda: gauge(eng, name) == count


def test_health_models_and_a_completion(engine: tuple[str, Engine]) -> None:
    dialect, eng = engine
    status, raw = eng.request("GET", "/health")
    assert status == 200 and raw == b""
    status, out = eng.request("GET", "/v1/models")
    ids = [card["id"] for card in json.loads(out)["data"]]
    assert ids == ([SERVED, "other-name"] if dialect == "vllm" else [SERVED])
    status, body = eng.post(
        "/v1/completions", {"model": SERVED, "prompt": "hello", "max_tokens": 4, "priority": 0}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert body["model"] == SERVED and body["choices"][0]["finish_reason"] == "length"
    if dialect == "vllm":
        status, out = eng.request("GET", "/version")
        assert status == 200 and json.loads(out) == {"version": "0.11.0"}
    else:
        status, out = eng.request("GET", "/health_generate")
        assert status == 200


def test_metric_names(engine: tuple[str, Engine]) -> None:
    dialect, eng = engine
    eng.post("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 3})
    found = metrics(eng)
    assert METRICS[dialect] <= set(found), sorted(METRICS[dialect] - set(found))
    ttft = f"{dialect}:time_to_first_token_seconds"
    assert found[ttft][f"{ttft}_count"] >= 1
    _, raw = eng.request("GET", "/metrics")
    if dialect == "vllm":
        # vLLM V1 labels every family model_name=<first served name>, engine="0".
        assert 'vllm:num_preemptions_total{engine="0",model_name="llama"}' in raw.decode()
    # The agent's parser for the real engine reads every replica figure off the stand-in.
    sample = scrape.parse(dialect, {"/metrics": raw.decode()})
    assert None not in (sample.running, sample.waiting, sample.kv_used_fraction)
    assert {"generation_tokens", "prompt_tokens", "preemptions"} <= set(sample.counters)
    assert {"ttft", "e2e", "itl"} <= set(sample.histograms)


def test_error_bodies(engine: tuple[str, Engine]) -> None:
    dialect, eng = engine
    status, body = eng.post("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 0})
    assert status == 400
    if dialect == "vllm":
        assert body["error"]["code"] == 400 and body["error"]["param"] == "max_tokens"
        status, body = eng.post("/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404
        assert body == {
            "error": {
                "message": "The model `nope` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
        # No "model" at all: the served one.
        status, body = eng.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 200 and body["model"] == SERVED
        # A priority under fcfs would be refused; here the priority policy is on.
        status, _ = eng.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 5})
        assert status == 200
    else:
        assert body["object"] == "error" and body["code"] == 400
        assert body["type"] == "BadRequestError" and "max_tokens" in body["message"]
        # SGLang serves whatever "model" says.
        status, body = eng.post(
            "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1}
        )
        assert status == 200


def test_interactive_starts_before_the_queued_batch(engine: tuple[str, Engine]) -> None:
    dialect, eng = engine
    running, waiting = GAUGES[dialect]
    finished: list[str] = []
    lock = threading.Lock()

    def generate(name: str, priority: int) -> None:
        body = {"model": SERVED, "prompt": name, "max_tokens": 30, "ignore_eos": True}
        status, _ = eng.post("/v1/completions", {**body, "priority": priority})
        with lock:
            finished.append(name if status == 200 else f"{name}:{status}")

    # A long batch stream holds the one running slot until we hang up. (Without a priority it
    # would rank last in SGLang, and the first batch request would preempt it.)
    holder = eng.connection(timeout=30)
    body = {"model": SERVED, "prompt": "hold", "max_tokens": 100_000, "ignore_eos": True}
    body["priority"] = 10
    holder.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                   {"Content-Type": "application/json"})  # fmt: skip
    assert holder.getresponse().status == 200
    wait_for("the slot taken", lambda: gauge(eng, running) == 1, 10, every=0.02)
    threads: list[threading.Thread] = []
    queue = [("batch0", 10), ("batch1", 10), ("batch2", 10), ("interactive", 0)]
    for queued, (name, priority) in enumerate(queue, start=1):
        threads.append(threading.Thread(target=generate, args=(name, priority), daemon=True))
        threads[-1].start()
        wait_for(f"{queued} queued", queued_is(eng, waiting, queued), 10, every=0.02)
    holder.close()  # the stand-in aborts the stream; the queue runs one request at a time
    for thread in threads:
        thread.join(timeout=30)
    assert finished == ["interactive", "batch0", "batch1", "batch2"], eng.log_text()[-2000:]


@pytest.mark.parametrize("dialect", sorted(MODULES))
def test_version_and_an_unknown_flag(dialect: str) -> None:
    command = [sys.executable, "-m", MODULES[dialect]]
    done = subprocess.run([*command, "--version"], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0 and b"stand-in" in done.stdout
    spec(dialect).check_version(done.stdout.decode())
    bad = [*ARGS[dialect], "--port", "1", "--no-such-flag"]
    done = subprocess.run([*command, *bad], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 2 and b"--no-such-flag" in done.stderr
