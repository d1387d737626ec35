"""The cap valve's pass: each rack's drawn power against its budget, GPU power limits out.

One pass (`run_valve`, a leader loop: fleet/control/service_loops.py) reads every budgeted
rack's drawn power now — what `fleetctl racks` shows (fleet/power/racks.py): the sum of its
servers' fresh readings, BMC or else the agent-based estimate — and asks fleet/power/caps.py's
rule for the rack's next cap. It reads only feeds and readings (a few grouped queries), not the
commitments and history the rack view works out: it runs every 15 s at 10k servers.

A changed cap is written on the rack with one `rack.gpu_cap` Event, and on each of the rack's
loading or serving GPU servers as `gpu_power_limit_w` (cap × the GPU's TDP; None when
uncapped), which the agent reads from its heartbeat reply and sets through NVML. A server that
starts serving in a capped rack gets the rack's limit on the next pass; servers in other states
are left alone (no agent to obey, or one on its way out).

The rule acts on the draw it sees, and a cap reaches the GPUs only at the agents' next heartbeat
and shows in the draw only at the next reading. So after a change a rack is decided again only
once every reading summed is newer than the change plus a heartbeat: without that, a 15 s pass
on 60 s BMC readings would step a rack to its floor on one stale peak. The wait is bounded: a
reading older than `racks.FRESH_INTERVALS` reconciler intervals is not summed at all.

The valve runs while the autopilot is paused: a cap protects a breaker, it boots, drains and
cycles nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, func, select

from fleet.lifecycle.states import ServerState
from fleet.models import Event, GpuModelSpec, PowerFeed, Rack, Server, as_utc, utcnow
from fleet.power.budget import Feed, rack_budget
from fleet.power.caps import next_cap_pct
from fleet.power.gate import clear_settled_overrides
from fleet.power.racks import drawn_fresh_s, to_feed
from fleet.settings import Settings
from fleet_core.gpus import GPUS, gpu_spec

log = logging.getLogger(__name__)

ACTOR = "valve"
# The states whose agent runs and obeys a limit: a loading server's first prefill is as hot as
# a serving one's.
CAPPED_STATES = (ServerState.LOADING, ServerState.SERVING)


@dataclass(frozen=True, slots=True)
class RackDraw:
    """A rack's drawn power now: the sum of its servers' fresh readings, how many there are,
    and when the oldest of them was taken."""

    drawn_w: float
    readings: int
    oldest_at: datetime


def settled(changed_at: datetime | None, oldest_reading_at: datetime, grace_s: float) -> bool:
    """Whether every reading summed was taken after the last cap change reached the agents
    (`grace_s`: one heartbeat); a rack never capped is always settled."""
    if changed_at is None:
        return True
    return as_utc(oldest_reading_at) >= as_utc(changed_at) + timedelta(seconds=grace_s)


def limit_w(cap_pct: float | None, tdp_w: float) -> float | None:
    """The per-GPU power limit for a cap in percent of TDP (None: uncapped, the GPU's default)."""
    return None if cap_pct is None else round(cap_pct * tdp_w / 100.0, 1)


def _pct(value: float | None) -> str:
    return "none" if value is None else f"{value:g} %"


def _kw(watts: float) -> str:
    return f"{watts / 1000:.1f} kW"


def drawn_by_rack(session: Session, rack_ids: list[int], since: datetime) -> dict[int, RackDraw]:
    """Per rack, the sum of its servers' readings taken after `since` (racks.is_fresh), in one
    grouped query; a rack with none is absent (no reading: the valve does not act on it)."""
    rows = session.connection().execute(
        sa.select(
            col(Server.rack_id),
            func.sum(col(Server.drawn_w)).label("drawn_w"),
            func.count().label("readings"),
            func.min(col(Server.drawn_at)).label("oldest_at"),
        )
        .where(
            col(Server.rack_id).in_(rack_ids),
            col(Server.drawn_w).is_not(None),
            col(Server.drawn_at) > since,
        )
        .group_by(col(Server.rack_id))
    )
    return {
        row.rack_id: RackDraw(float(row.drawn_w), int(row.readings), as_utc(row.oldest_at))
        for row in rows
    }


@dataclass(frozen=True, slots=True)
class GpuServer:
    """A loading or serving server with GPUs: what the valve needs of it."""

    id: int
    name: str
    gpu_model: str
    limit_w: float | None


def capped_servers(session: Session, rack_ids: list[int]) -> dict[int, list[GpuServer]]:
    """Per rack, its servers whose agents take a GPU limit (CAPPED_STATES, with GPUs)."""
    rows = session.connection().execute(
        sa.select(
            col(Server.id),
            col(Server.rack_id),
            col(Server.name),
            col(Server.gpu_model),
            col(Server.gpu_power_limit_w),
        )
        .where(
            col(Server.rack_id).in_(rack_ids),
            col(Server.state).in_(CAPPED_STATES),
            col(Server.gpu_count) > 0,
        )
        .order_by(col(Server.name))
    )
    out: dict[int, list[GpuServer]] = {}
    for row in rows:
        out.setdefault(row.rack_id, []).append(
            GpuServer(row.id, row.name, row.gpu_model, row.gpu_power_limit_w)
        )
    return out


def budgets(session: Session) -> dict[int, tuple[Rack, float]]:
    """Every rack with a budget (feeds), by id, with its budget in watts."""
    feeds: dict[int, list[Feed]] = {}
    for row in session.exec(select(PowerFeed)):
        feeds.setdefault(row.rack_id, []).append(to_feed(row))
    out: dict[int, tuple[Rack, float]] = {}
    for rack in session.exec(select(Rack).order_by(col(Rack.name))):
        assert rack.id is not None
        budget_w = rack_budget(feeds.get(rack.id, []))
        if budget_w > 0:
            out[rack.id] = (rack, budget_w)
    return out


def _tdp_by_model(session: Session) -> dict[str, float]:
    """TDP per GPU model name: the built-in table, then the models an inventory added."""
    tdp = {name: spec.tdp_w for name, spec in GPUS.items()}
    for name, watts in session.exec(select(GpuModelSpec.name, GpuModelSpec.tdp_w)):
        tdp.setdefault(name, watts)
    return tdp


def _tdp_of(model: str, tdp: dict[str, float]) -> float | None:
    if model in tdp:
        return tdp[model]
    try:
        return gpu_spec(model).tdp_w  # "h100-sxm" and other spellings of a built-in
    except ValueError:
        return None


def run_valve(engine: sa.Engine, settings: Settings, now: datetime | None = None) -> list[str]:
    """One pass over every budgeted rack; returns the moves made (cap changes, limits synced,
    budget overrides cleared)."""
    at = now or utcnow()
    since = at - timedelta(seconds=drawn_fresh_s(settings))
    moves: list[str] = []
    with Session(engine, expire_on_commit=False) as session:
        racks = budgets(session)
        ids = list(racks)
        draws = drawn_by_rack(session, ids, since)
        tdp = _tdp_by_model(session)
        servers = capped_servers(session, ids)
        for rack_id, (rack, budget_w) in racks.items():
            moves.extend(
                _rack_pass(
                    session,
                    rack,
                    budget_w,
                    draws.get(rack_id),
                    servers.get(rack_id, []),
                    tdp,
                    settings,
                    at,
                )
            )
            session.commit()  # rack by rack: no row stays locked for the whole pass
        # The gate's admin overrides end here too, once their rack is back inside its budget.
        cleared = clear_settled_overrides(session, at, actor=ACTOR)
        moves.extend(f"rack {name}: budget override cleared" for name in cleared)
    for move in moves:
        log.info("valve: %s", move)
    return moves


def _rack_pass(
    session: Session,
    rack: Rack,
    budget_w: float,
    draw: RackDraw | None,
    servers: list[GpuServer],
    tdp: dict[str, float],
    settings: Settings,
    at: datetime,
) -> list[str]:
    old = rack.gpu_cap_pct
    # No reading, or none yet since the last change took hold: the rule holds the cap.
    drawn_w: float | None = None
    if draw is not None and settled(
        rack.gpu_cap_changed_at, draw.oldest_at, settings.heartbeat_interval_s
    ):
        drawn_w = draw.drawn_w
    new = next_cap_pct(
        drawn_w,
        budget_w,
        old,
        high_pct=settings.power_cap_high_pct,
        low_pct=settings.power_cap_low_pct,
        floor_pct=settings.power_cap_floor_pct,
        step_pct=settings.power_cap_step_pct,
    )
    limited: dict[str, float | None] = {}
    updates: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for server in servers:
        tdp_w = _tdp_of(server.gpu_model, tdp)
        if tdp_w is None:
            skipped[server.name] = f"unknown GPU model {server.gpu_model!r}: no TDP to cap from"
            continue
        want = limit_w(new, tdp_w)
        if server.limit_w != want:
            updates.append({"id": server.id, "gpu_power_limit_w": want})
            limited[server.name] = want
    if updates:  # by primary key, one statement: no Server rows loaded whole
        session.execute(sa.update(Server), updates)
    if new == old:
        # Servers that started serving since the last change join the rack's limit quietly.
        return [
            f"rack {rack.name}: server {name} GPU limit lifted (rack uncapped)"
            if watts is None
            else f"rack {rack.name}: server {name} GPU limit {watts:g} W (rack capped at {new:g} %)"
            for name, watts in limited.items()
        ]
    assert drawn_w is not None  # the rule moves only on a reading
    share = 100.0 * drawn_w / budget_w
    rack.gpu_cap_pct = new
    rack.gpu_cap_changed_at = at
    session.add(rack)
    message = (
        f"rack {rack.name} draws {_kw(drawn_w)} of its {_kw(budget_w)} budget ({share:.0f} %): "
        f"GPU cap {_pct(old)} → {_pct(new)} of TDP on {len(limited)} server(s)"
    )
    if skipped:
        message += f"; {len(skipped)} skipped (unknown GPU model)"
    details: dict[str, Any] = {
        "drawn_w": round(drawn_w, 1),
        "budget_w": round(budget_w, 1),
        "share_pct": round(share, 1),
        "from_pct": old,
        "to_pct": new,
        "high_pct": settings.power_cap_high_pct,
        "low_pct": settings.power_cap_low_pct,
        "readings": draw.readings if draw is not None else 0,
        "servers": limited,
        "skipped": skipped,
    }
    session.add(
        Event(
            at=at,
            subject_type="rack",
            subject=rack.name,
            actor=ACTOR,
            kind="rack.gpu_cap",
            message=message[:2000],
            details=details,
        )
    )
    return [message]
