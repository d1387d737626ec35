"""One snapshot shape for every GPU telemetry backend (NVML, DCGM, simulated).

A backend reads every GPU of the server at once and returns a `Snapshot`: plain, frozen data
the fault policy (fleet_core/fault_policy.py), the agent's `/state` and `/metrics`, and the fleet's
heartbeat all consume. A field a GPU or backend cannot report is None, never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntFlag
from typing import Literal, Protocol, get_args

# Faults the SIMULATED backend can be given (fleet_agent/telemetry/simulated.py says what each
# does): the lab's fault file, `fleetctl lab fault` and the agent's /faults all name them so.
FaultKind = Literal[
    "xid",
    "ecc_uncorrected",
    "remap_pending",
    "remap_failed",
    "temperature_ramp",
    "clock_events",
    "gpu_lost",
    "clear",
]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class ClockEvent(IntFlag):
    """NVML clocks-event ("throttle") reasons, nvmlClocksEventReason* (nvml.h)."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL_SLOWDOWN = 0x20
    HW_THERMAL_SLOWDOWN = 0x40
    HW_POWER_BRAKE_SLOWDOWN = 0x80
    DISPLAY_CLOCK_SETTING = 0x100


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one moment."""

    index: int
    uuid: str | None = None
    name: str | None = None  # as the driver names it, e.g. "NVIDIA H100 80GB HBM3"
    pci_bus_id: str | None = None  # "00000000:3B:00.0"
    temperature_c: float | None = None
    # Thresholds the GPU reports (NVML TEMPERATURE_THRESHOLD_SLOWDOWN / _SHUTDOWN / _GPU_MAX).
    slowdown_temp_c: float | None = None
    shutdown_temp_c: float | None = None
    max_operating_temp_c: float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    utilization_pct: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    # ECC: uncorrected errors since the driver loaded (volatile counter).
    ecc_uncorrected_volatile: int | None = None
    # Row remapping (A100 and later): rows remapped so far, a remap waiting for a GPU reset,
    # and a remap that failed (no spare rows left).
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    clock_events: int | None = None  # a ClockEvent bit mask
    lost: bool = False  # the GPU stopped answering (fell off the bus, NVML GPU_IS_LOST)


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An NVIDIA driver Xid error, from NVML's event set, the kernel log, or DCGM."""

    xid: int
    at: float  # seconds since the epoch
    gpu_index: int | None = None
    pci_bus_id: str | None = None
    message: str = ""
    source: str = ""  # "nvml", "kmsg", "dcgm", "simulated"


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float  # seconds since the epoch
    backend: str
    gpus: tuple[GpuSample, ...] = ()
    # Xid events that arrived since the previous snapshot of this backend.
    xids: tuple[XidEvent, ...] = ()
    driver_version: str | None = None
    notes: tuple[str, ...] = field(default=())  # e.g. fields this backend cannot read


class TelemetryUnavailable(RuntimeError):
    """This backend cannot run on this machine (no NVIDIA driver, no dcgm-exporter): a clear
    refusal to start, naming what is missing."""


class GpuTelemetry(Protocol):
    name: str

    def snapshot(self) -> Snapshot:
        """Read every GPU now; new Xid events since the last call are included once."""
        ...

    def close(self) -> None: ...
