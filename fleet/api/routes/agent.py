"""The agents' side of the API: register and heartbeat, answered with the assignment."""

from __future__ import annotations

from fastapi import APIRouter

from fleet.agent_reports import Heartbeat, Registration, Reply, heartbeat, register
from fleet.api.deps import AgentCaller, SessionDep, SettingsDep

router = APIRouter(tags=["agent"], prefix="/agent")


@router.post("/register")
def agent_register(
    report: Registration, agent: AgentCaller, session: SessionDep, settings: SettingsDep
) -> Reply:
    """An agent (re)starts: who it is, where its local API listens, the GPUs it found.
    Only the agent token of that server may send it (403 otherwise)."""
    return register(session, agent, report, settings.heartbeat_interval_s)


@router.post("/heartbeat")
def agent_heartbeat(
    report: Heartbeat, agent: AgentCaller, session: SessionDep, settings: SettingsDep
) -> Reply:
    """Every few seconds: the health verdict, repair action and per-GPU state. Answered with
    the server's assignment (nothing, a deployment's replicas, or drain)."""
    return heartbeat(session, agent, report, settings.heartbeat_interval_s)
