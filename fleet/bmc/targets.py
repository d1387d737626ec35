"""From a server row to a BmcTarget: the one place a BMC password is decrypted."""

from __future__ import annotations

from fleet.bmc.base import BmcTarget, Timeouts
from fleet.crypto import SecretBox
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
    return BmcTarget(
        server=server.name,
        protocol=BmcProtocol(server.bmc_protocol),
        address=server.bmc_address,
        port=server.bmc_port,
        username=server.bmc_username,
        password=box.decrypt(server.bmc_password_encrypted),
        system_id=server.bmc_system_id,
        verify_tls=settings.bmc_verify_tls,
        ca_bundle=str(settings.bmc_ca_bundle) if settings.bmc_ca_bundle else None,
        timeouts=timeouts_from(settings),
    )
