"""Routing strategies on a mixed fleet: the Azure LLM inference trace replayed open loop.

    .venv/bin/python bench/routing.py [--requests 2400] [--load 0.8] [--trace conv|code]
        [--speedup 1] [--strategies round_robin,least_pending,...] [--max-batch-size 16]
        [--router-limit N] [--offset 0] [--warmup 0.1]
    .venv/bin/python bench/routing.py --all

About 5 minutes with the defaults (five strategies, 40 s of replay each, on 2 cores). `--all` is
issue 25's acceptance in one run, about 16 minutes: the code and conversation traces with
round-robin, least-pending and estimated completion time, then the multi-turn sessions
(bench/routing_sessions.py) and the callers (bench/routing_callers.py), then every goal again.

Fleet: 8 stand-in engines (python -m fleet_agent.engine.standin, Llama-3.1-8B FP8, chunked prefill,
--max_batch_size B) pretending to be 3 H200, 3 H100 and 2 L40S, listed in one routing-table file
with max_batch_size B, which is also the router's per-replica limit (`--router-limit N` leaves it
out of the table and sets FLEET_ROUTER_REPLICA_LIMIT=N instead: requests then also queue inside
the engines). The engines start once; each strategy gets a fresh router (`fleetctl router run
--table FILE --strategy NAME`, a subprocess, so its learned throughput and output estimate start
from the priors every time) and the SAME requests: the same sizes at the same times. Only the
prompts' unique heads change from one strategy to the next, so that no strategy reuses prefix
blocks cached by another; the engines are idle between runs. FLEET_ROUTER_* variables in the
environment reach every router and are printed; `--strategies NAME@KEY=VALUE` runs one strategy
with FLEET_ROUTER_KEY=VALUE (e.g. estimated_completion_time@PREFILL_WEIGHT=0.05), so settings
can be compared in one run. With one deployment, model_affinity is estimated_completion_time.

Agents: the engines have no fleet agent, so a STAND-IN FOR THE AGENT (this file with
--agent-shim, one subprocess) serves the agent's /state contract ({"ready", "draining",
"replicas": [{"url", "state", "queued", "running", "kv_used_fraction"}]}) at one URL per engine,
from the engine's /prometheus/metrics gauges scraped when the router asks (every 250 ms; a real
agent polls its engines once a second, so this is fresher than the real thing). Without it
least_kv would see no KV figure. It never reads /metrics, which empties on read.

Requests: a slice of the trace (fleet/data/traces/, Azure LLM inference 2023, CC BY 4.0, Patel et
al.,
Splitwise, ISCA 2024, read by fleet.traces), in trace order, with its real arrival pattern
(bursts included) compressed in time so that the mean offered load is `--load` of the fleet's
capacity. Each prompt is filler text of the trace's prompt length (4 characters per token, the
stand-in's tokenizer) with a unique head, sent with max_tokens = the trace's output length and
ignore_eos, streamed (SSE) so that TTFT is measured. NB: the router expects
min(max_tokens, its running mean of output lengths), so max_tokens = the true length tells it
the exact length of every answer shorter than that mean; a client that asks for more than it
gets (the usual case) tells it less.

Capacity: PREDICTED, not measured: fleet_core.cost_model's steady state for the slice's mix
(effective_lengths) at B streams per engine, summed over the fleet (the stand-in times its
iterations with that same model; bench/engine.py checks that the two agree, and the router's
measured capacities printed at the end come out within ~10 % of it). Perfect routing could
serve that rate; at --load 0.8 no engine need be full on average. Also printed: the cost
model's floor, each request alone on an idle H200, which no strategy can beat: a goal below it
is unreachable.

Time: --speedup is FLEET_STANDIN_SPEEDUP. Latencies and throughputs are printed in SIMULATED
seconds (wall x speed-up: what the modelled fleet would show); the load generator's lag in wall
milliseconds. The default is 1 (real time) on purpose: the Python processes spend CPU per
streamed token and per request, not per simulated second, so a speed-up multiplies the CPU the
run needs. At 1 the default run takes about one of this machine's 2 cores (router ~30 %, the 8
engines ~50 %, load generator ~15-20 %); at 3 the stand-ins fell behind the offered load (a 13 s
replay, TTFT p50 5 s for every strategy), so the figures measured Python and the OS scheduler,
not routing. Speed-up 1 also keeps the router's units straight: it measures capacity per wall
second while its cost-model prior is per simulated second. The report flags a run whose
finished rate falls short of the offered one, and a saturated router, load generator or machine.

Load generator: asyncio + aiohttp, open loop (each request leaves at its scheduled time whatever
happened to earlier ones; the garbage collector is off during the replay), one connection per
request in flight (kept alive). Lag = actual send time - scheduled time. The first --warmup
share of the replay is left out of the figures. Printed per strategy: latency and TTFT
p50/p95/p99, throughput, errors, lag; where the requests went (per GPU model, from the engines'
own Prometheus counters) and what the slowest 5 % were (their output length, and how many
decoded at an L40S's pace, told from their inter-token gaps); what the router learned (capacity
per replica, expected output); CPU per process; then every strategy's p95 as a ratio to
round-robin's and least-pending's, and the goals (issue 25): on the code trace
estimated_completion_time p95 <= 0.8 x least-pending with no 429 (stretch: <= 3 x the floor), on
the conversation trace <= 1.3 x the floor. Never fails on timing: exits non-zero only when
something does not start.

Bursts: the trace's arrival pattern, compressed, has bursts far above the mean rate (the code
trace's first 2,400 requests at 80 %: 655 arrivals in one second, 3.3 x capacity). Printed with
the floor: the burst bound, the same arrivals in ONE first-come-first-served queue drained at the
predicted capacity (fleet/router/admission.py's fluid_waits: perfect routing, no batching
slowdown): its deepest backlog (less the requests in flight at the replicas' limits, that is what
FLEET_ROUTER_QUEUE_BOUND must hold, or the burst gets 429s) and its latency p95 (wait + each
request alone on an H200). No FIFO router beats it; a goal below it is flagged unreachable.

Pace: on the conversation trace, whose goal is the floor's, also the pace bound
(bench/pace_bound.py, ~1 minute): in a fluid model of the fleet, the smallest R at which some
assignment of the requests keeps 95 % within R x the floor's p95, with every GPU busy all the
time, and at most 90 % and 85 % of it. A goal below the first is flagged unreachable for any
router.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/routing.py` puts bench/, not the repo, on the path
    sys.path.insert(0, str(REPO))

import pace_bound  # noqa: E402 - bench/ is on sys.path
from measure import cpu_seconds, free_port, pct, wait_until  # noqa: E402

from fleet.router.admission import fluid_waits  # noqa: E402
from fleet.router.estimates import prior_capacity  # noqa: E402
from fleet.router.strategy import PREFILL_WEIGHT, STRATEGIES  # noqa: E402
from fleet_core import cost_model as cm  # noqa: E402

MODEL = "llama-3.1-8b"
DEPLOYMENT = "llama"
FLEET = ("H200",) * 3 + ("H100",) * 3 + ("L40S",) * 2
# Issue 25's goals: estimated_completion_time's p95 against least-pending's (code trace, with no
# 429) and against the floor (stretch on the code trace; the goal on the conversation trace)
GOAL_CODE_VS_LP, STRETCH_CODE_VS_FLOOR, GOAL_CONV_VS_FLOOR = 0.8, 3.0, 1.3
PACE_BUSY = (1.0, 0.9, 0.85)  # the GPUs' busy shares the pace bound is solved for
ACCEPTANCE_STRATEGIES = ("round_robin", "least_pending", "estimated_completion_time")
HOST = "127.0.0.1"


# --- helpers ------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def healthy(url: str) -> bool:
    return http_get(f"{url}/health")[0] == 200


def stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def tail(path: Path, lines: int = 15) -> str:
    with suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# --- workload -----------------------------------------------------------------------------------

_FILLER = ("the quick brown fox jumps over the lazy dog and " * 8000)[: 4 * 40_000]


def prompt_text(run: int, serial: int, tokens: int) -> str:
    head = f"{run:02d}-{serial:07d} "  # unique per run and request: no prefix block is reused
    return (head + _FILLER)[: 4 * max(tokens, 4)]


@dataclass(frozen=True)
class Planned:
    at: float  # wall seconds after the start of the replay
    prompt: int
    output: int


def plan(
    trace: str, offset: int, count: int, rate_wall: float
) -> tuple[list[Planned], float, float]:
    """The slice, its arrival times compressed to `rate_wall` requests per wall second on
    average; also the trace's own span and rate over the slice."""
    from fleet.traces import load_trace

    rows = load_trace(trace)[offset : offset + count]
    if len(rows) < 2:
        raise RuntimeError(f"trace {trace!r} has fewer than 2 requests from offset {offset}")
    t0 = rows[0].at_s
    span = rows[-1].at_s - t0
    natural = (len(rows) - 1) / span
    scale = natural / rate_wall
    out = [Planned((r.at_s - t0) * scale, r.prompt_tokens, max(1, r.output_tokens)) for r in rows]
    return out, span, natural


