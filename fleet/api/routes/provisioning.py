"""Warm spares, operator moves that start workflows, and the autopilot."""

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine

from fleet.api.deps import Operator, SessionDep, Viewer
from fleet.models import Int
from fleet.provisioning import workflows as provisioning

router = APIRouter(tags=["provisioning"])


class BootRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    deployment: str = Field(min_length=1, max_length=63)
    count: Int = Field(ge=1, le=1000)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=500)


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="resumed by an operator", min_length=1, max_length=500)


@router.get("/spares")
def spares(_: Viewer, session: SessionDep) -> dict[str, Any]:
    """The warm pool per site and GPU model, each spare with the power it would commit."""
    return provisioning.warm_pool(session)


@router.post("/spares/boot")
def boot(request: BootRequest, user: Operator, session: SessionDep) -> dict[str, Any]:
    """Boot `count` spares for a deployment now (placement: model allowed, model cached, rack
    headroom, spread, measured boot time); its target grows by what booted. The servers then
    go booting → loading → serving on the leader's ticks."""
    engine = cast(Engine, session.get_bind())
    session.close()
    result = provisioning.boot_spares(
        engine, request.deployment, request.count, user.actor, raise_target=True
    )
    return {
        "deployment": result.deployment,
        "booted": list(result.booted),
        "short": result.short,
        "reasons": list(result.reasons),
    }


@router.post("/servers/{name}/drain")
def drain(name: str, user: Operator, session: SessionDep) -> dict[str, Any]:
    """Serving → draining: the agent stops taking requests and finishes in-flight ones; the
    server then waits, drained, for `undrain` (or maintenance, release, retire)."""
    return provisioning.operator_drain(session, name, user.actor)


@router.post("/servers/{name}/undrain")
def undrain(name: str, user: Operator, session: SessionDep) -> dict[str, Any]:
    """Back to serving: a drained server loads its deployment again (no power cycle)."""
    return provisioning.operator_undrain(session, name, user.actor)


@router.get("/autopilot")
def autopilot(_: Viewer, session: SessionDep) -> dict[str, Any]:
    return provisioning.autopilot_view(provisioning.get_autopilot(session))


@router.post("/autopilot/pause")
def pause(request: PauseRequest, user: Operator, session: SessionDep) -> dict[str, Any]:
    """Stop every automatic action (boots, drains, power cycles, returns) until resumed."""
    row = provisioning.set_paused(session, True, user.actor, request.reason)
    return provisioning.autopilot_view(row)


@router.post("/autopilot/resume")
def resume(request: ResumeRequest, user: Operator, session: SessionDep) -> dict[str, Any]:
    """Resume automatic actions; also closes an open breaker."""
    row = provisioning.set_paused(session, False, user.actor, request.reason)
    return provisioning.autopilot_view(row)
