"""How a request gets its database session, the engine, its caller and its page: nothing else
knows. Routes take them as the `Annotated` aliases below (`SessionDep`, `EngineDep`, `Viewer`,
`PagingDep`, ...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, TypeVar

import sqlalchemy as sa
from fastapi import Depends, HTTPException, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet.api import edge
from fleet.api.access import is_unavailable
from fleet.api.responses import Page
from fleet.auth import Principal
from fleet.crypto import SecretBox
from fleet.models import Role
from fleet.settings import Settings


def get_session(request: Request) -> Iterator[Session]:
    session = Session(request.app.state.engine, expire_on_commit=False)
    try:
        yield session
    except BaseException:
        session.rollback()
        raise
    finally:
        _close(session)


def _close(session: Session) -> None:
    """FastAPI closes a dependency after the answer went out. A connection the database
    dropped meanwhile (a restart, pg_terminate_backend) fails the close's ROLLBACK: that must
    not turn an answered request into a logged 500 and a keep-alive connection cut under the
    client's next request (tests/chaos/test_postgres_restart.py). The connection is
    invalidated instead (the pool opens a new one); any other error still raises."""
    try:
        session.close()
    except sa.exc.SQLAlchemyError as exc:
        if not is_unavailable(exc):
            raise
        session.invalidate()


SessionDep = Annotated[Session, Depends(get_session)]


async def get_engine(request: Request) -> Engine:
    """The service's engine, for work that opens sessions of its own and must hold no
    transaction meanwhile (power actions wait on BMCs: fleet/power/actions.py)."""
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(get_engine)]

_bearer = HTTPBearer(auto_error=False, description="a token from `fleetctl token create`")


async def current_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller the edge (fleet/api/edge.py) authenticated before the body was read: no
    second query, no worker thread. A route outside the edge's prefix checks the token here,
    the same way."""
    principal = request.scope.get("state", {}).get(edge.PRINCIPAL)
    if isinstance(principal, Principal):
        return principal
    token = credentials.credentials if credentials is not None else None
    principal = await edge.authenticate_token(request.app.state.engine, token)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, edge.UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
        )
    return principal


CurrentUser = Annotated[Principal, Depends(current_principal)]


def require(role: Role) -> Callable[[Principal], Awaitable[Principal]]:
    # async: a check this small must not take a worker thread (FastAPI runs plain functions
    # in its thread pool).
    async def check(principal: CurrentUser) -> Principal:
        if not principal.may(role):
            raise HTTPException(status.HTTP_403_FORBIDDEN, edge.role_refusal(principal, role))
        return principal

    return check


Viewer = Annotated[Principal, Depends(require(Role.VIEWER))]
Admin = Annotated[Principal, Depends(require(Role.ADMIN))]
Operator = Annotated[Principal, Depends(require(Role.OPERATOR))]
RouterCaller = Annotated[Principal, Depends(require(Role.ROUTER))]
AgentCaller = Annotated[Principal, Depends(require(Role.AGENT))]


def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


# The dependencies are async so that FastAPI does not spend a worker-thread hop on a lookup.
async def get_settings(request: Request) -> Settings:
    return app_settings(request)


SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_box(request: Request) -> SecretBox:
    box: SecretBox = request.app.state.box
    return box


BoxDep = Annotated[SecretBox, Depends(get_box)]


Row = TypeVar("Row")


@dataclass(frozen=True, slots=True)
class Paging:
    """`limit`/`offset` of a list request; `page` wraps one page, `slice` pages a full list."""

    limit: int
    offset: int
    request: Request

    def page(self, count: int, results: list[Row]) -> Page[Row]:
        """`{count, next, previous, results}` with absolute links to the neighbouring pages."""

        def link(offset: int) -> str:
            return str(self.request.url.include_query_params(limit=self.limit, offset=offset))

        following = self.offset + self.limit
        return Page(
            count=count,
            next=link(following) if following < count else None,
            previous=link(max(0, self.offset - self.limit)) if self.offset > 0 else None,
            results=results,
        )

    def slice(self, rows: list[Row]) -> Page[Row]:
        return self.page(len(rows), rows[self.offset : self.offset + self.limit])


# Far beyond any fleet, and within a 64-bit SQL integer on both backends.
MAX_OFFSET = 1_000_000_000


async def paging(
    request: Request,
    limit: Annotated[
        int | None, Query(ge=1, description="page size (capped by the service)")
    ] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> Paging:
    settings = app_settings(request)
    size = min(settings.default_page_size if limit is None else limit, settings.max_page_size)
    return Paging(limit=size, offset=offset, request=request)


PagingDep = Annotated[Paging, Depends(paging)]
