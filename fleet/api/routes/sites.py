"""Sites, racks (with power budget, committed and drawn power, headroom) and power feeds;
an operator's edit of a rack's budget mode and margin.

Sites and feeds are small tables and page in memory; racks page in SQL (each listed rack's
power figures are computed, and 10,000 servers fill ~1,500 racks).
"""

from __future__ import annotations

from fastapi import APIRouter

from fleet.api.deps import Operator, PagingDep, SessionDep, SettingsDep, Viewer
from fleet.api.responses import Page
from fleet.inventory import sites as service
from fleet.models import PowerFeedPublic, RackPublic, RackUpdate, SitePublic

router = APIRouter(tags=["inventory"])


@router.get("/sites")
def list_sites(_: Viewer, session: SessionDep, paging: PagingDep) -> Page[SitePublic]:
    return paging.slice(service.list_sites(session))


@router.get("/sites/{name}")
def get_site(name: str, _: Viewer, session: SessionDep) -> SitePublic:
    return service.get_site(session, name)


@router.get("/racks")
def list_racks(
    _: Viewer,
    session: SessionDep,
    settings: SettingsDep,
    paging: PagingDep,
    site: str | None = None,
) -> Page[RackPublic]:
    # Paged in SQL: a page's racks are the ones whose power figures are computed.
    total = service.count_racks(session, site)
    shown = service.list_racks(
        session, site, settings=settings, offset=paging.offset, limit=paging.limit
    )
    return paging.page(total, shown)


@router.get("/racks/{name}")
def get_rack(name: str, _: Viewer, session: SessionDep, settings: SettingsDep) -> RackPublic:
    return service.get_rack(session, name, settings=settings)


@router.patch("/racks/{name}")
def edit_rack(
    name: str, update: RackUpdate, user: Operator, session: SessionDep, settings: SettingsDep
) -> RackPublic:
    """Set how the rack's servers commit power: `budget_mode` nameplate (their maximum) or
    measured (their p99 draw × `budget_margin`, 1.0-2.0; docs/power.md). 422 names the field
    of a value that makes no sense."""
    return service.update_rack(session, name, update, user.actor, settings=settings)


@router.get("/feeds")
def list_feeds(
    _: Viewer, session: SessionDep, paging: PagingDep, rack: str | None = None
) -> Page[PowerFeedPublic]:
    return paging.slice(service.list_feeds(session, rack))
