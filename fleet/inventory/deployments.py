"""Deployments: create, update and read (the models being served, with their SLAs).

A deployment serves a model version (fleet/catalog/); one created with a bare `model_uri` and
`model_checksum` (as before versions) gets an `external` version for them, so both kinds of
client keep working. Its `model_uri` and `model_checksum` follow the version
(`fleet.catalog.refs.set_deployment_version`)."""

from __future__ import annotations

from pydantic import ValidationError
from sqlmodel import Session, col, select

from fleet.catalog.refs import key_for_id, set_deployment_version
from fleet.catalog.versions import external_version, row_for_key
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
    ModelVersion,
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


def public(
    session: Session, row: Deployment, keys: dict[int, str] | None = None
) -> DeploymentPublic:
    """The deployment as clients see it, its versions named "<model>@<version>" (`keys`: the
    names by version id, when the caller has them all)."""

    def name(version_id: int | None) -> str | None:
        if version_id is None:
            return None
        if keys is not None:
            return keys.get(version_id)
        return key_for_id(session, version_id)

    return DeploymentPublic.model_validate(
        row.model_dump()
        | {
            "model_version": name(row.model_version_id),
            "canary_version": name(row.canary_version_id),
        }
    )


def list_deployments(session: Session) -> list[DeploymentPublic]:
    keys = {
        v.id: f"{v.model}@{v.version}"
        for v in session.exec(select(ModelVersion))
        if v.id is not None
    }
    rows = session.exec(select(Deployment).order_by(col(Deployment.name)))
    return [public(session, d, keys) for d in rows]


def get_deployment(session: Session, name: str) -> DeploymentPublic:
    return public(session, _get(session, name))


def _check_rules(spec: DeploymentCreate) -> None:
    """400 for a deployment that matches its schema but breaks a rule across its fields."""
    problems = spec.rule_problems()
    if problems:
        raise FleetError("; ".join(problems))


def _version_of(
    session: Session,
    model_version: str | None,
    uri: str | None,
    checksum: str | None,
    actor: str,
) -> ModelVersion:
    """The version a client names: `model_version`, or an external one for a legacy
    `model_uri` and `model_checksum` (400 unless exactly one of the two ways is given)."""
    if model_version is not None:
        if uri is not None or checksum is not None:
            raise FleetError(
                "give model_version or model_uri and model_checksum (weights delivered "
                "outside Fleet), not both"
            )
        return row_for_key(session, model_version)
    if uri is None or checksum is None:
        raise FleetError(
            'model_version ("<model>@<version>", fleetctl models list) is required, or both '
            "model_uri and model_checksum for weights delivered outside Fleet"
        )
    return external_version(session, uri, checksum, actor)


def create_deployment(session: Session, spec: DeploymentCreate, actor: str) -> DeploymentPublic:
    if session.exec(select(Deployment.id).where(Deployment.name == spec.name)).first() is not None:
        raise ConflictError(f"deployment {spec.name!r} already exists (update it with PATCH)")
    _check_rules(spec)
    _check_gpu_models(session, spec.gpu_models)
    version = _version_of(session, spec.model_version, spec.model_uri, spec.model_checksum, actor)
    values = spec.model_dump(exclude={"model_version"})
    # Placeholders, replaced at once by the version's identity.
    values |= {"model_uri": version.model, "model_checksum": version.digest}
    row = Deployment.model_validate(values)
    set_deployment_version(session, row, version)
    session.add(row)
    session.add(
        Event(
            subject_type="deployment",
            subject=spec.name,
            actor=actor,
            kind="deployment.created",
            message=f"{version.model}@{version.version} ({row.model_uri})",
            details={"model_version": f"{version.model}@{version.version}"},
        )
    )
    session.commit()
    return public(session, row)


def update_deployment(
    session: Session, name: str, update: DeploymentUpdate, actor: str
) -> DeploymentPublic:
    row = _get(session, name)
    changes = update.model_dump(exclude_unset=True)
    model_version = changes.pop("model_version", None)
    identity = {k: changes.pop(k) for k in ("model_uri", "model_checksum") if k in changes}
    current = row.model_dump(include=set(DeploymentBase.model_fields))
    try:
        candidate = DeploymentCreate.model_validate({**current, **changes})
    except ValidationError as exc:
        raise ValidationFailed(validation_messages(exc)) from None
    _check_rules(candidate)
    if "gpu_models" in changes:
        _check_gpu_models(session, candidate.gpu_models)
    version: ModelVersion | None = None
    if model_version is not None or identity:
        if row.canary_version_id is not None:
            raise ConflictError(
                f"deployment {name} is rolling out a version: let the rollout finish or roll "
                f"it back (fleetctl deployments rollback {name}) before changing its version"
            )
        if model_version is not None:
            version = _version_of(session, model_version, None, None, actor)
            if identity:
                raise FleetError("give model_version or model_uri and model_checksum, not both")
        else:
            version = _version_of(
                session,
                None,
                identity.get("model_uri", row.model_uri),
                identity.get("model_checksum", row.model_checksum),
                actor,
            )
    changed = set_fields(row, changes)
    if version is not None and version.id != row.model_version_id:
        before = (row.model_uri, row.model_checksum)
        set_deployment_version(session, row, version)
        changed += ["model_version"] + [
            f
            for f, old in zip(("model_uri", "model_checksum"), before, strict=True)
            if getattr(row, f) != old
        ]
    record_update(session, row, "deployment", name, changed, actor, "updated")
    session.commit()
    return public(session, row)
