"""Database engine, sessions, and the Alembic migrations that are the only way the schema moves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet.settings import ConfigError, Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# libpq's TCP keepalives on the service's Postgres connections: an idle pooled connection whose
# peer is gone is probed after 30 s and dropped after three unanswered probes 10 s apart.
TCP_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


class NotMigratedError(ConfigError):
    """The database schema is behind the code."""


def make_engine(url: str, **kwargs: Any) -> Engine:
    """hide_parameters on both backends: bound values (BMC ciphertext included) stay out of
    error messages and SQL logs."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            hide_parameters=True,
            **kwargs,
        )
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {"application_name": "fleet", **kwargs.pop("connect_args", {})}
    return sa.create_engine(
        url, pool_pre_ping=True, hide_parameters=True, connect_args=connect_args, **kwargs
    )


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def engine_from_settings(settings: Settings) -> Engine:
    """The service's engine: its pool sized with the API's admission (docs/api.md), and a
    short pool timeout (SQLAlchemy's `TimeoutError`, which the API answers with 503)."""
    url = settings.effective_database_url
    if sa.make_url(url).database in (None, "", ":memory:") and url.startswith("sqlite"):
        return make_engine(url)  # one connection per thread: there is no pool to size
    extra: dict[str, Any] = {}
    if not url.startswith("sqlite"):
        # How its sessions show in pg_stat_activity; psycopg prepares a statement on its 5th
        # run on a connection, which a transaction-mode pooler (PgBouncer < 1.21) breaks.
        connect_args: dict[str, Any] = {
            "application_name": settings.db_application_name,
            **postgres_timeouts(settings),
        }
        if not settings.db_prepared_statements:
            connect_args["prepare_threshold"] = None
        extra["connect_args"] = connect_args
    return make_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        pool_timeout=settings.db_pool_timeout_s,
        **extra,
    )


def postgres_timeouts(settings: Settings) -> dict[str, int]:
    """libpq's connection options that bound what a silent database host costs (Settings,
    `db_connect_timeout_s`): the connect timeout, TCP_USER_TIMEOUT and keepalives."""
    options = {"connect_timeout": settings.db_connect_timeout_s, **TCP_KEEPALIVES}
    if settings.db_tcp_user_timeout_s > 0:
        options["tcp_user_timeout"] = max(1, round(settings.db_tcp_user_timeout_s * 1000))
    return options


def probe_engine(engine: Engine, timeout_s: float = 3.0) -> Engine:
    """An engine without a pool on `engine`'s database, for checks that must not wait behind
    the requests' pool (the readiness probe); on Postgres, connecting and each transaction's
    statements are bounded by `timeout_s` (a `SET LOCAL` as each transaction begins, not a
    startup option, which PgBouncer refuses)."""
    postgres = engine.dialect.name == "postgresql"
    connect_args = (
        {"connect_timeout": max(int(timeout_s), 1)} if postgres else {"timeout": timeout_s}
    )
    probe = sa.create_engine(
        engine.url, poolclass=sa.NullPool, hide_parameters=True, connect_args=connect_args
    )
    if postgres:
        ms = max(int(timeout_s * 1000), 1)

        def bounded(conn: sa.Connection) -> None:
            conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")

        sa.event.listen(probe, "begin", bounded)
    return probe


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One transaction: committed on success, rolled back on any error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


@lru_cache(maxsize=1)
def head_revision() -> str | None:
    """The code's schema revision (read once: the migration files do not change at run time)."""
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    return script.get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return current_revision_on(conn)


def current_revision_on(conn: sa.Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(alembic_config(engine), revision)


def check_migrated(engine: Engine) -> None:
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise NotMigratedError(
            f"database schema is at {current or 'nothing'}, code needs {head}: "
            "run `fleetctl db upgrade`"
        )


def upsert(table: sa.Table, dialect: str) -> postgresql.Insert | sqlite.Insert:
    """An INSERT into `table` that takes `on_conflict_do_update` (Postgres and SQLite spell
    it alike; `dialect`: the bind's dialect name)."""
    return postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
