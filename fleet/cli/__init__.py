"""fleetctl: the operator's command line, a thin front over the fleet's REST API.

`serve`, `db` and `token create` work on the database directly (they start or bootstrap the
service); every other command talks to a running service at --url / FLEET_URL with
--token / FLEET_TOKEN. Errors are one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import httpx
import typer
import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text


def _typer(help: str, name: str | None = None, *, no_args_is_help: bool = True) -> typer.Typer:
    # Plain (non-rich) usage errors: one line an operator can grep, and exit code 2.
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=no_args_is_help,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        add_completion=False,
    )


app = _typer("Operate a bare-metal GPU inference fleet.", name="fleetctl")
db_app = _typer("Database schema (Alembic migrations).")
token_app = _typer("API tokens (created directly in the database).")
inventory_app = _typer("Inventory files: import, export, validate.")
servers_app = _typer("GPU servers.")
deployments_app = _typer("Deployments (served models).")
agent_app = _typer("The node agent that runs on every GPU server.")
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(inventory_app, name="inventory")
app.add_typer(servers_app, name="servers")
app.add_typer(deployments_app, name="deployments")
app.add_typer(agent_app, name="agent")

# Piped output gets a wide console so tables are not squeezed to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True)  # progress: never mixed into output a script may parse
P = ParamSpec("P")
R = TypeVar("R")


class CliError(Exception):
    """Shown as one line on stderr; exit code 1."""


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


Url = Annotated[
    str, typer.Option("--url", envvar="FLEET_URL", help="Fleet service URL.", show_default=True)
]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar="FLEET_TOKEN", help="Bearer token.", show_default=False),
]
Out = Annotated[Output, typer.Option("--output", "-o", help="table or json.")]
DEFAULT_URL = "http://127.0.0.1:8080"


def handled(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn every expected failure into one line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from pydantic import ValidationError
        from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError

        from fleet.errors import FleetError
        from fleet.settings import ConfigError
        from fleet.validation import validation_messages

        try:
            return fn(*args, **kwargs)
        except (CliError, FleetError, ConfigError, OSError) as exc:
            message = (
                str(exc) if not isinstance(exc, OSError) else f"{exc.strerror}: {exc.filename}"
            )
            _fail(message)
        except httpx.HTTPError as exc:
            _fail(_http_error(exc))
        except ValidationError as exc:  # e.g. a FLEET_* setting; never echoes the input value
            _fail("; ".join(validation_messages(exc)))
        # Unreachable database, bad credentials, a URL SQLAlchemy cannot use.
        except (OperationalError, DBAPIError, ArgumentError) as exc:
            _fail(f"cannot use the database: {_database_error(exc)}")
        except ValueError as exc:  # e.g. FLEET_SECRET_KEY is not a valid key
            _fail(_without_password(_one_line(str(exc))) or type(exc).__name__)

    return wrapper


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {_printable(message, one_line=True)}", err=True)
    raise typer.Exit(1) from None


# Text from the service or a file (event messages, reasons, warnings, errors) may hold terminal
# escape sequences (ANSI/OSC: retitle the terminal, rewrite what was printed, fake a link):
# whatever this CLI prints of it goes through _printable. JSON output escapes them instead.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(text: object, *, one_line: bool = False) -> str:
    """`text` without control characters (tab and newline kept, or made spaces: a line of
    its own must not print a second one)."""
    clean = _CONTROL.sub("", str(text))
    return clean.replace("\n", " ").replace("\t", " ") if one_line else clean


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


# A URL (scheme://…) or a libpq `password=…` pair: either may carry the database password.
_URL_OR_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*|password\s*=\s*\S+", re.I)


def _database_error(exc: Exception) -> str:
    """The driver's first line, with anything that could hold the database password removed."""
    orig = getattr(exc, "orig", None)
    text = _one_line(str(orig if orig is not None else exc)) or type(exc).__name__
    return _without_password(_URL_OR_PASSWORD.sub("<redacted>", text))


def _without_password(text: str) -> str:
    password = _database_password()
    return text.replace(password, "<redacted>") if password else text


def _database_password() -> str | None:
    try:
        from sqlalchemy.engine import make_url

        url = _settings().database_url
        return make_url(url).password if url else None
    except Exception:  # settings or URL unparsable: nothing more to redact than the regex does
        return None


def _http_error(exc: httpx.HTTPError) -> str:
    url = str(exc.request.url) if exc.request is not None else "the fleet service"
    if isinstance(exc, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return f"{url}: TLS certificate verify failed (see --ca-bundle / FLEET_CA_BUNDLE)"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach {url}: connection refused (is `fleetctl serve` running? see --url)"
    if isinstance(exc, httpx.TimeoutException):
        return f"{url}: timed out"
    return f"{url}: {exc}"


# ---------------------------------------------------------------------------------------------
# The HTTP client


# The CA bundle the service's certificate is verified against (default: the system's CAs): a
# root option, `fleetctl --ca-bundle ca.pem racks`, or FLEET_CA_BUNDLE for every command.
_ca_bundle: Path | None = None


@app.callback()
def _root(
    ca_bundle: Annotated[
        Path | None,
        typer.Option(
            "--ca-bundle",
            envvar="FLEET_CA_BUNDLE",
            help="CA certificates to verify an https:// --url against (default: the system's).",
        ),
    ] = None,
) -> None:
    global _ca_bundle
    _ca_bundle = ca_bundle


class Api:
    def __init__(self, url: str, token: str | None, timeout: float = 60.0) -> None:
        from fleet.tls import client_context

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=timeout,
            verify=client_context(_ca_bundle),
        )

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise CliError(_detail(response))
        if response.status_code == 204 or not response.content:
            return None
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def stream_lines(self, method: str, path: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """An NDJSON response, one decoded line at a time as the service sends it."""
        headers = {"Accept": "application/x-ndjson"}
        with self._client.stream(method, path, headers=headers, timeout=None, **kwargs) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise CliError(_detail(resp))
            for text in resp.iter_lines():
                if text.strip():
                    yield json.loads(text)

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def pages(self, path: str, limit: int | None, **params: Any) -> Iterator[dict[str, Any]]:
        """Rows of a paged list: `limit` rows, or all of them when limit is None."""
        seen = 0
        page = self.get(path, limit=min(limit, 1000) if limit else 1000, **params)
        while True:
            for row in page["results"]:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield row
            if not page["next"] or (limit is not None and seen >= limit):
                return
            page = self.request("GET", page["next"])


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text.strip()[:200]}"
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail
    return f"HTTP {response.status_code}: {json.dumps(body)[:300]}"


def _api(url: str, token: str | None) -> Api:
    if not token:
        raise CliError("no token: pass --token or set FLEET_TOKEN (`fleetctl token create`)")
    return Api(url, token)


# ---------------------------------------------------------------------------------------------
# Output


def _show(
    rows: Sequence[dict[str, Any]] | dict[str, Any],
    output: Output,
    columns: Sequence[tuple[str, str]] | None = None,
    title: str | None = None,
) -> None:
    if output is Output.JSON:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if isinstance(rows, dict):
        table = Table(show_header=False, title=title)
        table.add_column("field", style="bold")
        table.add_column("value")
        for key, value in rows.items():
            table.add_row(Text(_printable(key)), Text(_cell(value)))
        console.print(table)
        return
    assert columns is not None
    table = Table(title=title)
    for _, header in columns:
        justify = "right" if header.endswith(("W", "#")) else "left"
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(Text(_cell(row.get(key))) for key, _ in columns))
    console.print(table)


