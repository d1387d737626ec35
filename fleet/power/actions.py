"""Power actions on servers through their BMCs: one server at a time, many servers at once.

Each action reads the BMC, acts only if needed, reads back, stores what it saw in the server's
observed fields (never its lifecycle state: that is the state machine's) and records an Event
with the outcome. One power action per server at a time, across service processes.

`act_on` is the one power path: operator actions (`power`), `verify` and the provisioner's
boots, cycles and returns (fleet/provisioning/tick.py) all go through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet import locks
from fleet.bmc import BmcError, PowerDriver, driver_for
from fleet.bmc.base import ACTIONS as ACTIONS  # re-exported: routes and the CLI name them here
from fleet.bmc.base import Action as Action
from fleet.bmc.base import ActionResult, BmcTarget
from fleet.bmc.bulk import Job, Outcome, Stagger, run_bulk
from fleet.bmc.targets import target_for
from fleet.crypto import SecretBox
from fleet.errors import ConflictError, NotFoundError
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Event, Pool, PowerState, Rack, Server, utcnow
from fleet.settings import Settings


@dataclass(frozen=True, slots=True)
class PowerReport:
    """One server's outcome, as the API and CLI show it."""

    server: str
    action: Action
    ok: bool
    sent: bool
    state_before: PowerState | None
    state_after: PowerState | None
    error: str | None  # one line naming the server, its BMC and the cause
    started: float  # seconds after the bulk action began (shows the per-rack stagger)
    seconds: float


class ServerBusy(ConflictError):
    """Another power action holds this server."""


# ---------------------------------------------------------------------------------------------
# One action per server at a time


@contextmanager
def server_power_lock(engine: Engine, server: Server, connections: int = 32) -> Iterator[None]:
    """Held for one power action (or BMC read) on `server`, across service processes; a second
    one is refused at once (ServerBusy), never queued. Postgres: a session advisory lock on a
    connection of its own, from `connections` kept for these locks (fleet/locks.py)."""
    busy = ServerBusy(f"server {server.name}: another power action is in progress")
    with locks.try_lock(engine, f"fleet.power:{server.name}", busy, connections=connections):
        yield


# ---------------------------------------------------------------------------------------------
# The one power path: operator actions, verify and the provisioner all come through here


def act_on(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    server: Server,
    action: Action,
    actor: str,
    *,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
) -> ActionResult | PowerState:
    """`action` on `server`'s BMC, its power lock held, then what the BMC said recorded: the
    observed fields and one Event (`server.power`, or `server.power_failed` with the error,
    which is raised again). ServerBusy (another action holds the server) records nothing:
    nothing went out."""
    try:
        with (
            server_power_lock(engine, server, settings.bmc_workers),
            drivers(target_for(server, box, settings)) as driver,
        ):
            result = driver.act(action)
    except ServerBusy:
        raise
    except Exception as exc:
        _record(engine, server, action, None, exc, actor, settings.power_settle_s)
        raise
    _record(engine, server, action, result, None, actor, settings.power_settle_s)
    return result


def _record(
    engine: Engine,
    server: Server,
    action: Action,
    result: ActionResult | PowerState | None,
    error: Exception | None,
    actor: str,
    settle_s: float,
) -> None:
    """Observed fields and one Event, in one transaction. A command that went out starts a
    settle window in which the reconciler leaves the server alone (the BMC may apply it late)."""
    now = utcnow()
    with Session(engine) as session:
        row = session.get(Server, server.id)
        if row is None:  # deleted meanwhile: nothing to record against
            return
        if error is None:
            after = result.state_after if isinstance(result, ActionResult) else result
            assert after is not None
            row.power_state, row.power_state_at, row.bmc_reachable = after, now, True
            row.bmc_failures, row.bmc_checked_at = 0, now
            if isinstance(result, ActionResult) and result.sent:
                row.power_settle_until = now + timedelta(seconds=settle_s)
            details: dict[str, object] = {"action": action, "power_state": after.value}
            if isinstance(result, ActionResult):
                details.update(sent=result.sent, before=result.state_before.value)
            kind, message = "server.power", _describe(action, result)
        else:
            if isinstance(error, BmcError):
                row.bmc_reachable = type(error).__name__ != "BmcUnreachable"
            details = {"action": action, "error": type(error).__name__}
            kind, message = "server.power_failed", str(error)
        session.add(row)
        session.add(
            Event(
                at=now,
                subject_type="server",
                subject=server.name,
                actor=actor,
                kind=kind,
                message=message,
                details=details,
            )
        )
        session.commit()


def _describe(action: Action, result: ActionResult | PowerState | None) -> str:
    if isinstance(result, ActionResult):
        if not result.sent:
            return f"power {action}: already {result.state_before.value}, nothing sent"
        return (
            f"power {action}: sent; was {result.state_before.value}, "
            f"BMC now reports {result.state_after.value}"
        )
    return f"power status: {result.value if result else 'unknown'}"


def load_servers(engine: Engine, names: Sequence[str]) -> dict[str, tuple[Server, str]]:
    """The named servers with their rack names; every name must exist."""
    with Session(engine) as session:
        rows = list(
            session.exec(
                select(Server, Rack.name)
                .select_from(Server)
                .join(Rack, col(Rack.id) == Server.rack_id)
                .where(col(Server.name).in_(list(names)))
            )
        )
    found = {s.name: (s, rack) for s, rack in rows}
    missing = [n for n in names if n not in found]
    if missing:
        raise NotFoundError(f"no server named {', '.join(repr(n) for n in missing)}")
    return found


