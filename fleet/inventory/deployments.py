"""Deployments: create, update and read (the models being served, with their SLAs)."""

from __future__ import annotations

from pydantic import ValidationError
from sqlmodel import Session, col, select

from fleet.errors import ConflictError, FleetError, NotFoundError, ValidationFailed
from fleet.events import record_update, set_fields
from fleet.inventory.gpu_models import BUILTIN
from fleet.models import (
    Deployment,
    DeploymentBase,
    DeploymentCreate,
    DeploymentPublic,
    DeploymentUpdate,
    Event,
    GpuModelSpec,
)
from fleet.validation import validation_messages


def _check_gpu_models(session: Session, models: list[str]) -> None:
    known = set(BUILTIN) | set(session.exec(select(GpuModelSpec.name)))
    unknown = sorted(set(models) - known)
    if unknown:
        raise FleetError(
            f"gpu_models: unknown GPU model(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )


def _get(session: Session, name: str) -> Deployment:
    row = session.exec(select(Deployment).where(Deployment.name == name)).one_or_none()
    if row is None:
        raise NotFoundError(f"no deployment named {name!r}")
    return row


def public(row: Deployment) -> DeploymentPublic:
    return DeploymentPublic.model_validate(row.model_dump())


def list_deployments(session: Session) -> list[DeploymentPublic]:
    return [public(d) for d in session.exec(select(Deployment).order_by(col(Deployment.name)))]


def get_deployment(session: Session, name: str) -> DeploymentPublic:
    return public(_get(session, name))


def _check_rules(spec: DeploymentCreate) -> None:
    """400 for a deployment that matches its schema but breaks a rule across its fields."""
    problems = spec.rule_problems()
    if problems:
        raise FleetError("; ".join(problems))


def create_deployment(session: Session, spec: DeploymentCreate, actor: str) -> DeploymentPublic:
    if session.exec(select(Deployment.id).where(Deployment.name == spec.name)).first() is not None:
        raise ConflictError(f"deployment {spec.name!r} already exists (update it with PATCH)")
    _check_rules(spec)
    _check_gpu_models(session, spec.gpu_models)
    row = Deployment.model_validate(spec.model_dump())
    session.add(row)
    session.add(
        Event(
            subject_type="deployment",
            subject=spec.name,
            actor=actor,
            kind="deployment.created",
            message=f"{spec.model_uri}",
        )
    )
    session.commit()
    return public(row)


def update_deployment(
    session: Session, name: str, update: DeploymentUpdate, actor: str
) -> DeploymentPublic:
    row = _get(session, name)
    changes = update.model_dump(exclude_unset=True)
    current = row.model_dump(include=set(DeploymentBase.model_fields))
    try:
        candidate = DeploymentCreate.model_validate({**current, **changes})
    except ValidationError as exc:
        raise ValidationFailed(validation_messages(exc)) from None
    _check_rules(candidate)
    if "gpu_models" in changes:
        _check_gpu_models(session, candidate.gpu_models)
    changed = set_fields(row, changes)
    record_update(session, row, "deployment", name, changed, actor, "updated")
    session.commit()
    return public(row)
