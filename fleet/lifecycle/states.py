"""Server lifecycle states and the moves between them: pure data, no I/O.

This is the transition table of docs/design.md. `fleet.lifecycle.transitions.transition` is the
only code
that applies it to a server; the simulator and tests read it directly.
"""

from __future__ import annotations

from enum import StrEnum


class PowerState(StrEnum):
    """What a server's BMC last said of its power (`Server.power_state`)."""

    ON = "on"
    OFF = "off"
    UNKNOWN = "unknown"


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
    # Pre-staging (fleet/provisioning/staging.py): a warm spare powered on only to fetch a
    # version into its cache loads no replica; once the version is verified (or its fetch
    # failed, or ran past `stage_deadline_s`) it goes straight back to the warm pool.
    S.LOADING: frozenset({S.SERVING, S.FAILED, S.POWERING_OFF}),
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
INITIAL: ServerState = S.ENROLLED

# What an operator may ask for by hand (POST /servers/{name}/transition). The other moves
# record facts — the BMC powered it on, the agent registered, replicas are ready — that only
# the fleet's own loops observe.
OPERATOR_TARGETS: frozenset[ServerState] = frozenset(
    {S.MAINTENANCE, S.RETIRED, S.ENROLLED, S.DRAINING}
)

# States in which the server is on, or being turned on or off.
POWERED: frozenset[ServerState] = frozenset(
    {S.BOOTING, S.LOADING, S.SERVING, S.DRAINING, S.DRAINED, S.POWERING_OFF}
)
# States the lifecycle only enters once the server is off (warm: the BMC reported it off).
KNOWN_OFF: frozenset[ServerState] = frozenset({S.WARM, S.RETIRED})


def is_allowed(current: ServerState, target: ServerState) -> bool:
    return target in TRANSITIONS[current]


def allowed_targets(current: ServerState) -> list[ServerState]:
    return sorted(TRANSITIONS[current], key=list(ServerState).index)


def draws_max_power(state: ServerState | str, power_state: str) -> bool:
    """Whether a rack budget must count this server at its maximum draw.

    On or on its way up: yes. Otherwise the BMC's last reading decides, and with no reading
    a server counts as on unless the lifecycle knows it is off: overstating headroom is what
    trips a breaker.
    """
    if ServerState(state) in POWERED or power_state == "on":
        return True
    if power_state == "off":
        return False
    return ServerState(state) not in KNOWN_OFF
