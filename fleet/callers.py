"""Tenants and client keys: who may send requests to the routers, at what rates, with what
share of a contended deployment (docs/api.md "Tenants and client keys", docs/router.md).

A key's value is made here and returned once; only its SHA-256 is stored. Rows are read without
the hash; `callers_table` (the routers' view, which needs it) reads it with a plain DBAPI
cursor, out of SQLAlchemy's row logging. No other answer, event, log line or error carries it.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.orm import QueryableAttribute, defer
from sqlmodel import Session, col, select

from fleet.auth import hash_token, parse_lifetime
from fleet.errors import ConflictError, NotFoundError
from fleet.models import (
    ClientKey,
    ClientKeyCreate,
    ClientKeyCreated,
    ClientKeyPublic,
    ClientKeyUpdate,
    Event,
    Tenant,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
    as_utc,
    utcnow,
)

KEY_PREFIX = "fk_"
# Rows are read without their hash (and so no result row SQLAlchemy logs at DEBUG carries it).
_NO_HASH = defer(cast("QueryableAttribute[str]", ClientKey.key_hash))


def new_key() -> str:
    """A client key's value: 256 random bits, recognisable by its prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def is_active(revoked_at: datetime | None, expires_at: datetime | None, now: datetime) -> bool:
    return revoked_at is None and (expires_at is None or as_utc(expires_at) > now)


def _active_clause(now: datetime) -> Any:
    return sa.and_(
        col(ClientKey.revoked_at).is_(None),
        sa.or_(col(ClientKey.expires_at).is_(None), col(ClientKey.expires_at) > now),
    )


# ---------------------------------------------------------------------------------------------
# Tenants


def _tenant(session: Session, name: str, *, lock: bool = False) -> Tenant:
    query = select(Tenant).where(Tenant.name == name)
    row = session.exec(query.with_for_update() if lock else query).one_or_none()
    if row is None:
        raise NotFoundError(f"no tenant named {name!r} (see `fleetctl tenants list`)")
    return row


def _tenant_public(row: Tenant, keys: int) -> TenantPublic:
    assert row.id is not None
    return TenantPublic(
        id=row.id,
        name=row.name,
        concurrency_share=row.concurrency_share,
        created_at=row.created_at,
        keys=keys,
    )


def _active_keys(session: Session, tenant_id: int | None, now: datetime) -> int:
    query = (
        select(sa.func.count())
        .select_from(ClientKey)
        .where(ClientKey.tenant_id == tenant_id, _active_clause(now))
    )
    return int(session.exec(query).one())


def _tenant_event(kind: str, row: Tenant, actor: str, message: str) -> Event:
    return Event(
        subject_type="tenant",
        subject=row.name,
        actor=actor,
        kind=kind,
        message=message,
        details={"concurrency_share": row.concurrency_share},
    )


def list_tenants(session: Session, now: datetime | None = None) -> list[TenantPublic]:
    """Every tenant by name, with its count of active keys (one query)."""
    now = now or utcnow()
    active = (
        select(ClientKey.tenant_id, sa.func.count().label("n"))
        .where(_active_clause(now))
        .group_by(col(ClientKey.tenant_id))
        .subquery()
    )
    rows = session.exec(
        select(Tenant, active.c.n)
        .outerjoin(active, active.c.tenant_id == Tenant.id)
        .order_by(col(Tenant.name))
    )
    return [_tenant_public(t, int(n or 0)) for t, n in rows]


def create_tenant(session: Session, spec: TenantCreate, actor: str) -> TenantPublic:
    if session.exec(select(Tenant.id).where(Tenant.name == spec.name)).first() is not None:
        raise ConflictError(f"tenant {spec.name!r} already exists (change it with PATCH)")
    row = Tenant(name=spec.name, concurrency_share=spec.concurrency_share)
    session.add(row)
    try:
        session.flush()
    except sa.exc.IntegrityError:  # the same name, created meanwhile by another request
        session.rollback()
        raise ConflictError(f"tenant {spec.name!r} already exists") from None
    session.add(
        _tenant_event("tenant.created", row, actor, f"concurrency share {row.concurrency_share:g}")
    )
    session.commit()
    return _tenant_public(row, 0)


