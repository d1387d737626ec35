"""The autoscaler: `policy` (pure: signals and history in, a target and its rule out), its
vocabulary `signals` (the types, thresholds and `aggregate`: heartbeats → `Signals`) and
look-ahead `trend`, and `service` (the leader's tick: heartbeats in, `target_servers` and
decision records out).

Importing the package loads only the pure modules, so the simulator needs no database.
"""

from fleet.autoscaler.policy import decide
from fleet.autoscaler.signals import (
    RULES,
    Decision,
    DeploymentState,
    PolicyConfig,
    Signals,
    aggregate,
)
from fleet.autoscaler.trend import Trend, fit_trend, step_sse

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
