"""Rollouts: start, the leader's tick, promotion and rollback (docs/router.md, docs/weights.md).

A rollout moves a deployment from its version (stable) to another of the same model (canary)
in steps (fleet/rollout/plan.py). At a step of weight w:

1. moving — ceil(w × servers) of the deployment's servers (at least 1, leaving one stable)
   run the canary: the tick sets their `Server.model_version_id`, at most as many at once as
   the disruption budget leaves (servers draining or drained, and servers moved but not yet
   ready on their new version, use it up); their agents fetch the version and restart their
   engines on it (the assignment, fleet/registry/agent_reports.py).
2. analysing — once every canary server serves the canary (its replicas ready and reporting
   that version), routers get weight w (the routing table) and the window opens: the routers'
   per-version counters are noted, and each tick compares the canary with the stable version
   over the window since then (fleet/rollout/analysis.py); halfway through the window the
   canary's servers are probed (fleet/provisioning/quality_probe.py).
3. pass → the next step (or the promotion after the last); fail → rollback.

Promotion moves the remaining servers within the budget (router weight = the canary's share of
the ready servers), then makes the canary the deployment's version (`set_deployment_version`)
and clears the servers' own versions: one `deployment.rollout_complete` Event. Rollback (the
analysis failing, a canary server that cannot fetch the version, the moving taking longer than
`stage_deadline_s`, or an operator) sets the weight to 0 and the canary aside at once and sends
every canary server back in the same transaction (at weight 0 they serve nothing, so moving
them back at once disrupts no traffic and restores capacity soonest): one
`deployment.rollback` Event with the figures.

The deployment's row is read FOR UPDATE by every writer (the tick, start, rollback): an
operator's rollback never crosses the tick's step on Postgres; SQLite serialises writers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.catalog.refs import cache_entry, key_of, set_deployment_version, version_by_key
from fleet.crypto import SecretBox
from fleet.errors import ConflictError, FleetError, NotFoundError
from fleet.events import deployment_event
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, ModelVersion, Server, utcnow
from fleet.provisioning import quality_probe
from fleet.provisioning.autopilot import get_autopilot
from fleet.registry.routing_table import VersionLoad, version_loads
from fleet.rollout.analysis import Thresholds, Verdict, VersionFigures, judge
from fleet.rollout.plan import PlanError, build_plan, canary_servers
from fleet.settings import Settings

log = logging.getLogger(__name__)
ACTOR = "rollout"
RUNNING = "running"
MAX_HISTORY = 50
S = ServerState
# Servers of the deployment that count: they run (or are about to run) its replicas.
ACTIVE = (S.LOADING, S.SERVING)
DISRUPTED = (S.DRAINING, S.DRAINED)


class RolloutRequest(BaseModel):
    """POST /deployments/{name}/rollout."""

    version: str = Field(
        min_length=1, max_length=130, description='"<model>@<version>", or the version alone'
    )
    canary: str | None = Field(default=None, max_length=20, description="e.g. 5%")
    steps: list[Annotated[str, StringConstraints(max_length=20)]] = Field(
        default_factory=list, max_length=20, description="e.g. 25%, 50%"
    )
    step_s: float | None = Field(default=None, gt=0, le=86400, description="each step's window")
    min_requests: int | None = Field(default=None, ge=1, le=10**6)


class RollbackRequest(BaseModel):
    reason: str = Field(default="", max_length=500)


class RolloutServer(BaseModel):
    server: str
    state: str
    version: str | None
    ready: bool  # its replicas are ready on that version


class RolloutStatus(BaseModel):
    deployment: str
    model_version: str | None
    canary_version: str | None
    canary_weight: float
    rollout: dict[str, Any]
    servers: list[RolloutServer]


# ---------------------------------------------------------------------------------------------
# Start, rollback, status (the API's)


def _locked(session: Session, name: str) -> Deployment:
    row = session.exec(
        select(Deployment).where(Deployment.name == name).with_for_update()
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"no deployment named {name!r}")
    return row


def _version_named(session: Session, deployment: Deployment, text: str) -> ModelVersion:
    current = session.get(ModelVersion, deployment.model_version_id)
    if "@" in text:
        version = version_by_key(session, text)
    elif current is not None:
        version = session.exec(
            select(ModelVersion).where(
                ModelVersion.model == current.model, ModelVersion.version == text
            )
        ).first()
    else:
        version = None
    if version is None:
        raise NotFoundError(f"no model version {text!r} (fleetctl models list)")
    return version


def start(session: Session, name: str, request: RolloutRequest, actor: str) -> RolloutStatus:
    """Begin a rollout (409 when one runs, or the version is not a new one of the same model)."""
    deployment = _locked(session, name)
    if deployment.canary_version_id is not None:
        raise ConflictError(
            f"{name} is already rolling out {deployment.rollout.get('version')}: wait for it "
            "or roll it back first"
        )
    current = session.get(ModelVersion, deployment.model_version_id)
    if current is None:
        raise ConflictError(f"{name} serves no model version to roll out from")
    version = _version_named(session, deployment, request.version)
    if version.model != current.model:
        raise ConflictError(
            f"{key_of(version)} is a version of model {version.model!r}; {name} serves "
            f"{current.model!r} (a rollout changes the version, not the model)"
        )
    if version.id == current.id:
        raise ConflictError(f"{name} already serves {key_of(version)}")
    try:
        steps = build_plan(request.canary, request.steps or None)
    except PlanError as exc:
        raise FleetError(f"rollout plan: {exc}") from None
    now = utcnow()
    deployment.canary_version_id = version.id
    deployment.canary_weight = 0.0
    deployment.rollout = {
        "status": RUNNING,
        "phase": "moving",
        "version": key_of(version),
        "from_version": key_of(current),
        "steps": steps,
        "step": 0,
        "step_s": request.step_s,
        "min_requests": request.min_requests,
        "started_at": now.isoformat(),
        "started_by": actor,
        "step_started_at": now.isoformat(),
        "moved": {},
        "history": [],
    }
    deployment.updated_at = now
    session.add(deployment)
    plan = ", ".join(f"{w:.0%}" if w >= 0.01 else f"{w:.2%}" for w in steps)
    session.add(
        deployment_event(
            name,
            utcnow(),
            actor,
            "deployment.rollout_started",
            f"rollout of {name}: {key_of(current)} → {key_of(version)} in steps {plan}",
            {"version": key_of(version), "from_version": key_of(current), "steps": steps},
        )
    )
    session.commit()
    return status(session, name)


def rollback_by_hand(session: Session, name: str, reason: str, actor: str) -> RolloutStatus:
    deployment = _locked(session, name)
    if deployment.canary_version_id is None:
        raise ConflictError(f"{name} has no rollout in progress")
    why = f"rolled back by {actor}" + (f": {reason}" if reason else "")
    _rollback(session, deployment, why, dict(deployment.rollout.get("analysis") or {}), actor)
    session.commit()
    return status(session, name)


def status(session: Session, name: str) -> RolloutStatus:
    deployment = session.exec(select(Deployment).where(Deployment.name == name)).one_or_none()
    if deployment is None:
        raise NotFoundError(f"no deployment named {name!r}")
    keys = _keys(session)
    servers = []
    for server in _members(session, deployment):
        key = keys.get(server.model_version_id or deployment.model_version_id)
        servers.append(
            RolloutServer(
                server=server.name,
                state=str(server.state),
                version=key,
                ready=key is not None and _settled(server, key),
            )
        )
    return RolloutStatus(
        deployment=name,
        model_version=keys.get(deployment.model_version_id),
        canary_version=keys.get(deployment.canary_version_id),
        canary_weight=deployment.canary_weight,
        rollout=deployment.rollout or {},
        servers=servers,
    )


# ---------------------------------------------------------------------------------------------
# The leader's tick


@dataclass
class TickReport:
    actions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def rollout_once(
    engine: Engine,
    settings: Settings,
    box: SecretBox,
    ask: quality_probe.AskAgent | None = None,
    *,
    now: datetime | None = None,
) -> TickReport:
    """One tick: every running rollout one step further, then the probes it asked for."""
    report = TickReport()
    with Session(engine) as session:
        names = list(
            session.exec(
                select(Deployment.name).where(col(Deployment.canary_version_id).is_not(None))
            )
        )
        _clear_strays(session, report)
        session.commit()
        paused = get_autopilot(session).paused
    to_probe: list[str] = []
    for name in names:
        try:
            with Session(engine) as session:
                to_probe += _advance(session, name, settings, now or utcnow(), report, paused)
                session.commit()
        except FleetError as exc:
            report.errors.append(f"{name}: {exc}")
    for server in to_probe:
        outcome = quality_probe.probe_server(engine, settings, server, ask, box=box)
        report.actions.append(f"{server}: probe: {outcome.detail}")
    for line in report.actions:
        log.info("rollout: %s", line)
    return report


def _advance(
    session: Session,
    name: str,
    settings: Settings,
    now: datetime,
    report: TickReport,
    paused: bool = False,
) -> list[str]:
    """One rollout one step further; returns the canary servers to probe now. A paused
    autopilot holds it where it is (no server moves, no step passes); a failing step still
    rolls back (the safe direction)."""
    deployment = _locked(session, name)
    canary = session.get(ModelVersion, deployment.canary_version_id)
    r = dict(deployment.rollout or {})
    if canary is None or r.get("status") != RUNNING:
        return []
    keys = _keys(session)
    canary_key, stable_key = key_of(canary), keys.get(deployment.model_version_id) or ""
    members = _members(session, deployment)
    active = [s for s in members if s.state in ACTIVE]
    on_canary = [s for s in active if s.model_version_id == canary.id]
    on_stable = [s for s in active if s.model_version_id != canary.id]
    # A canary server whose agent cannot fetch the version: the rollout cannot go on.
    for server in on_canary:
        entry = cache_entry(server, canary_key)
        if entry is not None and entry.get("state") == "failed":
            error = str(entry.get("error") or "fetch failed")[:300]
            _rollback(
                session,
                deployment,
                f"{server.name} could not fetch {canary_key}: {error}",
                dict(r.get("analysis") or {}),
                ACTOR,
            )
            report.actions.append(f"{name}: rolled back ({server.name} could not fetch)")
            return []
    phase = r.get("phase", "moving")
    steps = [float(w) for w in r.get("steps") or []]
    step = int(r.get("step") or 0)
    weight = 1.0 if phase == "promoting" else steps[min(step, len(steps) - 1)]
    target = len(active) if phase == "promoting" else canary_servers(weight, len(active))
    moved: dict[str, str] = dict(r.get("moved") or {})
    unsettled = [s for s in on_canary if not _settled(s, canary_key, moved.get(s.name))]
    if phase in ("moving", "promoting"):
        disrupted = sum(1 for s in members if s.state in DISRUPTED) + len(unsettled)
        room = max(0, deployment.disruption_budget - disrupted)
        # Stable servers that are serving ready first (then the rest, in name order).
        candidates = sorted(
            on_stable,
            key=lambda s: (not _settled(s, stable_key, None), s.state != S.SERVING, s.name),
        )
        switch = [] if paused else candidates[: max(0, min(room, target - len(on_canary)))]
        for server in switch:
            server.model_version_id = canary.id
            moved[server.name] = now.isoformat()
            session.add(server)
            report.actions.append(f"{name}: {server.name} → {canary_key}")
        r["moved"] = moved
        on_canary += switch
        unsettled += switch
        started = _at(r.get("step_started_at")) or now
        if unsettled and (now - started).total_seconds() > settings.stage_deadline_s:
            _rollback(
                session,
                deployment,
                f"{', '.join(s.name for s in unsettled)} not serving {canary_key} within "
                f"{settings.stage_deadline_s:g} s",
                dict(r.get("analysis") or {}),
                ACTOR,
            )
            report.actions.append(f"{name}: rolled back (canary servers not ready in time)")
            return []
    if phase == "moving":
        if target == 0:
            r["waiting"] = f"a canary needs at least 2 serving servers ({len(active)} serve {name})"
        elif len(on_canary) >= target and not unsettled:
            r.pop("waiting", None)
            r["phase"] = "analysing"
            r["window_started_at"] = now.isoformat()
            r["baseline"] = _counters(session, name, settings, now)
            r["probed"] = False
            deployment.canary_weight = weight
            report.actions.append(f"{name}: step {step + 1}: {weight:.0%} to {canary_key}")
        else:
            r["waiting"] = (
                f"{len(on_canary) - len(unsettled)} of {target} canary servers serve {canary_key}"
            )
        _save(session, deployment, r, now)
        return []
    if phase == "promoting":
        ready_canary = len(on_canary) - len(unsettled)
        ready_stable = sum(1 for s in on_stable if _settled(s, stable_key, None))
        if not on_stable and not unsettled:
            _promote(session, deployment, canary, r, now)
            report.actions.append(f"{name}: now serves {canary_key}")
            return []
        if ready_canary + ready_stable:
            deployment.canary_weight = round(ready_canary / (ready_canary + ready_stable), 4)
        r["waiting"] = f"{len(on_canary) - len(unsettled)} of {len(active)} servers on {canary_key}"
        _save(session, deployment, r, now)
        return []
    # analysing
    if not on_canary or unsettled:
        # The canary's servers left (scale-in, a drain) or one restarts: the window's figures
        # would not be the step's. Back to moving; the window opens again once it serves.
        r.update(phase="moving", step_started_at=now.isoformat())
        r.pop("baseline", None)
        report.actions.append(f"{name}: step {step + 1}: canary servers changed, moving again")
        _save(session, deployment, r, now)
        return []
    window_start = _at(r.get("window_started_at")) or now
    elapsed = (now - window_start).total_seconds()
    thresholds = Thresholds(
        step_s=float(r.get("step_s") or settings.rollout_step_s),
        min_requests=int(r.get("min_requests") or settings.rollout_min_requests),
        max_error_increase=settings.rollout_max_error_increase,
        max_latency_ratio=settings.rollout_max_latency_ratio,
    )
    stable_figures, canary_figures = _window_figures(
        session, name, settings, now, r.get("baseline") or {}, stable_key, canary_key
    )
    verdict = judge(
        stable_figures,
        canary_figures,
        elapsed_s=elapsed,
        thresholds=thresholds,
        probe_mismatches=_mismatches(session, name, canary_key, window_start),
    )
    probing = settings.probe_interval_s > 0
    to_probe: list[str] = []
    if verdict.outcome == "pass" and probing and not r.get("probed"):
        verdict = Verdict("wait", "waiting for the quality probe", verdict.figures)
    if verdict.outcome == "pass" and paused:
        verdict = Verdict("wait", "the autopilot is paused: the step holds", verdict.figures)
    if (
        verdict.outcome != "fail"
        and probing
        and not r.get("probed")
        and elapsed >= thresholds.step_s / 2
    ):
        to_probe = [s.name for s in on_canary if _settled(s, canary_key, moved.get(s.name))]
        r["probed"] = True
    r["analysis"] = {
        "outcome": verdict.outcome,
        "reason": verdict.reason,
        "at": now.isoformat(),
        "step": step + 1,
        "weight": weight,
        "figures": verdict.figures,
    }
    if verdict.outcome == "fail":
        _rollback(session, deployment, verdict.reason, r["analysis"], ACTOR)
        report.actions.append(f"{name}: rolled back at step {step + 1}: {verdict.reason}")
        return []
    if verdict.outcome == "pass":
        history = list(r.get("history") or [])[-(MAX_HISTORY - 1) :]
        history.append(r["analysis"])
        r["history"] = history
        r["step_started_at"] = now.isoformat()
        r.pop("baseline", None)
        if step + 1 < len(steps):
            r["step"], r["phase"] = step + 1, "moving"
        else:
            r["phase"] = "promoting"
        report.actions.append(f"{name}: step {step + 1} passed: {verdict.reason}")
    _save(session, deployment, r, now)
    return to_probe


def _promote(
    session: Session, deployment: Deployment, canary: ModelVersion, r: dict[str, Any], now: datetime
) -> None:
    before = r.get("from_version")
    set_deployment_version(session, deployment, canary)
    for server in session.exec(select(Server).where(Server.model_version_id == canary.id)):
        server.model_version_id = None
        session.add(server)
    deployment.canary_version_id = None
    deployment.canary_weight = 0.0
    r.update(status="complete", phase="done", finished_at=now.isoformat())
    r.pop("waiting", None)
    _save(session, deployment, r, now)
    session.add(
        deployment_event(
            deployment.name,
            utcnow(),
            ACTOR,
            "deployment.rollout_complete",
            f"{deployment.name} now serves {key_of(canary)} (was {before})",
            {
                "version": key_of(canary),
                "from_version": before,
                "steps": r.get("history") or [],
            },
        )
    )


def _rollback(
    session: Session,
    deployment: Deployment,
    reason: str,
    analysis: dict[str, Any],
    actor: str,
) -> None:
    """Weight 0, the canary set aside and its servers sent back, one Event with the figures
    (the caller commits)."""
    now = utcnow()
    r = dict(deployment.rollout or {})
    canary_id = deployment.canary_version_id
    back = []
    if canary_id is not None:
        for server in session.exec(select(Server).where(Server.model_version_id == canary_id)):
            server.model_version_id = None
            session.add(server)
            back.append(server.name)
    deployment.canary_version_id = None
    deployment.canary_weight = 0.0
    r.update(
        status="rolled_back",
        phase="done",
        reason=reason,
        finished_at=now.isoformat(),
        rolled_back_by=actor,
    )
    r.pop("waiting", None)
    _save(session, deployment, r, now)
    figures = analysis.get("figures") or {}
    session.add(
        deployment_event(
            deployment.name,
            utcnow(),
            actor,
            "deployment.rollback",
            f"{deployment.name}: rollout of {r.get('version')} rolled back at step "
            f"{int(r.get('step') or 0) + 1} ({reason}); {len(back)} server(s) back on "
            f"{r.get('from_version')}",
            {
                "version": r.get("version"),
                "from_version": r.get("from_version"),
                "step": int(r.get("step") or 0) + 1,
                "reason": reason,
                "automatic": actor == ACTOR,
                "servers": back,
                "figures": figures,
            },
        )
    )


# ---------------------------------------------------------------------------------------------
# Helpers


def _clear_strays(session: Session, report: TickReport) -> None:
    """A server's own version is a rollout's doing: one that left its deployment, or whose
    deployment no longer rolls that version out, goes back to its deployment's."""
    canaries = {
        d.id: d.canary_version_id
        for d in session.exec(
            select(Deployment).where(col(Deployment.canary_version_id).is_not(None))
        )
    }
    for server in session.exec(select(Server).where(col(Server.model_version_id).is_not(None))):
        if server.deployment_id is None or canaries.get(server.deployment_id) != (
            server.model_version_id
        ):
            server.model_version_id = None
            session.add(server)
            report.actions.append(f"{server.name}: own version cleared (no rollout of it)")


