"""Measured boot-to-ready times (power-on to serving) per GPU model and cache state, and p90s.

Every server keeps the time of its last boot (`Server.boot_to_ready_s`, written by the
provisioner when a spare it booted starts serving), and its last boot of each cache state: one
that began with its version ready in its weights cache (`boot_to_ready_cached_s`) and one that
had to fetch it first (`boot_to_ready_uncached_s`). The autoscaler projects capacity on its way
with the p90 for the spare placement would boot (`boot_figures` and
`fleet.provisioning.placement.expected_boot_s`); the calendar starts its boots that much before
the scheduled minute.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.models import Server
from fleet.provisioning.placement import BootFigures
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


def boot_samples(session: Session) -> list[tuple[str, bool | None, float]]:
    """(GPU model, cache state, seconds) of every server's latest measured boots: its last
    with the version cached (True) and its last that fetched first (False); a server with
    neither but an older figure gives that one, state unknown (None)."""
    rows = session.exec(
        select(
            Server.gpu_model,
            Server.boot_to_ready_cached_s,
            Server.boot_to_ready_uncached_s,
            Server.boot_to_ready_s,
        ).where(
            sa.or_(
                col(Server.boot_to_ready_cached_s).is_not(None),
                col(Server.boot_to_ready_uncached_s).is_not(None),
                col(Server.boot_to_ready_s).is_not(None),
            )
        )
    )
    out: list[tuple[str, bool | None, float]] = []
    for model, cached, uncached, any_state in rows:
        if cached is not None:
            out.append((model, True, float(cached)))
        if uncached is not None:
            out.append((model, False, float(uncached)))
        if cached is None and uncached is None and any_state is not None:
            out.append((model, None, float(any_state)))
    return out


def figures(samples: Iterable[tuple[str, bool | None, float]]) -> BootFigures:
    """Per (GPU model, cache state): (p90 seconds, number of boots measured)."""
    per: dict[tuple[str, bool | None], list[float]] = {}
    for model, cached, seconds in samples:
        per.setdefault((model, cached), []).append(seconds)
    out: dict[tuple[str, bool | None], tuple[float, int]] = {}
    for key, values in per.items():
        value = p90(values)
        if value is not None:
            out[key] = (value, len(values))
    return BootFigures(out)


def boot_figures(session: Session) -> BootFigures:
    """The fleet's boot-to-ready p90s per GPU model and cache state, read now."""
    return figures(boot_samples(session))
