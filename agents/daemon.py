"""The agent's main loop: read the GPUs, judge their health, tell the fleet, hear the assignment.

Every tick (the fleet sets the interval, 5 s by default): one telemetry snapshot (plus Xids
from the kernel log where the backend is real hardware), the fault policy over the recent
history, then a heartbeat, or a registration when the agent is not (or no longer) known to be
registered. When the fleet cannot be reached the agent keeps reading its GPUs and serving its
local API, backs off with jitter, and registers again once the fleet answers: a fleet restart
loses nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from agents import AGENT_VERSION
from agents.config import AgentSettings
from agents.fault_policy import Assessment, RepairAction, Verdict, assess
from agents.fleet_client import FleetClient, FleetRefused, FleetUnreachable
from agents.telemetry.base import GpuSample, GpuTelemetry, Snapshot, XidEvent

log = logging.getLogger("agents.daemon")

# An Xid seen by NVML and again in the kernel log within this many seconds is one event.
_DUPLICATE_XID_S = 5.0


class XidSource(Protocol):
    """Kernel-log Xids (agents/telemetry/kmsg.py): new events since the last call."""

    def read_new(self) -> list[XidEvent]: ...


@dataclasses.dataclass
class Counters:
    snapshots: int = 0
    telemetry_errors: int = 0
    heartbeats: int = 0
    heartbeat_failures: int = 0
    registrations: int = 0


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        telemetry: GpuTelemetry,
        client: FleetClient,
        *,
        kernel_log: XidSource | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.client = client
        self.kernel_log = kernel_log
        self.clock = clock
        self.rng = rng or random.Random()
        self.counters = Counters()
        self.history: deque[Snapshot] = deque()
        self.assessment: Assessment | None = None
        self.registered = False
        self.expected_gpus = settings.expected_gpus
        self.interval_s = settings.heartbeat_interval_s
        self.assignment: dict[str, Any] = {"kind": "none"}
        self.fleet_state: str | None = None
        self.last_contact: float | None = None
        self.last_error: str | None = None
        self.advertise_url = settings.advertise_url
        self._failures = 0
        self._lock = threading.RLock()  # the local API reads what the loop writes

    # -----------------------------------------------------------------------------------------
    # one tick

    def tick(self) -> float:
        """Read, judge, report. Returns the seconds to wait before the next tick."""
        self._observe()
        try:
            self._report()
        except FleetUnreachable as exc:
            return self._failed(str(exc), refused=False)
        except FleetRefused as exc:
            return self._failed(str(exc), refused=True)
        self._failures = 0
        return self.interval_s

    def _observe(self) -> None:
        now = self.clock()
        try:
            snapshot = self.telemetry.snapshot()
        except Exception as exc:  # a backend that fails at run time: judged, not fatal
            self.counters.telemetry_errors += 1
            log.warning("telemetry (%s) failed: %s", self.telemetry.name, exc)
            snapshot = None
        if snapshot is not None:
            snapshot = self._with_kernel_xids(snapshot)
            self.counters.snapshots += 1
        with self._lock:
            if snapshot is not None:
                self.history.append(snapshot)
            while self.history and self.history[0].at < now - self.settings.history_s:
                self.history.popleft()
            self.assessment = assess(list(self.history), expected_gpus=self.expected_gpus)

    def _with_kernel_xids(self, snapshot: Snapshot) -> Snapshot:
        if self.kernel_log is None:
            return snapshot
        from agents.telemetry.kmsg import attach_gpu_indexes

        try:
            found = attach_gpu_indexes(self.kernel_log.read_new(), snapshot.gpus)
        except Exception as exc:  # the kernel log is a complement: never fatal
            log.warning("kernel log read failed, going on without it: %s", exc)
            self.kernel_log = None
            return snapshot
        fresh = [x for x in found if not _seen(x, snapshot.xids)]
        if not fresh:
            return snapshot
        return dataclasses.replace(snapshot, xids=snapshot.xids + tuple(fresh))

    def _report(self) -> None:
        if not self.registered:
            reply = self.client.register(self.registration())
            self.counters.registrations += 1
            self.registered = True
            log.info("registered with the fleet as %s", self.settings.server)
        else:
            try:
                reply = self.client.heartbeat(self.heartbeat())
            except FleetUnreachable:
                self.registered = False  # register again once the fleet is back
                raise
            self.counters.heartbeats += 1
        self._heard(reply)

    def _heard(self, reply: dict[str, Any]) -> None:
        with self._lock:
            self.interval_s = float(reply.get("heartbeat_interval_s", self.interval_s))
            self.expected_gpus = reply.get("expected_gpus", self.expected_gpus)
            self.assignment = dict(reply.get("assignment") or {"kind": "none"})
            self.fleet_state = reply.get("state")
            self.last_contact = self.clock()
            self.last_error = None

    def _failed(self, error: str, *, refused: bool) -> float:
        self.counters.heartbeat_failures += 1
        self._failures += 1
        with self._lock:
            self.last_error = error
        # Full jitter: agents of a whole fleet must not all hammer a restarting service at once.
        cap = self.settings.backoff_max_s
        if not refused:
            cap = min(cap, self.settings.backoff_initial_s * 2 ** min(self._failures, 16))
        wait = self.rng.uniform(self.settings.backoff_initial_s, max(cap, 0.001))
        level = logging.ERROR if refused else logging.WARNING
        log.log(
            level,
            "fleet %s: %s; retrying in %.1f s",
            "refused" if refused else "unreachable",
            error,
            wait,
        )
        return wait

    # -----------------------------------------------------------------------------------------
    # what the agent says

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self.history[-1] if self.history else None

    def registration(self) -> dict[str, Any]:
        snapshot = self.latest()
        gpus = snapshot.gpus if snapshot else ()
        return {
            "server": self.settings.server,
            "agent_version": AGENT_VERSION,
            "agent_url": self.advertise_url,
            "telemetry": self.telemetry.name,
            "driver_version": snapshot.driver_version if snapshot else None,
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_mib": g.memory_total_mib,
                    "pci_bus_id": g.pci_bus_id,
                }
                for g in gpus
                if not g.lost
            ],
        }

    def heartbeat(self) -> dict[str, Any]:
        snapshot = self.latest()
        with self._lock:
            assessment = self.assessment
        verdict = assessment.verdict if assessment else Verdict.DEGRADED
        return {
            "server": self.settings.server,
            "verdict": verdict.value,
            "action": (assessment.action if assessment else RepairAction.NONE).value,
            "reasons": [
                {
                    "code": r.code,
                    "gpu": r.gpu,
                    "message": r.message[:500],
                    "action": r.action.value,
                    "verdict": r.verdict.value,
                }
                for r in (assessment.reasons if assessment else ())
            ][:256],
            "gpus": [_gpu_status(g, assessment) for g in (snapshot.gpus if snapshot else ())],
            "snapshot_at": _iso(snapshot.at) if snapshot else None,
            "draining": self.draining,
        }

    @property
    def draining(self) -> bool:
        return self.assignment.get("kind") == "drain"

    @property
    def ready(self) -> bool:
        """GPUs healthy and not draining (engine readiness joins with the supervisor)."""
        with self._lock:
            assessment = self.assessment
        return (
            assessment is not None
            and assessment.verdict is not Verdict.UNHEALTHY
            and not self.draining
            and bool(self.history)
        )

    def state(self) -> dict[str, Any]:
        """Everything /state shows: the latest snapshot, the verdict, the fleet's view."""
        with self._lock:
            snapshot = self.latest()
            assessment = self.assessment
            return {
                "server": self.settings.server,
                "agent_version": AGENT_VERSION,
                "telemetry": self.telemetry.name,
                "registered": self.registered,
                "fleet_state": self.fleet_state,
                "assignment": self.assignment,
                "ready": self.ready,
                "draining": self.draining,
                "last_contact": _iso(self.last_contact) if self.last_contact else None,
                "last_error": self.last_error,
                "assessment": assessment.to_dict() if assessment else None,
                "snapshot": dataclasses.asdict(snapshot) if snapshot else None,
                "counters": dataclasses.asdict(self.counters),
            }

    # -----------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop` is set."""
        while not stop.is_set():
            try:
                wait = self.tick()
            except Exception:  # never let one bad tick end the agent
                log.exception("agent tick failed")
                wait = self.settings.backoff_max_s
            stop.wait(wait)


def _seen(event: XidEvent, known: tuple[XidEvent, ...]) -> bool:
    return any(
        k.xid == event.xid
        and (k.gpu_index == event.gpu_index or k.gpu_index is None or event.gpu_index is None)
        and abs(k.at - event.at) <= _DUPLICATE_XID_S
        for k in known
    )


def _gpu_status(gpu: GpuSample, assessment: Assessment | None) -> dict[str, Any]:
    health = "unknown"
    if assessment is not None:
        verdicts = {r.verdict for r in assessment.reasons if r.gpu == gpu.index}
        health = (
            "unhealthy"
            if gpu.lost or Verdict.UNHEALTHY in verdicts
            else "degraded"
            if Verdict.DEGRADED in verdicts
            else "healthy"
        )
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "health": health,
        "lost": gpu.lost,
        "temperature_c": gpu.temperature_c,
        "memory_used_mib": gpu.memory_used_mib,
        "memory_total_mib": gpu.memory_total_mib,
        "utilization_pct": gpu.utilization_pct,
        "power_w": gpu.power_w,
    }


def _iso(epoch: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC).isoformat()
