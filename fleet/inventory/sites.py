"""Sites, rack views and power feeds as the API shows them (rack power itself:
fleet/power/racks.py)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.errors import NotFoundError
from fleet.models import PowerFeed, PowerFeedPublic, Rack, RackPublic, Server, Site, SitePublic
from fleet.power.racks import RackView, rack_views, usable_watts


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


def rack_public(view: RackView) -> RackPublic:
    return RackPublic(
        **view.rack.model_dump(exclude={"id", "site_id", "created_at", "updated_at"}),
        site=view.site,
        feeds=view.feeds,
        servers=view.servers,
        budget_w=round(view.power.budget_w, 1),
        committed_w=round(view.power.committed_w, 1),
        headroom_w=round(view.power.headroom_w, 1),
        all_on_w=round(view.power.all_on_w, 1),
    )


def list_racks(session: Session, site: str | None = None) -> list[RackPublic]:
    return [rack_public(v) for v in rack_views(session, site=site)]


def get_rack(session: Session, name: str) -> RackPublic:
    views = rack_views(session, rack=name)
    if not views:
        raise NotFoundError(f"no rack named {name!r}")
    return rack_public(views[0])


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
