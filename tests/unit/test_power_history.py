"""fleet.power.history on SQLite and Postgres: closed buckets written (a clash merged, never
duplicated), old ones pruned in bounded batches, and the queries the rack view and measured-mode
placement ask (the p99 in SQL follows fleet_core/stats.quantile exactly)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from sqlmodel import Session, col, func, select

from fleet.models import PowerSample
from fleet.power.history import RackHistory, prune, rack_history, server_p99, write_buckets
from fleet.power.series import RACK, SERVER, Bucket
from fleet.settings import Settings
from fleet_core.stats import quantile

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
BUCKET_S = 300.0
SETTINGS = Settings(
    power_bucket_s=BUCKET_S, power_server_history_s=86_400, power_rack_history_s=7 * 86_400
)


def bucket(kind: str, subject: str, ago_s: float, max_w: float, **kw: object) -> Bucket:
    values: dict[str, object] = {
        "mean_w": max_w / 2,
        "samples": 5,
        "estimated": False,
        "bucket_s": BUCKET_S,
        **kw,
    }
    return Bucket(kind, subject, NOW - timedelta(seconds=ago_s), max_w=max_w, **values)  # type: ignore[arg-type]


def rows(session: Session, kind: str | None = None) -> list[PowerSample]:
    query = select(PowerSample).order_by(col(PowerSample.subject), col(PowerSample.bucket_start))
    if kind is not None:
        query = query.where(PowerSample.kind == kind)
    return list(session.exec(query))


def test_buckets_are_written_one_row_each(session: Session) -> None:
    written = write_buckets(
        session,
        [
            bucket(SERVER, "gpu1", 600, 5000, estimated=True),
            bucket(SERVER, "gpu1", 300, 5200),
            bucket(RACK, "r1", 300, 9000),
        ],
    )
    session.commit()
    assert written == 3
    stored = rows(session)
    assert [(r.kind, r.subject, r.max_w, r.estimated) for r in stored] == [
        (SERVER, "gpu1", 5000, True),
        (SERVER, "gpu1", 5200, False),
        (RACK, "r1", 9000, False),
    ]
    assert stored[0].bucket_start == NOW - timedelta(seconds=600)
    assert (stored[0].bucket_s, stored[0].mean_w, stored[0].samples) == (300, 2500, 5)
    assert write_buckets(session, []) == 0


def test_a_clash_after_a_restart_keeps_the_larger_max_and_merges_the_rest(
    session: Session,
) -> None:
    # The old leader wrote the bucket's first half; the new one writes the rest of it.
    write_buckets(session, [bucket(SERVER, "gpu1", 300, 6000, mean_w=3000, samples=2)])
    session.commit()
    write_buckets(
        session, [bucket(SERVER, "gpu1", 300, 4000, mean_w=4000, samples=2, estimated=True)]
    )
    session.commit()
    (row,) = rows(session)
    assert (row.max_w, row.mean_w, row.samples, row.estimated) == (6000, 3500, 4, True)
    # And the other way round: the later half had the peak.
    write_buckets(session, [bucket(SERVER, "gpu1", 300, 7000, mean_w=3500, samples=4)])
    session.commit()
    session.expire_all()
    (row,) = rows(session)
    assert (row.max_w, row.samples) == (7000, 8)


def test_prune_drops_buckets_past_retention_a_batch_at_a_time(session: Session) -> None:
    day = 86_400.0
    old_servers = [bucket(SERVER, f"s{i}", day + 300 * (i + 1), 100) for i in range(5)]
    kept_server = bucket(SERVER, "s-new", day - 300, 100)
    old_rack = bucket(RACK, "r1", 7 * day + 300, 100)
    kept_rack = bucket(RACK, "r1", 2 * day, 100)  # past the server retention, inside the rack's
    write_buckets(session, [*old_servers, kept_server, old_rack, kept_rack])
    session.commit()

    assert prune(session, NOW, SETTINGS, limit=2) == 3  # two servers' buckets, one rack's
    session.commit()
    assert session.exec(select(func.count()).select_from(PowerSample)).one() == 5
    assert prune(session, NOW, SETTINGS, limit=2) == 2
    assert prune(session, NOW, SETTINGS, limit=2) == 1
    assert prune(session, NOW, SETTINGS, limit=2) == 0
    session.commit()
    left = [(r.kind, r.subject, r.bucket_start) for r in rows(session)]
    assert left == [
        (RACK, "r1", kept_rack.bucket_start),
        (SERVER, "s-new", kept_server.bucket_start),
    ]


def test_rack_history_peak_over_a_day_and_p99_over_a_week(session: Session) -> None:
    rng = random.Random(3)
    # r1: 500 buckets over the last 7 days (p99 over them), a peak two days ago outside the
    # 24 h window, and an old bucket past the week that counts in neither.
    week = [(rng.uniform(0, 7 * 86_400 - 1), rng.uniform(20_000, 30_000)) for _ in range(500)]
    week.append((2 * 86_400.0, 35_000.0))
    buckets = [bucket(RACK, "r1", ago, w) for ago, w in week]
    buckets.append(bucket(RACK, "r1", 8 * 86_400, 99_000))
    buckets.append(bucket(RACK, "r2", 60, 1000))
    # A server named like a rack: another kind, never mixed in.
    buckets.append(bucket(SERVER, "r2", 60, 50_000))
    # One bucket per subject and start (the table's unique key).
    unique = {(b.kind, b.subject, b.bucket_start): b for b in buckets}
    write_buckets(session, list(unique.values()))
    session.commit()

    r1_week = [
        b.max_w
        for b in unique.values()
        if b.kind == RACK and b.subject == "r1" and NOW - b.bucket_start <= timedelta(days=7)
    ]
    r1_day = [
        b.max_w
        for b in unique.values()
        if b.kind == RACK and b.subject == "r1" and NOW - b.bucket_start <= timedelta(days=1)
    ]
    got = rack_history(session, ["r1", "r2", "r3"], NOW, SETTINGS)
    assert got["r1"] == RackHistory(peak_24h_w=max(r1_day), p99_7d_w=quantile(r1_week, 0.99))
    assert got["r1"].p99_7d_w is not None and got["r1"].p99_7d_w < 35_000  # a single spike
    assert got["r2"] == RackHistory(peak_24h_w=1000, p99_7d_w=1000)
    assert got["r3"] == RackHistory(peak_24h_w=None, p99_7d_w=None)
    assert rack_history(session, [], NOW, SETTINGS) == {}


def test_server_p99_and_the_history_it_covers(session: Session) -> None:
    # gpu1: 12 buckets (one hour) of rising maxima; gpu2: 300 buckets (25 h, the window cuts
    # it at 24 h).
    write_buckets(session, [bucket(SERVER, "gpu1", 300 * i, 1000 + i) for i in range(1, 13)])
    write_buckets(session, [bucket(SERVER, "gpu2", 300 * i, 2000 + i) for i in range(1, 301)])
    session.commit()
    got = server_p99(session, ["gpu1", "gpu2", "gpu3"], NOW, 86_400)
    assert got["gpu1"] == (1012, 3600)  # fewer than 100 buckets: the p99 is the maximum
    inside = sorted(2000.0 + i for i in range(1, 289))  # 288 buckets start within 24 h
    assert got["gpu2"] == (quantile(inside, 0.99), 86_400)
    assert got["gpu3"] == (None, 0.0)
    assert server_p99(session, [], NOW, 86_400) == {}
    # A shorter window: fewer buckets, less history covered.
    assert server_p99(session, ["gpu1"], NOW, 1800)["gpu1"] == (1006, 1800)


def test_many_subjects_are_asked_in_chunks(session: Session) -> None:
    names = [f"s{i:05d}" for i in range(2_500)]
    write_buckets(session, [bucket(SERVER, n, 300, float(i)) for i, n in enumerate(names)])
    session.commit()
    got = server_p99(session, names, NOW, 86_400)
    assert len(got) == 2_500 and got["s02499"] == (2499, 300)
