"""`fleetctl schedule`: the scheduled-scaling calendar (fleet/calendar/)."""

from __future__ import annotations

import re
from datetime import datetime
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
    show,
    typer_app,
)

schedule_app = typer_app("The scheduled-scaling calendar: floors at known times, booted early.")
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
    row = api_client(url, token).request("POST", "/api/v1/schedules", json=body)
    if output is Output.JSON:
        show(row, output)
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
    rows = api_client(url, token).get("/api/v1/schedules", deployment=deployment)["results"]
    if output is Output.TABLE:
        for row in rows:
            nxt = row["next"] or {}
            row["ends"] = row["end_cron"] or f"+{row['duration_s']} s"
            row["state"] = f"open until {row['active_until']}" if row["active"] else "waiting"
            row["next_local"] = _local(nxt.get("start_local"))
            row["boot_local"] = _local(nxt.get("boot_at_local"))
    show(rows, output, SCHEDULE_COLUMNS)


@schedule_app.command("rm")
@handled
def schedule_rm(entry_id: int, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Remove an entry (an open window's floor goes at the calendar's next tick)."""
    api_client(url, token).request("DELETE", f"/api/v1/schedules/{entry_id}")
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
    api = api_client(url, token)
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
        show(body, output)
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
    show(rows, output, PREVIEW_COLUMNS, title=title)
