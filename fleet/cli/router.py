"""`fleetctl router run`: the GPU-aware request router (fleet/router/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli.common import (
    CliError,
    handled,
    typer_app,
)

router_app = typer_app("The GPU-aware request router (OpenAI-compatible).")


@router_app.command("run")
@handled
def router_run(
    fleet_url: Annotated[
        str | None, typer.Option("--fleet-url", help="[FLEET_ROUTER_FLEET_URL]")
    ] = None,
    host: Annotated[str | None, typer.Option(help="[FLEET_ROUTER_LISTEN_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="[FLEET_ROUTER_LISTEN_PORT]")] = None,
    strategy: Annotated[
        str | None,
        typer.Option(help="Default strategy for every deployment [FLEET_ROUTER_STRATEGY]."),
    ] = None,
    table: Annotated[
        Path | None,
        typer.Option("--table", help="A routing table file instead of the fleet service."),
    ] = None,
    callers: Annotated[
        Path | None,
        typer.Option(
            "--callers",
            help="Client keys and tenants from a file, not the fleet [FLEET_ROUTER_CALLERS_FILE].",
        ),
    ] = None,
    client_auth: Annotated[
        str | None,
        typer.Option("--client-auth", help="keys (default) or none [FLEET_ROUTER_CLIENT_AUTH]."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="Router processes sharing the port [FLEET_ROUTER_WORKERS]."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option("--tls-cert", help="Serve https [FLEET_ROUTER_TLS_CERT].")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option("--tls-key", help="Its key [FLEET_ROUTER_TLS_KEY].")
    ] = None,
    ca_bundle: Annotated[
        Path | None,
        typer.Option(
            "--ca-bundle", help="Verify the fleet, agents, engines [FLEET_ROUTER_CA_BUNDLE]."
        ),
    ] = None,
) -> None:
    """Run the router (token from FLEET_ROUTER_TOKEN; every setting as FLEET_ROUTER_*)."""
    from fleet.router.config import RouterSettings
    from fleet.router.main import bind, run, server_tls

    given = {
        "fleet_url": fleet_url,
        "listen_host": host,
        "listen_port": port,
        "strategy": strategy,
        "table_file": table,
        "callers_file": callers,
        "client_auth": client_auth,
        "workers": workers,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "ca_bundle": ca_bundle,
    }
    options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    settings = RouterSettings(**options)
    if settings.table_file is None and settings.token is None:
        raise CliError(
            "no token: set FLEET_ROUTER_TOKEN (a router token; a viewer token is enough only "
            "with --client-auth none) or --table"
        )
    scheme = "https" if server_tls(settings) is not None else "http"
    sock = bind(settings)
    typer.echo(
        f"router on {scheme}://{settings.listen_host}:{sock.getsockname()[1]}, "
        f"strategy {settings.strategy}, client auth {settings.client_auth}"
        + (f", {settings.workers} workers" if settings.workers > 1 else ""),
        err=True,
    )
    run(settings, sock)
