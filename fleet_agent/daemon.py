"""The agent's main loop: read the GPUs, judge their health, tell the fleet, hear the assignment.

Every tick (the fleet sets the interval, 5 s by default): one telemetry snapshot (plus Xids
from the kernel log where the backend is real hardware), the fault policy over the recent
history, then a heartbeat, or a registration when the agent is not (or no longer) known to be
registered. When the fleet cannot be reached the agent keeps reading its GPUs and serving its
local API, backs off with jitter, and registers again once the fleet answers: a fleet restart
loses nothing.

Power limit: each reply carries the per-GPU limit the fleet's cap valve asks for
(Reply.gpu_power_limit_w; None: the GPUs' default). When it differs from the last one applied
(and on the first reply, so a restarted agent never keeps a stale cap) the agent sets it on
every GPU through the telemetry backend (PowerLimitControl: NVML, the simulated backend); a
backend that cannot (dcgm) says so once per requested value. Each heartbeat's GPUs carry the
limit the boards enforce (GpuStatus.power_limit_w).

Weights (fleet_agent/weights/, docs/weights.md): every tick hands the stager the versions the
assignment names (the served one, then `stage`) and the keys to keep; it fetches them in the
background. A served version the agent fetches starts its engines on the cache's path once it
is ready; until then engines already serving that deployment (an older version: a rollout)
keep serving, and engines of another deployment stop. Each heartbeat carries the cache
(Heartbeat.cache) and each replica the version it runs (ReplicaStatus.version); a version
turning ready or failed is reported at once.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import SecretStr, ValidationError

from fleet_agent import AGENT_VERSION
from fleet_agent.config import AgentSettings
from fleet_agent.engine.supervisor import EngineSupervisor
from fleet_agent.fleet_client import FleetClient, FleetRefused, FleetUnreachable
from fleet_agent.telemetry import PowerLimitControl, PowerLimitFailed, PowerLimitUnsupported
from fleet_agent.weights.cache import WeightsCache
from fleet_agent.weights.stager import Stager
from fleet_core.fault_policy import Assessment, RepairAction, Verdict, assess
from fleet_core.telemetry import GpuSample, GpuTelemetry, Snapshot, XidEvent
from fleet_core.wire import (
    MAX_REASONS,
    MAX_REPLICA_ERROR,
    MAX_XIDS,
    Assignment,
    GpuFound,
    GpuHealth,
    GpuStatus,
    HealthReason,
    Heartbeat,
    ModelRef,
    Registration,
    ReplicaStatus,
    Reply,
)

log = logging.getLogger("fleet_agent.daemon")

# An Xid seen by NVML and again in the kernel log within this many seconds is one event.
_DUPLICATE_XID_S = 5.0
_NOT_YET = object()  # no power limit applied since the agent started


class XidSource(Protocol):
    """Kernel-log Xids (fleet_agent/telemetry/kmsg.py): new events since the last call."""

    def read_new(self) -> list[XidEvent]: ...


@dataclasses.dataclass
class Drain:
    """A self-drain in progress: no new requests, in-flight ones finish, then engines stop."""

    reason: str  # "unhealthy" or "fleet"
    started: float
    deadline: float
    stopping: threading.Thread | None = None
    done: bool = False


@dataclasses.dataclass
class PowerLimitState:
    """The fleet's power limit as this agent handled it (shown by /state)."""

    requested_w: float | None = None  # the latest reply's Reply.gpu_power_limit_w
    applied: dict[int, float] | None = None  # GPU index → limit set, by the last success
    error: str | None = None  # why the requested limit is not (yet) in force
    changes: int = 0  # limits applied since start


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
        supervisor: EngineSupervisor | None = None,
        cache: WeightsCache | None = None,
        stager: Stager | None = None,
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
        self.assignment = Assignment(kind="none")
        self.fleet_state: str | None = None
        self.last_contact: float | None = None
        self.last_error: str | None = None
        self.advertise_url = settings.advertise_url
        # The local API's key (/probe, /faults): configured, or random per start; the fleet
        # learns it at (re)registration, so a restart with a new one costs nothing.
        key = settings.api_key.get_secret_value() if settings.api_key else None
        self.api_key = key or secrets.token_urlsafe(32)
        self.supervisor = supervisor
        self.cache = cache
        self.stager = stager if stager is not None else (Stager(cache) if cache else None)
        self.drain: Drain | None = None
        self._failures = 0
        self._refused_urls: list[str] = []
        self.power_limit = PowerLimitState()
        self._power_limit_done: object = _NOT_YET  # the request last applied (or refused for good)
        self.next_report_at = 0.0  # report at once: register first
        self._reported: tuple[object, ...] | None = None
        self._wake = threading.Event()
        self._lock = threading.RLock()  # the local API reads what the loop writes

    # -----------------------------------------------------------------------------------------
    # one tick

    def tick(self) -> float:
        """Read and judge the GPUs, steer the engines, and report when due: every heartbeat
        interval, and at once when the verdict, readiness or drain state changes. Returns the
        seconds to wait before the next tick."""
        self._observe()
        self._stage()
        self._steer_engines()
        now = self.clock()
        changed = self._state_key() != self._reported
        if now >= self.next_report_at or (changed and self._failures == 0):
            try:
                self._report()
            except FleetUnreachable as exc:
                self.next_report_at = now + self._failed(str(exc), refused=False)
            except FleetRefused as exc:
                self.next_report_at = now + self._failed(str(exc), refused=True)
            else:
                self._failures = 0
                self.next_report_at = now + self.interval_s
        return max(0.0, min(self.settings.sample_interval_s, self.next_report_at - now))

    def wake(self) -> None:
        """Tick now (e.g. a fault was just injected): the verdict must not wait a sample."""
        self._wake.set()

    def _state_key(self) -> tuple[object, ...]:
        assessment = self.assessment
        return (
            assessment.verdict if assessment else None,
            assessment.action if assessment else None,
            self.ready,
            self.draining,
            self.cache.states() if self.cache is not None else (),
        )

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
        from fleet_agent.telemetry.kmsg import attach_gpu_indexes

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
        try:
            report = self.heartbeat() if self.registered else self.registration()
        except ValidationError as exc:
            # A report the fleet would answer 422 to: refused here, saying why.
            raise FleetRefused(f"report not valid: {_first_error(exc)}") from exc
        if isinstance(report, Registration):
            reply = self.client.register(report)
            self.counters.registrations += 1
            self.registered = True
            log.info("registered with the fleet as %s", self.settings.server)
        else:
            try:
                reply = self.client.heartbeat(report)
            except FleetUnreachable:
                self.registered = False  # register again once the fleet is back
                raise
            self.counters.heartbeats += 1
        self._reported = self._state_key()
        self._heard(reply)

    # -----------------------------------------------------------------------------------------
    # weights

    def _stage(self) -> None:
        """Tell the stager what the assignment wants cached: the served version first, then
        the `stage` list (kind "stage": a spare pre-staged; kind "serve": ahead of a rollout).
        Draining or unassigned: nothing (a fetch under way stops; its partial files stay)."""
        stager, cache = self.stager, self.cache
        if stager is None or cache is None:
            return
        a = self.assignment
        wanted: list[ModelRef] = []
        if a.kind == "serve" and a.model is not None:
            wanted.append(a.model)
        if a.kind in ("serve", "stage"):
            wanted.extend(a.stage)
        stager.want(wanted, keep=a.keep)
        running = self.supervisor.version if self.supervisor is not None else None
        cache.set_in_use([running] if running else [])

    # -----------------------------------------------------------------------------------------
    # engines and self-drain

    def _steer_engines(self) -> None:
        """Engines run the fleet's assignment while the GPUs are not unhealthy. An unhealthy
        verdict or the fleet's "drain" starts a self-drain: /readyz turns false at once (routers
        stop sending), in-flight requests finish (up to drain_deadline_s), then the engines
        stop gracefully."""
        supervisor = self.supervisor
        if supervisor is None:
            return
        now = self.clock()
        kind = self.assignment.kind
        unhealthy = self.assessment is not None and self.assessment.verdict is Verdict.UNHEALTHY
        drain = self.drain
        if drain is not None and drain.done and kind == "serve" and not unhealthy:
            log.info("drain over: the assignment stands and the GPUs are healthy again")
            self.drain = drain = None
        if drain is None:
            if kind == "serve" and not unhealthy:
                self._apply(supervisor)
                return
            if kind in ("none", "stage"):  # stage: a spare fetching weights runs no engine
                supervisor.apply(None)
                return
            if supervisor.deployment is None:
                return  # nothing running: nothing to drain
            reason = "fleet" if kind == "drain" else "unhealthy"
            self.drain = drain = Drain(reason, now, now + self.settings.drain_deadline_s)
            log.warning("self-drain (%s): not ready; in-flight requests finish", reason)
        self._advance_drain(supervisor, drain, now)

    def _apply(self, supervisor: EngineSupervisor) -> None:
        snapshot = self.latest()
        gpus = sorted(g.index for g in snapshot.gpus if not g.lost) if snapshot else None
        assignment = self.assignment
        ref, cache = assignment.model, self.cache
        model_dir = None
        if ref is not None and not ref.external and cache is not None:
            if not cache.is_ready(ref):
                # Not cached yet: the engines of an earlier version of this deployment serve
                # on; those of another deployment stop (their weights are not wanted).
                if supervisor.deployment not in (None, assignment.deployment):
                    supervisor.apply(None)
                return
            model_dir = cache.engine_dir(ref.key)
        try:
            # The supervisor reads the assignment as the fleet's JSON sent it.
            supervisor.apply(
                assignment.model_dump(mode="json"), gpus=gpus or None, model_dir=model_dir
            )
        except ValueError as exc:
            with self._lock:
                self.last_error = f"assignment: {exc}"

    def _advance_drain(self, supervisor: EngineSupervisor, drain: Drain, now: float) -> None:
        if drain.stopping is None:
            # Stats are a poll old: trust "nothing in flight" only after two polls of the drain.
            settled = now >= drain.started + 2 * supervisor.config.poll_interval_s
            idle = settled and supervisor.in_flight() == 0
            if idle or now >= drain.deadline:
                if not idle:
                    log.warning("drain deadline: stopping engines with requests in flight")
                drain.stopping = threading.Thread(
                    target=supervisor.stop_all, name="engine-stop", daemon=True
                )
                drain.stopping.start()
        elif not drain.stopping.is_alive() and not drain.done:
            drain.done = True
            log.info("drain done: engines stopped")

    def _heard(self, reply: Reply) -> None:
        """Take the fleet's answer; a field it lacks keeps the agent's current value."""
        with self._lock:
            if reply.heartbeat_interval_s is not None:
                self.interval_s = reply.heartbeat_interval_s
            if reply.expected_gpus is not None:
                self.expected_gpus = reply.expected_gpus
            self.assignment = reply.assignment
            self.fleet_state = reply.state
            self.last_contact = self.clock()
            self.last_error = None
        self._apply_power_limit(reply.gpu_power_limit_w)
        refused = list(reply.refused_urls)
        if refused != self._refused_urls:  # said once per change, not every heartbeat
            self._refused_urls = refused
            for problem in refused:
                log.error("the fleet will not route to %s (set engine_host)", problem)

    def _apply_power_limit(self, watts: float | None) -> None:
        """Set the fleet's per-GPU limit when it changed. A transient failure is tried again at
        the next reply; a backend that cannot set limits is told once per requested value."""
        with self._lock:
            self.power_limit.requested_w = watts
        if self._power_limit_done is not _NOT_YET and self._power_limit_done == watts:
            return
        wanted = "the default" if watts is None else f"{watts:g} W"
        telemetry = self.telemetry
        error: str | None = None
        applied: dict[int, float] | None = None
        if not isinstance(telemetry, PowerLimitControl):
            error = f"telemetry {telemetry.name} cannot set GPU power limits"
        else:
            try:
                applied = telemetry.set_power_limit(watts)
            except PowerLimitUnsupported as exc:
                error = str(exc)
            except (PowerLimitFailed, RuntimeError) as exc:
                with self._lock:
                    self.power_limit.error = str(exc)
                log.warning("GPU power limit %s not set, trying again: %s", wanted, exc)
                return
        self._power_limit_done = watts
        with self._lock:
            self.power_limit.error = error
            if applied is not None:
                self.power_limit.applied = applied
                self.power_limit.changes += 1
        if error is not None and watts is None:
            # Nothing asked of a backend that cannot set limits: the boards keep their own.
            log.info("GPU power limits stay as the boards have them: %s", error)
        elif error is not None:
            log.error("GPU power limit %s requested by the fleet NOT applied: %s", wanted, error)
        else:
            log.info("GPU power limit %s applied: %s", wanted, _limits_text(applied or {}))

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

    def registration(self) -> Registration:
        snapshot = self.latest()
        gpus = snapshot.gpus if snapshot else ()
        return Registration(
            server=self.settings.server,
            agent_version=AGENT_VERSION,
            agent_url=self.advertise_url,
            agent_api_key=SecretStr(self.api_key),
            telemetry=self.telemetry.name,
            driver_version=snapshot.driver_version if snapshot else None,
            gpus=[
                GpuFound(
                    index=g.index,
                    uuid=g.uuid,
                    name=g.name,
                    memory_mib=g.memory_total_mib,
                    pci_bus_id=g.pci_bus_id,
                )
                for g in gpus
                if not g.lost
            ],
        )

    def heartbeat(self) -> Heartbeat:
        snapshot = self.latest()
        with self._lock:
            assessment = self.assessment
            xids = _xids_by_gpu(self.history)
        reasons = assessment.reasons if assessment else ()
        return Heartbeat(
            server=self.settings.server,
            verdict=assessment.verdict if assessment else Verdict.DEGRADED,
            action=assessment.action if assessment else RepairAction.NONE,
            reasons=[
                HealthReason(
                    code=r.code,
                    gpu=r.gpu,
                    message=r.message[:500],
                    action=r.action,
                    verdict=r.verdict,
                )
                for r in reasons[:MAX_REASONS]
            ],
            gpus=[
                _gpu_status(g, assessment, xids.get(g.index, ()))
                for g in (snapshot.gpus if snapshot else ())
            ],
            snapshot_at=datetime.fromtimestamp(snapshot.at, UTC) if snapshot else None,
            draining=self.draining,
            ready=self.ready,
            replicas=[_replica_report(r) for r in self.replicas()],
            cache=self.cache.report() if self.cache is not None else None,
        )

    @property
    def draining(self) -> bool:
        return self.assignment.kind == "drain" or self.drain is not None

    def replicas(self) -> list[dict[str, Any]]:
        return self.supervisor.replica_stats() if self.supervisor is not None else []

    @property
    def ready(self) -> bool:
        """GPUs not unhealthy, not draining, and every replica of the assignment ready."""
        with self._lock:
            assessment = self.assessment
        if assessment is None or assessment.verdict is Verdict.UNHEALTHY or not self.history:
            return False
        if self.draining:
            return False
        if self.assignment.kind == "serve" and self.supervisor is not None:
            return self.supervisor.ready
        return True

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
                "assignment": self.assignment.model_dump(mode="json"),
                "ready": self.ready,
                "draining": self.draining,
                "drain": _drain_view(self.drain),
                "power_limit": dataclasses.asdict(self.power_limit),
                "replicas": self.replicas(),
                "cache": self._cache_view(),
                "last_contact": _iso(self.last_contact) if self.last_contact else None,
                "last_error": self.last_error,
                "assessment": assessment.to_dict() if assessment else None,
                "snapshot": dataclasses.asdict(snapshot) if snapshot else None,
                "counters": dataclasses.asdict(self.counters),
            }

    def _cache_view(self) -> dict[str, Any] | None:
        if self.cache is None:
            return None
        view = self.cache.view()
        if self.stager is not None:
            view["stager"] = self.stager.view()
        return view

    # -----------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop` is set; the engines and the stager stop with the agent."""
        if self.supervisor is not None:
            self.supervisor.start()
        if self.stager is not None:
            self.stager.start()
        try:
            while not stop.is_set():
                try:
                    wait = self.tick()
                except Exception:  # never let one bad tick end the agent
                    log.exception("agent tick failed")
                    wait = self.settings.sample_interval_s
                self._wake.wait(wait)
                self._wake.clear()
        finally:
            if self.stager is not None:
                self.stager.close()
            if self.supervisor is not None:
                self.supervisor.close(self.settings.engine_stop_grace_s)


