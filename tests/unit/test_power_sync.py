"""fleet.power_sync: the reconciler's policy, as plain data."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleet.lifecycle.states import ServerState
from fleet.models import PowerState
from fleet.power.reconcile_policy import (
    Due,
    ServerView,
    SyncPolicy,
    due,
    expected_power,
    is_mismatched,
    judge_failure,
    judge_reading,
)

ON, OFF, UNKNOWN = PowerState.ON, PowerState.OFF, PowerState.UNKNOWN
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
POLICY = SyncPolicy(failures_to_unreachable=3, unreachable_interval_s=300)


def view(
    state: ServerState = ServerState.WARM, power: PowerState = OFF, **kw: object
) -> ServerView:
    return ServerView(name="gpu1", state=state, power_state=power, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (ServerState.WARM, OFF),
        (ServerState.RETIRED, OFF),
        (ServerState.BOOTING, ON),
        (ServerState.SERVING, ON),
        (ServerState.DRAINED, ON),
        (ServerState.POWERING_OFF, None),  # on its way: either reading is fine
        (ServerState.ENROLLED, None),
        (ServerState.FAILED, None),
        (ServerState.MAINTENANCE, None),
    ],
)
def test_expected_power(state: ServerState, expected: PowerState | None) -> None:
    assert expected_power(state) == expected


def test_due_reads_by_default_and_skips_retired() -> None:
    assert due(view(), NOW, POLICY) is Due.READ
    assert due(view(ServerState.RETIRED), NOW, POLICY) is Due.SKIP


def test_a_settling_action_is_left_alone_until_it_settles() -> None:
    settling = view(power_settle_until=NOW + timedelta(seconds=5))
    assert due(settling, NOW, POLICY) is Due.SETTLING
    assert due(settling, NOW + timedelta(seconds=5), POLICY) is Due.READ


def test_an_unreachable_bmc_is_read_on_the_slower_cadence() -> None:
    down = view(bmc_failures=3, bmc_checked_at=NOW)
    assert due(down, NOW + timedelta(seconds=299), POLICY) is Due.BACKOFF
    assert due(down, NOW + timedelta(seconds=300), POLICY) is Due.READ
    # Fewer than K failures: still the normal cadence.
    assert due(view(bmc_failures=2, bmc_checked_at=NOW), NOW, POLICY) is Due.READ


def test_an_unchanged_reading_records_nothing() -> None:
    result = judge_reading(view(power=OFF), OFF, POLICY)
    assert result.events == () and result.power_state is OFF and result.bmc_failures == 0
    assert result.bmc_reachable is True


def test_a_change_the_lifecycle_allows_is_recorded_without_a_mismatch() -> None:
    # Booting, read back "off" (the BMC was slow), now on: a change, not a contradiction.
    result = judge_reading(view(ServerState.BOOTING, OFF), ON, POLICY)
    assert [e.kind for e in result.events] == ["server.power_changed"]
    assert not result.mismatched


def test_a_warm_spare_found_on_is_flagged_and_not_forced() -> None:
    result = judge_reading(view(ServerState.WARM, OFF), ON, POLICY)
    assert [e.kind for e in result.events] == ["server.power_changed", "server.power_mismatch"]
    assert result.mismatched and result.power_state is ON  # the hardware wins
    mismatch = result.events[1]
    assert "warm" in mismatch.message and "not forced" in mismatch.message
    assert mismatch.details == {"power_state": "on", "expected": "off", "state": "warm"}


def test_a_serving_server_found_off_is_flagged() -> None:
    result = judge_reading(view(ServerState.SERVING, ON), OFF, POLICY)
    assert result.mismatched


def test_an_unknown_reading_is_stored_but_never_called_a_change() -> None:
    result = judge_reading(view(ServerState.WARM, OFF), UNKNOWN, POLICY)
    assert result.events == ()


def test_failures_count_up_and_the_kth_marks_the_bmc_unreachable_once() -> None:
    first = judge_failure(view(), "BMC r1-gpu1: connection refused", POLICY)
    assert (first.bmc_failures, first.bmc_reachable, first.events) == (1, None, ())
    third = judge_failure(view(bmc_failures=2), "BMC r1-gpu1: connection refused", POLICY)
    assert third.bmc_reachable is False and third.bmc_failures == 3
    assert [e.kind for e in third.events] == ["server.bmc_unreachable"]
    assert "connection refused" in third.events[0].message and "300 s" in third.events[0].message
    fourth = judge_failure(view(bmc_failures=3), "still down", POLICY)
    assert fourth.events == () and fourth.bmc_failures == 4
    assert fourth.power_state is None  # the last reading stays: a failure is not "off"


def test_a_bmc_that_answers_again_is_recorded() -> None:
    back = judge_reading(view(bmc_failures=5, power=OFF), OFF, POLICY)
    assert [e.kind for e in back.events] == ["server.bmc_reachable"]
    assert back.bmc_failures == 0 and back.bmc_reachable is True
    # One a power action marked unreachable (no failed read counted) too; a BMC that was
    # merely unread before is not "back".
    marked = judge_reading(view(bmc_reachable=False, power=OFF), OFF, POLICY)
    assert [e.kind for e in marked.events] == ["server.bmc_reachable"]
    assert "power action" in marked.events[0].message
    assert judge_reading(view(power=OFF), OFF, POLICY).events == ()


def test_standing_mismatch() -> None:
    assert is_mismatched(ServerState.WARM, ON)
    assert not is_mismatched(ServerState.WARM, OFF)
    assert not is_mismatched(ServerState.WARM, UNKNOWN)
    assert not is_mismatched(ServerState.ENROLLED, ON)
