"""GPU models the fleet knows: the built-in ones, and how an inventory adds its own.

The built-ins are fleet_core.gpus's table (published figures, docs/hardware.md "GPUs"). An
inventory may add models of its own (`gpu_models:`, stored as GpuModelSpec rows); a server whose
GPU model is in neither is rejected, because placement, power and the engine cost model all need
these numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet_core.gpus import GPUS, GpuSpec

# Built-in models by name ("H100", "H200", "L40S"): inventory-added ones may not reuse a name.
BUILTIN: Mapping[str, GpuSpec] = GPUS
