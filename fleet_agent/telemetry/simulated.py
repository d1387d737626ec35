"""Simulated GPU telemetry: a STAND-IN used only where no GPU exists.

The demo, the virtual colo and the tests run the node agent on machines without NVIDIA GPUs;
`SimulatedTelemetry` gives them snapshots in the same shape as the NVML backend, with believable
per-model values and a way to inject the faults the fault policy must react to. Nothing here is
used on a real GPU server.

Fault kinds (`Fault.kind`), each on one GPU:
    xid               `count` XidEvents in the next snapshot only, as the driver would log them
    ecc_uncorrected   adds `count` to the volatile uncorrected-ECC counter (held)
    remap_pending     a row remap waits for a GPU reset (held)
    remap_failed      a remap failed; also one more uncorrectable remapped row (held)
    temperature_ramp  temperature moves linearly to `target_c` at `rate_c_per_s` and stays;
                      at or over the slowdown threshold the thermal clock-event bits are set
    clock_events      `bits` ORed into the reported clock-event reasons (held)
    gpu_lost          listed, `lost=True`, no readings, as NVML after GPU_IS_LOST (held)
    clear             what a GPU reset and driver reload do (see `SimulatedTelemetry.clear`);
                      `gpu=ALL_GPUS` (from_dict's default for "clear") clears every GPU

Power: each GPU draws what the stand-in engine running on it reports through the shared state
directory (fleet_agent/telemetry/sim_gpu_state.py: power from the phase-aware power model of
fleet_core/power_model.py, utilisation, memory); without a fresh report it follows the `load()`
callable (0..1, idle by default). `set_power_limit()` is the simulated nvmlDeviceSetPower-
ManagementLimit: clamped to the board's range like NVML, reported as power_limit_w, never
exceeded by the reported power, and written to the state directory so the engines slow down.

Faults arrive through `inject()`/`clear()` (in-process callers, the agent's /faults endpoint,
tests) or through a JSON fault file that the virtual colo writes and this backend re-reads when
its mtime or size changes. Each id is applied once, so an Xid fires once though the file stays:

    {"faults": [{"id": "f1", "kind": "xid", "gpu": 3, "xid": 79},
                {"id": "f2", "kind": "temperature_ramp", "gpu": 0, "rate_c_per_s": 2}]}
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fleet_agent.telemetry import sim_gpu_state
from fleet_agent.telemetry.sim_gpu_state import GpuActivity
from fleet_core.gpus import GPUS
from fleet_core.telemetry import (
    FAULT_KINDS,
    ClockEvent,
    FaultKind,
    GpuSample,
    Snapshot,
    XidEvent,
)

log = logging.getLogger(__name__)

# Every bit NVML defines; a fault may only set these.
_CLOCK_EVENT_MASK = sum(bit.value for bit in ClockEvent)
THERMAL_SLOWDOWN_BITS = int(ClockEvent.HW_THERMAL_SLOWDOWN | ClockEvent.SW_THERMAL_SLOWDOWN)

# A stand-in driver version (a real R550 release string), so consumers see the usual shape.
DRIVER_VERSION = "550.54.15"
# Bounds on the fault file so a runaway writer cannot make the agent parse forever.
MAX_FAULT_FILE_BYTES = 1 << 20
MAX_FAULTS_PER_FILE = 1000
# `Fault.gpu` of a "clear" that names no GPU (what from_dict gives when "gpu" is absent).
ALL_GPUS = -1
# An engine's activity report older than this: the engine stopped (or hangs), the GPU idles.
ACTIVITY_MAX_AGE_S = 3.0


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Per-model figures the simulator draws from."""

    name: str  # as the driver names it
    memory_total_mib: int
    tdp_w: float
    idle_w: tuple[float, float]  # range; each simulated GPU draws its own idle power from it
    idle_temp_c: tuple[float, float]
    full_load_temp_c: float
    slowdown_temp_c: float
    shutdown_temp_c: float
    max_operating_temp_c: float
    power_limit_min_w: float  # the lowest limit the board accepts; the highest is tdp_w


