"""`fleetctl serve`: the fleet service (API, health, metrics) under uvicorn, with a bounded
shutdown."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli.common import (
    CliError,
    handled,
    load_settings,
)
from fleet.cli.inventory import print_report


@handled
def serve(
    host: Annotated[str | None, typer.Option(help="Listen address [FLEET_LISTEN_HOST].")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port [FLEET_LISTEN_PORT].")] = None,
    import_file: Annotated[
        Path | None, typer.Option("--import", help="Import this inventory file first.")
    ] = None,
    admin_token: Annotated[
        bool, typer.Option("--admin-token", help="Create an admin token and print it.")
    ] = False,
    tls_cert: Annotated[
        Path | None, typer.Option("--tls-cert", help="Serve https: certificate [FLEET_TLS_CERT].")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option("--tls-key", help="Serve https: its key [FLEET_TLS_KEY].")
    ] = None,
) -> None:
    """Run the fleet service (API, health, metrics)."""
    import logging

    import uvicorn

    from fleet import db
    from fleet.api import create_app
    from fleet.auth import create_token
    from fleet.inventory import import_inventory
    from fleet.inventory.schema import parse_inventory
    from fleet.models import Role
    from fleet.tls import check_server_pair, client_context

    settings = load_settings()
    # TLS files that do not load are refused before the database is touched (and the fleet's
    # client certificate for agents now, rather than at every probe).
    tls_cert, tls_key = tls_cert or settings.tls_cert, tls_key or settings.tls_key
    if (tls_cert is None) != (tls_key is None):
        raise CliError("--tls-cert and --tls-key go together (FLEET_TLS_CERT, FLEET_TLS_KEY)")
    if tls_cert is not None and tls_key is not None:
        check_server_pair(tls_cert, tls_key)
    if settings.tls_ca_bundle is not None or settings.tls_client_cert is not None:
        client_context(settings.tls_ca_bundle, settings.tls_client_cert, settings.tls_client_key)
    scheme = "https" if tls_cert is not None else "http"
    # Before logging is set up, so that a refusal (un-migrated database, missing key) is one line.
    app_ = create_app(settings)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    # The DMTF redfish library logs every request attempt at INFO: our own lines say more.
    logging.getLogger("redfish").setLevel(max(logging.WARNING, logging.root.level))
    host, port = host or settings.listen_host, port or settings.listen_port
    engine = app_.state.engine
    if import_file is not None:
        inv = parse_inventory(import_file.read_bytes())
        with db.session_scope(engine) as session:
            report = import_inventory(session, inv, app_.state.box, "fleetctl:serve")
        print_report(report.model_dump(), import_file)
    where = (
        "embedded SQLite at " + str(settings.data_dir / "fleet.db")
        if settings.is_embedded
        else "database from FLEET_DATABASE_URL"
    )
    typer.echo(f"Fleet {_version()} serving at {scheme}://{host}:{port}  ({where})")
    if admin_token:
        with db.session_scope(engine) as session:
            token = create_token(session, "serve-admin", Role.ADMIN, actor="fleetctl:serve")
        typer.echo(f"admin token: {token}")
        typer.echo(
            f"try:  export FLEET_URL={scheme}://{host}:{port} FLEET_TOKEN={token}; fleetctl racks"
        )
    config = uvicorn.Config(
        app_,
        host=host,
        port=port,
        log_level=settings.log_level.lower(),
        access_log=False,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        # SIGTERM: in-flight requests get this long, then the lifespan stops the loops.
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    serve_bounded(config, settings.shutdown_timeout_s)


def serve_bounded(config: Any, timeout_s: float) -> None:
    """uvicorn's server with a watchdog from the first SIGTERM/SIGINT: a shutdown still running
    `timeout_s` later (a request stuck in a worker thread, a loop in a BMC call) ends with
    `os._exit(1)`, so that the process always ends within the bound."""
    import gc
    import os
    import threading
    from types import FrameType

    import uvicorn

    def watchdog() -> None:
        time.sleep(timeout_s)
        os.write(2, f"fleet: shutdown still running after {timeout_s:g} s: exiting\n".encode())
        os._exit(1)

    class BoundedServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                threading.Thread(target=watchdog, name="shutdown-watchdog", daemon=True).start()
            super().handle_exit(sig, frame)

    # Fewer, cheaper garbage collections: a full one walks every object with the GIL held,
    # stalling the event loop (and /healthz) for 100-250 ms under load; what start-up built
    # never becomes garbage (bench/heartbeats.py measures the difference).
    gc.set_threshold(50_000, 20, 100)
    gc.freeze()
    server = BoundedServer(config)
    server.run()
    if not server.started:
        raise SystemExit(3)  # what uvicorn.run exits with when startup fails


def _version() -> str:
    import fleet

    return fleet.__version__
