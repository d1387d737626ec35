"""fleet.registry.routing_table on both databases: who a router may send to, per deployment."""

from __future__ import annotations

from datetime import timedelta

from factories import add_rack, add_server, add_site
from sqlmodel import Session

from fleet.models import Deployment, ModelVersion, utcnow
from fleet.registry.routing_table import routing_table, served_name
from fleet.settings import Settings


def test_only_serving_ready_servers_with_a_fresh_heartbeat_are_listed(session: Session) -> None:
    rack = add_rack(session, add_site(session, "s1"), "r1")
    dep = Deployment(
        name="llama",
        model_uri="s3://models/llama-3.1-8b/",
        model_checksum="sha256:1",
        engine_params={"tp_size": 1, "max_batch_size": 32},
        sla_p95_latency_ms=2000,
        sla_ttft_ms=500,
    )
    session.add(dep)
    session.commit()
    now = utcnow()
    cases = {
        "ok": ("serving", True, now),
        "stale": ("serving", True, now - timedelta(minutes=5)),
        "unready": ("serving", False, now),
        "draining": ("draining", True, now),
    }
    for i, (name, (state, ready, beat)) in enumerate(cases.items()):
        server = add_server(session, rack, name, state, u_position=1 + 8 * i, bmc_system_id=name)
        server.deployment_id = dep.id
        server.agent_ready = ready
        server.agent_url = f"http://{name}:9410"
        server.last_heartbeat_at = beat
        server.replicas = [
            {"index": 0, "url": f"http://{name}:8100", "state": "ready"},
            {"index": 1, "state": "loading"},  # no URL yet: not routable
        ]
        session.add(server)
    session.commit()
    [row] = routing_table(session, Settings(heartbeat_interval_s=5.0))
    assert row["deployment"] == "llama"
    assert row["models"] == ["llama", "llama-3.1-8b"]
    assert (row["tp_size"], row["max_batch_size"]) == (1, 32)
    assert row["replicas"] == [
        {
            "server": "ok",
            "gpu_model": "H100",
            "agent_url": "http://ok:9410",
            "index": 0,
            "url": "http://ok:8100",
            "state": "ready",
            "version": None,  # a deployment without model versions (none recorded here)
        }
    ]
    assert row["versions"] == {"stable": None, "canary": None, "canary_weight": 0.0}


def test_each_replica_has_its_version_and_the_deployment_its_split(session: Session) -> None:
    """The agent's word first (a server a rollout just moved still runs the old version), else
    the server's own version, else its deployment's."""
    rack = add_rack(session, add_site(session, "s1"), "r1")
    v1 = ModelVersion(model="llama", version="v1", digest="sha256:1", created_by="t")
    v2 = ModelVersion(model="llama", version="v2", digest="sha256:2", created_by="t")
    session.add_all([v1, v2])
    session.commit()
    dep = Deployment(
        name="llama",
        model_uri="llama",
        model_checksum="sha256:1",
        sla_p95_latency_ms=2000,
        sla_ttft_ms=500,
        model_version_id=v1.id,
        canary_version_id=v2.id,
        canary_weight=0.05,
    )
    session.add(dep)
    session.commit()
    now = utcnow()
    # (server's own version, what its agent reports)
    cases = {"a": (None, None), "b": (v2.id, None), "c": (v2.id, "llama@v1")}
    for i, (name, (own, reported)) in enumerate(cases.items()):
        server = add_server(
            session, rack, name, "serving", u_position=1 + 8 * i, bmc_system_id=name
        )
        server.deployment_id = dep.id
        server.model_version_id = own
        server.agent_ready = True
        server.agent_url = f"http://{name}:9410"
        server.last_heartbeat_at = now
        server.replicas = [
            {"index": 0, "url": f"http://{name}:8100", "state": "ready", "version": reported}
        ]
        session.add(server)
    session.commit()
    [row] = routing_table(session, Settings(heartbeat_interval_s=5.0))
    assert {r["server"]: r["version"] for r in row["replicas"]} == {
        "a": "llama@v1",
        "b": "llama@v2",
        "c": "llama@v1",
    }
    assert row["versions"] == {"stable": "llama@v1", "canary": "llama@v2", "canary_weight": 0.05}
    assert row["models"] == ["llama"]


def test_served_name_is_the_checkpoint_directory() -> None:
    assert served_name("s3://bucket/llama-3.1-70b") == "llama-3.1-70b"
    assert served_name("/models/llama/") == "llama"
    assert served_name("meta-llama/Llama-3.1-8B") == "Llama-3.1-8B"


def test_a_deployment_switched_off_says_so_and_promises_no_boot(session: Session) -> None:
    for name, most in (("off", 0), ("cold", 2)):
        session.add(
            Deployment(
                name=name,
                model_uri=f"s3://models/{name}/",
                model_checksum="sha256:1",
                min_replicas=0,
                max_replicas=most,
                sla_p95_latency_ms=2000,
                sla_ttft_ms=500,
            )
        )
    session.commit()
    rows = {r["deployment"]: r for r in routing_table(session, Settings(boot_estimate_s=600.0))}
    assert (rows["off"]["off"], rows["off"]["cold_start_s"]) == (True, None)
    assert (rows["cold"]["off"], rows["cold"]["cold_start_s"]) == (False, 600.0)
