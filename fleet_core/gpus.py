"""The GPU models the fleet knows: one table of published figures, read by every side.

Figures from docs/hardware.md, "GPUs": bandwidth, TFLOPS and TDP from NVIDIA's H100, H200 and
L40S datasheets; usable memory and the idle draw range are NVML readings on real boards; the
lowest power limit from NVIDIA's DGX H100/H200 user guide (L40S: an assumption). The
inventory (fleet/inventory/gpu_models.py: memory for placement), the engine cost model
(fleet_core/cost_model.py) and the simulated telemetry (fleet_agent/telemetry/simulated.py) all
read this table. Pure data: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Precision = Literal["fp8", "bf16"]
Interconnect = Literal["nvlink", "pcie"]

MIB = 2**20


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model, as docs/hardware.md's "GPUs" table gives it."""

    model: str  # the fleet's name for it: inventories, deployments and scenarios use it
    name: str  # the datasheet's name (e.g. "H100 SXM")
    memory_spec_gb: float
    memory_mib: int  # usable memory as NVML reports it
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense, FLOP/s
    fp8_flops: float  # dense, FLOP/s
    tdp_w: float
    idle_w: tuple[float, float]  # observed idle draw range (low, high)
    interconnect: Interconnect
    # The lowest power limit the board accepts (NVML's power-limit constraints); the highest is
    # tdp_w, also the default limit. H100/H200: the DGX H100/H200 user guide's Redfish
    # PowerLimitWatts (AllowableMin 200, DefaultSetPoint 700). L40S: an assumption (no published
    # figure found), a bit under a third of its TDP.
    power_limit_min_w: float = 200.0

    @property
    def memory_usable_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def idle_mid_w(self) -> float:
        """The middle of the observed idle range: where one figure is needed (energy sums)."""
        return sum(self.idle_w) / 2

    def flops(self, precision: Precision) -> float:
        return self.fp8_flops if precision == "fp8" else self.bf16_flops


GPUS: Mapping[str, GpuSpec] = MappingProxyType(
    {
        spec.model: spec
        for spec in (
            GpuSpec(
                model="H100",
                name="H100 SXM",
                memory_spec_gb=80,
                memory_mib=81_559,
                hbm_bandwidth=3.35e12,
                bf16_flops=989e12,
                fp8_flops=1979e12,
                tdp_w=700.0,
                idle_w=(67.0, 73.0),
                interconnect="nvlink",
            ),
            GpuSpec(
                model="H200",
                name="H200",
                memory_spec_gb=141,
                memory_mib=143_771,
                hbm_bandwidth=4.8e12,
                bf16_flops=989e12,
                fp8_flops=1979e12,
                tdp_w=700.0,
                idle_w=(73.0, 79.0),
                interconnect="nvlink",
            ),
            GpuSpec(
                model="L40S",
                name="L40S",
                memory_spec_gb=48,
                memory_mib=46_068,
                hbm_bandwidth=0.864e12,
                bf16_flops=362e12,
                fp8_flops=733e12,
                tdp_w=350.0,
                idle_w=(22.0, 33.0),
                interconnect="pcie",
                power_limit_min_w=100.0,
            ),
        )
    }
)


def gpu_spec(name: str) -> GpuSpec:
    """ "H100", "h100-sxm", "H200", "L40S" (case-insensitive) → the GPU's spec."""
    key = name.strip().upper().replace("-SXM", "").replace(" SXM", "")
    try:
        return GPUS[key]
    except KeyError:
        raise ValueError(f"unknown GPU model {name!r}; known: {', '.join(GPUS)}") from None
