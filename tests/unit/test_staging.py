"""Pre-staging warm spares (fleet/provisioning/staging_policy.py, pure; staging.py and the
tick's steps, on both databases with a scripted BMC and scripted agent reports).

The fleet: two racks of three warm 8 × H100 spares (room for two boots each at 4 kW), one
deployment serving `llama@v2` (a 3 GB checkpoint) asking for `cached_spares` of them.
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

from fleet.bmc.base import ActionResult
from fleet.crypto import SecretBox
from fleet.lifecycle.states import ServerState
from fleet.models import (
    ArtifactFormat,
    Deployment,
    Event,
    ModelArtifact,
    ModelVersion,
    Pool,
    PowerState,
    Server,
    utcnow,
)
from fleet.provisioning.autopilot import get_autopilot, set_paused
from fleet.provisioning.placement import RackRoom, Spare
from fleet.provisioning.staging_policy import Candidate, Goal, InFlight, plan
from fleet.provisioning.tick import TickReport, provision_once
from fleet.settings import Settings

S = ServerState
ON, OFF = PowerState.ON, PowerState.OFF
BOX = SecretBox(TEST_SECRET_KEY)
V1, V2 = "llama@v1", "llama@v2"
GB = 1_000_000_000


# --- the pure policy ----------------------------------------------------------------------------


def spare(name: str, rack: str = "r1", *, cached: tuple[str, ...] = (), gpu: str = "H100") -> Spare:
    return Spare(name, "s1", rack, gpu, 8, 50.0, 4_000.0, cached)


def cand(
    name: str,
    rack: str = "r1",
    *,
    cached: tuple[str, ...] = (),
    budget: int | None = None,
    partial: dict[str, int] | None = None,
    tried: frozenset[str] = frozenset(),
    gpu: str = "H100",
) -> Candidate:
    return Candidate(spare(name, rack, cached=cached, gpu=gpu), budget, partial or {}, tried)


def goal(keep: int = 2, *, concurrency: int = 2, gpu: str = "H100", size: int = 3 * GB) -> Goal:
    return Goal("chat", V2, gpu, keep, 8, size, concurrency)


ROOMS = {r: RackRoom(r, "s1", 100_000.0) for r in ("r1", "r2", "r3")}


def test_stages_the_missing_spares_spread_over_racks() -> None:
    spares = [cand("a1", "r1"), cand("a2", "r1"), cand("b1", "r2", cached=(V2,)), cand("c1", "r3")]
    picks, gaps = plan([goal(3)], spares, [], ROOMS)
    # b1 holds it (r2); the two missing go to r1 and r3, one each.
    assert [p.name for p in picks] == ["a1", "c1"] and not gaps
    assert picks[0].reason.startswith("pre-stage llama@v2 for chat: 1 of 3 H100 warm spares")


def test_enough_holders_and_in_flight_stages_nothing() -> None:
    spares = [cand("a1", cached=(V2,)), cand("a2")]
    flying = [InFlight("x", "r2", V2, "H100")]
    assert plan([goal(2)], spares, flying, ROOMS) == ([], [])


def test_an_old_version_counts_for_nothing() -> None:
    spares = [cand("a1", cached=(V1,)), cand("a2", "r2", cached=(V1,))]
    picks, _ = plan([goal(2)], spares, [], ROOMS)
    assert [p.name for p in picks] == ["a1", "a2"]


def test_concurrency_bounds_the_stages_at_once() -> None:
    spares = [cand(f"s{i}", f"r{1 + i % 3}") for i in range(6)]
    picks, gaps = plan([goal(4, concurrency=1)], spares, [], ROOMS)
    assert len(picks) == 1
    assert gaps[0].reason == "chat: H100 spares holding llama@v2: 1 staging now, at most 1 at once"
    flying = [InFlight("s9", "r1", V2, "H100")]
    picks, gaps = plan([goal(4, concurrency=1)], spares, flying, ROOMS)
    assert picks == [] and "1 staging now" in gaps[0].reason


def test_tried_and_too_small_caches_are_skipped_and_said() -> None:
    spares = [cand("a1", tried=frozenset({V2})), cand("a2", budget=2 * GB)]
    picks, gaps = plan([goal(1)], spares, [], ROOMS)
    assert picks == []
    assert "cache budget under the version's 3,000,000,000 bytes" in gaps[0].reason
    picks, gaps = plan([goal(1)], spares[:1], [], ROOMS)
    assert "failed to stage it lately" in gaps[0].reason


def test_rack_headroom_is_the_budget_gate() -> None:
    tight = {"r1": RackRoom("r1", "s1", 3_000.0), "r2": RackRoom("r2", "s1", 4_000.0)}
    spares = [cand("a1", "r1"), cand("b1", "r2"), cand("b2", "r2")]
    picks, gaps = plan([goal(3, concurrency=3)], spares, [], tight)
    # r1 cannot take 3,950 W; r2 takes exactly one.
    assert [p.name for p in picks] == ["b1"]
    assert gaps[0].reason.endswith("no rack has the headroom to power one on now")


def test_a_partial_fetch_is_resumed_first_within_a_rack() -> None:
    spares = [cand("a1"), cand("a2", partial={V2: GB})]
    picks, _ = plan([goal(1)], spares, [], ROOMS)
    assert picks[0].name == "a2" and "resuming 1,000,000,000 bytes on disk" in picks[0].reason


def test_other_gpu_models_are_their_own_goal() -> None:
    spares = [cand("h", gpu="H100"), cand("l", "r2", gpu="L40S", cached=(V2,))]
    picks, _ = plan([goal(1), goal(1, gpu="L40S")], spares, [], ROOMS)
    assert [(p.name, p.gpu_model) for p in picks] == [("h", "H100")]


def test_a_spare_is_picked_once_across_goals() -> None:
    spares = [cand("a1")]
    two = [Goal("chat", V2, "H100", 1, 8, 0, 1), Goal("code", "code@v1", "H100", 1, 8, 0, 1)]
    picks, gaps = plan(two, spares, [], ROOMS)
    assert [p.name for p in picks] == ["a1"] and gaps[0].deployment == "code"


# --- the service and the tick -------------------------------------------------------------------


class Bmc(ActingBmc):
    state: dict[str, PowerState] = {}
    commands: list[tuple[str, str]] = []
    lock = threading.Lock()

    def power_state(self) -> PowerState:
        return self.state.get(self.target.server, OFF)

    def _send(self, action: str, want: PowerState) -> ActionResult:
        before = self.power_state()
        if before == want and action != "cycle":
            return ActionResult(action, False, before, before)  # type: ignore[arg-type]
        with self.lock:
            self.commands.append((self.target.server, action))
            self.state[self.target.server] = want
        return ActionResult(action, True, before, want)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def fresh_bmc() -> Iterator[None]:
    Bmc.state, Bmc.commands = {}, []
    yield


def settings(**overrides: Any) -> Settings:
    return Settings(
        **{
            "boot_deadline_s": 600.0,
            "load_deadline_s": 600.0,
            "power_retry_after_s": 30.0,
            "stage_deadline_s": 600.0,
            **overrides,
        }
    )


def tick(db: Engine, **overrides: Any) -> TickReport:
    return provision_once(db, BOX, settings(**overrides), drivers=Bmc)


def add_version(session: Session, version: str) -> ModelVersion:
    row = ModelVersion(
        model="llama",
        version=version,
        digest="sha256:" + "0" * 64,
        size_bytes=3 * GB,
        created_by="test",
    )
    session.add(row)
    session.flush()
    assert row.id is not None
    session.add(
        ModelArtifact(
            version_id=row.id,
            name="model.safetensors",
            uri=f"http://127.0.0.1:1/llama/{version}/model.safetensors",
            sha256="a" * 64,
            size_bytes=3 * GB,
            format=ArtifactFormat.HF_SAFETENSORS,
        )
    )
    session.commit()
    return row


@pytest.fixture
def fleet(session: Session) -> dict[str, Any]:
    site = add_site(session, "s1")
    for rack_name in ("r1", "r2"):
        rack = add_rack(session, site, rack_name, feeds=[feed("A", amps=16), feed("B", amps=16)])
        for i in range(3):
            name = f"{rack_name}-gpu{i}"
            add_server(
                session,
                rack,
                name,
                "warm",
                u_position=1 + 8 * i,
                bmc_system_id=name,
                pool=Pool.WARM,
                max_w=4000.0,
                standby_w=50.0,
            )
    v1, v2 = add_version(session, "v1"), add_version(session, "v2")
    deployment = Deployment(
        name="llama",
        model_uri="llama",
        model_checksum=v2.digest,
        model_version_id=v2.id,
        engine_params={"backend": "pytorch"},
        gpus_per_replica=8,
        gpu_models=["H100"],
        max_replicas=8,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=300,
        disruption_budget=1,
        cached_spares=2,
    )
    session.add(deployment)
    session.commit()
    return {"v1": v1.id, "v2": v2.id}


def row(db: Engine, name: str) -> Server:
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        session.expunge(server)
        return server


def staging(db: Engine) -> list[Server]:
    with Session(db) as session:
        rows = list(
            session.exec(
                select(Server)
                .where(col(Server.stage_version_id).is_not(None))
                .order_by(col(Server.name))
            )
        )
        for r in rows:
            session.expunge(r)
        return rows


def report(db: Engine, name: str, *, entries: list[dict[str, Any]], **fields: Any) -> None:
    """What the agent's heartbeat would write: the cache report with the given entries."""
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        now = utcnow()
        server.last_heartbeat_at = now
        server.cache_entries = entries
        server.cache_reported_at = now
        server.cache_budget_bytes = 100 * GB
        for key, value in fields.items():
            setattr(server, key, now if value == "now" else value)
        session.add(server)
        session.commit()


