"""Small SVG line charts for the console's deployments page, as plain data: a series of
(time, value) points in, polylines in a fixed viewBox out (a gap where a value is missing),
with an optional limit line (an SLA). Pure; the template draws them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Chart", "line_chart"]

WIDTH, HEIGHT = 300.0, 60.0


@dataclass(frozen=True, slots=True)
class Chart:
    lines: list[str]  # SVG polyline points, one per unbroken run
    top: float  # the value at the chart's top edge
    limit_y: float | None  # where the limit line is drawn (None: no limit)
    last: float | None  # the newest value
    peak: float | None  # the largest value
    over: int  # points above the limit


def line_chart(
    points: Sequence[tuple[float, float]],
    start: float,
    end: float,
    *,
    limit: float | None = None,
) -> Chart:
    """`points` ((epoch, value); NaN or None-like values break the line) over [start, end]."""
    seen = [(t, v) for t, v in points if start <= t <= end and not math.isnan(v)]
    values = [v for _, v in seen]
    top = max([*values, (limit or 0.0) * 1.25, 1e-9])
    span = max(end - start, 1.0)

    def xy(t: float, v: float) -> str:
        return f"{(t - start) / span * WIDTH:.1f},{HEIGHT - v / top * HEIGHT:.1f}"

    lines: list[str] = []
    run: list[str] = []
    last_t = None
    for t, v in sorted(points):
        if not start <= t <= end:
            continue
        gap = last_t is not None and t - last_t > 90.0
        if math.isnan(v) or gap:
            if len(run) > 1:
                lines.append(" ".join(run))
            run = []
        if not math.isnan(v):
            run.append(xy(t, v))
        last_t = t
    if len(run) > 1:
        lines.append(" ".join(run))
    return Chart(
        lines=lines,
        top=top,
        limit_y=None if limit is None else HEIGHT - limit / top * HEIGHT,
        last=values[-1] if values else None,
        peak=max(values) if values else None,
        over=sum(1 for v in values if limit is not None and v > limit),
    )
