"""fleet.provisioning (boots, tick, autopilot, operator moves) on both databases, with a
scripted BMC and scripted agent reports.

The virtual-colo end-to-end runs are in tests/e2e/worlds/test_provisioning_e2e.py; here each
workflow step is driven tick by tick (`provision_once`) so every rule is pinned exactly: the
write-ahead power-on (one power-on even when the process dies after the BMC call), deadlines,
capacity and replacement, remediation and quarantine, the disruption budget, the breaker and the
pause, and atomic placement against a rack's last headroom.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, feed
from fake_bmcs import ActingBmc
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.bmc.base import ActionResult, BmcAuthFailed, BmcUnreachable
from fleet.crypto import SecretBox
from fleet.errors import FleetError
from fleet.lifecycle.states import ServerState
from fleet.models import BootRecord, Deployment, Event, Pool, PowerState, Server, utcnow
from fleet.provisioning.autopilot import get_autopilot, set_paused
from fleet.provisioning.boots import BootResult, boot_spares
from fleet.provisioning.operator_moves import operator_drain, operator_undrain
from fleet.provisioning.tick import TickReport, provision_once
from fleet.settings import Settings

S = ServerState
ON, OFF = PowerState.ON, PowerState.OFF
BOX = SecretBox(TEST_SECRET_KEY)


class Crash(BaseException):
    """The process dies right after the BMC got the command (before any database write)."""


class Bmc(ActingBmc):
    """A BMC that applies at once. Shared per server name: state, commands received."""

    state: dict[str, PowerState] = {}
    commands: list[tuple[str, str]] = []
    crash_after_send: set[str] = set()
    refuse: set[str] = set()
    # Applies the command, then its answer is lost (a BMC slower than the call timeout).
    unanswered: set[str] = set()
    lock = threading.Lock()

    def power_state(self) -> PowerState:
        if self.target.server in self.refuse:
            raise BmcAuthFailed(self.target, "authentication refused")
        return self.state.get(self.target.server, OFF)

    def _send(self, action: str, want: PowerState) -> ActionResult:
        before = self.power_state()
        if self.target.server in self.unanswered:
            with self.lock:
                self.commands.append((self.target.server, action))
                self.state[self.target.server] = want
            raise BmcUnreachable(self.target, "timed out (the Reset may still be applied)")
        if before == want and action != "cycle":
            return ActionResult(action, False, before, before)  # type: ignore[arg-type]
        with self.lock:
            self.commands.append((self.target.server, action))
            self.state[self.target.server] = want
        if self.target.server in self.crash_after_send:
            self.crash_after_send.discard(self.target.server)
            raise Crash()
        return ActionResult(action, True, before, want)  # type: ignore[arg-type]


def settings(**overrides: Any) -> Settings:
    return Settings(
        **{
            "boot_deadline_s": 60.0,
            "load_deadline_s": 60.0,
            "drain_deadline_s": 60.0,
            "power_retry_after_s": 30.0,
            "breaker_share": 0.2,
            **overrides,
        }
    )


def tick(db: Engine, **overrides: Any) -> TickReport:
    return provision_once(db, BOX, settings(**overrides), drivers=Bmc)


@pytest.fixture(autouse=True)
def fresh_bmc() -> Iterator[None]:
    Bmc.state, Bmc.commands, Bmc.crash_after_send = {}, [], set()
    Bmc.refuse, Bmc.unanswered = set(), set()
    yield


@pytest.fixture
def fleet(session: Session) -> dict[str, Any]:
    """Two racks of warm H100 spares (room for two boots each), one deployment."""
    site = add_site(session, "s1")
    racks = {}
    # 415 V x 16 A x sqrt(3) x 0.8 = 9,201 W per side: budget for ~2 spares at 4 kW max.
    for name in ("r1", "r2"):
        racks[name] = add_rack(session, site, name, feeds=[feed("A", amps=16), feed("B", amps=16)])
    spares = []
    for rack in ("r1", "r2"):
        for i in range(3):
            name = f"{rack}-gpu{i}"
            add_server(
                session,
                racks[rack],
                name,
                "warm",
                u_position=1 + 8 * i,
                bmc_system_id=name,
                pool=Pool.WARM,
                max_w=4000.0,
                standby_w=50.0,
            )
            spares.append(name)
    deployment = Deployment(
        name="llama",
        model_uri="s3://m/llama-8b",
        model_checksum="sha256:1",
        engine_params={"backend": "pytorch"},
        gpus_per_replica=8,
        gpu_models=["H100"],
        max_replicas=8,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=300,
        disruption_budget=1,
    )
    session.add(deployment)
    session.commit()
    return {"spares": spares, "deployment": deployment.name}


def row(db: Engine, name: str) -> Server:
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        session.expunge(server)
        return server


def states(db: Engine) -> dict[str, str]:
    with Session(db) as session:
        return {s.name: s.state.value for s in session.exec(select(Server))}


def agent_reports(db: Engine, name: str, **fields: Any) -> None:
    """What a heartbeat or registration of the server's agent would write."""
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        now = utcnow()
        server.last_heartbeat_at = now
        for key, value in fields.items():
            setattr(server, key, now if value == "now" else value)
        session.add(server)
        session.commit()


