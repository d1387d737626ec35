"""What the router learns as requests finish (pure: numbers in, numbers out; the clock is passed).

- `OutputEstimate`: per deployment, how many tokens an answer runs to — a running mean of what
  finished requests actually wrote. The router never knows a request's true length in advance;
  it expects min(max_tokens, this estimate).
- `Throughput`: per replica, the work (strategy.py's units) it completes per busy second,
  measured over windows in which it ran at least `min_concurrency` requests on average (a
  replica running one request at a time shows its per-stream speed, not its capacity). Until
  then, and as the starting point, a prior from the engine cost model for its GPU and model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.router.strategy import PREFILL_WEIGHT
from fleet_core import cost_model

NOMINAL_PROMPT = 1000  # tokens: the prior's request shape (a chat turn with context)
NOMINAL_OUTPUT = 200


@dataclass
class OutputEstimate:
    value: float = 256.0  # before anything finished: a middling answer
    samples: int = 0
    horizon: int = 200  # a plain mean over the first `horizon` answers, then an EWMA of that span

    def expected(self, max_tokens: int | None) -> float:
        return min(float(max_tokens), self.value) if max_tokens else self.value

    def observe(self, output_tokens: int) -> None:
        self.samples += 1
        n, horizon = self.samples, self.horizon
        weight = 1.0 / (horizon if horizon < n else n)  # min(samples, horizon)
        self.value += (output_tokens - self.value) * weight


@dataclass
class Throughput:
    value: float  # work units per second (the prior until measured)
    min_concurrency: float = 4.0
    window_s: float = 2.0
    alpha: float = 0.3
    _work: float = 0.0
    _area: float = 0.0  # ∫ in-flight dt over the window (request-seconds)
    _busy: float = 0.0  # seconds with at least one request in flight
    _since: float | None = None  # start of the window
    _last: float = 0.0  # last change of the in-flight count
    _inflight: int = 0
    measured: bool = False

    def _advance(self, now: float) -> None:
        if self._since is None:
            self._since = self._last = now
            return
        span = now - self._last
        if not span > 0.0:  # max(0.0, ·)
            span = 0.0
        self._area += span * self._inflight
        if self._inflight:
            self._busy += span
        self._last = now

    def started(self, now: float) -> None:
        self._advance(now)
        self._inflight += 1

    def finished(self, now: float, work: float) -> None:
        self._advance(now)
        self._inflight = self._inflight - 1 if self._inflight > 1 else 0  # max(0, · - 1)
        self._work += work
        assert self._since is not None
        if now - self._since >= self.window_s:
            self._close(now)

    def _close(self, now: float) -> None:
        assert self._since is not None
        span = now - self._since
        if self._busy > 0 and span > 0 and self._area / span >= self.min_concurrency:
            sample = self._work / self._busy
            self.value = (
                sample if not self.measured else self.value + self.alpha * (sample - self.value)
            )
            self.measured = True
        self._work = self._area = self._busy = 0.0
        self._since = now


def iteration_costs(gpu_model: str, model: str, *, tp_size: int = 1) -> tuple[float, float, float]:
    """The engine cost model's iteration time, split as the strategy uses it: (seconds every
    iteration costs, seconds per token computed — a prompt token or a decoding request —, seconds
    per context token whose KV cache is read). Decode is bound by memory bandwidth (the first
    and third), prefill by arithmetic (the second), and the two weigh differently on each GPU:
    an L40S is ~3.6 x slower than an H200 per decode step but ~2.7 x per prompt token. (0, 0, 0)
    for hardware the model does not know (the strategy then falls back to `stream_rate`)."""
    try:
        shape = cost_model.EngineShape(
            gpu=cost_model.gpu_spec(gpu_model),
            model=cost_model.guess_model(model),
            tp_size=max(1, tp_size),
        )
        if cost_model.kv_capacity_blocks(shape) < 1:  # does not fit: nothing to model
            return (0.0, 0.0, 0.0)
        base = cost_model.iteration_seconds(shape, 0, 0, 0)
        per_token = cost_model.iteration_seconds(shape, 1, 0, 0) - base
        per_kv = (cost_model.iteration_seconds(shape, 0, 0, 1_000_000) - base) / 1_000_000
    except ValueError:
        return (0.0, 0.0, 0.0)
    return (base, per_token, per_kv)


def stream_rate(
    gpu_model: str, model: str, *, tp_size: int = 1, prefill_weight: float = PREFILL_WEIGHT
) -> float:
    """One request's top speed alone on `gpu_model` (work units per second: a token each
    iteration of a batch of one, its prompt at the prefill weight), from the cost model; inf
    for hardware it does not know (no floor then)."""
    try:
        shape = cost_model.EngineShape(
            gpu=cost_model.gpu_spec(gpu_model),
            model=cost_model.guess_model(model),
            tp_size=max(1, tp_size),
        )
        itl = cost_model.predicted_itl_s(shape, 1, NOMINAL_PROMPT, NOMINAL_OUTPUT)
    except ValueError:
        return float("inf")
    return (1 + prefill_weight * NOMINAL_PROMPT / NOMINAL_OUTPUT) / itl


def prior_capacity(
    gpu_model: str,
    model: str,
    *,
    tp_size: int = 1,
    concurrency: int = 64,
    prefill_weight: float = PREFILL_WEIGHT,
) -> float:
    """Work units per second the cost model predicts for `model` on `gpu_model` at
    `concurrency` streams of the nominal shape; 1.0 for hardware it does not know (the
    measurement then takes over)."""
    try:
        shape = cost_model.EngineShape(
            gpu=cost_model.gpu_spec(gpu_model),
            model=cost_model.guess_model(model),
            tp_size=max(1, tp_size),
        )
        itl = cost_model.predicted_itl_s(shape, concurrency, NOMINAL_PROMPT, NOMINAL_OUTPUT)
        decode = cost_model.predicted_decode_tokens_per_s(
            shape, concurrency, NOMINAL_PROMPT, NOMINAL_OUTPUT
        )
    except ValueError:
        return 1.0
    batch = decode * itl  # requests decoding per iteration
    prefill_per_iter = batch * NOMINAL_PROMPT / NOMINAL_OUTPUT
    return (batch + prefill_weight * prefill_per_iter) / itl