def events(db: Engine, kind: str) -> list[Event]:
    with Session(db, expire_on_commit=False) as session:
        return list(session.exec(select(Event).where(Event.kind == kind).order_by(col(Event.id))))


def walk_to_loading(db: Engine, name: str) -> None:
    tick(db)  # power on
    assert (name, "on") in Bmc.commands
    report(db, name, entries=[], agent_registered_at="now")
    tick(db)  # -> loading
    assert row(db, name).state == S.LOADING


def test_a_spare_is_staged_and_powered_off_again(db: Engine, fleet: dict[str, Any]) -> None:
    tick(db)
    [first] = staging(db)  # disruption budget 1: one at a time
    assert first.state == S.BOOTING and first.boot_kind == "stage"
    assert first.stage_version_id == fleet["v2"] and first.deployment_id is None
    walk_to_loading(db, first.name)
    report(db, first.name, entries=[{"key": V2, "state": "fetching", "bytes": GB}])
    tick(db)
    assert row(db, first.name).state == S.LOADING and len(staging(db)) == 1
    report(db, first.name, entries=[{"key": V2, "state": "ready", "bytes": 3 * GB}])
    tick(db)  # -> powering_off (power-off queued next tick)
    assert row(db, first.name).state == S.POWERING_OFF
    [staged] = events(db, "server.staged")
    assert staged.subject == first.name and "llama@v2 verified" in staged.message
    tick(db)
    assert (first.name, "off") in Bmc.commands
    tick(db)  # BMC says off -> warm; the next one starts, in the other rack
    back = row(db, first.name)
    assert back.state == S.WARM and back.stage_version_id is None
    [second] = staging(db)
    assert second.name != first.name and second.rack_id != back.rack_id


