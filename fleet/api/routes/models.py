"""Model versions and their artifacts (fleet/catalog/; docs/weights.md).

Viewers read; operators create and delete. A version is immutable (a second POST of the same
`<model>@<version>` is a 409) and is deleted only when no deployment or server uses it (409
naming them)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from fleet.api.deps import Operator, PagingDep, SessionDep, Viewer
from fleet.api.responses import Listing, Page
from fleet.catalog import versions as service
from fleet.models import MODEL_NAME_PATTERN, ModelVersionCreate, ModelVersionPublic, VersionHolder

router = APIRouter(prefix="/models", tags=["models"])

ModelName = Annotated[str, Path(max_length=63, pattern=MODEL_NAME_PATTERN)]
VersionName = Annotated[str, Path(max_length=63, pattern=MODEL_NAME_PATTERN)]


@router.get("")
def list_versions(
    _: Viewer,
    session: SessionDep,
    paging: PagingDep,
    model: Annotated[str | None, Query(max_length=63, pattern=MODEL_NAME_PATTERN)] = None,
) -> Page[ModelVersionPublic]:
    """Every version (of `model` when given), by model and creation time."""
    return paging.slice(service.list_versions(session, model))


@router.post("", status_code=status.HTTP_201_CREATED)
def create_version(
    spec: ModelVersionCreate, user: Operator, session: SessionDep
) -> ModelVersionPublic:
    """400 naming each bad artifact (scheme, sha256, size, name); 409 if it exists."""
    return service.create_version(session, spec, user.actor)


@router.get("/{model}/versions/{version}")
def get_version(
    model: ModelName, version: VersionName, _: Viewer, session: SessionDep
) -> ModelVersionPublic:
    """One version, with the deployments using it and the servers holding it in their cache."""
    return service.get_version(session, model, version)


@router.get("/{model}/versions/{version}/servers")
def version_servers(
    model: ModelName, version: VersionName, _: Viewer, session: SessionDep
) -> Listing[VersionHolder]:
    """The servers whose agent reported the version in its cache, and in which state."""
    rows = service.version_holders(session, model, version)
    return Listing(count=len(rows), results=rows)


@router.delete("/{model}/versions/{version}", status_code=status.HTTP_204_NO_CONTENT)
def delete_version(
    model: ModelName, version: VersionName, user: Operator, session: SessionDep
) -> None:
    """409 while a deployment serves or rolls it out, or a server is moved to or staging it."""
    service.delete_version(session, model, version, user.actor)
