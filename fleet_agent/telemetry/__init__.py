"""GPU telemetry backends behind one snapshot shape (fleet_core/telemetry.py), and the one thing
the agent sets through them: the GPUs' power limit (the fleet's cap valve, docs/power.md)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class PowerLimitUnsupported(RuntimeError):
    """This backend or these GPUs cannot set a power limit (dcgm-exporter is read-only, NVML
    without root answers NO_PERMISSION): asking again will not help."""


class PowerLimitFailed(RuntimeError):
    """Setting the limit failed this time (a GPU busy or lost): worth another try."""


@runtime_checkable
class PowerLimitControl(Protocol):
    """A backend that can set every GPU's power limit."""

    def set_power_limit(self, watts: float | None) -> dict[int, float]:
        """Set every GPU's limit to `watts`, clamped to what each board accepts (None: the
        board's default limit). Returns the limit now set per GPU index (watts). Raises
        PowerLimitUnsupported or PowerLimitFailed."""
        ...
