"""The agent's fault policy: recent telemetry snapshots → a verdict, the reasons, a repair action.

PURE: plain data in, plain data out. No I/O and no clock reads — "now" is the `at` of the newest
snapshot, so the same history always gives the same `Assessment` (table-tested).

`assess(history)` looks at the snapshots of the last `Thresholds.window_s` seconds (10 minutes by
default) before the newest one. Each snapshot's `xids` are the events that arrived since the
previous snapshot, so Xids are counted across the window's snapshots; an Xid belongs to the window
when the snapshot that carried it does (snapshot time, not the event's own `at`: one clock for
every rule, and a kernel-log event replayed late still counts from when the agent saw it).

Verdicts: `healthy` < `degraded` < `unhealthy` (the one `Verdict` type: the fleet's server rows
and the agent's reports use it too). Repair actions, by severity:
`none` < `restart_engine` < `reboot` < `hardware_inspection`. The assessment's verdict is the
worst verdict of its reasons and its action the most severe action of its reasons; no reasons
means healthy/none, and healthy always means no reasons (informational events such as Xid 63 or
a few Xid 94s add none). Escalation across reboots (the same fault again after a reboot → hardware
inspection) is the fleet's job: this policy sees one boot of one server.

Xid table (meanings from NVIDIA's Xid catalog; classes from NVIDIA's k8s device plugin, whose
application-Xid list is 13/31/43/45/68/109, and from leptonai/gpud's suggested repair actions):

    Xid  meaning (NVIDIA catalog)                                verdict    action
    ---  ------------------------------------------------------  ---------  -------------------
     13  Graphics Engine Exception (e.g. an illegal address in   degraded   restart_engine
         a kernel: usually the application)
     31  GPU memory page fault (the application's MMU fault)     degraded   restart_engine
     43  GPU stopped processing (a channel reset after an        degraded   restart_engine
         application fault)
     45  Preemptive cleanup, due to previous errors (a channel   degraded   restart_engine
         torn down, e.g. its process was killed)
     68  NVDEC0 Exception (video decoder error)                  degraded   restart_engine
    109  Context Switch Timeout Error                            degraded   restart_engine
     48  Double Bit ECC Error (uncorrectable DRAM error)         unhealthy  reboot
     74  NVLink Error                                            unhealthy  reboot
     79  GPU has fallen off the bus                              unhealthy  reboot
     95  Uncontained ECC error                                   unhealthy  reboot
    119  GSP RPC Timeout                                         unhealthy  reboot
    120  GSP Error                                               unhealthy  reboot
    140  Unrecovered ECC Error                                   unhealthy  reboot
     64  ECC page retirement or row remapper recording failure   unhealthy  hardware_inspection
     63  ECC page retirement or row remapping recording event    healthy    none
         (a row was marked; the next reset applies it)
     94  Contained ECC error (only the process that touched      healthy    none
         the row was hit) — at most xid94_max_per_window
         on one GPU in the window
     94  ... more than xid94_max_per_window                      unhealthy  reboot
    any  other Xid (not classified by this policy)               degraded   none

Reason codes: "xid_app" (application Xids), "xid_<n>" (reset Xids and 64), "xid_94_rate",
"xid_other"; 63 and 94 under the limit give no reason (63's remap shows up as `remap_pending`).

Counter and state rules (per GPU; a GPU is the same GPU across snapshots by uuid, else by index):

    code                    rule                                              verdict    action
    ----------------------  ------------------------------------------------  ---------  --------
    ecc_uncorrected_rising  volatile uncorrected ECC count in the newest      unhealthy  reboot
                            snapshot > in the earliest of the window
    remap_pending           a row remap waits for a GPU reset (newest)        unhealthy  reboot
    remap_failed            row remapping failed, no spare rows (newest)      unhealthy  hw insp.
    thermal_slowdown        HW_THERMAL_SLOWDOWN in ≥ thermal_minutes_share    unhealthy  hw insp.
                            of the window's sampled minutes
    temperature_sustained   temperature ≥ the GPU's slowdown threshold        unhealthy  hw insp.
                            continuously for ≥ thermal_sustained_s
    gpu_lost                the GPU stopped answering (newest snapshot)       unhealthy  reboot
    gpu_missing             fewer GPUs in the newest snapshot than expected   unhealthy  reboot
    no_telemetry            no snapshot at all                                degraded   none

Decisions where the sources leave room:

* Xid 94 under (or at) the limit is healthy with no reason: a contained error already killed only
  the process that touched the row, and an engine restart is the engine supervisor's business.
  More than `xid94_max_per_window` on one GPU in the window means the memory is going bad: reboot
  (which also applies the pending row remap).
* Unclassified Xids are degraded with action none: visible to an operator, never a drain by
  themselves.
* Thermal slowdown counts HW_THERMAL_SLOWDOWN only. SW_THERMAL_SLOWDOWN is the driver trimming
  clocks before the hardware limit (normal under heavy load) and HW_SLOWDOWN is also raised by
  power brakes and external signals, so neither pins down a cooling fault. The action is hardware
  inspection, not reboot: a reboot does not fix cooling.
* Thermal share: the window is cut into whole minutes counted back from the newest snapshot; the
  share is (minutes in which at least one sample of the GPU had the bit) / (minutes holding at
  least one sample of the GPU). The rule fires only when the sampled minutes cover at least
  `thermal_min_coverage` of the window, so one minute of data cannot trip it.
* Sustained temperature: any run inside the window counts (not only one still going), so the
  verdict holds for a window after the GPU cools instead of flapping with the load. Samples
  further apart than `max_sample_gap_s`, or a sample without a temperature, break the run.
* `gpu_missing` compares the newest snapshot's GPU count (lost GPUs included: they are reported
  separately) with `expected_gpus`; GPU indices seen earlier in the window and absent now are
  named in the message.
* An empty history is degraded/none ("no_telemetry"): the GPUs' health is unknown, which is not
  healthy, but nothing in it calls for a repair.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from fleet_core.telemetry import ClockEvent, GpuSample, Snapshot, XidEvent

__all__ = [
    "APPLICATION_XIDS",
    "HARDWARE_INSPECTION_XIDS",
    "INFORMATIONAL_XIDS",
    "REBOOT_XIDS",
    "XID_MEANINGS",
    "Assessment",
    "Reason",
    "RepairAction",
    "Thresholds",
    "Verdict",
    "assess",
]


class Verdict(StrEnum):
    """The agent's judgement of a server's GPUs: the policy's verdict, stored on the server."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


