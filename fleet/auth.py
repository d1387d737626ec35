"""Bearer tokens: issued once, stored as SHA-256, checked on every API request."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from fleet.errors import FleetError, NotFoundError
from fleet.models import ApiToken, Event, Role, Server, as_utc, utcnow

TOKEN_PREFIX = "flt_"
MAX_TOKEN_NAME = 80
# Token lifetimes: `90d`, `12h`, `30m`; ten years at most (a typo must not overflow a date).
_LIFETIME = re.compile(r"^\s*([1-9][0-9]{0,6})\s*([dhm])\s*$")
_LIFETIME_UNITS = {"d": timedelta(days=1), "h": timedelta(hours=1), "m": timedelta(minutes=1)}
MAX_LIFETIME = timedelta(days=3650)
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


def parse_lifetime(text: str) -> timedelta:
    """`90d`, `12h` or `30m` -> a timedelta; FleetError naming the accepted forms otherwise."""
    match = _LIFETIME.match(text)
    if match is None:
        raise FleetError(
            f"--expires-in {text!r}: give a whole number of days, hours or minutes "
            "(e.g. 90d, 12h, 30m)"
        )
    lifetime = int(match.group(1)) * _LIFETIME_UNITS[match.group(2)]
    if lifetime > MAX_LIFETIME:
        raise FleetError(f"--expires-in {text!r}: at most {MAX_LIFETIME.days}d")
    return lifetime


def create_token(
    session: Session,
    name: str,
    role: Role,
    server: str | None = None,
    actor: str = "fleetctl",
    expires_in: timedelta | None = None,
) -> str:
    """Store a new token and return its only plaintext copy. With `expires_in`, it answers
    401 from then on, like a revoked one."""
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
    if expires_in is not None and not timedelta(0) < expires_in <= MAX_LIFETIME:
        raise FleetError(f"a token lifetime must be more than 0 and at most {MAX_LIFETIME.days}d")
    expires_at = utcnow() + expires_in if expires_in is not None else None
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiToken(
            name=name,
            role=role,
            token_hash=hash_token(token),
            server_id=server_id,
            expires_at=expires_at,
        )
    )
    until = f", expires {expires_at.isoformat(timespec='seconds')}" if expires_at else ""
    session.add(
        Event(
            subject_type="token",
            subject=name,
            actor=actor,
            kind="token.created",
            message=f"{role.value} token created{until}",
            details={
                "role": role.value,
                "server": server,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    )
    return token


def authenticate(session: Session, token: str, now: datetime | None = None) -> Principal | None:
    """The caller a token names, or None: unknown, revoked or expired (all answer 401)."""
    row = session.exec(
        select(ApiToken).where(
            ApiToken.token_hash == hash_token(token), col(ApiToken.revoked_at).is_(None)
        )
    ).one_or_none()
    if row is None or row.id is None or _expired(row.expires_at, now or utcnow()):
        return None
    return Principal(row.id, row.name, Role(row.role), row.server_id)


def _expired(expires_at: datetime | None, now: datetime) -> bool:
    return expires_at is not None and as_utc(expires_at) <= now


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: int
    name: str
    role: str
    server: str | None
    created_at: str
    revoked_at: str | None
    expires_at: str | None
    expired: bool


def list_tokens(session: Session, now: datetime | None = None) -> list[TokenInfo]:
    now = now or utcnow()
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
            expires_at=t.expires_at.isoformat() if t.expires_at else None,
            expired=_expired(t.expires_at, now),
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
