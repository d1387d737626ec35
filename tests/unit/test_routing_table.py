"""fleet.registry.routing_table on both databases: who a router may send to, per deployment."""

from __future__ import annotations

from datetime import timedelta

from factories import add_rack, add_server, add_site
from sqlmodel import Session

from fleet.models import Deployment, utcnow
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
        }
    ]


def test_served_name_is_the_checkpoint_directory() -> None:
    assert served_name("s3://bucket/llama-3.1-70b") == "llama-3.1-70b"
    assert served_name("/models/llama/") == "llama"
    assert served_name("meta-llama/Llama-3.1-8B") == "Llama-3.1-8B"
