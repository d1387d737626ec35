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
strategies that read it — for the engines that changed or are still streaming, and not for a
replica that provably cannot win the decision (`_open_to`: the same choice as reading them
all). `kv_use`, `queued` and `running` are taken fresh from the engine at that moment (the
real router sees them polled, a fraction of a second old).

Events: the engines' block ends (fleet/sim/engine.py) in time order (`_Events`, a calendar
queue), merged with the arrival list and the timers (autoscaler ticks, boots finishing); at
equal times an engine's block end comes first, then a timer, then an arrival.

Autoscaling (a deployment with `autoscale`; fleet/sim/autoscale.py): each tick asks the
production policy for a target and makes it true: warm spares boot and join the pool when
ready; a scale-down calls off boots first, then drains a replica (not ready in the pool: no new
requests) that leaves, back to the warm pool, when its last request finishes. The calendar
(fleet/sim/calendar.py) raises floors on its own ticks; with racks (fleet/sim/racks.py) the
spares to boot and the replicas to release are fleet/provisioning/placement.py's choice.

Faults (fleet/sim/faults.py): Xid timers per serving engine; the agent's fault policy judges
them; an engine restart, or a self-drain and then `fleet.provisioning.escalation.escalate`'s power
cycle or
quarantine.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from fleet.autoscaler.policy import decide
from fleet.autoscaler.signals import Signals
from fleet.provisioning import placement
from fleet.provisioning.escalation import escalate
from fleet.router.admission import AdmissionQueue
from fleet.router.config import RouterSettings
from fleet.router.estimates import Throughput, iteration_costs, prior_capacity, stream_rate
from fleet.router.pool import DeploymentPool
from fleet.router.strategy import (
    CompletionTime,
    ModelAffinity,
    Replica,
    Request,
    completion_time,
    make,
)
from fleet.sim import autoscale as auto
from fleet.sim import faults as flt
from fleet.sim import power as sim_power
from fleet.sim import racks as sim_racks
from fleet.sim.autoscale import AutoscaleSpec, Exhaustion, RouterLoad, ScalePoint
from fleet.sim.calendar import DEFAULT_START, TICK_S, Calendar, Fired
from fleet.sim.engine import Batching, Engine, SimRequest, outputs_left
from fleet.sim.faults import FaultCounts, FaultSpec
from fleet.sim.racks import RackSpec
from fleet_core import cost_model
from fleet_core.cost_model import EngineShape
from fleet_core.fault_policy import RepairAction, Verdict
from fleet_core.gcpause import collector_paused
from fleet_core.telemetry import Snapshot

READS_OUTPUT_LEFT = frozenset({"estimated_completion_time", "model_affinity", "prefix_aware"})
_NOTHING: frozenset[str] = frozenset()  # no replica excluded
ROUTER_ATTEMPTS = int(RouterSettings.model_fields["attempts"].default)


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
    faults: FaultSpec | None = None  # None: no GPU faults (fleet/sim/faults.py)

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


class _Due:
    """An engine's block end on the event heap, ordered by (time, sequence). A compiled class
    with its own `__lt__` compares in one call where a (time, seq, engine) tuple took three
    (the heap is ~100,000 deep at 100,000 GPUs)."""

    __slots__ = ("engine", "seq", "t")

    def __init__(self, t: float, seq: int, engine: Engine) -> None:
        self.t = t
        self.seq = seq
        self.engine = engine

    def __lt__(self, other: _Due) -> bool:
        return self.t < other.t or (self.t == other.t and self.seq < other.seq)


BUCKET_S = 0.01  # the event queue's bucket width (simulated seconds)
_LAST_K = 1 << 62  # the bucket of an end at no finite time (taken after every other)


