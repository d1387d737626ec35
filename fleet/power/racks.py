"""Rack power as the fleet sees it now: feeds and server states from the database,
arithmetic from fleet.power.budget, measured draw and its history from fleet.power.history.

A rack in `measured` mode commits each powered server at its measured p99 draw × the rack's
margin (`budget.measured_commit_w`); one in `nameplate` mode at its maximum. Either way the
rack's headroom counts what it draws now when that is more than what it committed, so at
100 % drawn no boot fits (fleet/power/caps.py, `admits_boot`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select
from sqlmodel.sql.expression import Select

from fleet.lifecycle.states import draws_max_power
from fleet.models import BudgetMode, PowerFeed, Rack, Server, Site, as_utc, utcnow
from fleet.power import history
from fleet.power.budget import (
    Feed,
    RackPower,
    ServerDraw,
    feed_watts,
    measured_commit_w,
    rack_power,
)
from fleet.settings import Settings, get_settings

# A server's last reading counts towards its rack's drawn power while it is younger than this
# many reconcile intervals: one missed read is noise, three mean the reading is stale.
FRESH_INTERVALS = 3


@dataclass(frozen=True, slots=True)
class RackView:
    rack: Rack
    site: str
    feeds: int
    servers: int
    power: RackPower  # power.drawn_w: Σ fresh readings now (None: no server has one)
    drawn_estimated_w: float = 0.0  # the part of drawn_w that is agent-based estimates
    peak_24h_w: float | None = None  # the rack's largest bucket over 24 h (history)
    p99_7d_w: float | None = None  # p99 of its buckets over 7 days

    @property
    def drawn_w(self) -> float | None:
        return self.power.drawn_w


@dataclass(frozen=True, slots=True)
class Commitment:
    """What a server's measured commitment is worked out from (its rack's margin)."""

    name: str
    idle_w: float
    max_w: float
    margin: float


def to_feed(row: PowerFeed) -> Feed:
    return Feed(row.side, row.volts, row.amps, row.phase, row.max_utilisation_pct)


def usable_watts(row: PowerFeed) -> float:
    return feed_watts(to_feed(row))


def drawn_fresh_s(settings: Settings) -> float:
    """How long a stored drawn_w counts as the server's draw now, for the rack view, the valve
    and the agent-based estimate alike. A live BMC's reading is rewritten at least every other
    sweep (fleet/power/measure.py `rewrite_after_s`), so one older than this means the BMC
    stopped giving readings: the estimate may then take over, and the rack's draw leaves it
    out."""
    return FRESH_INTERVALS * settings.reconcile_interval_s


def is_fresh(drawn_at: datetime | None, now: datetime, settings: Settings) -> bool:
    """Whether a reading taken at `drawn_at` still says what the server draws now."""
    if drawn_at is None:
        return False
    return as_utc(drawn_at) > now - timedelta(seconds=drawn_fresh_s(settings))


def measured_commits(
    session: Session, servers: Iterable[Commitment], *, now: datetime, settings: Settings
) -> dict[str, float]:
    """What each server would commit while on in a `measured` rack: its p99 draw over
    `power_measured_window_s` × margin, within [idle, max]; its maximum until
    `power_measured_min_s` of history exists."""
    servers = list(servers)
    if not servers:
        return {}
    p99s = history.server_p99(
        session, [s.name for s in servers], now, settings.power_measured_window_s
    )
    out: dict[str, float] = {}
    for s in servers:
        p99, history_s = p99s.get(s.name, (None, 0.0))
        out[s.name] = measured_commit_w(
            p99,
            history_s,
            margin=s.margin,
            idle_w=s.idle_w,
            max_w=s.max_w,
            min_history_s=settings.power_measured_min_s,
        )
    return out


def commit_watts(
    session: Session,
    servers: Iterable[tuple[Server, Rack]],
    *,
    now: datetime | None = None,
    settings: Settings | None = None,
) -> dict[str, float]:
    """server name → what it commits while on, by its rack's budget mode: its maximum in a
    `nameplate` rack, its measured commitment in a `measured` one. What placement weighs a
    spare at, and what a power-on through the gate needs (less the standby it draws now)."""
    pairs = list(servers)
    commits = measured_commits(
        session,
        (
            Commitment(s.name, s.idle_w, s.max_w, rack.budget_margin)
            for s, rack in pairs
            if rack.budget_mode == BudgetMode.MEASURED
        ),
        now=now or utcnow(),
        settings=settings or get_settings(),
    )
    return {s.name: commits.get(s.name, s.max_w) for s, _ in pairs}


def racks_query(site: str | None = None, rack: str | None = None) -> Select[Rack, str]:
    """(Rack, site name) of `site`'s racks (all: None), or of the one named `rack`."""
    query = select(Rack, Site.name).join(Site)
    if site is not None:
        query = query.where(Site.name == site)
    if rack is not None:
        query = query.where(Rack.name == rack)
    return query


