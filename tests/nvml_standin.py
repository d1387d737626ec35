"""A STAND-IN pynvml module for tests: no GPU, no driver.

Everything that does not call libnvidia-ml.so is nvidia-ml-py's own: the NVML_* constants, the
ctypes structures (c_nvmlMemory_t, c_nvmlUtilization_t, nvmlPciInfo_t, c_nvmlEventData_t), the
device and event-set handle types, and the NVMLError_* classes, raised the way pynvml raises
them (`pynvml.NVMLError(code)` returns the subclass). Only the functions that would call the C
library are replaced, by methods answering from `FakeGpu` data (8 H100 SXM GPUs by default).

Calls are recorded so tests can check what was (not) asked again.
"""

from __future__ import annotations

import ctypes
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pynvml  # type: ignore[import-untyped]

MIB = 1024 * 1024
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEMORY_MIB = 81_559  # what NVML reports as total for an H100 80GB HBM3
H100_TDP_MW = 700_000
DRIVER_VERSION = "550.54.15"
# PCI addresses of the 8 GPUs of a typical HGX H100 baseboard.
HGX_BUS_IDS = (
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
)
_HANDLE_BASE = 0x7F00_0000_1000  # fake device pointers: never dereferenced, only compared


@dataclass
class FakeGpu:
    index: int
    uuid: str
    pci_bus_id: str
    name: str = H100_NAME
    temperature_c: int = 31
    slowdown_temp_c: int = 89
    shutdown_temp_c: int = 92
    max_operating_temp_c: int = 87
    memory_used_mib: int = 529  # nvmlMemory_t v1 counts the driver's reservation as used
    memory_total_mib: int = H100_MEMORY_MIB
    utilization_pct: int = 0
    power_mw: int = 70_315  # idle
    power_limit_mw: int = H100_TDP_MW  # enforced (nvmlDeviceGetEnforcedPowerLimit)
    power_limit_default_mw: int = H100_TDP_MW
    power_limit_constraints_mw: tuple[int, int] = (200_000, H100_TDP_MW)  # DGX H100 user guide
    ecc_uncorrected_volatile: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failure
    clock_reasons: int = 0x1  # nvmlClocksEventReasonGpuIdle
    lost: bool = False  # every device call answers GPU_IS_LOST
    # pynvml function name -> NVML_ERROR_* code that call answers on this GPU.
    errors: dict[str, int] = field(default_factory=dict)


def eight_h100s() -> list[FakeGpu]:
    """Six GPUs serving a model, two idle."""
    gpus = []
    for i, bus_id in enumerate(HGX_BUS_IDS):
        gpu = FakeGpu(
            index=i, uuid=f"GPU-5c3e{i:04x}-8d1f-4b2a-9e6c-0d4f1a2b{i:04x}", pci_bus_id=bus_id
        )
        if i < 6:
            gpu.temperature_c = 58 + i
            gpu.memory_used_mib = 74_211
            gpu.utilization_pct = 87
            gpu.power_mw = 512_480 + 1000 * i
            gpu.clock_reasons = 0x0
        gpus.append(gpu)
    return gpus


