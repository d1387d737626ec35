"""Defaults of the agent's behaviour that the simulator must reproduce (pure constants).

The agent's settings (fleet_agent/config.py) default to these, and the simulator
(fleet/sim/faults.py) models the same agent without importing it.
"""

from __future__ import annotations

# Self-drain (an unhealthy verdict or the fleet's "drain"): in-flight requests get this long to
# finish before the engines are stopped.
DRAIN_DEADLINE_S = 120.0