def update_tenant(session: Session, name: str, update: TenantUpdate, actor: str) -> TenantPublic:
    row = _tenant(session, name, lock=True)
    if update.concurrency_share is not None:
        before = row.concurrency_share
        row.concurrency_share = update.concurrency_share
        session.add(row)
        session.add(
            _tenant_event(
                "tenant.updated",
                row,
                actor,
                f"concurrency share {before:g} -> {row.concurrency_share:g}",
            )
        )
    session.commit()
    return _tenant_public(row, _active_keys(session, row.id, utcnow()))


def delete_tenant(session: Session, name: str, actor: str) -> TenantPublic:
    """Delete a tenant without active keys (its revoked and expired ones go with it)."""
    row = _tenant(session, name, lock=True)
    active = _active_keys(session, row.id, utcnow())
    if active:
        raise ConflictError(
            f"tenant {name!r} has {active} active key(s): revoke them first "
            f"(`fleetctl keys list --tenant {name}`, `fleetctl keys revoke ID`)"
        )
    public = _tenant_public(row, 0)
    session.execute(sa.delete(ClientKey).where(col(ClientKey.tenant_id) == row.id))
    session.delete(row)
    session.add(_tenant_event("tenant.deleted", row, actor, "deleted"))
    session.commit()
    return public


# ---------------------------------------------------------------------------------------------
# Client keys


def _key_public(row: ClientKey, tenant: str, now: datetime) -> ClientKeyPublic:
    assert row.id is not None
    return ClientKeyPublic(
        id=row.id,
        name=row.name,
        tenant=tenant,
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        expires_at=row.expires_at,
        active=is_active(row.revoked_at, row.expires_at, now),
    )


def _limits(row: ClientKey) -> dict[str, Any]:
    return {
        "id": row.id,
        "requests_per_minute": row.requests_per_minute,
        "tokens_per_minute": row.tokens_per_minute,
    }


def _key_event(kind: str, row: ClientKey, tenant: str, actor: str, message: str) -> Event:
    """An event about a key: its id, name, tenant and limits, never its value or hash."""
    return Event(
        subject_type="client_key",
        subject=row.name,
        actor=actor,
        kind=kind,
        message=message,
        details={"tenant": tenant, **_limits(row)},
    )


def _describe(row: ClientKey) -> str:
    rpm = row.requests_per_minute
    tpm = row.tokens_per_minute
    return (
        f"{'unlimited' if rpm is None else rpm} requests/min, "
        f"{'unlimited' if tpm is None else tpm} tokens/min"
    )


def _key(session: Session, key_id: int, *, lock: bool = False) -> tuple[ClientKey, str]:
    query = (
        select(ClientKey, Tenant.name)
        .join(Tenant, col(Tenant.id) == ClientKey.tenant_id)
        .options(_NO_HASH)
        .where(ClientKey.id == key_id)
    )
    found = session.exec(query.with_for_update(of=ClientKey) if lock else query).one_or_none()
    if found is None:
        raise NotFoundError(f"no client key with id {key_id} (see `fleetctl keys list`)")
    row, tenant = found
    return row, tenant


def list_keys(
    session: Session, tenant: str | None = None, now: datetime | None = None
) -> list[ClientKeyPublic]:
    """Every key by id, or those of `tenant` (NotFoundError for an unknown one)."""
    now = now or utcnow()
    query = (
        select(ClientKey, Tenant.name)
        .join(Tenant, col(Tenant.id) == ClientKey.tenant_id)
        .options(_NO_HASH)
        .order_by(col(ClientKey.id))
    )
    if tenant is not None:
        query = query.where(ClientKey.tenant_id == _tenant(session, tenant).id)
    return [_key_public(row, name, now) for row, name in session.exec(query)]


def create_key(session: Session, spec: ClientKeyCreate, actor: str) -> ClientKeyCreated:
    """A new key for `spec.tenant`, and its only plaintext copy."""
    # Locked: a key created while its tenant is deleted waits, and then finds no tenant.
    tenant = _tenant(session, spec.tenant, lock=True)
    assert tenant.id is not None
    # `90d`, `12h`, `30m`, at most ten years: a 400 naming the accepted forms otherwise.
    lifetime = parse_lifetime(spec.expires_in) if spec.expires_in is not None else None
    now = utcnow()
    key = new_key()
    row = ClientKey(
        name=spec.name,
        tenant_id=tenant.id,
        key_hash=hash_token(key),
        requests_per_minute=spec.requests_per_minute,
        tokens_per_minute=spec.tokens_per_minute,
        created_at=now,
        expires_at=now + lifetime if lifetime is not None else None,
    )
    session.add(row)
    session.flush()  # its id, for the event and the answer
    until = f", expires {row.expires_at.isoformat(timespec='seconds')}" if row.expires_at else ""
    session.add(
        _key_event(
            "client_key.created",
            row,
            tenant.name,
            actor,
            f"key {row.id} for tenant {tenant.name}: {_describe(row)}{until}",
        )
    )
    # The answer before the commit: a session that expires on commit would read the row
    # again, hash and all, into SQLAlchemy's DEBUG log.
    public = _key_public(row, tenant.name, now)
    session.commit()
    return ClientKeyCreated(**public.model_dump(), key=key)


