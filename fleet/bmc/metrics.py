"""BMC call latency and errors: `fleet_bmc_call_duration_seconds`, `fleet_bmc_call_errors_total`.

Every BMC call goes through a `PowerDriver` method, whoever makes it (the reconciler, the
provisioner, the power and verify routes), so the drivers are the one place to measure:
`PowerDriver.__init_subclass__` wraps the operations of every driver class with `instrument`.
One observation per operation as its caller sees it (retries, session renewals and the
read-back after a command included): a driver method calling another (an IPMI power-on reads
the power state first) is not counted twice.

The series live in this process (not the database): each service process exposes the calls it
made itself, and Prometheus sums them over the processes it scrapes. The error counter starts
at 0 for every kind of error as soon as a protocol and operation saw a call, so that "no errors"
is a value, not a missing series.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from prometheus_client import Counter, Histogram
from prometheus_client.core import Metric

from fleet.bmc.base import (
    BmcAuthFailed,
    BmcError,
    BmcProtocolError,
    BmcTransient,
    BmcUnreachable,
    BmcUnsupported,
)

F = TypeVar("F", bound=Callable[..., Any])

# The PowerDriver operations (fleet/bmc/base.py); close() is bookkeeping, not a BMC call.
OPERATIONS = ("power_state", "power_on", "power_off", "power_cycle", "identify", "info", "sensors")
# From the most to the least specific: an error is the first class it is an instance of.
ERROR_KINDS: tuple[tuple[type[BmcError], str], ...] = (
    (BmcUnreachable, "unreachable"),
    (BmcAuthFailed, "auth"),
    (BmcUnsupported, "unsupported"),
    (BmcTransient, "transient"),
    (BmcProtocolError, "protocol"),
)
OTHER = "other"  # another BmcError, or an exception a driver did not map (a bug)
KINDS = (*(kind for _, kind in ERROR_KINDS), OTHER)
# Seconds: a Redfish GET on a LAN answers in tens of milliseconds; an IPMI power command with
# its read-back, or a call that times out and retries, takes tens of seconds.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)

DURATION = Histogram(
    "fleet_bmc_call_duration_seconds",
    "BMC operations (PowerDriver calls) by protocol and operation, failed ones included",
    ["protocol", "operation"],
    buckets=BUCKETS,
    registry=None,  # exposed by collect(), in every app's registry of this process
)
ERRORS = Counter(
    "fleet_bmc_call_errors",
    "BMC operations that failed, by protocol, operation and kind of error",
    ["protocol", "operation", "error"],
    registry=None,
)
_initialised: set[tuple[str, str]] = set()
_init_lock = threading.Lock()
_depth = threading.local()  # per thread: driver operations under way (nested calls)


def error_kind(exc: BaseException) -> str:
    for cls, kind in ERROR_KINDS:
        if isinstance(exc, cls):
            return kind
    return OTHER


def record(protocol: str, operation: str, seconds: float, error: BaseException | None) -> None:
    """One finished operation (also for tests and drivers outside PowerDriver)."""
    key = (protocol, operation)
    if key not in _initialised:
        with _init_lock:
            for kind in KINDS:
                ERRORS.labels(protocol, operation, kind)  # a child at 0
            _initialised.add(key)
    DURATION.labels(protocol, operation).observe(seconds)
    if error is not None:
        ERRORS.labels(protocol, operation, error_kind(error)).inc()


def _protocol(driver: Any) -> str:
    protocol = getattr(getattr(driver, "target", None), "protocol", None)
    return str(getattr(protocol, "value", protocol) or "unknown")


def instrument(operation: str, method: F) -> F:
    """`method` (a driver's `operation`) timed, its exceptions counted, and re-raised as is."""
    if getattr(method, "__fleet_bmc_timed__", False):
        return method

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "value", 0)
        if depth:  # inside another operation of a driver: that one counts
            return method(self, *args, **kwargs)
        _depth.value = 1
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            error = exc
            raise
        finally:
            _depth.value = 0
            # A BaseException (KeyboardInterrupt, a test's simulated crash) is no BMC error:
            # the call is timed, nothing is counted against the BMC.
            record(_protocol(self), operation, time.perf_counter() - started, error)

    timed.__fleet_bmc_timed__ = True  # type: ignore[attr-defined]
    return cast(F, timed)


def instrument_driver(cls: type) -> None:
    """Wrap the operations `cls` itself defines (inherited ones are wrapped already)."""
    for operation in OPERATIONS:
        method = cls.__dict__.get(operation)
        if callable(method) and not getattr(method, "__isabstractmethod__", False):
            setattr(cls, operation, instrument(operation, method))


def collect() -> Iterator[Metric]:
    """The two families, for a registry's collector (fleet/api/metrics.py)."""
    yield from DURATION.collect()
    yield from ERRORS.collect()
