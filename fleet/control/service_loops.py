"""The service's singleton control loops, wired together: one leadership, one thread per loop.

The reconciler (BMC power states) and the provisioner (warm-spare workflows); the autoscaler,
the scheduled-scaling calendar, the cap valve (GPU power limits of racks near their budget) and
the rollouts (model versions moved step by step, fleet/rollout/) join here. They share the
leadership: one process leads them all.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.engine import Engine

from fleet import db
from fleet.autoscaler.demand import Forecasts
from fleet.autoscaler.service import History, autoscale_once
from fleet.calendar.service import calendar_once
from fleet.control import wakeups
from fleet.control.leader import StepDown, identity, leadership_for
from fleet.control.loops import Alongside, SingletonLoop
from fleet.crypto import SecretBox
from fleet.models import Event, utcnow
from fleet.power.reconciler import reconcile_once
from fleet.power.valve import run_valve
from fleet.provisioning.tick import provision_once
from fleet.rollout.service import rollout_once
from fleet.settings import Settings


def _leadership_event(engine: Engine, leading: bool, why: str | None = None) -> None:
    who = identity()
    if leading:
        message = f"{who} leads the control loops"
    elif why is not None:
        message = f"{who} gave up the lead and stopped its control loops: {why}"
    else:
        message = f"{who} lost the lead and stopped its control loops"
    details: dict[str, str] = {"process": who}
    if why is not None:
        details["reason"] = why
    with db.session_scope(engine) as session:
        session.add(
            Event(
                at=utcnow(),
                subject_type="service",
                subject="leader",
                actor=who,
                kind="service.leader" if leading else "service.follower",
                message=message,
                details=details,
            )
        )


def build_loops(settings: Settings, engine: Engine, box: SecretBox) -> list[SingletonLoop]:
    # A leader whose loops keep failing releases the lock for a while (fleet/control/leader.py) and
    # says why in its service.follower Event (written then, not at the reconciler's next tick).
    leadership = StepDown(
        leadership_for(engine, "control", settings.leader_lease_s),
        settings.leader_step_down_failures,
        settings.leader_step_down_s,
        on_step_down=lambda why: _leadership_event(engine, False, why),
    )
    # When this process last became leader: missed heartbeats count only after a grace.
    led_since: dict[str, datetime | None] = {"at": None}

    def on_leadership(leading: bool) -> None:
        led_since["at"] = utcnow() if leading else None
        if leading or not leadership.backing_off:  # a step-down has had its Event
            _leadership_event(engine, leading)

    reconciler = SingletonLoop(
        "reconciler",
        settings.reconcile_interval_s,
        lambda: reconcile_once(engine, box, settings),
        leadership,
        # A follower that never led has nothing to say; a change of leader is worth an Event.
        on_leadership=on_leadership,
        on_tick=leadership.record,
    )
    provisioner = SingletonLoop(
        "provisioner",
        settings.provision_interval_s,
        lambda: provision_once(engine, box, settings, leader_since=led_since["at"] or utcnow()),
        leadership,
        on_tick=leadership.record,
    )
    # Signal windows live in the leader's memory: a new leader starts with empty ones, so it
    # cannot scale down before a full down window of data (the safe direction).
    history = History.new(
        max(settings.autoscale_up_window_s, settings.autoscale_down_window_s) + 600.0
    )
    forecasts = Forecasts.new(settings.forecast_max_error)
    autoscaler = SingletonLoop(
        "autoscaler",
        settings.autoscale_interval_s,
        lambda: autoscale_once(engine, settings, history, forecasts=forecasts),
        leadership,
        on_tick=leadership.record,
    )

    def calendar_tick() -> None:
        # A firing raised a target: the provisioner boots now, not at its next tick, so that
        # the boots start within one calendar tick of their time.
        if calendar_once(engine, settings):
            provisioner.wake()

    calendar = SingletonLoop(
        "calendar",
        settings.calendar_interval_s,
        calendar_tick,
        leadership,
        on_tick=leadership.record,
    )
    valve = SingletonLoop(
        "valve",
        settings.power_valve_interval_s,
        lambda: run_valve(engine, settings),
        leadership,
        on_tick=leadership.record,
    )
    rollouts = SingletonLoop(
        "rollouts",
        settings.rollout_interval_s,
        lambda: rollout_once(engine, settings, box),
        leadership,
        on_tick=leadership.record,
    )
    loops = [reconciler, provisioner, autoscaler, calendar, rollouts, valve]
    if settings.wake_poll_s > 0:
        # It leads alongside the provisioner (no lease of its own to ask 10 times a second);
        # its ticks are reads, not counted towards a step-down (they would drown the others).
        watch = wakeups.Watch(engine, {wakeups.PROVISIONER: provisioner.wake})
        loops.append(
            SingletonLoop("wakeups", settings.wake_poll_s, watch.tick, Alongside(provisioner))
        )
    return loops
