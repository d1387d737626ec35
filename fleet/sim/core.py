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

Events: the engines' block ends (fleet/sim/engine.py) in a heap, merged with the arrival list
and the timers (autoscaler ticks, boots finishing); at equal times an engine's block end comes
first, then a timer, then an arrival.

Autoscaling (a deployment with `autoscale`; fleet/sim/autoscale.py): each tick asks the
production policy for a target and makes it true: warm spares boot and join the pool when
ready; a scale-down calls off boots first, then drains a replica (not ready in the pool: no new
requests) that leaves, back to the warm pool, when its last request finishes.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from agents.engine import cost_model
from agents.engine.cost_model import EngineShape
from fleet.autoscaler.policy import Signals, decide
from fleet.router.admission import AdmissionQueue
from fleet.router.estimates import Throughput, prior_capacity
from fleet.router.pool import DeploymentPool, Ticket
from fleet.router.strategy import Replica, Request, make
from fleet.sim import autoscale as auto
from fleet.sim.autoscale import AutoscaleSpec, Exhaustion, RouterLoad, ScalePoint
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
    autoscale: AutoscaleSpec | None = None  # None: a fixed fleet

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
    # Autoscaling
    index: int = 0
    count: int = 0  # engines made (for URLs)
    warm: dict[str, int] = field(default_factory=dict)  # the warm pool it draws from (shared)
    booting: dict[str, Engine] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)
    history: deque[Signals] = field(default_factory=deque)
    stats: dict[str, deque[tuple[float, float, float]]] = field(default_factory=dict)
    router_stats: deque[tuple[float, float, float]] = field(default_factory=deque)
    target: int = 0
    last_up_at: float | None = None
    last_down_at: float | None = None


@dataclass
class RunResult:
    requests: list[SimRequest]
    engines: list[tuple[str, Engine]]  # (GPU model, engine)
    deployments: list[DeploymentSpec]
    span_s: float  # first arrival to last finish
    wall_s: float = 0.0
    events: int = 0
    on_s: list[float] | None = None  # per engine: seconds on (booting + serving); None: span
    booting_s: float = 0.0  # GPU-seconds spent booting
    timeline: list[ScalePoint] = field(default_factory=list)
    exhaustions: list[Exhaustion] = field(default_factory=list)