# Only power-ons draw inrush current; reads and power-offs need no spacing.
SPACED: frozenset[Action] = frozenset({"on", "cycle"})


def power_stagger(settings: Settings, *, spaced: bool) -> Stagger:
    """The bounds of bulk BMC actions (operator power, the provisioner's tick): `bmc_workers`
    at once; power-ons (`spaced`) at most `power_on_per_rack` per rack, a delay apart."""
    return Stagger(
        workers=settings.bmc_workers,
        per_rack=settings.power_on_per_rack if spaced else None,
        rack_delay=settings.power_on_rack_delay_s if spaced else 0.0,
    )


def power(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    names: Sequence[str],
    action: Action,
    actor: str,
    *,
    stagger: Stagger | None = None,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
    on_done: Callable[[PowerReport], None] | None = None,
) -> list[PowerReport]:
    """Run `action` on every named server; one report per server, in the order given."""
    if action not in ACTIONS:
        raise ValueError(f"unknown power action {action!r} (one of {', '.join(ACTIONS)})")
    names = list(dict.fromkeys(names))  # a server named twice is acted on once
    found = load_servers(engine, names)
    if stagger is None:
        stagger = power_stagger(settings, spaced=action in SPACED)

    def job(server: Server) -> Callable[[], ActionResult | PowerState]:
        return lambda: act_on(engine, box, settings, server, action, actor, drivers=drivers)

    def report(outcome: Outcome[ActionResult | PowerState]) -> PowerReport:
        value = outcome.value
        before = value.state_before if isinstance(value, ActionResult) else value
        after = value.state_after if isinstance(value, ActionResult) else value
        done = PowerReport(
            server=outcome.server,
            action=action,
            ok=outcome.ok,
            sent=isinstance(value, ActionResult) and value.sent,
            state_before=before,
            state_after=after,
            error=None if outcome.error is None else str(outcome.error),
            started=round(outcome.started, 3),
            seconds=round(outcome.finished - outcome.started, 3),
        )
        if on_done is not None:
            on_done(done)
        return done

    jobs = [Job(n, found[n][1], job(found[n][0])) for n in names]
    reports: dict[str, PowerReport] = {}

    def collect(outcome: Outcome[ActionResult | PowerState]) -> None:
        reports[outcome.server] = report(outcome)

    run_bulk(jobs, stagger, on_done=collect)
    return [reports[n] for n in names]


# ---------------------------------------------------------------------------------------------
# Verify: the first contact with a newly enrolled server's BMC


@dataclass(frozen=True, slots=True)
class VerifyReport:
    server: str
    ok: bool
    power_state: PowerState | None
    moved_to: ServerState | None  # the lifecycle state it reached, if it moved
    message: str  # what happened, or (not ok) one line naming the server, its BMC and the cause


def _verify_one(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    server: Server,
    actor: str,
    drivers: Callable[[BmcTarget], PowerDriver],
) -> VerifyReport:
    """Enrolled → warm (pool warm, found off) or → booting (pool baseline, powered on).

    A warm-pool server found on stays enrolled: a spare must be off, and powering off a
    machine Fleet does not yet know is an operator's call, not ours.
    """
    if server.state != ServerState.ENROLLED:
        return VerifyReport(server.name, True, None, None, f"already {server.state}: nothing to do")
    action: Action = "on" if server.pool == Pool.BASELINE else "status"
    result = act_on(engine, box, settings, server, action, actor, drivers=drivers)
    state = result.state_after if isinstance(result, ActionResult) else result
    if server.pool == Pool.BASELINE:
        target, why = ServerState.BOOTING, "BMC verified; baseline server powered on"
    elif state == PowerState.OFF:
        target, why = ServerState.WARM, "BMC verified; the spare is off"
    else:
        return VerifyReport(
            server.name,
            False,
            state,
            None,
            f"server {server.name}: the BMC reports it {state.value}; a warm spare must be off "
            f"(power it off with `fleetctl servers power off {server.name}`, then verify again)",
        )
    with Session(engine) as session:
        lifecycle.transition(session, server.name, target, actor, why)
    return VerifyReport(server.name, True, state, target, why)


def verify(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    names: Sequence[str],
    actor: str,
    *,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
) -> list[VerifyReport]:
    """Verify every named server's BMC and move the enrolled ones on; one report each."""
    names = list(dict.fromkeys(names))
    found = load_servers(engine, names)
    stagger = Stagger(  # baseline servers are powered on: stagger like any power-on
        workers=settings.bmc_workers,
        per_rack=settings.power_on_per_rack,
        rack_delay=settings.power_on_rack_delay_s,
    )

    def job(server: Server) -> Callable[[], VerifyReport]:
        return lambda: _verify_one(engine, box, settings, server, actor, drivers)

    outcomes = run_bulk([Job(n, found[n][1], job(found[n][0])) for n in names], stagger)
    reports = []
    for outcome in outcomes:
        if outcome.value is not None:
            reports.append(outcome.value)
            continue
        reports.append(VerifyReport(outcome.server, False, None, None, str(outcome.error)))
    return reports