def _cell(value: Any) -> str:
    """A table cell's text: printable, and set as plain text (never read as rich markup)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        # Watts and seconds read as whole numbers; fractions (queue per GPU, KV use) keep
        # three significant digits.
        if value.is_integer() or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    if isinstance(value, list | dict):
        return json.dumps(value) if value else "-"
    return _printable(value)


# ---------------------------------------------------------------------------------------------
# Commands that work on the database directly


def _settings() -> Any:
    from fleet.settings import get_settings

    return get_settings()


def _engine() -> Any:
    """The database engine, migrated (embedded default) or checked to be (any other)."""
    from fleet import db
    from fleet.api.app import prepare_database

    settings = _settings()
    engine = db.engine_from_settings(settings)
    prepare_database(settings, engine)
    return engine


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
    """Run the agent (token from FLEET_AGENT_TOKEN; every setting as FLEET_AGENT_*)."""
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


router_app = _typer("The GPU-aware request router (OpenAI-compatible).")
app.add_typer(router_app, name="router")


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
        "workers": workers,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "ca_bundle": ca_bundle,
    }
    options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    settings = RouterSettings(**options)
    if settings.table_file is None and settings.token is None:
        raise CliError("no token: set FLEET_ROUTER_TOKEN (a viewer token is enough) or --table")
    scheme = "https" if server_tls(settings) is not None else "http"
    sock = bind(settings)
    typer.echo(
        f"router on {scheme}://{settings.listen_host}:{sock.getsockname()[1]}, "
        f"strategy {settings.strategy}"
        + (f", {settings.workers} workers" if settings.workers > 1 else ""),
        err=True,
    )
    run(settings, sock)


@db_app.command("upgrade")
@handled
def db_upgrade() -> None:
    """Migrate the database to the code's schema."""
    from fleet import db

    engine = db.engine_from_settings(_settings())
    before = db.current_revision(engine)
    db.upgrade(engine)
    after = db.current_revision(engine)
    typer.echo(f"database at {after}" + (f" (was {before or 'empty'})" if before != after else ""))


@db_app.command("current")
@handled
def db_current() -> None:
    """Show the schema revision of the database and of the code."""
    from fleet import db

    engine = db.engine_from_settings(_settings())
    typer.echo(f"database: {db.current_revision(engine) or 'empty'}  code: {db.head_revision()}")


@app.command("secret-key")
def secret_key() -> None:
    """Print a new key for FLEET_SECRET_KEY (encrypts BMC credentials at rest)."""
    from cryptography.fernet import Fernet

    typer.echo(Fernet.generate_key().decode())


@token_app.command("create")
@handled
def token_create(
    role: Annotated[str, typer.Option("--role", help="admin, operator, router, viewer or agent")],
    name: Annotated[str | None, typer.Option("--name", help="Who or what holds it.")] = None,
    server: Annotated[
        str | None, typer.Option("--server", help="Agent tokens: the server.")
    ] = None,
    expires_in: Annotated[
        str | None,
        typer.Option("--expires-in", help="Lifetime: 90d, 12h or 30m (default: never expires)."),
    ] = None,
) -> None:
    """Create a token and print it (the only time it is shown)."""
    from fleet.auth import create_token, parse_lifetime
    from fleet.db import session_scope
    from fleet.models import Role

    try:
        parsed = Role(role)
    except ValueError:
        raise CliError(f"--role must be one of {', '.join(r.value for r in Role)}") from None
    lifetime = parse_lifetime(expires_in) if expires_in is not None else None
    with session_scope(_engine()) as session:
        token = create_token(
            session, name or f"{parsed.value}-token", parsed, server, expires_in=lifetime
        )
    typer.echo(token)


TOKEN_COLUMNS = [
    ("id", "id"),
    ("name", "name"),
    ("role", "role"),
    ("server", "server"),
    ("created_at", "created"),
    ("expires_at", "expires"),
    ("expired", "expired"),
    ("revoked_at", "revoked"),
]


@token_app.command("list")
@handled
def token_list(output: Out = Output.TABLE) -> None:
    """List tokens (never their values: only hashes are stored)."""
    import dataclasses

    from fleet.auth import list_tokens
    from fleet.db import session_scope

    with session_scope(_engine()) as session:
        rows = [dataclasses.asdict(t) for t in list_tokens(session)]
    _show(rows, output, TOKEN_COLUMNS)


@token_app.command("revoke")
@handled
def token_revoke(token_id: Annotated[int, typer.Argument(help="Token id (`token list`).")]) -> None:
    """Revoke a token: requests with it get 401 from now on."""
    from fleet.auth import revoke_token
    from fleet.db import session_scope

    with session_scope(_engine()) as session:
        info = revoke_token(session, token_id)
    typer.echo(f"revoked token {info.id} ({info.role} {info.name})")


@app.command("serve")
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

    settings = _settings()
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
        _print_report(report.model_dump(), import_file)
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
    _serve_bounded(config, settings.shutdown_timeout_s)


def _serve_bounded(config: Any, timeout_s: float) -> None:
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


# ---------------------------------------------------------------------------------------------
# Inventory


def _print_report(report: dict[str, Any], path: Path | str) -> None:
    verb = "would change" if report["dry_run"] else "changed"
    created = {k: v for k, v in report["created"].items() if v}
    updated = {k: v for k, v in report["updated"].items() if v}
    unchanged = sum(report["unchanged"].values())
    typer.echo(
        f"{path}: {verb}: created {_counts(created)}; updated {_counts(updated)}; "
        f"{unchanged} unchanged"
    )
    if report["dry_run"]:
        for change in report["changes"]:
            fields = f" ({', '.join(change['fields'])})" if change["fields"] else ""
            typer.echo(
                _printable(f"  {change['action']} {change['kind']} {change['name']}{fields}")
            )
    for warning in report["warnings"]:
        typer.echo(f"warning: {_printable(warning, one_line=True)}", err=True)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}{'s' if v != 1 else ''}" for k, v in counts.items()) or "nothing"


def _send_inventory(api: Api, path: Path, endpoint: str, dry_run: bool) -> dict[str, Any]:
    body = path.read_bytes()
    try:
        result: dict[str, Any] = api.request(
            "POST",
            f"/api/v1/inventory/{endpoint}",
            params={"dry_run": "true"} if dry_run else None,
            content=body,
            headers={"Content-Type": "application/yaml"},
        )
    except CliError as exc:
        raise CliError(f"{path}: {exc}") from None
    return result


