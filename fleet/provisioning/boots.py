"""Booting warm spares: the placement lock, and the move of chosen spares to `booting`.

`boot_spares` picks warm spares (fleet/provisioning/placement.py) and moves them to `booting`
under one placement lock, so the rack-headroom check and the commitment are atomic across
processes; the tick (fleet/provisioning/tick.py) then powers them on. An operator's
`spares boot` and the tick's own replacements both come here. Placement prefers a spare whose
agent last reported the deployment's version `ready` in its weights cache; the boot's
`server.transition` Event says which spare and why ("version llama@v2 cached, …"), and
`start_boot` records whether the boot began with the version cached (`boot_cache_hit`), so
its boot-to-ready is measured per cache state (fleet/provisioning/boot_times.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.catalog.refs import (
    artifacts_of,
    holds_ready,
    is_external,
    key_for_id,
    key_of,
    server_version_id,
)
from fleet.control import wakeups
from fleet.errors import FleetError, NotFoundError
from fleet.inventory.servers import NO_PASSWORD
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, ModelVersion, Pool, Rack, Server, Site, utcnow

# The placement lock (the headroom check and the commitment, atomic across processes) is the
# budget gate's: one lock for every path that raises a rack's draw. Re-exported for the tick.
from fleet.power.gate import PLACEMENT_LOCK as PLACEMENT_LOCK
from fleet.power.gate import placement_lock as placement_lock
from fleet.power.racks import commit_watts, rack_views
from fleet.provisioning import placement
from fleet.provisioning.boot_times import BootQuantile, boot_figures
from fleet.settings import Settings

S = ServerState
# Servers that hold (or are about to hold) a deployment's replicas.
ACTIVE = frozenset({S.BOOTING, S.LOADING, S.SERVING})


# ---------------------------------------------------------------------------------------------
# Booting spares


@dataclass(frozen=True, slots=True)
class BootResult:
    deployment: str
    booted: tuple[str, ...]
    short: int
    reasons: tuple[str, ...]


def ready_keys(server: Server) -> tuple[str, ...]:
    """The version keys its agent last reported verified in its weights cache. A warm spare's
    report is the one from before it powered off: the disk kept them."""
    return tuple(
        str(e["key"])
        for e in server.cache_entries or ()
        if isinstance(e, dict) and e.get("state") == "ready" and e.get("key")
    )


def want_for(session: Session, deployment: Deployment, servers: int) -> placement.Want:
    """What placement is asked for `servers` more servers of the deployment: its version's
    key is what a spare's cache should hold (none for an external version: no spare ever
    fetches or holds it)."""
    version = (
        session.get(ModelVersion, deployment.model_version_id)
        if deployment.model_version_id is not None
        else None
    )
    external = version is not None and is_external(artifacts_of(session, version))
    return placement.Want(
        deployment=deployment.name,
        model="" if external or version is None else key_of(version),
        gpu_models=tuple(deployment.gpu_models),
        gpus_per_replica=deployment.gpus_per_replica,
        servers=servers,
        running_per_rack=_running_per_rack(session, deployment),
    )


def warm_spares(session: Session, *, settings: Settings | None = None) -> list[placement.Spare]:
    """Every warm spare that could be powered on. Its `max_w` is what it commits once on
    (fleet/power/racks.py `commit_watts`): in a `measured` rack its measured draw × margin,
    so placement packs more of them under the same budget."""
    rows = list(
        session.exec(
            select(Server, Rack, Site.name)
            .join(Rack, col(Rack.id) == Server.rack_id)
            .join(Site, col(Site.id) == Rack.site_id)
            .where(Server.state == S.WARM, Server.pool == Pool.WARM)
            # No BMC password (dropped when its BMC moved): it could not be powered on.
            .where(Server.bmc_password_encrypted != NO_PASSWORD)
        )
    )
    commits = commit_watts(session, ((s, rack) for s, rack, _ in rows), settings=settings)
    return [
        placement.Spare(
            name=s.name,
            site=site,
            rack=rack.name,
            gpu_model=s.gpu_model,
            gpu_count=s.gpu_count,
            standby_w=s.standby_w,
            max_w=commits[s.name],
            cached=ready_keys(s),
            boot_to_ready_s=s.boot_to_ready_s,
            boot_cached_s=s.boot_to_ready_cached_s,
            boot_uncached_s=s.boot_to_ready_uncached_s,
        )
        for s, rack, site in rows
    ]


def rack_rooms(
    session: Session, *, settings: Settings | None = None
) -> dict[str, placement.RackRoom]:
    """Every rack's power headroom, as placement weighs it: budget less the larger of what
    the rack committed and what it draws now, so a rack drawing its whole budget or more
    takes no boot (fleet/power/caps.py, `admits_boot`)."""
    return {
        v.rack.name: placement.RackRoom(
            rack=v.rack.name, site=v.site, headroom_w=v.power.headroom_w
        )
        for v in rack_views(session, settings=settings, with_history=False)
    }


def _running_per_rack(session: Session, deployment: Deployment) -> dict[str, int]:
    rows = session.exec(
        select(Rack.name, sa.func.count())
        .select_from(Server)
        .join(Rack, col(Rack.id) == Server.rack_id)
        .where(Server.deployment_id == deployment.id, col(Server.state).in_(list(ACTIVE)))
        .group_by(Rack.name)
    )
    return {rack: int(n) for rack, n in rows}


def boot_spares(
    engine: Engine,
    deployment_name: str,
    count: int,
    actor: str,
    *,
    raise_target: bool,
    settings: Settings | None = None,
) -> BootResult:
    """Pick `count` warm spares for the deployment and move them to `booting`, one atomic
    placement each. `raise_target`: an operator asked for more capacity (the target grows by
    what booted); the tick's own replacements leave the target as it is."""
    if count < 1:
        raise FleetError("count must be at least 1")
    settings = settings or Settings()
    default_boot_s = settings.boot_estimate_s
    how = BootQuantile.of(settings)
    booted: list[str] = []
    reasons: tuple[str, ...] = ()
    for _ in range(count):
        with Session(engine) as session, placement_lock(session):
            deployment = _deployment(session, deployment_name)
            want = want_for(session, deployment, 1)
            spares = warm_spares(session)
            choice = placement.choose_spares(spares, rack_rooms(session), want)
            if not choice.chosen:
                reasons = choice.reasons
                session.rollback()
                break
            name = choice.chosen[0]
            spare = next(s for s in spares if s.name == name)
            cached = placement.holds(spare, want)
            boot = placement.expected_boot_s(
                spare.gpu_model, cached, boot_figures(session, how), default_boot_s
            )
            server = session.exec(select(Server).where(Server.name == name)).one()
            if raise_target:
                # Before start_boot, whose wake-up bump flushes it: every transaction takes
                # the wakeup row last, so none waits on it while holding what another needs.
                deployment.target_servers += 1
                session.add(deployment)
            start_boot(
                session,
                server,
                deployment,
                "power_on",
                actor,
                f"scale out {deployment.name}: spare chosen by placement "
                f"({placement.why(spare, want, boot=boot, named=False)})",
                details={
                    "placement": placement.why(spare, want, boot=boot),
                    "version": want.model or None,
                    "version_cached": cached,
                    "expected_boot_s": round(boot[0], 1),
                },
            )
            session.commit()
            booted.append(name)
    return BootResult(deployment_name, tuple(booted), count - len(booted), reasons)


