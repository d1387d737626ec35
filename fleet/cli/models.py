"""`fleetctl models`: model versions and their files."""

from __future__ import annotations

from fleet.cli.common import typer_app

models_app = typer_app("Model versions and their files (docs/weights.md).")
