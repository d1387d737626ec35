"""fleet/rollout/service.py on both databases: a rollout's steps, promotion and rollbacks, with
the agents' reports and the routers' load reports written as the fleet receives them (the
registry's and the routing table's own functions), and the probe through a fake agent."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.errors import ConflictError, FleetError, NotFoundError
from fleet.models import Deployment, Event, ModelVersion, Server, utcnow
from fleet.provisioning import quality_probe
from fleet.registry.routing_table import DeploymentLoad, LoadReport, VersionLoad, record_report
from fleet.rollout import service
from fleet.rollout.service import RolloutRequest, rollout_once
from fleet.settings import Settings

BOX = SecretBox(TEST_SECRET_KEY)
V1, V2 = "llama@v1", "llama@v2"


@pytest.fixture
def world(db: Engine) -> Engine:
    """Deployment llama on llama@v1, four serving servers whose agents report v1, budget 1."""
    with Session(db) as session:
        rack = add_rack(session, add_site(session, "s1"), "r1")
        versions = [
            ModelVersion(model="llama", version=v, digest=f"sha256:{v}", created_by="t")
            for v in ("v1", "v2")
        ]
        other = ModelVersion(model="mistral", version="v1", digest="sha256:m", created_by="t")
        session.add_all([*versions, other])
        session.commit()
        dep = Deployment(
            name="llama",
            model_uri="llama",
            model_checksum="sha256:v1",
            sla_p95_latency_ms=2000,
            sla_ttft_ms=500,
            model_version_id=versions[0].id,
            disruption_budget=1,
        )
        session.add(dep)
        session.commit()
        for i in range(4):
            server = add_server(
                session, rack, f"gpu{i}", "serving", u_position=1 + 8 * i, bmc_system_id=f"{i}"
            )
            server.deployment_id = dep.id
            server.agent_url = f"http://gpu{i}:9410"
            session.add(server)
        session.commit()
    follow(db)
    return db


def settings(**overrides: Any) -> Settings:
    return Settings(**{"probe_interval_s": 0.0, "router_report_stale_s": 3600.0, **overrides})


def follow(db: Engine, *, skip: tuple[str, ...] = ()) -> None:
    """Every agent (but `skip`'s) restarted on its assigned version and reported it ready."""
    with Session(db) as session:
        keys = {v.id: f"{v.model}@{v.version}" for v in session.exec(select(ModelVersion))}
        dep = session.exec(select(Deployment)).one()
        for server in session.exec(select(Server)):
            if server.name in skip:
                continue
            key = keys[server.model_version_id or dep.model_version_id]
            server.agent_ready = True
            server.last_heartbeat_at = utcnow()
            server.replicas = [
                {"index": 0, "url": f"http://{server.name}:8100", "state": "ready", "version": key}
            ]
            session.add(server)
        session.commit()


def report(db: Engine, at: datetime, **versions: tuple[int, int]) -> None:
    """Router r1's counters since it started: version key (v1/v2) → (requests, errors)."""
    figures = {
        f"llama@{v}": VersionLoad(requests=n, errors=e, p95_s=0.4, ttft_p95_s=0.1)
        for v, (n, e) in versions.items()
    }
    with Session(db) as session:
        load = DeploymentLoad(waiting=0, versions=figures)
        record_report(session, LoadReport(router="r1", deployments={"llama": load}), now=at)


def state(db: Engine) -> tuple[Deployment, dict[str, int | None]]:
    with Session(db, expire_on_commit=False) as session:
        dep = session.exec(select(Deployment)).one()
        own = {s.name: s.model_version_id for s in session.exec(select(Server))}
        return dep, own


def events(db: Engine, kind: str) -> list[Event]:
    with Session(db) as session:
        return list(session.exec(select(Event).where(Event.kind == kind).order_by(col(Event.id))))


def start(db: Engine, **fields: Any) -> service.RolloutStatus:
    request = RolloutRequest(
        **{"version": "v2", "canary": "25%", "steps": ["50%"], "step_s": 60, "min_requests": 20}
        | fields
    )
    with Session(db) as session:
        return service.start(session, "llama", request, "operator:test")


def tick(db: Engine, at: datetime, cfg: Settings | None = None, **kw: Any) -> list[str]:
    return rollout_once(db, cfg or settings(), BOX, now=at, **kw).actions


def open_window(db: Engine, at: datetime) -> None:
    """Ticks and agents until the step's window opens (one move at a time: budget 1)."""
    for _ in range(10):
        tick(db, at)
        follow(db)
        if state(db)[0].rollout["phase"] == "analysing":
            return
    raise AssertionError(state(db)[0].rollout)


def test_a_good_version_goes_step_by_step_within_the_budget_and_is_promoted(
    world: Engine,
) -> None:
    t0 = utcnow()
    started = start(world)
    assert started.rollout["steps"] == [0.25, 0.5]
    assert started.canary_version == V2 and started.canary_weight == 0.0
    # Step 1 (25 % of 4 servers: 1), moved before the routers get any weight.
    tick(world, t0)
    dep, own = state(world)
    assert sum(v is not None for v in own.values()) == 1
    assert (dep.rollout["phase"], dep.canary_weight) == ("moving", 0.0)
    tick(world, t0)  # its agent has not restarted yet: nothing more
    assert state(world)[0].rollout["phase"] == "moving"
    follow(world)
    report(world, t0, v1=(100, 0), v2=(0, 0))
    tick(world, t0)
    dep, _ = state(world)
    assert (dep.rollout["phase"], dep.canary_weight) == ("analysing", 0.25)
    # The window counts what happened since it opened: v1's 100 before are not in it.
    report(world, t0 + timedelta(seconds=30), v1=(160, 1), v2=(30, 0))
    tick(world, t0 + timedelta(seconds=30))
    analysis = state(world)[0].rollout["analysis"]
    assert analysis["outcome"] == "wait"
    assert analysis["figures"]["stable"]["requests"] == 60
    assert analysis["figures"]["canary"]["requests"] == 30
    report(world, t0 + timedelta(seconds=61), v1=(220, 1), v2=(50, 0))
    tick(world, t0 + timedelta(seconds=61))
    dep, _ = state(world)
    assert dep.rollout["phase"] == "moving" and dep.rollout["step"] == 1
    assert dep.canary_weight == 0.25  # until step 2's servers serve
    # Step 2: 50 % of 4 = 2 canary servers.
    t1 = t0 + timedelta(seconds=100)
    open_window(world, t1)
    dep, own = state(world)
    assert sum(v is not None for v in own.values()) == 2
    assert dep.canary_weight == 0.5
    report(world, t1 + timedelta(seconds=61), v1=(400, 1), v2=(200, 0))
    tick(world, t1 + timedelta(seconds=61))
    assert state(world)[0].rollout["phase"] == "promoting"
    # Promotion: the two others, one at a time (budget 1), the weight following the servers
    # as they serve (one just moved still answers as v1 until its agent restarts it).
    t2 = t1 + timedelta(seconds=70)
    tick(world, t2)
    dep, own = state(world)
    assert sum(v is not None for v in own.values()) == 3
    assert dep.canary_weight == 0.5
    tick(world, t2)
    assert sum(v is not None for v in state(world)[1].values()) == 3  # not before it serves
    follow(world)
    tick(world, t2)
    dep, own = state(world)
    assert (sum(v is not None for v in own.values()), dep.canary_weight) == (4, 0.75)
    follow(world)
    tick(world, t2)
    dep, own = state(world)
    assert dep.rollout["status"] == "complete"
    assert (dep.model_checksum, dep.model_uri, dep.canary_version_id) == (
        "sha256:v2",
        "llama",
        None,
    )
    assert set(own.values()) == {None}  # the deployment's version is theirs again
    [done] = events(world, "deployment.rollout_complete")
    assert V2 in done.message and len(done.details["steps"]) == 2
    with Session(world) as session:
        assert service.status(session, "llama").model_version == V2


def test_a_bad_version_is_rolled_back_at_the_canary_step_with_the_figures(world: Engine) -> None:
    t0 = utcnow()
    start(world, canary="10%")  # 10 % of 4: 1 server
    report(world, t0, v1=(1000, 0), v2=(0, 0))
    open_window(world, t0)
    # 5 s in: 20 canary requests, half of them failed; the stable version's 180 are fine.
    report(world, t0 + timedelta(seconds=5), v1=(1180, 0), v2=(20, 10))
    actions = tick(world, t0 + timedelta(seconds=5))
    assert any("rolled back at step 1" in a for a in actions)
    dep, own = state(world)
    assert (dep.canary_version_id, dep.canary_weight, dep.rollout["status"]) == (
        None,
        0.0,
        "rolled_back",
    )
    assert set(own.values()) == {None}  # every canary server sent back at once
    [event] = events(world, "deployment.rollback")
    assert event.actor == "rollout" and event.details["automatic"] is True
    figures = event.details["figures"]
    assert (figures["canary"]["requests"], figures["canary"]["errors"]) == (20, 10)
    assert figures["stable"]["requests"] == 180
    failed = figures["canary"]["errors"]
    window = figures["canary"]["requests"] + figures["stable"]["requests"]
    assert failed < 0.10 * window  # fewer failed requests than the canary's share
    assert "error rate 50.0%" in event.message
    # Nothing more happens: the next tick leaves it alone.
    assert tick(world, t0 + timedelta(seconds=10)) == []


def test_a_canary_that_answers_at_random_fails_the_probe_and_is_not_drained(
    world: Engine,
) -> None:
    answers = iter(f"garbage {i}" for i in range(100))

    def ask(url: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        return {"answers": [{"replica": 0, "text": next(answers), "error": None}]}

    cfg = settings(probe_interval_s=300.0)
    t0 = utcnow()
    start(world, canary="10%", step_s=60)
    open_window(world, t0)
    report(world, t0 + timedelta(seconds=31), v1=(100, 0), v2=(30, 0))
    actions = tick(world, t0 + timedelta(seconds=31), cfg, ask=ask)  # halfway: the probe
    assert any("answered differently" in a for a in actions), actions
    [mismatch] = events(world, "server.probe_mismatch")
    assert mismatch.details == {"deployment": "llama", "version": V2, "canary": True}
    tick(world, t0 + timedelta(seconds=32), cfg, ask=ask)
    dep, _ = state(world)
    assert dep.rollout["status"] == "rolled_back"
    assert "quality probe" in dep.rollout["reason"]
    with Session(world) as session:
        moved = session.exec(select(Server).where(Server.name == mismatch.subject)).one()
        assert moved.state == "serving"  # the version was wrong, not the server


def test_a_canary_that_answers_the_same_twice_records_its_reference_and_passes(
    world: Engine,
) -> None:
    def ask(url: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        return {"answers": [{"replica": 0, "text": "2, 3, 5, 7, 11", "error": None}]}

    cfg = settings(probe_interval_s=300.0)
    t0 = utcnow()
    start(world, canary="10%", steps=[], step_s=60)
    open_window(world, t0)
    report(world, t0 + timedelta(seconds=61), v1=(100, 0), v2=(30, 0))
    tick(world, t0 + timedelta(seconds=61), cfg, ask=ask)  # probes (waits for it)
    assert state(world)[0].rollout["analysis"]["outcome"] == "wait"
    [recorded] = events(world, "server.probe_recorded")
    assert recorded.details["version"] == V2
    tick(world, t0 + timedelta(seconds=62), cfg, ask=ask)
    assert state(world)[0].rollout["phase"] == "promoting"


def test_the_provisioners_probe_leaves_canary_servers_to_the_rollout(world: Engine) -> None:
    start(world)
    tick(world, utcnow())
    _, own = state(world)
    [canary] = [name for name, v in own.items() if v is not None]
    due = quality_probe.probe_due(world, settings(probe_interval_s=300.0))
    assert canary not in due and len(due) == 3


def test_a_canary_server_that_cannot_fetch_rolls_the_rollout_back(world: Engine) -> None:
    start(world)
    tick(world, utcnow())
    _, own = state(world)
    [canary] = [name for name, v in own.items() if v is not None]
    with Session(world) as session:
        server = session.exec(select(Server).where(Server.name == canary)).one()
        server.cache_entries = [
            {"key": V2, "state": "failed", "error": "model.safetensors: sha256 mismatch"}
        ]
        session.add(server)
        session.commit()
    tick(world, utcnow())
    dep, own = state(world)
    assert dep.rollout["status"] == "rolled_back"
    assert (
        f"{canary} could not fetch {V2}: model.safetensors: sha256 mismatch"
        in (dep.rollout["reason"])
    )
    assert set(own.values()) == {None}


def test_canary_servers_not_ready_by_the_deadline_roll_back(world: Engine) -> None:
    t0 = utcnow()
    start(world)
    tick(world, t0)
    tick(world, t0 + timedelta(seconds=10), settings(stage_deadline_s=5.0))
    dep, _ = state(world)
    assert dep.rollout["status"] == "rolled_back" and "not serving" in dep.rollout["reason"]


def test_a_paused_autopilot_holds_the_rollout(world: Engine) -> None:
    from fleet.provisioning.autopilot import set_paused

    with Session(world) as session:
        set_paused(session, True, "operator:test", "freeze")
    start(world)
    tick(world, utcnow())
    assert set(state(world)[1].values()) == {None}
    assert state(world)[0].rollout["phase"] == "moving"


def test_an_operator_rolls_back_by_hand(world: Engine) -> None:
    t0 = utcnow()
    start(world)
    open_window(world, t0)
    with Session(world) as session:
        done = service.rollback_by_hand(session, "llama", "looks off", "operator:alice")
    assert done.canary_version is None and done.rollout["status"] == "rolled_back"
    [event] = events(world, "deployment.rollback")
    assert event.actor == "operator:alice" and event.details["automatic"] is False
    assert "looks off" in event.message
    with Session(world) as session, pytest.raises(ConflictError, match="no rollout"):
        service.rollback_by_hand(session, "llama", "", "operator:alice")


def test_refusals(world: Engine) -> None:
    with pytest.raises(NotFoundError, match="no model version"):
        start(world, version="v9")
    with pytest.raises(ConflictError, match="already serves"):
        start(world, version="v1")
    with pytest.raises(ConflictError, match="not the model"):
        start(world, version="mistral@v1")
    with pytest.raises(FleetError, match="rollout plan: steps must increase"):
        start(world, canary="50%", steps=["10%"])
    with Session(world) as session, pytest.raises(NotFoundError):
        service.start(session, "nope", RolloutRequest(version="v2"), "t")
    start(world, version=V2)
    with pytest.raises(ConflictError, match="already rolling out llama@v2"):
        start(world)


def test_a_server_that_left_its_deployment_loses_its_own_version(world: Engine) -> None:
    start(world)
    tick(world, utcnow())
    with Session(world) as session:
        server = session.exec(select(Server).where(col(Server.model_version_id).is_not(None))).one()
        name = server.name
        server.deployment_id = None  # returned to the pool
        session.add(server)
        session.commit()
    tick(world, utcnow())
    _, own = state(world)
    assert own[name] is None
    assert sum(v is not None for v in own.values()) == 1  # another one took its place


def test_a_canary_server_that_restarts_mid_window_reopens_the_window(world: Engine) -> None:
    t0 = utcnow()
    start(world)
    open_window(world, t0)
    _, own = state(world)
    [canary] = [name for name, v in own.items() if v is not None]
    with Session(world) as session:
        server = session.exec(select(Server).where(Server.name == canary)).one()
        server.replicas = [{**server.replicas[0], "state": "loading"}]
        session.add(server)
        session.commit()
    actions = tick(world, t0 + timedelta(seconds=10))
    assert any("moving again" in a for a in actions)
    assert state(world)[0].rollout["phase"] == "moving"
    follow(world)
    tick(world, t0 + timedelta(seconds=11))
    dep, _ = state(world)
    assert dep.rollout["phase"] == "analysing"
    assert dep.rollout["window_started_at"] == (t0 + timedelta(seconds=11)).isoformat()
