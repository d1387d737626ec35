"""What the console draws, as plain data: a rack's elevation (its U positions top to bottom,
each server box with its state's colour group) and its power bars (budget, committed, drawn,
and whether it is near its breaker).

Pure: rows in, frozen dataclasses out; the templates only lay them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["STATE_GROUP", "Box", "Power", "elevation", "power_bars"]

# A server's lifecycle state → the colour group its box is drawn in (and the legend's words).
STATE_GROUP = {
    "serving": "serving",
    "booting": "starting",
    "loading": "starting",
    "warm": "spare",
    "enrolled": "spare",
    "draining": "leaving",
    "drained": "leaving",
    "powering_off": "leaving",
    "failed": "fault",
    "quarantined": "fault",
    "maintenance": "out",
    "retired": "out",
}


@dataclass(frozen=True, slots=True)
class Box:
    """One row of the elevation: a server spanning `height` U from `top` down, or empty U."""

    top: int  # the highest U it covers (the elevation is drawn from the top U down)
    height: int
    server: str | None = None
    state: str | None = None
    group: str = "empty"
    gpu: str = ""
    deployment: str | None = None


def elevation(
    height_u: int, servers: Sequence[tuple[str, int, int, str, str, str | None]]
) -> list[Box]:
    """The rack's U from `height_u` down to 1: each server ((name, bottom U, height, state,
    GPU label, deployment)) as one box, each run of empty U as one. A server reaching past
    the top is cut at it; one overlapping another keeps its own box below the first."""
    by_top: dict[int, tuple[str, int, int, str, str, str | None]] = {}
    taken: set[int] = set()
    for row in sorted(servers, key=lambda r: -(r[1] + r[2] - 1)):
        name, bottom, height, state, gpu, deployment = row
        top = min(bottom + max(height, 1) - 1, height_u)
        span = [u for u in range(bottom, top + 1) if u not in taken]
        if not span:
            continue
        taken.update(span)
        by_top[max(span)] = (name, min(span), len(span), state, gpu, deployment)
    boxes: list[Box] = []
    u = height_u
    while u >= 1:
        if u in by_top:
            name, bottom, height, state, gpu, deployment = by_top[u]
            boxes.append(
                Box(u, height, name, state, STATE_GROUP.get(state, "out"), gpu, deployment)
            )
            u -= height
            continue
        top = u
        while u >= 1 and u not in by_top and u not in taken:
            u -= 1
        if top == u:  # a U taken by an overlapping server's remainder: skip it
            u -= 1
            continue
        boxes.append(Box(top, top - u))
    return boxes


@dataclass(frozen=True, slots=True)
class Power:
    budget_w: float
    committed_w: float
    drawn_w: float | None
    committed_pct: float  # of the budget, for the bars (capped at 100 for drawing)
    drawn_pct: float | None
    high_pct: float  # the high-water mark: the cap valve's threshold

    @property
    def drawing_high(self) -> bool:
        """Drawn at or above the high-water mark."""
        return self.drawn_pct is not None and self.drawn_pct >= self.high_pct

    @property
    def over_budget(self) -> bool:
        """Committed past the budget (an admin's override)."""
        return self.committed_w > self.budget_w

    @property
    def hot(self) -> bool:
        return self.drawing_high or self.over_budget

    @property
    def committed_bar(self) -> float:
        return min(self.committed_pct, 100.0)

    @property
    def drawn_bar(self) -> float:
        return min(self.drawn_pct or 0.0, 100.0)


def power_bars(
    budget_w: float, committed_w: float, drawn_w: float | None, high_pct: float
) -> Power:
    def pct(x: float) -> float:
        return 100.0 * x / budget_w if budget_w > 0 else 0.0

    drawn_pct = pct(drawn_w) if drawn_w is not None else None
    return Power(budget_w, committed_w, drawn_w, pct(committed_w), drawn_pct, high_pct)
