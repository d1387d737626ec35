"""Server queries and operator edits (state changes go through fleet.lifecycle.transitions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from sqlmodel import Session, col, select

from fleet.catalog.refs import server_version_id
from fleet.crypto import SecretBox
from fleet.errors import ConflictError, ForbiddenError, NotFoundError
from fleet.events import record_update, set_fields
from fleet.lifecycle.states import ServerState
from fleet.models import (
    Deployment,
    Event,
    Gpu,
    GpuPublic,
    ModelVersion,
    Pool,
    Rack,
    Server,
    ServerPublic,
    ServerUpdate,
    Site,
    Verdict,
    utcnow,
)
from fleet_core.weights import version_key
from fleet_core.wire import GpuReading

# ---------------------------------------------------------------------------------------------
# BMC credentials stay with the BMC they were given for (docs/design.md)

# The stored ciphertext of a server without a BMC password: dropped when its BMC endpoint
# changed with no new password (a Fernet token is never empty; the column is NOT NULL).
NO_PASSWORD = ""
# What only an admin may change: the credentials themselves (and the pinned SSH host key:
# update_server).
CREDENTIAL_FIELDS = ("bmc_username", "bmc_password")


def has_bmc_password(server: Server | sa.Row[Any]) -> bool:
    return server.bmc_password_encrypted != NO_PASSWORD


@dataclass(frozen=True, slots=True)
class BmcEndpoint:
    """Where a server's BMC password is sent."""

    protocol: str
    address: str
    port: int
    system_id: str | None
    plain_http: bool

    @classmethod
    def of(cls, row: Any) -> BmcEndpoint:
        """From anything with the `bmc_*` fields (a Server, a ServerCreate)."""
        return cls(
            str(row.bmc_protocol),
            row.bmc_address,
            row.bmc_port,
            row.bmc_system_id,
            bool(row.bmc_plain_http),
        )

    def moved_from(self, old: BmcEndpoint) -> bool:
        """Would the stored password now go somewhere else, or in clear where it did not?
        (Turning plain HTTP off only adds TLS.)"""
        elsewhere = (self.protocol, self.address, self.port, self.system_id) != (
            old.protocol,
            old.address,
            old.port,
            old.system_id,
        )
        return elsewhere or (self.plain_http and not old.plain_http)

    def describe(self) -> str:
        system = f" system {self.system_id}" if self.system_id else ""
        plain = " (plain HTTP)" if self.plain_http else ""
        return f"{self.protocol} {self.address}:{self.port}{system}{plain}"


def record_endpoint_change(
    session: Session,
    server: Server,
    fields: list[str],
    actor: str,
    message: str,
    moved: tuple[BmcEndpoint, BmcEndpoint],
    password: str,
    at: datetime | None = None,
) -> None:
    """Like `record_update`, for an edit that moved the BMC endpoint: the event also names
    both endpoints and what became of the stored password ("kept", "replaced", "dropped",
    "none"), never its value."""
    before, after = moved
    now = at or utcnow()
    server.updated_at = now
    session.add(server)
    note = {
        "dropped": "; its stored BMC password was dropped (an admin sets a new one)",
        "none": "; it has no BMC password (an admin sets one)",
    }.get(password, "")
    session.add(
        Event(
            at=now,
            subject_type="server",
            subject=server.name,
            actor=actor,
            kind="server.updated",
            message=f"{message}: BMC endpoint {before.describe()} -> {after.describe()}{note}",
            details={
                "fields": fields,
                "bmc_endpoint": {"from": before.describe(), "to": after.describe()},
                "bmc_password": password,
            },
        )
    )


@dataclass(frozen=True, slots=True)
class ServerFilter:
    site: str | None = None
    rack: str | None = None
    pool: Pool | None = None
    state: ServerState | None = None
    gpu_model: str | None = None
    deployment: str | None = None  # the deployment it serves (by name)
    health: Verdict | None = None  # the agent's last verdict


def _with_place() -> Any:
    """Servers with their rack and site names, the deployment they serve (if any) and its
    model version."""
    return (
        select(Server, Rack.name, Site.name, Deployment)
        .select_from(Server)
        .join(Rack, col(Rack.id) == Server.rack_id)
        .join(Site, col(Site.id) == Rack.site_id)
        .outerjoin(Deployment, col(Deployment.id) == Server.deployment_id)
    )


def _version_keys(session: Session, rows: list[Any]) -> dict[int, str]:
    """ "<model>@<version>" of each version the rows' servers serve (their own or their
    deployment's: fleet.catalog.refs.server_version_id)."""
    ids = {server_version_id(server, deployment) for server, *_, deployment in rows}
    ids.discard(None)
    if not ids:
        return {}
    query = select(ModelVersion).where(col(ModelVersion.id).in_(ids))
    return {v.id: version_key(v.model, v.version) for v in session.exec(query) if v.id}


