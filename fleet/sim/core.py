"""The discrete-event loop: arrivals → the production router (strategy + books) → engines.

Each deployment gets the router's own `DeploymentPool` (fleet/router/pool.py) with a strategy
from `fleet.router.strategy.make`, the engines as `Replica`s with the cost-model prior capacity
(`prior_capacity`, as fleet/router/discovery.py gives them) and a `Throughput` meter each, and
the pool's `OutputEstimate`. Booking and release go through the pool's own `_book` and
`release`, on the simulation's clock, so in-flight counts, prompt tokens, expected output,
measured capacity and the output estimate evolve exactly as in the router. The router's
per-replica limit is the engine's max_batch_size (what the routing table carries); when no
replica is available a request waits in a FIFO waiting room (unbounded here), and the waiting
requests are admitted as replicas free up, first come first served.

Streaming: the router lowers a replica's expected output as tokens stream (Ticket.streamed).
Rather than one event per token, a replica's `output_left` is recomputed exactly from its
engine (tokens written by the iterations ended by now) just before a decision, for the
strategies that read it. `kv_use`, `queued` and `running` are taken fresh from the engine at
that moment (the real router sees them polled, a fraction of a second old).

Events: the engines' block ends (fleet/sim/engine.py) in a heap, merged with the arrival list;
at equal times an engine's block end comes before an arrival.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from agents.engine import cost_model
from agents.engine.cost_model import EngineShape
from fleet.router.admission import AdmissionQueue
from fleet.router.estimates import Throughput, prior_capacity
from fleet.router.pool import DeploymentPool, Ticket
from fleet.router.strategy import Replica, Request, make
from fleet.sim.engine import Batching, Engine, SimRequest

READS_OUTPUT_LEFT = frozenset({"estimated_completion_time", "model_affinity"})


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    model: str  # cost_model.model_spec name
    replicas: tuple[tuple[str, int], ...]  # (GPU model, engines), in order
    strategy: str = "estimated_completion_time"
    batching: Batching = "continuous"
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    tp_size: int = 1
    chunked_prefill: bool = True
    router_limit: int | None = None  # per replica; None: max_batch_size (the routing table's)
    latency_sla_s: float | None = None
    ttft_sla_s: float | None = None

    def shape(self, gpu: str) -> EngineShape:
        return EngineShape(
            gpu=cost_model.gpu_spec(gpu),
            model=cost_model.model_spec(self.model),
            tp_size=self.tp_size,
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
        )

    @property
    def engines(self) -> int:
        return sum(n for _, n in self.replicas)


@dataclass
class _Dep:
    spec: DeploymentSpec
    pool: DeploymentPool
    engines: dict[str, Engine]  # by replica URL
    reads_output_left: bool
    waiting: deque[SimRequest] = field(default_factory=deque)


@dataclass
class RunResult:
    requests: list[SimRequest]
    engines: list[tuple[str, Engine]]  # (GPU model, engine)
    deployments: list[DeploymentSpec]
    span_s: float  # first arrival to last finish
    wall_s: float = 0.0
    events: int = 0


class Simulation:
    def __init__(self, deployments: Sequence[DeploymentSpec], *, per_iteration: bool = False):
        self.now = 0.0
        self.deps: list[_Dep] = []
        self.engine_list: list[tuple[str, Engine]] = []
        self._engine_index: dict[int, tuple[_Dep, Engine]] = {}
        self._tickets: dict[int, Ticket] = {}
        for spec in deployments:
            pool = DeploymentPool(
                name=spec.name,
                strategy=make(spec.strategy),
                queue=AdmissionQueue(0),
                models=frozenset({spec.model}),
                clock=lambda: self.now,
            )
            engines: dict[str, Engine] = {}
            n = 0
            for gpu, count in spec.replicas:
                shape = spec.shape(gpu)
                prior = prior_capacity(
                    gpu, spec.model, tp_size=spec.tp_size, concurrency=spec.max_batch_size
                )
                for _ in range(count):
                    url = f"sim://{spec.name}/{n}-{gpu}"
                    n += 1
                    engine = Engine(
                        shape,
                        batching=spec.batching,
                        chunked_prefill=spec.chunked_prefill,
                        per_iteration=per_iteration,
                    )
                    engines[url] = engine
                    pool.replicas[url] = Replica(
                        url=url,
                        gpu_model=gpu,
                        models=pool.models,
                        limit=spec.router_limit or spec.max_batch_size,
                        capacity=prior,
                    )
                    pool.throughput[url] = Throughput(prior)
            dep = _Dep(spec, pool, engines, spec.strategy in READS_OUTPUT_LEFT)
            self.deps.append(dep)
            for url, engine in engines.items():
                self._engine_index[id(engine)] = (dep, engine)
                self.engine_list.append((pool.replicas[url].gpu_model, engine))
        self._heap: list[tuple[float, int, Engine]] = []
        self._seq = 0

    # --- routing -----------------------------------------------------------------------------

    def _refresh(self, dep: _Dep) -> None:
        now = self.now
        for url, replica in dep.pool.replicas.items():
            engine = dep.engines[url]
            replica.queued = len(engine.waiting)
            replica.running = len(engine.context) + len(engine.decoding)
            replica.kv_use = engine.used_fraction()
            if dep.reads_output_left:
                replica.output_left = engine.output_left(now)

    def _try_route(self, dep: _Dep, r: SimRequest) -> bool:
        pool = dep.pool
        request = Request(
            model=dep.spec.model,
            prompt_tokens=r.prompt,
            expected_output=pool.estimate.expected(r.max_tokens),
        )
        replica = pool._choose(request, frozenset())
        if replica is None:
            return False
        ticket = pool._book(replica, request)
        self._tickets[r.rid] = ticket
        r.routed = self.now
        r.expected = request.expected_output
        engine = dep.engines[replica.url]
        r.engine = id(engine)
        if engine.add(r, self.now):
            self._schedule(engine)
        return True

    def _schedule(self, engine: Engine) -> None:
        t = engine.next_time
        if t < math.inf:
            self._seq += 1
            heapq.heappush(self._heap, (t, self._seq, engine))

    def _pump(self, dep: _Dep) -> None:
        while dep.waiting:
            self._refresh(dep)
            if not self._try_route(dep, dep.waiting[0]):
                return
            dep.waiting.popleft()

    # --- the loop ----------------------------------------------------------------------------

    def run(self, requests: Sequence[SimRequest]) -> RunResult:
        """Simulate `requests` (sorted by arrival; fresh SimRequest objects) to the end."""
        import time

        wall = time.perf_counter()
        heap = self._heap
        events = 0
        i, n = 0, len(requests)
        deps = self.deps
        while i < n or heap:
            if heap and (i >= n or heap[0][0] <= requests[i].arrival):
                t, _, engine = heapq.heappop(heap)
                if engine.next_time != t:  # superseded (a cut or a replan)
                    continue
                self.now = t
                events += 1
                dep, _ = self._engine_index[id(engine)]
                finished = engine.advance()
                self._schedule(engine)
                for r in finished:
                    ticket = self._tickets.pop(r.rid)
                    ticket.output_seen = r.output
                    dep.pool.release(ticket, output_tokens=r.output, ok=True, failed=False)
                if finished:
                    self._pump(dep)
            else:
                r = requests[i]
                i += 1
                self.now = r.arrival
                events += 1
                dep = deps[r.deployment]
                if dep.waiting:
                    dep.waiting.append(r)
                    continue
                self._refresh(dep)
                if not self._try_route(dep, r):
                    dep.waiting.append(r)
        first = requests[0].arrival if requests else 0.0
        last = max((r.finish for r in requests), default=first)
        return RunResult(
            requests=list(requests),
            engines=self.engine_list,
            deployments=[d.spec for d in deps],
            span_s=last - first,
            wall_s=time.perf_counter() - wall,
            events=events,
        )


# --- metrics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted `values` (q in 0..100); NaN when empty."""
    if not values:
        return math.nan
    k = max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))
    return values[k]