def _documented(
    model: str,
    *,
    name: str,
    full_load_temp_c: float,
    slowdown_temp_c: float,
    shutdown_temp_c: float,
    max_operating_temp_c: float,
) -> GpuModel:
    """A model of fleet_core.gpus's table: memory, TDP and idle range from there (documented
    figures, docs/hardware.md "GPUs"), temperatures as given (assumptions, see MODELS)."""
    spec = GPUS[model]
    return GpuModel(
        name=name,
        memory_total_mib=spec.memory_mib,
        tdp_w=spec.tdp_w,
        idle_w=spec.idle_w,
        idle_temp_c=(30.0, 35.0),
        full_load_temp_c=full_load_temp_c,
        slowdown_temp_c=slowdown_temp_c,
        shutdown_temp_c=shutdown_temp_c,
        max_operating_temp_c=max_operating_temp_c,
        power_limit_min_w=spec.power_limit_min_w,
    )


# Memory, TDP and idle power: fleet_core.gpus (docs/hardware.md, "GPUs" table). Temperatures
# and thresholds are typical values, an assumption (no published per-model table): idle 30-35
# °C, ~72 °C at full load on a well-cooled server, slowdown 87 / shutdown 92 / max operating 85 °C.
MODELS: dict[str, GpuModel] = {
    "H100": _documented(
        "H100",
        name="NVIDIA H100 80GB HBM3",
        full_load_temp_c=72.0,
        slowdown_temp_c=87.0,
        shutdown_temp_c=92.0,
        max_operating_temp_c=85.0,
    ),
    "H200": _documented(
        "H200",
        name="NVIDIA H200",
        full_load_temp_c=73.0,
        slowdown_temp_c=87.0,
        shutdown_temp_c=92.0,
        max_operating_temp_c=85.0,
    ),
    # L40S thresholds are an assumption (passively cooled PCIe card, trips a little higher).
    "L40S": _documented(
        "L40S",
        name="NVIDIA L40S",
        full_load_temp_c=75.0,
        slowdown_temp_c=92.0,
        shutdown_temp_c=95.0,
        max_operating_temp_c=89.0,
    ),
    # A100 SXM4 80GB: not in docs/hardware.md, so every figure here is an assumption: 81,920 MiB
    # spec, 81,251 MiB usable (as nvidia-smi reports on R5xx drivers), 400 W TDP, idle ~50-60 W,
    # lowest power limit 100 W.
    "A100": GpuModel(
        name="NVIDIA A100-SXM4-80GB",
        memory_total_mib=81_251,
        tdp_w=400.0,
        idle_w=(50.0, 60.0),
        idle_temp_c=(30.0, 35.0),
        full_load_temp_c=70.0,
        slowdown_temp_c=89.0,
        shutdown_temp_c=92.0,
        max_operating_temp_c=85.0,
        power_limit_min_w=100.0,
    ),
}

# PCI bus numbers of a DGX H100's eight GPUs as nvidia-smi lists them (assumption, typical);
# further GPUs get the next free bus numbers.
_DGX_BUSES = (0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)
MAX_GPUS = 64