def update_key(
    session: Session, key_id: int, update: ClientKeyUpdate, actor: str
) -> ClientKeyPublic:
    """Change a key's limits (null lifts one); a revoked key keeps what it had."""
    row, tenant = _key(session, key_id, lock=True)
    if row.revoked_at is not None:
        raise ConflictError(f"client key {key_id} is revoked: create a new one")
    changes = update.model_dump(exclude_unset=True)
    if changes:
        before = _describe(row)
        for field, value in changes.items():
            setattr(row, field, value)
        session.add(row)
        session.add(
            _key_event(
                "client_key.updated",
                row,
                tenant,
                actor,
                f"key {key_id}: {before} -> {_describe(row)}",
            )
        )
    public = _key_public(row, tenant, utcnow())
    session.commit()
    return public


def revoke_key(session: Session, key_id: int, actor: str) -> ClientKeyPublic:
    """Revoke a key: routers refuse it from their next poll of the fleet. Twice is a no-op."""
    row, tenant = _key(session, key_id, lock=True)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        session.add(_key_event("client_key.revoked", row, tenant, actor, f"key {key_id} revoked"))
    public = _key_public(row, tenant, utcnow())
    session.commit()
    return public


# ---------------------------------------------------------------------------------------------
# The routers' view (GET /api/v1/routing/callers)


class CallerTenant(BaseModel):
    name: str
    concurrency_share: float


class CallerKey(BaseModel):
    """An active key as routers match it: by the SHA-256 of the value a request carries."""

    id: int
    hash: str
    tenant: str
    name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None


class CallersTable(BaseModel):
    """GET /api/v1/routing/callers (and, keys given by `hash`, a router's callers file)."""

    tenants: list[CallerTenant]
    keys: list[CallerKey]


def callers_table(session: Session, now: datetime | None = None) -> CallersTable:
    """Every tenant and every active key with its hash, tenant and limits: three small
    queries (tenants; active keys joined to their tenant; the hashes), whatever the number of
    keys."""
    now = now or utcnow()
    tenants = [
        CallerTenant(name=name, concurrency_share=share)
        for name, share in session.exec(
            select(Tenant.name, Tenant.concurrency_share).order_by(col(Tenant.name))
        )
    ]
    # Columns, not rows: no ORM object per key (thousands of keys, read every poll).
    rows = session.execute(
        sa.select(
            col(ClientKey.id),
            col(ClientKey.name),
            col(Tenant.name),
            col(ClientKey.requests_per_minute),
            col(ClientKey.tokens_per_minute),
        )
        .join(Tenant, col(Tenant.id) == col(ClientKey.tenant_id))
        .where(_active_clause(now))
        .order_by(col(ClientKey.id))
    ).all()
    hashes = _unrevoked_hashes(session)
    keys = [
        CallerKey(
            id=key_id,
            hash=hashes[key_id],
            tenant=tenant,
            name=name,
            requests_per_minute=rpm,
            tokens_per_minute=tpm,
        )
        for key_id, name, tenant, rpm, tpm in rows
        if key_id in hashes  # (revoked between the reads: left out)
    ]
    return CallersTable(tenants=tenants, keys=keys)


def _unrevoked_hashes(session: Session) -> dict[int, str]:
    """Key id → hash of every unrevoked key, read on the session's connection with a plain
    DBAPI cursor: SQLAlchemy logs result rows at DEBUG, and these must stay out of any log."""
    cursor = session.connection().connection.cursor()
    try:
        cursor.execute("SELECT id, key_hash FROM client_key WHERE revoked_at IS NULL")
        return {int(key_id): str(key_hash) for key_id, key_hash in cursor.fetchall()}
    finally:
        cursor.close()
