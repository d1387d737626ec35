"""The autoscaler: its view of each deployment, its decisions, and manual mode."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlmodel import Session, col, select

from fleet.api.deps import Operator, SessionDep, SettingsDep, Viewer
from fleet.api.responses import Listing, ScaleOutcome, ScalingDecisionPublic, ScalingStatus
from fleet.autoscaler.service import status
from fleet.errors import NotFoundError
from fleet.models import MAX_REPLICAS, Deployment, Event, OptInt, ScalingDecision, utcnow

router = APIRouter(tags=["autoscaler"])


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Replicas to pin the deployment at (manual mode), or null to hand it back to the autoscaler.
    replicas: OptInt = Field(ge=0, le=MAX_REPLICAS)


@router.get("/autoscaler")
def autoscaler_status(
    _: Viewer, session: SessionDep, settings: SettingsDep
) -> Listing[ScalingStatus]:
    """Per deployment: mode, target, serving, on the way, its signals now (from the last
    heartbeats and router reports, as the autoscaler's next tick sees them), and its last
    decision's rule and reason."""
    rows = [ScalingStatus.model_validate(row) for row in status(session, settings, utcnow())]
    return Listing(count=len(rows), results=rows)


@router.get("/autoscaler/{deployment}/decisions")
def decisions(
    deployment: str,
    _: Viewer,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> Listing[ScalingDecisionPublic]:
    """The deployment's decisions, newest first: rule, target before and after, inputs."""
    _deployment(session, deployment)
    rows = session.exec(
        select(ScalingDecision)
        .where(ScalingDecision.deployment == deployment)
        .order_by(col(ScalingDecision.id).desc())
        .limit(limit)
    ).all()
    results = [ScalingDecisionPublic.model_validate(r, from_attributes=True) for r in rows]
    return Listing(count=len(results), results=results)


@router.post("/deployments/{name}/scale")
def scale(name: str, request: ScaleRequest, user: Operator, session: SessionDep) -> ScaleOutcome:
    """Pin the deployment at `replicas` (manual mode: the autoscaler holds it there), or
    `null` for automatic scaling again."""
    deployment = _deployment(session, name)
    deployment.pinned_replicas = request.replicas
    session.add(deployment)
    mode = f"pinned at {request.replicas} replicas" if request.replicas is not None else "automatic"
    session.add(
        Event(
            at=utcnow(),
            subject_type="deployment",
            subject=name,
            actor=user.actor,
            kind="deployment.scale_mode",
            message=f"scaling {mode}",
            details={"pinned_replicas": request.replicas},
        )
    )
    session.commit()
    return ScaleOutcome(
        deployment=name,
        mode="pinned" if request.replicas is not None else "auto",
        pinned_replicas=request.replicas,
    )


def _deployment(session: Session, name: str) -> Deployment:
    row = session.exec(select(Deployment).where(Deployment.name == name)).first()
    if row is None:
        raise NotFoundError(f"no deployment named {name!r}")
    return row