# What the driver prints after "Xid (PCI:...): N, " for the Xids a fleet usually sees.
_XID_TEXT: dict[int, str] = {
    13: "pid=2331, name=python3, Graphics SM Warp Exception on (GPC 4, TPC 0, SM 1): "
    "Out Of Range Address",
    31: "pid=2331, name=python3, Ch 0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS "
    "GPC2 GPCCLIENT_T1_7 faulted @ 0x7f2b_57b30000. Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    43: "pid=2331, name=python3, Ch 00000008",
    45: "pid=2331, name=python3, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x1c000",
    48: "pid=2331, name=python3, An uncorrectable double bit error (DBE) has been detected on "
    "GPU in the framebuffer at partition 0, subpartition 1.",
    63: "pid=0, name=<unknown>, Row Remapper: New row (0x00000000000001e9) marked for "
    "remapping, reset gpu to activate.",
    64: "pid=0, name=<unknown>, Row Remapper: Failed to remap row, all spare rows used.",
    74: "pid=0, name=<unknown>, NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, "
    "0x0, 0x0, 0x0)",
    79: "pid=0, name=<unknown>, GPU has fallen off the bus.",
    92: "pid=0, name=<unknown>, High single-bit ECC error rate",
    94: "pid=2331, name=python3, Contained: SM (0x1). RST: No, D-RST: No",
    95: "pid=2331, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "pid=0, name=<unknown>, Timeout after 6s of waiting for RPC response from GPU0 GSP!",
    120: "pid=0, name=<unknown>, GSP task exception",
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault. Field meanings depend on `kind` (see the module docstring)."""

    kind: FaultKind
    gpu: int = 0  # kind "clear" also takes ALL_GPUS (-1)
    xid: int | None = None  # kind "xid": the Xid number (required)
    count: int = 1  # "ecc_uncorrected": errors added; "xid": how many events
    target_c: float | None = None  # "temperature_ramp": end temperature (default slowdown + 2)
    rate_c_per_s: float = 1.0  # "temperature_ramp": speed, by the injected clock
    bits: int = 0  # "clock_events": ClockEvent bits held set until cleared

    def __post_init__(self) -> None:
        # Checked here too, so a Fault built directly is as safe as one from a file.
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {FAULT_KINDS}")
        if self.kind == "xid" and (self.xid is None or self.xid < 0):
            raise ValueError(f"an 'xid' fault needs a non-negative 'xid' number, got {self.xid!r}")
        if self.count < 1:
            raise ValueError(f"'count' must be at least 1, got {self.count}")
        if not (self.rate_c_per_s > 0 and math.isfinite(self.rate_c_per_s)):
            raise ValueError(f"'rate_c_per_s' must be a positive number, got {self.rate_c_per_s}")
        if self.target_c is not None and not math.isfinite(self.target_c):
            raise ValueError(f"'target_c' must be a finite number, got {self.target_c}")
        if self.bits & ~_CLOCK_EVENT_MASK or self.bits < 0:
            raise ValueError(
                f"'bits' {self.bits:#x} has bits outside ClockEvent ({_CLOCK_EVENT_MASK:#x})"
            )
        if self.kind == "clock_events" and self.bits == 0:
            raise ValueError("a 'clock_events' fault needs non-zero 'bits'")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fault:
        """Build a fault from JSON-like data, with a message naming the bad field.

        An "id" key (the fault file's) is accepted and ignored; any other unknown key is an
        error, so a typo such as "target" for "target_c" is not silently dropped. "bits" may be
        an integer or a list of ClockEvent names (["HW_SLOWDOWN", "SW_POWER_CAP"]).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a fault must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)} - {"id"}
        if unknown:
            raise ValueError(f"unknown fault field(s) {sorted(unknown)}")
        kind = data.get("kind")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        if kind == "xid" and data.get("xid") is None:
            raise ValueError("an 'xid' fault needs an 'xid' number (e.g. 79)")
        xid = data.get("xid")
        target = data.get("target_c")
        # A "clear" without a GPU clears them all; every other kind defaults to GPU 0.
        default_gpu = ALL_GPUS if kind == "clear" else 0
        return cls(
            kind=kind,
            gpu=_int_field(data, "gpu", default_gpu),
            xid=None if xid is None else _int_field(data, "xid", 0),
            count=_int_field(data, "count", 1),
            target_c=None if target is None else _float_field(data, "target_c", 0.0),
            rate_c_per_s=_float_field(data, "rate_c_per_s", 1.0),
            bits=_bits_field(data.get("bits", 0)),
        )


def _int_field(data: Mapping[str, Any], key: str, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"fault field {key!r} must be an integer, got {value!r}")
    return value


def _float_field(data: Mapping[str, Any], key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"fault field {key!r} must be a number, got {value!r}")
    return float(value)


def _bits_field(value: Any) -> int:
    if isinstance(value, list):
        bits = 0
        for name in value:
            if not isinstance(name, str) or name not in ClockEvent.__members__:
                names = sorted(ClockEvent.__members__)
                raise ValueError(f"unknown ClockEvent name {name!r}; expected one of {names}")
            bits |= ClockEvent[name].value
        return bits
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"fault field 'bits' must be an integer or ClockEvent names, got {value!r}"
        )
    return value


@dataclass(slots=True)
class _Ramp:
    start_c: float
    target_c: float
    rate_c_per_s: float
    started_at: float

    def value(self, now: float) -> float:
        moved = self.rate_c_per_s * max(0.0, now - self.started_at)
        gap = self.target_c - self.start_c
        return self.target_c if moved >= abs(gap) else self.start_c + math.copysign(moved, gap)


@dataclass(slots=True)
class _GpuState:
    """One simulated GPU: fixed identity plus the faults it currently holds."""

    index: int
    uuid: str
    pci_bus_id: str
    idle_w: float
    idle_temp_c: float
    power_limit_w: float
    ecc_uncorrected: int = 0
    remapped_rows_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failed: bool = False
    clock_bits: int = 0
    lost: bool = False
    ramp: _Ramp | None = None
    pending_xids: list[XidEvent] = field(default_factory=list)


