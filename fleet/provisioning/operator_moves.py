"""Operator views and moves: the warm pool as placement sees it, drain and undrain.

The moves only change what the database says; the tick (fleet/provisioning/tick.py) carries
them out (an undrained server boots with `resume`, a drained one waits for the operator).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from fleet.control import wakeups
from fleet.errors import ConflictError, NotFoundError
from fleet.events import server_event
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Rack, Server, Site, utcnow
from fleet.power.racks import commit_watts
from fleet.provisioning import placement
from fleet.provisioning.boots import rack_rooms, start_boot

S = ServerState


def servers_named(session: Session, names: Sequence[str]) -> list[Server]:
    rows = list(session.exec(select(Server).where(col(Server.name).in_(list(names)))))
    missing = sorted(set(names) - {r.name for r in rows})
    if missing:
        raise NotFoundError(f"no server named {', '.join(repr(n) for n in missing)}")
    return rows


def warm_pool(session: Session) -> dict[str, object]:
    """Warm spares per site and GPU model, each with the watts booting it would commit."""
    rooms = rack_rooms(session)
    rows = list(
        session.exec(
            select(Server, Rack, Site.name)
            .join(Rack, col(Rack.id) == Server.rack_id)
            .join(Site, col(Site.id) == Rack.site_id)
            .where(Server.state == S.WARM)
            .order_by(col(Site.name), col(Server.gpu_model), col(Server.name))
        )
    )
    # What each would commit once on: its maximum, or its measured commitment in a measured
    # rack (placement weighs it the same way, fleet/provisioning/boots.py).
    commits = commit_watts(session, ((server, rack) for server, rack, _ in rows))
    groups: dict[tuple[str, str], list[dict[str, object]]] = {}
    for server, rack_row, site in rows:
        rack = rack_row.name
        spare = placement.Spare(
            name=server.name,
            site=site,
            rack=rack,
            gpu_model=server.gpu_model,
            gpu_count=server.gpu_count,
            standby_w=server.standby_w,
            max_w=commits[server.name],
        )
        groups.setdefault((site, server.gpu_model), []).append(
            {
                "server": server.name,
                "rack": rack,
                "gpus": server.gpu_count,
                "boot_cost_w": placement.extra_draw_w(spare),
                "rack_headroom_w": round(rooms[rack].headroom_w, 1),
                "fits": placement.fits(spare, rooms[rack]),
                "boot_to_ready_s": server.boot_to_ready_s,
                # The versions its agent last reported verified in its cache.
                "versions_cached": sorted(
                    str(e["key"])
                    for e in server.cache_entries or ()
                    if isinstance(e, dict) and e.get("state") == "ready" and e.get("key")
                ),
            }
        )
    return {
        "count": sum(len(v) for v in groups.values()),
        "pools": [
            {"site": site, "gpu_model": model, "count": len(spares), "spares": spares}
            for (site, model), spares in groups.items()
        ],
    }


def _view(server: Server) -> dict[str, object]:
    return {"server": server.name, "state": server.state.value, "drain_reason": server.drain_reason}


def _said(what: str, why: str | None) -> str:
    return f"{what}: {why}" if why else what


def operator_drain(
    session: Session, name: str, actor: str, why: str | None = None
) -> dict[str, object]:
    """Serving → draining, to wait drained for the operator (`why`: their reason, recorded)."""
    [server] = servers_named(session, [name])
    if server.state != S.SERVING:
        raise ConflictError(f"server {name} is {server.state.value}: only a serving server drains")
    said = _said("drained by an operator", why)
    lifecycle.transition(session, server, S.DRAINING, actor, said, commit=False)
    server.drain_reason, server.drain_started_at = "operator", utcnow()
    session.add(server)
    wakeups.request(session)
    session.commit()
    return _view(server)


def operator_undrain(
    session: Session, name: str, actor: str, why: str | None = None
) -> dict[str, object]:
    """Back to loading: now from drained, once drained from draining; either way an Event
    saying who and why."""
    [server] = servers_named(session, [name])
    if server.state == S.DRAINING:
        server.drain_reason = "resume"  # once drained, it loads again
        session.add(server)
        said = _said("undrained by an operator: loads again once drained", why)
        session.add(server_event(server.name, actor, "server.undrain", said))
        wakeups.request(session)
        session.commit()
        return _view(server)
    if server.state != S.DRAINED or server.drain_reason not in ("operator", "resume", "probe"):
        raise ConflictError(
            f"server {name} is {server.state.value}"
            + (f" ({server.drain_reason})" if server.drain_reason else "")
            + ": undrain applies to a server an operator drained"
        )
    deployment = session.get(Deployment, server.deployment_id) if server.deployment_id else None
    start_boot(session, server, deployment, "resume", actor, _said("undrained by an operator", why))
    session.commit()
    return _view(server)
