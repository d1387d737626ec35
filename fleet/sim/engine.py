"""One simulated engine on a virtual clock: continuous or static batching, cost-model timed.

The stand-in's cost model (agents/engine/cost_model.py) is the one implementation of an
iteration's duration; this module only decides what each iteration carries, following the
stand-in's core (agents/engine/core.py) and trtllm-serve's defaults:

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

Not modelled (yet): prefix-block reuse (every prompt is computed in full), the stand-in's
text, stop strings.

Speed: the engine advances in BLOCKS. A block is either one iteration that prefills something,
or a run of decode-only iterations during which the batch does not change: it lasts until the
next request finishes (or until a new request arrives: `add` cuts the run after the iteration
in progress). An iteration's duration is linear in its KV read (`iteration_seconds` is an affine
function of its arguments), and the KV read grows by the batch size per iteration, so a run of k
iterations lasts k·u + v·k(k-1)/2, computed in O(1) and inverted with a square root. The
coefficients are taken from `cost_model.iteration_seconds` itself, never re-derived.
`per_iteration=True` runs every iteration on its own through `iteration_seconds` (the
reference; tests/test_sim.py checks that both modes agree).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from agents.engine import cost_model
from agents.engine.cost_model import EngineShape

Batching = Literal["continuous", "static"]
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
    # Filled in by the simulation
    routed: float = NAN  # booked on a replica by the router
    start: float = NAN  # first scheduled by the engine
    first_token: float = NAN
    finish: float = NAN
    engine: int = -1
    expected: float = 0.0  # the router's expected output at booking
    # Engine state
    computed: int = 0  # prompt tokens computed
    reserved: int = 0  # KV blocks reserved (prompt + max_tokens)
    i0: int = 0  # the engine's iteration count when its first token was written


@dataclass(slots=True)
class _Block:
    start: float
    end: float
    iters: int
    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    run: bool = False  # decode-only run (may be cut)
    u: float = 0.0  # first iteration's duration (runs)
    v: float = 0.0  # growth per iteration (runs)


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

    # --- state ---------------------------------------------------------------------------

    @property
    def next_time(self) -> float:
        return self.block.end if self.block is not None else math.inf

    def live(self) -> int:
        """Requests booked here and not finished."""
        return len(self.waiting) + len(self.context) + len(self.decoding)

    def used_fraction(self) -> float:
        """KV use (tokens cached / capacity), as an agent would report it."""
        used = self.kv_const + self.n_dec * self.it + sum(r.computed for r in self.context)
        return min(1.0, used / self.kv_tokens)

    def output_left(self, now: float, expected: dict[int, float] | None = None) -> float:
        """What the router's books hold for this engine at `now`: Σ max(0, expected - streamed)
        over the requests booked here, tokens streamed by the iterations ended by `now`."""
        done = self.it + self._iters_done(now)
        total = 0.0
        for r in self.waiting:
            total += r.expected
        for r in self.context:
            total += r.expected
        for _, _, r in self.decoding:
            left = r.expected - (1 + done - r.i0)
            if left > 0:
                total += left
        return total

    # --- requests ------------------------------------------------------------------------

    def fits(self, prompt: int, max_tokens: int) -> bool:
        blocks = cost_model.blocks_for(self.shape, prompt + max_tokens)
        too_long = not self.chunked and prompt > self.shape.max_num_tokens
        return blocks <= self.max_blocks and not too_long and max_tokens >= 1

    def add(self, r: SimRequest, now: float) -> bool:
        """Queue `r` at `now`. True when the engine's next event time changed."""
        if not self.fits(r.prompt, r.max_tokens):
            raise ValueError(f"request {r.rid} ({r.prompt}+{r.max_tokens}) never fits this engine")
        r.reserved = cost_model.blocks_for(self.shape, r.prompt + r.max_tokens)
        self.waiting.append(r)
        b = self.block
        if b is None:
            self._plan(now)
            return True
        if self.static:
            return False
        if b.start >= now:  # planned at this very instant: plan again with the newcomer
            self._plan(b.start)
            return True
        if b.run and b.iters > 1:
            m = min(b.iters, max(1, self._count(b, now - b.start, strict=True)))
            if m < b.iters:
                b.iters = m
                b.end = b.start + self._run_seconds(b, m)
                return True
        return False

    # --- blocks --------------------------------------------------------------------------

    def _run_seconds(self, b: _Block, k: int) -> float:
        return k * b.u + b.v * k * (k - 1) / 2

    def _count(self, b: _Block, span: float, *, strict: bool) -> int:
        """Iterations i ≥ 0 of run `b` with S(i) < span (strict) or S(i) ≤ span; S(0) = 0."""
        if span <= 0:
            return 0 if strict or span < 0 else 1
        a, lin = b.v / 2, b.u - b.v / 2
        if a > 0:
            i = int((-lin + math.sqrt(lin * lin + 4 * a * span)) / (2 * a))
        else:
            i = int(span / b.u)
        i = max(0, i - 1)

        def ok(n: int) -> bool:
            s = self._run_seconds(b, n)
            return s < span if strict else s <= span

        while ok(i + 1):
            i += 1
        while i > 0 and not ok(i):
            i -= 1
        return i + 1  # i = 0 always counts (S(0) = 0 < span)

    def _iters_done(self, now: float) -> int:
        b = self.block
        if b is None or now < b.start:
            return 0
        if now >= b.end:
            return b.iters
        if not b.run:
            return 0
        # iterations whose end S(i+1) ≤ now - start
        return min(b.iters, self._count(b, now - b.start, strict=False) - 1)

    def _admit(self) -> None:
        limit = self.shape.max_batch_size
        if self.static and (self.context or self.n_dec):
            return
        while self.waiting and len(self.context) + len(self.decoding) < limit:
            head = self.waiting[0]
            if self.reserved + head.reserved > self.max_blocks:
                break
            self.waiting.popleft()
            self.reserved += head.reserved
            self.context.append(head)

    def _plan(self, now: float) -> None:
        self._admit()
        shape = self.shape
        b_dec = self.n_dec
        if self.context:
            budget = shape.max_num_tokens - b_dec
            slots = shape.max_batch_size - len(self.decoding)
            chunks: list[tuple[SimRequest, int]] = []
            kv_ctx = 0
            for r in self.context:
                if budget <= 0 or slots <= 0:
                    break
                remaining = r.prompt - r.computed
                if remaining <= budget:
                    chunk = remaining
                elif self.chunked:
                    per_block = shape.tokens_per_block
                    aligned = (budget // per_block) * per_block
                    chunk = aligned if aligned > 0 else budget
                else:
                    break
                chunks.append((r, chunk))
                kv_ctx += r.computed + chunk
                budget -= chunk
                slots -= 1
                if r.start != r.start:  # NaN: first scheduled now
                    r.start = now
            if chunks:
                ctx = sum(c for _, c in chunks)
                kv = self.kv_const + b_dec * self.it + kv_ctx
                d = cost_model.iteration_seconds(shape, b_dec, ctx, kv)
                self.block = _Block(now, now + d, 1, chunks)
                return
        if b_dec:
            u = (
                self._base
                + self._per_token * b_dec
                + self._per_kv * (self.kv_const + b_dec * self.it)
            )
            v = self._per_kv * b_dec
            if self.per_iteration:
                kv = self.kv_const + b_dec * self.it
                d = cost_model.iteration_seconds(shape, b_dec, 0, kv)
                self.block = _Block(now, now + d, 1, run=True, u=d, v=0.0)
                return
            # (no live decoder with padding left cannot happen: a static batch ends with its last)
            k = max(1, self.decoding[0][0] - self.it) if self.decoding else 1
            blk = _Block(now, now, k, run=True, u=u, v=v)
            blk.end = now + self._run_seconds(blk, k)
            self.block = blk
            return
        self.block = None

    def advance(self) -> list[SimRequest]:
        """Complete the current block (the caller's clock is at its end); plan the next one.
        Returns the requests that finished."""
        b = self.block
        assert b is not None
        end = b.end
        self.busy_s += end - b.start
        self.iterations += b.iters
        self.it += b.iters
        it = self.it
        finished: list[SimRequest] = []
        heap = self.decoding
        while heap and heap[0][0] <= it:
            _, _, r = heapq.heappop(heap)
            r.finish = end
            finished.append(r)
            if not self.static:
                self.n_dec -= 1
                self.kv_const -= r.prompt + 1 - r.i0
                self.reserved -= r.reserved
        for r, chunk in b.prefill:
            r.computed += chunk
            if r.computed >= r.prompt:
                self.context.remove(r)
                r.first_token = end
                r.i0 = it
                if r.output <= 1:
                    r.finish = end
                    finished.append(r)
                    if not self.static:
                        self.reserved -= r.reserved
                    continue
                heapq.heappush(heap, (it + r.output - 1, r.rid, r))
                self.n_dec += 1
                self.kv_const += r.prompt + 1 - it
        if self.static and not heap and not self.context:
            self.n_dec = 0
            self.kv_const = 0
            self.reserved = 0
        self.block = None
        self._plan(end)
        return finished
