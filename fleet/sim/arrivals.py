"""Arrivals: when requests come and how big they are. Deterministic for a seed (random.Random).

- Poisson arrivals with a rate curve (`Constant`, `Diurnal`, `Spikes` on top of another curve),
  drawn by thinning (Lewis & Shedler): candidates at the curve's peak rate, each kept with
  probability rate(t) / peak.
- Sizes: `FixedSizes` (every request the same) or `TraceSizes` (rows drawn at random from an
  Azure trace, so the joint prompt/output distribution is the trace's).
- `replay_trace`: a trace's own arrival pattern (bursts included), compressed or stretched by
  `speed`, or to a target mean rate.

The Azure LLM inference traces (fleet/data/traces/, Azure LLM inference 2023, CC BY 4.0, Patel et
al.,
"Splitwise", ISCA 2024) are read by fleet.traces.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fleet.traces import TraceRequest, load_trace

DAY_S = 86_400.0


class RateCurve(Protocol):
    def rate(self, t: float) -> float:
        """Requests per second at `t` (seconds from the start)."""
        ...

    def peak(self) -> float:
        """An upper bound of rate(t) over all t."""
        ...


@dataclass(frozen=True)
class Constant:
    rps: float

    def rate(self, t: float) -> float:
        return self.rps

    def peak(self) -> float:
        return self.rps


@dataclass(frozen=True)
class Diurnal:
    """mean · (1 + amplitude · cos(2π (t - peak_s) / period_s)): highest at `peak_s`."""

    mean_rps: float
    amplitude: float = 0.5
    peak_s: float = 14 * 3600.0
    period_s: float = DAY_S

    def rate(self, t: float) -> float:
        phase = 2 * math.pi * (t - self.peak_s) / self.period_s
        return max(0.0, self.mean_rps * (1 + self.amplitude * math.cos(phase)))

    def peak(self) -> float:
        return self.mean_rps * (1 + abs(self.amplitude))


@dataclass(frozen=True)
class Spike:
    at_s: float
    duration_s: float
    multiplier: float


@dataclass(frozen=True)
class Spikes:
    """`base` multiplied by each spike's multiplier while it lasts."""

    base: RateCurve
    spikes: tuple[Spike, ...]

    def rate(self, t: float) -> float:
        r = self.base.rate(t)
        for s in self.spikes:
            if s.at_s <= t < s.at_s + s.duration_s:
                r *= s.multiplier
        return r

    def peak(self) -> float:
        m = 1.0
        for s in self.spikes:
            m *= max(1.0, s.multiplier)
        return self.base.peak() * m


class Sizes(Protocol):
    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, output tokens)."""
        ...


@dataclass(frozen=True)
class FixedSizes:
    prompt: int
    output: int

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return self.prompt, self.output


class TraceSizes:
    """Rows drawn uniformly from a trace (prompt and output together)."""

    def __init__(self, trace: str | Sequence[TraceRequest]) -> None:
        rows = load_trace(trace) if isinstance(trace, str) else list(trace)
        if not rows:
            raise ValueError("the trace is empty")
        self.rows = [(max(1, r.prompt_tokens), max(1, r.output_tokens)) for r in rows]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return self.rows[rng.randrange(len(self.rows))]


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float
    prompt: int
    output: int


def poisson(
    curve: RateCurve, sizes: Sizes, duration_s: float, seed: int, *, start_s: float = 0.0
) -> list[Arrival]:
    """A non-homogeneous Poisson process over [start_s, start_s + duration_s)."""
    rng = random.Random(seed)
    peak = curve.peak()
    if peak <= 0:
        return []
    out: list[Arrival] = []
    t = start_s
    end = start_s + duration_s
    expovariate, uniform = rng.expovariate, rng.random
    while True:
        t += expovariate(peak)
        if t >= end:
            return out
        if uniform() * peak <= curve.rate(t):
            p, o = sizes.draw(rng)
            out.append(Arrival(t, p, o))


def replay_trace(
    trace: str | Sequence[TraceRequest],
    *,
    offset: int = 0,
    count: int | None = None,
    speed: float | None = None,
    rate_rps: float | None = None,
) -> list[Arrival]:
    """A slice of a trace in its own arrival pattern, from time 0: `speed` times faster, or
    compressed to a mean of `rate_rps` requests per second (as bench/routing.py does)."""
    rows = load_trace(trace) if isinstance(trace, str) else list(trace)
    rows = rows[offset : None if count is None else offset + count]
    if len(rows) < 2:
        raise ValueError("the trace slice has fewer than 2 requests")
    t0 = rows[0].at_s
    span = rows[-1].at_s - t0
    if rate_rps is not None:
        if span <= 0:
            raise ValueError("the trace slice spans no time")
        scale = ((len(rows) - 1) / span) / rate_rps
    else:
        scale = 1.0 / (speed or 1.0)
    return [
        Arrival((r.at_s - t0) * scale, max(1, r.prompt_tokens), max(1, r.output_tokens))
        for r in rows
    ]