def rack_views(
    session: Session,
    site: str | None = None,
    rack: str | None = None,
    *,
    now: datetime | None = None,
    settings: Settings | None = None,
    with_history: bool = True,
    offset: int = 0,
    limit: int | None = None,
) -> list[RackView]:
    """Every rack (or the one asked; or the page `offset`, `limit` of them in name order: a
    page's racks are read and computed, not the site's) with its power: a server counts as on
    when its state or its BMC says so, or while the budget gate's write-ahead commitment holds
    (`power_committed_until`, fleet/power/gate.py); on, it commits its maximum in a
    `nameplate` rack and its measured commitment in a `measured` one. Drawn power sums the
    servers' fresh readings; peak and p99 come from the rack's stored history, read only
    `with_history` (the views people read; placement and the gate, which run under the
    placement lock, need headroom only)."""
    now = now or utcnow()
    settings = settings or get_settings()
    query = racks_query(site, rack).order_by(col(Rack.name))
    racks = list(session.exec(query.offset(offset).limit(limit)))
    by_id = {r.id: r for r, _ in racks}
    ids = list(by_id)
    feeds: dict[int, list[Feed]] = {}
    for f in session.exec(select(PowerFeed).where(col(PowerFeed.rack_id).in_(ids))):
        feeds.setdefault(f.rack_id, []).append(to_feed(f))
    columns = (
        Server.name,
        Server.rack_id,
        Server.idle_w,
        Server.max_w,
        Server.standby_w,
        Server.state,
        Server.power_state,
        Server.power_committed_until,
        Server.drawn_w,
        Server.drawn_source,
        Server.drawn_at,
    )
    rows = list(
        session.connection().execute(
            sa.select(*(col(c) for c in columns)).where(col(Server.rack_id).in_(ids))
        )
    )
    on: dict[str, bool] = {}
    for row in rows:
        committed = (
            row.power_committed_until is not None and as_utc(row.power_committed_until) > now
        )
        on[row.name] = committed or draws_max_power(row.state, row.power_state)
    commits = measured_commits(
        session,
        (
            Commitment(row.name, row.idle_w, row.max_w, by_id[row.rack_id].budget_margin)
            for row in rows
            if on[row.name] and by_id[row.rack_id].budget_mode == BudgetMode.MEASURED
        ),
        now=now,
        settings=settings,
    )
    draws: dict[int, list[ServerDraw]] = {}
    drawn: dict[int, float] = {}
    estimated: dict[int, float] = {}
    for row in rows:
        draws.setdefault(row.rack_id, []).append(
            ServerDraw(row.max_w, row.standby_w, on=on[row.name], commit_w=commits.get(row.name))
        )
        if row.drawn_w is not None and is_fresh(row.drawn_at, now, settings):
            drawn[row.rack_id] = drawn.get(row.rack_id, 0.0) + row.drawn_w
            if row.drawn_source == "estimate":
                estimated[row.rack_id] = estimated.get(row.rack_id, 0.0) + row.drawn_w
    histories: Mapping[str, history.RackHistory] = (
        history.rack_history(session, [r.name for r, _ in racks], now, settings)
        if racks and with_history
        else {}
    )
    out = []
    for r, site_name in racks:
        assert r.id is not None
        past = histories.get(r.name)
        out.append(
            RackView(
                rack=r,
                site=site_name,
                feeds=len(feeds.get(r.id, [])),
                servers=len(draws.get(r.id, [])),
                power=rack_power(feeds.get(r.id, []), draws.get(r.id, []), drawn.get(r.id)),
                drawn_estimated_w=estimated.get(r.id, 0.0),
                peak_24h_w=past.peak_24h_w if past else None,
                p99_7d_w=past.p99_7d_w if past else None,
            )
        )
    return out
