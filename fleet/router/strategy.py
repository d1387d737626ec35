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
  the request's own time there (`own_seconds`): its prompt at that GPU's arithmetic speed, then
  its expected tokens at that GPU's decode pace for the replica's batch, from the cost model
  (`iter_s`, `token_s`, `kv_s`; for a GPU the model does not know, one stream's top speed,
  `stream_rate`).
- `prefix_aware`: `estimated_completion_time` with a prefix credit: on each replica the request
  costs its prompt less the tokens that replica's prefix index (prefix.py) expects in its KV
  cache (`cached`), and its estimate is lower by a credit for each of those tokens, so a
  conversation's next turn goes where its history is cached unless that replica's queue or
  speed costs more than the credit is worth. The pool books only those uncached tokens as the
  replica's prefill work.
- `model_affinity`: a wrapper that keeps a model on the replicas that have it loaded, and lets
  a hot model spread to the others when those are saturated. The default strategy is
  `prefix_aware` behind affinity (without a cached prefix it chooses as
  `estimated_completion_time` does).

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

from fleet.router.prefix import PREFIX_CREDIT, PrefixIndex

PREFILL_WEIGHT = 0.15
_INF = float("inf")
STRATEGIES = (
    "round_robin",
    "least_pending",
    "least_kv",
    "estimated_completion_time",
    "model_affinity",
    "prefix_aware",
)
DEFAULT_STRATEGY = "model_affinity"  # behind it: prefix_aware


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
    # The cost model's iteration time on its GPU (estimates.iteration_costs; 0: not known):
    # seconds per iteration, per token computed, per context token read
    iter_s: float = 0.0
    token_s: float = 0.0
    kv_s: float = 0.0
    ejected_until: float = 0.0  # monotonic seconds; after repeated failures
    version: str = ""  # "<model>@<version>" it runs ("": not known, taken as the stable one)
    # The prompt blocks booked here, as the router pictures the engine's prefix cache (prefix.py)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    def available(self, now: float) -> bool:  # (inlined in `_open`)
        return self.ready and self.inflight < self.limit and now >= self.ejected_until

    def work(self, prefill_weight: float = PREFILL_WEIGHT) -> float:
        return self.prompt_inflight * prefill_weight + self.output_left


@dataclass(frozen=True, init=False)
class Request:
    model: str
    prompt_tokens: int
    expected_output: float  # the deployment's running estimate, capped by max_tokens
    blocks: tuple[int, ...]  # its prompt's leading-block hashes (prefix.py; () when not known)

    # Written out, not generated: the simulator's compiled build (fleet/sim/native.py) makes
    # one per request, and mypyc compiles only an __init__ it can see. (Frozen: set once.)
    def __init__(
        self,
        model: str,
        prompt_tokens: int,
        expected_output: float,
        blocks: tuple[int, ...] = (),
    ) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "expected_output", expected_output)
        object.__setattr__(self, "blocks", blocks)

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


def own_seconds(replica: Replica, request: Request, fresh: float) -> float:
    """The request's own seconds on `replica`, by the cost model's iteration time on its GPU
    (`iter_s`, `token_s`, `kv_s`): its `fresh` prompt tokens (those not in the replica's
    prefix cache) in one iteration — prefill is bound by arithmetic, `token_s` each — then one
    decode iteration per expected output token at the replica's batch with this request in it,
    each reading the KV cache of the prompts in flight and half the outputs — decode is bound
    by memory bandwidth, so a request's speed depends on its GPU and its batch, not on how
    much work the others have queued. 0 when the GPU is not known."""
    output = request.expected_output
    itl = (
        replica.iter_s
        + replica.token_s * (replica.inflight + 1)
        + replica.kv_s
        * (replica.prompt_inflight + request.prompt_tokens + 0.5 * (replica.output_left + output))
    )
    return replica.iter_s + replica.token_s * fresh + output * itl


def completion_time(
    replica: Replica, request: Request, prefill_weight: float = PREFILL_WEIGHT
) -> float:
    """Seconds until `replica` would finish `request` after everything it has in flight: the
    queue view (all the work at the replica's throughput), but never less than the request's
    own time at the replica's current batch (`own_seconds`) — an idle slow GPU still decodes
    one token per iteration, and its full-batch throughput would make it look faster than a
    busy fast one. Without the cost model's figures for the GPU, the floor is the request at
    one stream's top speed (`stream_rate`)."""
    cost = request.cost(prefill_weight)
    queued = (replica.work(prefill_weight) + cost) / max(replica.capacity, 1e-9)
    if replica.token_s > 0.0:
        return max(queued, own_seconds(replica, request, request.prompt_tokens))
    return max(queued, cost / max(replica.stream_rate, 1e-9))