def shape_for(gpu: str, batch: int) -> cm.EngineShape:
    return cm.EngineShape(gpu=cm.gpu_spec(gpu), model=cm.model_spec(MODEL), max_batch_size=batch)


def alone_seconds(shape: cm.EngineShape, prompt: int, output: int) -> tuple[float, float]:
    """(TTFT, latency) of one request alone on an idle engine, by the cost model: its prompt
    in max_num_tokens chunks (the last one also writes the first token), then one decode
    iteration per further token. No strategy can do better than this on that GPU."""
    ttft, done = 0.0, 0
    while done < prompt:
        chunk = min(shape.max_num_tokens, prompt - done)
        ttft += cm.iteration_seconds(shape, 0, chunk, done)
        done += chunk
    decode = (output - 1) * cm.iteration_seconds(shape, 1, 0, prompt + output // 2)
    return ttft, ttft + decode


# --- processes ----------------------------------------------------------------------------------


@dataclass
class Engine:
    gpu: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@contextmanager
def engines(gpus: Sequence[str], batch: int, speedup: float, logs: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        for i, gpu in enumerate(gpus):
            port = free_port()
            env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_STANDIN_")}
            env |= {
                "FLEET_STANDIN_GPU": gpu,
                "FLEET_STANDIN_MODEL": MODEL,
                "FLEET_STANDIN_SPEEDUP": str(speedup),
                "FLEET_STANDIN_LOAD_S": str(0.2 * speedup),  # 0.2 s of wall time
                "FLEET_STANDIN_DRAIN_S": "5",
            }
            argv = [sys.executable, "-m", "fleet_agent.engine.standin", MODEL, "--host", HOST]
            argv += ["--port", str(port), "--max_batch_size", str(batch)]
            argv += ["--enable_chunked_prefill", "--log_level", "warning"]
            with (logs / f"engine-{i}-{gpu}.log").open("ab") as out:
                proc = subprocess.Popen(
                    argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
                )
            started.append(Engine(gpu, port, proc))
        for i, e in enumerate(started):
            try:
                wait_until(f"engine {i} ({e.gpu})", partial(healthy, e.url), e.proc, 60)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{tail(logs / f'engine-{i}-{e.gpu}.log')}") from None
        yield started
    finally:
        for e in started:
            if e.proc.poll() is None:
                e.proc.send_signal(signal.SIGTERM)
        for e in started:
            stop(e.proc)


@contextmanager
def agent_shim(urls: Sequence[str], logs: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--agent-shim", str(port), *urls]
    with (logs / "agent-shim.log").open("ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://{HOST}:{port}"
    try:
        wait_until("agent shim", lambda: http_get(f"{base}/e/0/state")[0] == 200, proc, 30)
        yield base, proc
    finally:
        stop(proc)


def write_table(path: Path, fleet: Sequence[Engine], agent_base: str, batch: int | None) -> None:
    """The routing table: one deployment, one replica per engine, each with its own agent URL
    (the shim). Without `batch` the router's FLEET_ROUTER_REPLICA_LIMIT is the limit."""
    replicas = [
        {
            "server": f"s{i}-{e.gpu.lower()}",
            "gpu_model": e.gpu,
            "agent_url": f"{agent_base}/e/{i}",
            "url": e.url,
            "state": "ready",
        }
        for i, e in enumerate(fleet)
    ]
    row: dict[str, Any] = {
        "deployment": DEPLOYMENT,
        "models": [DEPLOYMENT, MODEL],
        "model_uri": f"s3://models/{MODEL}",
        "tp_size": 1,
        "replicas": replicas,
    }
    if batch is not None:
        row["max_batch_size"] = batch
    path.write_text(json.dumps({"results": [row]}, indent=1))


@dataclass(frozen=True)
class Variant:
    """A strategy, optionally with router settings: "NAME[@KEY=VALUE...]", KEY a FLEET_ROUTER_
    suffix (e.g. estimated_completion_time@PREFILL_WEIGHT=0.5)."""

    label: str
    strategy: str
    env: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, *settings = spec.split("@")
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r} (one of {', '.join(STRATEGIES)})")
        env = []
        for item in settings:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"{spec!r}: expected NAME@KEY=VALUE")
            env.append((f"FLEET_ROUTER_{key.upper()}", value))
        return cls(spec, name, tuple(env))


@contextmanager
def router(
    variant: Variant, table: Path, logs: Path, n_replicas: int, env_extra: dict[str, str]
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    env = dict(os.environ)
    env.setdefault("FLEET_ROUTER_LOG_LEVEL", "WARNING")
    env.setdefault("FLEET_ROUTER_CLIENT_AUTH", "none")  # the strategy phases: no callers
    env |= env_extra | dict(variant.env)
    argv = [sys.executable, "-m", "fleet.cli", "router", "run", "--table", str(table)]
    argv += ["--host", HOST, "--port", str(port), "--strategy", variant.strategy]
    log = logs / f"router-{len(list(logs.glob('router-*')))}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://{HOST}:{port}"

    def all_ready() -> bool:
        status, body = http_get(f"{base}/state")
        if status != 200:
            return False
        deps = json.loads(body)["deployments"]
        ready = [r for d in deps for r in d["replicas"] if r["ready"]]
        return len(ready) == n_replicas

    try:
        try:
            wait_until(f"router ({variant.label})", all_ready, proc, 30)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{tail(log)}") from None
        yield base, proc
    finally:
        stop(proc)


# --- the stand-in for the agent ------------------------------------------------------------------

_GAUGES = {
    "trtllm_num_requests_running": "running",
    "trtllm_num_requests_waiting": "queued",
    "trtllm_kv_cache_utilization": "kv_used_fraction",
}


def engine_gauges(text: str) -> dict[str, float]:
    """The three load gauges of a stand-in's /prometheus/metrics (one label set each)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("trtllm_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            key = _GAUGES.get(name)
            if key is not None:
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def run_agent_shim(port: int, urls: Sequence[str]) -> None:
    """A STAND-IN FOR THE FLEET AGENT's /state (fleet_agent/local_api.py), one path per engine:
    GET /e/<i>/state → the agent's JSON for a server whose one replica is engine i, from the
    engine's Prometheus gauges scraped on the spot (never /metrics: it empties on read)."""

    async def main() -> None:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.4))

        async def state(request: web.Request) -> web.Response:
            i = int(request.match_info["i"])
            url = urls[i]
            row: dict[str, Any] = {"url": url, "state": "ready"}
            try:
                async with session.get(f"{url}/prometheus/metrics") as reply:
                    ok = reply.status == 200
                    text = await reply.text() if ok else ""
            except (aiohttp.ClientError, TimeoutError):
                ok, text = False, ""
            if ok:
                g = engine_gauges(text)
                row |= {
                    "queued": int(g.get("queued", 0)),
                    "running": int(g.get("running", 0)),
                    "kv_used_fraction": g.get("kv_used_fraction"),
                }
            else:
                row["state"] = "unhealthy"
            return web.json_response({"ready": ok, "draining": False, "replicas": [row]})

        app = web.Application()
        app.router.add_get("/e/{i}/state", state)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, HOST, port).start()
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
        await runner.cleanup()
        await session.close()

    asyncio.run(main())