@dataclass(frozen=True)
class Summary:
    requests: int
    latency_p50: float
    latency_p95: float
    latency_p99: float
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    wait_mean: float  # arrival → first scheduled by an engine
    sla_attainment: float | None  # share meeting every SLA its deployment sets
    gpu_hours: float
    kwh: float
    span_s: float


def engine_kwh(gpu: str, engine: Engine, span_s: float) -> float:
    """Busy time at TDP, the rest at the GPU's measured idle draw (midpoint of its range), per
    GPU of the engine: a simple per-GPU figure, not a power model."""
    spec = cost_model.gpu_spec(gpu)
    idle = sum(spec.idle_w) / 2
    busy = min(engine.busy_s, span_s)
    joules = engine.shape.gpus * (spec.tdp_w * busy + idle * (span_s - busy))
    return joules / 3.6e6


def summarize(result: RunResult, *, warmup: float = 0.0) -> Summary:
    """Figures over the requests after the first `warmup` share (by arrival order)."""
    reqs = result.requests[int(len(result.requests) * warmup) :]
    done = [r for r in reqs if r.finish == r.finish]
    lat = sorted(r.finish - r.arrival for r in done)
    ttft = sorted(r.first_token - r.arrival for r in done)
    wait = [r.start - r.arrival for r in done]
    specs = result.deployments
    met = 0
    with_sla = 0
    for r in done:
        s = specs[r.deployment]
        if s.latency_sla_s is None and s.ttft_sla_s is None:
            continue
        with_sla += 1
        ok = (s.latency_sla_s is None or r.finish - r.arrival <= s.latency_sla_s) and (
            s.ttft_sla_s is None or r.first_token - r.arrival <= s.ttft_sla_s
        )
        met += ok
    span = result.span_s
    gpus = sum(e.shape.gpus for _, e in result.engines)
    return Summary(
        requests=len(done),
        latency_p50=percentile(lat, 50),
        latency_p95=percentile(lat, 95),
        latency_p99=percentile(lat, 99),
        ttft_p50=percentile(ttft, 50),
        ttft_p95=percentile(ttft, 95),
        ttft_p99=percentile(ttft, 99),
        wait_mean=sum(wait) / len(wait) if wait else math.nan,
        sla_attainment=met / with_sla if with_sla else None,
        gpu_hours=gpus * span / 3600,
        kwh=sum(engine_kwh(g, e, span) for g, e in result.engines),
        span_s=span,
    )