@inventory_app.command("import")
@handled
def inventory_import(
    file: Annotated[Path, typer.Argument(help="Inventory YAML file.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show changes, write nothing.")
    ] = False,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Import (upsert by name) an inventory file, all or nothing."""
    report = _send_inventory(_api(url, token), file, "import", dry_run)
    if output is Output.JSON:
        _show(report, output)
    else:
        _print_report(report, file)


@inventory_app.command("validate")
@handled
def inventory_validate(
    file: Annotated[Path, typer.Argument(help="Inventory YAML file.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Check a file against the fleet as an import would; writes nothing."""
    report = _send_inventory(_api(url, token), file, "validate", False)
    if output is Output.JSON:
        _show(report, output)
        return
    changes = len(report["changes"])
    typer.echo(f"{file}: valid; an import would make {changes} change{'s' if changes != 1 else ''}")
    for warning in report["warnings"]:
        typer.echo(f"warning: {_printable(warning, one_line=True)}", err=True)


@inventory_app.command("export")
@handled
def inventory_export(
    out: Annotated[
        Path | None, typer.Option("--file", "-f", help="Write here, not stdout.")
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Write the fleet's inventory as YAML (BMC passwords are never exported)."""
    text = _api(url, token).request("GET", "/api/v1/inventory/export")
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)


# ---------------------------------------------------------------------------------------------
# Sites, racks, servers, deployments, events

SITE_COLUMNS = [
    ("name", "site"),
    ("description", "description"),
    ("rack_count", "racks #"),
    ("server_count", "servers #"),
]
RACK_COLUMNS = [
    ("name", "rack"),
    ("site", "site"),
    ("status", "status"),
    ("servers", "servers #"),
    ("budget_w", "budget W"),
    ("committed_w", "committed W"),
    ("headroom_w", "headroom W"),
    ("all_on_w", "all-on W"),
]
SERVER_COLUMNS = [
    ("name", "server"),
    ("site", "site"),
    ("rack", "rack"),
    ("u_position", "U"),
    ("gpu_model", "GPU"),
    ("gpu_count", "GPUs #"),
    ("pool", "pool"),
    ("state", "state"),
    ("power_state", "power"),
    ("bmc_protocol", "BMC"),
]
DEPLOYMENT_COLUMNS = [
    ("name", "deployment"),
    ("model_uri", "model"),
    ("gpus_per_replica", "GPUs/replica #"),
    ("gpu_models", "GPU models"),
    ("min_replicas", "min #"),
    ("max_replicas", "max #"),
    ("sla_p95_latency_ms", "p95 SLA ms"),
    ("sla_ttft_ms", "TTFT SLA ms"),
]
EVENT_COLUMNS = [
    ("at", "time"),
    ("subject", "subject"),
    ("kind", "kind"),
    ("from_state", "from"),
    ("to_state", "to"),
    ("actor", "actor"),
    ("message", "message"),
]

Limit = Annotated[int | None, typer.Option("--limit", help="At most this many rows (default all).")]


@app.command("sites")
@handled
def sites(url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE) -> None:
    """List sites."""
    _show(list(_api(url, token).pages("/api/v1/sites", None)), output, SITE_COLUMNS)


@app.command("racks")
@handled
def racks(
    site: Annotated[str | None, typer.Option(help="Only this site.")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List racks with power budget, committed draw and headroom."""
    rows = list(_api(url, token).pages("/api/v1/racks", None, site=site))
    _show(rows, output, RACK_COLUMNS)


@servers_app.command("list")
@handled
def servers_list(
    site: Annotated[str | None, typer.Option()] = None,
    rack: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="baseline or warm")] = None,
    state: Annotated[str | None, typer.Option()] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model")] = None,
    limit: Limit = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List servers, filtered."""
    rows = list(
        _api(url, token).pages(
            "/api/v1/servers",
            limit,
            site=site,
            rack=rack,
            pool=pool,
            state=state,
            gpu_model=gpu_model,
        )
    )
    _show(rows, output, SERVER_COLUMNS)


@servers_app.command("show")
@handled
def servers_show(
    name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Show one server."""
    _show(_api(url, token).get(f"/api/v1/servers/{name}"), output)


POWER_COLUMNS = [
    ("server", "server"),
    ("ok", "ok"),
    ("sent", "sent"),
    ("state_before", "before"),
    ("state_after", "after"),
    ("seconds", "seconds"),
    ("error", "error"),
]


@servers_app.command("power")
@handled
def servers_power(
    action: Annotated[str, typer.Argument(help="on, off, force_off, cycle or status")],
    names: Annotated[list[str] | None, typer.Argument(help="Servers (or use the filters).")] = None,
    site: Annotated[str | None, typer.Option()] = None,
    rack: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="baseline or warm")] = None,
    state: Annotated[str | None, typer.Option()] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Power servers on/off/cycle through their BMCs, or read their power state.

    Power-ons are staggered per rack (inrush current); every result is read back from the BMC.
    Exit code 1 if any server failed.
    """
    filters = {"site": site, "rack": rack, "pool": pool, "state": state, "gpu_model": gpu_model}
    body: dict[str, Any] = {"action": action, **_choose(names, filters)}
    results: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    # The service streams one line per server as its BMC answers: a live progress bar (on
    # stderr, so that `-o json` output stays clean), then the table in the order asked.
    progress = Progress(
        SpinnerColumn(),
        TextColumn(f"power {action}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        # Only for a person at a terminal: piped or captured stderr stays one line per error.
        disable=not err_console.is_terminal,
    )
    with progress:
        task = progress.add_task("power", total=None, failed=0)
        for line in _api(url, token).stream_lines("POST", "/api/v1/power", json=body):
            if "result" in line:
                results.append(line["result"])
                failed = sum(not r["ok"] for r in results)
                progress.update(task, advance=1, failed=failed)
            elif "error" in line:
                raise CliError(f"the service failed mid-way: {line['error']}")
            elif "failed" in line:
                summary = line
            elif "count" in line:
                progress.update(task, total=line["count"])
    if not summary:
        raise CliError("the service ended the stream early (see its log); results may be partial")
    order = {name: i for i, name in enumerate(names or [])}
    results.sort(key=lambda r: (order.get(r["server"], len(order)), r["server"]))
    _show(results, output, POWER_COLUMNS)
    if summary["failed"]:
        raise CliError(f"{summary['failed']} of {summary['count']} servers failed (see the table)")


VERIFY_COLUMNS = [
    ("server", "server"),
    ("ok", "ok"),
    ("power_state", "power"),
    ("moved_to", "now"),
    ("message", "message"),
]


def _choose(names: list[str] | None, filters: dict[str, str | None]) -> dict[str, Any]:
    select = {k: v for k, v in filters.items() if v is not None}
    if bool(names) == bool(select):
        raise CliError("name servers, or select them with --site/--rack/--pool/--state/--gpu-model")
    return {"servers": names} if names else {"select": select}


@servers_app.command("verify")
@handled
def servers_verify(
    names: Annotated[list[str] | None, typer.Argument(help="Servers (or use the filters).")] = None,
    site: Annotated[str | None, typer.Option()] = None,
    rack: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="baseline or warm")] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Check enrolled servers' BMCs (all of them when none are named): warm-pool spares found
    off become warm; baseline servers are powered on (booting). Exit code 1 if any server
    could not be verified."""
    body = _choose(
        names,
        {
            "site": site,
            "rack": rack,
            "pool": pool,
            "gpu_model": gpu_model,
            "state": "enrolled" if not names else None,
        },
    )
    with console.status("verifying BMCs…", spinner="dots"):
        result = _api(url, token).request("POST", "/api/v1/verify", json=body, timeout=None)
    _show(result["results"], output, VERIFY_COLUMNS)
    if result["failed"]:
        raise CliError(
            f"{result['failed']} of {result['count']} servers not verified (see the table)"
        )


@servers_app.command("transition")
@handled
def servers_transition(
    name: str,
    to: Annotated[str, typer.Argument(help="Target state.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in the event).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Move a server through the lifecycle (operator moves)."""
    result = _api(url, token).request(
        "POST", f"/api/v1/servers/{name}/transition", json={"to": to, "reason": reason}
    )
    if output is Output.JSON:
        _show(result, output)
    elif result["event"] is None:
        typer.echo(f"{name} is already {to}")
    else:
        typer.echo(f"{name}: {result['event']['from_state']} → {result['event']['to_state']}")


@deployments_app.command("list")
@handled
def deployments_list(
    url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """List deployments."""
    _show(list(_api(url, token).pages("/api/v1/deployments", None)), output, DEPLOYMENT_COLUMNS)


@deployments_app.command("show")
@handled
def deployments_show(
    name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Show one deployment."""
    _show(_api(url, token).get(f"/api/v1/deployments/{name}"), output)


def _engine_params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--engine {pair!r}: expected KEY=VALUE")
        params[key] = yaml.safe_load(value)  # 8 -> int, 0.9 -> float, pytorch -> str
    return params


@deployments_app.command("create")
@handled
def deployments_create(
    name: str,
    model_uri: Annotated[str, typer.Option("--model-uri", help="Where the weights are.")],
    checksum: Annotated[str, typer.Option("--checksum", help="e.g. sha256:…")],
    sla_p95_ms: Annotated[float, typer.Option("--sla-p95-ms", help="p95 latency SLA.")],
    sla_ttft_ms: Annotated[float, typer.Option("--sla-ttft-ms", help="Time-to-first-token SLA.")],
    gpus_per_replica: Annotated[int, typer.Option("--gpus-per-replica")] = 1,
    gpu_model: Annotated[
        list[str] | None, typer.Option("--gpu-model", help="Allowed; repeat.")
    ] = None,
    min_replicas: Annotated[int, typer.Option("--min")] = 0,
    max_replicas: Annotated[int, typer.Option("--max")] = 1,
    disruption_budget: Annotated[int, typer.Option("--disruption-budget")] = 1,
    engine: Annotated[list[str] | None, typer.Option("--engine", help="KEY=VALUE; repeat.")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Create a deployment."""
    params = _engine_params(engine or [])
    params.setdefault("tp_size", gpus_per_replica)
    params.setdefault("pp_size", 1)
    body = {
        "name": name,
        "model_uri": model_uri,
        "model_checksum": checksum,
        "engine_params": params,
        "gpus_per_replica": gpus_per_replica,
        "gpu_models": gpu_model or [],
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "sla_p95_latency_ms": sla_p95_ms,
        "sla_ttft_ms": sla_ttft_ms,
        "disruption_budget": disruption_budget,
    }
    _show(_api(url, token).request("POST", "/api/v1/deployments", json=body), output)


@app.command("events")
@handled
def events(
    subject: Annotated[str | None, typer.Option(help="e.g. a server name.")] = None,
    subject_type: Annotated[
        str | None, typer.Option("--type", help="server, deployment, …")
    ] = None,
    kind: Annotated[str | None, typer.Option(help="e.g. server.transition, or server.")] = None,
    since: Annotated[str | None, typer.Option(help="ISO 8601 time.")] = None,
    limit: Annotated[int, typer.Option("--limit")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then print new events as they happen.")
    ] = False,
    follow_for: Annotated[
        float | None, typer.Option(help="With --follow: stop after this many seconds.")
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Show events, newest first; with --follow, then every new one as it happens (oldest
    first, one line each, until Ctrl-C or --follow-for)."""
    api = _api(url, token)
    filters = {"subject": subject, "subject_type": subject_type, "kind": kind}
    rows = list(api.pages("/api/v1/events", limit, since=since, **filters))
    if not follow:
        _show(rows, output, EVENT_COLUMNS)
        return
    for row in reversed(rows):
        _echo_event(row, output)
    seen = {row["id"] for row in rows}
    after = rows[0]["at"] if rows else since
    deadline = None if follow_for is None else time.monotonic() + follow_for
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.5)
        new = [
            r
            for r in api.pages("/api/v1/events", 1000, since=after, **filters)
            if r["id"] not in seen
        ]
        for row in sorted(new, key=lambda r: r["id"]):
            _echo_event(row, output)
            seen.add(row["id"])
            after = row["at"]


def _echo_event(row: dict[str, Any], output: Output) -> None:
    if output is Output.JSON:
        typer.echo(json.dumps(row, default=str))
        return
    change = f" {row['from_state']} → {row['to_state']}" if row.get("to_state") else ""
    line = f"{row['at']}  {row['subject']}  {row['kind']}{change}  {row['message']}"
    typer.echo(_printable(line, one_line=True))


# ---------------------------------------------------------------------------------------------
# Warm spares, operator moves that start workflows, the autopilot (fleet/provisioning/workflows.py)

# `fleetctl spares` alone lists the pool; `fleetctl spares boot` boots some.
spares_app = _typer(
    "Warm spares: the pool, and booting them for a deployment.", no_args_is_help=False
)
autopilot_app = _typer("Automatic actions: status, pause, resume (and the breaker).")
app.add_typer(spares_app, name="spares")
app.add_typer(autopilot_app, name="autopilot")
SPARE_COLUMNS = [
    ("site", "site"),
    ("gpu_model", "GPU"),
    ("server", "server"),
    ("rack", "rack"),
    ("gpus", "GPUs #"),
    ("boot_cost_w", "boot cost W"),
    ("rack_headroom_w", "rack headroom W"),
    ("fits", "fits"),
    ("boot_to_ready_s", "boot→ready s"),
]
BOOT_PROGRESS = ("booting", "loading", "serving")
BOOT_DONE = {"serving", "failed", "quarantined", "maintenance", "retired", "warm"}


@spares_app.callback(invoke_without_command=True)
@handled
def spares(
    ctx: typer.Context,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """The warm pool per site and GPU model, with each spare's power cost."""
    if ctx.invoked_subcommand is not None:
        return
    body = _api(url, token).get("/api/v1/spares")
    rows = [
        {"site": pool["site"], "gpu_model": pool["gpu_model"], **spare}
        for pool in body["pools"]
        for spare in pool["spares"]
    ]
    _show(rows, output, SPARE_COLUMNS)


@spares_app.command("boot")
@handled
def spares_boot(
    deployment: Annotated[str, typer.Option("--deployment", help="The deployment to serve.")],
    count: Annotated[int, typer.Option("--count", min=1, help="Spares to boot.")] = 1,
    wait: Annotated[
        float, typer.Option(help="Follow them this long (seconds; 0: do not follow).")
    ] = 3600.0,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Boot warm spares for a deployment and follow each through booting → loading → serving.
    Exit code 1 if fewer booted than asked, or any ended failed."""
    api = _api(url, token)
    result = api.request(
        "POST", "/api/v1/spares/boot", json={"deployment": deployment, "count": count}
    )
    booted: list[str] = result["booted"]
    if booted:
        err_console.print(f"booting {len(booted)} for {deployment}: {', '.join(booted)}")
    final = _follow_states(api, booted, wait) if booted and wait > 0 else {}
    rows = [
        {
            "server": n,
            "state": final.get(n, {}).get("state", "booting"),
            "boot_to_ready_s": final.get(n, {}).get("boot_to_ready_s"),
            "failed_reason": final.get(n, {}).get("failed_reason"),
        }
        for n in booted
    ]
    _show(
        rows,
        output,
        [
            ("server", "server"),
            ("state", "state"),
            ("boot_to_ready_s", "boot→ready s"),
            ("failed_reason", "why failed"),
        ],
    )
    failed = [r["server"] for r in rows if r["state"] == "failed"]
    if result["short"]:
        raise CliError(f"{result['short']} of {count} not booted: " + "; ".join(result["reasons"]))
    if failed:
        raise CliError(f"{len(failed)} failed: {', '.join(failed)} (see the table)")


def _follow_states(api: Api, names: list[str], wait_s: float) -> dict[str, dict[str, Any]]:
    """Poll the servers until each is done (serving, failed, …) or `wait_s` passed, showing
    each one's state as it moves."""
    last: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    ) as progress:
        tasks = {n: progress.add_task(f"{n}: booting", total=None) for n in names}
        while time.monotonic() < deadline:
            for name in names:
                if last.get(name, {}).get("state") in BOOT_DONE:
                    continue
                row = api.get(f"/api/v1/servers/{name}")
                if row["state"] != last.get(name, {}).get("state"):
                    progress.update(tasks[name], description=f"{name}: {row['state']}")
                    if not err_console.is_terminal:
                        err_console.print(f"{name}: {row['state']}")
                last[name] = row
            if all(last.get(n, {}).get("state") in BOOT_DONE for n in names):
                break
            time.sleep(1.0)
    return last


def _server_move(path: str, name: str, url: str, token: str | None) -> None:
    row = _api(url, token).request("POST", f"/api/v1/servers/{name}/{path}")
    typer.echo(f"{row['server']}: {row['state']}")


@servers_app.command("drain")
@handled
def servers_drain(name: str, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Drain a serving server (in-flight requests finish); it then waits, drained."""
    _server_move("drain", name, url, token)


@servers_app.command("undrain")
@handled
def servers_undrain(name: str, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Back to serving: a server an operator drained loads its deployment again."""
    _server_move("undrain", name, url, token)


def _operator_transition(name: str, to: str, reason: str, url: str, token: str | None) -> None:
    body = {"to": to, "reason": reason}
    row = _api(url, token).request("POST", f"/api/v1/servers/{name}/transition", json=body)
    typer.echo(f"{name}: {row['server']['state']}")


Reason = Annotated[str, typer.Option("--reason", help="Why (recorded in the event).")]


@servers_app.command("maintenance")
@handled
def servers_maintenance(
    name: str, reason: Reason = "operator maintenance", url: Url = DEFAULT_URL, token: Token = None
) -> None:
    """Take a server out for maintenance (nothing automatic touches it until released)."""
    _operator_transition(name, "maintenance", reason, url, token)


@servers_app.command("release")
@handled
def servers_release(
    name: str,
    reason: Reason = "released by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Release a failed, quarantined or maintenance server: back to enrolled (verify next)."""
    _operator_transition(name, "enrolled", reason, url, token)


@servers_app.command("retire")
@handled
def servers_retire(
    name: str,
    reason: Reason = "retired by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Retire a server for good."""
    _operator_transition(name, "retired", reason, url, token)


@autopilot_app.command("status")
@handled
def autopilot_status(
    url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Whether automatic actions run, and the breaker."""
    _show(_api(url, token).get("/api/v1/autopilot"), output)


@autopilot_app.command("pause")
@handled
def autopilot_pause(
    reason: Annotated[str, typer.Option("--reason")] = "paused by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Stop every automatic action (boots, drains, power cycles, returns)."""
    row = _api(url, token).request("POST", "/api/v1/autopilot/pause", json={"reason": reason})
    typer.echo(f"autopilot paused: {_printable(row['reason'], one_line=True)}")


@autopilot_app.command("resume")
@handled
def autopilot_resume(
    reason: Annotated[str, typer.Option("--reason")] = "resumed by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Resume automatic actions (and close an open breaker)."""
    _api(url, token).request("POST", "/api/v1/autopilot/resume", json={"reason": reason})
    typer.echo("autopilot running")


# ---------------------------------------------------------------------------------------------
# The autoscaler (fleet/autoscaler/)

autoscaler_app = _typer("The autoscaler: its view, its decisions and why.")
app.add_typer(autoscaler_app, name="autoscaler")
AUTOSCALER_COLUMNS = [
    ("deployment", "deployment"),
    ("mode", "mode"),
    ("target", "target #"),
    ("serving", "serving #"),
    ("on_the_way", "booting #"),
    ("queue_per_gpu", "queue/GPU"),
    ("kv_use", "KV use"),
    ("p95_latency_s", "p95 s"),
    ("last_rule", "last rule"),
]
DECISION_COLUMNS = [
    ("at", "time"),
    ("rule", "rule"),
    ("target_before", "from #"),
    ("target_after", "to #"),
    ("reason", "why"),
]


@autoscaler_app.command("status")
@handled
def autoscaler_status(
    url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Per deployment: mode, target, serving, booting, its signals now, and its last rule."""
    rows = _api(url, token).get("/api/v1/autoscaler")["results"]
    for row in rows:
        for key in ("queue_per_gpu", "kv_use", "p95_latency_s"):
            value = row["signals"].get(key)
            row[key] = round(value, 3) if isinstance(value, float) else value
    _show(rows, output, AUTOSCALER_COLUMNS)


@autoscaler_app.command("history")
@handled
def autoscaler_history(
    deployment: str,
    limit: Annotated[int, typer.Option("--limit")] = 20,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """The deployment's scaling decisions, newest first."""
    body = _api(url, token).get(f"/api/v1/autoscaler/{deployment}/decisions", limit=limit)
    _show(body["results"], output, DECISION_COLUMNS)


@autoscaler_app.command("explain")
@handled
def autoscaler_explain(
    deployment: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """The last decision for the deployment: the rule, why, and every input it used."""
    body = _api(url, token).get(f"/api/v1/autoscaler/{deployment}/decisions", limit=1)
    if not body["results"]:
        raise CliError(f"no decision for {deployment} yet (the autoscaler runs in the leader)")
    last = body["results"][0]
    if output is Output.JSON:
        _show(last, output)
        return
    typer.echo(
        f"{deployment}: {last['rule']} at {last['at']}: target {last['target_before']} → "
        f"{last['target_after']}"
    )
    typer.echo(f"why: {_printable(last['reason'], one_line=True)}")
    _show(last["inputs"], output, title="inputs")


@deployments_app.command("scale")
@handled
def deployments_scale(
    name: str,
    replicas: Annotated[
        int | None, typer.Option("--replicas", min=0, help="Pin at this many replicas.")
    ] = None,
    auto: Annotated[bool, typer.Option("--auto", help="Back to automatic scaling.")] = False,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Pin a deployment at N replicas (manual mode), or hand it back with --auto."""
    if (replicas is None) == (not auto):
        raise CliError("give --replicas N (manual mode) or --auto, not both")
    body = {"replicas": None if auto else replicas}
    row = _api(url, token).request("POST", f"/api/v1/deployments/{name}/scale", json=body)
    typer.echo(f"{name}: " + ("automatic" if row["mode"] == "auto" else f"pinned at {replicas}"))


# ---------------------------------------------------------------------------------------------
# The scheduled-scaling calendar (fleet/calendar/)

schedule_app = _typer("The scheduled-scaling calendar: floors at known times, booted early.")
app.add_typer(schedule_app, name="schedule")
SCHEDULE_COLUMNS = [
    ("id", "id"),
    ("deployment", "deployment"),
    ("cron", "cron"),
    ("timezone", "time zone"),
    ("ends", "ends"),
    ("min_replicas", "min replicas"),
    ("state", "state"),
    ("next_local", "next (local)"),
    ("boot_local", "boots (local)"),
    ("note", "note"),
]
PREVIEW_COLUMNS = [
    ("start_local", "serving from (local)"),
    ("start", "UTC"),
    ("boot_local", "boots (local)"),
    ("boot", "boots (UTC)"),
    ("end_local", "until (local)"),
]
Cron = Annotated[
    str | None, typer.Option("--cron", help='Start: a cron expression, e.g. "0 9 * * 1-5".')
]
TimeZone = Annotated[str, typer.Option("--tz", help="IANA time zone of the expressions.")]
Until = Annotated[
    str | None, typer.Option("--until", help='End: a cron expression, e.g. "0 18 * * 1-5".')
]
For = Annotated[
    str | None, typer.Option("--for", help="End: a duration after the start, e.g. 9h or 90m.")
]
_DURATION = re.compile(r"(\d+)\s*([dhms])")
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def _duration_s(text: str) -> int:
    """'9h', '1h30m', '45m', '90s', '2d' or plain seconds → seconds."""
    compact = text.strip().lower().replace(" ", "")
    if compact.isdigit():
        seconds = int(compact)
    else:
        parts = _DURATION.findall(compact)
        if not parts or "".join(n + u for n, u in parts) != compact:
            raise CliError(f"--for {text!r}: give a duration such as 9h, 1h30m, 45m or 3600")
        seconds = sum(int(n) * _UNIT_S[u] for n, u in parts)
    if seconds <= 0:
        raise CliError(f"--for {text!r}: the duration must be positive")
    return seconds


def _entry_body(
    deployment: str, cron: str | None, tz: str, until: str | None, for_: str | None
) -> dict[str, Any]:
    if not cron:
        raise CliError('give the start with --cron, e.g. --cron "0 9 * * 1-5"')
    if (until is None) == (for_ is None):
        raise CliError("give the end with --until CRON or --for DURATION (one of them)")
    return {
        "deployment": deployment,
        "cron": cron,
        "timezone": tz,
        "end_cron": until,
        "duration_s": _duration_s(for_) if for_ is not None else None,
    }


def _local(text: str | None) -> str:
    """An ISO timestamp with offset, shortened for a table: 'Fri 2027-03-26 09:00 +01:00'."""
    if not text:
        return ""
    at = datetime.fromisoformat(text)
    offset = at.strftime("%z")
    clock = "%H:%M:%S" if at.second else "%H:%M"
    return at.strftime(f"%a %Y-%m-%d {clock} ") + f"{offset[:3]}:{offset[3:]}"


@schedule_app.command("add")
@handled
def schedule_add(
    deployment: str,
    min_replicas: Annotated[
        int, typer.Option("--min-replicas", min=1, help="The floor while the window is open.")
    ],
    cron: Cron = None,
    tz: TimeZone = "UTC",
    until: Until = None,
    for_: For = None,
    note: Annotated[str, typer.Option("--note", help="Why (a launch, business hours).")] = "",
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Add an entry: at least N replicas from each --cron firing, --until or --for."""
    body = _entry_body(deployment, cron, tz, until, for_)
    body |= {"min_replicas": min_replicas, "note": note}
    row = _api(url, token).request("POST", "/api/v1/schedules", json=body)
    if output is Output.JSON:
        _show(row, output)
        return
    nxt = row["next"]
    when = f"; next serving from {_local(nxt['start_local'])}" if nxt else ""
    boots = f", boots from {_local(nxt['boot_at_local'])}" if nxt else ""
    typer.echo(f"entry {row['id']} for {deployment}{when}{boots} ({row['lead_basis']})")


@schedule_app.command("list")
@handled
def schedule_list(
    deployment: Annotated[str | None, typer.Option("--deployment")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """The entries: when each next serves, when its boots start, and whether it is open."""
    rows = _api(url, token).get("/api/v1/schedules", deployment=deployment)["results"]
    if output is Output.TABLE:
        for row in rows:
            nxt = row["next"] or {}
            row["ends"] = row["end_cron"] or f"+{row['duration_s']} s"
            row["state"] = f"open until {row['active_until']}" if row["active"] else "waiting"
            row["next_local"] = _local(nxt.get("start_local"))
            row["boot_local"] = _local(nxt.get("boot_at_local"))
    _show(rows, output, SCHEDULE_COLUMNS)


@schedule_app.command("rm")
@handled
def schedule_rm(entry_id: int, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Remove an entry (an open window's floor goes at the calendar's next tick)."""
    _api(url, token).request("DELETE", f"/api/v1/schedules/{entry_id}")
    typer.echo(f"entry {entry_id} removed")


@schedule_app.command("preview")
@handled
def schedule_preview(
    entry_id: Annotated[int | None, typer.Argument(help="An entry's id (or describe one).")] = None,
    deployment: Annotated[str | None, typer.Option("--deployment")] = None,
    cron: Cron = None,
    tz: TimeZone = "UTC",
    until: Until = None,
    for_: For = None,
    count: Annotated[int, typer.Option("--count", "-n", min=1, max=500)] = 10,
    start: Annotated[
        str | None, typer.Option("--from", help="From this time (ISO 8601; default now).")
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """The next N windows in local time and UTC, with the early boot (the measured p90)."""
    api = _api(url, token)
    params = {"count": count, "start": start}
    if entry_id is not None:
        if deployment or cron:
            raise CliError("give an entry's id, or describe one with --deployment and --cron")
        body = api.get(f"/api/v1/schedules/{entry_id}/preview", **params)
    else:
        if not deployment:
            raise CliError("give an entry's id, or describe one with --deployment and --cron")
        spec = _entry_body(deployment, cron, tz, until, for_) | {"min_replicas": 1}
        query = {k: v for k, v in params.items() if v is not None}
        body = api.request("POST", "/api/v1/schedules/preview", json=spec, params=query)
    if output is Output.JSON:
        _show(body, output)
        return
    rows = [
        {
            "start_local": _local(w["start_local"]),
            "start": datetime.fromisoformat(w["start"]).strftime("%a %Y-%m-%d %H:%M:%S"),
            "boot_local": _local(w["boot_at_local"]),
            "boot": datetime.fromisoformat(w["boot_at"]).strftime("%a %Y-%m-%d %H:%M:%S"),
            "end_local": _local(w["end_local"]),
        }
        for w in body["results"]
    ]
    title = f"{body['timezone']}: boots start {body['lead_s']:.0f} s early ({body['lead_basis']})"
    _show(rows, output, PREVIEW_COLUMNS, title=title)


# ---------------------------------------------------------------------------------------------
# Monitoring (fleet/observability/prometheus_config.py, docs/metrics.md)


@app.command("prometheus-config")
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
    servers = list(_api(url, token).pages("/api/v1/servers", None))
    files = build(
        services=service or [url],
        servers=servers,
        routers=router or [],
        scrape_interval_s=scrape_interval,
    )
    for path in write(out, files):
        typer.echo(path)


# ---------------------------------------------------------------------------------------------
# The virtual colo (fleet/lab/colo.py): BMC emulators and simulated servers, for demos and tests

lab_app = _typer("The virtual colo: real BMC emulators, simulated GPU servers (demo, tests).")
app.add_typer(lab_app, name="lab")
LabDir = Annotated[Path, typer.Option("--dir", "-d", help="The lab's working directory.")]
LAB_DIR = Path("lab")
LAB_STOP_TIMEOUT_S = 30.0
LAB_COLUMNS = [
    ("name", "server"),
    ("protocol", "protocol"),
    ("bmc", "BMC endpoint"),
    ("power", "power"),
    ("agent_pid", "agent pid"),
    ("agent_ready", "ready"),
    ("power_w", "W"),
]
LAB_RACK_COLUMNS = [("rack", "rack"), ("servers", "servers #"), ("on", "on #"), ("power_w", "W")]


def _lab_token_maker(engine: Any) -> Callable[[str], str]:
    """Agent tokens made in-process on the fleet's database (the usual FLEET_* settings), the
    way `fleetctl token create` makes them: a token needs its server imported first, so the
    lab asks for one when a server first boots. `engine` None: connect on the first call."""
    import threading

    from fleet.auth import create_token
    from fleet.db import session_scope
    from fleet.models import Role

    lock = threading.Lock()
    engines = [engine] if engine is not None else []

    def make(server: str) -> str:
        with lock:
            if not engines:
                engines.append(_engine())
            with session_scope(engines[0]) as session:
                return create_token(
                    session, f"lab-agent-{server}", Role.AGENT, server, actor="fleetctl:lab"
                )

    return make


def _running_lab(lab_dir: Path) -> dict[str, Any]:
    from fleet.lab.colo import lab_running, load_state

    state = load_state(lab_dir)
    if not lab_running(state):
        raise CliError(
            f"the lab in {lab_dir} is not running (pid {state['lab']['pid']} is gone): "
            f"`fleetctl lab down --dir {lab_dir}` cleans up what it left"
        )
    return state


@lab_app.command("up")
@handled
def lab_up(
    inventory: Annotated[Path, typer.Argument(help="Inventory YAML file.")],
    lab_dir: LabDir = LAB_DIR,
    fleet_url: Annotated[
        str,
        typer.Option("--fleet-url", envvar="FLEET_URL", help="The fleet agents report to."),
    ] = DEFAULT_URL,
    token: Token = None,
    boot_delay: Annotated[
        float | None,
        typer.Option("--boot-delay", help="Seconds from power-on to agent start [20]."),
    ] = None,
    do_import: Annotated[
        bool,
        typer.Option("--import/--no-import", help="Import the rewritten inventory into the fleet."),
    ] = True,
) -> None:
    """Run the virtual colo in the foreground until Ctrl-C or SIGTERM.

    Starts a BMC emulator per server (one sushy-emulator for all Redfish servers, one ipmi_sim
    per IPMI server), writes the inventory rewritten to point at them to DIR/inventory.yaml
    (lab-only BMC credentials) and imports it (--token: operator or admin). A server powered on
    through its BMC starts its agent (simulated GPUs) after the boot delay; agent tokens are
    created on the fleet's database (FLEET_DATABASE_URL, or the embedded default)."""
    import signal
    import threading

    from fleet.inventory.schema import parse_inventory
    from fleet.lab.colo import DEFAULT_BOOT_DELAY_S, VirtualColo, lab_running, load_state

    inv = parse_inventory(inventory.read_bytes())
    api = _api(fleet_url, token) if do_import else None
    # Importing needs the fleet's database for agent tokens too: fail before starting anything.
    engine = _engine() if do_import else None
    lab_dir.mkdir(parents=True, exist_ok=True)
    if (lab_dir / "lab.json").exists() and lab_running(load_state(lab_dir)):
        raise CliError(
            f"a lab is already running in {lab_dir}: `fleetctl lab down --dir {lab_dir}`"
        )
    colo = VirtualColo(
        inv,
        lab_dir,
        token_for=_lab_token_maker(engine),
        fleet_url=fleet_url,
        boot_delay_s=DEFAULT_BOOT_DELAY_S if boot_delay is None else boot_delay,
    )
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in signals}
    try:
        colo.up()
        _lab_publish(colo, lab_dir, api)
        while not stop.wait(1.0):
            pass
    finally:
        colo.down()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo(f"lab in {lab_dir} is down")


def _lab_publish(colo: Any, lab_dir: Path, api: Api | None) -> None:
    """Write DIR/inventory.yaml (0600: it holds the lab's BMC password) and import it."""
    import os

    path = lab_dir / "inventory.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(colo.rewritten_yaml())
    servers = colo.state()["servers"].values()
    redfish = sum(1 for s in servers if s["protocol"] == "redfish")
    typer.echo(
        f"lab up in {colo.up_seconds:.1f} s: {len(colo.servers)} servers ({redfish} Redfish on "
        f"one sushy-emulator, {len(colo.servers) - redfish} ipmi_sim), state in "
        f"{lab_dir / 'lab.json'}; Ctrl-C or `fleetctl lab down --dir {lab_dir}` stops it"
    )
    if api is None:
        typer.echo(f"wrote {path}: import it with `fleetctl inventory import {path}`")
        return
    _print_report(_send_inventory(api, path, "import", False), path)


@lab_app.command("status")
@handled
def lab_status(lab_dir: LabDir = LAB_DIR, output: Out = Output.TABLE) -> None:
    """Every server of the running lab: BMC, power as its emulator reports it, agent, draw."""
    import dataclasses

    from fleet.lab.colo import status_from_state

    rows = [dataclasses.asdict(s) for s in status_from_state(_running_lab(lab_dir))]
    racks: dict[str, dict[str, Any]] = {}
    for row in rows:
        rack = racks.setdefault(row["rack"], {"rack": row["rack"], "servers": 0, "on": 0})
        rack["servers"] += 1
        rack["on"] += row["power"] == "on"
        rack["power_w"] = rack.get("power_w", 0.0) + row["power_w"]
    if output is Output.JSON:
        _show({"servers": rows, "racks": list(racks.values())}, output)
        return
    for row in rows:
        row["power"] += " (booting)" if row["booting"] else ""
    _show(rows, output, LAB_COLUMNS)
    _show(list(racks.values()), output, LAB_RACK_COLUMNS)
    for row in rows:
        if row["error"]:
            typer.echo(_printable(f"note: {row['name']}: {row['error']}", one_line=True), err=True)


@lab_app.command("inject")
@handled
def lab_inject(
    server: Annotated[str, typer.Argument(help="The server (its agent must be up).")],
    kind: Annotated[str, typer.Argument(help="xid, ecc_uncorrected, gpu_lost, clear, ...")],
    xid: Annotated[int | None, typer.Argument(help="The Xid number (kind xid).")] = None,
    gpu: Annotated[int | None, typer.Option("--gpu", help="GPU index [0; clear: all].")] = None,
    count: Annotated[int | None, typer.Option("--count", help="Errors/events [1].")] = None,
    lab_dir: LabDir = LAB_DIR,
) -> None:
    """Inject a fault into a server's simulated GPUs (through its agent's /faults)."""
    from fleet.lab.colo import inject_fault
    from fleet_agent.telemetry.simulated import FAULT_KINDS

    if kind not in FAULT_KINDS:
        raise CliError(f"unknown fault kind {kind!r}: one of {', '.join(FAULT_KINDS)}")
    fault: dict[str, Any] = {"kind": kind}
    for key, value in (("xid", xid), ("gpu", gpu), ("count", count)):
        if value is not None:
            fault[key] = value
    entry = _running_lab(lab_dir)["servers"].get(server)
    if entry is None:
        raise CliError(f"no server named {server!r} in the lab in {lab_dir}")
    inject_fault(server, entry, fault)
    where = f" on GPU {gpu}" if gpu is not None else ""
    typer.echo(f"{server}: injected {kind}{f' {xid}' if xid is not None else ''}{where}")


@lab_app.command("down")
@handled
def lab_down(lab_dir: LabDir = LAB_DIR) -> None:
    """Stop the lab in DIR (SIGTERM, bounded wait), then check that none of the processes its
    state file names is left; stragglers of a crashed lab are killed."""
    import contextlib
    import os
    import signal

    from fleet.lab.colo import load_state, recorded_processes

    state = load_state(lab_dir)
    processes = recorded_processes(state)
    lab = next((ref for what, ref in processes if what == "lab"), None)
    if lab is not None and lab.alive():
        os.kill(lab.pid, signal.SIGTERM)
        if not _wait_gone([lab], LAB_STOP_TIMEOUT_S):
            os.kill(lab.pid, signal.SIGKILL)  # its sentinel and PDEATHSIG clean up after it
    refs = [ref for _, ref in processes]
    if not _wait_gone(refs, 10.0):
        for what, ref in processes:  # a crashed lab's leftovers: each leads its own group
            if ref.alive() and what != "lab":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(ref.pid, signal.SIGKILL)
        _wait_gone(refs, 5.0)
    left = [f"{what} (pid {ref.pid})" for what, ref in processes if ref.alive()]
    if left:
        raise CliError(f"still running after lab down: {', '.join(left)}")
    (lab_dir / "lab.json").unlink(missing_ok=True)
    typer.echo(f"lab in {lab_dir} stopped: none of its {len(processes)} processes is left")


def _wait_gone(refs: Sequence[Any], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while any(ref.alive() for ref in refs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


# ---------------------------------------------------------------------------------------------
# The simulator (fleet/sim/): what-if capacity planning with the production routing code


@app.command("simulate")
@handled
def simulate(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML (docs/sim.md).")],
    seed: Annotated[int | None, typer.Option("--seed", help="Overrides the scenario's.")] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            "--compare",
            help="Variants run on the SAME requests, comma-separated: a strategy, a batching "
            "(continuous|static) or strategy/batching.",
        ),
    ] = None,
    charts: Annotated[
        Path | None,
        typer.Option(
            "--charts",
            help="Write a PNG per run to this directory (made if missing), "
            "DIR/<scenario>-<variant>.png: demand vs capacity, p95 vs SLA, spares in use.",
        ),
    ] = None,
    pure: Annotated[
        bool,
        typer.Option(
            "--pure",
            help="Run the Python modules even where `fleetctl simulate-compile` built them "
            "(the same results, ~3× slower).",
        ),
    ] = False,
) -> None:
    """Simulate a scenario: the production routing strategies, autoscaling policy, calendar,
    placement, fault policy and escalation rule over engines timed by the cost model
    (docs/sim.md)."""
    from fleet.sim import native

    # Before anything imports the hot modules (fleet/sim/native.py).
    why_not = "--pure" if pure else native.enable()
    from fleet.sim import charts as sim_charts
    from fleet.sim import scenario as sim
    from fleet.sim.core import RunResult

    loaded = sim.load(scenario)
    out = None if charts is None else sim_charts.chart_dir(charts)  # before the runs
    typer.echo(
        "simulator: compiled (mypyc)" if why_not is None else f"simulator: Python ({why_not})",
        err=True,
    )
    written: list[Path] = []

    def chart(variant: str, result: RunResult) -> None:
        if out is not None:
            path = out / sim_charts.file_name(loaded.name, variant)
            title = f"{loaded.name} ({variant})"
            written.append(
                sim_charts.render(result, path, title=title, shared_warm_pool=loaded.shared_pool())
            )

    if compare:
        variants = [v.strip() for v in compare.split(",") if v.strip()]
        rows = sim.compare(loaded, variants, seed, on_result=chart)
    else:
        result, summary = sim.run(loaded, seed)
        rows = [(loaded.name, summary)]
        chart(sim_charts.variant_name(result.deployments), result)
    typer.echo(sim.table(rows))
    if not compare:
        for line in sim.report(result):
            typer.echo(line)
    for path in written:
        typer.echo(f"chart: {path}")


@app.command("simulate-compile")
@handled
def simulate_compile(
    force: Annotated[bool, typer.Option("--force", help="Build again even if built.")] = False,
) -> None:
    """Compile the simulator's hot modules with mypyc (about a minute; needs gcc, Python's
    headers and mypy) so that `fleetctl simulate` runs ~3× faster with the same results. The
    build is cached per source version ($XDG_CACHE_HOME/fleet/sim-native)."""
    from fleet.sim import native

    started = time.monotonic()
    try:
        where = native.build(force=force)
    except native.NativeError as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    typer.echo(f"compiled in {time.monotonic() - started:.0f} s: {where}")


# ---------------------------------------------------------------------------------------------
# The demo (fleet/demo/): the whole fleet in one command


@app.command("demo")
@handled
def demo(
    duration: Annotated[
        float, typer.Option("--duration", min=30, max=3600, help="Seconds of traffic.")
    ] = 120.0,
    servers: Annotated[int, typer.Option("--servers", min=2, max=12, help="L40S servers.")] = 6,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Live view or log lines.")] = True,
    keep: Annotated[
        bool, typer.Option("--keep", help="Leave it running; print the URLs and a token.")
    ] = False,
    workdir: Annotated[
        Path | None, typer.Option("--dir", help="Working directory [a new temporary one].")
    ] = None,
) -> None:
    """The whole fleet on this machine: a virtual colo, the fleet service and the router, a
    replayed day of real traffic with a spike, a GPU fault and a calendar entry; a summary and
    a chart at the end. Everything it starts stops when it ends (or on Ctrl-C)."""
    from fleet.demo.run import Options, run_demo

    options = Options(duration_s=duration, servers=servers, live=live, keep=keep, workdir=workdir)
    try:
        run_demo(options, console)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except RuntimeError as exc:  # DemoError, LabError: one line
        raise CliError(str(exc)) from None


def main() -> None:
    """The console script: like `app()`, but a usage error is one line too."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except Exception as exc:
        # Click's usage errors, matched by shape: Typer vendors its own copy of Click.
        exit_code, message = getattr(exc, "exit_code", None), getattr(exc, "format_message", None)
        if not isinstance(exit_code, int) or message is None:
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            typer.echo(message(), err=True)  # the help text itself
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            typer.echo(f"error: {message()}{hint}", err=True)
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
