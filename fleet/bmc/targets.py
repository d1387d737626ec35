"""From a server row to a BmcTarget: the one place a BMC password is decrypted."""

from __future__ import annotations

from dataclasses import replace

from fleet.bmc.base import BmcRefused, BmcTarget, Timeouts
from fleet.crypto import SecretBox
from fleet.inventory.servers import has_bmc_password
from fleet.models import BmcProtocol, Server
from fleet.settings import Settings


def timeouts_from(settings: Settings) -> Timeouts:
    return Timeouts(
        call=settings.bmc_call_timeout_s,
        total=settings.bmc_total_timeout_s,
        attempts=settings.bmc_attempts,
        backoff=settings.bmc_backoff_s,
    )


def target_for(server: Server, box: SecretBox, settings: Settings) -> BmcTarget:
    """The server's BMC with its password; BmcRefused (nothing sent) when none is stored."""
    target = BmcTarget(
        server=server.name,
        protocol=BmcProtocol(server.bmc_protocol),
        address=server.bmc_address,
        port=server.bmc_port,
        username=server.bmc_username,
        password="",
        system_id=server.bmc_system_id,
        verify_tls=settings.bmc_verify_tls,
        ca_bundle=str(settings.bmc_ca_bundle) if settings.bmc_ca_bundle else None,
        timeouts=timeouts_from(settings),
        plain_http=server.bmc_plain_http,
    )
    if not has_bmc_password(server):
        # Dropped when the BMC endpoint changed: never try the new endpoint without one.
        raise BmcRefused(
            target,
            f"no BMC password for {server.name}: set one (admin) with PATCH "
            f'/api/v1/servers/{server.name} {{"bmc_password": …}} or an inventory import '
            "(it was dropped when the BMC endpoint changed; nothing was sent)",
        )
    return replace(target, password=box.decrypt(server.bmc_password_encrypted))
