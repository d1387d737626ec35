"""check_watts: which BMC power readings are believed (fleet/power/readings.py)."""

from __future__ import annotations

import math

import pytest

from fleet.power.readings import NONSENSE_FACTOR, check_watts

MAX_W = 10_200.0  # a DGX H100's maximum


@pytest.mark.parametrize("watts", [0, 0.0, 1, 344, 6_500.5, MAX_W, MAX_W * 1.5, MAX_W * 10])
def test_believable_readings(watts: float) -> None:
    assert check_watts(watts, max_w=MAX_W) is None


@pytest.mark.parametrize(
    ("watts", "words"),
    [
        (-1, "negative"),
        (-0.5, "negative"),
        (math.nan, "not a finite number"),
        (math.inf, "not a finite number"),
        (-math.inf, "not a finite number"),
        (MAX_W * 10 + 1, "above 10 × the server's maximum of 10200 W"),
        (1e9, "above 10 ×"),
        ("344", "not a number"),
        (None, "not a number"),
        (True, "not a number"),
    ],
)
def test_nonsense_is_refused_with_a_reason(watts: object, words: str) -> None:
    reason = check_watts(watts, max_w=MAX_W)
    assert reason is not None and words in reason
    assert "\n" not in reason


def test_the_limit_scales_with_the_server() -> None:
    small = 800.0
    assert check_watts(small * NONSENSE_FACTOR, max_w=small) is None
    reason = check_watts(small * NONSENSE_FACTOR + 0.1, max_w=small)
    assert reason is not None and "8000.1 W" in reason and "800 W" in reason


@pytest.mark.parametrize("max_w", [0.0, -5.0, math.nan])
def test_without_a_usable_maximum_only_sign_and_finiteness_count(max_w: float) -> None:
    assert check_watts(1e7, max_w=max_w) is None
    assert check_watts(-3, max_w=max_w) is not None
    assert check_watts(math.nan, max_w=max_w) is not None
