"""`fleetctl tenants` and `fleetctl keys`: who may send requests to the routers (tenants with
their concurrency shares, client keys with their rate limits), through the API."""

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
    handled,
    printable,
    show,
    show_secret,
    typer_app,
)

tenants_app = typer_app("Tenants: who sends requests to the routers, and their shares.")
keys_app = typer_app("Client keys for the routers (operator): create, list, set limits, revoke.")

TENANT_COLUMNS = [
    ("name", "name"),
    ("concurrency_share", "share"),
    ("keys", "active keys"),
    ("created_at", "created"),
]
KEY_COLUMNS = [
    ("id", "id"),
    ("name", "name"),
    ("tenant", "tenant"),
    ("requests_per_minute", "requests/min"),
    ("tokens_per_minute", "tokens/min"),
    ("active", "active"),
    ("created_at", "created"),
    ("expires_at", "expires"),
    ("revoked_at", "revoked"),
]
Share = Annotated[
    float,
    typer.Option("--share", help="Its part of a contended deployment's slots: 0 < share <= 1."),
]


@tenants_app.command("create")
@handled
def tenants_create(
    name: Annotated[str, typer.Argument(help="The tenant's name (like a deployment's).")],
    share: Share = 1.0,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Create a tenant."""
    body = {"name": name, "concurrency_share": share}
    show(api_client(url, token).request("POST", "/api/v1/tenants", json=body), output)


@tenants_app.command("list")
@handled
def tenants_list(url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE) -> None:
    """List tenants with their shares and counts of active keys."""
    rows = api_client(url, token).get("/api/v1/tenants")["results"]
    show(rows, output, TENANT_COLUMNS)


@tenants_app.command("set")
@handled
def tenants_set(
    name: Annotated[str, typer.Argument(help="The tenant.")],
    share: Share,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Change a tenant's concurrency share."""
    body = {"concurrency_share": share}
    show(api_client(url, token).request("PATCH", f"/api/v1/tenants/{name}", json=body), output)


@tenants_app.command("delete")
@handled
def tenants_delete(
    name: Annotated[str, typer.Argument(help="The tenant (it must have no active keys).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Delete a tenant without active keys (revoke them first)."""
    deleted = api_client(url, token).request("DELETE", f"/api/v1/tenants/{name}")
    typer.echo(f"deleted tenant {printable(deleted['name'])}")


def _limit(text: str | None, flag: str, maximum: int) -> int | None:
    """A limit option: a whole number, or `none` to lift it."""
    assert text is not None
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise CliError(f"{flag} {text!r}: give a whole number of at least 1, or none") from None
    if not 1 <= value <= maximum:
        raise CliError(f"{flag} {text!r}: give 1 to {maximum:,}, or none")
    return value


Rpm = Annotated[
    str | None,
    typer.Option("--rpm", help="Requests per minute (none: unlimited).", show_default=False),
]
Tpm = Annotated[
    str | None,
    typer.Option("--tpm", help="Tokens per minute (none: unlimited).", show_default=False),
]


def _limits(rpm: str | None, tpm: str | None) -> dict[str, Any]:
    from fleet.models import MAX_KEY_RPM, MAX_KEY_TPM

    body: dict[str, Any] = {}
    if rpm is not None:
        body["requests_per_minute"] = _limit(rpm, "--rpm", MAX_KEY_RPM)
    if tpm is not None:
        body["tokens_per_minute"] = _limit(tpm, "--tpm", MAX_KEY_TPM)
    return body


@keys_app.command("create")
@handled
def keys_create(
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant it acts for.")],
    name: Annotated[str, typer.Option("--name", help="Who or what holds it.")],
    rpm: Rpm = None,
    tpm: Tpm = None,
    expires_in: Annotated[
        str | None,
        typer.Option("--expires-in", help="Lifetime: 90d, 12h or 30m (default: never expires)."),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Create a client key and print it (the only time it is shown)."""
    from fleet.auth import parse_lifetime

    body: dict[str, Any] = {"tenant": tenant, "name": name, **_limits(rpm, tpm)}
    if expires_in is not None:
        parse_lifetime(expires_in)  # one line naming the accepted forms, before any request
        body["expires_in"] = expires_in
    created = api_client(url, token).request("POST", "/api/v1/client-keys", json=body)
    what = (
        f"client key {created['id']} ({printable(created['name'])}) for tenant "
        f"{printable(created['tenant'])}, expires {created['expires_at'] or 'never'}"
    )
    show_secret(created, "key", what, output)


@keys_app.command("list")
@handled
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's.")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List client keys (never their values: only hashes are stored)."""
    rows = api_client(url, token).get("/api/v1/client-keys", tenant=tenant)["results"]
    show(rows, output, KEY_COLUMNS)


@keys_app.command("set")
@handled
def keys_set(
    key_id: Annotated[int, typer.Argument(help="Key id (`keys list`).")],
    rpm: Rpm = None,
    tpm: Tpm = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Change a key's limits (`none` lifts one)."""
    body = _limits(rpm, tpm)
    if not body:
        raise CliError("nothing to change: give --rpm and/or --tpm (a number, or none)")
    updated = api_client(url, token).request("PATCH", f"/api/v1/client-keys/{key_id}", json=body)
    show(updated, output)


@keys_app.command("revoke")
@handled
def keys_revoke(
    key_id: Annotated[int, typer.Argument(help="Key id (`keys list`).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Revoke a key: routers refuse it from their next poll of the fleet."""
    info = api_client(url, token).request("DELETE", f"/api/v1/client-keys/{key_id}")
    typer.echo(
        f"revoked client key {info['id']} ({printable(info['name'])} of tenant "
        f"{printable(info['tenant'])})"
    )
