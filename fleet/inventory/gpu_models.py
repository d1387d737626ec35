"""GPU models the fleet knows, with published figures (docs/hardware.md, vendor datasheets).

An inventory may add models of its own (`gpu_models:`); a server whose GPU model is in neither
is rejected, because placement, power and the engine cost model all need these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_mib: int  # usable memory as NVML reports it
    tdp_w: float
    idle_w: float
    hbm_tb_s: float
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense


# Usable memory and idle draw are NVML readings on real boards; TDP, bandwidth and TFLOPS are
# NVIDIA datasheet figures (H100 SXM, H200 SXM, L40S).
BUILTIN: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            "H100",
            memory_mib=81_559,
            tdp_w=700,
            idle_w=70,
            hbm_tb_s=3.35,
            bf16_tflops=989,
            fp8_tflops=1_979,
        ),
        GpuSpec(
            "H200",
            memory_mib=143_771,
            tdp_w=700,
            idle_w=76,
            hbm_tb_s=4.8,
            bf16_tflops=989,
            fp8_tflops=1_979,
        ),
        GpuSpec(
            "L40S",
            memory_mib=46_068,
            tdp_w=350,
            idle_w=28,
            hbm_tb_s=0.864,
            bf16_tflops=362,
            fp8_tflops=733,
        ),
    )
}
