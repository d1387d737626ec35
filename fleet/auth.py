"""Bearer tokens: issued once, stored as SHA-256, checked on every API request."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy.orm import QueryableAttribute, defer
from sqlmodel import Session, col, select

from fleet.errors import ConflictError, FleetError, NotFoundError
from fleet.models import ApiToken, Event, Role, Server, as_utc, utcnow

TOKEN_PREFIX = "flt_"
MAX_TOKEN_NAME = 80
# Token lifetimes: `90d`, `12h`, `30m`; ten years at most (a typo must not overflow a date).
_LIFETIME = re.compile(r"^\s*([1-9][0-9]{0,6})\s*([dhm])\s*$")
_LIFETIME_UNITS = {"d": timedelta(days=1), "h": timedelta(hours=1), "m": timedelta(minutes=1)}
MAX_LIFETIME = timedelta(days=3650)
# Rows are read without their hash: nothing here needs it once the row is found, and so no
# result row logged at DEBUG (SQLAlchemy's) carries it.
_NO_HASH = defer(cast("QueryableAttribute[str]", ApiToken.token_hash))
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
    return _create(session, name, role, server, actor, expires_in)[1]


def _create(
    session: Session,
    name: str,
    role: Role,
    server: str | None,
    actor: str,
    expires_in: timedelta | None,
) -> tuple[ApiToken, str]:
    """The new row (flushed: it has its id) and its only plaintext copy."""
    if not 1 <= len(name) <= MAX_TOKEN_NAME:
        # Events name the caller as "<role>:<name>" in a 100-character column.
        raise FleetError(f"a token name must be 1-{MAX_TOKEN_NAME} characters")
    server_id = None
    if role is Role.AGENT:
        if server is None:
            raise FleetError("an agent token needs --server: agent tokens act for one server")
        server_id = _server(session, server).id
    elif server is not None:
        raise FleetError("--server applies only to agent tokens")
    if expires_in is not None and not timedelta(0) < expires_in <= MAX_LIFETIME:
        raise FleetError(f"a token lifetime must be more than 0 and at most {MAX_LIFETIME.days}d")
    expires_at = utcnow() + expires_in if expires_in is not None else None
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        name=name,
        role=role,
        token_hash=hash_token(token),
        server_id=server_id,
        expires_at=expires_at,
    )
    session.add(row)
    session.flush()  # the id, for the event and the caller
    until = f", expires {expires_at.isoformat(timespec='seconds')}" if expires_at else ""
    session.add(
        Event(
            subject_type="token",
            subject=name,
            actor=actor,
            kind="token.created",
            message=f"{role.value} token {row.id} created{until}",
            details={
                "id": row.id,
                "role": role.value,
                "server": server,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    )
    return row, token


def _server(session: Session, name: str, *, lock: bool = False) -> Server:
    query = select(Server).where(Server.name == name)
    row = session.exec(query.with_for_update() if lock else query).one_or_none()
    if row is None:
        raise NotFoundError(f"no server named {name!r}")
    return row


def authenticate(session: Session, token: str, now: datetime | None = None) -> Principal | None:
    """The caller a token names, or None: unknown, revoked or expired (all answer 401). A
    rotated token (`replaced_by_id` set) still answers until its shortened expiry: the overlap
    in which its agent is given the new one."""
    row = session.exec(
        select(ApiToken)
        .options(_NO_HASH)
        .where(ApiToken.token_hash == hash_token(token), col(ApiToken.revoked_at).is_(None))
    ).one_or_none()
    if row is None or row.id is None or _expired(row.expires_at, now or utcnow()):
        return None
    return Principal(row.id, row.name, Role(row.role), row.server_id)


def _expired(expires_at: datetime | None, now: datetime) -> bool:
    return expires_at is not None and as_utc(expires_at) <= now


def _live(row: ApiToken, now: datetime) -> bool:
    """Neither revoked, expired nor replaced: the token a server's agent is meant to hold."""
    return (
        row.revoked_at is None and row.replaced_by_id is None and not _expired(row.expires_at, now)
    )


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """A token as lists show it: never its value or hash."""

    id: int
    name: str
    role: str
    server: str | None
    created_at: str
    revoked_at: str | None
    expires_at: str | None
    expired: bool
    replaced_by: int | None = None


def _info(row: ApiToken, server: str | None, now: datetime) -> TokenInfo:
    return TokenInfo(
        id=row.id or 0,
        name=row.name,
        role=str(row.role),
        server=server,
        created_at=row.created_at.isoformat(),
        revoked_at=row.revoked_at.isoformat() if row.revoked_at else None,
        expires_at=row.expires_at.isoformat() if row.expires_at else None,
        expired=_expired(row.expires_at, now),
        replaced_by=row.replaced_by_id,
    )


def list_tokens(
    session: Session,
    now: datetime | None = None,
    *,
    server: str | None = None,
    role: Role | None = None,
    live: bool | None = None,
) -> list[TokenInfo]:
    """Every token, by id; or those of `server` (its agent tokens), of `role`, and live or
    not (`live`: neither revoked, expired nor replaced). An unknown server is NotFoundError."""
    now = now or utcnow()
    query = (
        select(ApiToken, Server.name)
        .select_from(ApiToken)
        .options(_NO_HASH)
        .outerjoin(Server, col(Server.id) == ApiToken.server_id)
        .order_by(col(ApiToken.id))
    )
    if server is not None:
        query = query.where(ApiToken.server_id == _server(session, server).id)
    if role is not None:
        query = query.where(ApiToken.role == role)
    return [
        _info(t, name, now)
        for t, name in session.exec(query)
        if live is None or _live(t, now) is live
    ]


