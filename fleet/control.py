"""The service's singleton control loops, wired together: one leadership, one thread per loop.

The reconciler (BMC power states) and the provisioner (warm-spare workflows); the autoscaler
and the scheduled-scaling calendar join here. They share the leadership: one process leads
them all.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.engine import Engine

from fleet import db
from fleet.autoscaler.service import History, autoscale_once
from fleet.calendar.service import calendar_once
from fleet.crypto import SecretBox
from fleet.leader import identity, leadership_for
from fleet.loops import SingletonLoop
from fleet.models import Event, utcnow
from fleet.provisioning import provision_once
from fleet.reconciler import reconcile_once
from fleet.settings import Settings


def _leadership_event(engine: Engine, leading: bool) -> None:
    who = identity()
    with db.session_scope(engine) as session:
        session.add(
            Event(
                at=utcnow(),
                subject_type="service",
                subject="leader",
                actor=who,
                kind="service.leader" if leading else "service.follower",
                message=(
                    f"{who} leads the control loops"
                    if leading
                    else f"{who} lost the lead and stopped its control loops"
                ),
                details={"process": who},
            )
        )


def build_loops(settings: Settings, engine: Engine, box: SecretBox) -> list[SingletonLoop]:
    leadership = leadership_for(engine, "control", settings.leader_lease_s)
    # When this process last became leader: missed heartbeats count only after a grace.
    led_since: dict[str, datetime | None] = {"at": None}

    def on_leadership(leading: bool) -> None:
        led_since["at"] = utcnow() if leading else None
        _leadership_event(engine, leading)

    reconciler = SingletonLoop(
        "reconciler",
        settings.reconcile_interval_s,
        lambda: reconcile_once(engine, box, settings),
        leadership,
        # A follower that never led has nothing to say; a change of leader is worth an Event.
        on_leadership=on_leadership,
    )
    provisioner = SingletonLoop(
        "provisioner",
        settings.provision_interval_s,
        lambda: provision_once(engine, box, settings, leader_since=led_since["at"] or utcnow()),
        leadership,
    )
    # Signal windows live in the leader's memory: a new leader starts with empty ones, so it
    # cannot scale down before a full down window of data (the safe direction).
    history = History.new(
        max(settings.autoscale_up_window_s, settings.autoscale_down_window_s) + 600.0
    )
    autoscaler = SingletonLoop(
        "autoscaler",
        settings.autoscale_interval_s,
        lambda: autoscale_once(engine, settings, history),
        leadership,
    )

    def calendar_tick() -> None:
        # A firing raised a target: the provisioner boots now, not at its next tick, so that
        # the boots start within one calendar tick of their time.
        if calendar_once(engine, settings):
            provisioner.wake()

    calendar = SingletonLoop("calendar", settings.calendar_interval_s, calendar_tick, leadership)
    return [reconciler, provisioner, autoscaler, calendar]
