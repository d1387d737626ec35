"""`fleetctl servers ssh-trust`: pin the host key a server offers now, on an admin's word. The
only way a key is learnt from the network; a different key already pinned is refused (an admin
drops the pin first, `PATCH /servers/{name}` ssh_host_key null, after checking the host)."""

from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import select

from fleet.db import session_scope
from fleet.errors import ConflictError, NotFoundError
from fleet.models import Event, Server, utcnow
from fleet.settings import Settings
from fleet.ssh.client import target_for
from fleet.ssh.hostkeys import HostKeyMismatch, fingerprint, scan


def trust(engine: Engine, name: str, settings: Settings, actor: str) -> str:
    """Read the key the server offers (no login) and pin it unless one is pinned already;
    returns the pinned fingerprint. HostKeyMismatch when another key is pinned; SshError when
    the server cannot be reached."""
    with session_scope(engine) as session:
        server = session.exec(select(Server).where(Server.name == name)).one_or_none()
        if server is None:
            raise NotFoundError(f"no server named {name!r}")
        if not server.ssh_address:  # the fleet's record, not the server, is wrong: 409
            raise ConflictError(
                f"server {name}: no SSH address: set ssh.address in the inventory or "
                f"`PATCH /servers/{name}` ssh_address"
            )
        target = target_for(server)
    # No transaction while the server answers.
    offered = fingerprint(
        scan(target.address, target.port, settings.ssh_connect_timeout_s, server=name)
    )
    with session_scope(engine) as session:
        server = session.exec(
            select(Server).where(Server.name == name).with_for_update()
        ).one_or_none()
        if server is None:
            raise NotFoundError(f"no server named {name!r}")
        pinned = server.ssh_host_key
        if pinned is not None and pinned != offered:
            raise HostKeyMismatch(name, pinned, offered)
        if pinned == offered:
            return offered
        if (server.ssh_address, server.ssh_port) != (target.address, target.port):
            # Moved while we asked: what we read is not this server's key any more.
            raise ConflictError(
                f"server {name}: its SSH address changed while its host key was read: "
                "run ssh-trust again"
            )
        now = utcnow()
        server.ssh_host_key, server.updated_at = offered, now
        session.add(server)
        session.add(
            Event(
                at=now,
                subject_type="server",
                subject=name,
                actor=actor,
                kind="server.ssh_trusted",
                message=(
                    f"SSH host key {offered} pinned on first contact with "
                    f"{target.address}:{target.port}"
                ),
                details={"fields": ["ssh_host_key"], "host_key": offered},
            )
        )
    return offered