class RepairAction(StrEnum):
    """What would fix it, in order of severity (gpud's suggested repair actions)."""

    NONE = "none"
    RESTART_ENGINE = "restart_engine"
    REBOOT = "reboot"
    HARDWARE_INSPECTION = "hardware_inspection"


_VERDICT_RANK = {v: i for i, v in enumerate(Verdict)}
_ACTION_RANK = {a: i for i, a in enumerate(RepairAction)}

# NVIDIA k8s device plugin's application Xids: the application (here: the engine) is at fault.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# A GPU reset is needed; the agent resets by rebooting the server.
REBOOT_XIDS = frozenset({48, 74, 79, 95, 119, 120, 140})
HARDWARE_INSPECTION_XIDS = frozenset({64})
INFORMATIONAL_XIDS = frozenset({63})  # a row marked for remapping, applied at the next reset
XID_94 = 94  # contained ECC error: a reason only past the rate limit

XID_MEANINGS: Mapping[int, str] = MappingProxyType(
    {
        13: "Graphics Engine Exception",
        31: "GPU memory page fault",
        43: "GPU stopped processing",
        45: "Preemptive cleanup, due to previous errors",
        48: "Double Bit ECC Error",
        63: "ECC page retirement or row remapping recording event",
        64: "ECC page retirement or row remapper recording failure",
        68: "NVDEC0 Exception",
        74: "NVLink Error",
        79: "GPU has fallen off the bus",
        94: "Contained ECC error",
        95: "Uncontained ECC error",
        109: "Context Switch Timeout Error",
        119: "GSP RPC Timeout",
        120: "GSP Error",
        140: "Unrecovered ECC Error",
    }
)

