"""The agents' API (/api/v1/agent/...) of a real service, on SQLite and on Postgres."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from factories import add_rack, add_server, add_site, walk_to
from live import Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.models import Deployment, Event, Gpu, Role, Server, Verdict
from fleet.states import ServerState

API = "/api/v1/agent"


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("agent-api")) as server:
        yield server


@pytest.fixture
def servers(db: Engine, session: Session) -> list[str]:
    rack = add_rack(session, add_site(session, "lab"), "r1")
    for i, name in enumerate(("gpu-a", "gpu-b")):
        server = add_server(
            session, rack, name, u_position=1 + 8 * i, gpu_count=2, bmc_port=8000 + i
        )
        for index in range(2):
            assert server.id is not None
            session.add(Gpu(server_id=server.id, index=index, model="H100", memory_mib=81559))
    session.commit()
    return ["gpu-a", "gpu-b"]


@pytest.fixture
def agent(live: Live, servers: list[str]) -> Iterator[httpx.Client]:
    yield live.client(live.token(Role.AGENT, name="agent-a", server="gpu-a"))
    live.close_clients()


def registration(server: str = "gpu-a", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "server": server,
        "agent_version": "0.1.0",
        "agent_url": "http://10.0.0.5:9410",
        "telemetry": "simulated",
        "driver_version": "550.54.15",
        "gpus": [
            {"index": i, "uuid": f"GPU-{server}-{i}", "name": "NVIDIA H100 80GB HBM3"}
            for i in range(2)
        ],
    }
    return body | changes


def heartbeat(server: str = "gpu-a", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "server": server,
        "verdict": "healthy",
        "action": "none",
        "reasons": [],
        "gpus": [{"index": i, "health": "healthy", "temperature_c": 40.0} for i in range(2)],
    }
    return body | changes


def row(db: Engine, name: str) -> Server:
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        session.expunge(server)
        return server


def kinds(db: Engine, name: str) -> list[str]:
    with Session(db) as session:
        query = select(Event.kind).where(Event.subject == name).order_by(col(Event.id))
        return [k for k in session.exec(query) if not k.startswith("server.enrolled")]


def test_register_records_the_agent_and_its_gpus(agent: httpx.Client, db: Engine) -> None:
    reply = agent.post(f"{API}/register", json=registration())
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["server"] == "gpu-a" and body["expected_gpus"] == 2
    assert body["assignment"] == {
        "kind": "none",
        "deployment": None,
        "model_uri": None,
        "model_checksum": None,
        "engine_params": {},
        "gpus_per_replica": None,
        "replicas": 0,
    }
    server = row(db, "gpu-a")
    assert (server.agent_version, server.agent_url) == ("0.1.0", "http://10.0.0.5:9410")
    assert server.agent_registered_at is not None and server.last_heartbeat_at is not None
    assert server.state == ServerState.ENROLLED  # a report never moves the lifecycle
    with Session(db) as session:
        uuids = session.exec(
            select(Gpu.uuid).where(Gpu.server_id == server.id).order_by(col(Gpu.index))
        ).all()
    assert uuids == ["GPU-gpu-a-0", "GPU-gpu-a-1"]
    assert "server.agent_registered" in kinds(db, "gpu-a")


def test_a_gpu_count_that_disagrees_with_the_inventory_is_an_event(
    agent: httpx.Client, db: Engine
) -> None:
    body = registration(gpus=[{"index": 0, "uuid": "GPU-x"}])
    assert agent.post(f"{API}/register", json=body).status_code == 200
    assert "server.gpu_inventory_mismatch" in kinds(db, "gpu-a")


def test_a_token_for_one_server_reporting_for_another_gets_403(
    agent: httpx.Client, live: Live, db: Engine
) -> None:
    for path, body in (
        ("register", registration("gpu-b")),
        ("heartbeat", heartbeat("gpu-b")),
    ):
        reply = agent.post(f"{API}/{path}", json=body)
        assert reply.status_code == 403, reply.text
        assert "'gpu-a', not 'gpu-b'" in reply.json()["detail"]
    assert row(db, "gpu-b").last_heartbeat_at is None  # nothing written
    unknown = agent.post(f"{API}/heartbeat", json=heartbeat("no-such-server"))
    assert unknown.status_code == 403  # no probing of names with an agent token
    operator = live.client(live.token(Role.OPERATOR, name="ops"))
    refused = operator.post(f"{API}/heartbeat", json=heartbeat())
    assert refused.status_code == 403 and "agent role" in refused.json()["detail"]
    assert live.client().post(f"{API}/heartbeat", json=heartbeat()).status_code == 401


def test_heartbeats_record_health_and_changes_of_verdict_once(
    agent: httpx.Client, db: Engine
) -> None:
    assert agent.post(f"{API}/register", json=registration()).status_code == 200
    for _ in range(3):
        assert agent.post(f"{API}/heartbeat", json=heartbeat()).status_code == 200
    sick = heartbeat(
        verdict="unhealthy",
        action="reboot",
        reasons=[
            {
                "code": "xid_79",
                "gpu": 1,
                "message": "GPU 1: Xid 79 - GPU has fallen off the bus",
                "action": "reboot",
                "verdict": "unhealthy",
            }
        ],
        gpus=[{"index": 0, "health": "healthy"}, {"index": 1, "health": "unhealthy", "lost": True}],
    )
    for _ in range(2):
        assert agent.post(f"{API}/heartbeat", json=sick).status_code == 200
    server = row(db, "gpu-a")
    assert server.health_verdict == Verdict.UNHEALTHY and server.health_action == "reboot"
    assert server.health_reasons[0]["code"] == "xid_79"
    assert server.state == ServerState.ENROLLED
    with Session(db) as session:
        health = session.exec(
            select(Gpu.health).where(Gpu.server_id == server.id).order_by(col(Gpu.index))
        ).all()
    assert health == ["healthy", "unhealthy"]
    changes = [k for k in kinds(db, "gpu-a") if k == "server.health"]
    assert len(changes) == 2  # unknown -> healthy, healthy -> unhealthy; repeats say nothing


def test_the_reply_carries_the_assignment(
    agent: httpx.Client, db: Engine, session: Session
) -> None:
    deployment = Deployment(
        name="llama-8b",
        model_uri="s3://models/llama-3.1-8b",
        model_checksum="sha256:abc",
        engine_params={"backend": "pytorch", "tp_size": 1},
        gpus_per_replica=1,
        gpu_models=["H100"],
        sla_p95_latency_ms=2000,
        sla_ttft_ms=300,
    )
    session.add(deployment)
    session.commit()
    server = session.exec(select(Server).where(Server.name == "gpu-a")).one()
    server.deployment_id = deployment.id
    session.add(server)
    session.commit()
    # Assigned but not yet loading: nothing to run.
    assert agent.post(f"{API}/heartbeat", json=heartbeat()).json()["assignment"]["kind"] == "none"
    walk_to(session, server, ServerState.LOADING)
    serve = agent.post(f"{API}/heartbeat", json=heartbeat()).json()["assignment"]
    assert (serve["kind"], serve["deployment"], serve["replicas"]) == ("serve", "llama-8b", 2)
    assert serve["model_checksum"] == "sha256:abc" and serve["engine_params"]["tp_size"] == 1
    walk_to(session, server, ServerState.DRAINING)
    drain = agent.post(f"{API}/heartbeat", json=heartbeat()).json()["assignment"]
    assert drain["kind"] == "drain"


def test_bad_reports_are_422_and_write_nothing(agent: httpx.Client, db: Engine) -> None:
    for body in (
        heartbeat(verdict="fine"),
        heartbeat(action="format_disk"),
        heartbeat(gpus=[{"index": 99}]),
        registration(agent_url="ftp://x"),
        registration(extra=1),
    ):
        path = "register" if "agent_version" in body else "heartbeat"
        reply = agent.post(f"{API}/{path}", json=body)
        assert reply.status_code == 422, (body, reply.text)
    duplicate = registration(gpus=[{"index": 0, "uuid": "GPU-1"}, {"index": 1, "uuid": "GPU-1"}])
    assert agent.post(f"{API}/register", json=duplicate).status_code == 400
    assert row(db, "gpu-a").last_heartbeat_at is None
