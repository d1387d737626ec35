"""Retries of transient BMC failures: bounded in attempts and in time, jittered, never for
failures that are not transient. A fake clock makes every case exact and instant."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from fleet.bmc.base import (
    BmcAuthFailed,
    BmcError,
    BmcTarget,
    BmcTransient,
    BmcUnreachable,
    Timeouts,
)
from fleet.bmc.retry import with_retries
from fleet.models import BmcProtocol

TARGET = BmcTarget(
    server="gpu-1",
    protocol=BmcProtocol.REDFISH,
    address="127.0.0.1",
    port=8000,
    username="admin",
    password="s3cret",
    system_id="abc",
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(errors: Sequence[BmcError], result: str = "ok") -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return calls, call


def run(call: Callable[[], str], timeouts: Timeouts, clock: FakeClock, rand: float = 1.0) -> str:
    return with_retries(
        call,
        timeouts,
        sleep=clock.sleep,
        clock=clock.clock,
        rand=lambda: rand,
    )


def test_transient_failures_are_retried_with_doubling_backoff() -> None:
    clock = FakeClock()
    calls, call = failing([BmcTransient(TARGET, "HTTP 503")] * 2)
    assert run(call, Timeouts(attempts=3, backoff=0.5, total=30), clock) == "ok"
    assert len(calls) == 3
    assert clock.sleeps == [0.5, 1.0]  # full jitter at its ceiling (rand = 1.0)


def test_jitter_scales_each_delay() -> None:
    clock = FakeClock()
    _, call = failing([BmcTransient(TARGET, "busy")] * 2)
    run(call, Timeouts(attempts=3, backoff=2.0, total=30), clock, rand=0.25)
    assert clock.sleeps == [0.5, 1.0]


def test_attempts_bound_the_retries_and_the_last_error_surfaces() -> None:
    clock = FakeClock()
    errors = [BmcTransient(TARGET, f"HTTP 503 #{i}") for i in range(5)]
    calls, call = failing(errors)
    with pytest.raises(BmcTransient, match="#2"):
        run(call, Timeouts(attempts=3, backoff=0.1, total=30), clock)
    assert len(calls) == 3


def test_total_time_bounds_the_retries() -> None:
    clock = FakeClock()
    calls, call = failing([BmcTransient(TARGET, "HTTP 503")] * 10)
    with pytest.raises(BmcTransient):
        run(call, Timeouts(attempts=10, backoff=1.0, total=2.5), clock)
    # sleeps of 1 and 2 would end at 3 s > 2.5 s: only the first is taken
    assert clock.sleeps == [1.0] and len(calls) == 2


@pytest.mark.parametrize("error", [BmcAuthFailed(TARGET, "401"), BmcUnreachable(TARGET, "refused")])
def test_other_failures_are_not_retried(error: BmcError) -> None:
    clock = FakeClock()
    calls, call = failing([error])
    with pytest.raises(type(error)):
        run(call, Timeouts(attempts=5), clock)
    assert len(calls) == 1 and clock.sleeps == []


def test_errors_are_one_line_naming_server_and_bmc_and_never_the_password() -> None:
    text = str(BmcAuthFailed(TARGET, "the BMC refused the credentials"))
    assert text == (
        "server gpu-1 (redfish 127.0.0.1:8000 system abc): the BMC refused the credentials"
    )
    assert "s3cret" not in repr(TARGET) and "s3cret" not in text
