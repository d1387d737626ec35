"""Throwaway Postgres databases for tests: created on the local server, dropped after."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fleet import db

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@contextmanager
def throwaway_database(prefix: str, admin_url: str = ADMIN_URL, options: str = "") -> Iterator[str]:
    """Create `<prefix>_<pid>_<hex>` (with CREATE DATABASE `options`), yield its URL, drop it
    (WITH (FORCE): connections a failed test left open do not keep it alive)."""
    admin = sa.create_engine(
        admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}" {options}'))
        try:
            yield sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextmanager
def migrated_database(prefix: str, pg_url: str) -> Iterator[Engine]:
    """A throwaway database on `pg_url`'s server, migrated to head, for a test that needs one of
    its own (leadership is per database; junk it writes stays there); disposed and dropped."""
    admin = sa.make_url(pg_url).set(database="postgres").render_as_string(hide_password=False)
    with throwaway_database(prefix, admin) as url:
        engine = db.make_engine(url)
        try:
            db.upgrade(engine)
            yield engine
        finally:
            engine.dispose()


def world_database(stack: ExitStack, prefix: str) -> str:
    """A throwaway database for a whole-world test module, dropped when `stack` closes; the
    module is skipped where Postgres is not reachable, and fails in CI."""
    try:
        return stack.enter_context(throwaway_database(prefix))
    except sa.exc.OperationalError as exc:
        message = f"Postgres not available at {ADMIN_URL}: {str(exc.orig or exc).splitlines()[0]}"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
