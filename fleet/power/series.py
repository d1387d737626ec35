"""Measured draw as a bounded time series: readings folded into fixed buckets (pure, no I/O).

Every reading of a server (its BMC, or the agent-based estimate) and every rack reading (the sum
of its servers' latest readings at one reconciler sweep) goes into the open bucket of its
subject: `bucket_s` wide, aligned to the Unix epoch so that every process cuts the same buckets.
When a reading falls past the open bucket, that bucket closes and comes back to the caller, who
writes it as one row (fleet/power/history.py): the write rate is subjects ÷ bucket_s whatever
the reading rate. A bucket keeps the largest and the mean reading: breakers trip on peaks, so
the budget's p99 is taken over bucket maxima (`p99_of_buckets`), which never understates it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from fleet_core.stats import quantile

SERVER = "server"
RACK = "rack"


@dataclass(frozen=True, slots=True)
class Reading:
    kind: str  # SERVER or RACK
    subject: str  # the server's or the rack's name
    at: datetime  # aware UTC
    watts: float
    estimated: bool = False  # an agent-based estimate (or a rack sum with one in it)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One closed bucket: the row fleet/power/history.py writes (PowerSample)."""

    kind: str
    subject: str
    bucket_start: datetime
    bucket_s: float
    max_w: float
    mean_w: float
    samples: int
    estimated: bool


@dataclass(slots=True)
class _Open:
    start: datetime
    max_w: float
    total_w: float
    samples: int
    estimated: bool


def bucket_start(at: datetime, bucket_s: float) -> datetime:
    """The start of the bucket holding `at`: a multiple of `bucket_s` since the epoch."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    seconds = (at - epoch).total_seconds()
    return epoch + timedelta(seconds=math.floor(seconds / bucket_s) * bucket_s)


class Series:
    """Open buckets, one per (kind, subject). Not thread-safe: one caller (the reconciler)."""

    def __init__(self, bucket_s: float) -> None:
        if bucket_s <= 0:
            raise ValueError(f"bucket_s must be positive, not {bucket_s}")
        self.bucket_s = bucket_s
        self._open: dict[tuple[str, str], _Open] = {}

    def __len__(self) -> int:
        return len(self._open)

    def add(self, reading: Reading) -> list[Bucket]:
        """Fold one reading in; the subject's bucket that this reading closed, if any. A
        reading older than the subject's open bucket is dropped (a clock step back, a late
        answer): a closed bucket has been written already."""
        if not math.isfinite(reading.watts):
            return []
        key = (reading.kind, reading.subject)
        start = bucket_start(reading.at, self.bucket_s)
        current = self._open.get(key)
        closed: list[Bucket] = []
        if current is not None:
            if start < current.start:
                return []
            if start == current.start:
                current.max_w = max(current.max_w, reading.watts)
                current.total_w += reading.watts
                current.samples += 1
                current.estimated = current.estimated or reading.estimated
                return []
            closed.append(self._bucket(key, current))
        self._open[key] = _Open(start, reading.watts, reading.watts, 1, reading.estimated)
        return closed

    def add_all(self, readings: Iterable[Reading]) -> list[Bucket]:
        closed: list[Bucket] = []
        for reading in readings:
            closed.extend(self.add(reading))
        return closed

    def close_until(self, now: datetime) -> list[Bucket]:
        """Close every open bucket that ended by `now`: a subject that stopped reporting (a
        server switched off, a rack emptied) would otherwise hold its last bucket forever."""
        closed = []
        for key, current in list(self._open.items()):
            if current.start + timedelta(seconds=self.bucket_s) <= now:
                closed.append(self._bucket(key, current))
                del self._open[key]
        return closed

    def _bucket(self, key: tuple[str, str], b: _Open) -> Bucket:
        return Bucket(
            kind=key[0],
            subject=key[1],
            bucket_start=b.start,
            bucket_s=self.bucket_s,
            max_w=b.max_w,
            mean_w=b.total_w / b.samples,
            samples=b.samples,
            estimated=b.estimated,
        )


def rack_readings(servers: Iterable[tuple[str, float, bool]], at: datetime) -> list[Reading]:
    """One reading per rack from (rack, server's watts, estimated) triples: the sum of its
    servers' latest readings, estimated when any of them is."""
    totals: dict[str, tuple[float, bool]] = {}
    for rack, watts, estimated in servers:
        total, any_estimate = totals.get(rack, (0.0, False))
        totals[rack] = (total + watts, any_estimate or estimated)
    return [Reading(RACK, rack, at, w, est) for rack, (w, est) in sorted(totals.items())]


def peak(buckets: Iterable[Bucket]) -> float | None:
    """The largest reading in the buckets (None: no buckets)."""
    return max((b.max_w for b in buckets), default=None)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The fleet's quantile (fleet_core/stats.py: the value at ⌊q·n⌋ of the sorted values, so
    the p99 of fewer than 100 values is their maximum): never below the interpolated one,
    which is the side to err on for a power budget. None when there are no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], not {q}")
    return quantile(values, q)


def p99_of_buckets(buckets: Iterable[Bucket]) -> float | None:
    """The p99 of the buckets' maxima: conservative, a bucket's mean would hide its peaks."""
    return percentile((b.max_w for b in buckets), 0.99)


def covered_s(buckets: Iterable[Bucket]) -> float:
    """Seconds of history the buckets stand for."""
    return sum(b.bucket_s for b in buckets)
