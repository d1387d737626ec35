"""fleet/power/boot_cap.py: the highest GPU cap under which a spare fits a rack's headroom.

The spare is an HGX H100 (8 × 700 W TDP, 10.2 kW maximum): each 10 % of TDP off its GPUs takes
560 W off its maximum. The valve's default steps: 10 % a step, floor 50 %.
"""

from __future__ import annotations

import pytest

from fleet.power.boot_cap import BootFit, boot_fit, capped_max_w

HGX = {"max_w": 10_200.0, "gpu_count": 8, "tdp_w": 700.0}
STEPS = {"floor_pct": 50.0, "step_pct": 10.0}


def fit(commit_w: float, headroom_w: float, **server: float) -> BootFit | None:
    spec = {**HGX, **server}
    return boot_fit(
        commit_w,
        headroom_w,
        max_w=spec["max_w"],
        gpu_count=int(spec["gpu_count"]),
        tdp_w=spec["tdp_w"],
        **STEPS,
    )


def test_a_cap_takes_the_gpus_share_off_the_maximum_and_nothing_else() -> None:
    assert capped_max_w(10_200.0, 8, 700.0, None) == 10_200.0
    assert capped_max_w(10_200.0, 8, 700.0, 100.0) == 10_200.0
    assert capped_max_w(10_200.0, 8, 700.0, 90.0) == pytest.approx(9_640.0)
    assert capped_max_w(10_200.0, 8, 700.0, 50.0) == pytest.approx(7_400.0)
    assert capped_max_w(10_200.0, 0, 700.0, 50.0) == 10_200.0  # no GPUs: nothing comes off
    with pytest.raises(ValueError, match="cap_pct"):
        capped_max_w(10_200.0, 8, 700.0, 0.0)


def test_a_spare_that_fits_boots_uncapped() -> None:
    assert fit(10_200.0, 10_200.0) == BootFit(None, 10_200.0)


def test_a_spare_that_fits_only_under_a_cap_gets_the_highest_cap_that_fits() -> None:
    got = fit(10_200.0, 9_700.0)
    assert got is not None and got.cap_pct == 90.0
    assert got.commit_w == pytest.approx(9_640.0)
    got = fit(10_200.0, 8_500.0)  # 80 %: 9,080 W; 70 %: 8,520 W; 60 %: 7,960 W
    assert got is not None and got.cap_pct == 60.0


def test_the_floor_is_the_last_try_and_below_it_nothing_fits() -> None:
    got = fit(10_200.0, 7_400.0)
    assert got is not None and got.cap_pct == 50.0
    assert fit(10_200.0, 7_399.0) is None
    assert fit(10_200.0, 9_000.0, gpu_count=0) is None  # a server without GPUs cannot be capped


def test_a_measured_commitment_is_bounded_by_the_capped_maximum_not_replaced() -> None:
    """Measured mode: it commits 9,800 W (p99 × margin) uncapped; at 90 % its maximum is
    9,640 W, so it commits that; a cap never raises a commitment above the measured one."""
    got = fit(9_800.0, 9_700.0)
    assert got is not None and got.cap_pct == 90.0
    assert got.commit_w == pytest.approx(9_640.0)
    got = fit(6_000.0, 5_000.0)
    assert got is None  # its maximum at the floor (7,400 W) is above its measured 6,000 W


def test_steps_that_do_not_divide_the_range_still_try_the_floor() -> None:
    got = boot_fit(
        10_200.0, 7_700.0, max_w=10_200.0, gpu_count=8, tdp_w=700.0, floor_pct=55.0, step_pct=20.0
    )
    assert got is not None and got.cap_pct == 55.0  # 80 %: 9,080 W; 60 %: 7,960 W; 55 %: 7,680


def test_bad_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="floor_pct"):
        boot_fit(
            10_200.0,
            9_000.0,
            max_w=10_200.0,
            gpu_count=8,
            tdp_w=700.0,
            floor_pct=0.0,
            step_pct=10.0,
        )
    with pytest.raises(ValueError, match="step_pct"):
        boot_fit(
            10_200.0,
            9_000.0,
            max_w=10_200.0,
            gpu_count=8,
            tdp_w=700.0,
            floor_pct=50.0,
            step_pct=0.0,
        )
