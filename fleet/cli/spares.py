"""`fleetctl spares` (the warm pool, booting spares for a deployment) and `fleetctl
autopilot` (automatic actions: status, pause, resume)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from fleet.cli.common import (
    DEFAULT_URL,
    Api,
    CliError,
    Out,
    Output,
    Token,
    Url,
    api_client,
    err_console,
    handled,
    printable,
    show,
    typer_app,
)

# `fleetctl spares` alone lists the pool; `fleetctl spares boot` boots some.
spares_app = typer_app(
    "Warm spares: the pool, and booting them for a deployment.", no_args_is_help=False
)
autopilot_app = typer_app("Automatic actions: status, pause, resume (and the breaker).")
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
    ("versions_cached", "cached"),
]
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
    body = api_client(url, token).get("/api/v1/spares")
    rows = [
        {"site": pool["site"], "gpu_model": pool["gpu_model"], **spare}
        for pool in body["pools"]
        for spare in pool["spares"]
    ]
    show(rows, output, SPARE_COLUMNS)


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
    api = api_client(url, token)
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
    show(
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


@autopilot_app.command("status")
@handled
def autopilot_status(
    url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Whether automatic actions run, and the breaker."""
    show(api_client(url, token).get("/api/v1/autopilot"), output)


@autopilot_app.command("pause")
@handled
def autopilot_pause(
    reason: Annotated[str, typer.Option("--reason")] = "paused by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Stop every automatic action (boots, drains, power cycles, returns)."""
    row = api_client(url, token).request("POST", "/api/v1/autopilot/pause", json={"reason": reason})
    typer.echo(f"autopilot paused: {printable(row['reason'], one_line=True)}")


@autopilot_app.command("resume")
@handled
def autopilot_resume(
    reason: Annotated[str, typer.Option("--reason")] = "resumed by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Resume automatic actions (and close an open breaker)."""
    api_client(url, token).request("POST", "/api/v1/autopilot/resume", json={"reason": reason})
    typer.echo("autopilot running")