class _Events:
    """The engines' block ends, taken in (time, sequence) order: the same order as one heap of
    them, kept as a calendar queue. Ends later than the current bucket are appended to their
    bucket of BUCKET_S (one list append on a cold line); a bucket is heapified when it becomes
    the current one and is then small enough to stay in the CPU's caches. One heap over
    100,000 engines' ends walked ~17 cold entries per pop (`heappop` ~10 % of the
    100,000-GPU run by perf; what the whole run gained is smaller: docs/sim.md)."""

    __slots__ = ("buckets", "current", "k", "later")

    def __init__(self) -> None:
        self.current: list[_Due] = []  # a heap: the ends in buckets up to k
        self.k = -1  # the current bucket's number
        self.buckets: dict[int, list[_Due]] = {}  # later buckets by number, unordered
        self.later: list[int] = []  # a heap of their numbers

    def push(self, due: _Due) -> None:
        t = due.t
        # t >= 0: the floor; monotonic in t, so buckets keep the order
        k = int(t / BUCKET_S) if t < math.inf else _LAST_K
        if k <= self.k:  # (an end before the current bucket's is still after every one taken)
            heapq.heappush(self.current, due)
            return
        bucket = self.buckets.get(k)
        if bucket is None:
            self.buckets[k] = [due]
            heapq.heappush(self.later, k)
        else:
            bucket.append(due)

    def first(self) -> _Due | None:
        """The earliest end, left in place; None when there is none."""
        current = self.current
        if not current:
            if not self.later:
                return None
            self.k = heapq.heappop(self.later)
            current = self.current = self.buckets.pop(self.k)
            heapq.heapify(current)
        return current[0]

    def pop(self) -> _Due:
        """The earliest end (after `first` has returned it)."""
        return heapq.heappop(self.current)


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
    # `_refresh`'s books, by replica URL: the engines changed since the last decision, and the
    # ones with requests in generation (their output_left moves with the clock)
    dirty: dict[str, Engine] = field(default_factory=dict)
    decoding: dict[str, tuple[Engine, Replica]] = field(default_factory=dict)
    idle: dict[str, Replica] = field(default_factory=dict)  # nothing booked on its engine
    # Faults (fleet/sim/faults.py)
    faulted: dict[str, tuple[str, str]] = field(
        default_factory=dict
    )  # self-draining: action, fault
    restarting: dict[str, Engine] = field(default_factory=dict)  # engine restarts in progress
    xid_history: dict[str, list[Snapshot]] = field(default_factory=dict)
    reboot_history: dict[str, tuple[str | None, int]] = field(default_factory=dict)

    def serving(self) -> int:
        """Replicas that count as serving: a self-draining one does not (its server leaves
        SERVING), one whose engine restarts does (its server stays SERVING)."""
        return len(self.engines) - len(self.draining) - len(self.faulted) + len(self.restarting)

    calendar: Calendar | None = None  # its scheduled floors (fleet/sim/calendar.py)
    floor: int = 0  # the calendar's floor now


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
    faults: FaultCounts | None = None  # None: no deployment has faults
    fired: list[Fired] = field(default_factory=list)  # calendar windows fired
    engine_deployments: list[int] = field(default_factory=list)  # per engine: its deployment
    power: sim_power.PowerReport | None = None  # the racks' power books (fleet/sim/power.py)