class Simulation:
    def __init__(
        self,
        deployments: Sequence[DeploymentSpec],
        *,
        per_iteration: bool = False,
        warm_pool: Sequence[tuple[str, int]] = (),
        seed: int = 0,
    ):
        self.now = 0.0
        self.per_iteration = per_iteration
        self.deps: list[_Dep] = []
        self.engine_list: list[tuple[str, Engine]] = []
        self.on_at: list[float | None] = []  # per engine: when it started booting (None: start)
        self.off_at: list[float | None] = []  # when it left (None: still there at the end)
        self.booting_s = 0.0
        self._engine_index: dict[int, tuple[_Dep, Engine, int]] = {}
        self._tickets: dict[int, Ticket] = {}
        self._rng = random.Random(seed * 7919 + 17)
        self.shared_warm: dict[str, int] = {g: n for g, n in warm_pool if n > 0}
        self.timeline: list[ScalePoint] = []
        self.exhaustions: list[Exhaustion] = []
        # (time, seq, kind, deployment index, URL): autoscaler ticks and boots finishing
        self._timers: list[tuple[float, int, str, int, str]] = []
        self._ready_at: dict[str, float] = {}
        for index, spec in enumerate(deployments):
            pool = DeploymentPool(
                name=spec.name,
                strategy=make(spec.strategy),
                queue=AdmissionQueue(0),
                models=frozenset({spec.model}),
                clock=lambda: self.now,
            )
            dep = _Dep(spec, pool, {}, spec.strategy in READS_OUTPUT_LEFT, index=index)
            self.deps.append(dep)
            for gpu, count in spec.replicas:
                for _ in range(count):
                    self._join(dep, gpu, self._new_engine(dep, gpu, None))
            if spec.autoscale is not None:
                a = spec.autoscale
                dep.warm = (
                    self.shared_warm
                    if a.warm_pool is None
                    else {g: n for g, n in a.warm_pool if n > 0}
                )
                dep.target = spec.engines
        self._heap: list[tuple[float, int, Engine]] = []
        self._seq = 0

    # --- engines joining and leaving -----------------------------------------------------------

    def _new_engine(self, dep: _Dep, gpu: str, on_at: float | None) -> tuple[str, Engine]:
        spec = dep.spec
        url = f"sim://{spec.name}/{dep.count}-{gpu}"
        dep.count += 1
        engine = Engine(
            spec.shape(gpu),
            batching=spec.batching,
            chunked_prefill=spec.chunked_prefill,
            per_iteration=self.per_iteration,
        )
        self._engine_index[id(engine)] = (dep, engine, len(self.engine_list))
        self.engine_list.append((gpu, engine))
        self.on_at.append(on_at)
        self.off_at.append(None)
        return url, engine

    def _join(self, dep: _Dep, gpu: str, made: tuple[str, Engine]) -> None:
        """The engine serves: the router's pool gets it as a Replica (ready)."""
        url, engine = made
        spec = dep.spec
        prior = prior_capacity(
            gpu, spec.model, tp_size=spec.tp_size, concurrency=spec.max_batch_size
        )
        dep.engines[url] = engine
        dep.pool.replicas[url] = Replica(
            url=url,
            gpu_model=gpu,
            models=dep.pool.models,
            limit=spec.router_limit or spec.max_batch_size,
            capacity=prior,
        )
        dep.pool.throughput[url] = Throughput(prior)

    def _leave(self, dep: _Dep, url: str) -> None:
        """A drained engine (nothing in flight) leaves; its GPUs go back to the warm pool."""
        engine = dep.engines.pop(url)
        del dep.pool.replicas[url]
        del dep.pool.throughput[url]
        dep.stats.pop(url, None)
        dep.draining.discard(url)
        _, _, k = self._engine_index[id(engine)]
        self.off_at[k] = self.now
        gpu = self.engine_list[k][0]
        dep.warm[gpu] = dep.warm.get(gpu, 0) + 1

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

    # --- the autoscaler ----------------------------------------------------------------------

    def _timer(self, t: float, kind: str, dep: int, url: str = "") -> None:
        self._seq += 1
        heapq.heappush(self._timers, (t, self._seq, kind, dep, url))

    def _tick(self, dep: _Dep) -> None:
        """One autoscaler tick (fleet/autoscaler/service.py `autoscale_once`) and its target
        made true."""
        a = dep.spec.autoscale
        assert a is not None
        now = self.now
        servers = []
        for url, engine in dep.engines.items():
            if url in dep.draining:
                continue  # not SERVING: a draining server sends no counted heartbeat
            e2e, ttft = auto.p95(dep.stats.setdefault(url, deque()), now)
            replica = {
                "state": "ready",
                "queued": len(engine.waiting),
                "running": len(engine.context) + len(engine.decoding),
                "kv_used_fraction": engine.used_fraction(),
                "e2e_p95_s": e2e,
                "ttft_p95_s": ttft,
            }
            servers.append({"gpu_count": engine.shape.gpus, "replicas": [replica]})
        r_e2e, r_ttft = auto.p95(dep.router_stats, now)
        load = RouterLoad(waiting=len(dep.waiting), p95_s=r_e2e, ttft_p95_s=r_ttft)
        window = auto.observe(servers, now, load, dep.history, a.keep_s)
        serving = len(dep.engines) - len(dep.draining)
        state = auto.state(
            dep.spec.name,
            a,
            gpus_per_replica=dep.spec.tp_size,
            target=dep.target,
            serving=serving,
            booting=len(dep.booting),
            last_up_at=dep.last_up_at,
            last_down_at=dep.last_down_at,
        )
        decision = decide(state, window, now, a.policy_config())
        if decision.target != dep.target and decision.rule not in ("min", "floor", "pinned"):
            if decision.target > dep.target:
                dep.last_up_at = now
            else:
                dep.last_down_at = now
        dep.target = decision.target
        self._apply(dep)
        self.timeline.append(
            ScalePoint(
                now,
                dep.spec.name,
                dep.target,
                len(dep.engines) - len(dep.draining),
                len(dep.booting),
                len(dep.draining),
                decision.rule,
            )
        )

    def _apply(self, dep: _Dep) -> None:
        a = dep.spec.autoscale
        assert a is not None
        now = self.now
        have = len(dep.engines) - len(dep.draining) + len(dep.booting)
        if dep.target > have:
            short = 0
            for _ in range(dep.target - have):
                gpu = next((g for g, n in dep.warm.items() if n > 0 and self._fits(dep, g)), None)
                if gpu is None:
                    short += 1
                    continue
                dep.warm[gpu] -= 1
                url, engine = self._new_engine(dep, gpu, now)
                dep.booting[url] = engine
                ready = now + a.boot.draw(self._rng)
                self._ready_at[url] = ready
                self._timer(ready, "ready", dep.index, url)
            if short:
                self.exhaustions.append(Exhaustion(now, dep.spec.name, short))
        excess = have - dep.target
        while excess > 0 and dep.booting:  # the latest boot is called off first
            url = next(reversed(dep.booting))
            engine = dep.booting.pop(url)
            k = self._engine_index[id(engine)][2]
            self.off_at[k] = now
            self.booting_s += engine.shape.gpus * (now - (self.on_at[k] or now))
            self._ready_at.pop(url, None)
            gpu = self.engine_list[k][0]
            dep.warm[gpu] = dep.warm.get(gpu, 0) + 1
            excess -= 1
        while excess > 0:
            candidates = [u for u in dep.engines if u not in dep.draining]
            if not candidates:
                break
            # the one with the least in flight; the newest on a tie
            url = min(reversed(candidates), key=lambda u: dep.engines[u].live())
            dep.draining.add(url)
            dep.pool.replicas[url].ready = False
            if dep.engines[url].live() == 0:
                self._leave(dep, url)
            excess -= 1

    def _fits(self, dep: _Dep, gpu: str) -> bool:
        return cost_model.kv_capacity_blocks(dep.spec.shape(gpu)) >= 1

    def _ready(self, dep: _Dep, url: str) -> None:
        engine = dep.booting.pop(url, None)
        if engine is None or self._ready_at.pop(url, None) != self.now:
            return  # called off
        k = self._engine_index[id(engine)][2]
        self.booting_s += engine.shape.gpus * (self.now - (self.on_at[k] or self.now))
        self._join(dep, self.engine_list[k][0], (url, engine))
        self._pump(dep)

    # --- the loop ----------------------------------------------------------------------------

    def run(self, requests: Sequence[SimRequest]) -> RunResult:
        """Simulate `requests` (sorted by arrival; fresh SimRequest objects) to the end."""
        import time

        wall = time.perf_counter()
        heap = self._heap
        timers = self._timers
        events = 0
        i, n = 0, len(requests)
        deps = self.deps
        first = requests[0].arrival if requests else 0.0
        scaled = [d for d in deps if d.spec.autoscale is not None]
        for d in scaled:
            assert d.spec.autoscale is not None
            self._timer(first + d.spec.autoscale.interval_s, "tick", d.index)
        inf = math.inf
        while True:
            te = heap[0][0] if heap else inf
            ta = requests[i].arrival if i < n else inf
            if te == inf and ta == inf and not any(d.waiting and d.booting for d in scaled):
                break  # nothing left to happen (waiting requests with no boot to come: stuck)
            tt = timers[0][0] if timers else inf
            if te <= ta and te <= tt:
                t, _, engine = heapq.heappop(heap)
                if engine.next_time != t:  # superseded (a cut or a replan)
                    continue
                self.now = t
                events += 1
                dep, _, _ = self._engine_index[id(engine)]
                finished = engine.advance()
                self._schedule(engine)
                for r in finished:
                    ticket = self._tickets.pop(r.rid)
                    ticket.output_seen = r.output
                    dep.pool.release(ticket, output_tokens=r.output, ok=True, failed=False)
                    if dep.spec.autoscale is not None:
                        url = ticket.replica.url
                        dep.stats.setdefault(url, deque()).append(
                            (t, t - r.routed, r.first_token - r.routed)
                        )
                        dep.router_stats.append((t, t - r.arrival, r.first_token - r.arrival))
                if finished:
                    if dep.draining:
                        for url in [u for u in dep.draining if dep.engines[u].live() == 0]:
                            self._leave(dep, url)
                    self._pump(dep)
            elif tt <= ta:
                t, _, kind, index, url = heapq.heappop(timers)
                self.now = t
                dep = deps[index]
                if kind == "tick":
                    assert dep.spec.autoscale is not None
                    self._tick(dep)
                    self._timer(t + dep.spec.autoscale.interval_s, "tick", index)
                else:
                    self._ready(dep, url)
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
        last = max((r.finish for r in requests), default=first)
        on_s = []
        for on_at, off_at in zip(self.on_at, self.off_at, strict=True):
            on = first if on_at is None else on_at
            off = last if off_at is None else min(off_at, last)
            on_s.append(max(0.0, off - on))
        booting = self.booting_s
        for dep in deps:  # still booting at the end
            for engine in dep.booting.values():
                k = self._engine_index[id(engine)][2]
                booting += engine.shape.gpus * max(0.0, last - (self.on_at[k] or last))
        return RunResult(
            requests=list(requests),
            engines=self.engine_list,
            deployments=[d.spec for d in deps],
            span_s=last - first,
            wall_s=time.perf_counter() - wall,
            events=events,
            on_s=on_s,
            booting_s=booting,
            timeline=self.timeline,
            exhaustions=self.exhaustions,
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
    booting_gpu_hours: float = 0.0  # of gpu_hours
    peak_replicas: int = 0  # serving + booting at most (fixed fleets: the engines)
    exhaustions: int = 0  # autoscaler ticks short of warm spares
    first_exhaustion_s: float | None = None


def engine_kwh(gpu: str, engine: Engine, span_s: float) -> float:
    """Busy time at TDP, the rest of `span_s` (the time it was on) at the GPU's measured idle
    draw (midpoint of its range), per GPU of the engine: a simple per-GPU figure, not a power
    model. Booting is counted at the idle draw."""
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
    on_s = result.on_s or [span] * len(result.engines)
    gpu_s = sum(e.shape.gpus * on for (_, e), on in zip(result.engines, on_s, strict=True))
    if result.timeline:
        peak = max(p.serving + p.booting for p in result.timeline)
    else:
        peak = len(result.engines)
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
        gpu_hours=gpu_s / 3600,
        kwh=sum(engine_kwh(g, e, on) for (g, e), on in zip(result.engines, on_s, strict=True)),
        span_s=span,
        booting_gpu_hours=result.booting_s / 3600,
        peak_replicas=peak,
        exhaustions=len(result.exhaustions),
        first_exhaustion_s=result.exhaustions[0].at if result.exhaustions else None,
    )
