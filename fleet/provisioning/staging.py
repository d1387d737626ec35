"""Pre-staging warm spares: power one on, let its agent fetch a version, power it off again.

A deployment with `cached_spares` K keeps at least K warm spares of each GPU model it allows
holding its version verified in their weights cache (docs/provisioning.md, "Pre-staged
spares"), so that a scale-out boots a spare that loads from local disk. Each provisioner tick,
after capacity, `stage_once`:

1. reads what the spares' agents last reported (`Server.cache_entries`: a warm spare's report
   is the one from before it powered off; its disk kept the files), the spares already staging,
   and the racks' headroom, all under the placement lock (the budget gate's: one lock for every
   path that raises a rack's draw);
2. asks the pure policy (fleet/provisioning/staging_policy.py) which spares to stage;
3. moves each to `booting` with kind "stage", no deployment and `stage_version_id` set, in the
   same transaction: the rack commits its maximum draw at once, as for any boot.

The tick's own steps then carry it (fleet/provisioning/tick.py): `booting` powers it on through
the one power path (write-ahead, staggered per rack like every boot); the agent registers and is
answered kind "stage" with that version (fleet/registry/agent_reports.py), → `loading`; its
heartbeats report the fetch; `ready` (or `failed`, or `stage_deadline_s` since the power-on) →
`powering_off` → `warm`, with one `server.staged` or `server.stage_failed` Event. A spare whose
stage failed is not picked for that version again for `stage_deadline_s`.

Bounds: nothing while the autopilot is paused (the tick does not run); no new stage while the
breaker is open or while a deployment is short of its target this tick (scale-out needs the
spares and the headroom more); at most the deployment's disruption budget staging its version
at once. A scale-out that needs a server takes a staging one first (it is on already:
`take_staging`), and the version it fetched is the one it then serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.catalog.refs import artifacts_of, cache_entry, is_external, key_of, tp_size_of
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, ModelVersion, Pool, Rack, Server, utcnow
from fleet.provisioning import staging_policy as policy
from fleet.provisioning.boots import placement_lock, rack_rooms, start_boot, warm_spares
from fleet.settings import Settings
from fleet_core.weights import for_server

S = ServerState
KIND = "stage"  # Server.boot_kind of a staging boot
# A staging spare is powered on for its stage from booting until it is warm again.
STAGING_STATES = frozenset({S.BOOTING, S.LOADING, S.POWERING_OFF})
STAGED = "server.staged"
STAGE_FAILED = "server.stage_failed"


@dataclass
class StageReport:
    started: list[str] = field(default_factory=list)  # "<server>: <reason>"
    gaps: list[str] = field(default_factory=list)  # one line per goal left unmet


def is_staging(server: Server) -> bool:
    """Powered on only to fetch a version (no deployment)."""
    return server.stage_version_id is not None and server.deployment_id is None


# ---------------------------------------------------------------------------------------------
# Starting stages


def stage_once(engine: Engine, settings: Settings, actor: str) -> StageReport:
    """Start the stages the policy asks for now (module docstring); one transaction."""
    report = StageReport()
    now = utcnow()
    with Session(engine) as session, placement_lock(session):
        goals, versions = _goals(session)
        if not goals:
            return report
        candidates = _candidates(session, settings, now)
        in_flight = _in_flight(session, versions)
        picks, gaps = policy.plan(goals, candidates, in_flight, rack_rooms(session))
        ids = {key: v.id for key, v in versions.items()}
        for pick in picks:
            server = session.exec(select(Server).where(Server.name == pick.name)).one()
            start_boot(
                session,
                server,
                None,
                KIND,
                actor,
                pick.reason,
                details={"version": pick.version, "deployment": pick.deployment},
            )
            server.stage_version_id = ids[pick.version]
            server.stage_started_at = now
            session.add(server)
            report.started.append(f"{pick.name}: {pick.reason}")
        session.commit()
        report.gaps = [g.reason for g in gaps]
    return report


def _goals(session: Session) -> tuple[list[policy.Goal], dict[str, ModelVersion]]:
    """One goal per deployment asking for cached spares and GPU model it may run on; the
    versions by key. An external version (weights outside Fleet) has nothing to stage."""
    goals: list[policy.Goal] = []
    versions: dict[str, ModelVersion] = {}
    deployments = session.exec(
        select(Deployment).where(Deployment.cached_spares > 0).order_by(col(Deployment.name))
    )
    warm_models: list[tuple[str, int]] | None = None
    for deployment in deployments:
        version = (
            session.get(ModelVersion, deployment.model_version_id)
            if deployment.model_version_id is not None
            else None
        )
        if version is None:
            continue
        artifacts = artifacts_of(session, version)
        if not artifacts or is_external(artifacts):
            continue
        models = list(deployment.gpu_models)
        if not models:  # any GPU model: each one among the warm spares able to run it
            if warm_models is None:
                warm_models = [
                    (m, n)
                    for m, n in session.exec(
                        select(Server.gpu_model, Server.gpu_count).where(
                            Server.state == S.WARM, Server.pool == Pool.WARM
                        )
                    )
                ]
            models = sorted({m for m, n in warm_models if n >= deployment.gpus_per_replica})
        key = key_of(version)
        versions[key] = version
        tp = tp_size_of(deployment)
        for model in models:
            files = for_server(artifacts, model, tp)
            goals.append(
                policy.Goal(
                    deployment=deployment.name,
                    version=key,
                    gpu_model=model,
                    keep=deployment.cached_spares,
                    gpus_per_replica=deployment.gpus_per_replica,
                    size_bytes=sum(a.size_bytes or 0 for a in files),
                    concurrency=deployment.disruption_budget,
                )
            )
    return goals, versions


def _candidates(session: Session, settings: Settings, now: datetime) -> list[policy.Candidate]:
    spares = warm_spares(session, settings=settings)
    rows = {
        s.name: s
        for s in session.exec(
            select(Server).where(col(Server.name).in_([sp.name for sp in spares]))
        )
    }
    recent = _recent_failures(session, now - timedelta(seconds=settings.stage_deadline_s))
    out: list[policy.Candidate] = []
    for spare in spares:
        row = rows[spare.name]
        entries = [e for e in row.cache_entries or () if isinstance(e, dict) and e.get("key")]
        failed = {str(e["key"]) for e in entries if e.get("state") == "failed"}
        partial = {
            str(e["key"]): int(e.get("bytes") or 0) for e in entries if e.get("state") == "fetching"
        }
        out.append(
            policy.Candidate(
                spare=spare,
                cache_budget_bytes=row.cache_budget_bytes,
                partial_bytes=partial,
                tried=frozenset(failed | recent.get(spare.name, set())),
            )
        )
    return out


def _recent_failures(session: Session, since: datetime) -> dict[str, set[str]]:
    """Server name -> version keys whose stage failed there since `since` (its Events)."""
    out: dict[str, set[str]] = {}
    rows = session.exec(
        select(Event.subject, Event.details).where(
            Event.kind == STAGE_FAILED, Event.subject_type == "server", Event.at >= since
        )
    )
    for subject, details in rows:
        key = (details or {}).get("version")
        if isinstance(key, str):
            out.setdefault(subject, set()).add(key)
    return out


def _in_flight(session: Session, versions: dict[str, ModelVersion]) -> list[policy.InFlight]:
    by_id = {v.id: k for k, v in versions.items()}
    rows = session.exec(
        select(Server, Rack.name)
        .join(Rack, col(Rack.id) == Server.rack_id)
        .where(
            col(Server.stage_version_id).is_not(None),
            col(Server.deployment_id).is_(None),
            col(Server.state).in_(list(STAGING_STATES)),
        )
    )
    out: list[policy.InFlight] = []
    for server, rack in rows:
        key = by_id.get(server.stage_version_id)
        if key is None:  # a version no deployment asks for now: still on, counted by nobody
            continue
        out.append(policy.InFlight(server.name, rack, key, server.gpu_model))
    return out


# ---------------------------------------------------------------------------------------------
# Following a stage (the tick's `loading` step for a staging spare)


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    message: str  # one line, for the transition and the Event
    details: dict[str, Any]


def progress(session: Session, server: Server, settings: Settings, now: datetime) -> Outcome | None:
    """How the stage of a staging spare in `loading` stands: None while its agent fetches;
    an Outcome once the version is verified, its fetch failed, or the deadline passed."""
    version = (
        session.get(ModelVersion, server.stage_version_id)
        if server.stage_version_id is not None
        else None
    )
    started = server.stage_started_at or server.state_changed_at
    waited = (now - started).total_seconds()
    if version is None:  # deleted meanwhile: nothing left to stage
        return Outcome(False, "its version no longer exists", {"version": None})
    key = key_of(version)
    # Only a report from this power-on: the one from before it (kept while it was off) may
    # show a stale partial fetch.
    reported = server.cache_reported_at or server.last_heartbeat_at
    fresh = reported is not None and (
        server.load_started_at is None or reported >= server.load_started_at
    )
    entry = cache_entry(server, key) if fresh else None
    state = entry.get("state") if entry is not None else None
    details: dict[str, Any] = {"version": key, "seconds": round(waited, 3)}
    if entry is not None:
        details["bytes"] = entry.get("bytes")
    if state == "ready":
        return Outcome(True, f"{key} verified in its cache after {waited:.0f} s", details)
    if state == "failed":
        error = str(entry.get("error") or "no reason given") if entry is not None else ""
        details["error"] = error[:500]
        return Outcome(False, f"fetching {key} failed: {error}"[:500], details)
    if waited > settings.stage_deadline_s:
        details["error"] = "deadline"
        return Outcome(
            False,
            f"{key} not verified within {settings.stage_deadline_s:g} s (stage deadline)",
            details,
        )
    return None


def outcome_event(server: Server, outcome: Outcome, actor: str, now: datetime) -> Event:
    return Event(
        at=now,
        subject_type="server",
        subject=server.name,
        actor=actor,
        kind=STAGED if outcome.ok else STAGE_FAILED,
        message=(
            f"pre-staged: {outcome.message}; back to the warm pool"
            if outcome.ok
            else f"pre-stage failed: {outcome.message}; back to the warm pool"
        )[:2000],
        details=outcome.details,
    )


# ---------------------------------------------------------------------------------------------
# Scale-out takes a staging spare first


def take_staging(
    session: Session, deployment: Deployment, count: int, version_id: int | None
) -> list[Server]:
    """Up to `count` staging spares able to run the deployment, those staging its own version
    first: they are on already. Each is handed the deployment (its stage ends: the agent is
    answered "serve" next). The caller commits."""
    rows = list(
        session.exec(
            select(Server)
            .where(
                col(Server.stage_version_id).is_not(None),
                col(Server.deployment_id).is_(None),
                col(Server.state).in_([S.BOOTING, S.LOADING]),
                Server.gpu_count >= deployment.gpus_per_replica,
            )
            .order_by(col(Server.name))
        )
    )
    allowed = [s for s in rows if not deployment.gpu_models or s.gpu_model in deployment.gpu_models]
    allowed.sort(key=lambda s: (s.stage_version_id != version_id, s.name))
    taken = allowed[:count]
    now = utcnow()
    for server in taken:
        server.deployment_id = deployment.id
        server.stage_version_id = None
        server.stage_started_at = None
        server.boot_cache_hit = None  # its boot began as a stage: no boot figure from it
        if server.state == S.LOADING:
            server.load_started_at = now  # the load deadline counts from the hand-over
        session.add(server)
    return taken