def token_info(session: Session, token_id: int, now: datetime | None = None) -> TokenInfo:
    row = _token(session, token_id)
    server = session.get(Server, row.server_id) if row.server_id is not None else None
    return _info(row, server.name if server else None, now or utcnow())


def _token(session: Session, token_id: int, *, lock: bool = False) -> ApiToken:
    query = select(ApiToken).options(_NO_HASH).where(ApiToken.id == token_id)
    row = session.exec(query.with_for_update() if lock else query).one_or_none()
    if row is None:
        raise NotFoundError(f"no token with id {token_id} (see `fleetctl token list`)")
    return row


def revoke_token(session: Session, token_id: int, actor: str = "fleetctl") -> TokenInfo:
    """Revoke by id (names need not be unique); revoking twice is a no-op."""
    row = _token(session, token_id, lock=True)
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
                details={"id": token_id},
            )
        )
        session.flush()
    return token_info(session, token_id)


# ---------------------------------------------------------------------------------------------
# Agent tokens through the API (fleet/api/routes/tokens.py): one live token per server, rotated
# with an overlap so that an agent is never left without a working one.


class NotAnAgentToken(ConflictError):
    """Rotation is for agent tokens; people and routers get a new token and revoke the old.
    A 409: the request is well formed, the token it names is of another kind."""


@dataclass(frozen=True, slots=True)
class Minted:
    """A new token: its info and its only plaintext copy."""

    info: TokenInfo
    token: str


def agent_token_name(server: str) -> str:
    return f"agent-{server}"[:MAX_TOKEN_NAME]


def mint_agent_token(
    session: Session, server: str, lifetime: timedelta, actor: str = "fleetctl"
) -> Minted:
    """A new agent token for `server`, living `lifetime`. ConflictError while the server has a
    live one (the caller rotates or revokes it first): one working token per agent."""
    row = _server(session, server, lock=True)  # two mints for one server: one waits
    now = utcnow()
    held = session.exec(
        select(ApiToken)
        .options(_NO_HASH)
        .where(ApiToken.server_id == row.id, ApiToken.role == Role.AGENT)
        .order_by(col(ApiToken.id))
    ).all()
    live = [t.id for t in held if _live(t, now)]
    if live:
        raise ConflictError(
            f"server {server!r} already has a live agent token (id {live[0]}): rotate it "
            f"(`fleetctl agent-tokens rotate {live[0]}`) or revoke it first"
        )
    token, plaintext = _create(
        session, agent_token_name(server), Role.AGENT, server, actor, lifetime
    )
    return Minted(_info(token, server, now), plaintext)


def rotate_token(
    session: Session,
    token_id: int,
    lifetime: timedelta,
    overlap: timedelta,
    actor: str = "fleetctl",
) -> Minted:
    """A new token for the agent token `token_id`'s server; the old one keeps answering until
    min(its expiry, now + `overlap`), time for the agent to be given the new one."""
    old = _token(session, token_id, lock=True)  # two rotations of one token: one waits
    if old.role is not Role.AGENT or old.server_id is None:
        raise NotAnAgentToken(
            f"token {token_id} is {'an' if str(old.role)[0] in 'aeiou' else 'a'} {old.role} token: "
            "rotate applies to agent tokens "
            "(create a new one with `fleetctl token create` and revoke this one)"
        )
    if old.revoked_at is not None:
        raise ConflictError(
            f"token {token_id} is revoked: mint a new agent token instead (`fleetctl "
            "agent-tokens mint SERVER`)"
        )
    if old.replaced_by_id is not None:
        raise ConflictError(
            f"token {token_id} was already rotated: rotate its successor (id "
            f"{old.replaced_by_id}) instead"
        )
    now = utcnow()
    if _expired(old.expires_at, now):
        raise ConflictError(
            f"token {token_id} has expired: mint a new agent token instead (`fleetctl "
            "agent-tokens mint SERVER`)"
        )
    # The server's row too, as a mint takes it: a mint and a rotation for one server queue.
    server = session.exec(select(Server).where(Server.id == old.server_id).with_for_update()).one()
    new, plaintext = _create(
        session, agent_token_name(server.name), Role.AGENT, server.name, actor, lifetime
    )
    until = now + overlap
    if old.expires_at is None or as_utc(old.expires_at) > until:
        old.expires_at = until
    old.replaced_by_id = new.id
    session.add(old)
    assert old.expires_at is not None
    session.add(
        Event(
            subject_type="token",
            subject=old.name,
            actor=actor,
            kind="token.rotated",
            message=(
                f"agent token {token_id} of {server.name} replaced by token {new.id}; it "
                f"works until {as_utc(old.expires_at).isoformat(timespec='seconds')}"
            ),
            details={
                "id": token_id,
                "server": server.name,
                "replaced_by": new.id,
                "old_expires_at": as_utc(old.expires_at).isoformat(),
            },
        )
    )
    session.flush()
    return Minted(_info(new, server.name, now), plaintext)
