"""The provisioner's tick: boot, load, serve, drain, remediate, one step per server state.

Every workflow is a step the leader's tick (`provision_once`) takes from what the database says
now, so a crashed process loses nothing: nothing lives only in a coroutine. Each step is one
transaction through `fleet.lifecycle.transitions.transition` (compare-and-set, an Event each).

- **scale out**: `boot_spares` (fleet/provisioning/boots.py) picks warm spares and moves them to
  `booting` under one placement lock, so the rack-headroom check and the commitment are atomic
  across processes. The tick powers them on (write-ahead: `power_on_sent_at` is committed
  before the BMC call, so a crash between the call and the write never sends a second
  power-on before `power_retry_after_s`, by which time the BMC reports on), waits for the
  agent to register (→ `loading`: the heartbeat answer carries the assignment) and for every
  replica to be ready (→ `serving`). Deadlines: boot, load → `failed` with the reason.
- **capacity**: each deployment has `target_servers`; servers booting, loading or serving for it
  count. Short → spares boot (a failed or quarantined server is replaced this way); over →
  the least valuable servers drain and return to the warm pool (scale in).
- **return**: `serving → draining` (the agent drains) → `drained → powering_off` (BMC off) →
  `warm` once the BMC reports off.
- **pre-staging**: after capacity, warm spares are powered on to fetch the version of each
  deployment asking for `cached_spares`, then powered off again (fleet/provisioning/staging.py:
  `warm → booting → loading → powering_off → warm`, no deployment); a scale-out takes a staging
  spare first.
- **remediation**: a repair action `reboot` → drain → power cycle → `booting` again; the same
  fault after `max_reboots_same_fault` reboots, or `hardware_inspection`, → `quarantined`.
  A server silent for `heartbeat_cycle_after_s` is drained and power cycled too. With
  `remediation_ssh_reboot`, the OS is first asked to reboot over SSH and the power cycle
  follows only if that fails or the agent is not back in time (graceful_reboot.py).
- **bounds**: a deployment's disruption budget caps its servers draining or rebooting at once;
  if more than `breaker_share` of the servers turn unhealthy within `breaker_window_s`, the
  breaker opens and no automatic drain or cycle happens until an operator resumes; the
  autopilot can be paused altogether (both in fleet/provisioning/autopilot.py); after a leader
  change, silence counts only after `leader_grace_s`.

The steps decide on BMC actions and do not wait for them: each step commits its write-ahead
mark and queues the action; the tick then runs them all at once through `run_bulk`, under the
same bounds as an operator's bulk power (`power_stagger`: `bmc_workers` at once, power-ons at
most `power_on_per_rack` per rack, `power_on_rack_delay_s` apart), and applies each outcome in
the tick's own thread before capacity counts. 32 boots behind 1 s BMCs take seconds, not 32 round
trips one after another, and a rack's inrush stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.bmc import BmcError, PowerDriver, driver_for
from fleet.bmc.base import Action, ActionResult, BmcTarget, BmcUnreachable
from fleet.bmc.bulk import Job, Outcome, run_bulk
from fleet.crypto import SecretBox
from fleet.errors import ConflictError, FleetError
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, Pool, PowerState, Rack, Server, utcnow
from fleet.power.actions import SPACED, ServerBusy, act_on, power_stagger
from fleet.power.racks import commit_watts
from fleet.provisioning import graceful_reboot, placement, quality_probe, staging
from fleet.provisioning.autopilot import check_breaker, get_autopilot
from fleet.provisioning.boot_times import record_boot
from fleet.provisioning.boots import ACTIVE, boot_spares, placement_lock, rack_rooms, start_boot
from fleet.provisioning.escalation import escalate
from fleet.settings import Settings

S = ServerState
ACTOR = "provisioner"
# Servers counted against a deployment's disruption budget.
DISRUPTED = frozenset({S.DRAINING, S.DRAINED})
REMEDIATION_ACTIONS = frozenset({"reboot", "hardware_inspection"})
# Boots whose boot-to-ready counts per cache state (boot_to_ready_cached_s / _uncached_s).
BOOT_KINDS = frozenset({"power_on", "cycle", graceful_reboot.KIND})


# ---------------------------------------------------------------------------------------------
# The tick


@dataclass
class TickReport:
    paused: bool = False
    breaker_open: bool = False
    moves: list[str] = field(default_factory=list)
    power_actions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    staging: list[str] = field(default_factory=list)  # why a pre-staging goal is unmet


@dataclass(frozen=True, slots=True)
class PowerCall:
    """A BMC action a step decided on, run with the tick's others (`ProvisionTick._send_power`).
    `on_busy`: another power action held the server, nothing went out (None: nothing to undo);
    `on_error`: the BMC call failed, with its one-line message; `on_unanswered` (None: as
    `on_error`): no answer came, so the command may have been applied (a BMC slower than the
    call timeout, a link cut after the request went out)."""

    server: Server
    rack: str
    action: Action
    on_error: Callable[[str], None]
    on_busy: Callable[[], None] | None = None
    on_unanswered: Callable[[str], None] | None = None


def provision_once(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    *,
    drivers: Callable[[BmcTarget], PowerDriver] = driver_for,
    leader_since: datetime | None = None,
    ask_agent: quality_probe.AskAgent | None = None,  # None: over http(s), the settings' TLS
    request_reboot: graceful_reboot.RequestReboot = graceful_reboot.over_ssh,
) -> TickReport:
    report = TickReport()
    with Session(engine) as session:
        autopilot = get_autopilot(session)
        if autopilot.paused:
            report.paused = True
            return report
        report.breaker_open = check_breaker(session, settings, autopilot, ACTOR)
    tick = ProvisionTick(engine, box, settings, drivers, report, leader_since)
    tick.ask_agent = ask_agent
    tick.request_reboot = request_reboot
    tick.run()
    return report


class ProvisionTick:
    """One tick of the provisioner: what it acts with (database, BMC drivers, settings), when
    it runs (`now`), what it did (`report`), and one step per server state."""

    def __init__(
        self,
        engine: Engine,
        box: SecretBox,
        settings: Settings,
        drivers: Callable[[BmcTarget], PowerDriver],
        report: TickReport,
        leader_since: datetime | None,
    ) -> None:
        self.engine, self.box, self.settings, self.drivers = engine, box, settings, drivers
        self.report = report
        self.leader_since = leader_since
        self.ask_agent: quality_probe.AskAgent | None = None
        self.now = utcnow()
        self.pending: list[PowerCall] = []  # the steps' BMC actions, sent by `_send_power`
        self.reboots: list[str] = []  # servers whose OS is asked to reboot over SSH this tick
        self.request_reboot: graceful_reboot.RequestReboot = graceful_reboot.over_ssh
        self.short = False  # a deployment stayed short of its target this tick

    def run(self) -> None:
        try:
            for name, state in self._servers():
                try:
                    self._step(name, state)
                except (ConflictError, ServerBusy):
                    continue  # someone else moved it this instant: next tick
                except FleetError as exc:
                    self.report.errors.append(f"{name}: {exc}")
        finally:
            # Even after a step's bug: the queued actions' write-ahead marks are committed, so
            # they go out (a cycle's mark is never retried). Before capacity: a boot the BMC
            # refused fails now and is replaced in this tick.
            try:
                self._send_power()
            finally:
                # After the BMC actions (they must never wait behind SSH), and even if
                # sending those failed: the reboots' write-ahead marks are committed too.
                self._send_reboots()
        try:
            self._hold_capacity()
        except FleetError as exc:
            self.report.errors.append(str(exc))
        # Pre-staging only with nothing more pressing: not while the breaker is open, nor
        # while scale-out is short (it needs the spares and the headroom more).
        if not self.report.breaker_open and not self.short:
            try:
                staged = staging.stage_once(self.engine, self.settings, ACTOR)
            except FleetError as exc:
                self.report.errors.append(f"pre-staging: {exc}")
            else:
                for line in staged.started:
                    name, _, why = line.partition(": ")
                    self.report.moves.append(f"{name} -> booting: {why}")
                self.report.staging.extend(staged.gaps)
        if not self.report.breaker_open:
            for name in quality_probe.probe_due(self.engine, self.settings):
                outcome = quality_probe.probe_server(
                    self.engine, self.settings, name, self.ask_agent, box=self.box
                )
                if not outcome.ok:
                    self.report.moves.append(f"{name} -> draining: {outcome.detail}")

    def _servers(self) -> list[tuple[str, ServerState]]:
        with Session(self.engine) as session:
            rows = session.exec(
                select(Server.name, Server.state).where(
                    col(Server.state).in_(
                        [S.BOOTING, S.LOADING, S.SERVING, S.DRAINING, S.DRAINED, S.POWERING_OFF]
                    )
                )
            )
            return [(n, ServerState(s)) for n, s in rows]

    def _step(self, name: str, state: ServerState) -> None:
        handler = {
            S.BOOTING: self._booting,
            S.LOADING: self._loading,
            S.SERVING: self._serving,
            S.DRAINING: self._draining,
            S.DRAINED: self._drained,
            S.POWERING_OFF: self._powering_off,
        }[state]
        handler(name)

    # -- helpers ---------------------------------------------------------------------------

    def _load(self, session: Session, name: str) -> Server:
        return session.exec(select(Server).where(Server.name == name)).one()

    def _move(self, session: Session, server: Server, to: ServerState, reason: str) -> None:
        lifecycle.transition(session, server, to, ACTOR, reason, commit=False)
        self.report.moves.append(f"{server.name} -> {to.value}: {reason}")

    def _fail(self, session: Session, server: Server, reason: str) -> None:
        self._move(session, server, S.FAILED, reason)
        server.failed_reason = reason[:500]
        if staging.is_staging(server):  # a stage ends with its server
            server.stage_version_id = None
            server.stage_started_at = None
        session.add(server)

    def _elapsed(self, since: datetime | None) -> float:
        return (self.now - since).total_seconds() if since is not None else 0.0

    def _power(
        self,
        name: str,
        action: Action,
        on_error: Callable[[str], None] | None = None,
        on_busy: Callable[[], None] | None = None,
        on_unanswered: Callable[[str], None] | None = None,
    ) -> None:
        """Queue one BMC power action on `name`; `_send_power` runs it. `on_error` (default:
        the error reported) and `on_busy` run in the tick's thread once it has been tried."""
        with Session(self.engine) as session:
            server = self._load(session, name)
        if on_error is None:
            on_error = partial(self._report_error, name)
        # The rack id is the stagger's key: only one rack's power-ons share a slot.
        self.pending.append(
            PowerCall(server, str(server.rack_id), action, on_error, on_busy, on_unanswered)
        )

    def _report_error(self, name: str, error: str) -> None:
        self.report.errors.append(f"{name}: {error}")

    def _send_power(self) -> None:
        """Every queued action at once, through the one power path (fleet/power/actions.py:
        each server's power lock, the observed fields, the event), bounded like an operator's
        bulk power; returns once all have ended, their outcomes applied in this thread."""
        calls, self.pending = self.pending, []
        jobs = [
            Job(
                call.server.name,
                call.rack,
                partial(
                    act_on,
                    self.engine,
                    self.box,
                    self.settings,
                    call.server,
                    call.action,
                    ACTOR,
                    drivers=self.drivers,
                ),
                spaced=call.action in SPACED,
            )
            for call in calls
        ]
        outcomes = run_bulk(jobs, power_stagger(self.settings, spaced=True))
        unexpected: Exception | None = None
        for call, outcome in zip(calls, outcomes, strict=True):
            try:
                self._apply(call, outcome)
            except ConflictError:
                continue  # someone else moved it this instant: next tick
            except FleetError as exc:
                self.report.errors.append(f"{call.server.name}: {exc}")
            except Exception as exc:  # not a BMC's answer: a bug, raised once the rest is applied
                unexpected = unexpected or exc
        if unexpected is not None:
            raise unexpected

    def _send_reboots(self) -> None:
        """The graceful reboots the steps queued, at once over SSH; a server whose OS could not
        be asked falls back to the BMC power cycle (sent by its next `_booting` step)."""
        names, self.reboots = self.reboots, []
        outcomes = graceful_reboot.send(self.engine, self.settings, names, self.request_reboot)
        for name, error in outcomes.items():
            with Session(self.engine) as session:
                server = self._load(session, name)
                if server.state is not S.BOOTING or server.boot_kind != graceful_reboot.KIND:
                    continue  # moved on meanwhile
                if error is None:
                    graceful_reboot.record_asked(session, server, ACTOR, self.now)
                    self.report.power_actions.append(f"{name}: reboot over SSH")
                else:
                    graceful_reboot.fall_back(session, server, ACTOR, error, self.now)
                    self.report.errors.append(f"{name}: {error}")
                session.commit()

    def _apply(self, call: PowerCall, outcome: Outcome[ActionResult | PowerState]) -> None:
        error = outcome.error
        if error is None:
            result = outcome.value
            assert isinstance(result, ActionResult)  # an action, not a read
            self.report.power_actions.append(
                f"{call.server.name}: {call.action} (sent={result.sent})"
            )
        elif isinstance(error, ServerBusy):
            if call.on_busy is not None:
                call.on_busy()
        elif isinstance(error, BmcUnreachable) and call.on_unanswered is not None:
            call.on_unanswered(str(error))
        elif isinstance(error, BmcError):
            call.on_error(str(error))
        else:
            raise error

    # -- booting ---------------------------------------------------------------------------

    def _booting(self, name: str) -> None:
        s = self.settings
        with Session(self.engine) as session:
            server = self._load(session, name)
            started = server.boot_started_at or server.state_changed_at
            if server.boot_kind == graceful_reboot.KIND and not self._agent_up_since(
                server, started
            ):
                if server.ssh_reboot_sent_at is None:
                    graceful_reboot.mark_sent(session, server, self.now)
                    session.commit()
                    self.reboots.append(name)
                elif graceful_reboot.deadline_passed(server, s, self.now):
                    if self.report.breaker_open:
                        return  # no automatic power cycle while the breaker is open
                    graceful_reboot.fall_back(
                        session,
                        server,
                        ACTOR,
                        f"the agent did not register within {s.ssh_reboot_deadline_s:g} s of "
                        "the reboot asked over SSH",
                        self.now,
                    )
                    self.report.moves.append(f"{name}: SSH reboot timed out, power cycle next")
                    session.commit()
                return
            if server.power_on_sent_at is None and server.boot_kind not in (
                "resume",
                graceful_reboot.KIND,
            ):
                # Write-ahead: committed before the BMC hears of it.
                server.power_on_sent_at = self.now
                session.add(server)
                session.commit()
                action: Action = "cycle" if server.boot_kind == "cycle" else "on"

                def busy() -> None:
                    # Another power action (a reconciler read) held the server: nothing went
                    # out, so the write-ahead mark goes and the next tick tries again.
                    with Session(self.engine) as again:
                        row = self._load(again, name)
                        row.power_on_sent_at = None
                        again.add(row)
                        again.commit()

                def failed(error: str) -> None:
                    with Session(self.engine) as again:
                        row = self._load(again, name)
                        self._fail(again, row, f"BMC power {action} failed: {error}")
                        again.commit()

                def unanswered(error: str) -> None:
                    # The power-on may have gone out and the server be coming up: failing the
                    # boot would strand it powered on, doing nothing. The write-ahead mark
                    # stays; the retry below reads the BMC after power_retry_after_s and sends
                    # again only if it is still off; the boot deadline bounds the wait.
                    self.report.errors.append(
                        f"{name}: {error}; power {action} unanswered: read again after "
                        f"{s.power_retry_after_s:g} s, sent again only if still off"
                    )

                # A cycle is never asked twice (it would cycle a server that came up): its
                # unanswered call fails the boot, as any error does.
                self._power(
                    name,
                    action,
                    on_error=failed,
                    on_busy=busy,
                    on_unanswered=unanswered if action == "on" else None,
                )
                return
            if self._agent_up_since(server, started):
                if staging.is_staging(server):
                    self._move(
                        session,
                        server,
                        S.LOADING,
                        "agent registered; fetching its version into the cache (pre-staging)",
                    )
                    server.load_started_at = self.now
                    session.add(server)
                    session.commit()
                    return
                if server.deployment_id is None:
                    return  # an idle baseline server: capacity hands it a deployment
                self._move(
                    session,
                    server,
                    S.LOADING,
                    "agent registered; assignment sent with its next heartbeat",
                )
                server.load_started_at = self.now
                session.add(server)
                session.commit()
                return
            if self._elapsed(started) > s.boot_deadline_s:
                self._fail(
                    session,
                    server,
                    f"boot deadline: no agent registration within {s.boot_deadline_s:g} s",
                )
                session.commit()
                return
            # Write-ahead power-on without an answer yet (a crash, or a BMC that dropped it):
            # ask again only after the BMC has had time to apply the first one.
            sent = server.power_on_sent_at
            if (
                sent is not None
                and server.boot_kind in ("power_on", staging.KIND)
                and server.power_state is not PowerState.ON
                and self._elapsed(sent) > s.power_retry_after_s
            ):
                server.power_on_sent_at = self.now
                session.add(server)
                session.commit()
                self._power(name, "on")  # reads first: sends nothing if it is on

    def _agent_up_since(self, server: Server, started: datetime) -> bool:
        if server.boot_kind == "resume":
            return server.last_heartbeat_at is not None and server.last_heartbeat_at > started
        registered = server.agent_registered_at
        return registered is not None and registered > started

    # -- loading ---------------------------------------------------------------------------

    def _loading(self, name: str) -> None:
        s = self.settings
        with Session(self.engine) as session:
            server = self._load(session, name)
            if staging.is_staging(server):
                self._stage_step(session, server)
                return
            started = server.load_started_at or server.state_changed_at
            fresh = server.last_heartbeat_at is not None and server.last_heartbeat_at > started
            replicas = server.replicas or []
            if (
                fresh
                and server.agent_ready
                and replicas
                and all(r.get("state") == "ready" for r in replicas)
            ):
                self._move(session, server, S.SERVING, f"all {len(replicas)} replicas ready")
                server.load_s = round(self._elapsed(started), 3)
                if server.boot_started_at is not None:
                    server.boot_to_ready_s = round(self._elapsed(server.boot_started_at), 3)
                    # Per cache state, for a real boot that began in that state (not a
                    # resume, which boots nothing, nor a stage a scale-out took over).
                    hit = server.boot_cache_hit if server.boot_kind in BOOT_KINDS else None
                    if hit is not None:
                        if hit:
                            server.boot_to_ready_cached_s = server.boot_to_ready_s
                        else:
                            server.boot_to_ready_uncached_s = server.boot_to_ready_s
                    record_boot(
                        session,
                        server,
                        server.boot_to_ready_s,
                        server.load_s,
                        hit,
                        s.boot_history_days,
                        self.now,
                    )
                session.add(server)
                session.commit()
                return
            # A replica its supervisor gave up on (crashes in a row, a version the agent does
            # not drive) will not come ready by the deadline: fail now, with its error.
            failed = [r for r in replicas if r.get("state") == "failed"] if fresh else []
            if failed:
                first = failed[0]
                # One line, whatever the agent sent (the agent's own collapses it too)
                why = " ".join(str(first.get("error") or "no error reported").split())
                self._fail(
                    session,
                    server,
                    f"replica {first.get('index', '?')} failed ({len(failed)} of "
                    f"{len(replicas)} failed): {why}",
                )
                session.commit()
                return
            if self._elapsed(started) > s.load_deadline_s:
                self._fail(
                    session,
                    server,
                    f"load deadline: replicas not ready within {s.load_deadline_s:g} s",
                )
                session.commit()

    def _stage_step(self, session: Session, server: Server) -> None:
        """A staging spare in `loading`: once its version is verified, its fetch failed or the
        stage deadline passed, back to the warm pool, with one Event saying how it went."""
        outcome = staging.progress(session, server, self.settings, self.now)
        if outcome is None:
            return
        why = ("pre-staged: " if outcome.ok else "pre-stage failed: ") + outcome.message
        self._move(session, server, S.POWERING_OFF, why[:500])
        server.power_off_sent_at = None
        session.add(server)
        session.add(staging.outcome_event(server, outcome, ACTOR, self.now))
        session.commit()

    # -- serving ---------------------------------------------------------------------------

    def _serving(self, name: str) -> None:
        if self.report.breaker_open:
            return  # no automatic drains while the breaker is open
        with Session(self.engine) as session:
            server = self._load(session, name)
            reason: str | None = None
            if server.health_action in REMEDIATION_ACTIONS:
                codes = ", ".join(r.get("code", "?") for r in server.health_reasons) or "?"
                reason = f"remediation: agent asks for {server.health_action} ({codes})"
                server.last_fault = codes[:200]
            elif self._silent(server):
                reason = (
                    f"remediation: no heartbeat for {self._elapsed(server.last_heartbeat_at):.0f} s"
                )
                server.last_fault = "missed_heartbeats"
            if reason is None or not self._budget_allows(session, server):
                return
            server.drain_reason = "remediation"
            server.drain_started_at = self.now
            self._move(session, server, S.DRAINING, reason)
            session.add(server)
            session.commit()

    def _silent(self, server: Server) -> bool:
        if server.last_heartbeat_at is None:
            return False
        silent = self._elapsed(server.last_heartbeat_at)
        if self.leader_since is not None:
            # After a leader change, silence counts only after a grace period.
            silent = min(silent, self._elapsed(self.leader_since) - self.settings.leader_grace_s)
        return silent > self.settings.heartbeat_cycle_after_s

    def _budget_allows(self, session: Session, server: Server) -> bool:
        if server.deployment_id is None:
            return True
        deployment = session.get(Deployment, server.deployment_id)
        budget = deployment.disruption_budget if deployment else 1
        disrupted = session.exec(
            select(sa.func.count())
            .select_from(Server)
            .where(
                Server.deployment_id == server.deployment_id,
                col(Server.state).in_(list(DISRUPTED)),
            )
        ).one()
        return int(disrupted) < budget

    # -- draining and drained --------------------------------------------------------------

    def _draining(self, name: str) -> None:
        with Session(self.engine) as session:
            server = self._load(session, name)
            started = server.drain_started_at or server.state_changed_at
            heard = server.last_heartbeat_at is not None and server.last_heartbeat_at > started
            engines_idle = not any(
                r.get("state") not in (None, "stopped") for r in (server.replicas or [])
            )
            drained = heard and server.agent_draining and engines_idle
            overdue = self._elapsed(started) > self.settings.drain_deadline_s
            if drained or overdue:
                why = (
                    "the agent drained"
                    if drained
                    else (f"drain deadline ({self.settings.drain_deadline_s:g} s) passed")
                )
                self._move(session, server, S.DRAINED, why)
                session.commit()

    def _drained(self, name: str) -> None:
        with Session(self.engine) as session:
            server = self._load(session, name)
            if server.drain_reason == "scale_in":
                self._move(session, server, S.POWERING_OFF, "returning to the warm pool")
                server.power_off_sent_at = None
                session.add(server)
                session.commit()
                return
            if server.drain_reason == "resume":
                deployment = (
                    session.get(Deployment, server.deployment_id) if server.deployment_id else None
                )
                start_boot(session, server, deployment, "resume", ACTOR, "undrained: loading again")
                session.commit()
                return
            if server.drain_reason != "remediation" or self.report.breaker_open:
                return  # an operator's drain waits for the operator
            remedy = escalate(
                server.health_action,
                server.last_fault,
                reboot_fault=server.reboot_fault,
                reboot_count=server.reboot_count,
                max_reboots=self.settings.max_reboots_same_fault,
            )
            if remedy.quarantine:
                self._move(session, server, S.QUARANTINED, remedy.why)
                server.deployment_id = None
                session.add(server)
                session.commit()
                return
            server.reboot_count = remedy.reboot_count
            server.reboot_fault = remedy.reboot_fault
            deployment = (
                session.get(Deployment, server.deployment_id) if server.deployment_id else None
            )
            graceful = graceful_reboot.wanted(server, self.settings)
            kind = graceful_reboot.KIND if graceful else "cycle"
            server.ssh_reboot_sent_at = None
            start_boot(session, server, deployment, kind, ACTOR, remedy.why)
            self.report.moves.append(
                f"{name} -> booting ({'reboot over SSH' if graceful else 'power cycle'})"
            )
            session.commit()

    # -- powering off ----------------------------------------------------------------------

    def _powering_off(self, name: str) -> None:
        with Session(self.engine) as session:
            server = self._load(session, name)
            if server.power_off_sent_at is None:
                server.power_off_sent_at = self.now
                session.add(server)
                session.commit()

                def busy() -> None:  # nothing went out: try again next tick
                    with Session(self.engine) as again:
                        row = self._load(again, name)
                        row.power_off_sent_at = None
                        again.add(row)
                        again.commit()

                self._power(name, "off", on_busy=busy)
                return
            if server.power_state is PowerState.OFF:
                self._move(session, server, S.WARM, "the BMC reports it off: back in the warm pool")
                server.deployment_id = None
                server.drain_reason = None
                server.stage_version_id = None  # a staging spare's stage ends here
                server.stage_started_at = None
                session.add(server)
                session.commit()
                return
            waited = self._elapsed(server.power_off_sent_at)
            if waited > self.settings.power_off_deadline_s:
                self._fail(
                    session,
                    server,
                    f"the BMC did not power it off within {self.settings.power_off_deadline_s:g} s",
                )
                session.commit()
                return
            if waited > self.settings.power_retry_after_s:
                # A graceful shutdown the OS ignored: read again, force it off if still on.
                session.close()
                self._power(name, "force_off")

    # -- capacity --------------------------------------------------------------------------

    def _hold_capacity(self) -> None:
        with Session(self.engine) as session:
            deployments = list(session.exec(select(Deployment)))
            counts: dict[tuple[int | None, ServerState], int] = {
                (dep, ServerState(state)): int(n)
                for dep, state, n in session.exec(
                    select(Server.deployment_id, Server.state, sa.func.count())
                    .where(
                        col(Server.state).in_(list(ACTIVE)), col(Server.deployment_id).is_not(None)
                    )
                    .group_by(col(Server.deployment_id), col(Server.state))
                )
            }
        for deployment in deployments:
            have = sum(counts.get((deployment.id, state), 0) for state in ACTIVE)
            serving = counts.get((deployment.id, S.SERVING), 0)
            if have < deployment.target_servers:
                self._fill(deployment, deployment.target_servers - have)
            # A surplus is released only once it serves: a replacement still booting and a
            # server back from its reboot both count until then.
            elif serving > deployment.target_servers and not self.report.breaker_open:
                self._release(deployment, serving - deployment.target_servers)

    def _fill(self, deployment: Deployment, missing: int) -> None:
        # Baseline servers first: on already, idle (booting, agent up, no deployment).
        with Session(self.engine) as session, placement_lock(session):
            idle = list(
                session.exec(
                    select(Server)
                    .where(
                        Server.pool == Pool.BASELINE,
                        Server.state == S.BOOTING,
                        col(Server.deployment_id).is_(None),
                        col(Server.gpu_model).in_(deployment.gpu_models or [Server.gpu_model]),
                    )
                    .order_by(col(Server.name))
                )
            )[:missing]
            for server in idle:
                server.deployment_id = deployment.id
                session.add(server)
                self.report.moves.append(f"{server.name}: baseline server takes {deployment.name}")
            # Then spares powered on for a stage: on already, maybe holding the version.
            taken = staging.take_staging(
                session, deployment, missing - len(idle), deployment.model_version_id
            )
            for server in taken:
                message = f"taken by scale-out of {deployment.name} while pre-staging"
                session.add(
                    Event(
                        at=self.now,
                        subject_type="server",
                        subject=server.name,
                        actor=ACTOR,
                        kind="server.stage_taken",
                        message=message,
                        details={"deployment": deployment.name},
                    )
                )
                self.report.moves.append(f"{server.name}: {message}")
            session.commit()
        missing -= len(idle) + len(taken)
        if missing <= 0:
            return
        result = boot_spares(
            self.engine, deployment.name, missing, ACTOR, raise_target=False, settings=self.settings
        )
        for name in result.booted:
            self.report.moves.append(f"{name} -> booting for {deployment.name} (capacity)")
        if result.short:
            self.short = True
            why = "; ".join(result.reasons) or "no spare fits"
            self.report.errors.append(
                f"{deployment.name}: {result.short} server(s) short of target: {why}"
            )

    def _release(self, deployment: Deployment, extra: int) -> None:
        with Session(self.engine) as session:
            rows = list(
                session.exec(
                    select(Server, Rack)
                    .join(Rack, col(Rack.id) == Server.rack_id)
                    .where(Server.deployment_id == deployment.id, Server.state == S.SERVING)
                )
            )
            # What a release frees: its commitment (nameplate, or measured in a measured rack).
            commits = commit_watts(session, rows)
            serving = [
                placement.Serving(
                    name=s.name,
                    rack=rack.name,
                    deployment=deployment.name,
                    in_flight=sum(
                        int(r.get("queued") or 0) + int(r.get("running") or 0)
                        for r in s.replicas or []
                    ),
                    max_w=commits[s.name],
                    standby_w=s.standby_w,
                )
                for s, rack in rows
                if s.pool == Pool.WARM  # baseline servers stay on
            ]
            chosen = placement.choose_release(serving, rack_rooms(session), deployment.name, extra)
            for name in chosen:
                server = self._load(session, name)
                if not self._budget_allows(session, server):
                    break
                server.drain_reason = "scale_in"
                server.drain_started_at = self.now
                self._move(session, server, S.DRAINING, f"scale in {deployment.name}")
                session.add(server)
                session.commit()