# --- engine counters (what went where) -------------------------------------------------------


@dataclass
class Counters:
    requests: float = 0.0
    e2e_sum: float = 0.0  # simulated seconds, as the engine reports them
    tokens: float = 0.0

    def minus(self, other: Counters) -> Counters:
        return Counters(
            self.requests - other.requests,
            self.e2e_sum - other.e2e_sum,
            self.tokens - other.tokens,
        )


def engine_counters(url: str) -> Counters:
    status, body = http_get(f"{url}/prometheus/metrics")
    c = Counters()
    if status != 200:
        return c
    for line in body.decode().splitlines():
        if line.startswith("trtllm_request_success_total{"):
            c.requests += float(line.rsplit(" ", 1)[1])
        elif line.startswith("trtllm_e2e_request_latency_seconds_sum{"):
            c.e2e_sum += float(line.rsplit(" ", 1)[1])
        elif line.startswith("trtllm_generation_tokens_total{"):
            c.tokens += float(line.rsplit(" ", 1)[1])
    return c


# --- the load generator -------------------------------------------------------------------------


@dataclass
class Outcome:
    due: float  # scheduled send, loop seconds
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None


async def send(session: aiohttp.ClientSession, url: str, body: bytes, outcome: Outcome) -> None:
    loop = asyncio.get_running_loop()
    outcome.sent = loop.time()
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as reply:
            if reply.status != 200:
                outcome.error = f"HTTP {reply.status}"
                await reply.read()
                return
            tokens = 0
            async for chunk in reply.content.iter_any():
                if outcome.first is None:
                    outcome.first = loop.time()
                tokens += chunk.count(b"data: ")
            outcome.end = loop.time()
            outcome.tokens = max(0, tokens - 1)  # less data: [DONE]
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.error = type(exc).__name__


