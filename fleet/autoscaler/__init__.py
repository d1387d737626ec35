"""The autoscaler: `policy` (pure: signals and history in, a target and its rule out) and
`service` (the leader's tick: heartbeats in, `target_servers` and decision records out).

Importing the package loads only the pure policy, so the simulator needs no database.
"""

from fleet.autoscaler.policy import (
    RULES,
    Decision,
    DeploymentState,
    PolicyConfig,
    Signals,
    Trend,
    aggregate,
    decide,
    fit_trend,
    step_sse,
)

__all__ = [
    "RULES",
    "Decision",
    "DeploymentState",
    "PolicyConfig",
    "Signals",
    "Trend",
    "aggregate",
    "decide",
    "fit_trend",
    "step_sse",
]
