"""Server lifecycle states and the moves between them: pure data, no I/O.

This is the transition table of docs/design.md. `fleet.lifecycle.transition` is the only code
that applies it to a server; the simulator and tests read it directly.
"""

from __future__ import annotations

from enum import StrEnum


class ServerState(StrEnum):
    ENROLLED = "enrolled"
    WARM = "warm"
    BOOTING = "booting"
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"
    POWERING_OFF = "powering_off"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    MAINTENANCE = "maintenance"
    RETIRED = "retired"


S = ServerState

# from-state -> allowed to-states (docs/design.md, "Server lifecycle"). Operator-only moves
# (maintenance, retired) are added for every state below.
_TABLE: dict[ServerState, frozenset[ServerState]] = {
    S.ENROLLED: frozenset({S.WARM, S.BOOTING}),
    S.WARM: frozenset({S.BOOTING}),
    S.BOOTING: frozenset({S.LOADING, S.FAILED}),
    S.LOADING: frozenset({S.SERVING, S.FAILED}),
    S.SERVING: frozenset({S.DRAINING}),
    S.DRAINING: frozenset({S.DRAINED}),
    S.DRAINED: frozenset({S.POWERING_OFF, S.BOOTING, S.QUARANTINED}),
    # A BMC that will not power the server off is a failure like one that will not power it on.
    S.POWERING_OFF: frozenset({S.WARM, S.FAILED}),
    S.FAILED: frozenset({S.ENROLLED}),
    S.QUARANTINED: frozenset({S.ENROLLED}),
    S.MAINTENANCE: frozenset({S.ENROLLED}),
    S.RETIRED: frozenset(),
}

OPERATOR_ONLY: frozenset[ServerState] = frozenset({S.MAINTENANCE, S.RETIRED})

TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    state: targets | (OPERATOR_ONLY - {state} if state is not S.RETIRED else frozenset())
    for state, targets in _TABLE.items()
}

TERMINAL: frozenset[ServerState] = frozenset({S.RETIRED})
# States that wait for a person (`release` -> enrolled).
WAITING_FOR_OPERATOR: frozenset[ServerState] = frozenset({S.FAILED, S.QUARANTINED, S.MAINTENANCE})
# States in which the server is (or is being) powered on: its rack budget counts max draw.
POWERED: frozenset[ServerState] = frozenset(
    {S.BOOTING, S.LOADING, S.SERVING, S.DRAINING, S.DRAINED, S.POWERING_OFF}
)
INITIAL: ServerState = S.ENROLLED


def is_allowed(current: ServerState, target: ServerState) -> bool:
    return target in TRANSITIONS[current]


def allowed_targets(current: ServerState) -> list[ServerState]:
    return sorted(TRANSITIONS[current], key=list(ServerState).index)
