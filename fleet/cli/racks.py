"""`fleetctl racks`: each rack's power — budget, mode, committed, headroom, drawn now, peak over
24 h, p99 over 7 days, the GPU cap, and an admin's override while one holds — and `fleetctl
racks set` (budget mode and margin, docs/power.md)."""

from __future__ import annotations

import math
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
    cell,
    console,
    handled,
    show,
    typer_app,
)

# `fleetctl racks` alone lists them; `fleetctl racks set RACK …` changes one.
racks_app = typer_app(
    "Racks: power budget, mode, committed and drawn power; set a rack's budget mode.",
    no_args_is_help=False,
)

RACK_COLUMNS = [
    ("name", "rack"),
    ("site", "site"),
    ("status", "status"),
    ("servers", "servers #"),
    ("budget_w", "budget W"),
    ("committed_w", "committed W"),
    ("headroom_w", "headroom W"),
    ("all_on_w", "all-on W"),
    ("mode", "mode"),
    ("drawn", "drawn W"),
    ("peak_24h_w", "peak 24h W"),
    ("p99_7d_w", "p99 7d W"),
    ("cap", "GPU cap"),
]
# Marks a drawn figure of which some part is an agent-based estimate (no BMC reading).
ESTIMATE_MARK = "~"


def _mode(rack: dict[str, Any]) -> str:
    if rack.get("budget_mode") == "measured":
        return f"measured ×{rack['budget_margin']:g}"
    return str(rack.get("budget_mode") or "-")


def _drawn(rack: dict[str, Any]) -> str:
    drawn = rack.get("drawn_w")
    if drawn is None:
        return "-"
    mark = ESTIMATE_MARK if rack.get("drawn_estimated_w") else ""
    return f"{mark}{cell(float(drawn))}"


def _cap(rack: dict[str, Any]) -> str:
    cap = rack.get("gpu_cap_pct")
    return "-" if cap is None else f"{cap:g} % TDP"


def table_row(rack: dict[str, Any]) -> dict[str, Any]:
    """A rack as the API gives it, with the text of the columns this command composes."""
    return rack | {"mode": _mode(rack), "drawn": _drawn(rack), "cap": _cap(rack)}


def notes(racks: list[dict[str, Any]]) -> list[str]:
    """The lines under the table: each override that holds, and what the estimate mark means."""
    lines = [
        f"{r['name']}: budget override by {r.get('budget_override_by') or '?'} since "
        f"{r['budget_override_at']}: {r.get('budget_override_reason') or '(no reason given)'}"
        for r in racks
        if r.get("budget_override_at")
    ]
    if any(r.get("drawn_w") is not None and r.get("drawn_estimated_w") for r in racks):
        lines.append(
            f"{ESTIMATE_MARK}: part of the drawn power is an agent-based estimate (GPU power plus "
            "idle) where a BMC gives no reading"
        )
    return lines


def _show(racks: list[dict[str, Any]], output: Output) -> None:
    if output is Output.JSON:
        show(racks, output)
        return
    show([table_row(r) for r in racks], output, RACK_COLUMNS)
    for line in notes(racks):
        console.print(line, markup=False, highlight=False)


@racks_app.callback(invoke_without_command=True)
@handled
def racks(
    ctx: typer.Context,
    site: Annotated[str | None, typer.Option(help="Only this site.")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List racks with their power: budget, mode, committed, headroom, drawn now (~: partly
    estimated), peak over 24 h, p99 over 7 days, GPU cap, and any budget override."""
    if ctx.invoked_subcommand is not None:
        return
    _show(list(api_client(url, token).pages("/api/v1/racks", None, site=site)), output)


@racks_app.command("set")
@handled
def racks_set(
    rack: Annotated[str, typer.Argument(help="The rack.")],
    # Text, not a choice: the service checks it and its 422 names the field, in one line.
    mode: Annotated[
        str | None,
        typer.Option(help="nameplate (servers commit their maximum) or measured (p99 × margin)."),
    ] = None,
    margin: Annotated[
        float | None, typer.Option(help="Measured mode's safety margin, 1.0-2.0 (default 1.15).")
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Set how a rack's servers commit power (budget mode and margin).

    `--mode measured --margin 1.2` commits each at its measured p99 draw × 1.2 (its maximum
    until an hour of history exists); `--mode nameplate` at its maximum."""
    body: dict[str, Any] = {}
    if mode is not None:
        body["budget_mode"] = mode
    if margin is not None:
        if not math.isfinite(margin):  # JSON has no NaN: refused here, naming the option
            raise CliError("--margin: must be a finite number")
        body["budget_margin"] = margin
    if not body:
        raise CliError("nothing to set: give --mode and/or --margin")
    updated = api_client(url, token).request("PATCH", f"/api/v1/racks/{rack}", json=body)
    _show([updated], output)