def test_two_holders_satisfy_and_a_new_version_restages(db: Engine, fleet: dict[str, Any]) -> None:
    ready = [{"key": V2, "state": "ready", "bytes": 3 * GB}]
    report(db, "r1-gpu0", entries=ready)
    report(db, "r2-gpu0", entries=ready)
    tick(db)
    assert staging(db) == []
    # A rollout promotes v1 (any other version): the holders of v2 no longer count.
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        dep.model_version_id = fleet["v1"]
        session.add(dep)
        session.commit()
    tick(db)
    [restage] = staging(db)
    assert restage.stage_version_id == fleet["v1"]


def test_a_failed_fetch_is_recorded_and_not_retried(db: Engine, fleet: dict[str, Any]) -> None:
    tick(db)
    [first] = staging(db)
    walk_to_loading(db, first.name)
    failed = {"key": V2, "state": "failed", "error": "source unreachable: http://127.0.0.1:1/x"}
    report(db, first.name, entries=[failed])
    tick(db)
    assert row(db, first.name).state == S.POWERING_OFF
    [event] = events(db, "server.stage_failed")
    assert "source unreachable" in event.message and event.details["version"] == V2
    tick(db)
    tick(db)  # warm again; the next stage goes elsewhere
    assert row(db, first.name).state == S.WARM
    assert [s.name for s in staging(db)] != [first.name] and len(staging(db)) == 1


def test_the_stage_deadline_powers_it_off(db: Engine, fleet: dict[str, Any]) -> None:
    tick(db)
    [first] = staging(db)
    walk_to_loading(db, first.name)
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == first.name)).one()
        server.stage_started_at = utcnow() - timedelta(seconds=601)
        session.add(server)
        session.commit()
    report(db, first.name, entries=[{"key": V2, "state": "fetching", "bytes": GB}])
    tick(db)
    assert row(db, first.name).state == S.POWERING_OFF
    [event] = events(db, "server.stage_failed")
    assert "stage deadline" in event.message


