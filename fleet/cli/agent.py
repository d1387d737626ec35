"""`fleetctl agent run`: the node agent that runs on every GPU server (fleet_agent/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli.common import (
    CliError,
    handled,
    typer_app,
)

agent_app = typer_app("The node agent that runs on every GPU server.")


@agent_app.command("run")
@handled
def agent_run(
    server: Annotated[
        str | None, typer.Option(help="This server's inventory name [FLEET_AGENT_SERVER].")
    ] = None,
    fleet_url: Annotated[
        str | None, typer.Option("--fleet-url", help="[FLEET_AGENT_FLEET_URL]")
    ] = None,
    telemetry: Annotated[
        str | None,
        typer.Option(help="nvml, dcgm or simulated (a stand-in) [FLEET_AGENT_TELEMETRY]."),
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Local API port [FLEET_AGENT_LISTEN_PORT].")
    ] = None,
    fault_file: Annotated[
        Path | None,
        typer.Option("--fault-file", help="Simulated backend: faults to inject (JSON)."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option("--tls-cert", help="Local API https [FLEET_AGENT_TLS_CERT].")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option("--tls-key", help="Its key [FLEET_AGENT_TLS_KEY].")
    ] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(
            "--tls-client-ca", help="Require client certs from this CA [FLEET_AGENT_TLS_CLIENT_CA]."
        ),
    ] = None,
    ca_bundle: Annotated[
        Path | None,
        typer.Option("--ca-bundle", help="Verify the fleet against [FLEET_AGENT_CA_BUNDLE]."),
    ] = None,
) -> None:
    """Run the agent (token from FLEET_AGENT_TOKEN or FLEET_AGENT_TOKEN_FILE; every setting as
    FLEET_AGENT_*)."""
    import logging

    from fleet_agent.config import AgentSettings
    from fleet_agent.main import run
    from fleet_core.telemetry import TelemetryUnavailable

    given = {
        "server": server,
        "fleet_url": fleet_url,
        "telemetry": telemetry,
        "listen_port": port,
        "sim_fault_file": fault_file,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "tls_client_ca": tls_client_ca,
        "ca_bundle": ca_bundle,
    }
    # Options given win over FLEET_AGENT_* (BaseSettings reads the environment for the rest).
    options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    settings = AgentSettings(**options)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(settings)
    except TelemetryUnavailable as exc:
        raise CliError(str(exc)) from exc
