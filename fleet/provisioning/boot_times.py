"""Measured boot-to-ready times (power-on to serving) per GPU model and cache state, and the
figure the autoscaler and the calendar plan with.

Every boot the provisioner sees through to serving is a row of `boot_record` (`record_boot`,
in the provisioner's transaction): the server, its GPU model, whether the boot began with its
version ready in its weights cache (`cache_hit`), boot-to-ready and load seconds. The history
is kept `FLEET_BOOT_HISTORY_DAYS` (90) and pruned as boots are recorded. Servers also keep
their last boot of each kind (`Server.boot_to_ready_s`, `_cached_s`, `_uncached_s`): a server
with no row in the history (boots measured before it existed) counts with those.

The figure planned with is a high quantile of that history plus a margin (`BootQuantile`:
`FLEET_BOOT_QUANTILE`, 0.9, and `FLEET_BOOT_MARGIN_PCT`, 10 %): the autoscaler projects
capacity on its way with it for the spare placement would boot (`boot_figures` and
`fleet.provisioning.placement.expected_boot_s`); the calendar starts its boots that much before
the scheduled minute. A boot that takes longer than the slowest of ten still arrives within
the margin; one that takes the median arrives early, which costs a few GPU-minutes, where a
late one costs the window's first minutes of SLA.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

import sqlalchemy as sa
from sqlmodel import Session, col, delete, select

from fleet.models import BootRecord, Server, utcnow
from fleet.provisioning.placement import BootFigures
from fleet.settings import Settings
from fleet_core.stats import quantile

K = TypeVar("K")


@dataclass(frozen=True)
class BootQuantile:
    """How a history of boots becomes the seconds planned with: its `quantile`, plus
    `margin_pct` of it, over the boots of the last `history_days`."""

    quantile: float = 0.9
    margin_pct: float = 0.0
    history_days: float = 90.0

    @classmethod
    def of(cls, settings: Settings) -> BootQuantile:
        return cls(settings.boot_quantile, settings.boot_margin_pct, settings.boot_history_days)

    def value(self, values: Iterable[float]) -> float | None:
        q = quantile(values, self.quantile)
        return None if q is None else q * (1 + self.margin_pct / 100)

    def per(self, samples: Iterable[tuple[K, float]]) -> dict[K, tuple[float, int]]:
        """Per key: (the figure in seconds, number of boots measured)."""
        grouped: dict[K, list[float]] = {}
        for key, seconds in samples:
            grouped.setdefault(key, []).append(seconds)
        out: dict[K, tuple[float, int]] = {}
        for key, values in grouped.items():
            value = self.value(values)
            if value is not None:
                out[key] = (value, len(values))
        return out

    @property
    def label(self) -> str:
        """How a reason names the figure: "p90", "p90 + 10 %"."""
        name = f"p{self.quantile * 100:g}"
        return f"{name} + {self.margin_pct:g} %" if self.margin_pct else name

    def since(self, now: datetime) -> datetime:
        return now - timedelta(days=self.history_days)


def record_boot(
    session: Session,
    server: Server,
    boot_s: float,
    load_s: float | None,
    cache_hit: bool | None,
    history_days: float,
    now: datetime | None = None,
) -> None:
    """Add one measured boot to the history (the caller commits), and drop the boots older
    than the retention."""
    at = now or utcnow()
    session.add(
        BootRecord(
            at=at,
            server=server.name,
            gpu_model=server.gpu_model,
            cache_hit=cache_hit,
            boot_s=boot_s,
            load_s=load_s,
        )
    )
    cutoff = at - timedelta(days=history_days)
    session.exec(delete(BootRecord).where(col(BootRecord.at) < cutoff))


def _legacy(session: Session) -> list[Server]:
    """Servers with a last boot figure but no row in the history."""
    recorded = select(BootRecord.server).distinct()
    return list(
        session.exec(
            select(Server).where(
                sa.or_(
                    col(Server.boot_to_ready_cached_s).is_not(None),
                    col(Server.boot_to_ready_uncached_s).is_not(None),
                    col(Server.boot_to_ready_s).is_not(None),
                ),
                col(Server.name).not_in(recorded),
            )
        )
    )


def _history(session: Session, since: datetime | None) -> list[tuple[str, bool | None, float]]:
    query = select(BootRecord.gpu_model, BootRecord.cache_hit, BootRecord.boot_s)
    if since is not None:
        query = query.where(col(BootRecord.at) >= since)
    return [(model, hit, float(seconds)) for model, hit, seconds in session.exec(query)]


def measured_boots(session: Session, since: datetime | None = None) -> list[tuple[str, float]]:
    """(GPU model, seconds) of every boot in the history since `since` (all kept: None), and
    the last boot of each server the history does not know."""
    out = [(model, seconds) for model, _, seconds in _history(session, since)]
    out += [
        (server.gpu_model, float(server.boot_to_ready_s))
        for server in _legacy(session)
        if server.boot_to_ready_s is not None
    ]
    return out


def by_model(
    samples: Iterable[tuple[str, float]], how: BootQuantile
) -> dict[str, tuple[float, int]]:
    """Per GPU model: (`how`'s figure in seconds, number of boots measured)."""
    return how.per(samples)


def boot_samples(
    session: Session, since: datetime | None = None
) -> list[tuple[str, bool | None, float]]:
    """(GPU model, cache state, seconds) of every boot in the history since `since`, and the
    latest boots of each server the history does not know: its last with the version cached
    (True) and its last that fetched first (False); one with neither but an older figure
    gives that one, state unknown (None)."""
    out = _history(session, since)
    for server in _legacy(session):
        cached, uncached = server.boot_to_ready_cached_s, server.boot_to_ready_uncached_s
        if cached is not None:
            out.append((server.gpu_model, True, float(cached)))
        if uncached is not None:
            out.append((server.gpu_model, False, float(uncached)))
        if cached is None and uncached is None and server.boot_to_ready_s is not None:
            out.append((server.gpu_model, None, float(server.boot_to_ready_s)))
    return out


def figures(
    samples: Iterable[tuple[str, bool | None, float]], how: BootQuantile = BootQuantile()
) -> BootFigures:
    """Per (GPU model, cache state): (`how`'s figure in seconds, number of boots measured)."""
    return BootFigures(how.per(((model, cached), s) for model, cached, s in samples), how.label)


def boot_figures(session: Session, how: BootQuantile = BootQuantile()) -> BootFigures:
    """The fleet's boot-to-ready figures per GPU model and cache state, read now."""
    return figures(boot_samples(session, how.since(utcnow())), how)