def test_scale_out_takes_a_staging_spare_first(db: Engine, fleet: dict[str, Any]) -> None:
    tick(db)
    [first] = staging(db)
    walk_to_loading(db, first.name)
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        dep.target_servers = 1
        session.add(dep)
        session.commit()
    tick(db)
    taken = row(db, first.name)
    assert taken.deployment_id is not None and taken.stage_version_id is None
    assert taken.state == S.LOADING
    assert events(db, "server.stage_taken")[0].subject == first.name
    assert sum(1 for _, a in Bmc.commands if a == "on") == 1  # no other spare booted for it


def test_paused_or_breaker_open_stages_nothing(db: Engine, session: Session, fleet: Any) -> None:
    set_paused(session, True, "test", "maintenance window")
    assert tick(db).paused and staging(db) == []
    set_paused(session, False, "test", "done")
    autopilot = get_autopilot(session)
    autopilot.breaker_open = True
    session.add(autopilot)
    session.commit()
    tick(db)
    assert staging(db) == []


def test_an_external_version_is_never_staged(db: Engine, session: Session, fleet: Any) -> None:
    legacy = ModelVersion(
        model="legacy-0123456789ab", version="legacy", digest="sha256:1", created_by="test"
    )
    session.add(legacy)
    session.flush()
    assert legacy.id is not None
    session.add(
        ModelArtifact(
            version_id=legacy.id, name="weights", uri="s3://m/llama", format=ArtifactFormat.EXTERNAL
        )
    )
    dep = session.exec(select(Deployment)).one()
    dep.model_version_id = legacy.id
    session.add(dep)
    session.commit()
    tick(db)
    assert staging(db) == []


# --- placement, boot figures per cache state, and what the autoscaler and calendar count on -----


def no_staging(db: Engine) -> None:
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        dep.cached_spares = 0
        session.add(dep)
        session.commit()


def serve(db: Engine, name: str) -> None:
    tick(db)  # power on
    report(db, name, entries=row(db, name).cache_entries, agent_registered_at="now")
    tick(db)  # -> loading
    report(
        db,
        name,
        entries=[{"key": V2, "state": "ready"}],
        agent_ready=True,
        replicas=[{"index": 0, "state": "ready"}],
    )
    tick(db)  # -> serving
    assert row(db, name).state == S.SERVING


def test_placement_boots_the_spare_holding_the_version_and_says_so(
    db: Engine, fleet: dict[str, Any]
) -> None:
    from fleet.provisioning.boots import boot_spares

    no_staging(db)
    report(db, "r2-gpu2", entries=[{"key": V2, "state": "ready"}])
    report(db, "r1-gpu0", entries=[{"key": V2, "state": "failed", "error": "x"}])
    result = boot_spares(db, "llama", 1, "operator:test", raise_target=True, settings=settings())
    assert result.booted == ("r2-gpu2",)
    assert row(db, "r2-gpu2").boot_cache_hit is True
    [moved] = [
        e
        for e in events(db, "server.transition")
        if e.subject == "r2-gpu2" and e.to_state == "booting"
    ]
    assert "spare chosen by placement (version llama@v2 cached; H100 in rack r2" in moved.message
    assert moved.details["version_cached"] is True
    serve(db, "r2-gpu2")
    served = row(db, "r2-gpu2")
    assert served.boot_to_ready_cached_s is not None and served.boot_to_ready_uncached_s is None
    # The next one holds nothing: its boot counts as uncached.
    result = boot_spares(db, "llama", 1, "operator:test", raise_target=True, settings=settings())
    [name] = result.booted
    assert row(db, name).boot_cache_hit is False
    serve(db, name)
    assert row(db, name).boot_to_ready_uncached_s is not None
    assert row(db, name).boot_to_ready_cached_s is None


def set_figures(db: Engine, cached_s: float, uncached_s: float) -> None:
    """Two measured boots of H100 servers: one cached, one uncached (servers out of the pool,
    so that the spares placement picks from stay as they are)."""
    with Session(db) as session:
        for name in ("r1-gpu2", "r2-gpu2"):
            server = session.exec(select(Server).where(Server.name == name)).one()
            server.pool = Pool.BASELINE
            session.add(server)
        first = session.exec(select(Server).where(Server.name == "r1-gpu2")).one()
        first.boot_to_ready_cached_s = cached_s
        second = session.exec(select(Server).where(Server.name == "r2-gpu2")).one()
        second.boot_to_ready_uncached_s = uncached_s
        session.add_all([first, second])
        session.commit()


