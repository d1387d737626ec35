"""Server queries and operator edits (state changes go through fleet.lifecycle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.errors import ConflictError, NotFoundError
from fleet.events import record_update, set_fields
from fleet.models import (
    Gpu,
    GpuPublic,
    Pool,
    Rack,
    Server,
    ServerPublic,
    ServerUpdate,
    Site,
)
from fleet.states import ServerState


@dataclass(frozen=True, slots=True)
class ServerFilter:
    site: str | None = None
    rack: str | None = None
    pool: Pool | None = None
    state: ServerState | None = None
    gpu_model: str | None = None


def _with_place() -> Any:
    """Servers with their rack and site names."""
    return (
        select(Server, Rack.name, Site.name)
        .select_from(Server)
        .join(Rack, col(Rack.id) == Server.rack_id)
        .join(Site, col(Site.id) == Rack.site_id)
    )


def _public(server: Server, rack: str, site: str) -> ServerPublic:
    data = server.model_dump(exclude={"bmc_password_encrypted", "id", "rack_id"})
    return ServerPublic(
        **data, rack=rack, site=site, bmc_password_set=bool(server.bmc_password_encrypted)
    )


def list_servers(
    session: Session, where: ServerFilter, limit: int, offset: int
) -> tuple[int, list[ServerPublic]]:
    conditions: list[Any] = []
    if where.pool is not None:
        conditions.append(Server.pool == where.pool)
    if where.state is not None:
        conditions.append(Server.state == where.state)
    if where.gpu_model is not None:
        conditions.append(Server.gpu_model == where.gpu_model)
    # Site and rack filters need the joins; the others (and the count) do without them.
    ids = sa.select(col(Server.id), col(Server.name)).select_from(Server)
    if where.site is not None or where.rack is not None:
        ids = ids.join(Rack, col(Rack.id) == Server.rack_id)
        if where.site is not None:
            ids = ids.join(Site, col(Site.id) == Rack.site_id)
            conditions.append(Site.name == where.site)
        if where.rack is not None:
            conditions.append(Rack.name == where.rack)
    ids = ids.where(*conditions)
    conn = session.connection()
    count = conn.execute(sa.select(sa.func.count()).select_from(ids.subquery())).scalar_one()
    # Page over (id, name) only, then load the wide rows of that page: sorting whole server
    # rows for a deep OFFSET spills to disk on Postgres.
    page = ids.order_by(col(Server.name)).limit(limit).offset(offset).subquery()
    rows = session.exec(_with_place().join(page, page.c.id == Server.id).order_by(col(Server.name)))
    return count, [_public(s, rack, site) for s, rack, site in rows]


def get_server(session: Session, name: str) -> ServerPublic:
    row = session.exec(_with_place().where(Server.name == name)).one_or_none()
    if row is None:
        raise NotFoundError(f"no server named {name!r}")
    return _public(*row)


def list_gpus(
    session: Session, server: str | None, limit: int, offset: int
) -> tuple[int, list[GpuPublic]]:
    query = select(Gpu, Server.name).select_from(Gpu).join(Server, col(Server.id) == Gpu.server_id)
    if server is not None:
        if session.exec(select(Server.id).where(Server.name == server)).first() is None:
            raise NotFoundError(f"no server named {server!r}")
        query = query.where(Server.name == server)
    count = (
        session.connection()
        .execute(sa.select(sa.func.count()).select_from(query.subquery()))
        .scalar_one()
    )
    rows = session.exec(
        query.order_by(col(Server.name), col(Gpu.index)).limit(limit).offset(offset)
    )
    return count, [
        GpuPublic(**g.model_dump(exclude={"id", "server_id"}), server=s) for g, s in rows
    ]


def _check_endpoint_free(session: Session, server: Server) -> None:
    # no_autoflush: flushing the edited row first would hit the unique index before we can
    # say which server holds the endpoint.
    with session.no_autoflush:
        other = _endpoint_holder(session, server)
    if other is not None:
        raise ConflictError(
            f"{server.bmc_address}:{server.bmc_port}"
            f"{' system ' + server.bmc_system_id if server.bmc_system_id else ''} "
            f"is already the BMC of server {other!r}"
        )


def _endpoint_holder(session: Session, server: Server) -> str | None:
    return session.exec(
        select(Server.name).where(
            Server.bmc_address == server.bmc_address,
            Server.bmc_port == server.bmc_port,
            sa.func.coalesce(Server.bmc_system_id, "") == (server.bmc_system_id or ""),
            Server.id != server.id,
        )
    ).first()


def update_server(
    session: Session, name: str, update: ServerUpdate, box: SecretBox, actor: str
) -> ServerPublic:
    """Apply an operator's edit and record which fields changed (never their secret values)."""
    server = session.exec(select(Server).where(Server.name == name).with_for_update()).one_or_none()
    if server is None:
        raise NotFoundError(f"no server named {name!r}")
    changed = set_fields(server, update.model_dump(exclude_unset=True, exclude={"bmc_password"}))
    if {"bmc_address", "bmc_port", "bmc_system_id"} & set(changed):
        _check_endpoint_free(session, server)
    if update.bmc_password is not None:
        server.bmc_password_encrypted = box.encrypt(update.bmc_password.get_secret_value())
        changed.append("bmc_password")
    record_update(session, server, "server", name, changed, actor, "updated through the API")
    session.commit()
    return get_server(session, name)
