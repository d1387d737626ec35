"""The autoscaler's I/O edge: signals from heartbeats in, targets and decision records out.

Each tick (the leader's "autoscaler" loop) aggregates every deployment's fresh replica stats
into `Signals` (fleet/autoscaler/signals.py), keeps a sliding history per deployment in memory
(a new leader starts with empty windows: it cannot scale down before a full down window of
data, which is the safe direction), asks `decide`, and writes the new `target_servers`, which
the provisioner then makes true. Every change, and every change of rule while holding, is a
`ScalingDecision` row with its inputs, and an Event.

The look-ahead projects over the boot-to-ready of the spare placement would boot next
(`next_boot`): placement's own choice (fleet/provisioning/placement.py, over the warm spares
and the racks' headroom as they are now), at the fleet's p90 for its GPU model and cache state
— a spare holding the deployment's version loads from local disk and serves sooner than one
that must fetch it. The decision's inputs say which spare and why (`next_spare`,
`boot_basis`), and a scale-up lists the spares placement would boot for it (`placement`), so
`fleetctl autoscaler explain` shows them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.autoscaler import demand
from fleet.autoscaler.demand import Forecasts
from fleet.autoscaler.policy import decide
from fleet.autoscaler.signals import DeploymentState, PolicyConfig, RouterLoad, Signals, aggregate
from fleet.events import deployment_event
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, RouterReport, ScalingDecision, Server, utcnow
from fleet.provisioning import placement
from fleet.provisioning.autopilot import get_autopilot
from fleet.provisioning.boot_times import BootQuantile, boot_figures, measured_boots
from fleet.provisioning.boots import rack_rooms, want_for, warm_spares
from fleet.registry.routing_table import router_loads
from fleet.settings import Settings
from fleet_core.engines import spec as engine_spec

ACTOR = "autoscaler"
S = ServerState


def policy_config(settings: Settings) -> PolicyConfig:
    return PolicyConfig(
        queue_per_gpu_target=settings.autoscale_queue_per_gpu,
        up_window_s=settings.autoscale_up_window_s,
        down_window_s=settings.autoscale_down_window_s,
        cooldown_down_s=settings.autoscale_cooldown_down_s,
        slot_ceiling=settings.autoscale_slot_ceiling,
        cooldown_up_s=settings.autoscale_up_window_s,  # the policy's own rule of thumb
    )


@dataclass
class History:
    """Per-deployment sliding windows of signals, in this (leading) process's memory."""

    keep_s: float
    series: dict[str, deque[Signals]]
    lock: threading.Lock

    @classmethod
    def new(cls, keep_s: float) -> History:
        return cls(keep_s, {}, threading.Lock())

    def add(self, name: str, signals: Signals) -> list[Signals]:
        with self.lock:
            window = self.series.setdefault(name, deque())
            window.append(signals)
            while window and window[0].at < signals.at - self.keep_s:
                window.popleft()
            return list(window)


