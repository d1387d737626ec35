"""Power actions on servers through their BMCs: one server at a time, many servers at once.

Each action reads the BMC, acts only if needed, reads back, stores what it saw in the server's
observed fields (never its lifecycle state: that is the state machine's) and records an Event
with the outcome. One power action per server at a time, across service processes.

`act_on` is the one power path: operator actions (`power`), `verify` and the provisioner's
boots, cycles and returns (fleet/provisioning/tick.py) all go through it. Power-ons that no
lifecycle move has committed yet (an operator's on and cycle, verify of a baseline server)
ask the rack budget gate first (`gated_act_on`, fleet/power/gate.py), just before their BMC
call: a bulk power-on of a rack powers on what fits and refuses the rest, each with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet import leases
from fleet.bmc import BmcError, PowerDriver, driver_for
from fleet.bmc.base import ACTIONS as ACTIONS  # re-exported: routes and the CLI name them here
from fleet.bmc.base import Action as Action
from fleet.bmc.base import ActionResult, BmcTarget
from fleet.bmc.bulk import Job, Outcome, Stagger, run_bulk
from fleet.bmc.targets import target_for
from fleet.crypto import SecretBox
from fleet.errors import ConflictError, NotFoundError
from fleet.events import server_event
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Pool, PowerState, Rack, Server, as_utc, utcnow
from fleet.power import gate
from fleet.power.gate import Admission, Override
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
def server_power_lock(
    engine: Engine, server: Server, ttl_s: float = leases.TTL_S
) -> Iterator[None]:
    """Held for one power action (or BMC read) on `server`, across service processes; a second
    one is refused at once (ServerBusy), never queued. A lease (fleet/leases.py): no database
    connection is held while the BMC answers."""
    busy = ServerBusy(f"server {server.name}: another power action is in progress")
    with leases.hold(engine, f"power:{server.name}", busy, ttl_s=ttl_s):
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
            server_power_lock(engine, server, settings.lease_s),
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


def gated_act_on(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    server: Server,
    action: Action,
    actor: str,
    *,
    override: Override | None = None,
    admitted: Admission | None = None,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
) -> ActionResult | PowerState:
    """`act_on`, a power-on (`on`, `cycle`) admitted by its rack's budget gate first
    (gate.BudgetRefused otherwise: nothing sent, nothing recorded against the server). The
    gate's write-ahead commitment goes once the BMC says on, or holds until the reconciler
    can have read the server (fleet/power/gate.py `settle`). `admitted`: the admission a bulk
    action made ahead, in its order (`admit_in_order`): while its commitment holds it stands
    (no second trip through the placement lock); one that ran out meanwhile is checked afresh."""
    if action not in SPACED:
        return act_on(engine, box, settings, server, action, actor, drivers=drivers)
    if admitted is not None and _holds(admitted):
        admission = admitted
    else:
        admission = gate.admit(engine, settings, server.name, actor, override=override)
    try:
        result = act_on(engine, box, settings, server, action, actor, drivers=drivers)
    except ServerBusy:
        gate.settle(engine, settings, admission, confirmed=True)  # nothing went out
        raise
    except Exception:
        gate.settle(engine, settings, admission, confirmed=False)
        raise
    after = result.state_after if isinstance(result, ActionResult) else result
    gate.settle(engine, settings, admission, confirmed=after is PowerState.ON)
    return result


def _holds(admission: Admission) -> bool:
    """Whether an admission's write-ahead commitment still counts in its rack."""
    until = admission.committed_until
    return until is not None and as_utc(until) > utcnow()


def admit_in_order(
    engine: Engine,
    settings: Settings,
    names: Sequence[str],
    actor: str,
    *,
    override: Override | None = None,
) -> dict[str, Admission | gate.BudgetRefused]:
    """The gate asked for each power-on of a bulk action in the order given, before any BMC
    call: with several running at once per rack, asking only inside each job would let
    whichever got the lock first win the last headroom. The order the operator gave decides."""
    out: dict[str, Admission | gate.BudgetRefused] = {}
    for name in names:
        try:
            out[name] = gate.admit(engine, settings, name, actor, override=override)
        except gate.BudgetRefused as refused:
            out[name] = refused
    return out


def _record(
    engine: Engine,
    server: Server,
    action: Action,
    result: ActionResult | PowerState | None,
    error: Exception | None,
    actor: str,
    settle_s: float,
) -> None:
    """Observed fields and an Event, in one transaction. A command that went out starts a
    settle window in which the reconciler leaves the server alone (the BMC may apply it late).
    A BMC found unreachable, or answering again, is an Event as the reconciler writes them
    (`server.bmc_unreachable`, `server.bmc_reachable`), whichever of the two found it."""
    now = utcnow()
    with Session(engine) as session:
        row = session.get(Server, server.id)
        if row is None:  # deleted meanwhile: nothing to record against
            return
        was_reachable = row.bmc_reachable
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
        session.add(server_event(row.name, actor, kind, message, details))
        if was_reachable is False and row.bmc_reachable:
            back = f"BMC answers again (power {action})"
            session.add(server_event(row.name, actor, "server.bmc_reachable", back))
        elif was_reachable is not False and row.bmc_reachable is False:
            gone = (
                f"power {action}: the BMC did not answer; the reconciler keeps reading it "
                "(its next answer is a server.bmc_reachable Event)"
            )
            session.add(server_event(row.name, actor, "server.bmc_unreachable", gone))
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
    override: Override | None = None,
) -> list[PowerReport]:
    """Run `action` on every named server; one report per server, in the order given.

    Power-ons (`on`, `cycle`) pass the rack budget gate one by one, each just before its BMC
    call: one that does not fit fails with the refusal (rack, watts needed, headroom) as its
    error, unless an admin's `override` admits it."""
    if action not in ACTIONS:
        raise ValueError(f"unknown power action {action!r} (one of {', '.join(ACTIONS)})")
    names = list(dict.fromkeys(names))  # a server named twice is acted on once
    found = load_servers(engine, names)
    if stagger is None:
        stagger = power_stagger(settings, spaced=action in SPACED)

    admissions = (
        admit_in_order(engine, settings, names, actor, override=override)
        if action in SPACED
        else {}
    )

    def job(server: Server) -> Callable[[], ActionResult | PowerState]:
        admitted = admissions.get(server.name)
        return lambda: gated_act_on(
            engine,
            box,
            settings,
            server,
            action,
            actor,
            override=override,
            admitted=admitted if isinstance(admitted, Admission) else None,
            drivers=drivers,
        )

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

    reports: dict[str, PowerReport] = {}
    for name, refused in admissions.items():
        if isinstance(refused, gate.BudgetRefused):  # refused ahead: no job, nothing sent
            reports[name] = report(Outcome(name, found[name][1], None, refused, 0.0, 0.0))
    jobs = [Job(n, found[n][1], job(found[n][0])) for n in names if n not in reports]

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


