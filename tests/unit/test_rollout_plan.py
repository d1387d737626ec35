"""fleet/rollout/plan.py and analysis.py (pure): the plan's weights, servers per step, and a
step's verdict from the two versions' figures."""

from __future__ import annotations

import pytest

from fleet.rollout.analysis import LATENCY_FLOOR_S, Thresholds, VersionFigures, judge
from fleet.rollout.plan import PlanError, build_plan, canary_servers, parse_share


def test_shares_read_as_percentages_or_fractions() -> None:
    assert parse_share("5%") == 0.05
    assert parse_share(" 12.5 % ") == 0.125
    assert parse_share("5") == 0.05  # a bare number of 1 or more is a percentage
    assert parse_share("0.05") == 0.05
    assert parse_share(0.3) == 0.3
    assert parse_share("100%") == 1.0
    for bad in ("0%", "-5%", "150%", "five", "nan", "", "inf"):
        with pytest.raises(PlanError):
            parse_share(bad)


def test_a_plan_increases_and_ends_before_the_promotion() -> None:
    assert build_plan(None, None) == [0.05, 0.25, 0.5]
    assert build_plan("5%", ["25%", "50%"]) == [0.05, 0.25, 0.5]
    assert build_plan("10%", None) == [0.1]
    assert build_plan("10%", ["100%"]) == [0.1]  # 100 % is the promotion itself
    assert build_plan(None, ["30%"]) == [0.05, 0.3]
    with pytest.raises(PlanError, match="must increase"):
        build_plan("25%", ["10%"])
    with pytest.raises(PlanError, match="less than 100"):
        build_plan("100%", None)
    with pytest.raises(PlanError, match="at most"):
        build_plan("1%", [f"{n}%" for n in range(2, 30)])


def test_canary_servers_round_up_and_leave_one_stable() -> None:
    assert canary_servers(0.05, 10) == 1
    assert canary_servers(0.25, 10) == 3
    assert canary_servers(0.5, 10) == 5
    assert canary_servers(0.5, 4) == 2
    assert canary_servers(0.9, 4) == 3  # ceil(3.6) = 4 would leave nothing to compare with
    assert canary_servers(0.05, 2) == 1
    assert canary_servers(0.05, 1) == 0  # one server: no canary possible
    assert canary_servers(1.0, 4) == 4
    assert canary_servers(0.3, 0) == 0


T = Thresholds(step_s=60.0, min_requests=20, max_error_increase=0.02, max_latency_ratio=1.5)
GOOD = VersionFigures(requests=400, errors=0, p95_s=0.4, ttft_p95_s=0.1)


def test_a_canary_waits_for_requests_and_for_the_window() -> None:
    few = judge(GOOD, VersionFigures(requests=5), elapsed_s=120, thresholds=T)
    assert few.outcome == "wait" and "5 of the 20" in few.reason
    early = judge(GOOD, VersionFigures(20, 0, 0.4, 0.1), elapsed_s=10, thresholds=T)
    assert early.outcome == "wait" and "window 10 s of 60 s" in early.reason
    done = judge(GOOD, VersionFigures(20, 0, 0.4, 0.1), elapsed_s=60, thresholds=T)
    assert done.outcome == "pass"
    assert done.figures["canary"]["requests"] == 20
    assert done.figures["stable"]["error_rate"] == 0.0


def test_errors_fail_the_canary_as_soon_as_it_has_its_requests() -> None:
    bad = VersionFigures(requests=20, errors=10, p95_s=0.4)
    verdict = judge(GOOD, bad, elapsed_s=3, thresholds=T)  # long before the window ends
    assert verdict.outcome == "fail"
    assert "error rate 50.0% (10/20)" in verdict.reason
    assert verdict.figures["canary"]["error_rate"] == 0.5
    # Measured against the stable version's own rate: both at 5 % is no regression.
    noisy = VersionFigures(requests=400, errors=20, p95_s=0.4)
    same = VersionFigures(requests=40, errors=2, p95_s=0.4)
    assert judge(noisy, same, elapsed_s=60, thresholds=T).outcome == "pass"
    # A handful of stable requests prove nothing: the canary is held to the increase alone.
    thin = VersionFigures(requests=3, errors=3)
    assert judge(thin, same, elapsed_s=60, thresholds=T).outcome == "fail"


def test_latency_and_ttft_fail_past_the_ratio_and_the_floor() -> None:
    slow = VersionFigures(requests=30, errors=0, p95_s=1.2, ttft_p95_s=0.1)
    verdict = judge(GOOD, slow, elapsed_s=5, thresholds=T)
    assert verdict.outcome == "fail" and verdict.reason.startswith("latency p95 1200 ms")
    late = VersionFigures(requests=30, errors=0, p95_s=0.4, ttft_p95_s=0.5)
    assert judge(GOOD, late, elapsed_s=5, thresholds=T).reason.startswith("TTFT p95 500 ms")
    # A few milliseconds on a fast model: noise, not a regression.
    fast = VersionFigures(requests=400, p95_s=0.004)
    jitter = VersionFigures(requests=30, p95_s=0.004 * 1.5 + LATENCY_FLOOR_S - 0.001)
    assert judge(fast, jitter, elapsed_s=60, thresholds=T).outcome == "pass"
    # Unknown on one side: not compared.
    assert judge(VersionFigures(400), slow, elapsed_s=60, thresholds=T).outcome == "pass"


def test_a_probe_mismatch_fails_at_once() -> None:
    verdict = judge(GOOD, VersionFigures(), elapsed_s=0, thresholds=T, probe_mismatches=["s3"])
    assert (
        verdict.outcome == "fail" and "quality probe" in verdict.reason and "s3" in verdict.reason
    )
