"""What every fleetctl command shares: the Typer factory, one-line errors (`handled`), the
printable-text guard, the --url/--token/--output options, the HTTP client and the
table/JSON output."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import httpx
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text


def typer_app(help: str, name: str | None = None, *, no_args_is_help: bool = True) -> typer.Typer:
    # Plain (non-rich) usage errors: one line an operator can grep, and exit code 2.
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=no_args_is_help,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        add_completion=False,
    )


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
            fail(message)
        except httpx.HTTPError as exc:
            fail(_http_error(exc))
        except ValidationError as exc:  # e.g. a FLEET_* setting; never echoes the input value
            fail("; ".join(validation_messages(exc)))
        # Unreachable database, bad credentials, a URL SQLAlchemy cannot use.
        except (OperationalError, DBAPIError, ArgumentError) as exc:
            fail(f"cannot use the database: {_database_error(exc)}")
        except ValueError as exc:  # e.g. FLEET_SECRET_KEY is not a valid key
            fail(_without_password(_one_line(str(exc))) or type(exc).__name__)

    return wrapper


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {printable(message, one_line=True)}", err=True)
    raise typer.Exit(1) from None


# Text from the service or a file (event messages, reasons, warnings, errors) may hold terminal
# escape sequences (ANSI/OSC: retitle the terminal, rewrite what was printed, fake a link):
# whatever this CLI prints of it goes through printable. JSON output escapes them instead.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: object, *, one_line: bool = False) -> str:
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

        url = load_settings().database_url
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


# `fleetctl`'s own options, before any command: the root callback (fleet/cli/__init__.py). A
# comment, not a docstring: Typer would take a docstring for the app's help.
def root_options(
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


def api_client(url: str, token: str | None) -> Api:
    if not token:
        raise CliError("no token: pass --token or set FLEET_TOKEN (`fleetctl token create`)")
    return Api(url, token)


# ---------------------------------------------------------------------------------------------
# Output


def show(
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
            table.add_row(Text(printable(key)), Text(cell(value)))
        console.print(table)
        return
    assert columns is not None
    table = Table(title=title)
    for _, header in columns:
        justify = "right" if header.endswith(("W", "#")) else "left"
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(Text(cell(row.get(key))) for key, _ in columns))
    console.print(table)


def show_secret(created: dict[str, Any], secret_field: str, what: str, output: Output) -> None:
    """A secret shown once at creation (a token, a client key): with `-o json` the whole answer;
    otherwise the value alone on stdout (a script captures it) and `what` it is on stderr."""
    if output is Output.JSON:
        show(created, output)
        return
    err_console.print(f"{what} (shown this once)", markup=False, highlight=False)
    typer.echo(created[secret_field])


def cell(value: Any) -> str:
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
    return printable(value)


# ---------------------------------------------------------------------------------------------
# The service's settings and database, for the commands that work on it directly


def load_settings() -> Any:
    from fleet.settings import get_settings

    return get_settings()


def database_engine() -> Any:
    """The database engine, migrated (embedded default) or checked to be (any other)."""
    from fleet import db
    from fleet.api.app import prepare_database

    settings = load_settings()
    engine = db.engine_from_settings(settings)
    prepare_database(settings, engine)
    return engine
