"""`fleetctl prometheus-config`: monitoring (fleet/observability/prometheus_config.py,
docs/metrics.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleet.cli.common import (
    DEFAULT_URL,
    Token,
    Url,
    api_client,
    handled,
)


@handled
def prometheus_config(
    out: Annotated[
        Path, typer.Option("--out", help="Directory for prometheus.yml and targets/*.json.")
    ] = Path("prometheus"),
    router: Annotated[
        list[str] | None, typer.Option("--router", help="A router's URL (repeatable).")
    ] = None,
    service: Annotated[
        list[str] | None,
        typer.Option("--service", help="A service process to scrape (repeatable; default --url)."),
    ] = None,
    scrape_interval: Annotated[
        float, typer.Option("--scrape-interval", help="Seconds between scrapes.")
    ] = 15.0,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Write a Prometheus configuration for the fleet service, every agent and the routers,
    with file-based discovery: run it again and Prometheus follows without a reload."""
    from fleet.observability.prometheus_config import build, target_group, write

    for address in [*(service or [url]), *(router or [])]:
        target_group(address)  # a mistyped URL fails here, before the API is asked
    servers = list(api_client(url, token).pages("/api/v1/servers", None))
    files = build(
        services=service or [url],
        servers=servers,
        routers=router or [],
        scrape_interval_s=scrape_interval,
    )
    for path in write(out, files):
        typer.echo(path)