def _settle_verify(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    server: Server,
    found: PowerState,
    actor: str,
    drivers: Callable[[BmcTarget], PowerDriver],
    admitted: Admission | gate.BudgetRefused | None = None,
) -> VerifyReport:
    """Phase two of verify for one enrolled server whose BMC answered (`found`):
    → warm (pool warm, found off) or → booting (pool baseline: powered on through the rack
    budget gate unless found on; a refusal leaves it enrolled, the reason its message).

    A warm-pool server found on stays enrolled: a spare must be off, and powering off a
    machine Fleet does not yet know is an operator's call, not ours.
    """
    if server.pool == Pool.BASELINE:
        if found is PowerState.ON:
            why = "BMC verified; baseline server already on"
        else:
            try:
                if isinstance(admitted, gate.BudgetRefused):
                    raise admitted
                result = gated_act_on(
                    engine, box, settings, server, "on", actor, admitted=admitted, drivers=drivers
                )
            except gate.BudgetRefused as refused:
                hint = (
                    "it stays enrolled: make room in the rack, or an admin powers it on with "
                    f"`fleetctl servers power on {server.name} --override-budget --reason TEXT`; "
                    "then verify again"
                )
                message = gate.refusal_message(refused.need, hint)
                return VerifyReport(server.name, False, found, None, message)
            found = result.state_after if isinstance(result, ActionResult) else result
            why = "BMC verified; baseline server powered on"
        target = ServerState.BOOTING
    elif found == PowerState.OFF:
        target, why = ServerState.WARM, "BMC verified; the spare is off"
    else:
        return VerifyReport(
            server.name,
            False,
            found,
            None,
            f"server {server.name}: the BMC reports it {found.value}; a warm spare must be off "
            f"(power it off with `fleetctl servers power off {server.name}`, then verify again)",
        )
    with Session(engine) as session:
        lifecycle.transition(session, server.name, target, actor, why)
    return VerifyReport(server.name, True, found, target, why)


def verify(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    names: Sequence[str],
    actor: str,
    *,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
) -> list[VerifyReport]:
    """Verify every named server's BMC and move the enrolled ones on; one report each.

    Two phases. First every enrolled server's power state is read (all at once: reads draw no
    inrush), which records it, so that a server the fleet knew nothing of stops counting as
    on in its rack's budget. Then the spares found off turn warm and the baseline servers are
    powered on, staggered per rack, each through the rack budget gate: those past the budget
    stay enrolled with the refusal as their message."""
    names = list(dict.fromkeys(names))
    found = load_servers(engine, names)
    reports: dict[str, VerifyReport] = {}
    enrolled = []
    for name in names:
        server = found[name][0]
        if server.state != ServerState.ENROLLED:
            why = f"already {server.state}: nothing to do"
            reports[name] = VerifyReport(name, True, None, None, why)
        else:
            enrolled.append(name)

    def read(server: Server) -> Callable[[], ActionResult | PowerState]:
        return lambda: act_on(engine, box, settings, server, "status", actor, drivers=drivers)

    read_jobs = [Job(n, found[n][1], read(found[n][0]), spaced=False) for n in enrolled]
    states: dict[str, PowerState] = {}
    for outcome in run_bulk(read_jobs, power_stagger(settings, spaced=False)):
        if isinstance(outcome.value, PowerState):
            states[outcome.server] = outcome.value
        else:
            reports[outcome.server] = VerifyReport(
                outcome.server, False, None, None, str(outcome.error)
            )

    # Only a baseline server found not on is powered on: the others' jobs draw no inrush. The
    # gate is asked for those in the order given, before any of them is powered on.
    powered = [
        n
        for n in names
        if n in states and found[n][0].pool == Pool.BASELINE and states[n] is not PowerState.ON
    ]
    admissions = admit_in_order(engine, settings, powered, actor)

    def move(server: Server, state: PowerState) -> Callable[[], VerifyReport]:
        admitted = admissions.get(server.name)
        return lambda: _settle_verify(
            engine, box, settings, server, state, actor, drivers, admitted
        )

    move_jobs = [
        Job(n, found[n][1], move(found[n][0], state), spaced=n in admissions)
        for n, state in states.items()
    ]
    for moved in run_bulk(move_jobs, power_stagger(settings, spaced=True)):
        reports[moved.server] = moved.value or VerifyReport(
            moved.server, False, None, None, str(moved.error)
        )
    return [reports[n] for n in names]