def test_the_look_ahead_and_the_lead_use_the_figure_of_the_spare_that_would_boot(
    db: Engine, fleet: dict[str, Any]
) -> None:
    from fleet.autoscaler.service import Spares, next_boot
    from fleet.calendar.service import lead_for

    no_staging(db)
    set_figures(db, cached_s=95.0, uncached_s=780.0)
    s = settings(boot_estimate_s=1200.0)  # the default margin: p90 + 10 %
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        boot = next_boot(session, dep, Spares.read(session, s), s, [])
        assert boot.seconds == pytest.approx(858.0) and "version not cached" in boot.basis
        assert lead_for(session, dep, s, min_replicas=1).seconds == pytest.approx(858.0)
    report(db, "r2-gpu1", entries=[{"key": V2, "state": "ready"}])
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        boot = next_boot(session, dep, Spares.read(session, s), s, [])
        assert boot.seconds == pytest.approx(104.5)
        assert boot.basis == "r2-gpu1: H100, version cached: p90 + 10 % of 1 cached boot"
        assert boot.spare is not None and boot.spare.startswith("r2-gpu1: version llama@v2 cached")
        lead = lead_for(session, dep, s, min_replicas=1)
        assert (lead.seconds, lead.basis) == (boot.seconds, boot.basis)
        # Two servers: the second comes without the version, so the lead is its figure.
        assert lead_for(session, dep, s, min_replicas=2).seconds == pytest.approx(858.0)
    # No margin: the p90 itself.
    bare = settings(boot_estimate_s=1200.0, boot_margin_pct=0.0)
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        assert next_boot(session, dep, Spares.read(session, bare), bare, []).seconds == 95.0


def test_a_scale_up_decision_lists_the_spares_placement_would_boot(
    db: Engine, fleet: dict[str, Any]
) -> None:
    from fleet.autoscaler.service import History, autoscale_once
    from fleet.models import ScalingDecision

    no_staging(db)
    report(db, "r1-gpu1", entries=[{"key": V2, "state": "ready"}])
    with Session(db) as session:
        dep = session.exec(select(Deployment)).one()
        dep.min_replicas = 2  # the policy's `min` rule raises the target from 0 to 2
        session.add(dep)
        session.commit()
    autoscale_once(db, settings(), History.new(600.0))
    with Session(db) as session:
        decision = session.exec(select(ScalingDecision)).one()
    assert decision.target_after == 2
    lines = decision.inputs["placement"]
    assert lines[0].startswith("r1-gpu1: version llama@v2 cached")
    assert lines[1].startswith("r2-") and "not cached: fetches first" in lines[1]
    assert decision.inputs["next_spare"].startswith("r1-gpu1: version llama@v2 cached")
    assert decision.reason.endswith("; placement: " + lines[0])


def test_no_stage_starts_while_a_deployment_is_short(
    db: Engine, session: Session, fleet: Any
) -> None:
    short = Deployment(
        name="b200-only",
        model_uri="s3://m/other",
        model_checksum="sha256:2",
        engine_params={"backend": "pytorch"},
        gpus_per_replica=8,
        gpu_models=["B200"],  # no such spare: it stays short of its target
        max_replicas=2,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=300,
        target_servers=1,
    )
    session.add(short)
    session.commit()
    result = tick(db)
    assert any("short of target" in e for e in result.errors)
    assert staging(db) == []


def test_a_staging_spare_keeps_what_it_holds_for_another_deployments_spares(
    db: Engine, session: Session, fleet: dict[str, Any]
) -> None:
    """Two deployments with cached spares and caches that hold one version: were the staging
    spare to evict the other's version, a spare would be staged for that one next, round after
    round. Its assignment keeps it: the agent fails 'does not fit' instead."""
    from fleet.registry.agent_reports import assignment_for

    other = Deployment(
        name="other",
        model_uri="llama",
        model_checksum="sha256:" + "1" * 64,
        model_version_id=fleet["v1"],
        gpus_per_replica=8,
        gpu_models=["H100"],
        max_replicas=8,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=300,
        cached_spares=1,
    )
    session.add(other)
    session.commit()
    report(db, "r1-gpu0", entries=[{"key": V1, "state": "ready", "bytes": 3 * GB}])
    with Session(db) as s:
        server = s.exec(select(Server).where(Server.name == "r1-gpu0")).one()
        server.stage_version_id = fleet["v2"]
        assert set(assignment_for(s, server).keep) == {V1, V2}
        other_row = s.exec(select(Deployment).where(Deployment.name == "other")).one()
        other_row.cached_spares = 0  # no longer anyone's goal: it may go
        s.add(other_row)
        s.flush()
        assert assignment_for(s, server).keep == [V2]
