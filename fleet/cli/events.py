"""`fleetctl events`: the event log, and following it as it grows."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from fleet.cli.common import (
    DEFAULT_URL,
    Out,
    Output,
    Token,
    Url,
    api_client,
    handled,
    printable,
    show,
)

EVENT_COLUMNS = [
    ("at", "time"),
    ("subject", "subject"),
    ("kind", "kind"),
    ("from_state", "from"),
    ("to_state", "to"),
    ("actor", "actor"),
    ("message", "message"),
]


@handled
def events(
    subject: Annotated[str | None, typer.Option(help="e.g. a server name.")] = None,
    subject_type: Annotated[
        str | None, typer.Option("--type", help="server, deployment, …")
    ] = None,
    kind: Annotated[str | None, typer.Option(help="e.g. server.transition, or server.")] = None,
    since: Annotated[str | None, typer.Option(help="ISO 8601 time.")] = None,
    limit: Annotated[int, typer.Option("--limit")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then print new events as they happen.")
    ] = False,
    follow_for: Annotated[
        float | None, typer.Option(help="With --follow: stop after this many seconds.")
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Show events, newest first; with --follow, then every new one as it happens (oldest
    first, one line each, until Ctrl-C or --follow-for)."""
    api = api_client(url, token)
    filters = {"subject": subject, "subject_type": subject_type, "kind": kind}
    rows = list(api.pages("/api/v1/events", limit, since=since, **filters))
    if not follow:
        show(rows, output, EVENT_COLUMNS)
        return
    for row in reversed(rows):
        echo_event(row, output)
    seen = {row["id"] for row in rows}
    after = rows[0]["at"] if rows else since
    deadline = None if follow_for is None else time.monotonic() + follow_for
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.5)
        new = [
            r
            for r in api.pages("/api/v1/events", 1000, since=after, **filters)
            if r["id"] not in seen
        ]
        for row in sorted(new, key=lambda r: r["id"]):
            echo_event(row, output)
            seen.add(row["id"])
            after = row["at"]


def echo_event(row: dict[str, Any], output: Output) -> None:
    if output is Output.JSON:
        typer.echo(json.dumps(row, default=str))
        return
    change = f" {row['from_state']} → {row['to_state']}" if row.get("to_state") else ""
    line = f"{row['at']}  {row['subject']}  {row['kind']}{change}  {row['message']}"
    typer.echo(printable(line, one_line=True))