_MINUTE_S = 60.0
_DRIVER_TEXT_MAX = 120  # characters of a driver message quoted in an unclassified Xid's reason


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Every setting of the policy, with its default."""

    # How far back (seconds) the policy looks: Xid counts, the ECC rise, thermal history.
    window_s: float = 600.0
    # HW thermal slowdown in at least this share of the window's sampled minutes → unhealthy.
    thermal_minutes_share: float = 0.6
    # ...but only once sampled minutes cover at least this share of the window's minutes.
    thermal_min_coverage: float = 0.6
    # At or over the slowdown temperature continuously this long → unhealthy.
    thermal_sustained_s: float = 120.0
    # Two samples further apart than this do not make a continuous run (the agent was away).
    max_sample_gap_s: float = 60.0
    # More Xid 94s (contained ECC) than this on one GPU in the window → unhealthy, reboot.
    xid94_max_per_window: int = 3

    def __post_init__(self) -> None:
        for name in ("window_s", "thermal_sustained_s", "max_sample_gap_s"):
            value = getattr(self, name)
            if not value > 0:  # NaN fails too
                raise ValueError(f"{name} must be positive, not {value}")
        for name in ("thermal_minutes_share", "thermal_min_coverage"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], not {value}")
        if self.xid94_max_per_window < 0:
            raise ValueError(f"xid94_max_per_window must be ≥ 0, not {self.xid94_max_per_window}")


@dataclass(frozen=True, slots=True)
class Reason:
    """One finding: a stable `code`, the GPU index it is about (None: the whole server or an
    unidentified GPU), one line an operator understands, and what it calls for."""

    code: str
    gpu: int | None
    message: str
    action: RepairAction
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "gpu": self.gpu,
            "message": self.message,
            "action": self.action.value,
            "verdict": self.verdict.value,
        }


@dataclass(frozen=True, slots=True)
class Assessment:
    verdict: Verdict
    action: RepairAction  # the most severe of the reasons' actions
    reasons: tuple[Reason, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: strings, ints, None, lists and dicts only."""
        return {
            "verdict": self.verdict.value,
            "action": self.action.value,
            "reasons": [r.to_dict() for r in self.reasons],
        }


def assess(
    history: Sequence[Snapshot],
    *,
    expected_gpus: int | None = None,
    thresholds: Thresholds = Thresholds(),
) -> Assessment:
    """Judge the server's GPUs from `history`, the agent's recent snapshots (oldest first)."""
    if not history:
        return _assessment(
            [
                Reason(
                    "no_telemetry",
                    None,
                    "no telemetry snapshot yet — the GPUs' health is unknown",
                    RepairAction.NONE,
                    Verdict.DEGRADED,
                )
            ]
        )
    ordered = sorted(history, key=lambda s: s.at)  # stable: equal times keep their order
    latest = ordered[-1]
    start = latest.at - thresholds.window_s
    window = [s for s in ordered if s.at >= start]
    reasons: list[Reason] = []
    reasons += _xid_reasons(window, latest, thresholds)
    reasons += _missing_reasons(window, latest, expected_gpus)
    for gpu in latest.gpus:
        series = [(s.at, g) for s in window if (g := _same_gpu_in(s, gpu)) is not None]
        reasons += _gpu_state_reasons(gpu)
        reasons += _ecc_reasons(gpu, series, thresholds)
        reasons += _thermal_share_reasons(gpu, series, latest.at, thresholds)
        reasons += _sustained_temperature_reasons(gpu, series, thresholds)
    return _assessment(reasons)


# --- assembling ------------------------------------------------------------------------------


def _assessment(reasons: Iterable[Reason]) -> Assessment:
    ordered = tuple(
        sorted(reasons, key=lambda r: (-1 if r.gpu is None else r.gpu, r.code, r.message))
    )
    verdict = max((r.verdict for r in ordered), key=_VERDICT_RANK.__getitem__, default=None)
    action = max((r.action for r in ordered), key=_ACTION_RANK.__getitem__, default=None)
    return Assessment(
        verdict=verdict or Verdict.HEALTHY,
        action=action or RepairAction.NONE,
        reasons=ordered,
    )


def _label(index: int | None, pci_bus_id: str | None) -> str:
    """How a reason names a GPU: "GPU 3 (00000000:3B:00.0)"."""
    if index is None:
        return f"GPU at {pci_bus_id}" if pci_bus_id else "Unidentified GPU"
    return f"GPU {index} ({pci_bus_id})" if pci_bus_id else f"GPU {index}"


def _span(seconds: float) -> str:
    if seconds >= _MINUTE_S and seconds % _MINUTE_S == 0:
        return f"{seconds / _MINUTE_S:g} min"
    return f"{seconds:g} s"


def _same_gpu(a: GpuSample, b: GpuSample) -> bool:
    if a.uuid is not None and b.uuid is not None:
        return a.uuid == b.uuid
    return a.index == b.index


def _same_gpu_in(snapshot: Snapshot, gpu: GpuSample) -> GpuSample | None:
    return next((g for g in snapshot.gpus if _same_gpu(g, gpu)), None)


# --- Xids ------------------------------------------------------------------------------------


