"""The agents' side of the API: register and heartbeat, answered with the assignment."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fleet.api.deps import AgentCaller, BoxDep, SessionDep, SettingsDep
from fleet.power.measure import drawn_fresh_s
from fleet.registry.agent_reports import Heartbeat, Registration, Reply, heartbeat, register
from fleet.registry.heartbeat_ingest import HeartbeatIngest

router = APIRouter(tags=["agent"], prefix="/agent")


def _peer(request: Request) -> str | None:
    """The address the report came from: the URLs it names must be on it (agent_reports)."""
    return request.client.host if request.client is not None else None


@router.post("/register")
def agent_register(
    report: Registration,
    agent: AgentCaller,
    session: SessionDep,
    settings: SettingsDep,
    box: BoxDep,
    request: Request,
) -> Reply:
    """An agent (re)starts: who it is, where its local API listens (an address of the server
    itself, or in FLEET_AGENT_NETWORKS: 422 otherwise), its local API's key (stored encrypted,
    never shown), the GPUs it found. Only the agent token of that server may send it (403
    otherwise)."""
    return register(
        session,
        agent,
        report,
        settings.heartbeat_interval_s,
        box=box,
        peer=_peer(request),
        networks=settings.agent_networks,
    )


@router.post("/heartbeat")
def agent_heartbeat(
    report: Heartbeat,
    agent: AgentCaller,
    session: SessionDep,
    settings: SettingsDep,
    request: Request,
) -> Reply:
    """Every few seconds: the health verdict, repair action, per-GPU state and replicas (their
    URLs under the same rule as the agent's). Answered with the server's assignment (nothing,
    a deployment's replicas, or drain). On Postgres, a report that changes nothing the fleet
    acts on is answered before it gets here (fleet/api/fast_heartbeats.py) from what this one
    keeps."""
    ingest: HeartbeatIngest | None = request.app.state.heartbeats
    peer = _peer(request)
    fresh_s = drawn_fresh_s(settings)
    return heartbeat(
        session,
        agent,
        report,
        settings.heartbeat_interval_s,
        peer=peer,
        networks=settings.agent_networks,
        drawn_fresh=fresh_s,
        capture=ingest.capture(report, peer, agent.token_id, fresh_s) if ingest else None,
    )
