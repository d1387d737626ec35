"""fleet.power.series (the bucket accumulator and its summaries) and the pure rules of
fleet.power.measure (when drawn_w is rewritten, the agent-based estimate)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from fleet.power.measure import (
    BmcReading,
    Stored,
    drawn_fresh_s,
    estimate_w,
    needs_write,
    plan_writes,
    rewrite_after_s,
    sweep_readings,
)
from fleet.power.series import (
    RACK,
    SERVER,
    Bucket,
    Reading,
    Series,
    bucket_start,
    covered_s,
    p99_of_buckets,
    peak,
    percentile,
    rack_readings,
)
from fleet.settings import Settings
from fleet_core.stats import quantile

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)  # a multiple of 300 s since the epoch


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def reading(seconds: float, watts: float, subject: str = "gpu1", **kw: bool) -> Reading:
    return Reading(SERVER, subject, at(seconds), watts, **kw)


def test_buckets_are_aligned_to_the_epoch() -> None:
    assert bucket_start(at(0), 300) == T0
    assert bucket_start(at(299.9), 300) == T0
    assert bucket_start(at(300), 300) == at(300)
    assert bucket_start(at(-1), 300) == at(-300)
    assert bucket_start(datetime(1970, 1, 1, 0, 7, tzinfo=UTC), 300).minute == 5


def test_a_bucket_closes_when_a_reading_falls_past_it() -> None:
    series = Series(300)
    assert series.add(reading(10, 1000)) == []
    assert series.add(reading(70, 3000)) == []
    assert series.add(reading(130, 2000, estimated=True)) == []
    closed = series.add(reading(310, 500))
    assert closed == [
        Bucket(SERVER, "gpu1", T0, 300, max_w=3000, mean_w=2000, samples=3, estimated=True)
    ]
    # The next bucket starts afresh: one sample, not estimated.
    (second,) = series.close_until(at(600))
    assert (second.bucket_start, second.max_w, second.samples) == (at(300), 500, 1)
    assert not second.estimated and len(series) == 0


def test_subjects_and_kinds_keep_their_own_buckets() -> None:
    series = Series(60)
    series.add_all([reading(0, 10, "a"), reading(0, 20, "b"), Reading(RACK, "a", at(0), 30)])
    closed = series.add_all([reading(61, 11, "a")])
    assert [(b.kind, b.subject, b.max_w) for b in closed] == [(SERVER, "a", 10)]
    rest = series.close_until(at(120))
    assert sorted((b.kind, b.subject) for b in rest) == [(RACK, "a"), (SERVER, "a"), (SERVER, "b")]


def test_a_late_reading_is_dropped_and_an_open_bucket_is_not_closed_early() -> None:
    series = Series(300)
    series.add(reading(400, 100))
    assert series.add(reading(10, 9999)) == []  # its bucket has been written already
    assert series.close_until(at(599)) == []  # the open bucket ends at 600
    (bucket,) = series.close_until(at(600))
    assert bucket.max_w == 100 and bucket.samples == 1


def test_non_finite_watts_never_enter_a_bucket() -> None:
    series = Series(300)
    assert series.add(reading(0, float("nan"))) == [] and len(series) == 0


def test_bucket_width_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_s"):
        Series(0)


def test_a_racks_reading_is_the_sum_of_its_servers() -> None:
    readings = rack_readings(
        [("r1", 1000.0, False), ("r2", 50.0, False), ("r1", 2500.0, True)], at(0)
    )
    assert readings == [Reading(RACK, "r1", at(0), 3500.0, True), Reading(RACK, "r2", at(0), 50)]


def bucket(max_w: float, bucket_s: float = 300) -> Bucket:
    return Bucket(SERVER, "gpu1", T0, bucket_s, max_w, max_w / 2, 1, False)


def test_peak_and_p99_of_bucket_maxima() -> None:
    assert peak([]) is None and p99_of_buckets([]) is None
    buckets = [bucket(float(w)) for w in range(1, 201)]  # maxima 1..200
    assert peak(buckets) == 200
    # The fleet's rule: index ⌊0.99·200⌋ = 198 of the sorted maxima.
    assert p99_of_buckets(buckets) == 199
    # Fewer than 100 buckets: the p99 is their maximum (never understated).
    assert p99_of_buckets([bucket(5), bucket(9), bucket(7)]) == 9
    assert covered_s([bucket(1), bucket(1, 60)]) == 360


def test_percentile_is_the_fleets_quantile() -> None:
    rng = random.Random(7)
    values = [rng.uniform(0, 10_000) for _ in range(1_000)]
    for q in (0.0, 0.5, 0.95, 0.99, 1.0):
        assert percentile(values, q) == quantile(values, q)
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        percentile([1.0], 99)


def test_drawn_is_rewritten_on_a_move_a_new_source_or_a_bucket_later() -> None:
    def write(old: float | None, new: float, age_s: float = 60, source: str = "bmc") -> bool:
        old_at = None if old is None else at(-age_s)
        return needs_write(old, "bmc" if old is not None else None, old_at, new, source, at(0), 300)

    assert write(None, 5000)  # a first reading
    assert not write(5000, 5090)  # 1.8 %: not worth a row
    assert write(5000, 5100)  # 2 %
    assert write(5000, 4890)  # down 2.2 %
    assert write(5000, 5000, age_s=300)  # a bucket old: rewritten, so its age stays honest
    assert write(5000, 5000, source="estimate")
    assert not write(10, 10.9)  # 9 %, but under a watt: not worth a row
    assert write(0, 1.0)


def test_the_estimate_is_gpu_power_plus_the_non_gpu_idle() -> None:
    # 8 GPUs idling at 70 W in a 2000 W idle server: 1440 W of CPUs, fans and NICs.
    watts = [300.0] * 8
    assert estimate_w(watts, gpu_count=8, gpu_idle_w=70, server_idle_w=2000) == 2400 + 1440
    # A GPU that reports no power counts at its idle; a lost one is reported as None.
    partial = [300.0] * 7 + [None]
    assert estimate_w(partial, gpu_count=8, gpu_idle_w=70, server_idle_w=2000) == 2100 + 70 + 1440
    # An idle_w below the GPUs' own idle: the baseline floors at 0.
    assert estimate_w([100.0], gpu_count=1, gpu_idle_w=70, server_idle_w=50) == 100
    assert estimate_w([None, None], gpu_count=2, gpu_idle_w=70, server_idle_w=500) is None
    assert estimate_w([], gpu_count=0, gpu_idle_w=70, server_idle_w=500) is None


def test_an_unmoved_reading_is_rewritten_well_inside_its_freshness() -> None:
    settings = Settings(power_bucket_s=300, reconcile_interval_s=60)
    # Rewritten at the second sweep after the last write; counted fresh for three sweeps.
    assert (rewrite_after_s(settings), drawn_fresh_s(settings)) == (90, 180)
    # Sweeps slower than buckets: at least once a bucket.
    slow = Settings(power_bucket_s=300, reconcile_interval_s=600)
    assert rewrite_after_s(slow) == 300


def test_a_sweep_feeds_each_servers_latest_draw_and_its_racks_sum() -> None:
    def stored(sid: int, rack: str, w: float | None, src: str | None, age_s: float) -> Stored:
        return Stored(sid, rack, w, src, at(-age_s))

    rows = {
        "a": stored(1, "r1", 5000, "bmc", 30),  # read again this sweep: the new figure counts
        "b": stored(2, "r1", 3000, "estimate", 60),  # fresh estimate
        "c": stored(3, "r1", 7000, "bmc", 181),  # stale: its BMC went quiet
        "d": stored(4, "r2", 900, "bmc", 10),  # found off this sweep: no draw, fresh or not
        "e": stored(5, "r2", None, None, 0),
    }
    sweep = [
        BmcReading(1, "a", 10_200, True, 5500.0),
        BmcReading(4, "d", 10_200, False, None),
    ]
    got = sweep_readings(rows, sweep, at(0), fresh_s=180)
    assert [(r.kind, r.subject, r.watts, r.estimated) for r in got] == [
        (SERVER, "a", 5500, False),
        (SERVER, "b", 3000, True),
        (RACK, "r1", 8500, True),
    ]
    # What gets written: a moved 10 %; d is cleared.
    writes = plan_writes(rows, sweep, at(0), max_age_s=90)
    assert [(w["sid"], w["w"], w["src"]) for w in writes] == [(1, 5500.0, "bmc"), (4, None, None)]
