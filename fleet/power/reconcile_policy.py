"""Power-state reconciliation policy: pure data in, pure data out (no I/O).

The reconciler (fleet/power/reconciler.py) reads every server's BMC on a cadence and asks this
module
what the reading means. The hardware wins for observed fields; the lifecycle state is never
changed here. A server whose power contradicts its lifecycle state (a warm spare found on, a
serving server found off) is flagged for an operator with an Event, never silently forced: the
BMC may be right and the database wrong, and a forced power-off of a serving machine is not a
call a loop should make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from fleet.lifecycle.states import KNOWN_OFF, PowerState, ServerState


class Due(StrEnum):
    READ = "read"
    SETTLING = "settling"  # Fleet's own power action has not settled yet: leave it alone
    BACKOFF = "backoff"  # BMC marked unreachable: read on the slower cadence only
    SKIP = "skip"  # retired: nothing to watch


@dataclass(frozen=True, slots=True)
class SyncPolicy:
    failures_to_unreachable: int = 3
    unreachable_interval_s: float = 300.0


@dataclass(frozen=True, slots=True)
class ServerView:
    """What the reconciler knows of a server before it reads the BMC."""

    name: str
    state: ServerState
    power_state: PowerState
    bmc_failures: int = 0
    bmc_checked_at: datetime | None = None
    power_settle_until: datetime | None = None
    bmc_reachable: bool | None = None  # False: marked unreachable (by reads, or a power action)


@dataclass(frozen=True, slots=True)
class EventSpec:
    kind: str
    message: str
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What to store for one server after one read (None: leave the field as it is)."""

    power_state: PowerState | None
    bmc_reachable: bool | None
    bmc_failures: int
    events: tuple[EventSpec, ...] = ()

    @property
    def mismatched(self) -> bool:
        return any(e.kind == "server.power_mismatch" for e in self.events)


# Lifecycle states in which the server must be on; states with no opinion are left out
# (enrolled: not yet verified; powering_off: either is fine; failed, quarantined and
# maintenance: an operator's business).
_EXPECT_ON: frozenset[ServerState] = frozenset(
    {
        ServerState.BOOTING,
        ServerState.LOADING,
        ServerState.SERVING,
        ServerState.DRAINING,
        ServerState.DRAINED,
    }
)


def expected_power(state: ServerState) -> PowerState | None:
    if state in _EXPECT_ON:
        return PowerState.ON
    if state in KNOWN_OFF:
        return PowerState.OFF
    return None


def due(server: ServerView, now: datetime, policy: SyncPolicy) -> Due:
    if server.state is ServerState.RETIRED:
        return Due.SKIP
    if server.power_settle_until is not None and now < server.power_settle_until:
        return Due.SETTLING
    if (
        server.bmc_failures >= policy.failures_to_unreachable
        and server.bmc_checked_at is not None
        and now - server.bmc_checked_at < timedelta(seconds=policy.unreachable_interval_s)
    ):
        return Due.BACKOFF
    return Due.READ


def judge_reading(server: ServerView, reading: PowerState, policy: SyncPolicy) -> SyncResult:
    """A successful BMC read."""
    events: list[EventSpec] = []
    if server.bmc_failures >= policy.failures_to_unreachable or server.bmc_reachable is False:
        events.append(
            EventSpec(
                "server.bmc_reachable",
                f"BMC answers again after {server.bmc_failures} failed reads"
                if server.bmc_failures
                else "BMC answers again (a power action had found it unreachable)",
                {"failures": server.bmc_failures},
            )
        )
    changed = reading != server.power_state and reading is not PowerState.UNKNOWN
    if changed:
        events.append(
            EventSpec(
                "server.power_changed",
                f"BMC reports {reading.value}; Fleet last saw {server.power_state.value}",
                {"power_state": reading.value, "was": server.power_state.value},
            )
        )
        expected = expected_power(server.state)
        if expected is not None and reading != expected:
            events.append(
                EventSpec(
                    "server.power_mismatch",
                    f"BMC reports {reading.value} but a {server.state.value} server should be "
                    f"{expected.value}; left as it is for an operator (not forced)",
                    {
                        "power_state": reading.value,
                        "expected": expected.value,
                        "state": server.state.value,
                    },
                )
            )
    return SyncResult(power_state=reading, bmc_reachable=True, bmc_failures=0, events=tuple(events))


def judge_failure(server: ServerView, error: str, policy: SyncPolicy) -> SyncResult:
    """A failed BMC read: the K-th failure in a row marks the BMC unreachable (one Event);
    later failures are counted quietly on the slower cadence."""
    failures = server.bmc_failures + 1
    if failures == policy.failures_to_unreachable:
        return SyncResult(
            power_state=None,
            bmc_reachable=False,
            bmc_failures=failures,
            events=(
                EventSpec(
                    "server.bmc_unreachable",
                    f"{failures} BMC reads failed in a row; retrying every "
                    f"{policy.unreachable_interval_s:g} s. Last error: {error}",
                    {"failures": failures},
                ),
            ),
        )
    return SyncResult(power_state=None, bmc_reachable=None, bmc_failures=failures)


def is_mismatched(state: ServerState, power_state: PowerState) -> bool:
    """A standing contradiction between the lifecycle and the last BMC reading."""
    expected = expected_power(state)
    return expected is not None and power_state not in (expected, PowerState.UNKNOWN)
