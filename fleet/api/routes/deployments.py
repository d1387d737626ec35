"""Deployments: the models the fleet serves, with their engines, replica bounds and SLAs."""

from __future__ import annotations

from fastapi import APIRouter, status

from fleet.api.deps import Operator, PagingDep, SessionDep, Viewer
from fleet.api.responses import Page
from fleet.inventory import deployments as service
from fleet.models import DeploymentCreate, DeploymentPublic, DeploymentUpdate

router = APIRouter(prefix="/deployments", tags=["deployments"])


@router.get("")
def list_deployments(_: Viewer, session: SessionDep, paging: PagingDep) -> Page[DeploymentPublic]:
    return paging.slice(service.list_deployments(session))


@router.get("/{name}")
def get_deployment(name: str, _: Viewer, session: SessionDep) -> DeploymentPublic:
    return service.get_deployment(session, name)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_deployment(
    spec: DeploymentCreate, user: Operator, session: SessionDep
) -> DeploymentPublic:
    return service.create_deployment(session, spec, user.actor)


@router.patch("/{name}")
def update_deployment(
    name: str, update: DeploymentUpdate, user: Operator, session: SessionDep
) -> DeploymentPublic:
    return service.update_deployment(session, name, update, user.actor)
