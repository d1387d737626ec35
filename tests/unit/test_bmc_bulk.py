"""Bulk BMC calls: bounded concurrency, per-rack stagger, per-server results."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from fleet.bmc.bulk import Job, Stagger, run_bulk


class Tracker:
    """Records how many jobs of each rack run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.total_peak = 0

    def job(self, rack: str, seconds: float, fail: bool = False) -> str:
        with self.lock:
            self.running[rack] = self.running.get(rack, 0) + 1
            self.peak[rack] = max(self.peak.get(rack, 0), self.running[rack])
            self.total_peak = max(self.total_peak, sum(self.running.values()))
        try:
            time.sleep(seconds)
            if fail:
                raise RuntimeError(f"BMC of a server in {rack} failed")
            return "done"
        finally:
            with self.lock:
                self.running[rack] -= 1


def jobs_for(tracker: Tracker, racks: dict[str, int], seconds: float) -> list[Job[str]]:
    return [
        Job(f"{rack}-s{i}", rack, lambda rack=rack: tracker.job(rack, seconds))  # type: ignore[misc]
        for rack, count in racks.items()
        for i in range(count)
    ]


def test_per_rack_limit_and_spacing_hold_while_racks_run_in_parallel() -> None:
    tracker = Tracker()
    jobs = jobs_for(tracker, {"r1": 6, "r2": 6}, seconds=0.05)
    outcomes = run_bulk(jobs, Stagger(workers=32, per_rack=2, rack_delay=0.02))
    assert all(o.ok and o.value == "done" for o in outcomes)
    assert [o.server for o in outcomes] == [j.server for j in jobs]  # order of the request
    assert tracker.peak == {"r1": 2, "r2": 2}
    assert tracker.total_peak == 4  # both racks at once
    for rack in ("r1", "r2"):
        starts = sorted(o.started for o in outcomes if o.rack == rack)
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert min(gaps) >= 0.02 - 0.005  # the inrush spacing (5 ms scheduler slack)


def test_workers_bound_total_concurrency() -> None:
    tracker = Tracker()
    jobs = jobs_for(tracker, {f"r{i}": 2 for i in range(8)}, seconds=0.03)
    run_bulk(jobs, Stagger(workers=3, per_rack=None, rack_delay=0))
    assert tracker.total_peak <= 3


def test_failures_are_per_server_results() -> None:
    tracker = Tracker()
    jobs = [
        Job("ok-1", "r1", lambda: tracker.job("r1", 0.01)),
        Job("bad", "r1", lambda: tracker.job("r1", 0.01, fail=True)),
        Job("ok-2", "r2", lambda: tracker.job("r2", 0.01)),
    ]
    seen: list[str] = []
    outcomes = run_bulk(
        jobs, Stagger(per_rack=None, rack_delay=0), on_done=lambda o: seen.append(o.server)
    )
    assert [o.ok for o in outcomes] == [True, False, True]
    assert "r1 failed" in str(outcomes[1].error)
    assert sorted(seen) == ["bad", "ok-1", "ok-2"]


def test_a_stalled_bmc_holds_up_only_itself() -> None:
    """One call hangs (as a BMC that accepts and never answers does, until its timeout); the
    other servers of the same rack and of other racks finish long before it."""
    release = threading.Event()

    def stalled() -> str:
        release.wait(timeout=5)
        return "late"

    tracker = Tracker()
    jobs = [Job("stalled", "r1", stalled), *jobs_for(tracker, {"r1": 5, "r2": 5}, 0.01)]
    done: list[str] = []

    def on_done(outcome: object) -> None:
        done.append(outcome.server)  # type: ignore[attr-defined]
        if len(done) == len(jobs) - 1:
            release.set()  # everyone else is done: now let the stalled one return

    outcomes = run_bulk(jobs, Stagger(workers=32, per_rack=2, rack_delay=0), on_done=on_done)
    assert done[-1] == "stalled"
    assert outcomes[0].value == "late" and all(o.ok for o in outcomes)


def test_unspaced_jobs_pass_their_racks_stagger() -> None:
    """Power-offs beside power-ons in one run (the provisioner's tick): the rack's limit and
    spacing hold the power-ons only."""
    tracker = Tracker()
    ons = jobs_for(tracker, {"r1": 2}, seconds=0.05)
    offs = [
        Job(f"r1-off{i}", "r1", lambda: tracker.job("r1", 0.05), spaced=False) for i in range(3)
    ]
    outcomes = run_bulk([*ons, *offs], Stagger(workers=32, per_rack=1, rack_delay=0.5))
    assert all(o.ok for o in outcomes)
    first, second = sorted(o.started for o in outcomes[:2])
    assert second - first >= 0.5 - 0.005  # the power-ons: spaced
    assert all(o.started < second for o in outcomes[2:])  # the others: not held by it
    assert tracker.peak["r1"] >= 2


def test_nothing_to_do() -> None:
    assert run_bulk([]) == []


@pytest.mark.parametrize("per_rack", [1, 3])
def test_fake_clock_spacing_is_exact(per_rack: int) -> None:
    """With an injected clock and sleep, the start times are the stagger plan itself."""
    now = [0.0]
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return now[0]

    def sleep(seconds: float) -> None:
        with lock:
            now[0] += seconds

    jobs = [Job(f"s{i}", "r1", lambda: "x") for i in range(4)]
    outcomes = run_bulk(
        jobs, Stagger(workers=1, per_rack=per_rack, rack_delay=10), clock=clock, sleep=sleep
    )
    assert [o.started for o in outcomes] == [0.0, 10.0, 20.0, 30.0]