class NvmlStandIn(types.ModuleType):
    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        driver_version: str = DRIVER_VERSION,
        init_error: int | None = None,
        count_error: int | None = None,
        temperature_v: bool = False,
        temperature_v_error: int | None = None,
        clocks_event_reasons: bool = True,
    ) -> None:
        super().__init__("pynvml_standin")
        # nvidia-ml-py's constants, structures, handle types and exception classes, as they are.
        for name, value in vars(pynvml).items():
            if not name.startswith("__") and not isinstance(value, types.FunctionType):
                setattr(self, name, value)
        self.gpus = gpus if gpus is not None else eight_h100s()
        self.driver_version = driver_version
        self.init_error = init_error
        self.count_error = count_error
        self.temperature_v_error = temperature_v_error
        self.calls: list[tuple[str, int | None]] = []
        self.wait_timeouts: list[int] = []
        self.initialized = 0
        self.registered: set[int] = set()
        self.pending: deque[tuple[int, int, int]] = deque()  # (gpu index, event type, data)
        self.event_sets_freed = 0
        # Newer calls exist only where the module (nvidia-ml-py version) has them.
        if temperature_v:
            self.nvmlDeviceGetTemperatureV = self._temperature_v
        if clocks_event_reasons:
            self.nvmlDeviceGetCurrentClocksEventReasons = self._clocks_event_reasons

    # ---- test helpers -----------------------------------------------------------------------

    def count(self, function: str, index: int | None = None) -> int:
        return sum(1 for f, i in self.calls if f == function and (index is None or i == index))

    def push_xid(self, index: int, xid: int) -> None:
        """The driver reports an Xid on a GPU: queued for every event set that registered it."""
        self.pending.append((index, pynvml.nvmlEventTypeXidCriticalError, xid))

    def handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(_HANDLE_BASE + 0x100 * index), pynvml.c_nvmlDevice_t)

    def _device(self, function: str, handle: Any) -> FakeGpu:
        address = ctypes.cast(handle, ctypes.c_void_p).value or 0
        gpu = self.gpus[(address - _HANDLE_BASE) // 0x100]
        self.calls.append((function, gpu.index))
        self._check_init()
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.errors:
            raise pynvml.NVMLError(gpu.errors[function])
        return gpu

    def _check_init(self) -> None:
        if self.initialized <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    # ---- library ----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append(("nvmlInit", None))
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.calls.append(("nvmlShutdown", None))
        self._check_init()
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handle(index)

    # ---- device fields ----------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._device("nvmlDeviceGetPciInfo", handle)
        info = pynvml.nvmlPciInfo_t()
        domain, bus, rest = gpu.pci_bus_id.split(":")
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id[4:].encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        info.pciDeviceId = 0x233010DE  # H100 SXM5 80GB
        return info

    def _temperature_v(self, handle: Any, sensor: int, version: int = 0) -> int:
        gpu = self._device("nvmlDeviceGetTemperatureV", handle)
        if self.temperature_v_error is not None:
            raise pynvml.NVMLError(self.temperature_v_error)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return gpu.temperature_c

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._device("nvmlDeviceGetTemperature", handle)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return gpu.temperature_c

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        gpu = self._device("nvmlDeviceGetTemperatureThreshold", handle)
        thresholds = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: gpu.slowdown_temp_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: gpu.shutdown_temp_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: gpu.max_operating_temp_c,
        }
        if threshold not in thresholds:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return thresholds[threshold]

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        memory = pynvml.c_nvmlMemory_t()
        memory.total = gpu.memory_total_mib * MIB
        memory.used = gpu.memory_used_mib * MIB
        memory.free = memory.total - memory.used
        return memory

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._device("nvmlDeviceGetUtilizationRates", handle)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = gpu.utilization_pct
        rates.memory = gpu.utilization_pct // 2
        return rates

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any) -> list[int]:
        gpu = self._device("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        return list(gpu.power_limit_constraints_mw)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        return self._device(
            "nvmlDeviceGetPowerManagementDefaultLimit", handle
        ).power_limit_default_mw

    def nvmlDeviceSetPowerManagementLimit(self, handle: Any, limit: int) -> None:
        gpu = self._device("nvmlDeviceSetPowerManagementLimit", handle)
        low, high = gpu.power_limit_constraints_mw
        if not low <= limit <= high:  # as the driver answers an out-of-range limit
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu.power_limit_mw = limit

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._device("nvmlDeviceGetTotalEccErrors", handle)
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        return gpu.ecc_uncorrected_volatile

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._device("nvmlDeviceGetRemappedRows", handle).remapped_rows

    def _clocks_event_reasons(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_reasons

    # ---- events -----------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self._check_init()
        return ctypes.cast(ctypes.c_void_p(0x7F00_0000_0010), pynvml.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        gpu = self._device("nvmlDeviceRegisterEvents", handle)
        assert event_types == pynvml.nvmlEventTypeXidCriticalError
        self.registered.add(gpu.index)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        self._check_init()
        self.wait_timeouts.append(timeout_ms)
        while self.pending:
            index, event_type, value = self.pending.popleft()
            if index in self.registered:
                data = pynvml.c_nvmlEventData_t()
                data.device = self.handle(index)
                data.eventType = event_type
                data.eventData = value
                return data
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._check_init()
        self.event_sets_freed += 1
