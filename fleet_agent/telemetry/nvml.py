"""NVML telemetry: the production path on a GPU server (nvidia-ml-py's `pynvml` module).

One `NvmlTelemetry` holds NVML open for the agent's life: `nvmlInit()` once, device handles and
their identity (name, UUID, PCI bus id) read once, an event set registered for Xid critical
errors, then every `snapshot()` reads each GPU's live fields and drains the event set without
blocking. `close()` frees the event set and calls `nvmlShutdown()`.

Failure rules (docs/telemetry.md):
- no driver / no libnvidia-ml.so at start: `TelemetryUnavailable` with one clear line;
- a field a GPU cannot report (NOT_SUPPORTED, NO_PERMISSION): None, remembered per GPU so it is
  not asked again, and named in every snapshot's notes;
- GPU_IS_LOST / UNKNOWN from a device: that GPU's sample is `lost=True` (identity kept);
- any other NVML error on a field: None for this snapshot only, with a note; asked again next time.

Power limits (the fleet's cap valve, docs/power.md): `set_power_limit(watts)` sets every GPU's
limit with nvmlDeviceSetPowerManagementLimit (milliwatts, root only), clamped to
nvmlDeviceGetPowerManagementLimitConstraints; None restores nvmlDeviceGetPowerManagementDefault-
Limit. The snapshot's power_limit_w is nvmlDeviceGetEnforcedPowerLimit, what the board enforces.

The pynvml module is injectable so tests can pass a stand-in built from nvidia-ml-py's own
structures, constants and exception classes (tests/nvml_standin.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from fleet_agent.telemetry import PowerLimitFailed, PowerLimitUnsupported
from fleet_core.telemetry import GpuSample, Snapshot, TelemetryUnavailable, XidEvent

UNAVAILABLE = (
    "NVML is not available here (no NVIDIA driver/libnvidia-ml.so): "
    "use --telemetry dcgm or simulated"
)
_MIB = 1024 * 1024
# A storm of Xids must not keep one snapshot draining forever; the rest wait for the next one.
_MAX_EVENTS_PER_SNAPSHOT = 256

T = TypeVar("T")


class _GpuLost(Exception):
    """A device answered GPU_IS_LOST or UNKNOWN: its whole sample becomes lost=True."""


@dataclass
class _Device:
    index: int
    handle: Any = None  # pynvml's c_nvmlDevice_t; None until NVML hands one out
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None

    def lost(self) -> GpuSample:
        return GpuSample(
            index=self.index, uuid=self.uuid, name=self.name, pci_bus_id=self.pci_bus_id, lost=True
        )


def _import_pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise TelemetryUnavailable(
            "nvidia-ml-py is not installed (pip install nvidia-ml-py): "
            "use --telemetry dcgm or simulated"
        ) from exc


def _errors(nvml: ModuleType, *names: str) -> tuple[type[BaseException], ...]:
    """The named NVMLError_* classes this pynvml version has (older ones lack a few)."""
    found = (getattr(nvml, name, None) for name in names)
    return tuple(cls for cls in found if isinstance(cls, type) and issubclass(cls, BaseException))


def _text(value: object) -> str:
    """pynvml returns str or bytes for strings depending on its version."""
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def _address(handle: object) -> int | None:
    """A device handle's pointer value: how an event's `device` is matched to a GPU index
    (ctypes pointers compare by identity, not by address)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[arg-type]
    except (ctypes.ArgumentError, TypeError):
        return None


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__