def _drain_view(drain: Drain | None) -> dict[str, Any] | None:
    if drain is None:
        return None
    return {
        "reason": drain.reason,
        "started": _iso(drain.started),
        "deadline": _iso(drain.deadline),
        "engines_stopping": drain.stopping is not None and not drain.done,
        "done": drain.done,
    }


_REPLICA_FIELDS = (
    "index",
    "gpus",
    "port",
    "url",
    "state",
    "pid",  # the same after an agent restart: the engine was adopted
    "restarts",
    "load_seconds",
    "queued",
    "running",
    "kv_used_fraction",
    "cache_hit_rate",
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "e2e_p50_s",
    "e2e_p95_s",
    "preemptions",
    "version",
    "engine",
)


def _replica_report(stats: dict[str, Any]) -> ReplicaStatus:
    """The supervisor's stats of one replica, as the report carries them (the rest stays local).
    A figure the report cannot carry (an engine's odd value) is left out, not the heartbeat."""
    fields = {key: stats.get(key) for key in _REPLICA_FIELDS}
    error = stats.get("last_error")
    if isinstance(error, str) and error.strip():  # one line, within the report's bound
        fields["error"] = " ".join(error.split())[:MAX_REPLICA_ERROR]
    try:
        return ReplicaStatus.model_validate(fields)
    except ValidationError as exc:
        bad = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
        log.warning("replica %s: left out of the report: %s", stats.get("index"), sorted(bad))
        return ReplicaStatus.model_validate(
            {k: v for k, v in fields.items() if k not in bad or k in _REQUIRED_REPLICA_FIELDS}
        )


