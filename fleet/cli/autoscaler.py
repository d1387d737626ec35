"""`fleetctl autoscaler`: its view, its decisions and why (fleet/autoscaler/)."""

from __future__ import annotations

from typing import Annotated

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
    typer_app,
)

autoscaler_app = typer_app("The autoscaler: its view, its decisions and why.")
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
    rows = api_client(url, token).get("/api/v1/autoscaler")["results"]
    for row in rows:
        for key in ("queue_per_gpu", "kv_use", "p95_latency_s"):
            value = row["signals"].get(key)
            row[key] = round(value, 3) if isinstance(value, float) else value
    show(rows, output, AUTOSCALER_COLUMNS)


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
    body = api_client(url, token).get(f"/api/v1/autoscaler/{deployment}/decisions", limit=limit)
    show(body["results"], output, DECISION_COLUMNS)


@autoscaler_app.command("explain")
@handled
def autoscaler_explain(
    deployment: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """The last decision for the deployment: the rule, why, the spare placement would boot
    next and its boot figure (cached or not: what the look-ahead counted on), the spares a
    scale-up asked for, and every input it used."""
    body = api_client(url, token).get(f"/api/v1/autoscaler/{deployment}/decisions", limit=1)
    if not body["results"]:
        raise CliError(f"no decision for {deployment} yet (the autoscaler runs in the leader)")
    last = body["results"][0]
    if output is Output.JSON:
        show(last, output)
        return
    typer.echo(
        f"{deployment}: {last['rule']} at {last['at']}: target {last['target_before']} → "
        f"{last['target_after']}"
    )
    typer.echo(f"why: {printable(last['reason'], one_line=True)}")
    inputs = dict(last["inputs"])
    chosen = inputs.pop("placement", None)
    next_spare = inputs.pop("next_spare", None)
    basis = inputs.pop("boot_basis", None)
    if next_spare:
        typer.echo(f"next spare: {printable(str(next_spare), one_line=True)}")
    if basis:
        typer.echo(f"boot figure: {printable(str(basis), one_line=True)}")
    forecast = _forecast_line(inputs)
    if forecast:
        typer.echo(f"forecast: {printable(forecast, one_line=True)}")
    if isinstance(chosen, list) and chosen:
        typer.echo("placement for this scale-up:")
        for line in chosen:
            typer.echo(f"  {printable(str(line), one_line=True)}")
    show(inputs, output, title="inputs")


def _forecast_line(inputs: dict[str, object]) -> str | None:
    """Predictive scaling's side of the decision (fleet/autoscaler/demand.py): its state, the
    servers it wanted and on what, against the reactive rules' answer, and which won."""
    how = inputs.pop("forecast", None)
    servers = inputs.pop("forecast_servers", None)
    basis = inputs.pop("forecast_basis", None)
    reactive = inputs.pop("reactive_target", None)
    rule = inputs.pop("reactive_rule", None)
    won = inputs.pop("won", None)
    if how is None and servers is None:
        return None
    line = str(how) if how is not None else "on"
    if servers is not None:
        line += (
            f"; wants {servers} servers ({basis}) against reactive {reactive} ({rule}): {won} won"
        )
    return line
