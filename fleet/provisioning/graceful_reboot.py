"""Remediation's graceful step: ask the OS to reboot over SSH before the BMC cuts its power.

A server that remediation must reboot (fleet/provisioning/tick.py, `_drained`) boots with kind
`ssh_reboot` when `remediation_ssh_reboot` is on and the server has an SSH address. The tick
then sends `systemctl reboot` over SSH (pinned host key, fleet/ssh/) and waits for the agent to
register again, as after any boot. The boot turns into the BMC power cycle remediation did
before (kind `cycle`, the usual write-ahead path) when the SSH request fails, or when the agent
has not registered within `ssh_reboot_deadline_s` of it. Either way one Event says which:
`server.ssh_reboot` (asked over SSH) or `server.reboot_fallback` (with the reason).

A clean OS reboot flushes file systems and lets the engines stop; a power cycle does neither,
and some GPU faults clear only with it, which is why it stays the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.errors import FleetError
from fleet.models import Event, Server
from fleet.settings import Settings

log = logging.getLogger(__name__)

KIND = "ssh_reboot"
# Asks one server's OS to reboot; raises FleetError (fleet.ssh.client.SshError) saying why not.
RequestReboot = Callable[[Server, Settings], None]


def over_ssh(server: Server, settings: Settings) -> None:
    """The production request: `systemctl reboot` over SSH, host key pinned."""
    from fleet.ssh.client import request_reboot, target_for

    request_reboot(target_for(server), settings)


def wanted(server: Server, settings: Settings) -> bool:
    """Whether remediation reboots this server over SSH first."""
    return settings.remediation_ssh_reboot and bool(server.ssh_address)


def deadline_passed(server: Server, settings: Settings, now: datetime) -> bool:
    sent = server.ssh_reboot_sent_at
    return sent is not None and (now - sent).total_seconds() > settings.ssh_reboot_deadline_s


def send(
    engine: Engine, settings: Settings, names: Sequence[str], request: RequestReboot
) -> dict[str, str | None]:
    """Ask every named server's OS to reboot, at most `ssh_workers` at once (each bounded by
    the SSH timeouts): name → None when asked, else the one-line reason it could not be."""
    if not names:
        return {}
    with Session(engine) as session:
        servers = list(session.exec(select(Server).where(col(Server.name).in_(list(names)))))

    def ask(server: Server) -> str | None:
        try:
            request(server, settings)
        except FleetError as exc:
            return str(exc)
        except Exception as exc:  # a bug or a library's surprise: the BMC fallback still runs
            log.exception("%s: asking for a reboot over SSH failed", server.name)
            return f"server {server.name}: reboot over SSH failed ({type(exc).__name__})"
        return None

    with ThreadPoolExecutor(max_workers=min(settings.ssh_workers, len(servers) or 1)) as pool:
        errors = list(pool.map(ask, servers))
    return {server.name: error for server, error in zip(servers, errors, strict=True)}


def mark_sent(session: Session, server: Server, now: datetime) -> None:
    """The write-ahead mark, committed before the SSH call: a crash never asks twice (the
    deadline falls back instead)."""
    server.ssh_reboot_sent_at = now
    session.add(server)


def record_asked(session: Session, server: Server, actor: str, now: datetime) -> None:
    session.add(
        Event(
            at=now,
            subject_type="server",
            subject=server.name,
            actor=actor,
            kind="server.ssh_reboot",
            message="the OS was asked to reboot over SSH (graceful); a BMC power cycle "
            "follows if the agent is not back in time",
        )
    )


def fall_back(session: Session, server: Server, actor: str, why: str, now: datetime) -> None:
    """Turn this boot into a BMC power cycle: the tick's next `_booting` step sends it."""
    server.boot_kind = "cycle"
    server.boot_started_at = now  # the boot deadline counts from the cycle
    server.power_on_sent_at = None
    server.ssh_reboot_sent_at = None
    session.add(server)
    session.add(
        Event(
            at=now,
            subject_type="server",
            subject=server.name,
            actor=actor,
            kind="server.reboot_fallback",
            message=f"falling back to a BMC power cycle: {why}"[:500],
            details={"why": why[:500]},
        )
    )
