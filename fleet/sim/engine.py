"""One simulated engine on a virtual clock: continuous or static batching, cost-model timed.

The stand-in's cost model (fleet_core/cost_model.py) is the one implementation of an
iteration's duration; this module only decides what each iteration carries, following the
stand-in's core (fleet_agent/engine/core.py) and trtllm-serve's defaults:

- GUARANTEED_NO_EVICT admission, first come first served: a waiting request is admitted only
  while fewer than max_batch_size requests run and KV blocks for prompt + max_tokens are free
  after every running request's reservation. Nothing is evicted.
- Each iteration decodes one token for every request in generation, then schedules prompts
  first come first served within max_num_tokens (whole prompts, or chunks with chunked
  prefill). The iteration that computes a prompt's last token also writes its first token.
- Static batching (for comparison): a batch is formed only when the engine is empty, runs
  until its longest request has finished, and admits nothing meanwhile; a finished request
  stays in the batch as padding (it still costs a decode slot and grows its KV read) until the
  batch ends, although its own answer is complete (streamed) when its last token is written.

- Prefix-block reuse, as the stand-in's (TensorRT-LLM's block reuse): a request's `blocks` are
  its prompt's leading-block hashes (chained: block k's hash names the prefix up to it; empty:
  nothing to reuse). When the engine first schedules it, the leading blocks found in the
  engine's prefix cache are taken as computed (at least one prompt token is left to compute);
  when its prompt is complete its blocks enter the cache as the most recent, least recently
  used dropped beyond the KV capacity in blocks. Reused blocks are counted, not shared (the
  KV read and the reservation are the whole prompt's, as in the stand-in).

Not modelled (yet): the stand-in's text, stop strings.

Speed: the engine advances in BLOCKS. A block is either one iteration that prefills something,
or a run of decode-only iterations during which the batch does not change: it lasts until the
next request finishes (or until a new request arrives: `add` cuts the run after the iteration
in progress). An iteration's duration is linear in its KV read (`iteration_seconds` is an affine
function of its arguments), and the KV read grows by the batch size per iteration, so a run of k
iterations lasts k·u + v·k(k-1)/2, computed in O(1) and inverted with a square root. The
coefficients are taken from `cost_model.iteration_seconds` itself, never re-derived.
`per_iteration=True` runs every iteration on its own through `iteration_seconds` (the
reference; tests/unit/test_sim.py checks that both modes agree).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from math import sqrt
from typing import Literal, Protocol

from fleet.router.pool import Ticket
from fleet_core import cost_model, power_model
from fleet_core.cost_model import EngineShape

Batching = Literal["continuous", "static"]
_DURATIONS: dict[EngineShape, dict[tuple[int, int, int], float]] = {}
_DURATIONS_KEPT = 1 << 16  # per shape, then it starts again
NAN = float("nan")


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request: what arrives (arrival, sizes) and what happens to it (the times)."""

    rid: int
    arrival: float
    prompt: int
    output: int  # tokens it will write (the model's true length, known only to the engine)
    max_tokens: int  # what the client asks for: the KV reservation and the router's cap
    deployment: int = 0
    blocks: tuple[int, ...] = ()  # the prompt's leading-block hashes (prefix reuse; module doc)
    # Filled in by the simulation
    routed: float = NAN  # booked on a replica by the router
    start: float = NAN  # first scheduled by the engine
    first_token: float = NAN
    finish: float = NAN
    engine: int = -1
    expected: float = 0.0  # the router's expected output at booking
    failed: bool = False  # lost to a fault after its first token (fleet/sim/faults.py)
    retries: int = 0  # re-routed after its engine went away before its first token
    ticket: Ticket | None = field(default=None, repr=False)  # the router's booking in flight
    # Engine state
    computed: int = 0  # prompt tokens computed
    reserved: int = 0  # KV blocks reserved (prompt + max_tokens)
    i0: int = 0  # the engine's iteration count when its first token was written
    cached: int = 0  # prompt tokens found in the engine's prefix cache
    looked: bool = False  # the prefix lookup has happened (on its current engine)


