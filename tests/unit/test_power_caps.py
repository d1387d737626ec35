"""fleet/power/caps.py: the cap valve's rule (high and low water, step, floor) and the no-boot
check at 100 %. Pure: a rack's drawn power and budget in, the next cap out.

The marks are the defaults (docs/power.md): cap at 90 % of the budget drawn, lift below 80 %,
10 % of TDP a step, never below 50 %. The budget is 10 kW, so watts read as tenths of a percent.
"""

from __future__ import annotations

from typing import Any

import pytest

from fleet.power.caps import admits_boot, next_cap_pct

BUDGET_W = 10_000.0
MARKS: dict[str, float] = {"high_pct": 90.0, "low_pct": 80.0, "floor_pct": 50.0, "step_pct": 10.0}


def step(drawn_w: float | None, cap: float | None, **marks: Any) -> float | None:
    return next_cap_pct(drawn_w, BUDGET_W, cap, **{**MARKS, **marks})


def test_crossing_high_water_caps_an_uncapped_rack_one_step_below_tdp() -> None:
    assert step(9_000.0, None) == 90.0  # at the mark itself
    assert step(9_500.0, None) == 90.0


def test_above_high_water_each_decision_steps_down_again() -> None:
    assert step(9_500.0, 90.0) == 80.0
    assert step(12_000.0, 80.0) == 70.0  # over budget: still one step, not a jump


def test_the_cap_stops_at_the_floor() -> None:
    assert step(9_900.0, 60.0) == 50.0
    assert step(9_900.0, 50.0) == 50.0
    assert step(9_900.0, 55.0) == 50.0  # a step past the floor lands on it
    caps: list[float | None] = [None]
    for _ in range(10):
        caps.append(step(9_900.0, caps[-1]))
    assert caps[:7] == [None, 90.0, 80.0, 70.0, 60.0, 50.0, 50.0]
    assert caps[-1] == 50.0


def test_between_the_marks_nothing_moves() -> None:
    """Hysteresis: a rack hovering between low and high water keeps whatever cap it has."""
    for drawn in (8_000.0, 8_500.0, 8_999.0):
        assert step(drawn, None) is None
        assert step(drawn, 70.0) == 70.0


def test_below_low_water_the_cap_lifts_a_step_at_a_time_then_goes() -> None:
    assert step(7_000.0, 70.0) == 80.0
    assert step(7_000.0, 80.0) == 90.0
    assert step(7_000.0, 90.0) is None  # 100 % of TDP is no cap: the GPU's own default
    assert step(7_999.0, 95.0) is None
    assert step(7_000.0, None) is None  # nothing to lift


def test_no_reading_or_no_budget_leaves_the_cap_as_it_is() -> None:
    assert step(None, 70.0) == 70.0
    assert step(None, None) is None
    assert next_cap_pct(20_000.0, 0.0, 60.0, **MARKS) == 60.0


@pytest.mark.parametrize(
    ("marks", "needle"),
    [
        ({"low_pct": 90.0}, "low_pct < high_pct"),  # low == high: no hysteresis band
        ({"low_pct": 95.0}, "low_pct < high_pct"),
        ({"low_pct": 0.0}, "0 < low_pct"),
        ({"high_pct": 120.0}, "high_pct <= 100"),
        ({"floor_pct": 0.0}, "floor_pct"),
        ({"floor_pct": 101.0}, "floor_pct"),
        ({"step_pct": 0.0}, "step_pct > 0"),
    ],
)
def test_marks_that_make_no_sense_are_refused(marks: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        step(9_500.0, None, **marks)
    # Refused even where the reading alone would not move anything.
    with pytest.raises(ValueError):
        step(None, None, **marks)


def test_no_boot_enters_a_rack_drawing_its_whole_budget() -> None:
    assert admits_boot(9_999.0, BUDGET_W)
    assert not admits_boot(10_000.0, BUDGET_W)
    assert not admits_boot(11_000.0, BUDGET_W)
    assert admits_boot(None, BUDGET_W)  # no reading: the committed budget check decides