async def replay(base: str, bodies: Sequence[bytes], times: Sequence[float]) -> list[Outcome]:
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=1800, sock_connect=10)
    url = f"{base}/v1/completions"
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start = loop.time() + 0.2
        for body, at in zip(bodies, times, strict=True):
            due = start + at
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(due)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(send(session, url, body, outcome)))
        await asyncio.gather(*tasks)
    return outcomes


# --- one strategy -------------------------------------------------------------------------------


@dataclass
class RunResult:
    label: str
    latency: list[float]  # simulated seconds, measured requests that succeeded
    ttft: list[float]
    lag: list[float]  # wall seconds, every request
    errors: dict[str, int]
    requests: int  # measured (after the warm-up)
    req_per_s: float  # simulated, finished in the measured window
    tok_per_s: float
    wall_s: float
    cpu: dict[str, float]  # share of one core, over the replay
    by_gpu: dict[str, Counters]
    learned: list[dict[str, Any]]  # the router's /state replicas at the end
    expected_output: float | None
    short_answers: int  # answers with fewer tokens than asked
    tail: tuple[int, float, float]  # slowest 5 %: count, mean output tokens, share at L40S pace


@dataclass(frozen=True)
class Setup:
    fleet: Sequence[Engine]
    shim: subprocess.Popen[bytes]
    table: Path
    logs: Path
    work: Sequence[Planned]
    warmup: float
    speedup: float
    router_env: dict[str, str]
    slow_itl_s: float  # a request's mean inter-token gap above this: it ran on an L40S


def cpu_now(setup: Setup, router_pid: int) -> dict[str, float]:
    return {
        "router": cpu_seconds(router_pid),
        "engines": sum(cpu_seconds(e.proc.pid) for e in setup.fleet),
        "agent shim": cpu_seconds(setup.shim.pid),
        "load gen": time.process_time(),
    }


