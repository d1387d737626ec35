"""Bearer tokens: issued once, stored as SHA-256, checked on every API request."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlmodel import Session, col, select

from fleet.errors import FleetError, NotFoundError
from fleet.models import ApiToken, Event, Role, Server, utcnow

TOKEN_PREFIX = "flt_"
MAX_TOKEN_NAME = 80
# Who may do what: each role includes the ones after it. Agents are outside this ladder: their
# tokens only reach the agent endpoints, for their own server.
_RANK = {Role.ADMIN: 4, Role.OPERATOR: 3, Role.ROUTER: 2, Role.VIEWER: 1, Role.AGENT: 0}


@dataclass(frozen=True, slots=True)
class Principal:
    token_id: int
    name: str
    role: Role
    server_id: int | None = None

    def may(self, needed: Role) -> bool:
        if needed is Role.AGENT or self.role is Role.AGENT:
            return self.role is needed
        return _RANK[self.role] >= _RANK[needed]

    @property
    def actor(self) -> str:
        """How events name this caller."""
        return f"{self.role.value}:{self.name}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    session: Session, name: str, role: Role, server: str | None = None, actor: str = "fleetctl"
) -> str:
    """Store a new token and return its only plaintext copy."""
    if not 1 <= len(name) <= MAX_TOKEN_NAME:
        # Events name the caller as "<role>:<name>" in a 100-character column.
        raise FleetError(f"a token name must be 1-{MAX_TOKEN_NAME} characters")
    server_id = None
    if role is Role.AGENT:
        if server is None:
            raise FleetError("an agent token needs --server: agent tokens act for one server")
        row = session.exec(select(Server).where(Server.name == server)).one_or_none()
        if row is None:
            raise NotFoundError(f"no server named {server!r}")
        server_id = row.id
    elif server is not None:
        raise FleetError("--server applies only to agent tokens")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, role=role, token_hash=hash_token(token), server_id=server_id))
    session.add(
        Event(
            subject_type="token",
            subject=name,
            actor=actor,
            kind="token.created",
            message=f"{role.value} token created",
            details={"role": role.value, "server": server},
        )
    )
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    row = session.exec(
        select(ApiToken).where(
            ApiToken.token_hash == hash_token(token), col(ApiToken.revoked_at).is_(None)
        )
    ).one_or_none()
    if row is None or row.id is None:
        return None
    return Principal(row.id, row.name, Role(row.role), row.server_id)


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: int
    name: str
    role: str
    server: str | None
    created_at: str
    revoked_at: str | None


def list_tokens(session: Session) -> list[TokenInfo]:
    rows = session.exec(
        select(ApiToken, Server.name)
        .select_from(ApiToken)
        .outerjoin(Server, col(Server.id) == ApiToken.server_id)
        .order_by(col(ApiToken.id))
    )
    return [
        TokenInfo(
            id=t.id or 0,
            name=t.name,
            role=str(t.role),
            server=server,
            created_at=t.created_at.isoformat(),
            revoked_at=t.revoked_at.isoformat() if t.revoked_at else None,
        )
        for t, server in rows
    ]


def revoke_token(session: Session, token_id: int, actor: str = "fleetctl") -> TokenInfo:
    """Revoke by id (names need not be unique); revoking twice is a no-op."""
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFoundError(f"no token with id {token_id} (see `fleetctl token list`)")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        session.add(
            Event(
                subject_type="token",
                subject=row.name,
                actor=actor,
                kind="token.revoked",
                message=f"{row.role} token {token_id} revoked",
            )
        )
        session.flush()
    return next(t for t in list_tokens(session) if t.id == token_id)