def _bus_key(pci_bus_id: str) -> tuple[int, ...] | None:
    """NVML's "00000000:3B:00.0" and the kernel log's "0000:3b:00" name the same GPU."""
    text = pci_bus_id.strip()
    if text[:4].upper() == "PCI:":
        text = text[4:]
    head, _, function = text.partition(".")
    try:
        parts = [int(p, 16) for p in head.split(":")]
        if function:
            int(function, 16)
    except ValueError:
        return None
    if len(parts) == 2:  # "3b:00": domain 0
        parts.insert(0, 0)
    return tuple(parts) if len(parts) == 3 else None


def _resolve(
    event: XidEvent, window: Sequence[Snapshot], latest: Snapshot
) -> tuple[int | None, str | None]:
    """The GPU index an Xid is about, and the PCI bus id to show for it."""
    samples = [*latest.gpus, *(g for s in reversed(window) for g in s.gpus)]
    if event.gpu_index is not None:
        bus = next((g.pci_bus_id for g in samples if g.index == event.gpu_index), None)
        return event.gpu_index, bus or event.pci_bus_id
    if event.pci_bus_id:
        key = _bus_key(event.pci_bus_id)
        for g in samples:
            if key is not None and g.pci_bus_id and _bus_key(g.pci_bus_id) == key:
                return g.index, g.pci_bus_id
        return None, event.pci_bus_id
    return None, None


def _xid_reasons(
    window: Sequence[Snapshot], latest: Snapshot, thresholds: Thresholds
) -> list[Reason]:
    # (gpu index, bus id shown, xid) → the events, in arrival order
    seen: dict[tuple[int | None, str | None, int], list[XidEvent]] = {}
    for snapshot in window:
        for event in snapshot.xids:
            index, bus = _resolve(event, window, latest)
            seen.setdefault((index, bus, event.xid), []).append(event)
    span = _span(thresholds.window_s)
    reasons: list[Reason] = []
    for (index, bus, xid), events in seen.items():
        who = _label(index, bus)
        n = len(events)
        times = f" ×{n} in the last {span}" if n > 1 else ""
        meaning = XID_MEANINGS.get(xid)
        if xid in INFORMATIONAL_XIDS:
            continue
        if xid == XID_94:
            if n > thresholds.xid94_max_per_window:
                reasons.append(
                    Reason(
                        "xid_94_rate",
                        index,
                        f"{who}: Xid 94 ×{n} in the last {span} (more than "
                        f"{thresholds.xid94_max_per_window}) — contained ECC errors keep "
                        "coming; memory is failing",
                        RepairAction.REBOOT,
                        Verdict.UNHEALTHY,
                    )
                )
        elif xid in APPLICATION_XIDS:
            reasons.append(
                Reason(
                    "xid_app",
                    index,
                    f"{who}: Xid {xid}{times} — {meaning} (application error)",
                    RepairAction.RESTART_ENGINE,
                    Verdict.DEGRADED,
                )
            )
        elif xid in REBOOT_XIDS:
            reasons.append(
                Reason(
                    f"xid_{xid}",
                    index,
                    f"{who}: Xid {xid}{times} — {meaning}",
                    RepairAction.REBOOT,
                    Verdict.UNHEALTHY,
                )
            )
        elif xid in HARDWARE_INSPECTION_XIDS:
            reasons.append(
                Reason(
                    f"xid_{xid}",
                    index,
                    f"{who}: Xid {xid}{times} — {meaning}",
                    RepairAction.HARDWARE_INSPECTION,
                    Verdict.UNHEALTHY,
                )
            )
        else:
            text = next((e.message for e in reversed(events) if e.message.strip()), "")
            said = " ".join(text.split())
            if len(said) > _DRIVER_TEXT_MAX:
                said = said[: _DRIVER_TEXT_MAX - 1] + "…"
            reasons.append(
                Reason(
                    "xid_other",
                    index,
                    f"{who}: Xid {xid}{times} — not classified by the fault policy"
                    + (f" (driver: {said})" if said else ""),
                    RepairAction.NONE,
                    Verdict.DEGRADED,
                )
            )
    return reasons


# --- GPUs gone -------------------------------------------------------------------------------


def _missing_reasons(
    window: Sequence[Snapshot], latest: Snapshot, expected_gpus: int | None
) -> list[Reason]:
    found = len(latest.gpus)
    if expected_gpus is None or found >= expected_gpus:
        return []
    now = {g.index for g in latest.gpus}
    gone = sorted({g.index for s in window for g in s.gpus} - now)
    named = f" (gone since earlier in the window: {', '.join(f'GPU {i}' for i in gone)})"
    return [
        Reason(
            "gpu_missing",
            None,
            f"{found} of {expected_gpus} expected GPUs found" + (named if gone else ""),
            RepairAction.REBOOT,
            Verdict.UNHEALTHY,
        )
    ]


