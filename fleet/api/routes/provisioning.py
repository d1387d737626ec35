"""Warm spares, operator moves that start workflows, and the autopilot."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from fleet.api.deps import EngineDep, Operator, SessionDep, SettingsDep, Viewer
from fleet.api.responses import AutopilotView, BootOutcome, DrainView, WarmPool
from fleet.models import Int
from fleet.provisioning import autopilot as autopilot_switch
from fleet.provisioning import boots, operator_moves

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
def spares(_: Viewer, session: SessionDep) -> WarmPool:
    """The warm pool per site and GPU model, each spare with the power it would commit."""
    return WarmPool.model_validate(operator_moves.warm_pool(session))


@router.post("/spares/boot")
def boot(
    request: BootRequest, user: Operator, engine: EngineDep, settings: SettingsDep
) -> BootOutcome:
    """Boot `count` spares for a deployment now (placement: model allowed, model cached, rack
    headroom, spread, measured boot time); its target grows by what booted. The servers then
    go booting → loading → serving on the leader's ticks."""
    # No session of the request's: the boots open their own, and take the placement lock.
    result = boots.boot_spares(
        engine, request.deployment, request.count, user.actor, raise_target=True, settings=settings
    )
    return BootOutcome(
        deployment=result.deployment,
        booted=list(result.booted),
        short=result.short,
        reasons=list(result.reasons),
    )


@router.post("/servers/{name}/drain")
def drain(name: str, user: Operator, session: SessionDep) -> DrainView:
    """Serving → draining: the agent stops taking requests and finishes in-flight ones; the
    server then waits, drained, for `undrain` (or maintenance, release, retire)."""
    return DrainView.model_validate(operator_moves.operator_drain(session, name, user.actor))


@router.post("/servers/{name}/undrain")
def undrain(name: str, user: Operator, session: SessionDep) -> DrainView:
    """Back to serving: a drained server loads its deployment again (no power cycle)."""
    return DrainView.model_validate(operator_moves.operator_undrain(session, name, user.actor))


@router.get("/autopilot")
def autopilot(_: Viewer, session: SessionDep) -> AutopilotView:
    row = autopilot_switch.get_autopilot(session)
    return AutopilotView.model_validate(autopilot_switch.autopilot_view(row))


@router.post("/autopilot/pause")
def pause(request: PauseRequest, user: Operator, session: SessionDep) -> AutopilotView:
    """Stop every automatic action (boots, drains, power cycles, returns) until resumed."""
    row = autopilot_switch.set_paused(session, True, user.actor, request.reason)
    return AutopilotView.model_validate(autopilot_switch.autopilot_view(row))


@router.post("/autopilot/resume")
def resume(request: ResumeRequest, user: Operator, session: SessionDep) -> AutopilotView:
    """Resume automatic actions; also closes an open breaker."""
    row = autopilot_switch.set_paused(session, False, user.actor, request.reason)
    return AutopilotView.model_validate(autopilot_switch.autopilot_view(row))
