"""fleet.power: rack budgets with worked numbers, and the A/B redundancy property."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.power.budget import (
    Feed,
    ServerDraw,
    Side,
    committed_watts,
    feed_watts,
    rack_budget,
    rack_power,
    side_watts,
)

# 415 V line-to-line × 32 A × √3 × 0.8 = 18,401.3 W
THREE_PHASE_415_32 = Feed(side="A", volts=415, amps=32, phase="three")
# 230 V × 32 A × 0.8 = 5,888 W
SINGLE_PHASE_230_32 = Feed(side="A", volts=230, amps=32, phase="single")

H100 = ServerDraw(max_w=10200, standby_w=60, on=True)


def test_three_phase_feed_watts() -> None:
    assert round(feed_watts(THREE_PHASE_415_32)) == 18401
    assert feed_watts(THREE_PHASE_415_32) == pytest.approx(415 * 32 * math.sqrt(3) * 0.8)


def test_single_phase_feed_watts() -> None:
    assert feed_watts(SINGLE_PHASE_230_32) == pytest.approx(5888)


def test_single_phase_is_the_default() -> None:
    assert feed_watts(Feed(side="B", volts=230, amps=32)) == pytest.approx(5888)


def test_utilisation_limit_scales_the_feed() -> None:
    full = Feed(side="A", volts=230, amps=32, max_utilisation_pct=100)
    half = Feed(side="A", volts=230, amps=32, max_utilisation_pct=50)
    assert feed_watts(full) == pytest.approx(7360)
    assert feed_watts(half) == pytest.approx(3680)


def test_side_watts_sums_each_side() -> None:
    feeds = [
        Feed(side="A", volts=415, amps=32, phase="three"),
        Feed(side="A", volts=415, amps=32, phase="three"),
        Feed(side="B", volts=230, amps=32),
    ]
    sides = side_watts(feeds)
    assert sides.keys() == {"A", "B"}
    assert sides["A"] == pytest.approx(2 * 18401.3, abs=0.1)
    assert sides["B"] == pytest.approx(5888)


def test_budget_is_the_smaller_side() -> None:
    # A1 + A2: 2 × 18,401.3 = 36,802.6 W; B1 + B2: 2 × 5,888 = 11,776 W.
    feeds = [
        Feed(side="A", volts=415, amps=32, phase="three"),
        Feed(side="A", volts=415, amps=32, phase="three"),
        Feed(side="B", volts=230, amps=32),
        Feed(side="B", volts=230, amps=32),
    ]
    assert rack_budget(feeds) == pytest.approx(11776)
    # The order of the feeds does not matter.
    assert rack_budget(list(reversed(feeds))) == pytest.approx(11776)


def test_budget_when_a_is_smaller() -> None:
    feeds = [
        Feed(side="A", volts=230, amps=16),  # 2,944 W
        Feed(side="B", volts=415, amps=32, phase="three"),
    ]
    assert rack_budget(feeds) == pytest.approx(2944)


@pytest.mark.parametrize("side", ["A", "B"])
def test_budget_with_one_side_is_that_side(side: Side) -> None:
    feeds = [Feed(side=side, volts=230, amps=32), Feed(side=side, volts=230, amps=32)]
    assert rack_budget(feeds) == pytest.approx(11776)


def test_budget_without_feeds_is_zero() -> None:
    assert rack_budget([]) == 0.0
    assert side_watts([]) == {}


def test_budget_accepts_a_generator() -> None:
    both: tuple[Side, ...] = ("A", "B")
    feeds = (Feed(side=s, volts=230, amps=32) for s in both)
    assert rack_budget(feeds) == pytest.approx(5888)


def test_committed_counts_max_when_on_and_standby_otherwise() -> None:
    servers = [
        ServerDraw(max_w=10200, standby_w=60, on=True),
        ServerDraw(max_w=10200, standby_w=60, on=False),
        ServerDraw(max_w=10200, standby_w=60, on=False),
    ]
    assert committed_watts(servers) == pytest.approx(10200 + 60 + 60)
    assert committed_watts([]) == 0


def test_rack_power_headroom_and_oversubscription() -> None:
    # Budget: 18,401.3 W (one three-phase feed on each side). One H100 on, two off.
    feeds = [
        Feed(side="A", volts=415, amps=32, phase="three"),
        Feed(side="B", volts=415, amps=32, phase="three"),
    ]
    servers = [
        ServerDraw(max_w=10200, standby_w=60, on=True),
        ServerDraw(max_w=10200, standby_w=60, on=False),
        ServerDraw(max_w=10200, standby_w=60, on=False),
    ]
    power = rack_power(feeds, iter(servers))
    assert power.budget_w == pytest.approx(18401.3, abs=0.1)
    assert power.committed_w == pytest.approx(10320)
    assert power.all_on_w == pytest.approx(30600)
    assert power.headroom_w == pytest.approx(18401.3 - 10320, abs=0.1)
    # All three on would need 30,600 W: 12,198.7 W over.
    assert power.oversubscribed_w == pytest.approx(30600 - 18401.3, abs=0.1)


def test_rack_power_within_budget_is_not_oversubscribed() -> None:
    feeds = [
        Feed(side="A", volts=415, amps=32, phase="three"),
        Feed(side="B", volts=415, amps=32, phase="three"),
    ]
    power = rack_power(feeds, [H100])
    assert power.oversubscribed_w == 0.0
    assert power.headroom_w == pytest.approx(18401.3 - 10200, abs=0.1)


def test_rack_power_headroom_goes_negative_when_over() -> None:
    feeds = [Feed(side="A", volts=230, amps=32)]  # 5,888 W, one side only
    power = rack_power(feeds, [H100])
    assert power.headroom_w == pytest.approx(5888 - 10200)
    assert power.oversubscribed_w == pytest.approx(10200 - 5888)


def test_empty_rack() -> None:
    power = rack_power([], [])
    assert (power.budget_w, power.committed_w, power.all_on_w) == (0.0, 0, 0)
    assert power.headroom_w == 0
    assert power.oversubscribed_w == 0


# ---------------------------------------------------------------------------------------------
# Property: the budget survives the loss of either side.

feeds_strategy = st.builds(
    Feed,
    side=st.sampled_from(["A", "B"]),
    volts=st.floats(min_value=100, max_value=1000, allow_nan=False, allow_infinity=False),
    amps=st.floats(min_value=1, max_value=1000, allow_nan=False, allow_infinity=False),
    phase=st.sampled_from(["single", "three"]),
    max_utilisation_pct=st.floats(min_value=1, max_value=100, allow_nan=False),
)


@given(st.lists(feeds_strategy, max_size=8))
def test_budget_survives_losing_either_side(feeds: list[Feed]) -> None:
    budget = rack_budget(feeds)
    assert budget >= 0
    sides = {f.side for f in feeds}
    if not sides:
        assert budget == 0
        return
    for side in sides:
        side_sum = sum(feed_watts(f) for f in feeds if f.side == side)
        if len(sides) == 2:
            # Never more than either side can carry on its own...
            assert budget <= side_sum * (1 + 1e-9)
            # ...so losing the other side (every feed on it) still carries the whole budget.
            survivors = [f for f in feeds if f.side == side]
            assert rack_budget(survivors) >= budget * (1 - 1e-9)
        else:
            assert budget == pytest.approx(side_sum)
    if len(sides) == 2:
        assert budget == pytest.approx(min(side_watts(feeds).values()))