class SimulatedTelemetry:
    """A STAND-IN GPU telemetry backend for machines without GPUs (demo, virtual colo, tests).

    Values follow the chosen model and the `load()` callable (0..1 utilisation); noise is seeded,
    so two instances with the same seed, clock and load report the same numbers.
    """

    name = "simulated"

    def __init__(
        self,
        model: str = "H100",
        gpus: int = 8,
        *,
        fault_file: Path | None = None,
        clock: Callable[[], float] = time.time,
        load: Callable[[], float] | None = None,
        seed: int = 0,
        state_dir: Path | None = None,
    ) -> None:
        key = model.upper()
        if key not in MODELS:
            raise ValueError(f"unknown GPU model {model!r}; simulated models: {sorted(MODELS)}")
        if not 1 <= gpus <= MAX_GPUS:
            raise ValueError(f"gpus must be between 1 and {MAX_GPUS}, got {gpus}")
        self.model = MODELS[key]
        self._clock = clock
        self._load = load or (lambda: 0.0)
        self._fault_file = fault_file
        self._file_key: tuple[int, int, int] | None = None
        self._applied_ids: set[str] = set()
        self._last_warning: str | None = None
        # Re-entrant: snapshot() holds it while the fault file's faults go through inject().
        self._lock = threading.RLock()
        identity_rng = random.Random(seed)
        # A separate stream for per-snapshot noise, so reading does not shift identities.
        self._noise = random.Random(seed ^ 0x5EED)
        self._gpus = [self._new_gpu(i, identity_rng) for i in range(gpus)]
        # Shared with the stand-in engines (sim_gpu_state): a fresh start has default limits,
        # whatever a previous agent left there.
        self._state_dir = state_dir
        if state_dir is not None:
            sim_gpu_state.write_limits(state_dir, self.power_limits())

    def _new_gpu(self, index: int, rng: random.Random) -> _GpuState:
        return _GpuState(
            index=index,
            uuid="GPU-" + str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            pci_bus_id=f"00000000:{_bus_number(index):02X}:00.0",
            idle_w=round(rng.uniform(*self.model.idle_w), 1),
            idle_temp_c=round(rng.uniform(*self.model.idle_temp_c), 1),
            power_limit_w=self.model.tdp_w,
        )

    # -- power limits --------------------------------------------------------------------------

    def power_limits(self) -> dict[int, float]:
        with self._lock:
            return {state.index: state.power_limit_w for state in self._gpus}

    def set_power_limit(self, watts: float | None) -> dict[int, float]:
        """The simulated nvmlDeviceSetPowerManagementLimit on every GPU: clamped to the board's
        [power_limit_min_w, tdp_w] (None: the default, the TDP). The engines read it from the
        state directory and slow down; reported power never exceeds it."""
        model = self.model
        limit = (
            model.tdp_w
            if watts is None
            else min(model.tdp_w, max(model.power_limit_min_w, float(watts)))
        )
        with self._lock:
            for state in self._gpus:
                if not state.lost:  # NVML cannot set a limit on a lost GPU either
                    state.power_limit_w = limit
            limits = {state.index: state.power_limit_w for state in self._gpus}
            if self._state_dir is not None:
                sim_gpu_state.write_limits(self._state_dir, limits)
        return limits

    # -- fault injection ---------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        """Apply one fault now. ValueError if its GPU index is out of range."""
        if fault.kind == "clear":
            self.clear(None if fault.gpu == ALL_GPUS else fault.gpu)
            return
        with self._lock:
            self._apply(fault, self._gpu(fault.gpu))

    def clear(self, gpu: int | None = None) -> None:
        """Drop held faults (all GPUs, or one) as a GPU reset and driver reload would.

        The volatile ECC counter returns to 0 and a pending remap is activated (no longer
        pending); the remapped-row count persists (it lives in the InfoROM). Xid events already
        raised but not yet reported stay queued: they happened before the reset.
        """
        with self._lock:
            targets = self._gpus if gpu is None else [self._gpu(gpu)]
            for state in targets:
                state.ecc_uncorrected = 0
                state.remap_pending = False
                state.remap_failed = False
                state.clock_bits = 0
                state.lost = False
                state.ramp = None

    def _gpu(self, index: int) -> _GpuState:
        if isinstance(index, bool) or not 0 <= index < len(self._gpus):
            raise ValueError(
                f"GPU index {index} out of range: this server has GPUs 0..{len(self._gpus) - 1}"
            )
        return self._gpus[index]

    def _apply(self, fault: Fault, state: _GpuState) -> None:
        now = self._clock()
        if fault.kind == "xid":
            assert fault.xid is not None  # Fault.__post_init__ guarantees it
            event = self._xid_event(state, fault.xid, now)
            state.pending_xids.extend([event] * fault.count)
        elif fault.kind == "ecc_uncorrected":
            state.ecc_uncorrected += fault.count
        elif fault.kind == "remap_pending":
            state.remap_pending = True
        elif fault.kind == "remap_failed":
            state.remap_failed = True
            state.remapped_rows_uncorrectable += 1
        elif fault.kind == "temperature_ramp":
            target = fault.target_c
            if target is None:
                target = self.model.slowdown_temp_c + 2.0
            start = self._temperature(state, self._current_load(), now, noise=0.0)
            state.ramp = _Ramp(start, target, fault.rate_c_per_s, now)
        elif fault.kind == "clock_events":
            state.clock_bits |= fault.bits
        elif fault.kind == "gpu_lost":
            state.lost = True

    def _xid_event(self, state: _GpuState, xid: int, now: float) -> XidEvent:
        text = _XID_TEXT.get(xid, f"pid=0, name=<unknown>, simulated Xid {xid}")
        return XidEvent(
            xid=xid,
            at=now,
            gpu_index=state.index,
            pci_bus_id=state.pci_bus_id,
            message=f"NVRM: Xid (PCI:{_kernel_pci(state.pci_bus_id)}): {xid}, {text}",
            source="simulated",
        )

    # -- fault file ----------------------------------------------------------------------------

    def _poll_fault_file(self) -> None:
        """Re-read the fault file if it changed; apply faults whose ids are new."""
        if self._fault_file is None:
            return
        try:
            st = self._fault_file.stat()
        except FileNotFoundError:
            self._file_key = None  # no file, no faults; a new file will be read
            return
        except OSError as exc:
            self._file_key = None
            self._warn_once(f"cannot read fault file {self._fault_file}: {exc}")
            return
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._file_key:
            return
        self._file_key = key
        self._last_warning = None
        try:
            entries = self._load_fault_file(st.st_size)
        except (OSError, ValueError) as exc:
            self._warn_once(f"ignoring fault file {self._fault_file}: {exc}")
            return
        # Remember only ids still in the file: bounded, and an id removed then re-added fires again.
        self._applied_ids &= {fault_id for fault_id, _ in entries}
        for fault_id, fault in entries:
            if fault_id in self._applied_ids:
                continue
            self._applied_ids.add(fault_id)
            try:
                self.inject(fault)
            except ValueError as exc:
                self._warn_once(f"fault {fault_id!r} in {self._fault_file} not applied: {exc}")

    def _warn_once(self, message: str) -> None:
        """Log a warning unless it repeats the previous one (the file did not change)."""
        if message != self._last_warning:
            self._last_warning = message
            log.warning("%s", message)

    def _load_fault_file(self, size: int) -> list[tuple[str, Fault]]:
        """Parse and validate the whole file; any error rejects all of it (no half-applied file)."""
        assert self._fault_file is not None
        if size > MAX_FAULT_FILE_BYTES:
            raise ValueError(f"file is {size} bytes, over the {MAX_FAULT_FILE_BYTES}-byte limit")
        try:
            document = json.loads(self._fault_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from exc
        if not isinstance(document, dict) or not isinstance(document.get("faults"), list):
            raise ValueError('expected {"faults": [...]}')
        raw = document["faults"]
        if len(raw) > MAX_FAULTS_PER_FILE:
            raise ValueError(f"{len(raw)} faults, over the limit of {MAX_FAULTS_PER_FILE}")
        entries: list[tuple[str, Fault]] = []
        for position, item in enumerate(raw):
            fault_id = item.get("id") if isinstance(item, dict) else None
            if not isinstance(fault_id, str) or not fault_id:
                raise ValueError(f"fault #{position} needs a non-empty string 'id'")
            if any(fault_id == seen for seen, _ in entries):
                raise ValueError(f"fault id {fault_id!r} appears twice")
            try:
                entries.append((fault_id, Fault.from_dict(item)))
            except ValueError as exc:
                raise ValueError(f"fault {fault_id!r}: {exc}") from exc
        return entries

    # -- snapshot ------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            self._poll_fault_file()
            now = self._clock()
            load = self._current_load()
            samples = tuple(self._sample(state, load, now) for state in self._gpus)
            xids = tuple(event for state in self._gpus for event in state.pending_xids)
            for state in self._gpus:
                state.pending_xids.clear()
        return Snapshot(
            at=now,
            backend=self.name,
            gpus=samples,
            xids=xids,
            driver_version=DRIVER_VERSION,
            notes=("simulated telemetry: a stand-in, no real GPU was read",),
        )

    def close(self) -> None:
        """Nothing to release; present for the GpuTelemetry protocol."""

    def _current_load(self) -> float:
        value = float(self._load())
        return 0.0 if math.isnan(value) else min(1.0, max(0.0, value))

    def _activity(self, state: _GpuState, now: float) -> GpuActivity | None:
        if self._state_dir is None:
            return None
        return sim_gpu_state.read_activity(self._state_dir, state.index, now, ACTIVITY_MAX_AGE_S)

    def _temperature(self, state: _GpuState, load: float, now: float, noise: float) -> float:
        if state.ramp is not None:
            return state.ramp.value(now)
        span = self.model.full_load_temp_c - state.idle_temp_c
        return state.idle_temp_c + load * span + noise

    def _sample(self, state: _GpuState, load: float, now: float) -> GpuSample:
        model = self.model
        if state.lost:
            # Like NVML after GPU_IS_LOST: identity known from enumeration, no readings.
            return GpuSample(
                index=state.index,
                uuid=state.uuid,
                name=model.name,
                pci_bus_id=state.pci_bus_id,
                lost=True,
            )
        activity = self._activity(state, now)
        noise = self._noise.uniform(-1.5, 1.5)
        if activity is not None:
            # What the engine on this GPU drew; its idle floor is this board's own idle draw.
            power = max(activity.power_w, state.idle_w) + noise
            load = (power - state.idle_w) / (model.tdp_w - state.idle_w)
            utilization = activity.busy * 100.0
            memory_used = activity.memory_used_mib
        else:
            power = state.idle_w + load * (model.tdp_w - state.idle_w) + noise
            utilization = load * 100.0
            # An idle GPU shows a few MiB; a serving engine takes up to ~92 % (KV cache fraction).
            memory_used = int(4 + load * 0.92 * model.memory_total_mib)
        load = min(1.0, max(0.0, load))
        temperature = round(self._temperature(state, load, now, self._noise.uniform(-0.5, 0.5)), 1)
        clock_bits = state.clock_bits
        if activity is not None and activity.capped:
            clock_bits |= int(ClockEvent.SW_POWER_CAP)  # as NVML reports a GPU held at its limit
        if temperature >= model.slowdown_temp_c:
            clock_bits |= THERMAL_SLOWDOWN_BITS  # real GPUs raise both at the slowdown threshold
        return GpuSample(
            index=state.index,
            uuid=state.uuid,
            name=model.name,
            pci_bus_id=state.pci_bus_id,
            temperature_c=temperature,
            slowdown_temp_c=model.slowdown_temp_c,
            shutdown_temp_c=model.shutdown_temp_c,
            max_operating_temp_c=model.max_operating_temp_c,
            memory_used_mib=min(memory_used, model.memory_total_mib),
            memory_total_mib=model.memory_total_mib,
            utilization_pct=round(utilization, 1),
            # Never past the enforced limit: the board clocks down to hold it.
            power_w=round(min(state.power_limit_w, max(1.0, power)), 1),
            power_limit_w=state.power_limit_w,
            ecc_uncorrected_volatile=state.ecc_uncorrected,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=state.remapped_rows_uncorrectable,
            remap_pending=state.remap_pending,
            remap_failed=state.remap_failed,
            clock_events=clock_bits,
        )


def _bus_number(index: int) -> int:
    """The index-th GPU's PCI bus: a DGX H100's layout first, then the lowest unused numbers."""
    if index < len(_DGX_BUSES):
        return _DGX_BUSES[index]
    spare = [bus for bus in range(0x01, 0x100) if bus not in _DGX_BUSES]
    return spare[index - len(_DGX_BUSES)]  # MAX_GPUS keeps this in range


def _kernel_pci(nvml_bus_id: str) -> str:
    """NVML's "00000000:1B:00.0" as the kernel log writes it: "0000:1b:00"."""
    domain, bus, rest = nvml_bus_id.split(":")
    return f"{int(domain, 16):04x}:{bus.lower()}:{rest.split('.')[0].lower()}"