def run_variant(run: int, variant: Variant, setup: Setup) -> RunResult:
    work, speedup = setup.work, setup.speedup
    bodies = [
        json.dumps(
            {
                "model": MODEL,
                "prompt": prompt_text(run, i, p.prompt),
                "max_tokens": p.output,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        for i, p in enumerate(work)
    ]
    times = [p.at for p in work]
    fleet = setup.fleet
    with router(variant, setup.table, setup.logs, len(fleet), setup.router_env) as (base, proc):
        before = [engine_counters(e.url) for e in fleet]
        cpu0 = cpu_now(setup, proc.pid)
        wall0 = time.monotonic()
        gc.collect()
        gc.disable()  # no collector pauses in the load generator's schedule
        try:
            outcomes = asyncio.run(replay(base, bodies, times))
        finally:
            gc.enable()
        wall = time.monotonic() - wall0
        cpu1 = cpu_now(setup, proc.pid)
        after = [engine_counters(e.url) for e in fleet]
        status, body = http_get(f"{base}/state")
        learned: list[dict[str, Any]] = []
        expected: float | None = None
        if status == 200:
            dep = json.loads(body)["deployments"][0]
            learned = dep["replicas"]
            expected = dep.get("expected_output_tokens")
    by_gpu: dict[str, Counters] = {}
    for e, b, a in zip(fleet, before, after, strict=True):
        d = a.minus(b)
        acc = by_gpu.setdefault(e.gpu, Counters())
        acc.requests += d.requests
        acc.e2e_sum += d.e2e_sum
        acc.tokens += d.tokens
    skip = setup.warmup * times[-1]
    measured = [o for o, at in zip(outcomes, times, strict=True) if at >= skip]
    good = [o for o in measured if o.error is None and o.end is not None]
    errors: dict[str, int] = {}
    for o in measured:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1
    # Throughput in the measured window: from the first measured send to the last send, what
    # finished in it (the fleet is warm by then; the drain after the last send is left out).
    t_lo = min(o.sent for o in measured)
    t_hi = max(o.sent for o in outcomes)
    done = [o for o in outcomes if o.error is None and o.end is not None and t_lo <= o.end <= t_hi]
    span = max(1e-9, t_hi - t_lo)
    short = sum(1 for o, p in zip(outcomes, work, strict=True) if o.end and o.tokens < p.output)
    # The slowest 5 %: how long were they, and how many decoded at an L40S's pace (the
    # engine is not named in the answer; its inter-token gap gives the GPU away).
    cut = pct([(o.end - o.sent) for o in good if o.end is not None], 0.95)
    slow = [o for o in good if o.end is not None and o.end - o.sent >= cut]
    paced = [
        o
        for o in slow
        if o.first is not None
        and o.end is not None
        and o.tokens > 1
        and (o.end - o.first) / (o.tokens - 1) * speedup > setup.slow_itl_s
    ]
    tail = (
        len(slow),
        statistics.mean(o.tokens for o in slow) if slow else float("nan"),
        len(paced) / len(slow) if slow else float("nan"),
    )
    return RunResult(
        label=variant.label,
        latency=[(o.end - o.sent) * speedup for o in good if o.end is not None],
        ttft=[(o.first - o.sent) * speedup for o in good if o.first is not None],
        lag=[o.sent - o.due for o in outcomes],
        errors=errors,
        requests=len(measured),
        req_per_s=len(done) / span / speedup,
        tok_per_s=sum(o.tokens for o in done) / span / speedup,
        wall_s=wall,
        cpu={k: (cpu1[k] - cpu0[k]) / wall for k in cpu0},
        by_gpu=by_gpu,
        learned=learned,
        expected_output=expected,
        short_answers=short,
        tail=tail,
    )


# --- report -------------------------------------------------------------------------------------


def s_(x: float) -> str:
    return "—" if x != x else f"{x:.2f}"


def ratio(a: float, b: float) -> str:
    return "—" if not (a == a and b == b and b > 0) else f"{a / b:.2f}"


def report(
    results: Sequence[RunResult],
    speedup: float,
    capacity_share: dict[str, float],
    floor: tuple[list[float], list[float]],
    offered: float,
    trace: str,
    burst: tuple[float, float],
    pace: Sequence[tuple[float, float | None]] = (),
) -> list[str]:
    """Print the figures; return the goal lines (printed too) for --all's summary."""
    goals: list[str] = []
    cores = os.cpu_count() or 1
    width = max(31, *(len(r.label) for r in results))
    print()
    print("Per strategy (latency and TTFT in simulated seconds; lag in wall milliseconds):")
    header = (
        f"{'strategy':<{width}} {'lat p50':>7} {'p95':>6} {'p99':>6} | {'TTFT p50':>8} "
        f"{'p95':>6} {'p99':>6} | {'req/s':>6} {'tok/s':>7} | {'errors':>6} | "
        f"{'lag p50':>7} {'p99':>6} {'max':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        errs = sum(r.errors.values())
        print(
            f"{r.label:<{width}} {s_(pct(r.latency, 0.5)):>7} {s_(pct(r.latency, 0.95)):>6} "
            f"{s_(pct(r.latency, 0.99)):>6} | {s_(pct(r.ttft, 0.5)):>8} "
            f"{s_(pct(r.ttft, 0.95)):>6} {s_(pct(r.ttft, 0.99)):>6} | {r.req_per_s:>6.1f} "
            f"{r.tok_per_s:>7.0f} | {errs:>6} | {pct(r.lag, 0.5) * 1e3:>7.1f} "
            f"{pct(r.lag, 0.99) * 1e3:>6.1f} {max(r.lag) * 1e3:>6.1f}"
        )
    ttft_floor, lat_floor = floor
    print(
        f"{'(each request alone on an H200)':<{width}} {s_(pct(lat_floor, 0.5)):>7} "
        f"{s_(pct(lat_floor, 0.95)):>6} {s_(pct(lat_floor, 0.99)):>6} | "
        f"{s_(pct(ttft_floor, 0.5)):>8} {s_(pct(ttft_floor, 0.95)):>6} "
        f"{s_(pct(ttft_floor, 0.99)):>6} | the cost model's floor: no strategy can beat it"
    )
    backlog, burst_p95 = burst
    print(
        f"Burst bound: one FIFO queue at the predicted capacity (perfect routing) backs up to "
        f"{backlog:.0f} requests and gives a latency p95 of {s_(burst_p95)} s; no FIFO router "
        "does better"
    )
    if pace:
        figures = [
            (f"{ratio:.2f} ×" if ratio is not None else f"> {pace_bound.RATIOS[-1]} ×")
            + f" the floor's p95 with the GPUs busy up to {busy:.0%} of the time"
            for busy, ratio in pace
        ]
        print(
            "Pace bound (bench/pace_bound.py, a fluid estimate that no router beats): 95 % of "
            f"the requests within {'; '.join(figures)} (long answers decode at a loaded "
            "batch's pace, between other prompts' prefill)"
        )
    for r in results:
        refused = r.errors.get("HTTP 429", 0)
        if refused:
            print(
                f"  {r.label}: {refused} × 429 (the waiting room was full: "
                f"FLEET_ROUTER_QUEUE_BOUND below the burst's backlog)"
            )
    for r in results:
        if r.req_per_s < 0.95 * offered and not r.errors:
            print(
                f"  {r.label}: finished {r.req_per_s:.1f} req/s of the {offered:.1f} offered: the "
                "fleet fell behind (overload, or the stand-ins short of CPU: see below)"
            )
        if r.errors:
            print(f"  {r.label}: errors {r.errors}")
        if r.short_answers:
            print(f"  {r.label}: {r.short_answers} answers shorter than max_tokens")
    print()
    print(
        "Where the requests went (the engines' own counters): share of the requests, and their "
        "mean e2e latency on that GPU model (simulated s):"
    )
    gpus = list(dict.fromkeys(FLEET))
    print(
        f"{'strategy':<{width}} "
        + " ".join(f"{g + ' share':>11} {'e2e':>5}" for g in gpus)
        + f"  | {'tail':>4} {'tokens':>6} {'L40S pace':>9}"
    )
    for r in results:
        total = sum(c.requests for c in r.by_gpu.values()) or 1.0
        cells = []
        for g in gpus:
            c = r.by_gpu.get(g, Counters())
            mean = c.e2e_sum / c.requests if c.requests else float("nan")
            cells.append(f"{c.requests / total:>11.0%} {s_(mean):>5}")
        count, tokens, paced = r.tail
        cells.append(f" | {count:>4} {tokens:>6.0f} {paced:>9.0%}")
        print(f"{r.label:<{width}} " + " ".join(cells))
    print(
        f"{'(share of the capacity)':<{width}} "
        + " ".join(f"{capacity_share[g]:>11.0%} {'':>5}" for g in gpus)
    )
    print(
        "  tail: the slowest 5 % of the measured requests (count, mean output tokens, share that "
        "decoded at an L40S's pace: mean inter-token gap above the H100's at full batch)"
    )
    print()
    print(
        "What each router learned: capacity per replica (work units per simulated second, mean "
        "per GPU model), expected output tokens:"
    )
    for r in results:
        per: dict[str, list[float]] = {}
        for rep in r.learned:
            # The router measures per wall second (÷ speed-up → per simulated second); a
            # replica it never measured keeps the cost-model prior, per simulated second.
            per.setdefault(rep["gpu_model"], []).append(rep["capacity"] / speedup)
        caps = ", ".join(f"{g} {statistics.mean(v):.0f}" for g, v in per.items())
        print(f"  {r.label:<{width}} {caps}; expected output {r.expected_output}")
    print()
    print(f"CPU (share of one core over each replay; this machine has {cores} cores):")
    for r in results:
        total = sum(r.cpu.values())
        shares = ", ".join(f"{k} {v:.0%}" for k, v in r.cpu.items())
        warn = []
        if r.cpu["router"] > 0.9:
            warn.append("THE ROUTER SATURATES A CORE")
        if r.cpu["load gen"] > 0.9:
            warn.append("THE LOAD GENERATOR SATURATES A CORE")
        if total > 0.9 * cores:
            warn.append("THE MACHINE IS SATURATED")
        flag = f"  <- {'; '.join(warn)}: these figures measure Python" if warn else ""
        print(f"  {r.label:<{width}} {shares}; total {total:.0%} ({r.wall_s:.0f} s wall){flag}")
    print()
    by_label = {r.label: r for r in results}
    rr, lp = by_label.get("round_robin"), by_label.get("least_pending")
    print("p95 as a ratio (latency | TTFT):")
    print(f"{'strategy':<{width}} {'÷ round_robin':>14} {'÷ least_pending':>16}")
    for r in results:
        cells = []
        for base in (rr, lp):
            if base is None:
                cells.append("—")
            else:
                cells.append(
                    f"{ratio(pct(r.latency, 0.95), pct(base.latency, 0.95))} | "
                    f"{ratio(pct(r.ttft, 0.95), pct(base.ttft, 0.95))}"
                )
        print(f"{r.label:<{width}} {cells[0]:>14} {cells[1]:>16}")
    ect = by_label.get("estimated_completion_time")
    if ect is None:
        return goals
    p95 = pct(ect.latency, 0.95)
    floor_p95 = pct(lat_floor, 0.95)
    # the fluid estimate's ratio with the GPUs busy all the time (the most it allows)
    best = min((ratio for _, ratio in pace if ratio is not None), default=None)
    pace_p95 = best * floor_p95 if best is not None else 0.0

    def verdict(name: str, value: float, goal: float, target: float, extra: str = "") -> None:
        line = f"{name}: {value:.2f}, {'met' if value <= goal else 'NOT met'}{extra}"
        if target < floor_p95:
            line += f" (unreachable here: {s_(target)} s is below the floor's p95)"
        elif target < burst_p95:
            line += (
                f" (unreachable for a FIFO waiting room: {s_(target)} s is below the burst "
                f"bound {s_(burst_p95)} s)"
            )
        elif target < pace_p95:
            line += (
                f" (unreachable for any router: {s_(target)} s is below the pace bound "
                f"{s_(pace_p95)} s with every GPU busy all the time)"
            )
        elif value > goal and pace:
            line += (
                " (pace bound: "
                + ", ".join(
                    f"{ratio:.2f} × at {busy:.0%} busy"
                    if ratio is not None
                    else f"none at {busy:.0%}"
                    for busy, ratio in pace
                )
                + ")"
            )
        print(line)
        goals.append(f"{trace} trace: {line}")

    if trace == "code" and lp is not None:
        lp95 = pct(lp.latency, 0.95)
        no429 = {x.label: x.errors.get("HTTP 429", 0) for x in (ect, lp)}
        verdict(
            f"Goal: estimated_completion_time p95 ≤ {GOAL_CODE_VS_LP} × least_pending",
            p95 / lp95,
            GOAL_CODE_VS_LP,
            GOAL_CODE_VS_LP * lp95,
            f"; 429s {no429[ect.label]} / {no429[lp.label]} (goal 0)",
        )
    if trace == "code":
        verdict(
            f"Stretch: estimated_completion_time p95 ≤ {STRETCH_CODE_VS_FLOOR} × the floor",
            p95 / floor_p95,
            STRETCH_CODE_VS_FLOOR,
            STRETCH_CODE_VS_FLOOR * floor_p95,
        )
    else:
        verdict(
            f"Goal: estimated_completion_time p95 ≤ {GOAL_CONV_VS_FLOOR} × the floor",
            p95 / floor_p95,
            GOAL_CONV_VS_FLOOR,
            GOAL_CONV_VS_FLOOR * floor_p95,
        )
    return goals


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2400, help="requests per strategy")
    ap.add_argument("--offset", type=int, default=0, help="first request of the trace slice")
    ap.add_argument("--load", type=float, default=0.8, help="offered load ÷ fleet capacity")
    ap.add_argument("--trace", default="conv", help="conv | code")
    ap.add_argument("--speedup", type=float, default=1.0, help="FLEET_STANDIN_SPEEDUP (see above)")
    ap.add_argument(
        "--max-batch-size", type=int, default=16, help="engines' max_batch_size (and the table's)"
    )
    ap.add_argument(
        "--router-limit",
        type=int,
        help="leave max_batch_size out of the table and set FLEET_ROUTER_REPLICA_LIMIT instead",
    )
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the replay not measured")
    ap.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated NAME[@KEY=VALUE...] (KEY: a FLEET_ROUTER_ setting), run in "
        f"order; default: {','.join(STRATEGIES)}",
    )
    ap.add_argument(
        "--all",
        action="store_true",
        help="issue 25's acceptance in one run: the code and conv traces with "
        f"{', '.join(ACCEPTANCE_STRATEGIES)} (--trace and --strategies ignored), the multi-turn "
        "sessions and the callers (~15 minutes)",
    )
    ap.add_argument("--agent-shim", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.agent_shim is not None:  # the child process of agent_shim()
        run_agent_shim(args.agent_shim, rest)
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        variants = [Variant.parse(s.strip()) for s in args.strategies.split(",") if s.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    if args.requests < 10 or not args.load > 0 or not args.speedup > 0:
        ap.error("need --requests >= 10, --load > 0 and --speedup > 0")
    try:
        if args.all:
            return acceptance(args)
        return trace_phase(args, variants)[0]
    except ValueError as exc:
        ap.error(str(exc))


def acceptance(args: argparse.Namespace) -> int:
    """--all: issue 25's acceptance in one run: the code and conversation traces (round-robin,
    least-pending, estimated completion time), the multi-turn sessions (estimated completion
    time against prefix-aware; bench/routing_sessions.py) and the callers (bench/routing_callers.py:
    401 without a key, a noisy tenant over its rate limit beside a quiet one); then every goal
    line again."""
    import routing_callers
    import routing_sessions

    goals: list[str] = []
    variants = [Variant.parse(name) for name in ACCEPTANCE_STRATEGIES]
    for trace in ("code", "conv"):
        print(f"\n=== {trace} trace ===", flush=True)
        rc, lines = trace_phase(argparse.Namespace(**{**vars(args), "trace": trace}), variants)
        if rc:
            return rc
        goals += lines
    print("\n=== multi-turn sessions ===", flush=True)
    rc, lines = routing_sessions.run(
        routing_sessions.parse_args(["--load", str(args.load), "--speedup", str(args.speedup)])
    )
    if rc:
        return rc
    goals += lines
    print("\n=== callers ===", flush=True)
    rc, lines = routing_callers.run(routing_callers.parse_args([]))
    if rc:
        return rc
    goals += lines
    print("\n=== the goals ===")
    for line in goals:
        print(line)
    return 0


@dataclass(frozen=True)
class Slice:
    """A trace slice at an offered load on FLEET, by the cost model (simulated seconds)."""

    sizes: list[tuple[int, int]]  # (prompt, output) tokens per request, in trace order
    mean_in: float
    mean_out: float
    eff_in: float  # the steady-state equivalent lengths (cost_model.effective_lengths)
    eff_out: float
    streams: int  # per engine: the engines' batch or the router's limit, the smaller
    per_gpu: dict[str, tuple[float, float]]  # GPU model: (output tok/s, ITL s) at `streams`
    cap_tok: float  # the fleet's predicted output tokens/s
    cap_req: float
    rate_sim: float  # offered requests/s
    span_s: float  # first to last arrival
    alone: list[tuple[float, float]]  # per request: (TTFT, latency) alone on an idle H200

    @property
    def floor_p95(self) -> float:
        return pct([latency for _, latency in self.alone], 0.95)


def slice_for(
    trace: str, offset: int, count: int, load: float, batch: int, router_limit: int | None = None
) -> Slice:
    """The slice at `load` of the fleet's capacity, and its floor. Capacity: the cost model's
    steady state per GPU for the slice's mix at B streams."""
    from fleet.traces import load_trace

    try:
        rows = load_trace(trace)[offset : offset + count]
    except OSError as exc:
        raise ValueError(str(exc)) from exc
    if len(rows) < 10:
        raise ValueError(f"trace {trace!r} has fewer than 10 requests from offset {offset}")
    sizes = [(r.prompt_tokens, max(1, r.output_tokens)) for r in rows]
    eff_in, eff_out = cm.effective_lengths(sizes)
    mean_out = statistics.mean(o for _, o in sizes)
    streams = min(batch, router_limit or batch)
    per_gpu: dict[str, tuple[float, float]] = {}
    for gpu in dict.fromkeys(FLEET):
        shape = shape_for(gpu, batch)
        per_gpu[gpu] = (
            cm.predicted_decode_tokens_per_s(shape, streams, eff_in, eff_out),
            cm.predicted_itl_s(shape, streams, eff_in, eff_out),
        )
    cap_tok = sum(per_gpu[g][0] for g in FLEET)
    rate_sim = load * cap_tok / mean_out
    work = plan(trace, offset, count, rate_sim)[0]
    h200 = shape_for("H200", batch)
    return Slice(
        sizes=sizes,
        mean_in=statistics.mean(i for i, _ in sizes),
        mean_out=mean_out,
        eff_in=eff_in,
        eff_out=eff_out,
        streams=streams,
        per_gpu=per_gpu,
        cap_tok=cap_tok,
        cap_req=cap_tok / mean_out,
        rate_sim=rate_sim,
        span_s=work[-1].at,
        alone=[alone_seconds(h200, p, o) for p, o in sizes],
    )


def trace_phase(args: argparse.Namespace, variants: Sequence[Variant]) -> tuple[int, list[str]]:
    """One trace, every variant: (exit code, the goal lines)."""
    sl = slice_for(
        args.trace, args.offset, args.requests, args.load, args.max_batch_size, args.router_limit
    )
    eff_in, eff_out, mean_in, mean_out = sl.eff_in, sl.eff_out, sl.mean_in, sl.mean_out
    batch, streams, per_gpu, cap_tok = args.max_batch_size, sl.streams, sl.per_gpu, sl.cap_tok
    cap_req, rate_sim = sl.cap_req, sl.rate_sim
    work, span, natural = plan(args.trace, args.offset, args.requests, rate_sim * args.speedup)
    share = {g: FLEET.count(g) * per_gpu[g][0] / cap_tok for g in per_gpu}
    # Between the H100's inter-token gap at full batch and the L40S's alone.
    slow_itl = math.sqrt(
        per_gpu["H100"][1] * cm.predicted_itl_s(shape_for("L40S", batch), 1, eff_in, eff_out)
    )
    alone = sl.alone  # in trace order, as `work`
    floor = ([a[0] for a in alone], [a[1] for a in alone])
    # The burst bound: the same arrivals, one FIFO queue at the predicted capacity (simulated s)
    waits = fluid_waits([p.at * args.speedup for p in work], cap_req)
    skip = args.warmup * work[-1].at
    bound = [w + a[1] for w, a, p in zip(waits, alone, work, strict=True) if p.at >= skip]
    burst = (max(waits) * cap_req, pct(bound, 0.95))
    # The pace bound, where the goal is the floor's (the code trace's lies under its bursts)
    pace: list[tuple[float, float | None]] = []
    if args.trace == "conv":
        print("Pace bound: solving (bench/pace_bound.py, under a minute)", flush=True)
        program = pace_bound.PaceBound(sl.sizes, pace_bound.groups_for(FLEET, MODEL), sl.span_s)
        pace = [(busy, program.bound(sl.floor_p95, busy, streams).ratio) for busy in PACE_BUSY]

    limit = (
        f"router limit {args.router_limit} per replica (FLEET_ROUTER_REPLICA_LIMIT)"
        if args.router_limit
        else "the router's limit too"
    )
    print(
        f"Fleet: {', '.join(f'{FLEET.count(g)} × {g}' for g in per_gpu)}; Llama-3.1-8B FP8, "
        f"engine max_batch_size {batch} ({limit}), chunked prefill; stand-in speed-up "
        f"{args.speedup:g}"
    )
    print(
        f"Trace: {args.trace} (Azure LLM inference 2023, CC BY 4.0, Patel et al., Splitwise, "
        f"ISCA 2024), requests {args.offset}..{args.offset + len(work) - 1}: mean prompt "
        f"{mean_in:.0f}, mean output {mean_out:.0f} tokens (steady-state equivalent "
        f"{eff_in:.0f}/{eff_out:.0f})"
    )
    print(
        f"Capacity, PREDICTED by fleet_core/cost_model.py for this mix at {streams} streams "
        "per engine (beside it the router's cost-model prior, work units/s):"
    )
    for gpu, (tps, itl) in per_gpu.items():
        prior = prior_capacity(gpu, MODEL, concurrency=streams)
        print(
            f"  {gpu:<5} {tps:7.0f} output tok/s = {tps / mean_out:5.1f} req/s per engine "
            f"(ITL {itl * 1e3:.1f} ms); router prior {prior:5.0f}"
        )
    print(f"  fleet {cap_tok:7.0f} output tok/s = {cap_req:5.1f} req/s (simulated)")
    print(
        f"Offered: {args.load:.0%} of that = {rate_sim:.1f} req/s simulated = "
        f"{rate_sim * args.speedup:.1f} req/s wall; the slice's own rate is {natural:.2f} req/s "
        f"over {span:.0f} s, so its arrivals are compressed ×{rate_sim / natural:.1f}; "
        f"{work[-1].at:.0f} s of replay per strategy, the first {args.warmup:.0%} not measured"
    )
    router_env: dict[str, str] = {}
    if args.router_limit:
        router_env["FLEET_ROUTER_REPLICA_LIMIT"] = str(args.router_limit)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLEET_ROUTER_")}
    env |= router_env
    print(
        "Router settings: "
        + (", ".join(f"{k}={v}" for k, v in env.items()) or "defaults")
        + f" (prefill weight default {PREFILL_WEIGHT})",
        flush=True,
    )

    results: list[RunResult] = []
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-routing-")))
        try:
            fleet = stack.enter_context(engines(FLEET, batch, args.speedup, logs))
            agent_base, shim = stack.enter_context(agent_shim([e.url for e in fleet], logs))
            table = logs / "routing.json"
            write_table(table, fleet, agent_base, None if args.router_limit else batch)
            setup = Setup(
                fleet, shim, table, logs, work, args.warmup, args.speedup, router_env, slow_itl
            )
            for run, variant in enumerate(variants):
                r = run_variant(run, variant, setup)
                results.append(r)
                print(
                    f"  {variant.label:<26} p95 {s_(pct(r.latency, 0.95))} s, "
                    f"{sum(r.errors.values())} errors, {r.wall_s:.0f} s wall",
                    flush=True,
                )
        except RuntimeError as exc:
            print(f"bench/routing.py: {exc}", file=sys.stderr)
            return 1, []
    return 0, report(results, args.speedup, share, floor, rate_sim, args.trace, burst, pace)


if __name__ == "__main__":
    sys.exit(main())