READY = [{"index": 0, "state": "ready"}]


def serve(db: Engine, name: str) -> None:
    """Walk a booting server to serving the way its agent would make it happen."""
    tick(db)  # power on
    agent_reports(db, name, agent_registered_at="now")
    tick(db)  # -> loading
    agent_reports(db, name, agent_ready=True, replicas=READY)
    tick(db)  # -> serving
    assert row(db, name).state == S.SERVING


def set_pool(db: Engine, names: list[str], pool: Pool) -> None:
    with Session(db) as session:
        for server in session.exec(select(Server).where(col(Server.name).in_(names))):
            server.pool = pool
            session.add(server)
        session.commit()


def target(db: Engine, name: str) -> int:
    with Session(db) as session:
        return session.exec(select(Deployment).where(Deployment.name == name)).one().target_servers


def test_spares_boot_power_on_load_and_serve(db: Engine, fleet: dict[str, Any]) -> None:
    result = boot_spares(db, fleet["deployment"], 2, "operator:test", raise_target=True)
    assert len(result.booted) == 2 and result.short == 0
    assert {row(db, n).rack_id for n in result.booted} == {1, 2}  # spread across racks
    assert target(db, fleet["deployment"]) == 2
    first = result.booted[0]
    tick(db)
    assert sorted(Bmc.commands) == sorted((n, "on") for n in result.booted)
    tick(db)  # no agent yet: still booting, no second power-on
    assert len(Bmc.commands) == 2 and row(db, first).state == S.BOOTING
    agent_reports(db, first, agent_registered_at="now")
    tick(db)
    assert row(db, first).state == S.LOADING
    agent_reports(db, first, agent_ready=True, replicas=READY * 2)
    tick(db)
    server = row(db, first)
    assert server.state == S.SERVING and server.boot_to_ready_s is not None
    assert server.load_s is not None
    with Session(db) as session:  # and into the boot history
        [record] = session.exec(select(BootRecord).where(BootRecord.server == first)).all()
    assert (record.boot_s, record.load_s) == (server.boot_to_ready_s, server.load_s)
    assert record.gpu_model == server.gpu_model and record.cache_hit == server.boot_cache_hit
    with Session(db) as session:
        kinds = [
            (e.from_state, e.to_state)
            for e in session.exec(
                select(Event)
                .where(Event.subject == first, Event.kind == "server.transition")
                .order_by(col(Event.id))
            )
        ]
    assert kinds[-3:] == [("warm", "booting"), ("booting", "loading"), ("loading", "serving")]


