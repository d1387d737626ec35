"""`fleetctl token` (API tokens, made on the database directly), `fleetctl agent-tokens` (agent
tokens through the API) and `fleetctl secret-key`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from fleet.cli.common import (
    DEFAULT_URL,
    CliError,
    Out,
    Output,
    Token,
    Url,
    api_client,
    database_engine,
    handled,
    printable,
    show,
    show_secret,
    typer_app,
)

token_app = typer_app("API tokens (created directly in the database).")


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
    with session_scope(database_engine()) as session:
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
    ("replaced_by", "replaced by"),
]


@token_app.command("list")
@handled
def token_list(output: Out = Output.TABLE) -> None:
    """List tokens (never their values: only hashes are stored)."""
    import dataclasses

    from fleet.auth import list_tokens
    from fleet.db import session_scope

    with session_scope(database_engine()) as session:
        rows = [dataclasses.asdict(t) for t in list_tokens(session)]
    show(rows, output, TOKEN_COLUMNS)


@token_app.command("revoke")
@handled
def token_revoke(token_id: Annotated[int, typer.Argument(help="Token id (`token list`).")]) -> None:
    """Revoke a token: requests with it get 401 from now on."""
    from fleet.auth import revoke_token
    from fleet.db import session_scope

    with session_scope(database_engine()) as session:
        info = revoke_token(session, token_id)
    typer.echo(f"revoked token {info.id} ({info.role} {info.name})")


# ---------------------------------------------------------------------------------------------
# `fleetctl agent-tokens`: agent tokens through the API (an admin's token), one per server.

agent_tokens_app = typer_app(
    "Agent tokens through the API (admin): mint one per server, list, revoke, rotate."
)


def _print_minted(minted: dict[str, Any], output: Output) -> None:
    what = (
        f"agent token {minted['id']} for {printable(minted['server'])}, expires "
        f"{minted['expires_at']}"
    )
    show_secret(minted, "token", what, output)


@agent_tokens_app.command("mint")
@handled
def agent_tokens_mint(
    server: Annotated[str, typer.Argument(help="The server whose agent holds it.")],
    expires_in: Annotated[
        str | None,
        typer.Option(
            "--expires-in",
            help="Lifetime: 90d, 12h or 30m (default: the service's FLEET_AGENT_TOKEN_LIFETIME_S).",
        ),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Mint the server's agent token and print it (the only time it is shown); refused while
    the server has a live one (rotate or revoke it)."""
    from fleet.auth import parse_lifetime

    body: dict[str, Any] = {"server": server}
    if expires_in is not None:
        body["expires_in_s"] = parse_lifetime(expires_in).total_seconds()
    _print_minted(api_client(url, token).request("POST", "/api/v1/tokens/agent", json=body), output)


@agent_tokens_app.command("list")
@handled
def agent_tokens_list(
    server: Annotated[str | None, typer.Option("--server", help="Only this server's.")] = None,
    live: Annotated[
        bool | None,
        typer.Option(
            "--live/--not-live",
            help="Only live ones (neither revoked, expired nor replaced), or only the rest.",
            show_default=False,
        ),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List agent tokens (never their values)."""
    rows = list(
        api_client(url, token).pages(
            "/api/v1/tokens",
            None,
            role="agent",
            server=server,
            live=None if live is None else str(live).lower(),
        )
    )
    show(rows, output, TOKEN_COLUMNS)


@agent_tokens_app.command("revoke")
@handled
def agent_tokens_revoke(
    token_id: Annotated[int, typer.Argument(help="Token id (`agent-tokens list`).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Revoke a token: requests with it get 401 from now on."""
    info = api_client(url, token).request("DELETE", f"/api/v1/tokens/{token_id}")
    typer.echo(f"revoked token {info['id']} ({info['role']} {printable(info['name'])})")


@agent_tokens_app.command("rotate")
@handled
def agent_tokens_rotate(
    token_id: Annotated[int, typer.Argument(help="The agent token's id (`agent-tokens list`).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Issue the server's new agent token and print it; the old one keeps working for the
    service's FLEET_AGENT_TOKEN_OVERLAP_S (or until its own expiry, if sooner)."""
    minted = api_client(url, token).request("POST", f"/api/v1/tokens/{token_id}/rotate")
    _print_minted(minted, output)
