"""Bounded retries with exponential backoff and full jitter, for transient BMC failures only."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from fleet.bmc.base import BmcError, Timeouts

T = TypeVar("T")


def with_retries(
    call: Callable[[], T],
    timeouts: Timeouts,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rand: Callable[[], float] = random.random,
) -> T:
    """Run `call`; retry a retryable BmcError up to `attempts` times in all, never past
    `total` seconds. Anything else (and the last failure) propagates unchanged.

    Never wrap a non-idempotent request in this (a Reset POST): a retry could send it twice.
    """
    deadline = clock() + timeouts.total
    for attempt in range(1, timeouts.attempts + 1):
        try:
            return call()
        except BmcError as exc:
            if not exc.retryable or attempt == timeouts.attempts:
                raise
            delay = rand() * timeouts.backoff * 2 ** (attempt - 1)
            if clock() + delay >= deadline:
                raise
            sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover
