"""The look-ahead (rule 5 of the policy, fleet/autoscaler/policy.py): least-squares lines
through a deployment's waiting requests, and the tests that tell a real ramp from a step, a
spike or a load that has levelled off.

Pure: plain data in and out, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fleet.autoscaler.signals import PolicyConfig, Signals, fmt

__all__ = ["MIN_TREND_POINTS", "QueueTrend", "Trend", "fit_trend", "queue_trend", "step_sse"]

MIN_TREND_POINTS = 3


@dataclass(frozen=True, slots=True)
class Trend:
    """A least-squares line through (time, value) points; `level` is its value at `now`."""

    slope: float  # per second
    level: float
    r2: float
    points: int
    span_s: float

    def ahead(self, seconds: float) -> float:
        return self.level + self.slope * seconds


def fit_trend(points: Sequence[tuple[float, float]], now: float) -> Trend | None:
    """Least squares through (at, value) points, x measured from `now` (epoch seconds lose
    precision when squared). Fewer than MIN_TREND_POINTS points or no spread in time: None. A
    constant series is a flat line with R² 0."""
    n = len(points)
    if n < MIN_TREND_POINTS:
        return None
    xs = [at - now for at, _ in points]
    ys = [y for _, y in points]
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sxy = syy = 0.0
    for x, y in zip(xs, ys, strict=True):
        dx = x - mx
        dy = y - my
        sxx += dx * dx
        sxy += dx * dy
        syy += dy * dy
    span = max(xs) - min(xs)
    if sxx <= 0.0:
        return None
    lo, hi = min(ys), max(ys)
    if hi == lo or syy <= 0.0:
        return Trend(slope=0.0, level=lo, r2=0.0, points=n, span_s=span)
    slope = sxy / sxx
    return Trend(
        slope=slope,
        level=my - slope * mx,
        r2=min(1.0, (sxy * sxy) / (sxx * syy)),
        points=n,
        span_s=span,
    )


def _line_sse(trend: Trend, points: Sequence[tuple[float, float]], now: float) -> float:
    return sum((y - trend.level - trend.slope * (at - now)) ** 2 for at, y in points)


def step_sse(values: Sequence[float]) -> float:
    """The least squared error of a step through `values` (in time order): one level before
    some point, another after it, each at its mean. A series a step explains as well as a
    line is a step, not a trend. Fewer than 2 values: infinity."""
    n = len(values)
    total = math.fsum(values)
    total_sq = math.fsum(v * v for v in values)
    best = math.inf
    left = left_sq = 0.0
    for k in range(1, n):
        v = values[k - 1]
        left += v
        left_sq += v * v
        right, right_sq = total - left, total_sq - left_sq
        sse = (left_sq - left * left / k) + (right_sq - right * right / (n - k))
        best = min(best, max(sse, 0.0))
    return best


@dataclass(frozen=True, slots=True)
class QueueTrend:
    """The look-ahead: least-squares lines through the waiting requests.

    The series is the TOTAL waiting (queue_per_gpu × serving_gpus) when every point knows its
    GPUs, so that capacity arriving in the window (which divides the per-GPU queue in one
    jump) does not read as falling load; it is then divided by the GPUs of the capacity to
    come. Without GPU counts it is queue_per_gpu itself, projected like the other signals.

    - `full`, over the trend window: it must rise, with R² ≥ trend_min_r2;
    - it must fit better than a step (`line_sse < step_sse`): a jump seen soon after it
      happened tilts a line as steeply as a ramp would, and projected a boot time ahead it
      buys servers for load that is not coming; so does one spike at the end;
    - `recent`, over the window's newer half, must rise too: a load that rose and levelled
      off still tilts the whole window's line, the newer half's is flat by then.
    The projection is the lower of the two lines'. A server bought for nothing costs a
    quarter of an hour of a GPU server; a real ramp passes all of these, and a step is the
    threshold rules' business once it holds for the up window."""

    full: Trend
    recent: Trend | None
    line_sse: float
    step_sse: float
    total: bool  # the series is total waiting requests (else queue per GPU)

    def lines(self) -> list[Trend]:
        return [self.full] if self.recent is None else [self.full, self.recent]

    def ahead(self, seconds: float) -> float:
        return min(t.ahead(seconds) for t in self.lines())

    def per_gpu_ahead(self, seconds: float, gpus_now: float, gpus_after: float) -> float:
        """The projected queue per GPU `seconds` ahead, on `gpus_after` GPUs."""
        ahead = self.ahead(seconds)
        if self.total:
            if gpus_after > 0:
                return ahead / gpus_after
            return math.inf if ahead > 0 else 0.0
        return ahead * gpus_now / gpus_after if gpus_now > 0 and gpus_after > 0 else ahead

    def rising(self, c: PolicyConfig) -> bool:
        return (
            self.full.r2 >= c.trend_min_r2
            and self.line_sse < self.step_sse
            and all(t.slope > 0.0 for t in self.lines())
        )

    def describe(self) -> str:
        unit = "waiting" if self.total else "queued/GPU"
        return (
            f"{unit} rising {fmt(self.full.slope)}/s over {self.full.span_s:.0f} s "
            f"(R² {self.full.r2:.2f})"
        )


def queue_trend(obs: Sequence[Signals], now: float, c: PolicyConfig) -> QueueTrend | None:
    """The lines over the trend window: the window must be covered (reach back to an
    observation at or before its start) with no gap and a queue value in every point."""
    start = now - c.trend_window_s
    run: list[Signals] = []
    prev = now
    for o in reversed(obs):
        if prev - o.at > c.max_gap_s or o.queue_per_gpu is None:
            return None
        run.append(o)
        if o.at <= start:
            break
        prev = o.at
    else:
        return None
    run.reverse()
    total = all(o.serving_gpus > 0 for o in run)
    points = [(o.at, (o.queue_per_gpu or 0.0) * (o.serving_gpus if total else 1)) for o in run]
    full = fit_trend(points, now)
    if full is None:
        return None
    middle = now - c.trend_window_s / 2
    recent = fit_trend([p for p in points if p[0] >= middle], now)
    return QueueTrend(
        full, recent, _line_sse(full, points, now), step_sse([y for _, y in points]), total
    )