@dataclass
class CompletionTime(_Scored):
    """`estimated_completion_time`: `_Scored` with the score (completion_time, inflight), its
    arithmetic inlined in `choose` (the same choice, without a function call per candidate;
    the simulator makes one choice per request). The lowest completion time wins, and it does
    not fall as `output_left` grows (fleet/sim/core.py relies on both)."""

    prefill_weight: float = PREFILL_WEIGHT
    # `prefix_aware`: on each replica, the request's prefill counts only the prompt tokens
    # its prefix index does not expect cached there (prefix.py: `cached`), and each cached
    # token takes (`prefix_credit` - 1) prefill weights more off the estimate, at the
    # fastest candidate's throughput (prefix.py: PREFIX_CREDIT, measured)
    prefix: bool = False
    prefix_credit: float = 1.0

    def choose(self, replicas: Sequence[Replica], request: Request, now: float) -> Replica | None:
        # self._rotated(replicas, now), walked in place instead of copied (one choice a request)
        candidates = _open(replicas, now)
        n = len(candidates)
        if not n:
            return None
        offset = next(self._turn) % n
        weight = self.prefill_weight
        full = request.cost(weight)
        prompt = request.prompt_tokens
        output = request.expected_output
        blocks = request.blocks if self.prefix else ()
        # Seconds a cached token takes off the estimate beyond its prefill skipped: priced at
        # the fastest candidate's throughput, so that a slow replica, whose own seconds are
        # long, does not earn a longer credit than a fast one
        bonus = 0.0
        if blocks:
            top = max(r.capacity for r in candidates)
            bonus = weight * (self.prefix_credit - 1.0) / (1e-9 if top < 1e-9 else top)
        best = None
        best_t = best_n = 0.0
        inf = _INF
        for i in range(n):  # as completion_time(r, request, weight), float(r.inflight)
            k = offset + i
            r = candidates[k if k < n else k - n]
            cached = r.prefix.cached(blocks, prompt) if blocks else 0.0  # the prefix credit
            # Both views count the prefill really skipped; the credit beyond it comes off
            # whichever bounds the estimate (an idle replica's is its own time, a busy one's
            # its queue), so that it holds for an idle replica as for a loaded one.
            fresh = prompt - cached  # the prompt tokens to prefill
            capacity = r.capacity
            queued = (r.prompt_inflight * weight + r.output_left + full - cached * weight) / (
                1e-9 if capacity < 1e-9 else capacity  # max(capacity, 1e-9)
            )
            token_s = r.token_s
            if token_s > 0.0:  # own_seconds(r, request, fresh)
                iter_s = r.iter_s
                itl = (
                    iter_s
                    + token_s * (r.inflight + 1)
                    + r.kv_s * (r.prompt_inflight + prompt + 0.5 * (r.output_left + output))
                )
                own = iter_s + token_s * fresh + output * itl
                t = own if own > queued else queued  # max(queued, own)
            else:
                rate = r.stream_rate
                if rate == inf:  # no floor: cost / inf is 0
                    t = 0.0 if queued < 0.0 else queued
                else:
                    alone = (full - cached * weight) / (1e-9 if rate < 1e-9 else rate)
                    t = alone if alone > queued else queued  # max(queued, alone)
            if cached:
                t -= cached * bonus
            if best is None or t < best_t or (t == best_t and r.inflight < best_n):
                best, best_t, best_n = r, t, float(r.inflight)  # min: the first lowest
        return best


def estimated_completion_time(prefill_weight: float = PREFILL_WEIGHT) -> _Scored:
    return CompletionTime(
        "estimated_completion_time",
        lambda r, q: (completion_time(r, q, prefill_weight), float(r.inflight)),
        prefill_weight=prefill_weight,
    )


def prefix_aware(prefill_weight: float = PREFILL_WEIGHT) -> CompletionTime:
    """`estimated_completion_time` with each replica's prefix credit (prefix.py): a turn goes
    where its conversation's KV blocks are cached unless that replica's queue or speed costs
    more than the credit is worth: the prefill skipped, and (PREFIX_CREDIT - 1) × the prefill
    weight per cached token at the fastest candidate's throughput."""
    return CompletionTime(
        "prefix_aware",
        lambda r, q: (completion_time(r, q, prefill_weight), float(r.inflight)),
        prefill_weight=prefill_weight,
        prefix=True,
        prefix_credit=PREFIX_CREDIT,
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


def credits_prefix(strategy: RoutingStrategy) -> bool:
    """Whether `strategy` gives prefix credit (`prefix_aware`, or affinity over it): the pool
    then books a request's prompt on a replica less the tokens expected cached there."""
    inner = strategy.inner if isinstance(strategy, ModelAffinity) else strategy
    return isinstance(inner, CompletionTime) and inner.prefix


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
        return ModelAffinity(prefix_aware(prefill_weight), prefill_weight=prefill_weight)
    if name == "prefix_aware":
        return prefix_aware(prefill_weight)
    raise ValueError(f"unknown routing strategy {name!r} (one of {', '.join(STRATEGIES)})")
