"""Quantiles as the fleet reports them everywhere: the value at index ⌊q·n⌋ of the sorted values
(the largest when n is small), None when there are none."""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None
