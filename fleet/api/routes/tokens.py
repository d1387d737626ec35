"""Agent tokens through the API (docs/api.md "Agent tokens"): an admin mints one per server,
lists, revokes and rotates them; any token reads its own info. A token's value is in the mint
and rotate answers only (once); no answer, event or error carries a hash."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Path, status
from pydantic import BaseModel, ConfigDict, Field

from fleet import auth
from fleet.api.deps import Admin, CurrentUser, PagingDep, SessionDep, SettingsDep
from fleet.api.responses import Page
from fleet.models import Role
from fleet.validation import INT32_MAX, OptNumber

router = APIRouter(prefix="/tokens", tags=["tokens"])

# deps.py has no admin alias: tokens are the only admin-only routes so far.
# Token ids are 32-bit on Postgres: a larger one is no token (422), not a database error.
TokenId = Annotated[int, Path(ge=1, le=INT32_MAX)]


class AgentTokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server: str = Field(min_length=1, max_length=63)
    # Seconds; default FLEET_AGENT_TOKEN_LIFETIME_S (90 days).
    expires_in_s: OptNumber = Field(default=None, gt=0, le=auth.MAX_LIFETIME.total_seconds())


class TokenPublic(BaseModel):
    """A token as lists show it: never its value or hash. `replaced_by`: the token that
    replaced a rotated one (which works until its `expires_at`)."""

    id: int
    name: str
    role: Role
    server: str | None
    created_at: datetime
    expires_at: datetime | None
    expired: bool
    revoked_at: datetime | None
    replaced_by: int | None


class MintedToken(BaseModel):
    """A new agent token: `token` is its value, shown this once (only its hash is kept)."""

    id: int
    name: str
    role: Role
    server: str | None
    expires_at: datetime | None
    token: str


def _public(info: auth.TokenInfo) -> TokenPublic:
    return TokenPublic.model_validate(dataclasses.asdict(info))


def _minted(minted: auth.Minted) -> MintedToken:
    info = minted.info
    return MintedToken(
        id=info.id,
        name=info.name,
        role=Role(info.role),
        server=info.server,
        expires_at=datetime.fromisoformat(info.expires_at) if info.expires_at else None,
        token=minted.token,
    )


@router.post("/agent", status_code=status.HTTP_201_CREATED)
def mint(
    request: AgentTokenRequest, user: Admin, session: SessionDep, settings: SettingsDep
) -> MintedToken:
    """A new agent token for `server` (the only time its value is shown). 409 while the server
    has a live one: rotate or revoke that first."""
    seconds = request.expires_in_s
    if seconds is None:
        seconds = settings.agent_token_lifetime_s
    minted = auth.mint_agent_token(
        session, request.server, timedelta(seconds=seconds), actor=user.actor
    )
    session.commit()
    return _minted(minted)


@router.get("")
def tokens(
    _: Admin,
    session: SessionDep,
    paging: PagingDep,
    server: str | None = None,
    role: Role | None = None,
    live: bool | None = None,
) -> Page[TokenPublic]:
    """Tokens by id; `live=true`: neither revoked, expired nor replaced (false: the rest)."""
    rows = auth.list_tokens(session, server=server, role=role, live=live)
    return paging.slice([_public(r) for r in rows])


@router.get("/self")
def own_token(principal: CurrentUser, session: SessionDep) -> TokenPublic:
    """The caller's own token, whatever its role (an agent checks its expiry here)."""
    return _public(auth.token_info(session, principal.token_id))


@router.delete("/{token_id:int}")
def revoke(token_id: TokenId, user: Admin, session: SessionDep) -> TokenPublic:
    """Revoke a token (any role): 401 with it from now on. Revoking twice changes nothing."""
    info = auth.revoke_token(session, token_id, actor=user.actor)
    session.commit()
    return _public(info)


@router.post("/{token_id:int}/rotate", status_code=status.HTTP_201_CREATED)
def rotate(
    token_id: TokenId, user: Admin, session: SessionDep, settings: SettingsDep
) -> MintedToken:
    """A new token for an agent token's server; the old one works until the sooner of its
    expiry and FLEET_AGENT_TOKEN_OVERLAP_S from now. 409 for a revoked, expired or already
    rotated token."""
    minted = auth.rotate_token(
        session,
        token_id,
        lifetime=timedelta(seconds=settings.agent_token_lifetime_s),
        overlap=timedelta(seconds=settings.agent_token_overlap_s),
        actor=user.actor,
    )
    session.commit()
    return _minted(minted)
