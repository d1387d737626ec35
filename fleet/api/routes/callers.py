"""Tenants and client keys (docs/api.md "Tenants and client keys"): who may send requests to
the routers. Operators create, change and revoke; viewers list. A key's value is in the create
answer only (once); no answer, event or error carries its hash."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from fleet import callers as service
from fleet.api.deps import Operator, SessionDep, Viewer
from fleet.api.responses import Listing
from fleet.models import (
    NAME_PATTERN,
    ClientKeyCreate,
    ClientKeyCreated,
    ClientKeyPublic,
    ClientKeyUpdate,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from fleet.validation import INT32_MAX

router = APIRouter(tags=["callers"])

TenantName = Annotated[str, Path(max_length=63, pattern=NAME_PATTERN)]
# Key ids are 32-bit on Postgres: a larger one is no key (422), not a database error.
KeyId = Annotated[int, Path(ge=1, le=INT32_MAX)]


@router.get("/tenants")
def list_tenants(_: Viewer, session: SessionDep) -> Listing[TenantPublic]:
    """Every tenant by name, with its count of active keys."""
    rows = service.list_tenants(session)
    return Listing(count=len(rows), results=rows)


@router.post("/tenants", status_code=status.HTTP_201_CREATED)
def create_tenant(spec: TenantCreate, user: Operator, session: SessionDep) -> TenantPublic:
    """A new tenant; `concurrency_share` (0 < share <= 1, default 1): the part of a contended
    deployment's slots its requests may hold (docs/router.md). 409 if the name is taken."""
    return service.create_tenant(session, spec, user.actor)


@router.patch("/tenants/{name}")
def update_tenant(
    name: TenantName, update: TenantUpdate, user: Operator, session: SessionDep
) -> TenantPublic:
    return service.update_tenant(session, name, update, user.actor)


@router.delete("/tenants/{name}")
def delete_tenant(name: TenantName, user: Operator, session: SessionDep) -> TenantPublic:
    """Delete a tenant (its revoked and expired keys with it); 409 while it has active keys."""
    return service.delete_tenant(session, name, user.actor)


@router.get("/client-keys")
def list_keys(
    _: Viewer,
    session: SessionDep,
    tenant: Annotated[str | None, Query(max_length=63, pattern=NAME_PATTERN)] = None,
) -> Listing[ClientKeyPublic]:
    """Keys by id (never their values or hashes), or a tenant's (404 for an unknown one)."""
    rows = service.list_keys(session, tenant)
    return Listing(count=len(rows), results=rows)


@router.post("/client-keys", status_code=status.HTTP_201_CREATED)
def create_key(spec: ClientKeyCreate, user: Operator, session: SessionDep) -> ClientKeyCreated:
    """A new key for a tenant; `key` is its value, shown this once (only its hash is kept).
    Limits per minute (null: unlimited); `expires_in` 90d, 12h or 30m (none: never). 404
    naming an unknown tenant, 400 for an `expires_in` of another form."""
    return service.create_key(session, spec, user.actor)


@router.patch("/client-keys/{key_id}")
def update_key(
    key_id: KeyId, update: ClientKeyUpdate, user: Operator, session: SessionDep
) -> ClientKeyPublic:
    """Change a key's limits: a field left out keeps its value, null lifts the limit. 409 for
    a revoked key."""
    return service.update_key(session, key_id, update, user.actor)


@router.delete("/client-keys/{key_id}")
def revoke_key(key_id: KeyId, user: Operator, session: SessionDep) -> ClientKeyPublic:
    """Revoke a key: routers refuse it from their next poll. Revoking twice changes nothing."""
    return service.revoke_key(session, key_id, user.actor)