def _deployment(session: Session, name: str) -> Deployment:
    deployment = session.exec(select(Deployment).where(Deployment.name == name)).first()
    if deployment is None:
        raise NotFoundError(f"no deployment named {name!r}")
    return deployment


def start_boot(
    session: Session,
    server: Server,
    deployment: Deployment | None,
    kind: str,
    actor: str,
    reason: str,
    *,
    details: dict[str, Any] | None = None,
) -> None:
    """`server` → booting for `deployment` (None: no deployment yet), its boot bookkeeping
    reset; `kind` says how the tick boots it ("power_on", "cycle", "resume", or "stage": a
    warm spare powered on to fetch a version, fleet/provisioning/staging.py). Whether the
    boot begins with its version ready in its cache is recorded (`boot_cache_hit`; None with
    no deployment), so that its boot-to-ready counts for that cache state."""
    lifecycle.transition(session, server, S.BOOTING, actor, reason, details, commit=False)
    now = utcnow()
    server.boot_kind = kind
    server.boot_started_at = now
    server.power_on_sent_at = None
    server.power_off_sent_at = None
    server.failed_reason = None
    server.drain_reason = None
    if deployment is not None:
        server.deployment_id = deployment.id
    server.boot_cache_hit = cache_hit(session, server, deployment)
    session.add(server)
    wakeups.request(session)  # its power-on is the provisioner's next step: now, not next tick


def cache_hit(session: Session, server: Server, deployment: Deployment | None) -> bool | None:
    """Whether `server` holds the version it is about to serve ready in its cache (None: it
    serves nothing yet)."""
    if deployment is None:
        return None
    key = key_for_id(session, server_version_id(server, deployment))
    return key is not None and holds_ready(server, key)
