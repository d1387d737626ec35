"""`fleetctl token` (API tokens, made on the database directly) and `fleetctl secret-key`."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.cli.common import (
    CliError,
    Out,
    Output,
    database_engine,
    handled,
    show,
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