@dataclass(slots=True, init=False)
class _Block:
    start: float
    end: float
    iters: int
    prefill: Sequence[tuple[SimRequest, int]]
    run: bool  # decode-only run (may be cut)
    u: float  # first iteration's duration (runs)
    v: float  # growth per iteration (runs)
    lin: float  # u - v/2 (runs: S(k) = v/2·k² + lin·k), for the estimate of k
    w: float  # per-GPU watts above idle while it runs (power tracking only; else 0)
    throttled: bool  # its GPUs' power limit slowed it (power tracking only)

    # Written out: mypyc compiles this one, while a dataclass's generated __init__ would stay
    # interpreted (two blocks per request; fleet/sim/native.py).
    def __init__(
        self,
        start: float,
        end: float,
        iters: int,
        prefill: Sequence[tuple[SimRequest, int]] = (),
        run: bool = False,
        u: float = 0.0,
        v: float = 0.0,
        lin: float = 0.0,
        w: float = 0.0,
        throttled: bool = False,
    ) -> None:
        self.start = start
        self.end = end
        self.iters = iters
        self.prefill = prefill
        self.run = run
        self.u = u
        self.v = v
        self.lin = lin
        self.w = w
        self.throttled = throttled


class Engine:
    """Waiting queue, running set and KV reservations of one engine; advanced block by block."""

    def __init__(
        self,
        shape: EngineShape,
        *,
        batching: Batching = "continuous",
        chunked_prefill: bool = True,
        per_iteration: bool = False,
    ) -> None:
        if batching not in ("continuous", "static"):
            raise ValueError(f"unknown batching {batching!r} (continuous or static)")
        self.shape = shape
        self.static = batching == "static"
        self.chunked = chunked_prefill
        self.per_iteration = per_iteration
        self.max_blocks = cost_model.kv_capacity_blocks(shape)
        if self.max_blocks < 1:
            raise ValueError(f"{shape.model.name} does not fit {shape.gpus} × {shape.gpu.name}")
        self.kv_tokens = self.max_blocks * shape.tokens_per_block
        # The affine coefficients of cost_model.iteration_seconds (it is affine in its counts).
        base = cost_model.iteration_seconds(shape, 0, 0, 0)
        self._base = base
        self._per_token = cost_model.iteration_seconds(shape, 1, 0, 0) - base
        self._per_kv = (cost_model.iteration_seconds(shape, 0, 0, 1_000_000) - base) / 1e6
        self.it = 0  # iterations completed
        self.waiting: deque[SimRequest] = deque()
        self.context: list[SimRequest] = []  # admitted, prompt not complete
        self.decoding: list[tuple[int, int, SimRequest]] = []  # heap of (finish it, rid, req)
        self.n_dec = 0  # requests decoding (static: padding included)
        self.kv_const = 0  # Σ(prompt + 1 - i0) over them: KV read = kv_const + n_dec · it
        self.reserved = 0
        self.block: _Block | None = None
        self.busy_s = 0.0
        self.iterations = 0
        self.url = ""  # the owner's name for it (the simulation's replica URL)
        self.owner = -1  # the owner's index of it (the simulation's deployment)
        self._tokens_per_block = shape.tokens_per_block
        # iteration_seconds of prefill iterations, by (decodes, prompt tokens, KV read): the
        # same figures, shared by the engines of one shape
        self._durations = _DURATIONS.setdefault(shape, {})
        self._max_batch = shape.max_batch_size
        self._max_tokens = shape.max_num_tokens
        # The prefix cache: block hashes, oldest first (module doc); blocks looked up and found
        self.prefix: dict[int, None] = {}
        self.prefix_lookups = 0
        self.prefix_hits = 0
        # Power (fleet/sim/power.py turns it on): each block's per-GPU watts from
        # fleet_core/power_model.py, and under a GPU power limit its capped duration
        self.power = False
        self.limit_w: float | None = None  # per GPU; None: the default limit (TDP)
        self.above_idle_j = 0.0  # per GPU: energy above idle of the blocks completed
        self.throttled_s = 0.0  # seconds of completed blocks that the limit slowed
        self._idle_w = power_model.idle_power_w(shape.gpu)
        # (uncapped s, capped s, per-GPU watts above idle) by (decodes, prompt tokens, KV read)
        # under the current limit
        self._priced: dict[tuple[int, int, int], tuple[float, float, float]] = {}

    # --- state ---------------------------------------------------------------------------

    @property
    def next_time(self) -> float:
        return self.block.end if self.block is not None else math.inf

    def live(self) -> int:
        """Requests booked here and not finished."""
        return len(self.waiting) + len(self.context) + len(self.decoding)

    def abort(self, now: float) -> list[SimRequest]:
        """The engine process is gone (a crash, or stopped at a drain deadline): the requests
        booked here come back unfinished and the engine is empty. The block in progress counts
        as busy up to `now`; its iterations are lost."""
        b = self.block
        if b is not None and now > b.start:
            self.busy_s += min(now, b.end) - b.start
            if self.power:
                self.above_idle_j += b.w * (min(now, b.end) - b.start)
                if b.throttled:
                    self.throttled_s += min(now, b.end) - b.start
        lost = [*self.waiting, *self.context, *(r for _, _, r in self.decoding)]
        self.waiting.clear()
        self.context.clear()
        self.decoding.clear()
        self.n_dec = self.kv_const = self.reserved = 0
        self.block = None
        return lost

    def used_fraction(self) -> float:
        """KV use (tokens cached / capacity), as an agent would report it."""
        used = self.kv_const + self.n_dec * self.it
        if self.context:
            used += sum(r.computed for r in self.context)
        return min(1.0, used / self.kv_tokens)

    def above_idle_j_at(self, now: float) -> float:
        """Per GPU: the energy above idle drawn up to `now` (power tracking only)."""
        b = self.block
        if b is None or now <= b.start:
            return self.above_idle_j
        return self.above_idle_j + b.w * (min(now, b.end) - b.start)

    def set_limit(self, limit_w: float | None, now: float) -> bool:
        """The GPUs' power limit from `now` (None: the default). A decode run in progress is
        cut after its iteration in progress, so the next block runs under the new limit (an
        iteration already started finishes as it began). True when the engine's next event
        time changed."""
        if limit_w == self.limit_w:
            return False
        self.limit_w = limit_w
        self._priced.clear()
        b = self.block
        if b is None:
            return False
        return self._replan_or_cut(b, now)

    def _replan_or_cut(self, b: _Block, now: float) -> bool:
        """A block planned at this very instant is planned again (with what changed); a decode
        run under way is cut after its current iteration. Whether the plan changed."""
        if b.start >= now:
            self._plan(b.start)
            return True
        if b.run and b.iters > 1:
            m = min(b.iters, max(1, self._count(b, now - b.start, strict=True)))
            if m < b.iters:
                b.iters = m
                b.end = b.start + self._run_seconds(b, m)
                return True
        return False

    def _price(self, decodes: int, tokens: int, kv: int) -> tuple[float, float, float]:
        """(uncapped seconds, seconds under the limit, per-GPU watts above idle) of one
        iteration (fleet_core/power_model.py)."""
        key = (decodes, tokens, kv)
        got = self._priced.get(key)
        if got is None:
            shape = self.shape
            free = cost_model.iteration_seconds(shape, decodes, tokens, kv)
            if self.limit_w is None:
                got = (free, free, power_model.iteration_power_w(shape, decodes, tokens, kv))
            else:
                capped, w = power_model.capped_iteration(shape, decodes, tokens, kv, self.limit_w)
                got = (free, max(free, capped), w)
            got = (got[0], got[1], got[2] - self._idle_w)
            if len(self._priced) >= _DURATIONS_KEPT:
                self._priced.clear()
            self._priced[key] = got
        return got

    def output_left(self, now: float, expected: dict[int, float] | None = None) -> float:
        """What the router's books hold for this engine at `now`: Σ max(0, expected - streamed)
        over the requests booked here, tokens streamed by the iterations ended by `now`."""
        box = _Box()
        outputs_left([("", (self, box))], now)
        return box.output_left

    # --- requests ------------------------------------------------------------------------

    def add(self, r: SimRequest, now: float) -> bool:
        """Queue `r` at `now`. True when the engine's next event time changed."""
        # KV blocks for prompt + max_tokens (cost_model.blocks_for, inlined: once per request)
        blocks = -(-(r.prompt + r.max_tokens) // self._tokens_per_block)
        if (
            blocks > self.max_blocks
            or (not self.chunked and r.prompt > self._max_tokens)
            or r.max_tokens < 1
        ):
            raise ValueError(f"request {r.rid} ({r.prompt}+{r.max_tokens}) never fits this engine")
        r.reserved = blocks
        r.looked = False
        self.waiting.append(r)
        b = self.block
        if b is None:
            self._plan(now)
            return True
        if self.static:
            return False
        return self._replan_or_cut(b, now)

    def prefix_hit_rate(self) -> float:
        """Prompt blocks found in the prefix cache ÷ blocks looked up (the stand-in's rate)."""
        return self.prefix_hits / self.prefix_lookups if self.prefix_lookups else 0.0

    def _lookup(self, r: SimRequest) -> None:
        """First scheduled here: its leading blocks in the prefix cache count as computed."""
        r.looked = True
        blocks = r.blocks
        if not blocks:
            return
        cache = self.prefix
        hit = 0
        for h in blocks:
            if h not in cache:
                break
            del cache[h]  # the most recent now (as the stand-in's move_to_end)
            cache[h] = None
            hit += 1
        top = (r.prompt - 1) // self._tokens_per_block  # at least one token left to compute
        if hit > top:
            hit = top
        self.prefix_lookups += len(blocks)
        self.prefix_hits += hit
        r.cached = r.computed = hit * self._tokens_per_block

    def _remember(self, blocks: tuple[int, ...]) -> None:
        cache = self.prefix
        for h in blocks:
            if h in cache:
                del cache[h]
            cache[h] = None
        excess = len(cache) - self.max_blocks
        if excess > 0:
            oldest = iter(cache)
            drop = [next(oldest) for _ in range(excess)]
            for h in drop:
                del cache[h]

    # --- blocks --------------------------------------------------------------------------

    def _run_seconds(self, b: _Block, k: int) -> float:
        return k * b.u + b.v * k * (k - 1) / 2

    def _count(self, b: _Block, span: float, *, strict: bool) -> int:
        """Iterations i ≥ 0 of run `b` with S(i) < span (strict) or S(i) ≤ span; S(0) = 0."""
        if span <= 0:
            return 0 if strict or span < 0 else 1
        u, v = b.u, b.v
        a = v / 2
        lin = u - a
        i = int((-lin + sqrt(lin * lin + 4 * a * span)) / (2 * a)) if a > 0 else int(span / u)
        i = max(0, i - 1)
        # S(k) = k·u + v·k(k-1)/2 exactly as `_run_seconds` computes it (monotone in k): the
        # estimate above is corrected to the last i with S(i) < span (or ≤ span).
        if strict:
            k = i + 1
            while k * u + v * k * (k - 1) / 2 < span:
                k += 1
            i = k - 1
            while i > 0 and not i * u + v * i * (i - 1) / 2 < span:
                i -= 1
        else:
            k = i + 1
            while k * u + v * k * (k - 1) / 2 <= span:
                k += 1
            i = k - 1
            while i > 0 and not i * u + v * i * (i - 1) / 2 <= span:
                i -= 1
        return i + 1  # i = 0 always counts (S(0) = 0 < span)

    def _plan(self, now: float) -> None:
        shape = self.shape
        waiting, context = self.waiting, self.context
        # Admission: first come first served, within max_batch_size and the KV blocks free
        if waiting and not (self.static and (context or self.n_dec)):
            limit = self._max_batch
            while waiting and len(context) + len(self.decoding) < limit:
                head = waiting[0]
                if self.reserved + head.reserved > self.max_blocks:
                    break
                waiting.popleft()
                self.reserved += head.reserved
                context.append(head)
        b_dec = self.n_dec
        if context:
            budget = self._max_tokens - b_dec
            slots = self._max_batch - len(self.decoding)
            chunks: list[tuple[SimRequest, int]] = []
            kv_ctx = 0
            ctx = 0
            for r in context:
                if budget <= 0 or slots <= 0:
                    break
                if not r.looked:
                    self._lookup(r)
                remaining = r.prompt - r.computed
                if remaining <= budget:
                    chunk = remaining
                elif self.chunked:
                    per_block = self._tokens_per_block
                    aligned = (budget // per_block) * per_block
                    chunk = aligned if aligned > 0 else budget
                else:
                    break
                chunks.append((r, chunk))
                kv_ctx += r.computed + chunk
                ctx += chunk
                budget -= chunk
                slots -= 1
                if r.start != r.start:  # NaN: first scheduled now
                    r.start = now
            if chunks:
                kv = self.kv_const + b_dec * self.it + kv_ctx
                if self.power:
                    free, capped, w = self._price(b_dec, ctx, kv)
                    self.block = _Block(now, now + capped, 1, chunks, w=w, throttled=capped > free)
                    return
                key = (b_dec, ctx, kv)
                d = self._durations.get(key)
                if d is None:
                    d = cost_model.iteration_seconds(shape, b_dec, ctx, kv)
                    if len(self._durations) >= _DURATIONS_KEPT:
                        self._durations.clear()
                    self._durations[key] = d
                self.block = _Block(now, now + d, 1, chunks)
                return
        if b_dec:
            kv = self.kv_const + b_dec * self.it
            if self.per_iteration:
                if self.power:
                    free, capped, w = self._price(b_dec, 0, kv)
                    self.block = _Block(
                        now, now + capped, 1, (), True, capped, 0.0, w=w, throttled=capped > free
                    )
                    return
                d = cost_model.iteration_seconds(shape, b_dec, 0, kv)
                self.block = _Block(now, now + d, 1, (), True, d, 0.0)
                return
            u = self._base + self._per_token * b_dec + self._per_kv * kv
            v = self._per_kv * b_dec
            # (no live decoder with padding left cannot happen: a static batch ends with its last)
            k = self.decoding[0][0] - self.it if self.decoding else 1
            if k < 1:
                k = 1
            if self.power:
                # The run's watts are its middle iteration's; under a limit every iteration
                # stretches by the middle one's factor (the run stays affine).
                free, capped, w = self._price(b_dec, 0, kv + b_dec * ((k - 1) // 2))
                if capped > free:
                    u *= capped / free
                    v *= capped / free
                self.block = _Block(
                    now,
                    now + (k * u + v * k * (k - 1) / 2),
                    k,
                    (),
                    True,
                    u,
                    v,
                    u - v / 2,
                    w=w,
                    throttled=capped > free,
                )
                return
            # the run's duration as `_run_seconds` computes it
            self.block = _Block(
                now, now + (k * u + v * k * (k - 1) / 2), k, (), True, u, v, u - v / 2
            )
            return
        self.block = None

    def advance(self) -> list[SimRequest]:
        """Complete the current block (the caller's clock is at its end); plan the next one.
        Returns the requests that finished."""
        b = self.block
        assert b is not None
        end = b.end
        self.busy_s += end - b.start
        if self.power:
            self.above_idle_j += b.w * (end - b.start)
            if b.throttled:
                self.throttled_s += end - b.start
        iters = b.iters
        self.iterations += iters
        it = self.it = self.it + iters
        finished: list[SimRequest] = []
        heap = self.decoding
        while heap and heap[0][0] <= it:
            _, _, r = heappop(heap)
            r.finish = end
            finished.append(r)
            if not self.static:
                self.n_dec -= 1
                self.kv_const -= r.prompt + 1 - r.i0
                self.reserved -= r.reserved
        for r, chunk in b.prefill:
            r.computed += chunk
            if r.computed >= r.prompt:
                if r.blocks:
                    self._remember(r.blocks)
                self.context.remove(r)
                r.first_token = end
                r.i0 = it
                if r.output <= 1:
                    r.finish = end
                    finished.append(r)
                    if not self.static:
                        self.reserved -= r.reserved
                    continue
                heappush(heap, (it + r.output - 1, r.rid, r))
                self.n_dec += 1
                self.kv_const += r.prompt + 1 - it
        if self.static and not heap and not self.context:
            self.n_dec = 0
            self.kv_const = 0
            self.reserved = 0
        self.block = None
        if heap or self.context or self.waiting:
            self._plan(end)
        return finished


class OutputLeft(Protocol):
    output_left: float


@dataclass(slots=True)
class _Box:
    output_left: float = 0.0


def outputs_left(
    engines: Iterable[tuple[str, tuple[Engine, OutputLeft]]], now: float
) -> list[str] | None:
    """`Engine.output_left(now)` of each (key, (engine, sink)), written to the sink (the
    simulation passes the router's Replica). Returns the keys of the engines whose figure can
    no longer fall until they change (an add or a block end): none of their requests in
    generation is short of its expected length (the iterations ended only grow), so the figure
    stays as written; None when there are none.

    One loop for many engines: the simulation runs it over a deployment's engines in
    generation before every routing decision."""
    settled: list[str] | None = None
    for key, (e, sink) in engines:
        total = 0.0
        if e.waiting:
            for r in e.waiting:
                total += r.expected
        if e.context:
            for r in e.context:
                total += r.expected
        decoding = e.decoding
        if not decoding:
            sink.output_left = total
            if settled is None:
                settled = []
            settled.append(key)
            continue
        # The iterations ended by `now`
        done = e.it
        b = e.block
        if b is not None and now >= b.start:
            if now >= b.end:
                done += b.iters
            elif b.run:
                # the last i with S(i) ≤ now - start, S as `_run_seconds` computes it (as
                # `_count(b, now - start, strict=False) - 1`)
                span = now - b.start
                u, v = b.u, b.v
                if v > 0:
                    lin = b.lin
                    i = int((sqrt(lin * lin + 2 * v * span) - lin) / v)  # the estimate
                else:
                    i = int(span / u)
                if i * u + v * i * (i - 1) / 2 <= span:
                    k = i + 1
                    while k * u + v * k * (k - 1) / 2 <= span:
                        i = k
                        k += 1
                else:
                    i -= 1
                    while i > 0 and not i * u + v * i * (i - 1) / 2 <= span:
                        i -= 1
                done += i if i < b.iters else b.iters
        moving = False
        for _, _, r in decoding:
            left = r.expected - (1 + done - r.i0)
            if left > 0:
                total += left
                moving = True
        sink.output_left = total
        if not moving:
            if settled is None:
                settled = []
            settled.append(key)
    return settled
