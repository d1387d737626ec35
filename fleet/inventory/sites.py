"""Sites, rack views and power feeds as the API shows them (rack power itself:
fleet/power/racks.py)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.errors import NotFoundError
from fleet.events import record_update, set_fields
from fleet.models import (
    PowerFeed,
    PowerFeedPublic,
    Rack,
    RackPublic,
    RackUpdate,
    Server,
    Site,
    SitePublic,
)
from fleet.power.racks import RackView, rack_views, racks_query, usable_watts
from fleet.provisioning.boots import placement_lock
from fleet.settings import Settings


def list_sites(session: Session, name: str | None = None) -> list[SitePublic]:
    """Every site (or the one named) with its rack and server counts."""
    sites = select(Site).order_by(col(Site.name))
    racks = select(Rack.site_id, sa.func.count()).group_by(col(Rack.site_id))
    servers = select(Rack.site_id, sa.func.count()).join(Server).group_by(col(Rack.site_id))
    if name is not None:
        sites = sites.where(Site.name == name)
        racks = racks.join(Site).where(Site.name == name)
        servers = servers.join(Site).where(Site.name == name)
    rack_counts = dict(session.exec(racks).all())
    server_counts = dict(session.exec(servers).all())
    return [
        SitePublic(
            **s.model_dump(exclude={"id"}),
            rack_count=rack_counts.get(s.id or -1, 0),
            server_count=server_counts.get(s.id or -1, 0),
        )
        for s in session.exec(sites)
    ]


def get_site(session: Session, name: str) -> SitePublic:
    sites = list_sites(session, name)
    if not sites:
        raise NotFoundError(f"no site named {name!r}")
    return sites[0]


def _w(watts: float | None) -> float | None:
    return None if watts is None else round(watts, 1)


def rack_public(view: RackView) -> RackPublic:
    rack = view.rack
    return RackPublic(
        name=rack.name,
        u_height=rack.u_height,
        status=rack.status,
        description=rack.description,
        budget_mode=rack.budget_mode,
        budget_margin=rack.budget_margin,
        site=view.site,
        feeds=view.feeds,
        servers=view.servers,
        budget_w=round(view.power.budget_w, 1),
        committed_w=round(view.power.committed_w, 1),
        headroom_w=round(view.power.headroom_w, 1),
        all_on_w=round(view.power.all_on_w, 1),
        drawn_w=_w(view.drawn_w),
        drawn_estimated_w=round(view.drawn_estimated_w, 1),
        peak_24h_w=_w(view.peak_24h_w),
        p99_7d_w=_w(view.p99_7d_w),
        budget_override_reason=rack.budget_override_reason,
        budget_override_by=rack.budget_override_by,
        budget_override_at=rack.budget_override_at,
        gpu_cap_pct=rack.gpu_cap_pct,
    )


def count_racks(session: Session, site: str | None = None) -> int:
    """How many racks `list_racks` lists for `site` (all sites: None)."""
    return int(
        session.exec(select(sa.func.count()).select_from(racks_query(site).subquery())).one()
    )


def list_racks(
    session: Session,
    site: str | None = None,
    *,
    settings: Settings | None = None,
    offset: int = 0,
    limit: int | None = None,
) -> list[RackPublic]:
    """The racks of `site` (all: None) by name, `offset`, `limit` of them (a page is computed
    alone: at 10,000 servers every rack's power figures took most of a page's time)."""
    views = rack_views(session, site=site, settings=settings, offset=offset, limit=limit)
    return [rack_public(v) for v in views]


def get_rack(session: Session, name: str, *, settings: Settings | None = None) -> RackPublic:
    views = rack_views(session, rack=name, settings=settings)
    if not views:
        raise NotFoundError(f"no rack named {name!r}")
    return rack_public(views[0])


def update_rack(
    session: Session,
    name: str,
    update: RackUpdate,
    actor: str,
    *,
    settings: Settings | None = None,
) -> RackPublic:
    """Apply an operator's edit of a rack's budget mode or margin, recorded as an Event naming
    the fields changed. Under the placement lock, so that an admission by the gate or a
    placement (which hold it) weighs the rack by the old mode or the new one, never both."""
    with placement_lock(session):
        rack = session.exec(select(Rack).where(Rack.name == name)).one_or_none()
        if rack is None:
            raise NotFoundError(f"no rack named {name!r}")
        before = {"budget_mode": str(rack.budget_mode), "budget_margin": rack.budget_margin}
        changed = set_fields(rack, update.model_dump(exclude_unset=True))
        after = {"budget_mode": str(rack.budget_mode), "budget_margin": rack.budget_margin}
        # Mode and margin are not secrets: the event says what they were and are.
        shown = ", ".join(f"{f} {before[f]} → {after[f]}" for f in changed)
        message = f"updated through the API: {shown}"
        record_update(session, rack, "rack", name, changed, actor, message)
        session.commit()
    return get_rack(session, name, settings=settings)


def list_feeds(session: Session, rack: str | None = None) -> list[PowerFeedPublic]:
    query = select(PowerFeed, Rack.name).join(Rack).order_by(col(Rack.name), col(PowerFeed.name))
    if rack is not None:
        query = query.where(Rack.name == rack)
    return [
        PowerFeedPublic(
            **f.model_dump(exclude={"id", "rack_id"}), rack=r, usable_w=round(usable_watts(f), 1)
        )
        for f, r in session.exec(query)
    ]
