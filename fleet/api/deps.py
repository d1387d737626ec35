"""How a request gets its database session, its caller and its page: nothing else knows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from fleet.auth import Principal, authenticate
from fleet.crypto import SecretBox
from fleet.models import Role
from fleet.settings import Settings


def get_session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        try:
            yield session
        except BaseException:
            session.rollback()
            raise


SessionDep = Annotated[Session, Depends(get_session)]

_bearer = HTTPBearer(auto_error=False, description="a token from `fleetctl token create`")


def current_principal(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    unauthorized = HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        "missing or invalid bearer token (create one with `fleetctl token create`)",
        headers={"WWW-Authenticate": "Bearer"},
    )
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise unauthorized
    principal = authenticate(session, credentials.credentials)
    if principal is None:
        raise unauthorized
    return principal


CurrentUser = Annotated[Principal, Depends(current_principal)]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def require(role: Role) -> Callable[[Principal], Principal]:
    def check(principal: CurrentUser) -> Principal:
        if not principal.may(role):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"{_article(principal.role.value)} {principal.role.value} token cannot do this; "
                f"it needs the {role.value} role",
            )
        return principal

    return check


Viewer = Annotated[Principal, Depends(require(Role.VIEWER))]
Operator = Annotated[Principal, Depends(require(Role.OPERATOR))]
AgentCaller = Annotated[Principal, Depends(require(Role.AGENT))]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_box(request: Request) -> SecretBox:
    box: SecretBox = request.app.state.box
    return box


BoxDep = Annotated[SecretBox, Depends(get_box)]


@dataclass(frozen=True, slots=True)
class Paging:
    """`limit`/`offset` of a list request; `page` wraps one page, `slice` pages a full list."""

    limit: int
    offset: int
    request: Request

    def page(self, count: int, results: list[Any]) -> dict[str, Any]:
        """`{count, next, previous, results}` with absolute links to the neighbouring pages."""

        def link(offset: int) -> str:
            return str(self.request.url.include_query_params(limit=self.limit, offset=offset))

        following = self.offset + self.limit
        return {
            "count": count,
            "next": link(following) if following < count else None,
            "previous": link(max(0, self.offset - self.limit)) if self.offset > 0 else None,
            "results": results,
        }

    def slice(self, rows: list[Any]) -> dict[str, Any]:
        return self.page(len(rows), rows[self.offset : self.offset + self.limit])


# Far beyond any fleet, and within a 64-bit SQL integer on both backends.
MAX_OFFSET = 1_000_000_000


def paging(
    request: Request,
    limit: Annotated[
        int | None, Query(ge=1, description="page size (capped by the service)")
    ] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> Paging:
    settings = get_settings(request)
    size = min(settings.default_page_size if limit is None else limit, settings.max_page_size)
    return Paging(limit=size, offset=offset, request=request)


PagingDep = Annotated[Paging, Depends(paging)]
