"""Rollouts of a deployment's model version (fleet/rollout/; docs/router.md, docs/weights.md):
start one, roll it back by hand, read where it stands."""

from __future__ import annotations

from fastapi import APIRouter, status

from fleet.api.deps import Operator, SessionDep, Viewer
from fleet.rollout import service
from fleet.rollout.service import RollbackRequest, RolloutRequest, RolloutStatus

router = APIRouter(prefix="/deployments", tags=["deployments"])


@router.post("/{name}/rollout", status_code=status.HTTP_202_ACCEPTED)
def start_rollout(
    name: str, spec: RolloutRequest, user: Operator, session: SessionDep
) -> RolloutStatus:
    """Begin rolling `spec.version` out (the leader's rollout loop then moves it step by
    step); 409 while another rollout runs or for a version that is not a new one of the
    deployment's model."""
    return service.start(session, name, spec, user.actor)


@router.post("/{name}/rollback")
def rollback(
    name: str, user: Operator, session: SessionDep, spec: RollbackRequest | None = None
) -> RolloutStatus:
    """Roll the running rollout back now: weight 0, canary servers back on the stable version
    (409 when none runs)."""
    return service.rollback_by_hand(
        session, name, spec.reason if spec is not None else "", user.actor
    )


@router.get("/{name}/rollout")
def rollout_status(name: str, _: Viewer, session: SessionDep) -> RolloutStatus:
    """The rollout's plan and progress (the last analysis and its figures), and each server's
    version."""
    return service.status(session, name)