def _members(session: Session, deployment: Deployment) -> list[Server]:
    return list(
        session.exec(
            select(Server)
            .where(
                Server.deployment_id == deployment.id,
                col(Server.state).in_([S.BOOTING, *ACTIVE, *DISRUPTED]),
            )
            .order_by(col(Server.name))
        )
    )


def _keys(session: Session) -> dict[int | None, str]:
    return {v.id: key_of(v) for v in session.exec(select(ModelVersion))}


def _settled(server: Server, key: str, moved_at: str | None = None) -> bool:
    """Serving `key`: the agent ready, every replica ready and reporting that version (an
    agent that reports no version: a heartbeat since the move, all replicas ready)."""
    if server.state != S.SERVING or not server.agent_ready or server.agent_draining:
        return False
    replicas = [r for r in server.replicas or [] if r.get("url")]
    if not replicas or any(r.get("state") != "ready" for r in replicas):
        return False
    versions = {r.get("version") for r in replicas}
    if versions == {key}:
        return True
    if versions != {None}:
        return False
    since = _at(moved_at)
    return since is None or (
        server.last_heartbeat_at is not None and server.last_heartbeat_at > since
    )


def _counters(
    session: Session, name: str, settings: Settings, now: datetime
) -> dict[str, dict[str, list[int]]]:
    fresh_after = now - timedelta(seconds=settings.router_report_stale_s)
    return {
        router: {key: [v.requests, v.errors] for key, v in figures.items()}
        for router, figures in version_loads(session, name, fresh_after).items()
    }