def replicas_per_server(deployment: Deployment, gpus_per_server: int) -> int:
    return max(1, gpus_per_server // max(1, deployment.gpus_per_replica))


def servers_for_replicas(replicas: int, per_server: int) -> int:
    return math.ceil(replicas / per_server) if replicas > 0 else 0


def autoscale_once(
    engine: Engine,
    settings: Settings,
    history: History,
    *,
    now: Callable[[], datetime] = utcnow,
    forecasts: Forecasts | None = None,
) -> list[ScalingDecision]:
    """One tick over every deployment; returns the decisions recorded. With `forecasts` (the
    leader's), the tick also keeps the demand history and, with FLEET_FORECAST, scales
    predictively (fleet/autoscaler/demand.py)."""
    at = now()
    epoch = at.timestamp()
    config = policy_config(settings)
    recorded: list[ScalingDecision] = []
    with Session(engine, expire_on_commit=False) as session:
        # Paused, the tick still watches (signal windows and the demand history stay whole,
        # so that a resume decides on the last minutes and the forecast has no hole), and
        # decides nothing.
        paused = get_autopilot(session).paused
        routers = fresh_router_loads(session, settings, at)
        counted: dict[str, tuple[float, float]] = {}
        if forecasts is not None:
            forecasts.start_tick()
            fresh_after = at - timedelta(seconds=settings.router_report_stale_s)
            counted = forecasts.book.count(
                session.exec(select(RouterReport).where(RouterReport.at >= fresh_after)), epoch
            )
            if epoch - forecasts.pruned_at >= 3600:
                demand.prune(session, at - timedelta(days=settings.demand_history_days))
                forecasts.pruned_at = epoch
        if not paused:  # once a tick, for every deployment
            boots = measured_boots(session, BootQuantile.of(settings).since(at))
            world = Spares.read(session, settings)
        for deployment in list(session.exec(select(Deployment))):
            servers = list(
                session.exec(select(Server).where(Server.deployment_id == deployment.id))
            )
            signals = observe(servers, routers.get(deployment.name), settings, at, deployment)
            window = history.add(deployment.name, signals)
            if paused:
                if forecasts is not None:
                    serving = sum(s.state == S.SERVING for s in servers)
                    _count_demand(
                        session, settings, forecasts, deployment, serving, signals, counted, at
                    )
                continue
            boot = next_boot(session, deployment, world, settings, boots)
            load = routers.get(deployment.name)
            state = _state(
                session, deployment, servers, settings, boot.seconds, load.waiting if load else 0
            )
            extra: dict[str, Any] = {"boot_basis": boot.basis, "next_spare": boot.spare}
            if forecasts is not None:
                state = _predict(
                    session, settings, forecasts, deployment, state, signals, counted, at, extra
                )
            decision = decide(state, window, epoch, config)
            if decision.target > deployment.target_servers:
                extra["placement"] = world.choose(
                    session, deployment, decision.target - deployment.target_servers
                )
            note = None
            if extra.get("placement"):  # a scale-up: which spare boots first, and why
                note = f"placement: {extra['placement'][0]}"
            row = _record(session, deployment, decision, at, extra, note)
            if row is not None:
                recorded.append(row)
        session.commit()
    return recorded


def _predict(
    session: Session,
    settings: Settings,
    forecasts: Forecasts,
    deployment: Deployment,
    state: DeploymentState,
    signals: Signals,
    counted: dict[str, tuple[float, float]],
    at: datetime,
    extra: dict[str, Any],
) -> DeploymentState:
    """Count the tick's demand into the history and, with FLEET_FORECAST, put the forecast's
    servers into the state (`decide` takes the larger: fleet/autoscaler/policy.py)."""
    _count_demand(session, settings, forecasts, deployment, state.serving, signals, counted, at)
    if not settings.forecast or state.pinned is not None:
        return state
    epoch = at.timestamp()
    name = deployment.name
    predictor = forecasts.predictor(name)
    ceiling = policy_config(settings).slot_ceiling
    if epoch - predictor.fitted_at >= settings.forecast_refit_s and forecasts.may_fit():
        started = time.perf_counter()
        predictor.fit(demand.read(session, name, forecasts.history_since(epoch)), epoch, ceiling)
        forecasts.fit_spent_s += time.perf_counter() - started
    servers, basis, how = predictor.need(epoch, state.boot_p90_s, ceiling)
    extra["forecast"] = how
    if servers is None:
        return state
    return replace(state, forecast_servers=servers, forecast_basis=basis)


def _count_demand(
    session: Session,
    settings: Settings,
    forecasts: Forecasts,
    deployment: Deployment,
    serving: int,
    signals: Signals,
    counted: dict[str, tuple[float, float]],
    at: datetime,
) -> None:
    """The tick's demand into the per-minute history; a closed minute written and scored
    against the forecast made for it (its switching off or on again an Event)."""
    epoch = at.timestamp()
    name = deployment.name
    predictor = forecasts.predictor(name)
    closed = forecasts.book.add(
        name,
        epoch,
        counted.get(name),
        serving,
        signals.slot_use,
        signals.p95_latency_s,
        signals.ttft_p95_s,
    )
    if closed is not None:
        demand.write(session, closed)
        switched = predictor.observe(closed)
        if switched is not None and settings.forecast:
            error = predictor.accuracy.error() if predictor.accuracy else None
            how = f"error {error:.0%} over 6 h" if error is not None else "error"
            message = (
                f"forecast off: {how} above {forecasts.config.max_error:.0%}; reactive scaling "
                f"alone until it is back at {forecasts.config.resume_error:.0%} or less"
                if switched == "off"
                else f"forecast on again: {how}"
            )
            session.add(
                deployment_event(
                    name, at, ACTOR, f"deployment.forecast_{switched}", message, {"error": error}
                )
            )


def fresh_router_loads(session: Session, settings: Settings, at: datetime) -> dict[str, RouterLoad]:
    return router_loads(session, at - timedelta(seconds=settings.router_report_stale_s))


def observe(
    servers: list[Server],
    load: RouterLoad | None,
    settings: Settings,
    at: datetime,
    deployment: Deployment | None = None,
) -> Signals:
    """A deployment's signals at `at`: its serving servers' heartbeats of the last three
    intervals (an older one says nothing about now), with the routers' load; the batch slots
    per replica are `deployment`'s max_batch_size (its engine's option), when it sets one."""
    fresh_after = at - timedelta(seconds=3 * settings.heartbeat_interval_s)
    fresh = [
        {"gpu_count": s.gpu_count, "replicas": s.replicas}
        for s in servers
        if s.state == S.SERVING
        and s.last_heartbeat_at is not None
        and s.last_heartbeat_at >= fresh_after
    ]
    epoch = at.timestamp()
    if not fresh:
        return Signals(epoch, None, None, None, None)
    slots = None
    if deployment is not None:
        slots = engine_spec(deployment.engine).max_batch_size(deployment.engine_params or {})
    return aggregate(fresh, epoch, load, slots_per_replica=slots)


@dataclass(frozen=True)
class Spares:
    """The warm spares, the racks' headroom and the measured boots, read once a tick: what
    placement would choose from, for every deployment."""

    spares: list[placement.Spare]
    rooms: dict[str, placement.RackRoom]
    figures: placement.BootFigures
    default_s: float

    @classmethod
    def read(cls, session: Session, settings: Settings) -> Spares:
        return cls(
            warm_spares(session, settings=settings),
            rack_rooms(session, settings=settings),
            boot_figures(session, BootQuantile.of(settings)),
            settings.boot_estimate_s,
        )

    def choose(self, session: Session, deployment: Deployment, servers: int) -> list[str]:
        """Placement's choice for `servers` more servers now, one line each on why (and,
        short, why not)."""
        want = want_for(session, deployment, servers)
        choice = placement.choose_spares(self.spares, self.rooms, want)
        by_name = {s.name: s for s in self.spares}
        lines = []
        for name in choice.chosen:
            spare = by_name[name]
            boot = placement.expected_boot_s(
                spare.gpu_model, placement.holds(spare, want), self.figures, self.default_s
            )
            lines.append(placement.why(spare, want, boot=boot))
        return lines + [f"short {choice.short}: {r}" for r in choice.reasons]


@dataclass(frozen=True)
class NextBoot:
    seconds: float  # the look-ahead's horizon
    basis: str  # what it stands on, for the decision's inputs
    spare: str | None  # placement's next spare and why (None: none would boot now)


def next_boot(
    session: Session,
    deployment: Deployment,
    world: Spares,
    settings: Settings,
    boots: list[tuple[str, float]],
) -> NextBoot:
    """The boot-to-ready of the spare placement would boot next for the deployment: the p90
    for its GPU model and cache state. With no spare to boot, the p90 of every measured boot of
    the GPU models it allows (the configured estimate when none was measured)."""
    want = want_for(session, deployment, 1)
    choice = placement.choose_spares(world.spares, world.rooms, want)
    if choice.chosen:
        spare = next(s for s in world.spares if s.name == choice.chosen[0])
        seconds, basis = placement.expected_boot_s(
            spare.gpu_model, placement.holds(spare, want), world.figures, world.default_s
        )
        return NextBoot(seconds, f"{spare.name}: {basis}", placement.why(spare, want))
    values = [
        seconds
        for model, seconds in boots
        if not deployment.gpu_models or model in deployment.gpu_models
    ]
    how = BootQuantile.of(settings)
    measured = how.value(values)
    if measured is None:
        return NextBoot(settings.boot_estimate_s, "no spare to boot, none measured: default", None)
    return NextBoot(
        measured, f"no spare to boot: {how.label} of {len(values)} measured boots", None
    )


def _state(
    session: Session,
    deployment: Deployment,
    servers: list[Server],
    settings: Settings,
    boot_s: float,
    router_waiting: int = 0,
) -> DeploymentState:
    gpus = gpus_per_server(session, deployment, servers)
    per_server = replicas_per_server(deployment, gpus)
    boot_p90 = boot_s
    pinned = (
        servers_for_replicas(deployment.pinned_replicas, per_server)
        if deployment.pinned_replicas is not None
        else None
    )
    return DeploymentState(
        name=deployment.name,
        sla_p95_s=deployment.sla_p95_latency_ms / 1000.0,
        sla_ttft_s=deployment.sla_ttft_ms / 1000.0,
        gpus_per_server=max(gpus, 1),
        min_servers=servers_for_replicas(deployment.min_replicas, per_server),
        max_servers=servers_for_replicas(deployment.max_replicas, per_server),
        floor=deployment.floor_servers,
        target=deployment.target_servers,
        serving=sum(s.state == S.SERVING for s in servers),
        on_the_way=sum(s.state in (S.BOOTING, S.LOADING) for s in servers),
        boot_p90_s=boot_p90,
        pinned=pinned,
        router_waiting=router_waiting,
        last_up_at=deployment.last_scale_up_at.timestamp() if deployment.last_scale_up_at else None,
        last_down_at=(
            deployment.last_scale_down_at.timestamp() if deployment.last_scale_down_at else None
        ),
    )


def gpus_per_server(session: Session, deployment: Deployment, servers: list[Server]) -> int:
    """GPUs per server of the deployment's servers, or (before it runs anywhere) of the spares
    it could get."""
    return max((s.gpu_count for s in servers), default=0) or _typical_gpus(session, deployment)


def _typical_gpus(session: Session, deployment: Deployment) -> int:
    counts = [
        s.gpu_count
        for s in session.exec(select(Server).where(Server.state == S.WARM))
        if not deployment.gpu_models or s.gpu_model in deployment.gpu_models
    ]
    return max(counts, default=8)


def _record(
    session: Session,
    deployment: Deployment,
    decision: Any,
    at: datetime,
    extra: dict[str, Any] | None = None,
    note: str | None = None,
) -> ScalingDecision | None:
    last = session.exec(
        select(ScalingDecision)
        .where(ScalingDecision.deployment == deployment.name)
        .order_by(col(ScalingDecision.id).desc())
        .limit(1)
    ).first()
    changed = decision.target != deployment.target_servers
    if not changed and last is not None and last.rule == decision.rule:
        return None  # holding for the same reason: one row says it
    row = ScalingDecision(
        deployment=deployment.name,
        at=at,
        rule=decision.rule,
        target_before=deployment.target_servers,
        target_after=decision.target,
        reason=(f"{decision.reason}; {note}" if note else decision.reason)[:1000],
        inputs={**dict(decision.inputs), **(extra or {})},
    )
    session.add(row)
    if changed:
        # Bounds (min, the calendar's floor) and manual pins are not scaling decisions of
        # the policy's own: they must not start its cooldowns and hold a real scale-up back.
        if decision.rule not in ("min", "floor", "pinned"):
            if decision.target > deployment.target_servers:
                deployment.last_scale_up_at = at
            else:
                deployment.last_scale_down_at = at
        session.add(
            deployment_event(
                deployment.name,
                at,
                ACTOR,
                "deployment.scaled",
                f"target {deployment.target_servers} → {decision.target}: {row.reason}",
                {"rule": decision.rule, "delta": decision.delta},
            )
        )
        deployment.target_servers = decision.target
        session.add(deployment)
    return row


def status(session: Session, settings: Settings, at: datetime) -> list[dict[str, Any]]:
    """Per deployment: target, serving, on the way, its signals as of `at` (what the next
    tick will see: a decision is recorded only when the target or the rule changes, so the
    last one's inputs may be minutes old), and the last decision's rule and reason."""
    out = []
    routers = fresh_router_loads(session, settings, at)
    for deployment in session.exec(select(Deployment).order_by(col(Deployment.name))):
        servers = list(session.exec(select(Server).where(Server.deployment_id == deployment.id)))
        last = session.exec(
            select(ScalingDecision)
            .where(ScalingDecision.deployment == deployment.name)
            .order_by(col(ScalingDecision.id).desc())
            .limit(1)
        ).first()
        out.append(
            {
                "deployment": deployment.name,
                "mode": "pinned" if deployment.pinned_replicas is not None else "auto",
                "pinned_replicas": deployment.pinned_replicas,
                "target": deployment.target_servers,
                "serving": sum(s.state == S.SERVING for s in servers),
                "on_the_way": sum(s.state in (S.BOOTING, S.LOADING) for s in servers),
                "last_rule": last.rule if last else None,
                "last_reason": last.reason if last else None,
                "last_decision_at": last.at if last else None,
                "signals": _signals_dict(
                    observe(servers, routers.get(deployment.name), settings, at, deployment)
                ),
            }
        )
    return out


def _signals_dict(signals: Signals) -> dict[str, Any]:
    return {k: v for k, v in asdict(signals).items() if k != "at"}
