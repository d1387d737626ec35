"""The calendar's I/O edge: one tick of the leader over every entry.

Each tick (the leader's "calendar" loop, every `calendar_interval_s`):

1. closes the windows that ended (`schedule.ended`);
2. asks `due` (fleet/calendar/plan.py) for each entry, with the lead of the spares it would
   boot (`lead_for`: placement's choice for the servers its floor still needs, each at the
   p90 boot-to-ready for its GPU model and cache state), and claims what is due with a
   conditional UPDATE on `fired_for` (the window's start):
   of two processes that both think they lead, or a leader restarted mid-window, only one
   ever fires a window. A window that closed before anyone could fire it is `missed`;
3. sets each deployment's `floor_servers` (the largest floor of its open windows), and for a
   firing raises `target_servers` to it at once, with a `ScalingDecision` (rule "calendar")
   whose reason says when, for when and why that early. The provisioner boots the spares; the
   autoscaler keeps the target at or above the floor until the window ends, and then scales
   down by its own rules.

All of it in one transaction. While the autopilot is paused the calendar waits; a window still
open when it resumes fires then (the same catch-up as after an outage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.autoscaler.service import (
    Spares,
    gpus_per_server,
    replicas_per_server,
    servers_for_replicas,
)
from fleet.calendar.cron import CronError, parse, zone
from fleet.calendar.plan import (
    Due,
    Lead,
    Spec,
    boot_models,
    due,
    floor_servers,
    lead_time,
    minutes,
    open_until,
    raised_target,
    slowest,
)
from fleet.events import deployment_event
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, ScalingDecision, ScheduleEntry, Server, utcnow
from fleet.provisioning import placement
from fleet.provisioning.autopilot import get_autopilot
from fleet.provisioning.boot_times import BootQuantile, by_model, measured_boots
from fleet.provisioning.boots import ACTIVE, want_for
from fleet.settings import Settings

log = logging.getLogger(__name__)
ACTOR = "calendar"
S = ServerState


@dataclass(frozen=True)
class Firing:
    entry: ScheduleEntry
    due: Due
    lead: Lead


def spec_of(entry: ScheduleEntry) -> Spec:
    start = parse(entry.cron, entry.timezone)
    end = parse(entry.end_cron, entry.timezone) if entry.end_cron else None
    return Spec(start, end, float(entry.duration_s) if entry.duration_s else None)


def candidate_models(deployment: Deployment, warm_models: list[str]) -> list[str]:
    """The GPU models of the spares the deployment could boot now (its allowed models when no
    spare is warm)."""
    return boot_models(deployment.gpu_models, warm_models)


def lead_for(
    session: Session,
    deployment: Deployment,
    settings: Settings,
    *,
    min_replicas: int = 0,
    warm: list[str] | None = None,
    measured: dict[str, tuple[float, int]] | None = None,
    world: Spares | None = None,
) -> Lead:
    """The lead of a window that needs `min_replicas` of the deployment: the slowest expected
    boot of the spares placement would boot for the servers still missing (at least one), each
    at its GPU model's and cache state's figure (fleet/provisioning/boot_times.py: a quantile
    of the measured boots plus a margin). Where placement cannot place them all now (power,
    spares), the slowest GPU model it may boot counts too (`lead_time`)."""
    if warm is None:
        warm = _warm_models(session)
    if measured is None:
        measured = _measured(session, settings)
    if world is None:
        world = Spares.read(session, settings)
    models = lead_time(candidate_models(deployment, warm), measured, settings.boot_estimate_s)
    servers = list(session.exec(select(Server).where(Server.deployment_id == deployment.id)))
    per_server = replicas_per_server(deployment, gpus_per_server(session, deployment, servers))
    have = sum(s.state in ACTIVE for s in servers)
    missing = max(1, floor_servers(min_replicas, per_server) - have)
    want = want_for(session, deployment, missing)
    choice = placement.choose_spares(world.spares, world.rooms, want)
    by_name = {s.name: s for s in world.spares}
    boots = []
    for name in choice.chosen:
        spare = by_name[name]
        seconds, basis = placement.expected_boot_s(
            spare.gpu_model, placement.holds(spare, want), world.figures, world.default_s
        )
        boots.append(Lead(seconds, f"{name}: {basis}"))
    lead = slowest(boots)
    if lead is None:
        return models
    if choice.short:
        # The model-wide figure first: on a tie it says more than one spare's.
        return slowest([models, lead]) or models
    return lead


def _measured(session: Session, settings: Settings) -> dict[str, tuple[float, int]]:
    how = BootQuantile.of(settings)
    return by_model(measured_boots(session, how.since(utcnow())), how)


def calendar_once(
    engine: Engine, settings: Settings, *, now: Callable[[], datetime] = utcnow
) -> list[Firing]:
    """One tick over every entry; returns the windows it fired."""
    at = now()
    fired: list[Firing] = []
    with Session(engine, expire_on_commit=False) as session:
        if get_autopilot(session).paused:
            return []
        entries = list(session.exec(select(ScheduleEntry).order_by(col(ScheduleEntry.id))))
        deployments = {d.id: d for d in session.exec(select(Deployment))}
        if not entries and not any(d.floor_servers for d in deployments.values()):
            return []
        measured = _measured(session, settings)
        warm = _warm_models(session)
        world = Spares.read(session, settings)
        for entry in entries:
            deployment = deployments[entry.deployment_id]
            try:
                spec = spec_of(entry)
            except CronError as exc:  # e.g. a time zone the system's tz database lost
                log.warning("calendar entry %s cannot be scheduled: %s", entry.id, exc)
                continue
            if entry.active_until is not None and entry.active_until <= at:
                _close(session, entry, deployment, at)
            lead = lead_for(
                session,
                deployment,
                settings,
                min_replicas=entry.min_replicas,
                warm=warm,
                measured=measured,
                world=world,
            )
            found = due(
                spec,
                entry.fired_for,
                at,
                lead.seconds,
                settings.calendar_interval_s,
                since=entry.created_at,
            )
            if found is None or not _claim(session, entry, found, at):
                continue
            if found.action == "missed":
                if found.window.end > entry.created_at:  # not a window before it existed
                    _missed(session, entry, deployment, found, at)
                continue
            fired.append(Firing(entry, found, lead))
        for deployment in deployments.values():
            mine = [e for e in entries if e.deployment_id == deployment.id]
            firings = [f for f in fired if f.entry.deployment_id == deployment.id]
            _apply(session, deployment, mine, firings, at)
        session.commit()
    return fired


def _warm_models(session: Session) -> list[str]:
    return list(session.exec(select(Server.gpu_model).where(Server.state == S.WARM)))


def _claim(session: Session, entry: ScheduleEntry, found: Due, at: datetime) -> bool:
    """Mark the window handled, unless someone did already: the once-only guarantee."""
    window = found.window
    values: dict[str, Any] = {"fired_for": window.start, "fired_at": None}
    if found.action == "fire":
        values = {
            "fired_for": window.start,
            "fired_at": at,
            "active_until": open_until(window, entry.active_until, at),
        }
    result = session.connection().execute(
        update(ScheduleEntry)
        .where(col(ScheduleEntry.id) == entry.id)
        .where(
            or_(
                col(ScheduleEntry.fired_for).is_(None),
                col(ScheduleEntry.fired_for) < window.start,
            )
        )
        .values(**values)
    )
    if result.rowcount != 1:
        return False
    session.expire(entry)  # read the claimed row back
    return True


def _close(session: Session, entry: ScheduleEntry, deployment: Deployment, at: datetime) -> None:
    ended = entry.active_until
    result = session.connection().execute(
        update(ScheduleEntry)
        .where(col(ScheduleEntry.id) == entry.id)
        .where(col(ScheduleEntry.active_until) == ended)
        .values(active_until=None)
    )
    session.expire(entry)
    if result.rowcount != 1 or ended is None:
        return
    local = ended.astimezone(zone(entry.timezone))
    session.add(
        _event(
            entry,
            at,
            "schedule.ended",
            f"window for {deployment.name} ended at {_clock(local)} ({entry.timezone}): "
            f"its floor of {_n(entry.min_replicas, 'replica')} no longer holds",
            {"deployment": deployment.name, "ended": ended.isoformat()},
        )
    )


def _missed(
    session: Session, entry: ScheduleEntry, deployment: Deployment, found: Due, at: datetime
) -> None:
    start, end, _ = found.window.local(entry.timezone)
    session.add(
        _event(
            entry,
            at,
            "schedule.missed",
            f"window {_clock(start)}–{_clock(end)} ({entry.timezone}) for {deployment.name} "
            "closed while no leader ran the calendar: not fired",
            {"deployment": deployment.name, "window_start": found.window.start.isoformat()},
        )
    )


def _apply(
    session: Session,
    deployment: Deployment,
    entries: list[ScheduleEntry],
    firings: list[Firing],
    at: datetime,
) -> None:
    """The deployment's floor from its open windows; a firing raises the target to it."""
    servers = list(session.exec(select(Server).where(Server.deployment_id == deployment.id)))
    per_server = replicas_per_server(deployment, gpus_per_server(session, deployment, servers))
    floors = {
        e.id: floor_servers(e.min_replicas, per_server)
        for e in entries
        if e.active_until is not None and e.active_until > at
    }
    floor = max(floors.values(), default=0)
    if floor == deployment.floor_servers and not firings:
        return
    before = deployment.floor_servers
    deployment.floor_servers = floor
    session.add(deployment)
    if not firings:
        session.add(
            deployment_event(
                deployment.name,
                at,
                ACTOR,
                "deployment.floor",
                f"calendar floor {before} → {floor} servers",
                {"floor_before": before, "floor_after": floor},
            )
        )
        return
    serving = sum(s.state == S.SERVING for s in servers)
    on_the_way = sum(s.state in (S.BOOTING, S.LOADING) for s in servers)
    highest = servers_for_replicas(deployment.max_replicas, per_server)
    target_before = deployment.target_servers
    target_after = raised_target(
        target_before, floor, highest, pinned=deployment.pinned_replicas is not None
    )
    for firing in firings:
        reason = _reason(
            firing,
            at,
            floor=floors.get(firing.entry.id, floor),
            target=target_after,
            # The boots this firing adds: what neither the target nor the fleet had already.
            booting=max(0, target_after - max(target_before, serving + on_the_way)),
            highest=highest,
            pinned=deployment.pinned_replicas,
        )
        window = firing.due.window
        session.add(
            ScalingDecision(
                deployment=deployment.name,
                at=at,
                rule="calendar",
                target_before=target_before,
                target_after=target_after,
                reason=reason[:1000],
                inputs={
                    "entry": firing.entry.id,
                    "window_start": window.start.isoformat(),
                    "window_end": window.end.isoformat(),
                    "timezone": firing.entry.timezone,
                    "lead_s": firing.lead.seconds,
                    "lead_basis": firing.lead.basis,
                    "late_s": round(firing.due.late_s, 3),
                    "min_replicas": firing.entry.min_replicas,
                    "floor": floor,
                },
            )
        )
        session.add(
            _event(
                firing.entry,
                at,
                "schedule.fired",
                f"{deployment.name}: {reason}",
                {"deployment": deployment.name, "window_start": window.start.isoformat()},
            )
        )
    if target_after != target_before:
        session.add(
            deployment_event(
                deployment.name,
                at,
                ACTOR,
                "deployment.scaled",
                f"target {target_before} → {target_after}: calendar floor {floor}",
                {"rule": "calendar", "delta": target_after - target_before},
            )
        )
        deployment.target_servers = target_after


