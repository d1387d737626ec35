"""`fleetctl sites` and `servers`: listing, power, verify and the operator's
lifecycle moves (transition, drain, maintenance, release, retire)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from fleet.cli.common import (
    DEFAULT_URL,
    CliError,
    Out,
    Output,
    Token,
    Url,
    api_client,
    console,
    err_console,
    handled,
    show,
    typer_app,
)

servers_app = typer_app("GPU servers.")

SITE_COLUMNS = [
    ("name", "site"),
    ("description", "description"),
    ("rack_count", "racks #"),
    ("server_count", "servers #"),
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
Limit = Annotated[int | None, typer.Option("--limit", help="At most this many rows (default all).")]


@handled
def sites(url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE) -> None:
    """List sites."""
    show(list(api_client(url, token).pages("/api/v1/sites", None)), output, SITE_COLUMNS)


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
        api_client(url, token).pages(
            "/api/v1/servers",
            limit,
            site=site,
            rack=rack,
            pool=pool,
            state=state,
            gpu_model=gpu_model,
        )
    )
    show(rows, output, SERVER_COLUMNS)


@servers_app.command("show")
@handled
def servers_show(
    name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Show one server."""
    show(api_client(url, token).get(f"/api/v1/servers/{name}"), output)


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
    override_budget: Annotated[
        bool,
        typer.Option(
            "--override-budget",
            help="Power on even past the rack's budget (admins only; needs --reason).",
        ),
    ] = False,
    reason: Annotated[
        str | None,
        typer.Option("--reason", help="Why the budget may be exceeded (recorded on the rack)."),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Power servers on/off/cycle through their BMCs, or read their power state.

    Power-ons are staggered per rack (inrush current) and pass the rack's budget gate: what
    fits is powered on, the rest fail naming the rack, the watts needed and the headroom. An
    admin may override with --override-budget --reason TEXT (an Event, shown on the rack).
    Every result is read back from the BMC. Exit code 1 if any server failed.
    """
    if override_budget and not (reason or "").strip():
        raise CliError("--override-budget needs --reason TEXT (why the budget may be exceeded)")
    if reason is not None and not override_budget:
        raise CliError("--reason goes with --override-budget")
    filters = {"site": site, "rack": rack, "pool": pool, "state": state, "gpu_model": gpu_model}
    body: dict[str, Any] = {"action": action, **_choose(names, filters)}
    if override_budget:
        body |= {"override_budget": True, "reason": reason}
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
        for line in api_client(url, token).stream_lines("POST", "/api/v1/power", json=body):
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
    show(results, output, POWER_COLUMNS)
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
        result = api_client(url, token).request("POST", "/api/v1/verify", json=body, timeout=None)
    show(result["results"], output, VERIFY_COLUMNS)
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
    result = api_client(url, token).request(
        "POST", f"/api/v1/servers/{name}/transition", json={"to": to, "reason": reason}
    )
    if output is Output.JSON:
        show(result, output)
    elif result["event"] is None:
        typer.echo(f"{name} is already {to}")
    else:
        typer.echo(f"{name}: {result['event']['from_state']} → {result['event']['to_state']}")


def _server_move(path: str, name: str, url: str, token: str | None) -> None:
    row = api_client(url, token).request("POST", f"/api/v1/servers/{name}/{path}")
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
    row = api_client(url, token).request("POST", f"/api/v1/servers/{name}/transition", json=body)
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
