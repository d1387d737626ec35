"""The agents' API (/api/v1/agent/...) of a real service, on SQLite and on Postgres.

The service runs with FLEET_AGENT_NETWORKS=10.20.0.0/16: the tests' requests come from
127.0.0.1, so loopback URLs are the agent's own address and 10.20.x.y a configured network.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import suppress
from ipaddress import ip_network
from typing import Any

import httpx
import pytest
from factories import TEST_SECRET_KEY, add_rack, add_server, add_site, walk_to
from live import Live, serve
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.control import wakeups
from fleet.crypto import SecretBox
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, Gpu, Role, Server, Verdict, Wakeup
from fleet.provisioning.quality_probe import probe_server
from fleet.registry.agent_reports import SETTLING_INTERVAL_S, url_problem
from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.fleet_client import FleetClient
from fleet_agent.local_api import LocalApi
from fleet_agent.telemetry.simulated import Fault, SimulatedTelemetry

API = "/api/v1/agent"


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    networks = "10.20.0.0/16,fd00:20::/64"
    with serve(engine, tmp_path_factory.mktemp("agent-api"), agent_networks=networks) as server:
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
        "agent_url": "http://127.0.0.1:9410",
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
        "engine": "trtllm",
        "engine_params": {},
        "gpus_per_replica": None,
        "replicas": 0,
        "model": None,
        "stage": [],
        "keep": [],
    }
    server = row(db, "gpu-a")
    assert (server.agent_version, server.agent_url) == ("0.1.0", "http://127.0.0.1:9410")
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


def wake_seq(db: Engine) -> int:
    with Session(db) as session:
        found = session.get(Wakeup, wakeups.PROVISIONER)
        return 0 if found is None else found.seq


def test_a_registration_and_a_heartbeat_that_changes_readiness_wake_the_provisioner(
    agent: httpx.Client, db: Engine
) -> None:
    """Each is what the provisioner's next step waits for (booting -> loading, loading ->
    serving): it is woken at once (fleet/control/wakeups.py). A heartbeat that says again what
    the last said is no news and wakes nothing: the steady state costs no write."""
    start = wake_seq(db)
    assert agent.post(f"{API}/register", json=registration()).status_code == 200
    assert wake_seq(db) == start + 1
    loading = heartbeat(ready=False, replicas=[{"index": 0, "state": "loading"}])
    assert agent.post(f"{API}/heartbeat", json=loading).status_code == 200
    after_first = wake_seq(db)  # the first report of replicas and readiness is a change
    for _ in range(3):
        assert agent.post(f"{API}/heartbeat", json=loading).status_code == 200
    assert wake_seq(db) == after_first
    ready = heartbeat(ready=True, replicas=[{"index": 0, "state": "ready"}])
    assert agent.post(f"{API}/heartbeat", json=ready).status_code == 200
    assert wake_seq(db) == after_first + 1
    assert agent.post(f"{API}/heartbeat", json=ready).status_code == 200
    assert wake_seq(db) == after_first + 1
    sick = heartbeat(ready=True, replicas=[{"index": 0, "state": "ready"}], verdict="degraded")
    assert agent.post(f"{API}/heartbeat", json=sick).status_code == 200
    assert wake_seq(db) == after_first + 2


def test_a_booting_servers_agent_is_asked_back_sooner(
    agent: httpx.Client, db: Engine, session: Session
) -> None:
    """Its assignment changes as soon as the provisioner moves it to loading: asked back in
    SETTLING_INTERVAL_S, the agent learns it then, not one heartbeat interval later."""
    usual = agent.post(f"{API}/register", json=registration()).json()["heartbeat_interval_s"]
    assert usual > SETTLING_INTERVAL_S  # enrolled: the configured interval
    server = session.exec(select(Server).where(Server.name == "gpu-a")).one()
    walk_to(session, server, ServerState.BOOTING)
    reply = agent.post(f"{API}/register", json=registration()).json()
    assert reply["heartbeat_interval_s"] == SETTLING_INTERVAL_S
    assert agent.post(f"{API}/heartbeat", json=heartbeat()).json()["heartbeat_interval_s"] == (
        SETTLING_INTERVAL_S
    )


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


def test_the_cache_a_heartbeat_reports_is_stored_and_shown(
    agent: httpx.Client, live: Live, db: Engine
) -> None:
    cache: dict[str, Any] = {
        "budget_bytes": 500_000_000_000,
        "used_bytes": 16_000_000_000,
        "free_bytes": 900_000_000_000,
        "entries": [
            {
                "key": "llama-8b@v1",
                "state": "ready",
                "bytes": 16_000_000_000,
                "total_bytes": 16_000_000_000,
                "verified_at": "2026-12-02T10:00:00Z",
            },
            {"key": "llama-8b@v2", "state": "failed", "error": "s3://w/x: 403 AccessDenied"},
        ],
    }
    reply = agent.post(f"{API}/heartbeat", json=heartbeat(cache=cache))
    assert reply.status_code == 200, reply.text
    viewer = live.client(live.token(Role.VIEWER, name="viewer"))
    shown = viewer.get("/api/v1/servers/gpu-a").json()
    assert (shown["cache_budget_bytes"], shown["cache_used_bytes"]) == (5 * 10**11, 16 * 10**9)
    assert [(e["key"], e["state"]) for e in shown["cache_entries"]] == [
        ("llama-8b@v1", "ready"),
        ("llama-8b@v2", "failed"),
    ]
    assert shown["cache_reported_at"] is not None and shown["model_version"] is None
    assert agent.post(f"{API}/heartbeat", json=heartbeat(cache=cache)).status_code == 200
    assert [k for k in kinds(db, "gpu-a") if "weights" in k] == [
        "server.weights_ready",
        "server.weights_failed",
    ]
    # A heartbeat without a cache (an older agent) leaves the stored one as it was.
    assert agent.post(f"{API}/heartbeat", json=heartbeat()).status_code == 200
    assert len(row(db, "gpu-a").cache_entries) == 2
    too_many = {**cache, "entries": cache["entries"] * 200}
    assert agent.post(f"{API}/heartbeat", json=heartbeat(cache=too_many)).status_code == 422


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


# ---------------------------------------------------------------------------------------------
# The URLs an agent reports: its own address or a configured network, nothing else


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://10.0.0.5:9410", "not the address this report came from (127.0.0.1)"),
        ("http://192.168.1.10:9410", "nor in FLEET_AGENT_NETWORKS"),
        ("http://evil.example:9410", "is a name"),
        ("http://localhost:9410", "is a name"),
        ("http://user:secret@127.0.0.1:9410", "no user name or password"),
        ("http://127.0.0.1:99999", "not a URL"),
    ],
)
def test_a_spoofed_agent_url_is_refused_and_nothing_is_written(
    agent: httpx.Client, db: Engine, url: str, problem: str
) -> None:
    reply = agent.post(f"{API}/register", json=registration(agent_url=url))
    assert reply.status_code == 422, reply.text
    assert reply.json()["errors"][0].startswith("agent_url: ") and problem in reply.text
    assert "secret" not in reply.text
    assert row(db, "gpu-a").agent_url is None and row(db, "gpu-a").last_heartbeat_at is None


def test_agent_urls_on_loopback_from_loopback_or_in_a_configured_network_are_accepted(
    agent: httpx.Client, db: Engine
) -> None:
    for url in (
        "http://127.0.0.1:9410",
        "https://10.20.3.4:9410",
        "http://[fd00:20::7]:9410",
        "http://[::ffff:127.0.0.1]:9410",
    ):
        reply = agent.post(f"{API}/register", json=registration(agent_url=url))
        assert reply.status_code == 200, (url, reply.text)
        assert row(db, "gpu-a").agent_url == url
    # Just outside the configured network: refused.
    outside = agent.post(f"{API}/register", json=registration(agent_url="http://10.21.0.1:9410"))
    assert outside.status_code == 422 and "agent_url" in outside.text


def test_replica_urls_follow_the_same_rule(agent: httpx.Client, db: Engine) -> None:
    assert agent.post(f"{API}/register", json=registration()).status_code == 200

    def replicas(*urls: str) -> list[dict[str, Any]]:
        return [{"index": i, "url": u, "state": "ready"} for i, u in enumerate(urls)]

    good = heartbeat(replicas=replicas("http://127.0.0.1:8100", "http://10.20.0.9:8101"))
    assert agent.post(f"{API}/heartbeat", json=good).status_code == 200
    assert agent.post(f"{API}/heartbeat", json=good).json()["refused_urls"] == []
    # A replica URL off the rule is dropped, the heartbeat (GPU health, readiness) is kept: a
    # refused heartbeat would end in the fleet power cycling the server for its silence.
    spoofed = heartbeat(replicas=replicas("http://127.0.0.1:8100", "http://203.0.113.7:443"))
    reply = agent.post(f"{API}/heartbeat", json=spoofed)
    assert reply.status_code == 200 and reply.json()["refused_urls"] == [
        "replicas[1].url: host 203.0.113.7 is not the address this report came from "
        "(127.0.0.1) nor in FLEET_AGENT_NETWORKS"
    ]
    assert [r["url"] for r in row(db, "gpu-a").replicas] == ["http://127.0.0.1:8100", None]
    for bad in ("ftp://127.0.0.1/x", "http://a:b@127.0.0.1:8100"):
        refused = agent.post(f"{API}/heartbeat", json=heartbeat(replicas=replicas(bad)))
        if refused.status_code == 200:  # past the schema's pattern: dropped by the rule
            assert refused.json()["refused_urls"], bad
            assert [r["url"] for r in row(db, "gpu-a").replicas] == [None], bad
        else:
            assert refused.status_code == 422 and "replicas" in refused.text, bad


def test_the_url_rule_by_peer() -> None:
    nat = [ip_network("10.20.0.0/16")]
    # An agent on 10.0.0.7 may name itself, not loopback (that would point routers at
    # themselves) and not its neighbour.
    assert url_problem("http://10.0.0.7:9410", "10.0.0.7", []) is None
    assert url_problem("http://127.0.0.1:9410", "10.0.0.7", []) is not None
    assert url_problem("http://10.0.0.8:9410", "10.0.0.7", []) is not None
    # A dual-stack listener's view of an IPv4 peer.
    assert url_problem("http://10.0.0.7:9410", "::ffff:10.0.0.7", []) is None
    # Behind NAT the peer is the gateway: the configured network decides.
    assert url_problem("http://10.20.5.5:9410", "192.0.2.1", nat) is None
    assert url_problem("http://10.21.5.5:9410", "192.0.2.1", nat) is not None
    # No peer known (a Unix socket): only the networks.
    assert url_problem("http://10.20.5.5:9410", None, nat) is None
    assert url_problem("http://127.0.0.1:9410", None, nat) is not None


# ---------------------------------------------------------------------------------------------
# The agent's local-API key: stored encrypted, never shown, presented by the quality probe


KEY = "agent-local-api-key-0123456789abcdef"


def test_the_agent_key_is_stored_encrypted_and_never_shown(
    agent: httpx.Client, live: Live, db: Engine
) -> None:
    reply = agent.post(f"{API}/register", json=registration(agent_api_key=KEY))
    assert reply.status_code == 200 and KEY not in reply.text
    sealed = row(db, "gpu-a").agent_api_key_encrypted
    assert sealed and KEY not in sealed and SecretBox(TEST_SECRET_KEY).decrypt(sealed) == KEY
    viewer = live.client(live.token(Role.ADMIN, name="admin"))
    for path in (
        "/api/v1/servers/gpu-a",
        "/api/v1/servers",
        "/api/v1/events?limit=1000",
        "/api/v1/inventory/export",
    ):
        text = viewer.get(path).text
        assert KEY not in text and sealed not in text and "agent_api_key" not in text, path
    short = agent.post(f"{API}/register", json=registration(agent_api_key="short"))
    assert short.status_code == 422 and "agent_api_key" in short.text and "short" not in short.text
    # An agent that sends no key (an older one) leaves none behind.
    assert agent.post(f"{API}/register", json=registration()).status_code == 200
    assert row(db, "gpu-a").agent_api_key_encrypted is None


def test_the_quality_probe_presents_the_key_the_agent_registered_with(
    live: Live, servers: list[str], db: Engine, session: Session
) -> None:
    """End to end: the agent's own code registers (its key included) with the live service,
    the fleet's probe decrypts the key and calls the agent's real local API with it."""
    token = live.token(Role.AGENT, name="agent-a", server="gpu-a")
    settings = AgentSettings(
        server="gpu-a", token=SecretStr(token), fleet_url=live.url, telemetry="simulated"
    )
    client = FleetClient(live.url, token, 10.0)
    agent = Agent(settings, SimulatedTelemetry("H100", 2, seed=2), client)
    api = LocalApi(agent, "127.0.0.1", 0).start()
    try:
        agent.advertise_url = api.url
        for _ in range(200):  # uvicorn listens once its thread is up: bounded wait
            with suppress(httpx.ConnectError):
                httpx.get(f"{api.url}/healthz")
                break
            time.sleep(0.025)
        agent.tick()
        assert agent.registered, agent.last_error
        deployment = Deployment(
            name="llama-8b",
            model_uri="s3://models/llama-3.1-8b",
            model_checksum="sha256:abc",
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
        box = SecretBox(TEST_SECRET_KEY)
        outcome = probe_server(db, live.settings, "gpu-a", box=box)
        # The agent answered (its key accepted): it has no engines, so no replica answered.
        assert outcome.ok and outcome.detail == "no ready replica answered", outcome.detail
        server.agent_api_key_encrypted = None  # a fleet that lost the key is refused
        session.add(server)
        session.commit()
        refused = probe_server(db, live.settings, "gpu-a", box=box)
        assert "did not answer the probe" in refused.detail and "401" in refused.detail
    finally:
        api.stop()
        client.close()


def test_each_gpus_readings_reach_the_gpu_view(live: Live, servers: list[str], db: Engine) -> None:
    """End to end: the agent's own code reads its (simulated) GPUs with an ECC error, a
    failed remap and an Xid on GPU 1, and the fleet's GPU view shows those numbers beside
    the verdict; a GPU no agent has reported has no reading."""
    token = live.token(Role.AGENT, name="agent-a", server="gpu-a")
    settings = AgentSettings(
        server="gpu-a", token=SecretStr(token), fleet_url=live.url, telemetry="simulated"
    )
    client = FleetClient(live.url, token, 10.0)
    telemetry = SimulatedTelemetry("H100", 2, seed=3)
    agent = Agent(settings, telemetry, client)
    try:
        agent.tick()  # registers
        telemetry.inject(Fault(kind="ecc_uncorrected", gpu=1, count=2))
        telemetry.inject(Fault(kind="remap_failed", gpu=1))
        telemetry.inject(Fault(kind="xid", gpu=1, xid=48))
        agent.tick()
        agent.next_report_at = 0  # report now: the verdict changed anyway
        agent.tick()
        assert agent.registered and agent.last_error is None, agent.last_error
    finally:
        client.close()
    viewer = live.client(live.token(Role.VIEWER, name="v"))
    gpus = viewer.get("/api/v1/servers/gpu-a/gpus").json()["results"]
    sick, well = gpus[1], gpus[0]
    assert sick["health"] == "unhealthy" and well["health"] == "healthy"
    reading = sick["reading"]
    assert reading["ecc_uncorrected_volatile"] == 2 and reading["remap_failed"] is True
    assert reading["remapped_rows_uncorrectable"] == 1 and reading["xids"] == [48]
    assert reading["temperature_c"] > 0 and reading["memory_total_mib"] > 0
    assert well["reading"]["xids"] == [] and well["reading"]["ecc_uncorrected_volatile"] == 0
    assert "uuid" not in reading and "health" not in reading  # those are the GPU row's
    # The server list stays light: the readings are the GPU view's.
    assert "gpu_telemetry" not in viewer.get("/api/v1/servers/gpu-a").json()
    other = viewer.get("/api/v1/servers/gpu-b/gpus").json()["results"]
    assert [g["reading"] for g in other] == [None, None]