class Simulation:
    def __init__(
        self,
        deployments: Sequence[DeploymentSpec],
        *,
        per_iteration: bool = False,
        warm_pool: Sequence[tuple[str, int]] = (),
        seed: int = 0,
        start: datetime = DEFAULT_START,  # the wall-clock time of simulated second 0
        calendar_interval_s: float = TICK_S,
        racks: Sequence[RackSpec] = (),
        power: sim_power.PowerSpec | None = None,
        power_from_s: float = 0.0,  # the power figures' means and peaks: samples after this
    ):
        self.now = 0.0
        self.per_iteration = per_iteration
        self.deps: list[_Dep] = []
        self.engine_list: list[tuple[str, Engine]] = []
        self.on_at: list[float | None] = []  # per engine: when it started booting (None: start)
        self.off_at: list[float | None] = []  # when it left (None: still there at the end)
        self.booting_s = 0.0
        self._engine_slot: dict[int, int] = {}  # id(engine) -> its index in engine_list
        self._rng = random.Random(seed * 7919 + 17)
        self.shared_warm: dict[str, int] = {g: n for g, n in warm_pool if n > 0}
        # Placement (fleet/sim/racks.py): the shared warm pool as servers in racks.
        if racks and warm_pool:
            raise ValueError("give the shared warm pool as racks or as counts, not both")
        self.racks = tuple(racks)
        gpus = max((d.tp_size for d in deployments), default=1)
        self._servers = {x.name: x for x in sim_racks.spares(self.racks, gpus)}
        self._free = dict(self._servers)  # warm, by name
        self._placed: dict[str, str] = {}  # engine URL → its server's name
        for x in self._servers.values():
            self.shared_warm[x.gpu_model] = self.shared_warm.get(x.gpu_model, 0) + 1
        # Drawn power, budget modes and the cap valve (fleet/sim/power.py)
        if power is not None and not self.racks:
            raise ValueError("power needs racks")
        self.books = (
            None
            if power is None
            else sim_power.PowerBooks(power, self.racks, self._servers.values())
        )
        self._power_from_s = power_from_s
        self._on_server: dict[str, tuple[_Dep, str]] = {}  # server → its replica now
        self.timeline: list[ScalePoint] = []
        self.exhaustions: list[Exhaustion] = []
        # (time, seq, kind, deployment index, URL): autoscaler ticks and boots finishing
        self._timers: list[tuple[float, int, str, int, str]] = []
        self._ready_at: dict[str, float] = {}
        self._boot_at: dict[str, float] = {}  # URL → when its current boot began
        self._seq = 0
        # Faults draw from their own stream: turning them on leaves the boot draws as they were.
        self._fault_rng = random.Random(seed * 7919 + 29)
        self._life: dict[str, int] = {}  # URL → how many times it joined (stale fault timers)
        self.fault_counts = FaultCounts()
        self.fired: list[Fired] = []
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
                if a.calendar:
                    dep.calendar = Calendar(spec.name, a.calendar, start, calendar_interval_s)
        self._events = _Events()

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
        engine.owner = dep.index
        self._engine_slot[id(engine)] = len(self.engine_list)
        self.engine_list.append((gpu, engine))
        self.on_at.append(on_at)
        self.off_at.append(None)
        return url, engine

    def _slot(self, engine: Engine) -> tuple[int, str]:
        """The engine's index in `engine_list` (and `on_at`, `off_at`) and its GPU model."""
        k = self._engine_slot[id(engine)]
        return k, self.engine_list[k][0]

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
            # as the router's discovery gives them (without them no replica has a speed floor)
            stream_rate=stream_rate(gpu, spec.model, tp_size=spec.tp_size),
        )
        replica = dep.pool.replicas[url]
        replica.prefix.capacity = engine.max_blocks  # as discovery sizes it (index_capacity)
        replica.iter_s, replica.token_s, replica.kv_s = iteration_costs(
            gpu, spec.model, tp_size=spec.tp_size
        )
        dep.pool.throughput[url] = Throughput(prior)
        self._track(dep, url, engine)
        if spec.faults is not None:
            life = self._life[url] = self._life.get(url, 0) + 1
            wait = flt.next_fault_in(spec.faults, engine.shape.gpus, self._fault_rng)
            if wait < math.inf:
                self._timer(self.now + wait, "xid", dep.index, f"{url}#{life}")

    def _leave(self, dep: _Dep, url: str) -> None:
        """A drained engine (nothing in flight) leaves; its GPUs go back to the warm pool."""
        engine = dep.engines.pop(url)
        self._out_of_pool(dep, url)
        dep.draining.discard(url)
        k, gpu = self._slot(engine)
        self.off_at[k] = self.now
        self._to_warm(dep, url, gpu)

    # --- routing -----------------------------------------------------------------------------

    def _track(self, dep: _Dep, url: str, engine: Engine) -> None:
        """A replica joined the pool: its engine's fields are read at the next decision."""
        engine.url = url
        dep.dirty[url] = engine

    def _refresh(self, dep: _Dep, request: Request) -> None:
        """The engine-reported fields of the replicas, as of now, before the decision for
        `request`. `queued`, `running` and `kv_use` change only when the engine does (an add or
        a block end marks it in `dep.dirty`). `output_left` also falls with the clock while a
        request in generation is short of its expected length: those engines, and the ones
        changed, are in `dep.decoding` and read again for every decision (an engine whose
        figure stops moving leaves it), but for the replicas `_open_to` finds cannot be
        chosen. The choice is exactly the one with every engine read afresh."""
        replicas = dep.pool.replicas
        decoding = dep.decoding
        dirty = dep.dirty
        now = self.now
        todo: list[tuple[str, tuple[Engine, Replica]]] = []
        if dirty:
            reads = dep.reads_output_left
            idle = dep.idle
            for url, engine in dirty.items():
                replica = replicas.get(url)
                if replica is None:  # out of the pool
                    decoding.pop(url, None)
                    idle.pop(url, None)
                    continue
                replica.queued = len(engine.waiting)
                replica.running = len(engine.context) + len(engine.decoding)
                replica.kv_use = engine.used_fraction()
                if reads:
                    pair = decoding[url] = (engine, replica)
                    if engine.waiting or engine.context or engine.decoding:
                        idle.pop(url, None)
                    else:  # read now: it may set the bar (and it settles at once)
                        idle[url] = replica
                        todo.append((url, pair))
            if todo:
                for url in outputs_left(todo, now) or ():
                    del decoding[url]
                todo.clear()
        if decoding:
            self._open_to(dep, request, decoding, todo)
            if todo:
                for url in outputs_left(todo, now) or ():
                    del decoding[url]
        dirty.clear()

    def _open_to(
        self,
        dep: _Dep,
        request: Request,
        decoding: dict[str, tuple[Engine, Replica]],
        todo: list[tuple[str, tuple[Engine, Replica]]],
    ) -> None:
        """Adds to `todo` the engines of `decoding` whose replica the strategy might choose for
        `request`; the others keep their last `output_left`. With `estimated_completion_time`
        (or `model_affinity` over it: every replica here has the model), a replica that is not
        available is not scored, and one whose completion time with output_left 0 already
        exceeds an available idle replica's (whose figure is fresh) cannot be chosen, with its
        last figure or with the true one: both are ≥ 0 and the score does not fall as
        output_left grows. So the choice is the one with every figure fresh. Other
        strategies: all of them."""
        strategy = dep.pool.strategy
        if isinstance(strategy, ModelAffinity):
            strategy = strategy.inner
        if not isinstance(strategy, CompletionTime) or (strategy.prefix and request.blocks):
            todo += decoding.items()  # (a prefix credit lowers some replicas' cost: no bar)
            return
        now = self.now
        weight = strategy.prefill_weight
        prompt = request.prompt_tokens
        output = request.expected_output
        cost = prompt * weight + output  # request.cost(weight)
        replicas = dep.pool.replicas
        bar = math.inf  # the completion time of an available idle replica (the first)
        for url, j in dep.idle.items():
            if (
                j.ready
                and j.inflight < j.limit
                and now >= j.ejected_until
                and replicas.get(url) is j
            ):
                # the same arithmetic as CompletionTime.choose
                bar = completion_time(j, request, weight)
                break
        for url, pair in decoding.items():
            m = pair[1]
            if not (m.ready and m.inflight < m.limit and now >= m.ejected_until):
                continue  # not scored
            # A floor under its completion time: both parts of CompletionTime.choose's max
            # with output_left 0 (each is no more than with any figure ≥ 0). Beaten by that
            # idle one whatever it has left when the floor is above the bar.
            capacity = m.capacity
            if (m.prompt_inflight * weight + cost) / (1e-9 if capacity < 1e-9 else capacity) > bar:
                continue  # the queue part
            token_s = m.token_s
            if token_s > 0.0:  # own_seconds: its batch is slower than the idle one's
                iter_s = m.iter_s
                itl = (
                    iter_s
                    + token_s * (m.inflight + 1)
                    + m.kv_s * (m.prompt_inflight + prompt + 0.5 * output)
                )
                if iter_s + token_s * prompt + output * itl > bar:
                    continue
            todo.append((url, pair))

    def _try_route(self, dep: _Dep, r: SimRequest) -> bool:
        pool = dep.pool
        now = self.now
        request = Request(dep.spec.model, r.prompt, pool.estimate.expected(r.max_tokens), r.blocks)
        self._refresh(dep, request)
        replica = pool._choose(request, _NOTHING)
        if replica is None:
            return False
        r.ticket = pool._book(replica, request)
        r.routed = now
        r.expected = request.expected_output
        url = replica.url
        engine = dep.engines[url]
        r.engine = id(engine)
        dep.dirty[url] = engine
        if engine.add(r, now):
            b = engine.block
            if b is not None:  # as _schedule
                self._seq += 1
                self._events.push(_Due(b.end, self._seq, engine))
        return True

    def _schedule(self, engine: Engine) -> None:
        t = engine.next_time
        if t < math.inf:
            self._seq += 1
            self._events.push(_Due(t, self._seq, engine))

    def _pump(self, dep: _Dep) -> None:
        while dep.waiting:
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
            if url in dep.draining or url in dep.faulted:
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
        window = auto.observe(servers, now, load, dep.history, a.keep_s, dep.spec.max_batch_size)
        serving = dep.serving()
        state = auto.state(
            dep.spec.name,
            a,
            gpus_per_replica=dep.spec.tp_size,
            target=dep.target,
            serving=serving,
            booting=len(dep.booting),
            last_up_at=dep.last_up_at,
            last_down_at=dep.last_down_at,
            floor=dep.floor,
            router_waiting=len(dep.waiting),
        )
        decision = decide(state, window, now, a.policy_config())
        if decision.target != dep.target and decision.rule not in ("min", "floor", "pinned"):
            if decision.target > dep.target:
                dep.last_up_at = now
            else:
                dep.last_down_at = now
        dep.target = decision.target
        self._apply(dep)
        self._record(dep, decision.rule)

    def _record(self, dep: _Dep, rule: str) -> None:
        """A point of the scaling timeline: the target and the replicas now."""
        self.timeline.append(
            ScalePoint(
                self.now,
                dep.spec.name,
                dep.target,
                dep.serving(),
                len(dep.booting),
                len(dep.draining),
                rule,
                sum(dep.warm.values()),
                floor=dep.floor,
            )
        )

    def _apply(self, dep: _Dep) -> None:
        a = dep.spec.autoscale
        assert a is not None
        now = self.now
        have = dep.serving() + len(dep.booting)
        if dep.target > have:
            short = 0
            reasons: tuple[str, ...] = ()
            if self._servers and dep.warm is self.shared_warm:
                chosen, short, reasons = self._place(dep, dep.target - have)
            else:
                chosen = []
                for _ in range(dep.target - have):
                    gpu = next(
                        (g for g, n in dep.warm.items() if n > 0 and self._fits(dep, g)), None
                    )
                    if gpu is None:
                        short += 1
                        continue
                    dep.warm[gpu] -= 1
                    chosen.append((gpu, None))
            for gpu, server in chosen:
                url, engine = self._new_engine(dep, gpu, now)
                if server is not None:
                    self._placed[url] = server
                    if self.books is not None:
                        self.books.placed(server, engine, now)
                        self._on_server[server] = (dep, url)
                dep.booting[url] = engine
                cached = server is not None and dep.spec.model in self._servers[server].cached
                ready = now + a.ready_s(self._rng, cached=cached)
                self._boot_at[url] = now
                self._ready_at[url] = ready
                self._timer(ready, "ready", dep.index, url)
            if short:
                self.exhaustions.append(Exhaustion(now, dep.spec.name, short, reasons))
        excess = have - dep.target
        while excess > 0 and dep.booting:  # the latest boot is called off first
            url = next(reversed(dep.booting))
            engine = dep.booting.pop(url)
            k, gpu = self._slot(engine)
            self.off_at[k] = now
            self.booting_s += engine.shape.gpus * (now - self._boot_at.pop(url, now))
            self._ready_at.pop(url, None)
            self._to_warm(dep, url, gpu)
            excess -= 1
        if excess > 0:
            # fleet/provisioning/placement.py's scale-in rule: the tightest rack first, then the
            # fewest in flight (engines outside the modelled racks count as the tightest)
            serving = []
            for url, engine in dep.engines.items():
                if url in dep.draining or url in dep.faulted:
                    continue
                box = self._servers.get(self._placed.get(url, ""))
                serving.append(
                    placement.Serving(
                        name=url,
                        rack=box.rack if box else "",
                        deployment=dep.spec.name,
                        in_flight=engine.live(),
                        max_w=box.max_w if box else 0.0,
                        standby_w=box.standby_w if box else 0.0,
                    )
                )
            for url in placement.choose_release(serving, self._rooms(), dep.spec.name, excess):
                dep.draining.add(url)
                dep.pool.replicas[url].ready = False
                if dep.engines[url].live() == 0:
                    self._leave(dep, url)

    # --- placement (fleet/sim/racks.py) ---------------------------------------------------------

    def _rooms(self) -> dict[str, placement.RackRoom]:
        if self.books is not None:
            return self.books.rooms()
        return sim_racks.rooms(
            self.racks, self._servers.values(), {x: x not in self._free for x in self._servers}
        )

    def _place(
        self, dep: _Dep, servers: int
    ) -> tuple[list[tuple[str, str | None]], int, tuple[str, ...]]:
        """Spares for `servers` more replicas, chosen by fleet/provisioning/placement.py: ((GPU,
        server)
        in boot order, how many could not be placed, why)."""
        models = {x.gpu_model for x in self._free.values()}
        running: dict[str, int] = {}
        for url in [*dep.engines, *dep.booting]:
            if (server := self._servers.get(self._placed.get(url, ""))) is not None:
                running[server.rack] = running.get(server.rack, 0) + 1
        want = placement.Want(
            deployment=dep.spec.name,
            model=dep.spec.model,
            gpu_models=tuple(sorted(g for g in models if self._fits(dep, g))) or ("(none fits)",),
            gpus_per_replica=dep.spec.tp_size,
            servers=servers,
            running_per_rack=running,
        )
        free = (
            list(self._free.values())
            if self.books is None
            else self.books.spares(self._free)  # what each commits once it boots
        )
        choice = placement.choose_spares(free, self._rooms(), want)
        picked = [self._free.pop(name) for name in choice.chosen]
        for x in picked:
            dep.warm[x.gpu_model] -= 1
        return [(x.gpu_model, x.name) for x in picked], choice.short, choice.reasons

    def _to_warm(self, dep: _Dep, url: str, gpu: str) -> None:
        """The engine's server powers off into the warm pool it came from."""
        server = self._placed.pop(url, None)
        if server is not None:
            self._free[server] = self._servers[server]
            if self.books is not None:
                self.books.off(server)
                self._on_server.pop(server, None)
        elif self._servers and dep.warm is self.shared_warm:
            return  # a replica of the starting fleet: outside the modelled racks
        dep.warm[gpu] = dep.warm.get(gpu, 0) + 1

    def _calendar(self, dep: _Dep) -> None:
        """One calendar tick (fleet/calendar/service.py `calendar_once`): the floor, and a
        firing raises the target at once (rule "calendar")."""
        a, cal = dep.spec.autoscale, dep.calendar
        assert a is not None and cal is not None
        tick = cal.tick(
            self.now,
            target=dep.target,
            max_servers=a.max_replicas,
            warm_models=[g for g, n in dep.warm.items() if n > 0 and self._fits(dep, g)],
            boot_p90_s=a.ready_p90_s,
        )
        dep.floor = tick.floor
        if not tick.fired:
            return
        self.fired.extend(tick.fired)
        dep.target = tick.target
        self._apply(dep)
        self._record(dep, "calendar")

    def _fits(self, dep: _Dep, gpu: str) -> bool:
        return cost_model.kv_capacity_blocks(dep.spec.shape(gpu)) >= 1

    def _ready(self, dep: _Dep, url: str) -> None:
        if self._ready_at.get(url) != self.now or url not in dep.booting:
            return  # called off (or an earlier boot's timer)
        del self._ready_at[url]
        engine = dep.booting.pop(url)
        self.booting_s += engine.shape.gpus * (self.now - self._boot_at.pop(url, self.now))
        self._join(dep, self._slot(engine)[1], (url, engine))
        self._pump(dep)

    # --- faults (fleet/sim/faults.py) ---------------------------------------------------------

    def _xid(self, dep: _Dep, tag: str) -> None:
        """An Xid on a serving engine, judged by the agent's fault policy."""
        url, _, life = tag.rpartition("#")
        engine = dep.engines.get(url)
        if engine is None or self._life.get(url) != int(life):
            return  # it left, or went through a restart or reboot since the draw
        if url in dep.draining or url in dep.faulted:
            return  # faults while draining are not modelled
        spec = dep.spec.faults
        assert spec is not None
        counts = self.fault_counts
        code = flt.draw_xid(spec, self._fault_rng)
        counts.xids[code] += 1
        assessment, kept = flt.judge(
            dep.xid_history.get(url, []), code, self.now, engine.shape.gpus, self._fault_rng
        )
        dep.xid_history[url] = kept
        if assessment.verdict is Verdict.UNHEALTHY:
            # The agent's self-drain: not ready at once; in-flight requests get the deadline.
            counts.drains += 1
            dep.faulted[url] = (assessment.action.value, flt.fault_code(assessment))
            dep.pool.replicas[url].ready = False
            if engine.live() == 0:
                self._remediate(dep, url)
            else:
                self._timer(self.now + spec.drain_deadline_s, "deadline", dep.index, tag)
            return
        if assessment.action is RepairAction.RESTART_ENGINE:
            # The engine process died; the supervisor starts it again.
            counts.restarts += 1
            self._lost(dep, engine.abort(self.now))
            self._out_of_pool(dep, url)
            dep.restarting[url] = dep.engines.pop(url)
            self._timer(self.now + spec.restart_s, "restarted", dep.index, url)
            self._pump(dep)
            return
        wait = flt.next_fault_in(spec, engine.shape.gpus, self._fault_rng)  # nothing to do
        self._timer(self.now + wait, "xid", dep.index, tag)

    def _deadline(self, dep: _Dep, tag: str) -> None:
        """The self-drain's deadline: the engines stop with what is left in flight."""
        url, _, life = tag.rpartition("#")
        if url not in dep.faulted or self._life.get(url) != int(life):
            return  # drained in time
        self._lost(dep, dep.engines[url].abort(self.now))
        self._remediate(dep, url)
        self._pump(dep)

    def _remediate(self, dep: _Dep, url: str) -> None:
        """The provisioner's step once the faulty server drained: `escalate` says power cycle
        (it boots again for the same deployment) or quarantine (it leaves the fleet)."""
        spec = dep.spec.faults
        assert spec is not None
        action, fault = dep.faulted.pop(url)
        engine = dep.engines.pop(url)
        self._out_of_pool(dep, url)
        dep.xid_history.pop(url, None)  # the agent forgets across reboots; the fleet does not
        last_fault, count = dep.reboot_history.get(url, (None, 0))
        remedy = escalate(
            action, fault, reboot_fault=last_fault, reboot_count=count, max_reboots=spec.max_reboots
        )
        k, _ = self._slot(engine)
        if remedy.quarantine:
            self.fault_counts.quarantined += 1
            self.off_at[k] = self.now
            if (server := self._placed.pop(url, None)) is not None:
                self._servers.pop(server)  # out of the fleet (its standby draw goes too)
                if self.books is not None:
                    self.books.gone(server)
                    self._on_server.pop(server, None)
            return
        self.fault_counts.reboots += 1
        dep.reboot_history[url] = (remedy.reboot_fault, remedy.reboot_count)
        boot = dep.spec.autoscale.boot if dep.spec.autoscale is not None else auto.BootTime()
        ready = self.now + boot.draw(self._rng)
        dep.booting[url] = engine
        self._boot_at[url] = self.now
        self._ready_at[url] = ready
        self._timer(ready, "ready", dep.index, url)

    def _restarted(self, dep: _Dep, url: str) -> None:
        engine = dep.restarting.pop(url)
        self._join(dep, self._slot(engine)[1], (url, engine))
        self._pump(dep)

    def _out_of_pool(self, dep: _Dep, url: str) -> None:
        del dep.pool.replicas[url]
        del dep.pool.throughput[url]
        dep.stats.pop(url, None)

    def _lost(self, dep: _Dep, requests: list[SimRequest]) -> None:
        """Requests whose engine went away. Those with no token out yet are retried on another
        replica (the router retries a connect error before the first byte, up to its attempts);
        the others fail."""
        retry: list[SimRequest] = []
        for r in requests:
            ticket = r.ticket
            assert ticket is not None
            r.ticket = None
            dep.pool.release(ticket, output_tokens=0, ok=False, failed=False)
            if r.first_token != r.first_token and r.retries + 1 < ROUTER_ATTEMPTS:
                r.retries += 1
                r.routed = r.start = math.nan
                r.engine = -1
                r.computed = r.reserved = r.i0 = 0
                retry.append(r)
                self.fault_counts.retried += 1
            else:
                r.failed = True
                self.fault_counts.failed += 1
        retry.sort(key=lambda r: (r.arrival, r.rid))
        dep.waiting.extendleft(reversed(retry))  # they came before everyone waiting

    # --- the loop ----------------------------------------------------------------------------

    def run(self, requests: Sequence[SimRequest]) -> RunResult:
        """Simulate `requests` (sorted by arrival; fresh SimRequest objects) to the end."""
        # No cycles made, none collected: the collector's passes over 100,000 engines' worth
        # of objects were a quarter of the run (fleet_core/gcpause.py).
        with collector_paused():
            return self._run(requests)

    def _run(self, requests: Sequence[SimRequest]) -> RunResult:
        import time

        wall = time.perf_counter()
        events_due = self._events
        timers = self._timers
        events = 0
        i, n = 0, len(requests)
        deps = self.deps
        first = requests[0].arrival if requests else 0.0
        scaled = [d for d in deps if d.spec.autoscale is not None]
        for d in scaled:
            assert d.spec.autoscale is not None
            self._timer(first + d.spec.autoscale.interval_s, "tick", d.index)
            if d.calendar is not None:
                self._timer(0.0, "calendar", d.index)  # on the wall clock's ticks from start
        if self.books is not None:
            self._timer(first + self.books.spec.sample_s, "power", -1)
            if self.books.spec.valve is not None:
                self._timer(first + self.books.spec.valve.interval_s, "valve", -1)
            self.books.sample(first, {})  # the first sample starts here
        inf = math.inf
        while True:
            head = events_due.first()
            te = inf if head is None else head.t
            ta = requests[i].arrival if i < n else inf
            if (
                te == inf
                and ta == inf
                and not any(d.waiting and (d.booting or d.restarting) for d in deps)
            ):
                break  # nothing left to happen (waiting requests with no boot to come: stuck)
            tt = timers[0][0] if timers else inf
            if te <= ta and te <= tt:
                due = events_due.pop()
                t, engine = due.t, due.engine
                b = engine.block
                if b is None or b.end != t:  # superseded (a cut or a replan)
                    continue
                self.now = t
                events += 1
                dep = deps[engine.owner]
                finished = engine.advance()
                dep.dirty[engine.url] = engine
                b = engine.block
                if b is not None:  # as _schedule
                    self._seq += 1
                    events_due.push(_Due(b.end, self._seq, engine))
                for r in finished:
                    ticket = r.ticket
                    assert ticket is not None
                    r.ticket = None
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
                    if dep.faulted:  # self-drains done in time
                        for url in [u for u in dep.faulted if dep.engines[u].live() == 0]:
                            self._remediate(dep, url)
                    if dep.waiting:
                        self._pump(dep)
            elif tt <= ta:
                t, _, kind, index, url = heapq.heappop(timers)
                self.now = t
                if kind == "power" or kind == "valve":
                    self._power_timer(kind)
                    continue
                dep = deps[index]
                if kind == "tick":
                    assert dep.spec.autoscale is not None
                    self._tick(dep)
                    self._timer(t + dep.spec.autoscale.interval_s, "tick", index)
                elif kind == "calendar":
                    assert dep.calendar is not None
                    self._calendar(dep)
                    self._timer(t + dep.calendar.tick_s, "calendar", index)
                elif kind == "xid":
                    self._xid(dep, url)
                elif kind == "deadline":
                    self._deadline(dep, url)
                elif kind == "restarted":
                    self._restarted(dep, url)
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
                if not self._try_route(dep, r):
                    dep.waiting.append(r)
        last = max((r.finish for r in requests if r.finish == r.finish), default=first)
        on_s = []
        for on_at, off_at in zip(self.on_at, self.off_at, strict=True):
            on = first if on_at is None else on_at
            off = last if off_at is None else min(off_at, last)
            on_s.append(max(0.0, off - on))
        booting = self.booting_s
        for dep in deps:  # still booting at the end
            for url, engine in dep.booting.items():
                booting += engine.shape.gpus * max(0.0, last - self._boot_at.get(url, last))
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
            faults=self.fault_counts if any(d.spec.faults for d in deps) else None,
            fired=self.fired,
            engine_deployments=[e.owner for _, e in self.engine_list],
            power=None if self.books is None else self.books.report(first + self._power_from_s),
        )

    # --- power (fleet/sim/power.py) -----------------------------------------------------------

    def _power_timer(self, kind: str) -> None:
        books = self.books
        assert books is not None
        now = self.now
        if kind == "power":
            serving = {}
            for server, (dep, url) in self._on_server.items():
                serving[server] = (
                    url in dep.engines and url not in dep.draining and url not in dep.faulted
                ) or url in dep.restarting
            books.sample(now, serving)
            self._timer(now + books.spec.sample_s, "power", -1)
            return
        valve = books.spec.valve
        assert valve is not None
        for rack in books.valve():
            for server, engine in books.on_engines(rack):
                if engine.set_limit(books.limit_w(server), now):
                    self._schedule(engine)
                    self._on_server[server][0].dirty[engine.url] = engine
        self._timer(now + valve.interval_s, "valve", -1)


