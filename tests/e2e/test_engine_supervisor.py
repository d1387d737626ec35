"""EngineSupervisor against real processes: a TEST-LOCAL fake trtllm-serve (below, written to
tmp_path and run with sys.executable) that takes the same command line and serves the same API:
its port is bound but not listening while it "loads" (connection refused), /health 503 then
200, /metrics hands out new iteration-stats entries and forgets them, /prometheus/metrics
carries histograms that grow by the same observations on every scrape, SIGTERM exits 0. It
records its argv, CUDA_VISIBLE_DEVICES and the pid of a child (a stand-in for an MPI rank) in
FAKE_ENGINE_DIR. FAKE_MODE: ok | crash (exit 3 at once) | ignore_term | never_ready. Files in
FAKE_ENGINE_DIR steer every engine: `idle` (no iterations, gauges 0), `sick` (/health 503).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from procs import alive

from fleet_agent.engine.engine_metrics import bucket_delta, histogram_quantile, parse_prometheus
from fleet_agent.engine.supervisor import EngineSupervisor, SupervisorConfig
from fleet_core.engines.trtllm import extra_llm_api_options, trtllm_serve_argv

FAKE_ENGINE = textwrap.dedent(
    r"""
    import json, os, signal, socket, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def flag(name, default=None):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

    if "--version" in sys.argv:  # the version check: VERSION beside this script, else 1.1.0
        beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "VERSION")
        print("fake engine", open(beside).read().strip() if os.path.exists(beside) else "1.1.0")
        sys.exit(0)
    host, port = flag("--host"), int(flag("--port"))
    dialect = os.environ.get("FAKE_DIALECT", "trtllm")  # vllm: Prometheus text at /metrics
    control = os.environ["FAKE_ENGINE_DIR"]
    mode = os.environ.get("FAKE_MODE", "ok")
    load_s = 3600.0 if mode == "never_ready" else float(os.environ.get("FAKE_LOAD_S", "0.3"))
    warm_s = float(os.environ.get("FAKE_WARM_S", "0.2"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    info = {
        "pid": os.getpid(), "ppid": os.getppid(), "child": child.pid, "argv": sys.argv[1:],
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "options": open(flag("--extra_llm_api_options")).read() if dialect == "trtllm" else None,
        "agent_token": os.environ.get("FLEET_AGENT_TOKEN"),
        "external": os.environ.get("EXTERNAL_ONLY"),
    }
    path = os.path.join(control, f"engine-{port}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    if mode == "crash":
        print("fake engine: CUDA out of memory", file=sys.stderr, flush=True)
        child.kill()
        sys.exit(3)

    lock = threading.Lock()
    counters = {"iter": 0, "scrapes": 0}
    idle = lambda: os.path.exists(os.path.join(control, "idle"))

    def entry(n):
        return {
            "iter": n, "iterLatencyMS": 10.0, "numActiveRequests": 3, "numQueuedRequests": 2,
            "numCompletedRequests": 1, "maxNumActiveRequests": 64, "gpuMemUsage": 10**9,
            "kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 75, "usedNumBlocks": 25,
                             "tokensPerBlock": 32, "reusedBlocks": 10, "missedBlocks": 10,
                             "cacheHitRate": 0.5},
            "inflightBatchingStats": {"numScheduledRequests": 3, "numContextRequests": 0,
                                      "numGenRequests": 3, "numPausedRequests": 0,
                                      "numCtxTokens": 0, "microBatchId": 0},
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
        }

    def histogram(name, bounds, k):
        lines = [f"# HELP {name} fake", f"# TYPE {name} histogram"]
        for le, n in bounds:
            lines.append(f'{name}_bucket{{le="{le}",model_name="fake"}} {n * k}')
        lines.append(f'{name}_count{{model_name="fake"}} {bounds[-1][1] * k}')
        lines.append(f'{name}_sum{{model_name="fake"}} {k}')
        return lines

    def prometheus():
        with lock:
            counters["scrapes"] += 1
            k = counters["scrapes"]
        busy = not idle()
        lines = histogram("trtllm_time_to_first_token_seconds",
                          [("0.1", 5), ("0.25", 9), ("0.5", 10), ("+Inf", 10)], k)
        lines += histogram("trtllm_e2e_request_latency_seconds",
                           [("0.5", 2), ("1.0", 6), ("2.5", 10), ("+Inf", 10)], k)
        lines += ["# TYPE trtllm_generation_tokens_total counter",
                  f'trtllm_generation_tokens_total{{model_name="fake"}} {100 * k}',
                  "# TYPE trtllm_num_requests_running gauge",
                  f'trtllm_num_requests_running{{model_name="fake"}} {3 if busy else 0}',
                  "# TYPE trtllm_num_requests_waiting gauge",
                  f'trtllm_num_requests_waiting{{model_name="fake"}} {2 if busy else 0}',
                  "# TYPE trtllm_kv_cache_utilization gauge",
                  'trtllm_kv_cache_utilization{model_name="fake"} 0.25']
        return "\n".join(lines) + "\n"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, body=b"", kind="text/plain"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                sick = os.path.exists(os.path.join(control, "sick"))
                self.reply(200 if time.monotonic() >= ready_at and not sick else 503)
            elif self.path == "/metrics" and dialect == "vllm":
                self.reply(200, b"# TYPE vllm:num_requests_running gauge\n"
                           b"vllm:num_requests_running 3\n"
                           b"# TYPE vllm:num_preemptions_total counter\n"
                           b"vllm:num_preemptions_total 7\n")
            elif self.path == "/metrics":  # new entries, forgotten once read
                entries = []
                if not idle():
                    with lock:
                        for _ in range(2):
                            counters["iter"] += 1
                            entries.append(entry(counters["iter"]))
                self.reply(200, json.dumps(entries).encode(), "application/json")
            elif self.path == "/prometheus/metrics":
                self.reply(200, prometheus().encode(), "text/plain; version=0.0.4")
            else:
                self.reply(404)

    server = ThreadingHTTPServer((host, port), Handler, bind_and_activate=False)
    server.daemon_threads = True
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.server_bind()  # bound, not listening: connections are refused while loading
    serving = False

    def on_term(signum, frame):
        if not serving:
            child.kill()
            sys.exit(0)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore_term" else on_term)
    print(f"fake engine loading on {host}:{port}", file=sys.stderr, flush=True)
    time.sleep(load_s)
    server.server_activate()
    ready_at = time.monotonic() + warm_s
    serving = True
    server.serve_forever(poll_interval=0.05)
    server.server_close()
    child.kill()
    child.wait()
    sys.exit(0)
    """
)

ASSIGNMENT: dict[str, Any] = {
    "kind": "serve",
    "deployment": "llama-8b",
    "model_uri": "s3://bucket/llama-3.1-8b",
    "model_checksum": "sha256:00",
    "engine_params": {
        "backend": "pytorch",
        "tp_size": 2,
        "pp_size": 1,
        "max_batch_size": 64,
        "max_num_tokens": 4096,
        "kv_cache_free_gpu_memory_fraction": 0.85,
    },
    "gpus_per_replica": 2,
    "replicas": 4,
}


def _assignment(replicas: int, **params: Any) -> dict[str, Any]:
    engine_params = {**ASSIGNMENT["engine_params"], **params}
    return {
        **ASSIGNMENT,
        "replicas": replicas,
        "engine_params": engine_params,
        "gpus_per_replica": engine_params["tp_size"] * engine_params["pp_size"],
    }


def _free_base_port(count: int) -> int:
    """A base port with `count` free ports after it (bounded tries)."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def _wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if alive(p)], "processes outlived the supervisor"


def _wait(
    sup: EngineSupervisor, check: Callable[[], bool], timeout: float = 10.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.poll()
        if check():
            return
        time.sleep(0.03)
    raise AssertionError(f"timed out waiting for {what}: {sup.replica_stats()}")


def _infos(control: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(control.glob("engine-*.json"))]


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.script = tmp_path / "fake_trtllm_serve.py"
        self.script.write_text(FAKE_ENGINE)
        self.control = tmp_path / "control"
        self.control.mkdir()
        self.supervisors: list[EngineSupervisor] = []

    def supervisor(self, replicas: int, **overrides: Any) -> EngineSupervisor:
        env = {"FAKE_ENGINE_DIR": str(self.control), **overrides.pop("env", {})}
        settings: dict[str, Any] = {
            "load_timeout_s": 10.0,
            "restart_backoff_s": 0.2,
            "restart_backoff_max_s": 1.0,
            "max_consecutive_crashes": 3,
            "stop_grace_s": 3.0,
            "poll_interval_s": 0.05,
            "leash_bound_s": None,  # the engine is the direct child (leash tests set it)
            **overrides,
        }
        config = SupervisorConfig(
            engine_command=(sys.executable, str(self.script)),
            base_port=_free_base_port(replicas),
            work_dir=self.tmp_path / "work",
            extra_env=env,
            **settings,
        )
        sup = EngineSupervisor(config)
        self.supervisors.append(sup)
        return sup

    def engine_pids(self) -> list[int]:
        return [p for info in _infos(self.control) for p in (info["pid"], info["child"])]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    for sup in h.supervisors:
        sup.close(grace_s=0.5)
    _wait_gone(h.engine_pids())  # no orphan: every engine and every child it started


def _stats(sup: EngineSupervisor) -> list[dict[str, Any]]:
    return sup.replica_stats()


# ---------------------------------------------------------------------------------------------
# pure pieces


def test_histogram_quantile_like_prometheus() -> None:
    buckets = {0.1: 5.0, 0.25: 9.0, 0.5: 10.0, float("inf"): 10.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.375)
    assert histogram_quantile(0.0, buckets) == 0.0
    # A rank in the +Inf bucket: the highest finite bound.
    assert histogram_quantile(0.99, {1.0: 1.0, 2.0: 2.0, float("inf"): 10.0}) == 2.0
    # No observations, no +Inf bucket, a single bucket: no answer (NaN in PromQL).
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.5, {1.0: 3.0, 2.0: 4.0}) is None
    assert histogram_quantile(0.5, {float("inf"): 4.0}) is None
    # A first bucket with a non-positive bound answers that bound.
    assert histogram_quantile(0.1, {-1.0: 5.0, 1.0: 10.0, float("inf"): 10.0}) == -1.0
    # Counts that dip are made monotonic first ({3: 4} counts as 5: 3 + 1/3, not 3 + 2/4).
    dipping = {1.0: 2.0, 2.0: 5.0, 3.0: 4.0, 4.0: 8.0, float("inf"): 8.0}
    assert histogram_quantile(0.75, dipping) == pytest.approx(3 + 1 / 3)
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_parse_prometheus_sums_label_sets() -> None:
    text = textwrap.dedent(
        """\
        # TYPE trtllm_time_to_first_token_seconds histogram
        trtllm_time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 1
        trtllm_time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 2
        trtllm_time_to_first_token_seconds_bucket{le="0.1",model_name="b"} 3
        trtllm_time_to_first_token_seconds_bucket{le="+Inf",model_name="b"} 3
        trtllm_time_to_first_token_seconds_count{model_name="a"} 2
        trtllm_time_to_first_token_seconds_sum{model_name="a"} 0.2
        # TYPE trtllm_generation_tokens_total counter
        trtllm_generation_tokens_total{model_name="a"} 10
        trtllm_generation_tokens_total{model_name="b"} 5
        # TYPE trtllm_num_requests_running gauge
        trtllm_num_requests_running{model_name="a"} 3
        trtllm_num_requests_running{model_name="b"} 1
        """
    )
    snap = parse_prometheus(text)
    assert snap.histograms["trtllm_time_to_first_token_seconds"] == {0.1: 4.0, float("inf"): 5.0}
    assert snap.counters["trtllm_generation_tokens_total"] == 15.0
    assert snap.gauges["trtllm_num_requests_running"] == [3.0, 1.0]
    assert bucket_delta({0.1: 6.0, float("inf"): 9.0}, {0.1: 4.0, float("inf"): 5.0}) == {
        0.1: 2.0,
        float("inf"): 4.0,
    }
    assert bucket_delta({0.1: 6.0}, None) == {0.1: 6.0}


def test_config_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engine_command"):
        SupervisorConfig(work_dir=tmp_path, engine_command=())
    with pytest.raises(ValueError, match="max_consecutive_crashes"):
        SupervisorConfig(work_dir=tmp_path, max_consecutive_crashes=0)


# ---------------------------------------------------------------------------------------------
# real processes


def test_four_replicas_pinned_loaded_measured_restarted(harness: Harness) -> None:
    # extra_env may not unpin a replica: the supervisor's CUDA_VISIBLE_DEVICES wins.
    sup = harness.supervisor(
        4, env={"FAKE_LOAD_S": "0.5", "CUDA_VISIBLE_DEVICES": "9"}, stats_window_s=60.0
    )
    sup.apply(ASSIGNMENT, gpus=range(8))
    assert [r["state"] for r in _stats(sup)] == ["loading"] * 4  # spawned by apply itself
    sup.poll()  # the ports refuse connections while the engines load
    assert not sup.ready and [r["state"] for r in _stats(sup)] == ["loading"] * 4
    assert all(r["last_error"] is None for r in _stats(sup))

    _wait(sup, lambda: sup.ready, what="4 replicas ready")
    stats = _stats(sup)
    base = stats[0]["port"]
    assert [r["port"] for r in stats] == [base, base + 1, base + 2, base + 3]
    assert [r["gpus"] for r in stats] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r["url"] for r in stats] == [f"http://127.0.0.1:{base + i}" for i in range(4)]
    assert all(0.5 <= r["load_seconds"] < 5.0 for r in stats), stats  # spawn → /health 200
    assert all(r["restarts"] == 0 for r in stats)

    # Each engine got its replica's GPUs, port and the deployment's YAML.
    infos = {
        info["argv"][info["argv"].index("--port") + 1]: info for info in _infos(harness.control)
    }
    work = harness.tmp_path / "work"
    options_path = work / "llama-8b" / "extra-llm-api-options.yaml"
    for i, r in enumerate(stats):
        info = infos[str(r["port"])]
        assert info["pid"] == r["pid"]
        assert info["cuda"] == f"{2 * i},{2 * i + 1}"
        assert [harness.script.as_posix(), *info["argv"]] == trtllm_serve_argv(
            (harness.script.as_posix(),),
            str(work / "models" / "llama-8b" / "llama-3.1-8b"),
            ASSIGNMENT["engine_params"],
            "127.0.0.1",
            r["port"],
            str(options_path),
        )
        assert yaml.safe_load(info["options"]) == extra_llm_api_options(ASSIGNMENT["engine_params"])
    assert (work / "llama-8b" / "replica-2.log").read_text().count("fake engine loading") == 1

    # Stats: two more polls give every replica a window of two scrapes.
    sup.poll()
    first = [e["iter"] for e in sup.iteration_stats(0)]
    sup.poll()
    second = [e["iter"] for e in sup.iteration_stats(0)]
    assert len(first) == len(second) == 2 and min(second) > max(first)  # only new entries
    for r in _stats(sup):
        assert (r["queued"], r["running"]) == (2, 3)
        assert r["kv_used_fraction"] == pytest.approx(0.25)
        assert r["cache_hit_rate"] == pytest.approx(0.5)
        assert r["ttft_p50_s"] == pytest.approx(0.1)
        assert r["ttft_p95_s"] == pytest.approx(0.375)
        assert r["e2e_p50_s"] == pytest.approx(0.875)
        assert r["e2e_p95_s"] == pytest.approx(2.3125)
        assert r["tokens_per_s"] is not None and r["tokens_per_s"] > 0
    assert sup.in_flight() == 4 * (2 + 3)
    json.dumps(sup.replica_stats())  # JSON-ready

    # Idle engines run no iterations: /metrics is empty, the Prometheus gauges say 0.
    (harness.control / "idle").touch()
    sup.poll()
    assert sup.in_flight() == 0 and sup.iteration_stats(1) == []
    (harness.control / "idle").unlink()

    # SIGKILL one engine (its child survives it): not ready, restarted after the backoff.
    victim = _stats(sup)[1]
    others = {r["index"]: r["pid"] for r in _stats(sup) if r["index"] != 1}
    orphan = infos[str(victim["port"])]["child"]
    os.kill(victim["pid"], signal.SIGKILL)
    _wait(sup, lambda: _stats(sup)[1]["restarts"] == 1, what="the crash seen")
    crashed = _stats(sup)[1]
    assert not sup.ready
    assert crashed["state"] == "loading"
    assert "exited with code -9" in crashed["last_error"]
    _wait_gone([orphan])  # the group kill took the dead leader's child too
    _wait(sup, lambda: sup.ready, what="ready again")
    again = _stats(sup)[1]
    assert again["restarts"] == 1 and again["pid"] != victim["pid"]
    assert again["load_seconds"] is not None and again["load_seconds"] >= 0.5
    assert {r["index"]: r["pid"] for r in _stats(sup) if r["index"] != 1} == others

    pids = harness.engine_pids()
    sup.stop_all(grace_s=5.0)
    assert sup.replica_stats() == [] and not sup.ready and sup.deployment is None
    _wait_gone(pids, timeout=1.0)


def test_unhealthy_engine_is_restarted(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_AGENT_TOKEN", "secret")  # the agent's; never the engine's
    sup = harness.supervisor(1, env={"FAKE_LOAD_S": "0.1"}, unhealthy_restart_s=0.3)
    sup.apply(_assignment(1, tp_size=1), gpus=[0])
    _wait(sup, lambda: sup.ready, what="ready")
    (harness.control / "sick").touch()
    _wait(sup, lambda: _stats(sup)[0]["state"] == "unhealthy", what="unhealthy")
    assert "/health answered 503" in _stats(sup)[0]["last_error"]
    _wait(sup, lambda: _stats(sup)[0]["restarts"] == 1, what="restarted")
    assert "unhealthy for 0.3 s" in _stats(sup)[0]["last_error"]
    (harness.control / "sick").unlink()
    _wait(sup, lambda: sup.ready, what="ready again")
    assert [info["agent_token"] for info in _infos(harness.control)] == [None, None]


def test_crash_loop_fails_after_max_consecutive_crashes(harness: Harness) -> None:
    sup = harness.supervisor(1, env={"FAKE_MODE": "crash"})
    sup.apply(_assignment(1, tp_size=1), gpus=[0])
    _wait(sup, lambda: _stats(sup)[0]["state"] == "failed", what="failed")
    r = _stats(sup)[0]
    assert r["restarts"] == 2  # started, crashed, restarted twice, third crash: failed
    assert r["pid"] is None and not sup.ready
    assert "exited with code 3: fake engine: CUDA out of memory" in r["last_error"]
    assert len(_infos(harness.control)) == 3
    for _ in range(3):  # failed stays failed
        sup.poll()
    assert _stats(sup)[0]["state"] == "failed" and len(_infos(harness.control)) == 3


def test_load_timeout_kills_and_restarts(harness: Harness) -> None:
    sup = harness.supervisor(1, env={"FAKE_MODE": "never_ready"}, load_timeout_s=0.5)
    sup.apply(_assignment(1, tp_size=1), gpus=[0])
    first = _stats(sup)[0]["pid"]
    _wait(sup, lambda: _stats(sup)[0]["state"] == "restarting", what="a load timeout")
    assert "not ready within load_timeout_s (0.5 s)" in _stats(sup)[0]["last_error"]
    # Killed with its whole group (its child too, if it got as far as starting one).
    children = [i["child"] for i in _infos(harness.control) if i["pid"] == first]
    _wait_gone([first, *children])


def test_port_in_use_is_reported(harness: Harness) -> None:
    sup = harness.supervisor(1)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", sup.config.base_port))
        squatter.listen()
        sup.apply(_assignment(1, tp_size=1), gpus=[0])
        _wait(sup, lambda: _stats(sup)[0]["state"] == "failed", what="failed")
    assert "is in use by another process" in _stats(sup)[0]["last_error"]
    assert _infos(harness.control) == []  # never spawned onto a taken port


def test_apply_is_idempotent_and_switches_deployments(harness: Harness) -> None:
    sup = harness.supervisor(2, env={"FAKE_LOAD_S": "0.1"})
    sup.start()  # the background thread polls; this test only reads
    sup.start()  # a second start is a no-op

    def settle(check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 10.0
        while not check():
            assert time.monotonic() < deadline, f"{what}: {sup.replica_stats()}"
            time.sleep(0.03)

    first = _assignment(2)
    sup.apply(first, gpus=range(4))
    settle(lambda: sup.ready, "ready")
    pids = [r["pid"] for r in _stats(sup)]
    assert sup.deployment == "llama-8b"

    sup.apply(json.loads(json.dumps(first)), gpus=[3, 2, 1, 0])  # equal: nothing restarts
    sup.apply({**first, "engine_params": dict(reversed(first["engine_params"].items()))})
    time.sleep(0.2)
    assert [r["pid"] for r in _stats(sup)] == pids and sup.ready

    second = _assignment(2, max_batch_size=32)  # different: stop all, then start anew
    sup.apply(second, gpus=range(4))
    assert not sup.ready
    settle(lambda: sup.ready and [r["pid"] for r in _stats(sup)] != pids, "switched")
    _wait_gone(pids)
    new = {info["pid"]: info for info in _infos(harness.control)}
    for r in _stats(sup):
        argv = new[r["pid"]]["argv"]
        assert argv[argv.index("--max_batch_size") + 1] == "32"

    with pytest.raises(ValueError, match="unknown engine_params bogus"):
        sup.apply(_assignment(2, bogus=1), gpus=range(4))
    assert sup.replica_stats() == [] and "bogus" in (sup.assignment_error or "")
    with pytest.raises(ValueError, match="bogus"):  # the same again: the same answer
        sup.apply(_assignment(2, bogus=1), gpus=range(4))
    sup.apply(second, gpus=range(4))
    settle(lambda: sup.ready, "ready after a bad assignment")
    assert sup.assignment_error is None

    sup.apply({"kind": "drain"})  # the daemon drains: the engines keep serving
    assert sup.ready
    running = harness.engine_pids()
    sup.apply(None)
    assert sup.replica_stats() == [] and sup.deployment is None
    _wait_gone(running)  # SIGTERM from apply, reaped by the thread's polls
    sup.apply({"kind": "none"})  # again: nothing to do


def test_a_fetched_version_runs_on_its_cache_path(harness: Harness, tmp_path: Path) -> None:
    """model_dir (the weights cache's engine_path) replaces model_root/<deployment>/<name>;
    the version is reported; the cache's own fields (stage, keep) restart nothing; a new
    version (a rollout) restarts the engines on its path. Weights Fleet did not fetch get
    external_env on top of extra_env."""
    sup = harness.supervisor(1, env={"FAKE_LOAD_S": "0.1"}, external_env={"EXTERNAL_ONLY": "1"})
    v1_dir = tmp_path / "cache" / "llama-3.1-8b" / "v1" / "llama-3.1-8b"
    ref = {"model": "llama-3.1-8b", "version": "v1", "key": "llama-3.1-8b@v1", "artifacts": []}
    first = {**_assignment(1), "model": ref, "stage": [], "keep": ["llama-3.1-8b@v1"]}
    sup.apply(first, gpus=[0, 1], model_dir=v1_dir)
    _wait(sup, lambda: sup.ready, what="ready on v1")
    [info] = _infos(harness.control)
    assert info["argv"][0] == str(v1_dir) and info["external"] is None
    assert sup.version == "llama-3.1-8b@v1"
    assert [r["version"] for r in _stats(sup)] == ["llama-3.1-8b@v1"]

    staged = {**first, "stage": [{**ref, "version": "v2", "key": "llama-3.1-8b@v2"}]}
    sup.apply({**staged, "keep": ["llama-3.1-8b@v1", "llama-3.1-8b@v2"]}, [0, 1], model_dir=v1_dir)
    assert [r["pid"] for r in _stats(sup)] == [info["pid"]] and sup.ready  # nothing restarts

    v2_dir = tmp_path / "cache" / "llama-3.1-8b" / "v2" / "llama-3.1-8b"
    second = {**first, "model": {**ref, "version": "v2", "key": "llama-3.1-8b@v2"}}
    sup.apply(second, gpus=[0, 1], model_dir=v2_dir)
    assert sup.version == "llama-3.1-8b@v2" and not sup.ready  # its replicas start anew
    _wait(sup, lambda: sup.ready, what="ready on v2")
    assert [i["argv"][0] for i in _infos(harness.control)].count(str(v2_dir)) == 1

    sup.apply(_assignment(1), gpus=[0, 1])  # no model: the old path, external_env on top
    _wait(sup, lambda: sup.ready, what="ready on the external path")
    assert sup.version is None
    last = [i for i in _infos(harness.control) if i["external"] == "1"]
    assert [i["argv"][0] for i in last] == [
        str(tmp_path / "work" / "models" / "llama-8b" / "llama-3.1-8b")
    ]


def test_tp_pp_must_match_gpus_per_replica(harness: Harness) -> None:
    sup = harness.supervisor(1)
    with pytest.raises(ValueError, match=r"must equal tp_size × pp_size \(2 × 1\)"):
        sup.apply({**ASSIGNMENT, "gpus_per_replica": 1}, gpus=range(8))
    with pytest.raises(ValueError, match="cannot hold one replica"):
        sup.apply(ASSIGNMENT, gpus=[0])
    with pytest.raises(ValueError, match="unknown assignment kind"):
        sup.apply({"kind": "dance"})


def test_switch_waits_for_old_engines_and_stop_all_escalates(harness: Harness) -> None:
    sup = harness.supervisor(2, env={"FAKE_MODE": "ignore_term", "FAKE_LOAD_S": "0.1"})
    sup = harness.supervisors[-1]
    sup.apply(_assignment(2), gpus=range(4))
    _wait(sup, lambda: sup.ready, what="ready")
    old = harness.engine_pids()

    # Switching: the old engines ignore SIGTERM, so the new ones wait (same GPUs and ports)
    # until stop_grace_s has passed and the old ones are SIGKILLed.
    started = time.monotonic()
    sup.apply(_assignment(2, max_num_tokens=2048), gpus=range(4))
    sup.poll()
    assert [r["state"] for r in _stats(sup)] == ["starting"] * 2
    _wait(sup, lambda: sup.ready, what="the new deployment ready")
    assert time.monotonic() - started >= sup.config.stop_grace_s
    _wait_gone(old)

    pids = [r["pid"] for r in _stats(sup)]
    started = time.monotonic()
    sup.stop_all(grace_s=0.5)  # SIGTERM to both at once, SIGKILL after 0.5 s
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 4.0, elapsed
    _wait_gone(pids, timeout=1.0)


# ---------------------------------------------------------------------------------------------
# engines other than trtllm, and the version check


def _vllm_assignment(**params: Any) -> dict[str, Any]:
    return {
        **ASSIGNMENT,
        "engine": "vllm",
        "engine_params": {"tensor_parallel_size": 2, **params},
        "gpus_per_replica": 2,
        "replicas": 1,
        "model": {"model": "llama-3.1-8b-instruct", "key": "llama-3.1-8b-instruct@v1"},
    }


def test_vllm_replica_runs_its_own_command_and_reads_its_metrics(harness: Harness) -> None:
    fake = (sys.executable, str(harness.script))
    sup = harness.supervisor(
        1, engine_commands={"vllm": fake}, env={"FAKE_DIALECT": "vllm", "FAKE_LOAD_S": "0.1"}
    )
    (harness.script.parent / "VERSION").write_text("0.11.0\n")
    sup.apply(_vllm_assignment(), gpus=range(2))
    _wait(sup, lambda: sup.ready and _stats(sup)[0]["running"] == 3, what="vllm ready")
    [info] = _infos(harness.control)
    port = str(sup.config.base_port)
    # `vllm serve MODEL ...`, both served names (deployment, model), priority scheduling on.
    assert info["argv"][:2] == [
        "serve",
        str(harness.tmp_path / "work/models/llama-8b/llama-3.1-8b"),
    ]
    assert info["argv"][2:] == [
        "--host", "127.0.0.1", "--port", port,
        "--served-model-name", "llama-8b", "llama-3.1-8b-instruct",
        "--tensor-parallel-size", "2",
        "--scheduling-policy", "priority",
    ]  # fmt: skip
    assert info["cuda"] == "0,1"
    [stats] = _stats(sup)
    assert (stats["engine"], stats["preemptions"], stats["last_error"]) == ("vllm", 7, None)
    assert sup.engine == "vllm"
    assert not list((harness.tmp_path / "work" / "llama-8b").glob("*.yaml"))  # trtllm's only


def test_sglang_argv_and_served_name_deduplicated(harness: Harness) -> None:
    fake = (sys.executable, str(harness.script))
    env = {"FAKE_DIALECT": "sglang", "FAKE_LOAD_S": "0.1"}
    sup = harness.supervisor(1, engine_commands={"sglang": fake}, env=env)
    (harness.script.parent / "VERSION").write_text("0.5.4\n")
    assignment = {
        **ASSIGNMENT,
        "engine": "sglang",
        "deployment": "llama-3.1-8b",  # the same as model_uri's basename: one served name
        "engine_params": {"tp_size": 1},
        "gpus_per_replica": 1,
        "replicas": 1,
    }
    sup.apply(assignment, gpus=[3])
    _wait(sup, lambda: bool(_infos(harness.control)), what="sglang started")
    [info] = _infos(harness.control)
    model = str(harness.tmp_path / "work/models/llama-3.1-8b/llama-3.1-8b")
    assert info["argv"] == [
        "--model-path", model, "--host", "127.0.0.1", "--port", str(sup.config.base_port),
        "--enable-metrics", "--served-model-name", "llama-3.1-8b",
        "--enable-priority-scheduling", "--schedule-low-priority-values-first",
        "--tp-size", "1",
    ]  # fmt: skip
    assert info["cuda"] == "3"


def test_engine_params_checked_by_the_deployments_engine(harness: Harness) -> None:
    sup = harness.supervisor(1)
    with pytest.raises(ValueError, match="tp_size"):  # trtllm's name, not vLLM's
        sup.apply({**_vllm_assignment(), "engine_params": {"tp_size": 2}}, gpus=range(2))
    with pytest.raises(ValueError, match=r"tensor_parallel_size × pipeline_parallel_size \(1 × 1"):
        sup.apply({**_vllm_assignment(), "engine_params": {}}, gpus=range(2))
    with pytest.raises(ValueError, match="engine 'triton'"):
        sup.apply({**ASSIGNMENT, "engine": "triton"}, gpus=range(8))


def test_unsupported_version_fails_the_replicas_once(harness: Harness) -> None:
    sup = harness.supervisor(2)
    (harness.script.parent / "VERSION").write_text("0.17.0\n")  # trtllm before 1.0
    sup.apply(_assignment(2), gpus=range(4))
    for _ in range(5):
        sup.poll()
    stats = _stats(sup)
    assert [r["state"] for r in stats] == ["failed", "failed"]
    assert stats[0]["last_error"] == (
        "trtllm-serve 0.17.0 is installed; this agent drives trtllm >=1.0,<1.3 "
        "(pip install 'fleet[gpu-trtllm]')"
    )
    assert _infos(harness.control) == []  # nothing was started
    assert len(sup._version_checks) == 1  # asked once for both replicas and every poll

    # A command that cannot answer at all: not final (a cold start may be slow, a package
    # half-installed): the replica backs off and asks again, and says why meanwhile.
    mute = (sys.executable, "-c", "raise SystemExit(4)")
    other = harness.supervisor(1, engine_commands={"trtllm": mute})
    other.apply(_assignment(1), gpus=range(2))
    [stat] = _stats(other)
    assert stat["state"] == "restarting"
    assert "exited with 4" in stat["last_error"] and "\n" not in stat["last_error"]
    assert other._version_checks == {}  # not remembered: asked again at the next start


def test_unknown_metrics_layout_keeps_serving_and_says_so(harness: Harness) -> None:
    # A vLLM deployment whose engine answers trtllm's JSON at /metrics: not zeros, one line.
    fake = (sys.executable, str(harness.script))
    env = {"FAKE_DIALECT": "json", "FAKE_LOAD_S": "0.1"}
    sup = harness.supervisor(1, engine_commands={"vllm": fake}, env=env)
    (harness.script.parent / "VERSION").write_text("0.11.0\n")
    sup.apply(_vllm_assignment(), gpus=range(2))
    _wait(sup, lambda: sup.ready and _stats(sup)[0]["last_error"] is not None, what="ready")
    [stats] = _stats(sup)
    assert stats["state"] == "ready"
    assert stats["last_error"].startswith("unsupported engine version: vllm /metrics has none")
    assert stats["running"] is None and stats["queued"] is None


def test_each_engines_command_from_the_agents_settings(tmp_path: Path) -> None:
    from pydantic import SecretStr

    from fleet_agent.config import AgentSettings
    from fleet_agent.main import build_supervisor

    settings = AgentSettings(
        server="gpu-1",
        token=SecretStr("flt_test"),
        work_dir=tmp_path,
        engine_command="/py -m fleet_agent.engine.standin",
        engine_command_vllm="/py -m fleet_agent.engine.standin.vllm",
        engine_leash_bound_s=0,
    )
    sup = build_supervisor(settings)
    try:
        config = sup.config
        assert config.command("trtllm") == ("/py", "-m", "fleet_agent.engine.standin")
        assert config.command("vllm") == ("/py", "-m", "fleet_agent.engine.standin.vllm")
        assert config.command("sglang") == ("python3", "-m", "sglang.launch_server")  # default
        assert config.check_versions and config.leash_bound_s is None
    finally:
        sup.close()
    assert AgentSettings(server="a", token=SecretStr("flt_x")).engine_leash_bound_s == 300.0
    with pytest.raises(ValueError, match="engine 'triton'"):
        SupervisorConfig(work_dir=tmp_path, engine_commands={"triton": ("x",)})


@pytest.mark.parametrize(
    ("engine", "module", "params"),
    [
        ("vllm", "fleet_agent.engine.standin.vllm", {"tensor_parallel_size": 1}),
        ("sglang", "fleet_agent.engine.standin.sglang", {"tp_size": 1}),
    ],
)
def test_each_engines_stand_in_serves_and_reports_stats(
    tmp_path: Path, engine: str, module: str, params: dict[str, Any]
) -> None:
    config = SupervisorConfig(
        work_dir=tmp_path / "work",
        engine_commands={engine: (sys.executable, "-m", module)},  # its version is checked
        base_port=_free_base_port(1),
        poll_interval_s=0.1,
        stop_grace_s=5.0,
        extra_env={
            "FLEET_STANDIN_GPU": "H100",
            "FLEET_STANDIN_LOAD_S": "0.2",
            "FLEET_STANDIN_MISSING_WEIGHTS": "ignore",
        },
    )
    assignment = {
        **ASSIGNMENT,
        "engine": engine,
        "engine_params": params,
        "gpus_per_replica": 1,
        "replicas": 1,
    }
    with EngineSupervisor(config) as sup:
        sup.apply(assignment, gpus=[0])
        _wait(sup, lambda: sup.ready, timeout=30.0, what=f"{engine} ready")
        [replica] = sup.replica_stats()
        body = {"model": "llama-8b", "prompt": "hello", "max_tokens": 4}
        with httpx.Client(timeout=30) as client:
            assert client.post(f"{replica['url']}/v1/completions", json=body).status_code == 200
        _wait(sup, lambda: sup.replica_stats()[0]["running"] is not None, what="stats")
        [replica] = sup.replica_stats()
        assert replica["engine"] == engine and replica["last_error"] is None
        assert replica["preemptions"] == 0 and replica["kv_used_fraction"] is not None