def _public(
    keys: dict[int, str],
    server: Server,
    rack: str,
    site: str,
    deployment: Deployment | None,
) -> ServerPublic:
    # The GPUs' readings are shown with the GPUs (list_gpus), not on every server of a list.
    data = server.model_dump(
        exclude={"bmc_password_encrypted", "id", "rack_id", "deployment_id", "gpu_telemetry"}
    )
    version = server_version_id(server, deployment)
    return ServerPublic(
        **data,
        rack=rack,
        site=site,
        deployment=deployment.name if deployment is not None else None,
        bmc_password_set=has_bmc_password(server),
        model_version=keys.get(version) if version is not None else None,
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
    if where.health is not None:
        conditions.append(Server.health_verdict == where.health)
    if where.deployment is not None:
        serving = sa.select(col(Deployment.id)).where(col(Deployment.name) == where.deployment)
        conditions.append(col(Server.deployment_id).in_(serving.scalar_subquery()))
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
    rows = list(
        session.exec(_with_place().join(page, page.c.id == Server.id).order_by(col(Server.name)))
    )
    keys = _version_keys(session, rows)
    return count, [_public(keys, *row) for row in rows]


def get_server(session: Session, name: str) -> ServerPublic:
    row = session.exec(_with_place().where(Server.name == name)).one_or_none()
    if row is None:
        raise NotFoundError(f"no server named {name!r}")
    return _public(_version_keys(session, [row]), *row)


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
    ).all()
    # Each server's readings once for the page (a server has up to 8 GPUs: joined, its JSON
    # would travel and be decoded once per GPU row).
    server_ids = {g.server_id for g, _ in rows}
    telemetry = dict(
        session.exec(
            select(Server.id, Server.gpu_telemetry).where(col(Server.id).in_(server_ids))
        ).all()
    )
    return count, [
        GpuPublic(
            **g.model_dump(exclude={"id", "server_id"}),
            server=s,
            reading=_reading(telemetry.get(g.server_id), g.index),
        )
        for g, s in rows
    ]


def _reading(readings: Sequence[Any] | None, index: int) -> GpuReading | None:
    """GPU `index`'s reading in its server's last heartbeat; None when it had none, or one
    this fleet cannot read (stored by another version: left out, not an error)."""
    for reading in readings or ():
        if isinstance(reading, dict) and reading.get("index") == index:
            try:
                return GpuReading.model_validate(reading)
            except ValidationError:
                return None
    return None


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
    session: Session,
    name: str,
    update: ServerUpdate,
    box: SecretBox,
    actor: str,
    *,
    credentials_allowed: bool = True,
) -> ServerPublic:
    """Apply an operator's edit and record which fields changed (never their secret values).

    A new BMC endpoint (protocol, address, port, system id, or plain HTTP turned on) drops the
    stored password unless this edit brings a new one: a password goes only to the BMC it was
    given for. Changing the credentials themselves, or the pinned SSH host key, needs
    `credentials_allowed` (admins). A new SSH address keeps the pin (the host is the same; a
    different one is refused when its key does not match)."""
    credentials = [f for f in CREDENTIAL_FIELDS if f in update.model_fields_set]
    if credentials and not credentials_allowed:
        raise ForbiddenError(
            f"changing BMC credentials ({', '.join(credentials)}) needs the admin role; "
            "leave them out (a new BMC address drops the stored password; an admin sets one)"
        )
    if "ssh_host_key" in update.model_fields_set and not credentials_allowed:
        raise ForbiddenError(
            "pinning or dropping an SSH host key (ssh_host_key) needs the admin role "
            "(`fleetctl servers ssh-trust` records the key a server offers)"
        )
    server = session.exec(select(Server).where(Server.name == name).with_for_update()).one_or_none()
    if server is None:
        raise NotFoundError(f"no server named {name!r}")
    before = BmcEndpoint.of(server)
    changed = set_fields(server, update.model_dump(exclude_unset=True, exclude={"bmc_password"}))
    if {"bmc_address", "bmc_port", "bmc_system_id"} & set(changed):
        _check_endpoint_free(session, server)
    after = BmcEndpoint.of(server)
    moved = after.moved_from(before)
    password = "kept" if has_bmc_password(server) else "none"
    if update.bmc_password is not None:
        server.bmc_password_encrypted = box.encrypt(update.bmc_password.get_secret_value())
        changed.append("bmc_password")
        password = "replaced"
    elif moved and has_bmc_password(server):
        server.bmc_password_encrypted = NO_PASSWORD
        changed.append("bmc_password")
        password = "dropped"
    message = "updated through the API"
    if moved:
        record_endpoint_change(session, server, changed, actor, message, (before, after), password)
    else:
        record_update(session, server, "server", name, changed, actor, message)
    session.commit()
    return get_server(session, name)