# --- metrics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted `values` (q in 0..100); NaN when empty. The summary's
    and the charts' rule only: what the simulated autoscaler sees is fleet_core.stats's
    quantile, as in production (autoscale.p95). Switching this one too moves the p50 and p95
    columns by one rank where q·n is whole (docs/sim.md)."""
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
    # Faults (zero without them)
    failed: int = 0  # requests lost mid-stream (counted as SLA misses)
    retried: int = 0  # re-routed after their engine went away before their first token
    xids: int = 0
    engine_restarts: int = 0
    reboots: int = 0
    quarantined: int = 0
    # Power (fleet/sim/power.py; None without a scenario's `power`)
    power: sim_power.PowerReport | None = None
    served_p95: float = math.nan  # latency from routing to the last token (the router's wait out)


def engine_kwh(gpu: str, engine: Engine, span_s: float) -> float:
    """Busy time at TDP, the rest of `span_s` (the time it was on) at the GPU's measured idle
    draw (midpoint of its range), per GPU of the engine: a simple per-GPU figure, not a power
    model. Booting is counted at the idle draw."""
    spec = cost_model.gpu_spec(gpu)
    idle = spec.idle_mid_w
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
    failed = [r for r in reqs if r.failed]
    for r in (*done, *failed):
        s = specs[r.deployment]
        if s.latency_sla_s is None and s.ttft_sla_s is None:
            continue
        with_sla += 1
        ok = (
            not r.failed
            and (s.latency_sla_s is None or r.finish - r.arrival <= s.latency_sla_s)
            and (s.ttft_sla_s is None or r.first_token - r.arrival <= s.ttft_sla_s)
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
        failed=len(failed),
        retried=sum(1 for r in reqs if r.retries),
        xids=sum(f.xids.values()) if (f := result.faults) else 0,
        engine_restarts=f.restarts if f else 0,
        reboots=f.reboots if f else 0,
        quarantined=f.quarantined if f else 0,
        power=result.power,
        served_p95=percentile(sorted(r.finish - r.routed for r in done), 95),
    )
