"""`fleetctl deployments rollout|rollback|rollout-status`: a new model version, step by step."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the rollout commands to `fleetctl deployments`."""
