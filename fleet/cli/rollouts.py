"""`fleetctl deployments rollout|rollback|rollout-status`: a new model version, step by step
(fleet/rollout/; docs/router.md)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from fleet.cli.common import DEFAULT_URL, Out, Output, Token, Url, api_client, handled, show

SERVER_COLUMNS = [
    ("server", "server"),
    ("state", "state"),
    ("version", "version"),
    ("ready", "ready"),
]


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    """The status as one table: the plan, where it stands, the last analysis."""
    r = row.get("rollout") or {}
    analysis = r.get("analysis") or {}
    figures = analysis.get("figures") or {}
    steps = r.get("steps") or []
    out: dict[str, Any] = {
        "deployment": row["deployment"],
        "serves": row.get("model_version"),
        "canary": row.get("canary_version"),
        "canary weight": f"{float(row.get('canary_weight') or 0):.1%}",
        "status": r.get("status") or "none",
        "phase": r.get("phase"),
        "rollout": f"{r.get('from_version')} → {r.get('version')}" if r else None,
        "steps": ", ".join(f"{float(w):.1%}" for w in steps) or None,
        "step": f"{int(r.get('step') or 0) + 1} of {len(steps)}" if steps else None,
        "waiting for": r.get("waiting"),
        "last analysis": (
            f"{analysis.get('outcome')}: {analysis.get('reason')}" if analysis else None
        ),
    }
    for side in ("stable", "canary"):
        f = figures.get(side)
        if f:
            out[f"{side} figures"] = (
                f"{f.get('requests')} requests, {f.get('errors')} errors "
                f"({float(f.get('error_rate') or 0):.1%}), p95 {_ms(f.get('p95_s'))}, "
                f"TTFT p95 {_ms(f.get('ttft_p95_s'))}"
            )
    if r.get("reason"):
        out["reason"] = r["reason"]
    return out


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{float(seconds) * 1000:.0f} ms"


def register(app: typer.Typer) -> None:
    """Add the rollout commands to `fleetctl deployments`."""

    @app.command("rollout")
    @handled
    def deployments_rollout(
        name: str,
        version: Annotated[
            str, typer.Option("--version", help='The version: "<model>@<version>" or its name.')
        ],
        canary: Annotated[
            str | None, typer.Option("--canary", help="The first step's share (default 5%).")
        ] = None,
        step: Annotated[
            list[str] | None,
            typer.Option("--step", help="A later step's share; repeat (default 25%, 50%)."),
        ] = None,
        step_s: Annotated[
            float | None,
            typer.Option("--step-s", min=0.001, help="Each step's window in seconds."),
        ] = None,
        min_requests: Annotated[
            int | None,
            typer.Option("--min-requests", min=1, help="Canary requests a verdict needs."),
        ] = None,
        url: Url = DEFAULT_URL,
        token: Token = None,
        output: Out = Output.TABLE,
    ) -> None:
        """Roll a new model version out: a canary share, judged against the stable version
        step by step, rolled back automatically on a regression."""
        body: dict[str, Any] = {"version": version, "canary": canary, "steps": step or []}
        if step_s is not None:
            body["step_s"] = step_s
        if min_requests is not None:
            body["min_requests"] = min_requests
        row = api_client(url, token).request(
            "POST", f"/api/v1/deployments/{name}/rollout", json=body
        )
        show(row if output is Output.JSON else _summary(row), output)

    @app.command("rollback")
    @handled
    def deployments_rollback(
        name: str,
        reason: Annotated[str, typer.Option("--reason", help="Why (in the Event).")] = "",
        url: Url = DEFAULT_URL,
        token: Token = None,
        output: Out = Output.TABLE,
    ) -> None:
        """Roll the running rollout back now (weight 0, canary servers back)."""
        row = api_client(url, token).request(
            "POST", f"/api/v1/deployments/{name}/rollback", json={"reason": reason}
        )
        show(row if output is Output.JSON else _summary(row), output)

    @app.command("rollout-status")
    @handled
    def deployments_rollout_status(
        name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
    ) -> None:
        """Where a deployment's rollout stands: plan, step, last analysis, servers' versions."""
        row = api_client(url, token).get(f"/api/v1/deployments/{name}/rollout")
        if output is Output.JSON:
            show(row, output)
            return
        show(_summary(row), output)
        show(row.get("servers") or [], output, SERVER_COLUMNS)