def _reason(
    firing: Firing,
    at: datetime,
    *,
    floor: int,
    target: int,
    booting: int,
    highest: int,
    pinned: int | None,
) -> str:
    """'booting 4 at 08:41 for 09:00 (Europe/Berlin), p90 boot 17 min (H100, 12 boots
    measured): floor 4 servers for 8 replicas until 18:00'."""
    entry, window = firing.entry, firing.due.window
    tz = zone(entry.timezone)
    start, end, _ = window.local(entry.timezone)
    now = at.astimezone(tz)
    for_when = _clock(start) if start.date() == now.date() else f"{start:%a %d %b} {_clock(start)}"
    lead = f"p90 boot {minutes(firing.lead.seconds)} ({firing.lead.basis})"
    until = f"floor {_n(floor, 'server')} for {_n(entry.min_replicas, 'replica')}"
    until += f" until {_clock(end) if end.date() == start.date() else f'{end:%a} {_clock(end)}'}"
    late = ""
    if firing.due.late_s > 0 and entry.created_at > window.fire_at:
        late = "entry added inside its window, "
    elif firing.due.late_s > 0:
        late = f"{minutes(firing.due.late_s)} late (no leader ran the calendar), "
    if pinned is not None:
        return (
            f"{late}for {for_when} ({entry.timezone}), {lead}: {until}; pinned at "
            f"{_n(pinned, 'replica')} by an operator, so the target stays until automatic mode"
        )
    capped = f", capped at max {highest}" if floor > highest else ""
    if booting == 0:
        return (
            f"{late}for {for_when} ({entry.timezone}), {lead}: {until}{capped}; "
            f"target {target} already meets it"
        )
    return (
        f"{late}booting {booting} at {now:%H:%M} for {for_when} ({entry.timezone}), "
        f"{lead}: {until}{capped}"
    )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _clock(local: datetime) -> str:
    return f"{local:%H:%M:%S}" if local.second else f"{local:%H:%M}"


def _event(
    entry: ScheduleEntry, at: datetime, kind: str, message: str, details: dict[str, Any]
) -> Event:
    return Event(
        at=at,
        subject_type="schedule",
        subject=str(entry.id),
        actor=ACTOR,
        kind=kind,
        message=message[:2000],
        details=details,
    )