# Without these a replica cannot be reported at all.
_REQUIRED_REPLICA_FIELDS = frozenset({"index", "state"})


def _seen(event: XidEvent, known: tuple[XidEvent, ...]) -> bool:
    return any(
        k.xid == event.xid
        and (k.gpu_index == event.gpu_index or k.gpu_index is None or event.gpu_index is None)
        and abs(k.at - event.at) <= _DUPLICATE_XID_S
        for k in known
    )


def _xids_by_gpu(history: Iterable[Snapshot]) -> dict[int, tuple[int, ...]]:
    """The distinct Xid codes each GPU saw in the snapshots kept (the fault policy's window),
    ascending; an Xid no GPU could be named for is in the reasons only."""
    seen: dict[int, set[int]] = {}
    for snapshot in history:
        for event in snapshot.xids:
            if event.gpu_index is not None:
                seen.setdefault(event.gpu_index, set()).add(event.xid)
    return {index: tuple(sorted(codes)[:MAX_XIDS]) for index, codes in seen.items()}


def _gpu_status(
    gpu: GpuSample, assessment: Assessment | None, xids: Sequence[int] = ()
) -> GpuStatus:
    health = GpuHealth.UNKNOWN
    if assessment is not None:
        verdicts = {r.verdict for r in assessment.reasons if r.gpu == gpu.index}
        health = (
            GpuHealth.UNHEALTHY
            if gpu.lost or Verdict.UNHEALTHY in verdicts
            else GpuHealth.DEGRADED
            if Verdict.DEGRADED in verdicts
            else GpuHealth.HEALTHY
        )
    return GpuStatus(
        index=gpu.index,
        uuid=gpu.uuid,
        health=health,
        lost=gpu.lost,
        temperature_c=gpu.temperature_c,
        slowdown_temp_c=gpu.slowdown_temp_c,
        memory_used_mib=gpu.memory_used_mib,
        memory_total_mib=gpu.memory_total_mib,
        utilization_pct=gpu.utilization_pct,
        power_w=gpu.power_w,
        power_limit_w=gpu.power_limit_w,
        ecc_uncorrected_volatile=gpu.ecc_uncorrected_volatile,
        remapped_rows_correctable=gpu.remapped_rows_correctable,
        remapped_rows_uncorrectable=gpu.remapped_rows_uncorrectable,
        remap_pending=gpu.remap_pending,
        remap_failed=gpu.remap_failed,
        clock_events=gpu.clock_events,
        xids=list(xids),
    )


def _limits_text(limits: dict[int, float]) -> str:
    """ "350 W on GPU 0, 1, 2" or "350 W on GPU 0, 1; 400 W on GPU 2" """
    by_value: dict[float, list[int]] = {}
    for index, watts in sorted(limits.items()):
        by_value.setdefault(watts, []).append(index)
    return (
        "; ".join(
            f"{watts:g} W on GPU {', '.join(str(i) for i in indexes)}"
            for watts, indexes in by_value.items()
        )
        or "no GPU"
    )


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}"


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()
