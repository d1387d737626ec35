"""The measured-draw history in the database (PowerSample): closed buckets written, old ones
pruned, and the figures others ask of it (docs/power.md).

Writers: the leader's Meter (fleet/power/measure.py) only. Readers: the rack views (peak over
24 h, p99 over 7 d) and measured-mode placement (a server's p99 over its window). The p99s are
computed in the database (a window function, the same rule as fleet_core/stats.quantile on
both backends), so a `fleetctl racks` over thousands of racks fetches one row per rack, not a
week of buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col

from fleet.models import PowerSample
from fleet.power.series import RACK, SERVER, Bucket
from fleet.settings import Settings

PEAK_WINDOW_S = 86_400.0  # RackPublic.peak_24h_w
P99_WINDOW_S = 7 * 86_400.0  # RackPublic.p99_7d_w (bounded by power_rack_history_s)
PRUNE_BATCH = 5_000  # rows deleted per kind per call: a backlog drains over several calls
CHUNK = 2_000  # names per IN (…): SQLite bounds the parameters of one statement

_TABLE = PowerSample.__table__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class RackHistory:
    peak_24h_w: float | None
    p99_7d_w: float | None


def write_buckets(session: Session, buckets: Sequence[Bucket]) -> int:
    """Insert closed buckets, one row each. A row already there for the same subject and
    bucket (a restarted leader writing the rest of a bucket its predecessor wrote) is merged:
    the larger max, the samples summed, the mean weighted. The caller commits."""
    if not buckets:
        return 0
    rows = [
        {
            "kind": b.kind,
            "subject": b.subject,
            "bucket_start": b.bucket_start,
            "bucket_s": b.bucket_s,
            "max_w": b.max_w,
            "mean_w": b.mean_w,
            "samples": b.samples,
            "estimated": b.estimated,
        }
        for b in buckets
    ]
    dialect = session.get_bind().dialect.name
    insert: Any
    larger: Any
    if dialect == "postgresql":
        insert, larger = postgresql.insert(_TABLE), sa.func.greatest
    elif dialect == "sqlite":
        insert, larger = sqlite.insert(_TABLE), sa.func.max  # SQLite's two-argument max()
    else:
        raise NotImplementedError(f"no upsert for dialect {dialect!r}")
    old, new = _TABLE.c, insert.excluded
    samples = old.samples + new.samples
    statement = insert.on_conflict_do_update(
        index_elements=["kind", "subject", "bucket_start"],
        set_={
            "max_w": larger(old.max_w, new.max_w),
            "mean_w": (old.mean_w * old.samples + new.mean_w * new.samples) / samples,
            "samples": samples,
            "estimated": sa.or_(old.estimated, new.estimated),
        },
    )
    session.execute(statement, rows)
    return len(rows)


def prune(session: Session, now: datetime, settings: Settings, *, limit: int = PRUNE_BATCH) -> int:
    """Delete buckets past their retention (server buckets after power_server_history_s,
    rack buckets after power_rack_history_s), at most `limit` per kind. The caller commits."""
    deleted = 0
    for kind, keep_s in (
        (SERVER, settings.power_server_history_s),
        (RACK, settings.power_rack_history_s),
    ):
        cutoff = now - timedelta(seconds=keep_s)
        ids = (
            sa.select(col(PowerSample.id))
            .where(col(PowerSample.kind) == kind, col(PowerSample.bucket_start) < cutoff)
            .order_by(col(PowerSample.bucket_start))
            .limit(limit)
        )
        # Through a derived table: MySQL-style "IN (SELECT … LIMIT)" is refused by some
        # engines; SQLite and Postgres take this form.
        victims = sa.select(ids.subquery().c.id)
        result = session.execute(sa.delete(PowerSample).where(col(PowerSample.id).in_(victims)))
        deleted += int(getattr(result, "rowcount", 0) or 0)
    return deleted


def _chunks(names: Sequence[str]) -> list[list[str]]:
    unique = sorted(set(names))
    return [unique[i : i + CHUNK] for i in range(0, len(unique), CHUNK)]


def _quantile_per_subject(
    session: Session, kind: str, subjects: Sequence[str], since: datetime, q: float
) -> dict[str, tuple[float, float]]:
    found: dict[str, tuple[float, float]] = {}
    for chunk in _chunks(subjects):
        found.update(_quantile_chunk(session, kind, chunk, since, q))
    return found


def _quantile_chunk(
    session: Session, kind: str, subjects: list[str], since: datetime, q: float
) -> dict[str, tuple[float, float]]:
    """subject → (the q-quantile of its bucket maxima since `since`, seconds covered), by
    fleet_core/stats.quantile's rule: the value at index ⌊q·n⌋ (0-based) of the sorted maxima,
    the largest when that index runs past the end."""
    permyriad = round(q * 10_000)  # ⌊q·n⌋ in integer arithmetic, exact on both backends
    rank = sa.func.row_number().over(
        partition_by=col(PowerSample.subject), order_by=col(PowerSample.max_w)
    )
    count = sa.func.count().over(partition_by=col(PowerSample.subject))
    covered = sa.func.sum(col(PowerSample.bucket_s)).over(partition_by=col(PowerSample.subject))
    ranked = (
        sa.select(
            col(PowerSample.subject).label("subject"),
            col(PowerSample.max_w).label("max_w"),
            (rank - 1).label("i"),
            count.label("n"),
            covered.label("covered"),
        )
        .where(
            col(PowerSample.kind) == kind,
            col(PowerSample.subject).in_(subjects),
            col(PowerSample.bucket_start) >= since,
        )
        .subquery()
    )
    # The smaller of two values: least() on Postgres, the two-argument min() on SQLite.
    smaller = sa.func.least if session.get_bind().dialect.name == "postgresql" else sa.func.min
    wanted = smaller(ranked.c.n - 1, (ranked.c.n * permyriad) // 10_000)
    rows = session.execute(
        sa.select(ranked.c.subject, ranked.c.max_w, ranked.c.covered).where(ranked.c.i == wanted)
    )
    return {r.subject: (float(r.max_w), float(r.covered)) for r in rows}


def rack_history(
    session: Session, racks: Sequence[str], now: datetime, settings: Settings
) -> dict[str, RackHistory]:
    """Every rack asked → its peak over the last 24 h and the p99 of its bucket maxima over
    the last 7 days (or the retention, if shorter); None where no bucket exists. Closed
    buckets only: the open one is still in the leader's memory."""
    if not racks:
        return {}
    peaks: dict[str, float] = {}
    for chunk in _chunks(racks):
        rows = session.execute(
            sa.select(col(PowerSample.subject), sa.func.max(col(PowerSample.max_w)))
            .where(
                col(PowerSample.kind) == RACK,
                col(PowerSample.subject).in_(chunk),
                col(PowerSample.bucket_start) >= now - timedelta(seconds=PEAK_WINDOW_S),
            )
            .group_by(col(PowerSample.subject))
        )
        peaks.update({subject: float(w) for subject, w in rows})
    window_s = min(P99_WINDOW_S, settings.power_rack_history_s)
    p99s = _quantile_per_subject(session, RACK, racks, now - timedelta(seconds=window_s), 0.99)
    return {
        rack: RackHistory(
            peak_24h_w=peaks.get(rack),
            p99_7d_w=p99s[rack][0] if rack in p99s else None,
        )
        for rack in racks
    }


def server_p99(
    session: Session, servers: Sequence[str], now: datetime, window_s: float
) -> dict[str, tuple[float | None, float]]:
    """Every server asked → (the p99 of its bucket maxima over the last `window_s`, None if it
    has none; the seconds of history those buckets cover, at most `window_s`). Measured mode
    commits nameplate until the seconds covered reach power_measured_min_s
    (fleet/power/budget.measured_commit_w)."""
    if not servers:
        return {}
    found = _quantile_per_subject(session, SERVER, servers, now - timedelta(seconds=window_s), 0.99)
    return {
        name: (found[name][0], min(window_s, found[name][1])) if name in found else (None, 0.0)
        for name in servers
    }