def _gpu_state_reasons(gpu: GpuSample) -> list[Reason]:
    who = _label(gpu.index, gpu.pci_bus_id)
    reasons: list[Reason] = []
    if gpu.lost:
        reasons.append(
            Reason(
                "gpu_lost",
                gpu.index,
                f"{who}: lost — it stopped answering the driver (fallen off the bus)",
                RepairAction.REBOOT,
                Verdict.UNHEALTHY,
            )
        )
    if gpu.remap_pending:
        reasons.append(
            Reason(
                "remap_pending",
                gpu.index,
                f"{who}: a memory row remap is pending — a GPU reset applies it",
                RepairAction.REBOOT,
                Verdict.UNHEALTHY,
            )
        )
    if gpu.remap_failed:
        reasons.append(
            Reason(
                "remap_failed",
                gpu.index,
                f"{who}: memory row remapping failed (no spare rows left)",
                RepairAction.HARDWARE_INSPECTION,
                Verdict.UNHEALTHY,
            )
        )
    return reasons


# --- ECC -------------------------------------------------------------------------------------


def _ecc_reasons(
    gpu: GpuSample, series: Sequence[tuple[float, GpuSample]], thresholds: Thresholds
) -> list[Reason]:
    counts = [g.ecc_uncorrected_volatile for _, g in series]
    known = [c for c in counts if c is not None]
    if len(known) < 2 or known[-1] <= known[0]:  # flat, or reset by a driver reload
        return []
    return [
        Reason(
            "ecc_uncorrected_rising",
            gpu.index,
            f"{_label(gpu.index, gpu.pci_bus_id)}: volatile uncorrected ECC errors rose from "
            f"{known[0]} to {known[-1]} in the last {_span(thresholds.window_s)}",
            RepairAction.REBOOT,
            Verdict.UNHEALTHY,
        )
    ]


# --- thermal ---------------------------------------------------------------------------------


def _thermal_share_reasons(
    gpu: GpuSample,
    series: Sequence[tuple[float, GpuSample]],
    now: float,
    thresholds: Thresholds,
) -> list[Reason]:
    minutes = max(1, math.ceil(thresholds.window_s / _MINUTE_S))
    sampled: set[int] = set()
    hot: set[int] = set()
    for at, g in series:
        if g.clock_events is None:
            continue
        minute = min(int((now - at) // _MINUTE_S), minutes - 1)  # 0: the newest minute
        sampled.add(minute)
        if g.clock_events & ClockEvent.HW_THERMAL_SLOWDOWN:
            hot.add(minute)
    if not _at_least(len(sampled), thresholds.thermal_min_coverage, minutes):
        return []  # too little of the window seen to call a pattern
    if not _at_least(len(hot), thresholds.thermal_minutes_share, len(sampled)):
        return []
    return [
        Reason(
            "thermal_slowdown",
            gpu.index,
            f"{_label(gpu.index, gpu.pci_bus_id)}: hardware thermal slowdown in {len(hot)} of "
            f"{len(sampled)} sampled minutes of the last {_span(thresholds.window_s)} — "
            "check its cooling",
            RepairAction.HARDWARE_INSPECTION,
            Verdict.UNHEALTHY,
        )
    ]


def _at_least(count: int, share: float, total: int) -> bool:
    """count ≥ share × total, without float noise (0.7 × 10 is 7.000000000000001)."""
    return count >= share * total - 1e-9


def _sustained_temperature_reasons(
    gpu: GpuSample, series: Sequence[tuple[float, GpuSample]], thresholds: Thresholds
) -> list[Reason]:
    longest = 0.0
    hottest: GpuSample | None = None
    run_start: float | None = None
    previous: float | None = None
    for at, g in series:
        hot = (
            g.temperature_c is not None
            and g.slowdown_temp_c is not None
            and g.temperature_c >= g.slowdown_temp_c
        )
        if not hot or (previous is not None and at - previous > thresholds.max_sample_gap_s):
            run_start = None
        if hot:
            if run_start is None:
                run_start = at
            if at - run_start >= longest:
                longest, hottest = at - run_start, g
        previous = at
    if hottest is None or longest < thresholds.thermal_sustained_s:
        return []
    return [
        Reason(
            "temperature_sustained",
            gpu.index,
            f"{_label(gpu.index, gpu.pci_bus_id)}: at or over its slowdown temperature "
            f"({hottest.slowdown_temp_c:g} °C) for {longest:g} s — check its cooling",
            RepairAction.HARDWARE_INSPECTION,
            Verdict.UNHEALTHY,
        )
    ]
