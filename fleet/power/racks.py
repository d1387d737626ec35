"""Rack power as the fleet sees it now: feeds and server states from the database,
arithmetic from fleet.power.budget."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.lifecycle.states import draws_max_power
from fleet.models import PowerFeed, Rack, Server, Site, as_utc, utcnow
from fleet.power.budget import Feed, RackPower, ServerDraw, feed_watts, rack_power


@dataclass(frozen=True, slots=True)
class RackView:
    rack: Rack
    site: str
    feeds: int
    servers: int
    power: RackPower


def to_feed(row: PowerFeed) -> Feed:
    return Feed(row.side, row.volts, row.amps, row.phase, row.max_utilisation_pct)


def usable_watts(row: PowerFeed) -> float:
    return feed_watts(to_feed(row))


def rack_views(
    session: Session,
    site: str | None = None,
    rack: str | None = None,
    *,
    now: datetime | None = None,
) -> list[RackView]:
    """Every rack (or the one asked) with its power: a server counts as on when its state or
    its BMC says so, or while the budget gate's write-ahead commitment holds
    (`power_committed_until`, fleet/power/gate.py)."""
    now = now or utcnow()
    query = select(Rack, Site.name).join(Site).order_by(col(Rack.name))
    if site is not None:
        query = query.where(Site.name == site)
    if rack is not None:
        query = query.where(Rack.name == rack)
    racks = list(session.exec(query))
    ids = [r.id for r, _ in racks]
    feeds: dict[int, list[Feed]] = {}
    for f in session.exec(select(PowerFeed).where(col(PowerFeed.rack_id).in_(ids))):
        feeds.setdefault(f.rack_id, []).append(to_feed(f))
    draws: dict[int, list[ServerDraw]] = {}
    columns = (
        Server.rack_id,
        Server.max_w,
        Server.standby_w,
        Server.state,
        Server.power_state,
        Server.power_committed_until,
    )
    rows = session.connection().execute(
        sa.select(*(col(c) for c in columns)).where(col(Server.rack_id).in_(ids))
    )
    for row in rows:
        committed = (
            row.power_committed_until is not None and as_utc(row.power_committed_until) > now
        )
        on = committed or draws_max_power(row.state, row.power_state)
        draws.setdefault(row.rack_id, []).append(ServerDraw(row.max_w, row.standby_w, on=on))
    out = []
    for r, site_name in racks:
        assert r.id is not None
        out.append(
            RackView(
                rack=r,
                site=site_name,
                feeds=len(feeds.get(r.id, [])),
                servers=len(draws.get(r.id, [])),
                power=rack_power(feeds.get(r.id, []), draws.get(r.id, [])),
            )
        )
    return out