def test_one_power_on_even_when_the_process_dies_after_the_bmc_call(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    Bmc.crash_after_send.add(name)
    with pytest.raises(Crash):
        tick(db)  # the BMC got it; nothing after it was written
    assert Bmc.commands == [(name, "on")]
    for _ in range(3):  # restarted processes, within the retry window
        tick(db)
    assert Bmc.commands == [(name, "on")]
    # Past the retry window the state is read first: it is on, so nothing is sent.
    later = settings(power_retry_after_s=0.001)
    provision_once(db, BOX, later, drivers=Bmc)
    assert Bmc.commands == [(name, "on")]


def test_a_bmc_error_fails_the_boot_and_a_replacement_boots(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [bad] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    Bmc.refuse.add(bad)
    tick(db)
    failed = row(db, bad)
    assert failed.state == S.FAILED and "authentication refused" in (failed.failed_reason or "")
    # The same tick (capacity) booted another spare for the deployment.
    booting = [n for n, s in states(db).items() if s == "booting"]
    assert len(booting) == 1 and booting[0] != bad
    assert target(db, fleet["deployment"]) == 1  # the target is unchanged


def test_an_unanswered_power_on_is_read_again_not_failed(db: Engine, fleet: dict[str, Any]) -> None:
    """The power-on went out but its answer was lost: the server is coming up, so the boot
    goes on (failing it would strand a powered-on server); past the retry window the BMC is
    read, and with the server on nothing more is sent."""
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    Bmc.unanswered.add(name)
    report = tick(db)
    assert Bmc.commands == [(name, "on")]
    server = row(db, name)
    assert server.state == S.BOOTING and server.power_on_sent_at is not None
    assert any("unanswered" in e for e in report.errors), report.errors
    Bmc.unanswered.discard(name)
    provision_once(db, BOX, settings(power_retry_after_s=0.001), drivers=Bmc)
    assert Bmc.commands == [(name, "on")], "read first: it is on, so nothing is sent again"
    assert row(db, name).state == S.BOOTING


def test_an_unanswered_power_on_of_a_server_still_off_is_sent_again_after_the_window(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    Bmc.unanswered.add(name)
    tick(db)
    Bmc.unanswered.discard(name)
    Bmc.state[name] = OFF  # it never applied it after all
    tick(db)  # within the window: nothing
    assert Bmc.commands == [(name, "on")]
    provision_once(db, BOX, settings(power_retry_after_s=0.001), drivers=Bmc)
    assert Bmc.commands == [(name, "on"), (name, "on")]
    assert row(db, name).state == S.BOOTING


def test_boot_and_load_deadlines_fail_with_the_reason(db: Engine, fleet: dict[str, Any]) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    tick(db)
    tick(db, boot_deadline_s=0.001)
    assert "boot deadline" in (row(db, name).failed_reason or "")
    [other] = [n for n, s in states(db).items() if s == "booting"]
    tick(db)
    agent_reports(db, other, agent_registered_at="now")
    tick(db)
    tick(db, load_deadline_s=0.001)
    assert "load deadline" in (row(db, other).failed_reason or "")


def _loading_with(db: Engine, name: str, replicas: list[dict[str, Any]]) -> Server:
    """Walk a booting server to loading, then let its agent report `replicas`: the row after
    the next step."""
    tick(db)  # power on
    agent_reports(db, name, agent_registered_at="now")
    tick(db)  # -> loading
    assert row(db, name).state == S.LOADING
    agent_reports(db, name, replicas=replicas)
    tick(db)  # the load deadline is 60 s away
    return row(db, name)


def test_a_replica_its_supervisor_failed_fails_the_load_at_once_with_its_error(
    db: Engine, fleet: dict[str, Any]
) -> None:
    """A replica in `failed` (crashes in a row, a refused engine version) will not come ready:
    the server fails at the next step with the replica's error, not after the load deadline.
    One still restarting is waited for."""
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    crashed = "engine exited with code 1: CUDA error: out of memory"
    ready = {"index": 0, "state": "ready"}
    restarting = [ready, {"index": 1, "state": "restarting", "error": crashed}]
    assert _loading_with(db, name, restarting).state == S.LOADING, "it may still load"
    agent_reports(db, name, replicas=[ready, {"index": 1, "state": "failed", "error": crashed}])
    tick(db)
    server = row(db, name)
    assert server.state == S.FAILED
    assert server.failed_reason == f"replica 1 failed (1 of 2 failed): {crashed}"

    # The replacements: an agent from before the field says only the state; a hostile or
    # broken one's line breaks do not reach the reason (shown, exported).
    forged = "oom\nINFO fleet: all is well\r\n"
    for error, said in ((None, "no error reported"), (forged, "oom INFO fleet: all is well")):
        booting = [n for n, s in states(db).items() if s == "booting"]
        failed = {"index": 0, "state": "failed"} | ({"error": error} if error else {})
        server = _loading_with(db, booting[0], [failed])
        assert server.failed_reason == f"replica 0 failed (1 of 1 failed): {said}"


def _remediate(db: Engine, name: str, action: str = "reboot") -> None:
    agent_reports(db, name, health_action=action, health_reasons=[{"code": "xid_79", "gpu": 0}])
    tick(db)  # -> draining
    assert row(db, name).state == S.DRAINING
    agent_reports(db, name, agent_draining=True, replicas=[])
    tick(db)  # -> drained
    tick(db)  # -> booting (cycle) or quarantined


def test_remediation_cycles_twice_then_quarantines_and_replaces(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    # No other spare for now, so that the reboots are this server's alone (a replacement
    # would boot while it is out, and one of the two return to the pool after).
    spares = [n for n in fleet["spares"] if n != name]
    set_pool(db, spares, Pool.BASELINE)
    for reboot in (1, 2):
        _remediate(db, name)
        server = row(db, name)
        assert server.state == S.BOOTING and server.boot_kind == "cycle"
        assert server.reboot_count == reboot and server.last_fault == "xid_79"
        agent_reports(db, name, health_action="none", health_reasons=[])
        serve(db, name)
        assert Bmc.commands.count((name, "cycle")) == reboot
    _remediate(db, name)
    assert row(db, name).state == S.QUARANTINED
    report = tick(db)
    assert any("short of target" in e for e in report.errors)  # no spare: said so
    set_pool(db, spares[:1], Pool.WARM)
    tick(db)
    assert states(db)[spares[0]] == "booting"  # capacity held: a replacement boots


def test_a_replacement_boots_while_a_server_is_out_then_one_returns(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    agent_reports(db, name, health_action="reboot", health_reasons=[{"code": "xid_79"}])
    tick(db)  # draining; capacity boots a replacement in the same tick
    booting = [n for n, s in states(db).items() if s == "booting"]
    assert row(db, name).state == S.DRAINING and len(booting) == 1
    serve(db, booting[0])
    agent_reports(db, name, agent_draining=True, replicas=[])
    tick(db)
    tick(db)  # power cycle
    agent_reports(db, name, health_action="none", health_reasons=[])
    tick(db)
    agent_reports(db, name, agent_registered_at="now")
    tick(db)
    agent_reports(db, name, agent_ready=True, replicas=READY)
    tick(db)  # back to serving, and two serve a target of one: one returns to the pool
    assert sorted(states(db)[n] for n in (name, booting[0])) == ["draining", "serving"]


def test_hardware_inspection_quarantines_at_once(db: Engine, fleet: dict[str, Any]) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    _remediate(db, name, "hardware_inspection")
    assert row(db, name).state == S.QUARANTINED


def test_the_disruption_budget_caps_drains(db: Engine, fleet: dict[str, Any]) -> None:
    booted = boot_spares(db, fleet["deployment"], 2, "operator:test", raise_target=True).booted
    for name in booted:
        serve(db, name)
    for name in booted:
        agent_reports(db, name, health_action="reboot", health_reasons=[{"code": "xid_48"}])
    tick(db)
    assert sorted(row(db, n).state.value for n in booted) == ["draining", "serving"]


def test_scale_in_returns_servers_to_the_warm_pool(db: Engine, fleet: dict[str, Any]) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    with Session(db) as session:
        deployment = session.exec(select(Deployment)).one()
        deployment.target_servers = 0
        session.add(deployment)
        session.commit()
    tick(db)
    assert row(db, name).state == S.DRAINING and row(db, name).drain_reason == "scale_in"
    agent_reports(db, name, agent_draining=True, replicas=[])
    tick(db)  # drained
    tick(db)  # -> powering_off
    tick(db)  # BMC off
    assert (name, "off") in Bmc.commands
    with Session(db) as session:  # what the reconciler or the power action recorded
        server = session.exec(select(Server).where(Server.name == name)).one()
        assert server.power_state is OFF
    tick(db)
    back = row(db, name)
    assert back.state == S.WARM and back.deployment_id is None


def test_the_breaker_stops_remediation_until_resumed(
    db: Engine, session: Session, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    # 2 of 6 servers (33 %) turned unhealthy within the window: over the 20 % limit.
    for sick in (name, fleet["spares"][5]):
        session.add(
            Event(
                at=utcnow(),
                subject_type="server",
                subject=sick,
                actor="agent:x",
                kind="server.health",
                message="unhealthy",
                details={"verdict": "unhealthy"},
            )
        )
    session.commit()
    agent_reports(db, name, health_action="reboot", health_reasons=[{"code": "xid_79"}])
    report = tick(db)
    assert report.breaker_open and row(db, name).state == S.SERVING
    with Session(db) as s:
        set_paused(s, False, "operator:test", "looked at it: a bad driver rollout")
    # Resumed: the breaker is closed, but the same events would open it again; age them out.
    report = tick(db, breaker_window_s=0.001)
    assert not report.breaker_open and row(db, name).state == S.DRAINING


def test_a_paused_autopilot_does_nothing(db: Engine, fleet: dict[str, Any]) -> None:
    boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True)
    with Session(db) as session:
        set_paused(session, True, "operator:test", "change freeze")
    assert tick(db).paused and Bmc.commands == []
    with Session(db) as session:
        set_paused(session, False, "operator:test", "freeze over")
    tick(db)
    assert len(Bmc.commands) == 1


def test_two_concurrent_boots_for_the_last_headroom(
    db: Engine, session: Session, fleet: dict[str, Any]
) -> None:
    """Only rack r1 has room, for exactly one more spare: two boots at once, one wins."""
    for name in fleet["spares"]:
        if name.startswith("r2-"):
            server = session.exec(select(Server).where(Server.name == name)).one()
            server.pool = Pool.BASELINE  # not a spare any more
            session.add(server)
    session.commit()
    assert boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    results: list[BootResult] = []
    barrier = threading.Barrier(2)

    def boot() -> None:
        barrier.wait()
        results.append(boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True))

    threads = [threading.Thread(target=boot) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    booted = [n for r in results for n in r.booted]
    assert len(booted) == 1  # exactly one took the last headroom
    [loser] = [r for r in results if not r.booted]
    assert loser.short == 1
    reason = " ".join(loser.reasons)
    assert "r1" in reason and "W" in reason, reason  # names the rack and the numbers
    in_r1 = [n for n, s in states(db).items() if s == "booting"]
    assert len(in_r1) == 2


def test_operator_drain_and_undrain(db: Engine, fleet: dict[str, Any]) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    with Session(db) as session:
        operator_drain(session, name, "operator:test")
    agent_reports(db, name, agent_draining=True, replicas=[])
    tick(db)
    tick(db)
    assert row(db, name).state == S.DRAINED  # waits for the operator
    with Session(db) as session:
        operator_undrain(session, name, "operator:test")
    assert row(db, name).boot_kind == "resume"
    agent_reports(db, name, agent_draining=False, replicas=READY)
    tick(db)
    assert row(db, name).state == S.LOADING
    agent_reports(db, name, agent_ready=True, replicas=READY)
    tick(db)
    assert row(db, name).state == S.SERVING
    assert not [c for c in Bmc.commands if c[1] == "cycle"]  # no power action on undrain


def test_silence_past_the_grace_is_remediated(db: Engine, fleet: dict[str, Any]) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        server.last_heartbeat_at = utcnow() - timedelta(seconds=400)
        session.add(server)
        session.commit()
    # A leader that just took over waits out its grace.
    provision_once(db, BOX, settings(), drivers=Bmc, leader_since=utcnow())
    assert row(db, name).state == S.SERVING
    provision_once(
        db, BOX, settings(), drivers=Bmc, leader_since=utcnow() - timedelta(seconds=3600)
    )
    assert row(db, name).state == S.DRAINING and row(db, name).last_fault == "missed_heartbeats"


def test_the_quality_probe_records_a_reference_then_drains_on_a_wrong_answer(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    key = "agent-key-of-the-test-0123456789"  # the agent sent it at registration
    sealed = BOX.encrypt(key)
    agent_reports(db, name, agent_url="http://10.0.0.9:9410", agent_api_key_encrypted=sealed)
    asked: list[tuple[str, dict[str, Any], str | None]] = []
    answer = {"text": "2, 3, 5, 7, 11"}

    def ask(url: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        asked.append((url, body, key))
        return {
            "answers": [
                {"replica": 0, "text": answer["text"], "error": None},
                {"replica": 1, "text": "2, 3, 5, 7, 11", "error": None},
            ]
        }

    provision_once(db, BOX, settings(), drivers=Bmc, ask_agent=ask)
    assert asked and asked[0][0] == "http://10.0.0.9:9410"
    assert asked[0][2] == key  # the fleet presents the agent's key (decrypted) to /probe
    assert row(db, name).state == S.SERVING  # the first answer is the reference
    provision_once(db, BOX, settings(), drivers=Bmc, ask_agent=ask)
    assert len(asked) == 1  # not due again before the interval
    answer["text"] = "2, 3, 5, 7, 12"  # replica 0 now computes wrong
    provision_once(db, BOX, settings(probe_interval_s=0.001), drivers=Bmc, ask_agent=ask)
    server = row(db, name)
    assert server.state == S.DRAINING and server.drain_reason == "probe"
    assert server.health_verdict == "degraded" and server.last_fault == "probe_mismatch"
    with Session(db) as session:
        [event] = session.exec(select(Event).where(Event.kind == "server.probe_mismatch")).all()
    assert "replica(s) 0" in event.message
    # Drained, it waits for a person (no power cycle: a reboot does not fix a wrong answer).
    agent_reports(db, name, agent_draining=True, replicas=[])
    provision_once(db, BOX, settings(), drivers=Bmc, ask_agent=ask)
    provision_once(db, BOX, settings(), drivers=Bmc, ask_agent=ask)
    assert row(db, name).state == S.DRAINED
    assert not [c for c in Bmc.commands if c[1] == "cycle"]


# -- remediation's graceful step: a reboot asked over SSH first (graceful_reboot.py) ----------


class SshOs:
    """Scripted OS side of `systemctl reboot` over SSH: who was asked, or the error to raise."""

    def __init__(self, error: str | None = None) -> None:
        self.asked: list[str] = []
        self.error = error

    def __call__(self, server: Server, settings: Settings) -> None:
        if self.error is not None:
            raise FleetError(f"server {server.name}: {self.error}")
        self.asked.append(server.name)


def ssh_tick(db: Engine, ssh: SshOs, **overrides: Any) -> TickReport:
    return provision_once(
        db,
        BOX,
        settings(remediation_ssh_reboot=True, ssh_reboot_deadline_s=120.0, **overrides),
        drivers=Bmc,
        request_reboot=ssh,
    )


def _remediate_over_ssh(db: Engine, name: str, ssh: SshOs) -> None:
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        server.ssh_address = "10.0.0.7"
        session.add(server)
        session.commit()
    agent_reports(db, name, health_action="reboot", health_reasons=[{"code": "xid_79"}])
    ssh_tick(db, ssh)  # -> draining
    agent_reports(db, name, agent_draining=True, replicas=[])
    ssh_tick(db, ssh)  # -> drained
    ssh_tick(db, ssh)  # -> booting (ssh_reboot)
    agent_reports(db, name, health_action="none", health_reasons=[])


def _kinds(db: Engine, name: str) -> list[str]:
    with Session(db) as session:
        return list(
            session.exec(
                select(Event.kind)
                .where(Event.subject == name, col(Event.kind).like("server.%reboot%"))
                .order_by(col(Event.id))
            )
        )


def test_remediation_reboots_over_ssh_when_the_host_answers(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    ssh = SshOs()
    _remediate_over_ssh(db, name, ssh)
    server = row(db, name)
    assert server.state == S.BOOTING and server.boot_kind == "ssh_reboot"
    ssh_tick(db, ssh)  # the reboot is asked, once
    ssh_tick(db, ssh)
    assert ssh.asked == [name] and _kinds(db, name) == ["server.ssh_reboot"]
    agent_reports(db, name, agent_registered_at="now")  # the OS came back, and its agent
    ssh_tick(db, ssh)
    assert row(db, name).state == S.LOADING
    assert (name, "cycle") not in Bmc.commands  # the BMC never cut the power


def test_remediation_falls_back_to_the_bmc_when_ssh_fails(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    ssh = SshOs(error="connection refused")
    _remediate_over_ssh(db, name, ssh)
    report = ssh_tick(db, ssh)  # SSH fails: the boot becomes a power cycle
    assert any("connection refused" in e for e in report.errors)
    assert row(db, name).boot_kind == "cycle" and Bmc.commands.count((name, "cycle")) == 0
    ssh_tick(db, ssh)
    assert Bmc.commands.count((name, "cycle")) == 1
    assert _kinds(db, name) == ["server.reboot_fallback"]


def _asked_and_never_back(db: Engine, fleet: dict[str, Any]) -> tuple[str, SshOs]:
    """A serving server remediated over SSH whose OS never comes back, its deadline passed."""
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    ssh = SshOs()
    _remediate_over_ssh(db, name, ssh)
    ssh_tick(db, ssh)  # asked over SSH; the OS never comes back
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        assert server.ssh_reboot_sent_at is not None
        server.ssh_reboot_sent_at -= timedelta(seconds=121)  # past the deadline
        session.add(server)
        session.commit()
    return name, ssh


def test_remediation_falls_back_when_the_agent_is_not_back_in_time(
    db: Engine, fleet: dict[str, Any]
) -> None:
    name, ssh = _asked_and_never_back(db, fleet)
    ssh_tick(db, ssh)  # the deadline passed: power cycle next
    ssh_tick(db, ssh)
    assert Bmc.commands.count((name, "cycle")) == 1 and ssh.asked == [name]
    assert _kinds(db, name) == ["server.ssh_reboot", "server.reboot_fallback"]


def test_remediation_cycles_a_server_without_ssh_even_when_enabled(
    db: Engine, fleet: dict[str, Any]
) -> None:
    [name] = boot_spares(db, fleet["deployment"], 1, "operator:test", raise_target=True).booted
    serve(db, name)
    ssh = SshOs()
    agent_reports(db, name, health_action="reboot", health_reasons=[{"code": "xid_79"}])
    ssh_tick(db, ssh)
    agent_reports(db, name, agent_draining=True, replicas=[])
    ssh_tick(db, ssh)
    ssh_tick(db, ssh)
    assert row(db, name).boot_kind == "cycle" and ssh.asked == []


def test_no_fallback_power_cycle_while_the_breaker_is_open(
    db: Engine, fleet: dict[str, Any]
) -> None:
    name, ssh = _asked_and_never_back(db, fleet)
    with Session(db) as session:
        autopilot = get_autopilot(session)
        autopilot.breaker_open, autopilot.breaker_reason = True, "a sick fleet"
        session.add(autopilot)
        session.commit()
    ssh_tick(db, ssh)
    ssh_tick(db, ssh)
    assert (name, "cycle") not in Bmc.commands and row(db, name).boot_kind == "ssh_reboot"
