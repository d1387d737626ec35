"""`fleetctl db`: the database schema (Alembic migrations), on the database directly."""

from __future__ import annotations

import typer

from fleet.cli.common import (
    handled,
    load_settings,
    typer_app,
)

db_app = typer_app("Database schema (Alembic migrations).")


@db_app.command("upgrade")
@handled
def db_upgrade() -> None:
    """Migrate the database to the code's schema."""
    from fleet import db

    engine = db.engine_from_settings(load_settings())
    before = db.current_revision(engine)
    db.upgrade(engine)
    after = db.current_revision(engine)
    typer.echo(f"database at {after}" + (f" (was {before or 'empty'})" if before != after else ""))


@db_app.command("current")
@handled
def db_current() -> None:
    """Show the schema revision of the database and of the code."""
    from fleet import db

    engine = db.engine_from_settings(load_settings())
    typer.echo(f"database: {db.current_revision(engine) or 'empty'}  code: {db.head_revision()}")
