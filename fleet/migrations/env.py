"""Alembic environment: the engine comes from fleet.db (settings), the target from the models."""

from __future__ import annotations

import warnings

from alembic import context
from sqlmodel import SQLModel

import fleet.models  # noqa: F401  (registers every table on SQLModel.metadata)
from fleet.db import engine_from_settings
from fleet.settings import get_settings

config = context.config
target_metadata = SQLModel.metadata


# SQLite cannot reflect expression indexes (uq_server_bmc_endpoint), so autogenerate cannot
# compare them: expected, and said once here rather than on every run.
warnings.filterwarnings("ignore", message=".*expression-based index.*")


def run_migrations_online() -> None:
    engine = config.attributes.get("engine") or engine_from_settings(get_settings())
    with engine.begin() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; connect to a database")
run_migrations_online()
