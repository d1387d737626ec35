"""The rack budget gate: every power-on (operator on/cycle, verify of a baseline server) asks
here first, under the placement lock, whether its rack's budget has room for it.

The provisioner's boots commit the same way under the same lock (fleet/provisioning/boots.py:
a spare moved to `booting` counts at its maximum from that commit on); this module is the gate
for the paths that power a server on without a lifecycle move first.

An admitted power-on is written ahead (`Server.power_committed_until`): the rack counts the
server at its maximum from that commit on, before its BMC has said anything, so two admissions
racing for the last headroom see each other (fleet/power/racks.py counts the commitment). Once
the BMC reports it on, the recorded power state counts and the commitment goes; a power-on the
BMC has not confirmed yet (sushy-tools applies a Reset seconds late; a read-back that failed)
keeps its commitment until the reconciler has had time to read it (`settle`).

A refusal (`BudgetRefused`, 409) names the rack, the server, the watts needed and the headroom.
An admin may override it with a reason: the power-on goes ahead, the rack records who, why and
when (shown by `fleetctl racks`) and an Event says so; `clear_settled_overrides` clears that
record once the rack's draw is back inside its budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet import locks
from fleet.errors import ConflictError, FleetError, NotFoundError
from fleet.lifecycle.states import POWERED, ServerState, draws_max_power
from fleet.models import BudgetMode, Event, PowerState, Rack, Server, as_utc, utcnow
from fleet.power.racks import Commitment, measured_commits, rack_views
from fleet.settings import Settings

# ---------------------------------------------------------------------------------------------
# The placement lock: the headroom check and the commitment, atomic across processes. The
# provisioner's boots take the same lock (the same name) in fleet/provisioning/boots.py.

PLACEMENT_LOCK = "fleet.placement"


@contextmanager
def placement_lock(session: Session) -> Iterator[None]:
    """Held for one placement transaction, across service processes (fleet/locks.py): on
    Postgres until the transaction ends, so commit inside the block."""
    with locks.transaction_lock(session, PLACEMENT_LOCK):
        yield


# ---------------------------------------------------------------------------------------------
# The rule (pure: plain data in, plain data out)


@dataclass(frozen=True, slots=True)
class Need:
    """What powering `server` on asks of its rack: `needed_w` more committed watts, against
    `headroom_w` of room (the budget less what the rack commits without this server's own
    uncertain count)."""

    rack: str
    server: str
    needed_w: float
    headroom_w: float
    budget_w: float
    committed_w: float  # budget_w - headroom_w: the rack's commitment the check starts from

    @property
    def fits(self) -> bool:
        """Adding nothing always fits, even on a rack past its budget (an override's)."""
        return self.needed_w <= max(0.0, self.headroom_w)

    @property
    def over_w(self) -> float:
        """How far past the budget the power-on takes the rack (0 when it fits)."""
        return max(0.0, self.needed_w - self.headroom_w)


def power_on_need(
    *,
    rack: str,
    server: str,
    budget_w: float,
    committed_w: float,
    on_w: float,
    standby_w: float,
    counted_on: bool,
    known_on: bool,
) -> Need:
    """The watts a power-on adds to its rack and the room there is for them.

    - `known_on` (its state is a powered one, its BMC last said on, or an admitted power-on
      still holds its commitment): it adds nothing, and always fits: a cycle of a serving
      server on a rack past its budget (an override) raises nothing.
    - otherwise it adds its on-draw less the standby it draws now (placement's
      `extra_draw_w` rule). A server `counted_on` only for want of a reading (the rack's
      `committed_w` already holds it at its on-draw) is taken out of that count first: the
      check is against what is known, so an unknown server fits only where the rack, counting
      it on, is still inside its budget.
    """
    extra = max(0.0, on_w - standby_w)
    if known_on:
        return Need(rack, server, 0.0, budget_w - committed_w, budget_w, committed_w)
    base = committed_w - extra if counted_on else committed_w
    return Need(rack, server, extra, budget_w - base, budget_w, base)


OVERRIDE_HINT = "an admin may override with --override-budget --reason TEXT"


def refusal_message(need: Need, hint: str = OVERRIDE_HINT) -> str:
    """One line: the rack, the server, the watts needed and the headroom, then `hint`."""
    return (
        f"rack {need.rack}: powering on {need.server} needs {need.needed_w:,.0f} W, "
        f"headroom {need.headroom_w:,.0f} W (budget {need.budget_w:,.0f} W, committed "
        f"{need.committed_w:,.0f} W); {hint}"
    )


# ---------------------------------------------------------------------------------------------
# Admission


class BudgetRefused(ConflictError):
    """A power-on its rack's budget has no room for (409); `need` holds the figures."""

    def __init__(self, need: Need) -> None:
        self.need = need
        super().__init__(refusal_message(need))


@dataclass(frozen=True, slots=True)
class Override:
    """An admin's explicit override of the budget gate, with the reason recorded."""

    actor: str
    reason: str

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise FleetError("a budget override needs a reason")


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted power-on. `committed_until`: the write-ahead commitment made for it (None:
    the server already counted as on, nothing was written)."""

    server: str
    rack: str
    needed_w: float
    headroom_w: float
    committed_until: datetime | None
    overridden: bool


def _known_on(server: Server, now: datetime) -> bool:
    committed = server.power_committed_until
    return (
        ServerState(server.state) in POWERED
        or server.power_state is PowerState.ON
        or (committed is not None and as_utc(committed) > now)
    )


def _on_w(session: Session, server: Server, rack: Rack, now: datetime, settings: Settings) -> float:
    """What the server commits once on: its maximum, or in a `measured` rack what placement
    counts for a boot there (its measured p99 × the rack's margin, fleet/power/racks.py)."""
    if rack.budget_mode != BudgetMode.MEASURED:
        return server.max_w
    commitment = Commitment(server.name, server.idle_w, server.max_w, rack.budget_margin)
    return measured_commits(session, [commitment], now=now, settings=settings)[server.name]


def admit(
    engine: Engine,
    settings: Settings,
    server_name: str,
    actor: str,
    *,
    override: Override | None = None,
    now: datetime | None = None,
) -> Admission:
    """Admit powering `server_name` on, or raise BudgetRefused (an admin's `override` admits
    it anyway, recorded on its rack and in an Event). The check and the commitment are one
    transaction under the placement lock."""
    with Session(engine) as session, placement_lock(session):
        now = now or utcnow()
        row = session.exec(
            select(Server, Rack)
            .join(Rack, col(Rack.id) == Server.rack_id)
            .where(Server.name == server_name)
        ).first()
        if row is None:
            raise NotFoundError(f"no server named {server_name!r}")
        server, rack = row
        [view] = rack_views(session, rack=rack.name, now=now, settings=settings, with_history=False)
        known_on = _known_on(server, now)
        need = power_on_need(
            rack=rack.name,
            server=server.name,
            budget_w=view.power.budget_w,
            # What the rack's headroom is counted from (its committed draw, or the drawn one
            # when that is larger: fleet/power/racks.py).
            committed_w=view.power.budget_w - view.power.headroom_w,
            on_w=_on_w(session, server, rack, now, settings),
            standby_w=server.standby_w,
            counted_on=known_on or draws_max_power(server.state, server.power_state),
            known_on=known_on,
        )
        if known_on:
            session.rollback()
            return Admission(server.name, rack.name, 0.0, need.headroom_w, None, False)
        overridden = not need.fits
        if overridden:
            if override is None:
                session.rollback()
                raise BudgetRefused(need)
            _record_override(session, rack, need, override, now)
        until = now + timedelta(seconds=settings.power_settle_s + settings.bmc_total_timeout_s)
        server.power_committed_until = until
        session.add(server)
        session.commit()
        return Admission(server.name, rack.name, need.needed_w, need.headroom_w, until, overridden)


def _record_override(
    session: Session, rack: Rack, need: Need, override: Override, now: datetime
) -> None:
    rack.budget_override_reason = override.reason
    rack.budget_override_by = override.actor
    rack.budget_override_at = now
    session.add(rack)
    session.add(
        Event(
            at=now,
            subject_type="rack",
            subject=rack.name,
            actor=override.actor,
            kind="rack.budget_override",
            message=(
                f"budget overridden to power on {need.server}: {need.over_w:,.0f} W over "
                f"(needs {need.needed_w:,.0f} W, headroom {need.headroom_w:,.0f} W); "
                f"reason: {override.reason}"
            ),
            details={
                "server": need.server,
                "needed_w": need.needed_w,
                "headroom_w": need.headroom_w,
                "over_w": need.over_w,
                "budget_w": need.budget_w,
                "reason": override.reason,
            },
        )
    )


def settle(
    engine: Engine, settings: Settings, admission: Admission | None, *, confirmed: bool
) -> None:
    """After the power action an admission was for. `confirmed` (the BMC said on, or nothing
    went out: the server was busy): the commitment goes, the recorded power state counts.
    Otherwise (sent but not yet confirmed, or failed in a way that may have sent it) it holds
    until the reconciler has read the server after its settle window. Never touches a
    commitment made since."""
    if admission is None or admission.committed_until is None:
        return
    now = utcnow()
    with Session(engine) as session:
        server = session.exec(select(Server).where(Server.name == admission.server)).first()
        if server is None:
            return
        current = server.power_committed_until
        if current is None or as_utc(current) > as_utc(admission.committed_until):
            return  # cleared already, or a newer admission's
        if confirmed:
            server.power_committed_until = None
        else:
            wait = settings.power_settle_s + settings.reconcile_interval_s
            server.power_committed_until = max(as_utc(current), now + timedelta(seconds=wait))
        session.add(server)
        session.commit()


# ---------------------------------------------------------------------------------------------
# Overrides that are no longer needed


def clear_settled_overrides(
    session: Session,
    now: datetime | None = None,
    *,
    settings: Settings | None = None,
    actor: str = "system:power",
) -> list[str]:
    """Clear the override record of every rack whose draw (committed, or measured when that is
    more) is back inside its budget, with a `rack.budget_override_cleared` Event each; commits,
    returns their names. A control loop calls it (the leader's)."""
    now = now or utcnow()
    overridden = {
        r.name for r in session.exec(select(Rack).where(col(Rack.budget_override_at).is_not(None)))
    }
    if not overridden:
        return []
    cleared: list[str] = []
    for view in rack_views(session, now=now, settings=settings, with_history=False):
        if view.rack.name not in overridden or view.power.headroom_w < 0:
            continue
        rack = view.rack
        load_w = view.power.budget_w - view.power.headroom_w  # committed, or drawn if more
        session.add(
            Event(
                at=now,
                subject_type="rack",
                subject=rack.name,
                actor=actor,
                kind="rack.budget_override_cleared",
                message=(
                    f"the rack's draw ({load_w:,.0f} W) is back inside its budget "
                    f"{view.power.budget_w:,.0f} W; the override by {rack.budget_override_by} "
                    f"({rack.budget_override_reason}) is cleared"
                ),
                details={
                    "load_w": load_w,
                    "budget_w": view.power.budget_w,
                    "by": rack.budget_override_by,
                    "reason": rack.budget_override_reason,
                },
            )
        )
        rack.budget_override_reason = rack.budget_override_by = None
        rack.budget_override_at = None
        session.add(rack)
        cleared.append(rack.name)
    session.commit()
    return cleared
