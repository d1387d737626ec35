"""Routing strategies: which ready replica gets the next request (pure; the simulator imports it).

Round-robin fails on GPU inference: requests differ by orders of magnitude in cost (a 20-token
answer to a 2,000-token prompt, or 1,000 tokens of output to a short one) and GPUs differ in
speed (an L40S decodes a 70B model at about a quarter of an H200's rate). The strategies:

- `round_robin`: the next replica in turn (the baseline).
- `least_pending`: the fewest requests in flight through this router (its own exact count),
  the engine's reported queue breaking ties.
- `least_kv`: the lowest KV-cache use the engine reports (the seed's "least GPU memory").
- `estimated_completion_time`: the replica that would finish the request soonest: its
  outstanding work (prompt tokens in flight, which the router counts exactly, weighted by
  `prefill_weight`, plus the output tokens it still expects of them) plus the request's own cost,
  divided by its measured throughput (`capacity`, work units per second) — but never less than
  the request's cost at one stream's top speed on that GPU (`stream_rate`, from the cost model).
- `model_affinity`: a wrapper that keeps a model on the replicas that have it loaded, and lets
  a hot model spread to the others when those are saturated. The default strategy is
  `estimated_completion_time` behind affinity.

A replica at its concurrency limit, not ready, or ejected after failures is never chosen; when
every replica is, `choose` returns None and the request waits in the router's queue.

One work unit is one output token; a prompt token costs `prefill_weight` of one. The default
(0.15) comes from the engine cost model (fleet_core/cost_model.py): at a serving batch of
~32 a decode step spends the weight-streaming time on 32 tokens, while a prompt token in the
same iteration adds only its arithmetic, about a seventh of a decode token's share.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

PREFILL_WEIGHT = 0.15
_INF = float("inf")
STRATEGIES = (
    "round_robin",
    "least_pending",
    "least_kv",
    "estimated_completion_time",
    "model_affinity",
)
DEFAULT_STRATEGY = "model_affinity"  # behind it: estimated_completion_time


@dataclass
class Replica:
    """The router's view of one engine: what its agent reports (polled) and what the router
    itself has in flight there (exact)."""

    url: str  # the engine's base URL: the replica's identity
    server: str = ""
    gpu_model: str = ""
    models: frozenset[str] = frozenset()
    limit: int = 64  # requests in flight through this router at most
    # From the agent's /state (polled; a fraction of a second old)
    ready: bool = True
    queued: int = 0
    running: int = 0
    kv_use: float | None = None
    # The router's own accounting
    inflight: int = 0
    prompt_inflight: int = 0  # prompt tokens of the requests in flight
    output_left: float = 0.0  # output tokens the requests in flight are still expected to write
    capacity: float = 1.0  # measured throughput, work units per second (see the module doc)
    stream_rate: float = float("inf")  # one request's top speed alone, work units per second
    ejected_until: float = 0.0  # monotonic seconds; after repeated failures
    version: str = ""  # "<model>@<version>" it runs ("": not known, taken as the stable one)

    def available(self, now: float) -> bool:  # (inlined in `_open`)
        return self.ready and self.inflight < self.limit and now >= self.ejected_until

    def work(self, prefill_weight: float = PREFILL_WEIGHT) -> float:
        return self.prompt_inflight * prefill_weight + self.output_left


@dataclass(frozen=True, init=False)
class Request:
    model: str
    prompt_tokens: int
    expected_output: float  # the deployment's running estimate, capped by max_tokens

    # Written out, not generated: the simulator's compiled build (fleet/sim/native.py) makes
    # one per request, and mypyc compiles only an __init__ it can see. (Frozen: set once.)
    def __init__(self, model: str, prompt_tokens: int, expected_output: float) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "expected_output", expected_output)

    def cost(self, prefill_weight: float = PREFILL_WEIGHT) -> float:
        return self.prompt_tokens * prefill_weight + self.expected_output


class RoutingStrategy(Protocol):
    name: str

    def choose(self, replicas: Sequence[Replica], request: Request, now: float) -> Replica | None:
        """The replica for `request`, or None when none is available."""
        ...


def _open(replicas: Sequence[Replica], now: float) -> list[Replica]:
    """The available ones (`Replica.available`, inlined: this runs for every choice)."""
    return [r for r in replicas if r.ready and r.inflight < r.limit and now >= r.ejected_until]


@dataclass
class RoundRobin:
    name: str = "round_robin"
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, replicas: Sequence[Replica], request: Request, now: float) -> Replica | None:
        if not replicas:
            return None
        # The turn walks the full list, so that a replica skipped while busy keeps its place.
        start = next(self._turn)
        for i in range(len(replicas)):
            candidate = replicas[(start + i) % len(replicas)]
            if candidate.available(now):
                return candidate
        return None


@dataclass
class _Scored:
    """Lowest score wins; ties go round the candidates in turn (no replica is everyone's
    favourite just for sorting first)."""

    name: str
    score: Callable[[Replica, Request], tuple[float, ...]]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, replicas: Sequence[Replica], request: Request, now: float) -> Replica | None:
        rotated = self._rotated(replicas, now)
        return min(rotated, key=lambda r: self.score(r, request)) if rotated else None

    def _rotated(self, replicas: Sequence[Replica], now: float) -> list[Replica]:
        """The available replicas, starting one further along each time (the tie turn)."""
        candidates = _open(replicas, now)
        if not candidates:
            return candidates
        offset = next(self._turn) % len(candidates)
        return candidates[offset:] + candidates[:offset]


def least_pending() -> _Scored:
    return _Scored("least_pending", lambda r, _: (float(r.inflight), float(r.queued)))


def least_kv() -> _Scored:
    return _Scored("least_kv", lambda r, _: (r.kv_use or 0.0, float(r.inflight)))


def completion_time(
    replica: Replica, request: Request, prefill_weight: float = PREFILL_WEIGHT
) -> float:
    """Seconds until `replica` would finish `request` after everything it has in flight: the
    queue view (all the work at the replica's throughput), but never less than the request
    alone at one stream's top speed — an idle slow GPU still decodes one token per iteration,
    and its full-batch throughput would make it look faster than a busy fast one."""
    cost = request.cost(prefill_weight)
    queued = (replica.work(prefill_weight) + cost) / max(replica.capacity, 1e-9)
    return max(queued, cost / max(replica.stream_rate, 1e-9))


@dataclass
class CompletionTime(_Scored):
    """`estimated_completion_time`: `_Scored` with the score (completion_time, inflight), its
    arithmetic inlined in `choose` (the same choice, without a function call per candidate;
    the simulator makes one choice per request). The lowest completion time wins, and it does
    not fall as `output_left` grows (fleet/sim/core.py relies on both)."""

    prefill_weight: float = PREFILL_WEIGHT

    def choose(self, replicas: Sequence[Replica], request: Request, now: float) -> Replica | None:
        rotated = self._rotated(replicas, now)
        if not rotated:
            return None
        weight = self.prefill_weight
        cost = request.cost(weight)
        best = None
        best_t = best_n = 0.0
        inf = _INF
        for r in rotated:  # as completion_time(r, request, weight), float(r.inflight)
            capacity = r.capacity
            queued = (r.prompt_inflight * weight + r.output_left + cost) / (
                1e-9 if capacity < 1e-9 else capacity  # max(capacity, 1e-9)
            )
            rate = r.stream_rate
            if rate == inf:  # no floor: cost / inf is 0
                t = 0.0 if queued < 0.0 else queued
            else:
                alone = cost / (1e-9 if rate < 1e-9 else rate)
                t = alone if alone > queued else queued  # max(queued, alone)
            if best is None or t < best_t or (t == best_t and r.inflight < best_n):
                best, best_t, best_n = r, t, float(r.inflight)  # min: the first lowest
        return best


def estimated_completion_time(prefill_weight: float = PREFILL_WEIGHT) -> _Scored:
    return CompletionTime(
        "estimated_completion_time",
        lambda r, q: (completion_time(r, q, prefill_weight), float(r.inflight)),
        prefill_weight=prefill_weight,
    )


@dataclass
class ModelAffinity:
    """Replicas with the model loaded first; a hot model spreads to the rest when the best of
    those would take more than `spread` times the best elsewhere (or none is available)."""

    inner: RoutingStrategy
    spread: float = 2.0
    prefill_weight: float = PREFILL_WEIGHT
    name: str = "model_affinity"

    def choose(self, replicas: Sequence[Replica], request: Request, now: float) -> Replica | None:
        loaded = [r for r in replicas if request.model in r.models]
        if not loaded or len(loaded) == len(replicas):
            return self.inner.choose(replicas, request, now)
        pick = self.inner.choose(loaded, request, now)
        others = [r for r in replicas if request.model not in r.models]
        elsewhere = self.inner.choose(others, request, now)
        if pick is None or elsewhere is None:
            return pick or elsewhere
        here = completion_time(pick, request, self.prefill_weight)
        there = completion_time(elsewhere, request, self.prefill_weight)
        return elsewhere if here > self.spread * there else pick


def make(name: str, prefill_weight: float = PREFILL_WEIGHT) -> RoutingStrategy:
    """A fresh strategy by name (each deployment gets its own: the turn counters are state)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_pending":
        return least_pending()
    if name == "least_kv":
        return least_kv()
    if name == "estimated_completion_time":
        return estimated_completion_time(prefill_weight)
    if name == "model_affinity":
        return ModelAffinity(
            estimated_completion_time(prefill_weight), prefill_weight=prefill_weight
        )
    raise ValueError(f"unknown routing strategy {name!r} (one of {', '.join(STRATEGIES)})")