def _window_figures(
    session: Session,
    name: str,
    settings: Settings,
    now: datetime,
    baseline: dict[str, dict[str, list[int]]],
    stable_key: str,
    canary_key: str,
) -> tuple[VersionFigures, VersionFigures]:
    """Each version's requests and errors since the window opened (per router: now minus the
    counters then; a router that restarted counts from 0), and the worst p95s now."""
    fresh_after = now - timedelta(seconds=settings.router_report_stale_s)
    loads = version_loads(session, name, fresh_after)

    def figures(key: str) -> VersionFigures:
        requests = errors = 0
        p95: float | None = None
        ttft: float | None = None
        for router, per_version in loads.items():
            current: VersionLoad | None = per_version.get(key)
            if current is None:
                continue
            base = baseline.get(router, {}).get(key, [0, 0])
            if current.requests < base[0] or current.errors < base[1]:
                base = [0, 0]
            requests += current.requests - base[0]
            errors += current.errors - base[1]
            p95 = _max(p95, current.p95_s)
            ttft = _max(ttft, current.ttft_p95_s)
        return VersionFigures(requests, errors, p95, ttft)

    return figures(stable_key), figures(canary_key)


def _mismatches(session: Session, name: str, canary_key: str, since: datetime) -> list[str]:
    """Canary servers whose probe mismatched since `since` (the probe's Events)."""
    rows = session.exec(
        select(Event).where(
            Event.kind == "server.probe_mismatch",
            col(Event.at) >= since,
        )
    )
    return sorted(
        {
            e.subject
            for e in rows
            if (e.details or {}).get("version") == canary_key
            and (e.details or {}).get("deployment") == name
        }
    )


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _at(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _save(session: Session, deployment: Deployment, r: dict[str, Any], now: datetime) -> None:
    deployment.rollout = dict(r)  # a new object: the JSON column notices the change
    deployment.updated_at = now
    session.add(deployment)