class NvmlTelemetry:
    name = "nvml"

    def __init__(
        self, nvml: ModuleType | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._nvml = nvml if nvml is not None else _import_pynvml()
        self._clock = clock
        m = self._nvml
        self._base_error = _errors(m, "NVMLError")
        self._lost_errors = _errors(m, "NVMLError_GpuIsLost", "NVMLError_Unknown")
        self._unsupported_errors = _errors(m, "NVMLError_NotSupported", "NVMLError_NoPermission")
        # The binding has the call but the installed driver does not: use the older call.
        self._missing_errors = _errors(
            m, "NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch"
        )
        self._timeout_errors = _errors(m, "NVMLError_Timeout")
        # (field, GPU index) -> why it cannot be read; never asked again.
        self._unsupported: dict[tuple[str, int], str] = {}
        self._use_temperature_v = hasattr(m, "nvmlDeviceGetTemperatureV")
        self._use_clocks_event = hasattr(m, "nvmlDeviceGetCurrentClocksEventReasons")
        self._event_set: Any = None
        self._event_notes: list[str] = []
        self._closed = False
        self._start()
        # A handle's pointer value -> its device: how an Xid event's `device` finds its GPU.
        self._by_address: dict[int | None, _Device] = {}
        try:
            self.driver_version = self._driver_version()
            self._devices = self._open_devices()
            self._open_events()
        except BaseException:
            self._shutdown()
            raise

    # ---- start and stop ---------------------------------------------------------------------

    def _start(self) -> None:
        m = self._nvml
        not_here = _errors(m, "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
        try:
            m.nvmlInit()
        except not_here as exc:
            raise TelemetryUnavailable(UNAVAILABLE) from exc
        except self._base_error as exc:  # e.g. LIB_RM_VERSION_MISMATCH after a driver upgrade
            raise TelemetryUnavailable(
                f"NVML did not start: {exc} ({_error_name(exc)}): "
                "fix the driver or use --telemetry dcgm or simulated"
            ) from exc

    def _driver_version(self) -> str | None:
        try:
            return _text(self._nvml.nvmlSystemGetDriverVersion())
        except self._base_error:
            return None

    def _open_devices(self) -> list[_Device]:
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
        except self._base_error as exc:
            raise TelemetryUnavailable(
                f"NVML started but cannot count the GPUs: {exc} ({_error_name(exc)})"
            ) from exc
        devices = [_Device(index=i) for i in range(count)]
        for device in devices:
            with contextlib.suppress(_GpuLost):  # every snapshot reports it lost, tries again
                self._attach(device, [])
        return devices

    def _attach(self, device: _Device, notes: list[str]) -> bool:
        """Get a handle and the identity, which never change while the driver is loaded.
        Raises _GpuLost for a GPU that is gone; False when NVML refuses a handle otherwise."""
        m = self._nvml
        try:
            device.handle = m.nvmlDeviceGetHandleByIndex(device.index)
        except self._lost_errors as exc:
            raise _GpuLost from exc
        except self._base_error as exc:
            notes.append(f"GPU {device.index}: no NVML handle ({_error_name(exc)})")
            return False
        self._by_address[_address(device.handle)] = device
        device.name = self._field(device, "name", lambda h: _text(m.nvmlDeviceGetName(h)), notes)
        device.uuid = self._field(device, "uuid", lambda h: _text(m.nvmlDeviceGetUUID(h)), notes)
        device.pci_bus_id = self._field(
            device, "pci_bus_id", lambda h: _text(m.nvmlDeviceGetPciInfo(h).busId), notes
        )
        return True

    def _open_events(self) -> None:
        """One event set for Xid critical errors on every GPU that supports them."""
        m = self._nvml
        try:
            self._event_set = m.nvmlEventSetCreate()
        except self._base_error as exc:
            self._event_notes.append(f"no Xid events from NVML: event set ({_error_name(exc)})")
            return
        refused: list[int] = []
        for device in self._devices:
            if device.handle is None:
                continue
            try:
                m.nvmlDeviceRegisterEvents(
                    device.handle, m.nvmlEventTypeXidCriticalError, self._event_set
                )
            except self._base_error:
                refused.append(device.index)
        if refused:
            self._event_notes.append(f"no Xid events from NVML on GPU {_indexes(refused)}")

    def close(self) -> None:
        if self._closed:
            return
        if self._event_set is not None:
            with contextlib.suppress(*self._base_error):  # shutting down anyway
                self._nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        with contextlib.suppress(*self._base_error):  # nothing left to release
            self._nvml.nvmlShutdown()

    # ---- snapshot ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        if self._closed:
            raise RuntimeError("NvmlTelemetry is closed")
        at = self._clock()
        notes: list[str] = []
        gpus = tuple(self._sample(device, notes) for device in self._devices)
        xids = self._drain_xids(at, notes)
        return Snapshot(
            at=at,
            backend=self.name,
            gpus=gpus,
            xids=xids,
            driver_version=self.driver_version,
            notes=(*self._unsupported_notes(), *self._event_notes, *notes),
        )

    def _sample(self, device: _Device, notes: list[str]) -> GpuSample:
        try:
            if device.handle is None and not self._attach(device, notes):
                return GpuSample(index=device.index)  # unreadable, not known to be gone
            return self._read_gpu(device, notes)
        except _GpuLost:
            return device.lost()

    def _read_gpu(self, device: _Device, notes: list[str]) -> GpuSample:
        m = self._nvml

        def read(name: str, call: Callable[[Any], T]) -> T | None:
            return self._field(device, name, call, notes)

        def threshold(name: str, kind: int) -> float | None:
            return read(name, lambda h: float(m.nvmlDeviceGetTemperatureThreshold(h, kind)))

        memory = read("memory", m.nvmlDeviceGetMemoryInfo)
        remap = read("remapped_rows", lambda h: tuple(m.nvmlDeviceGetRemappedRows(h)))
        power_mw = read("power", lambda h: int(m.nvmlDeviceGetPowerUsage(h)))
        limit_mw = read("power_limit", lambda h: int(m.nvmlDeviceGetEnforcedPowerLimit(h)))
        return GpuSample(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            pci_bus_id=device.pci_bus_id,
            temperature_c=read("temperature", self._temperature),
            slowdown_temp_c=threshold("slowdown_temp", m.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            shutdown_temp_c=threshold("shutdown_temp", m.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            max_operating_temp_c=threshold(
                "max_operating_temp", m.NVML_TEMPERATURE_THRESHOLD_GPU_MAX
            ),
            memory_used_mib=None if memory is None else int(memory.used) // _MIB,
            memory_total_mib=None if memory is None else int(memory.total) // _MIB,
            utilization_pct=read(
                "utilization", lambda h: float(m.nvmlDeviceGetUtilizationRates(h).gpu)
            ),
            power_w=None if power_mw is None else power_mw / 1000,
            power_limit_w=None if limit_mw is None else limit_mw / 1000,
            ecc_uncorrected_volatile=read("ecc_uncorrected_volatile", self._ecc_uncorrected),
            remapped_rows_correctable=None if remap is None else int(remap[0]),
            remapped_rows_uncorrectable=None if remap is None else int(remap[1]),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failed=None if remap is None else bool(remap[3]),
            clock_events=read("clock_events", self._clock_events),
        )

    def _field(
        self, device: _Device, name: str, call: Callable[[Any], T], notes: list[str]
    ) -> T | None:
        """One guarded NVML call for one field of one GPU."""
        key = (name, device.index)
        if key in self._unsupported:
            return None
        try:
            return call(device.handle)
        except self._lost_errors as exc:
            raise _GpuLost from exc
        except self._unsupported_errors as exc:
            self._unsupported[key] = _error_name(exc)
            return None
        except self._base_error as exc:
            notes.append(f"GPU {device.index}: {name} unread this time ({_error_name(exc)})")
            return None

    # Calls with an older fallback: the newer one is preferred while the driver has it.

    def _temperature(self, handle: Any) -> float:
        m = self._nvml
        if self._use_temperature_v:
            try:
                return float(m.nvmlDeviceGetTemperatureV(handle, m.NVML_TEMPERATURE_GPU))
            except self._missing_errors:
                self._use_temperature_v = False
        return float(m.nvmlDeviceGetTemperature(handle, m.NVML_TEMPERATURE_GPU))

    def _clock_events(self, handle: Any) -> int:
        m = self._nvml
        if self._use_clocks_event:
            try:
                return int(m.nvmlDeviceGetCurrentClocksEventReasons(handle))
            except self._missing_errors:
                self._use_clocks_event = False
        return int(m.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    def _ecc_uncorrected(self, handle: Any) -> int:
        m = self._nvml
        return int(
            m.nvmlDeviceGetTotalEccErrors(
                handle, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC
            )
        )

    def _unsupported_notes(self) -> list[str]:
        """One line per (field, reason): 'remapped_rows: NVMLError_NotSupported on GPU 3'."""
        grouped: dict[tuple[str, str], list[int]] = {}
        for (name, index), reason in self._unsupported.items():
            grouped.setdefault((name, reason), []).append(index)
        return [
            f"{name}: {reason} on GPU {_indexes(indexes)}"
            for (name, reason), indexes in sorted(grouped.items())
        ]

    # ---- power limit ------------------------------------------------------------------------

    def set_power_limit(self, watts: float | None) -> dict[int, float]:
        """Every reachable GPU's power limit to `watts` (None: its default), clamped to the
        board's constraints. Returns GPU index → the limit set (watts). Raises
        PowerLimitUnsupported when no GPU accepts a limit (NO_PERMISSION: the agent is not
        root; NOT_SUPPORTED), PowerLimitFailed when some GPU failed otherwise (the others are
        set; asking again is worth it). A lost GPU is skipped."""
        if self._closed:
            raise RuntimeError("NvmlTelemetry is closed")
        m = self._nvml
        done: dict[int, float] = {}
        refused: list[str] = []
        failed: list[str] = []
        for device in self._devices:
            if device.handle is None:
                continue  # never attached: snapshots report it, there is nothing to limit
            h = device.handle
            try:
                if watts is None:
                    target = int(m.nvmlDeviceGetPowerManagementDefaultLimit(h))
                else:
                    low, high = (int(v) for v in m.nvmlDeviceGetPowerManagementLimitConstraints(h))
                    target = min(high, max(low, round(watts * 1000)))
                m.nvmlDeviceSetPowerManagementLimit(h, target)
            except self._lost_errors:
                continue  # a lost GPU draws nothing to limit; the fault policy has it
            except self._unsupported_errors as exc:
                refused.append(f"GPU {device.index}: {_error_name(exc)}")
                continue
            except self._base_error as exc:  # GPU_IS_LOST among them: that GPU is not set
                failed.append(f"GPU {device.index}: {_error_name(exc)}")
                continue
            done[device.index] = target / 1000
        if refused and not done and not failed:
            raise PowerLimitUnsupported("NVML refused the power limit: " + "; ".join(refused))
        if refused or failed:
            raise PowerLimitFailed(
                f"power limit set on GPU {_indexes(list(done)) or 'none'}; not on "
                + "; ".join(refused + failed)
            )
        return done

    # ---- Xid events -------------------------------------------------------------------------

    def _drain_xids(self, at: float, notes: list[str]) -> tuple[XidEvent, ...]:
        """Everything queued since the last snapshot, without waiting (timeout 0)."""
        if self._event_set is None:
            return ()
        m = self._nvml
        wait = getattr(m, "nvmlEventSetWait_v2", None) or m.nvmlEventSetWait
        events: list[XidEvent] = []
        for _ in range(_MAX_EVENTS_PER_SNAPSHOT):
            try:
                data = wait(self._event_set, 0)
            except self._timeout_errors:
                break  # drained
            except self._base_error as exc:
                notes.append(f"Xid events unread this time ({_error_name(exc)})")
                break
            if int(data.eventType) & int(m.nvmlEventTypeXidCriticalError):
                events.append(self._xid_event(data, at))
        return tuple(events)

    def _xid_event(self, data: Any, at: float) -> XidEvent:
        device = self._by_address.get(_address(data.device))
        return XidEvent(
            xid=int(data.eventData),
            at=at,
            gpu_index=None if device is None else device.index,
            pci_bus_id=None if device is None else device.pci_bus_id,
            message="NVML Xid critical error event",
            source=self.name,
        )


def _indexes(indexes: list[int]) -> str:
    return ", ".join(str(i) for i in sorted(indexes))
