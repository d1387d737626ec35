"""`fleetctl inventory`: import, validate and export inventory files through the API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli.common import (
    DEFAULT_URL,
    Api,
    CliError,
    Out,
    Output,
    Token,
    Url,
    api_client,
    handled,
    printable,
    show,
    typer_app,
)

inventory_app = typer_app("Inventory files: import, export, validate.")


def print_report(report: dict[str, Any], path: Path | str) -> None:
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
            typer.echo(printable(f"  {change['action']} {change['kind']} {change['name']}{fields}"))
    for warning in report["warnings"]:
        typer.echo(f"warning: {printable(warning, one_line=True)}", err=True)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}{'s' if v != 1 else ''}" for k, v in counts.items()) or "nothing"


def send_inventory(api: Api, path: Path, endpoint: str, dry_run: bool) -> dict[str, Any]:
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
    report = send_inventory(api_client(url, token), file, "import", dry_run)
    if output is Output.JSON:
        show(report, output)
    else:
        print_report(report, file)


@inventory_app.command("validate")
@handled
def inventory_validate(
    file: Annotated[Path, typer.Argument(help="Inventory YAML file.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Check a file against the fleet as an import would; writes nothing."""
    report = send_inventory(api_client(url, token), file, "validate", False)
    if output is Output.JSON:
        show(report, output)
        return
    changes = len(report["changes"])
    typer.echo(f"{file}: valid; an import would make {changes} change{'s' if changes != 1 else ''}")
    for warning in report["warnings"]:
        typer.echo(f"warning: {printable(warning, one_line=True)}", err=True)


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
    text = api_client(url, token).request("GET", "/api/v1/inventory/export")
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)
