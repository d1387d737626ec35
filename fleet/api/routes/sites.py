"""Sites, racks (with power budget, committed draw and headroom) and power feeds.

These tables are small (hundreds of rows, not thousands), so the lists page in memory.
"""

from __future__ import annotations

from fastapi import APIRouter

from fleet.api.deps import PagingDep, SessionDep, Viewer
from fleet.api.responses import Page
from fleet.inventory import sites as service
from fleet.models import PowerFeedPublic, RackPublic, SitePublic

router = APIRouter(tags=["inventory"])


@router.get("/sites")
def list_sites(_: Viewer, session: SessionDep, paging: PagingDep) -> Page[SitePublic]:
    return paging.slice(service.list_sites(session))


@router.get("/sites/{name}")
def get_site(name: str, _: Viewer, session: SessionDep) -> SitePublic:
    return service.get_site(session, name)


@router.get("/racks")
def list_racks(
    _: Viewer, session: SessionDep, paging: PagingDep, site: str | None = None
) -> Page[RackPublic]:
    return paging.slice(service.list_racks(session, site))


@router.get("/racks/{name}")
def get_rack(name: str, _: Viewer, session: SessionDep) -> RackPublic:
    return service.get_rack(session, name)


@router.get("/feeds")
def list_feeds(
    _: Viewer, session: SessionDep, paging: PagingDep, rack: str | None = None
) -> Page[PowerFeedPublic]:
    return paging.slice(service.list_feeds(session, rack))
