"""Measured boot-to-ready times (power-on to serving) per GPU model, and their p90.

Every server keeps the time of its last boot (`Server.boot_to_ready_s`, written by the
provisioner when a spare it booted starts serving). The autoscaler projects capacity on its
way with the p90 of these; the calendar starts its boots that much before the scheduled minute.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import Session, col, select

from fleet.models import Server
from fleet_core.stats import quantile


def measured_boots(session: Session) -> list[tuple[str, float]]:
    """(GPU model, seconds) of every server's last measured boot."""
    rows = session.exec(
        select(Server.gpu_model, Server.boot_to_ready_s).where(
            col(Server.boot_to_ready_s).is_not(None)
        )
    )
    return [(model, float(seconds)) for model, seconds in rows if seconds is not None]


def p90(values: Iterable[float]) -> float | None:
    """The 90th percentile (fleet_core/stats.py: with ten boots or fewer, the slowest); None if
    empty."""
    return quantile(values, 0.9)


def p90_by_model(samples: Iterable[tuple[str, float]]) -> dict[str, tuple[float, int]]:
    """Per GPU model: (p90 seconds, number of boots measured)."""
    per_model: dict[str, list[float]] = {}
    for model, seconds in samples:
        per_model.setdefault(model, []).append(seconds)
    out: dict[str, tuple[float, int]] = {}
    for model, values in per_model.items():
        value = p90(values)
        if value is not None:
            out[model] = (value, len(values))
    return out
