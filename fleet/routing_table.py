"""The routing table: per deployment, the replicas a router may send to now.

A server receives traffic only when it is `serving`, its agent says ready and its heartbeat is
fresh (docs/design.md). The router (fleet/router/) reads this every few seconds and each listed
agent's /state every 250 ms; this table only says who exists, the agents say who is ready now.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlparse

from sqlmodel import Session, col, select

from fleet.models import Deployment, Server, utcnow
from fleet.settings import Settings
from fleet.states import ServerState


def served_name(model_uri: str) -> str:
    """The model name trtllm-serve answers to: its checkpoint directory's base name."""
    parsed = urlparse(model_uri)
    path = parsed.path if parsed.scheme else model_uri
    return PurePosixPath(path.rstrip("/")).name or parsed.netloc or model_uri


def routing_table(
    session: Session, settings: Settings, *, now: datetime | None = None
) -> list[dict[str, Any]]:
    fresh_after = (now or utcnow()) - timedelta(seconds=3 * settings.heartbeat_interval_s)
    serving = list(
        session.exec(
            select(Server)
            .where(Server.state == ServerState.SERVING)
            .where(col(Server.deployment_id).is_not(None))
            .order_by(col(Server.name))
        )
    )
    out = []
    for deployment in session.exec(select(Deployment).order_by(col(Deployment.name))):
        params = deployment.engine_params or {}
        replicas = [
            {
                "server": server.name,
                "gpu_model": server.gpu_model,
                "agent_url": server.agent_url,
                "index": replica.get("index"),
                "url": replica.get("url"),
                "state": replica.get("state"),
            }
            for server in serving
            if server.deployment_id == deployment.id
            and server.agent_ready
            and server.agent_url
            and server.last_heartbeat_at is not None
            and server.last_heartbeat_at >= fresh_after
            for replica in server.replicas or []
            if replica.get("url")
        ]
        out.append(
            {
                "deployment": deployment.name,
                "models": sorted({deployment.name, served_name(deployment.model_uri)}),
                "model_uri": deployment.model_uri,
                "tp_size": int(params.get("tp_size", 1) or 1),
                "max_batch_size": params.get("max_batch_size"),
                "sla_p95_latency_ms": deployment.sla_p95_latency_ms,
                "sla_ttft_ms": deployment.sla_ttft_ms,
                "replicas": replicas,
            }
        )
    return out
