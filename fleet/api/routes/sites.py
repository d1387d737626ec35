"""Sites, racks (with power budget, committed draw and headroom) and power feeds."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter
from sqlmodel import Session, col, select

from fleet.api.deps import PagingDep, SessionDep, Viewer
from fleet.errors import NotFoundError
from fleet.models import PowerFeed, PowerFeedPublic, Rack, RackPublic, Server, Site, SitePublic
from fleet.racks import RackView, rack_views, usable_watts

router = APIRouter(tags=["inventory"])


def _sites(session: Session, name: str | None = None) -> list[SitePublic]:
    rack_counts = dict(
        session.exec(select(Rack.site_id, sa.func.count()).group_by(col(Rack.site_id))).all()
    )
    server_counts = dict(
        session.exec(
            select(Rack.site_id, sa.func.count()).join(Server).group_by(col(Rack.site_id))
        ).all()
    )
    query = select(Site).order_by(col(Site.name))
    if name is not None:
        query = query.where(Site.name == name)
    return [
        SitePublic(
            **s.model_dump(exclude={"id"}),
            rack_count=rack_counts.get(s.id or -1, 0),
            server_count=server_counts.get(s.id or -1, 0),
        )
        for s in session.exec(query)
    ]


@router.get("/sites")
def list_sites(_: Viewer, session: SessionDep, paging: PagingDep) -> dict[str, Any]:
    sites = _sites(session)
    return paging.page(len(sites), sites[paging.offset : paging.offset + paging.limit])


@router.get("/sites/{name}")
def get_site(name: str, _: Viewer, session: SessionDep) -> SitePublic:
    sites = _sites(session, name)
    if not sites:
        raise NotFoundError(f"no site named {name!r}")
    return sites[0]


def _rack_public(view: RackView) -> RackPublic:
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


@router.get("/racks")
def list_racks(
    _: Viewer, session: SessionDep, paging: PagingDep, site: str | None = None
) -> dict[str, Any]:
    racks = [_rack_public(v) for v in rack_views(session, site=site)]
    return paging.page(len(racks), racks[paging.offset : paging.offset + paging.limit])


@router.get("/racks/{name}")
def get_rack(name: str, _: Viewer, session: SessionDep) -> RackPublic:
    views = rack_views(session, rack=name)
    if not views:
        raise NotFoundError(f"no rack named {name!r}")
    return _rack_public(views[0])


@router.get("/feeds")
def list_feeds(
    _: Viewer, session: SessionDep, paging: PagingDep, rack: str | None = None
) -> dict[str, Any]:
    query = select(PowerFeed, Rack.name).join(Rack).order_by(col(Rack.name), col(PowerFeed.name))
    if rack is not None:
        query = query.where(Rack.name == rack)
    feeds = [
        PowerFeedPublic(
            **f.model_dump(exclude={"id", "rack_id"}), rack=r, usable_w=round(usable_watts(f), 1)
        )
        for f, r in session.exec(query)
    ]
    return paging.page(len(feeds), feeds[paging.offset : paging.offset + paging.limit])
