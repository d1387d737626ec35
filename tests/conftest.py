"""Shared database harness: every database test runs on SQLite and on Postgres.

`engine` (session scope) is one freshly migrated database per backend: a SQLite file, or a
throwaway Postgres database on 127.0.0.1:5432 that is dropped at the end of the run. `db` empties
every table before each test; `session` is an ORM session on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

import pytest
import sqlalchemy as sa
from factories import TEST_SECRET_KEY
from pg import ADMIN_URL, throwaway_database
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet import db as fleet_db
from fleet.settings import get_settings

ALEMBIC_TABLE = "alembic_version"
# A failing test reports its own failure even when pytest's traceback formatting fails.
pytest_plugins = ["failure_reports"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep every test away from ~/.local/share/fleet and from the developer's FLEET_* env."""
    data_dir = tmp_path_factory.mktemp("fleet-data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEET_DATA_DIR", str(data_dir))
        mp.delenv("FLEET_DATABASE_URL", raising=False)
        mp.delenv("FLEET_SECRET_KEY", raising=False)
        # Control loops run only where a test starts them (test_reconciler, test_leader).
        mp.setenv("FLEET_RUN_LOOPS", "false")
        # An in-process `fleetctl simulate` would otherwise load the compiled simulator's
        # modules (fleet/sim/native.py) for the rest of the session; test_sim_native runs
        # them in processes of their own.
        mp.setenv("FLEET_SIM_NATIVE", "off")
        get_settings.cache_clear()
        yield data_dir
    get_settings.cache_clear()


@pytest.fixture(autouse=True)
def _pyghmi_io_thread_survives() -> Iterator[None]:
    """pyghmi reads every IPMI answer of the process on one I/O thread: a test after which it
    is dead would leave every later IPMI test hanging. Name the culprit instead."""
    yield
    module = sys.modules.get("pyghmi.ipmi.private.session")
    thread = getattr(module, "iothread", None)
    if thread is not None and not thread.is_alive():
        from fleet.bmc.ipmi import _revive_io_thread

        _revive_io_thread()  # so that later tests run on a working thread
        pytest.fail("pyghmi's I/O thread died during this test", pytrace=False)


@pytest.fixture
def secret_key() -> bytes:
    """A fixed, valid Fernet key (the one tests/factories.py encrypts BMC passwords with)."""
    return TEST_SECRET_KEY


def _postgres_unavailable(message: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"Postgres is required in CI: {message}", pytrace=False)
    pytest.skip(f"Postgres not available: {message}")


def _sqlite_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = tmp_path_factory.mktemp("sqlite") / "fleet.db"
    engine = fleet_db.make_engine(f"sqlite:///{path}")
    try:
        fleet_db.upgrade(engine)
        yield engine
    finally:
        engine.dispose()


def _postgres_engine() -> Iterator[Engine]:
    with ExitStack() as stack:
        unreachable: str | None = None
        try:
            url = stack.enter_context(throwaway_database("fleet_test"))
        except sa.exc.OperationalError as exc:
            unreachable = str(exc.orig or exc).strip().splitlines()[0]
        if unreachable is not None:  # outside the except block: a one-line failure, no chain
            _postgres_unavailable(f"cannot connect to {ADMIN_URL} ({unreachable})")
        engine = fleet_db.make_engine(url)
        stack.callback(engine.dispose)
        fleet_db.upgrade(engine)
        yield engine


@pytest.fixture(
    scope="session",
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    ids=["sqlite", "postgres"],
)
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A freshly migrated (Alembic, the real migrations) database, one per backend."""
    if request.param == "sqlite":
        yield from _sqlite_engine(tmp_path_factory)
    else:
        yield from _postgres_engine()


@pytest.fixture(scope="session")
def _wipe_sql(engine: Engine) -> list[str]:
    """The statements that empty every table of `engine` (worked out once per backend).

    The tables come from the database itself (reflected), so a table that only a migration
    knows about is emptied too; children are deleted before their parents. On Postgres this is
    DELETE plus a reset of every sequence rather than TRUNCATE … RESTART IDENTITY: the effect is
    the same, but TRUNCATE creates and syncs new files for each table (~70 ms a test here,
    against ~2 ms for the DELETEs on tables this small).
    """
    reflected = sa.MetaData()
    reflected.reflect(engine)
    ordered = [t.name for t in reversed(reflected.sorted_tables) if t.name != ALEMBIC_TABLE]
    statements = [f'DELETE FROM "{name}"' for name in ordered]
    if engine.dialect.name == "postgresql":
        return [
            "SET LOCAL lock_timeout = '10s'",  # a leaked transaction fails the test, not hangs it
            "SET LOCAL fleet.event_maintenance = 'on'",  # events are append-only otherwise
            *statements,
            "SELECT setval(seqrelid::regclass, seqstart, false) FROM pg_sequence",
        ]
    with engine.connect() as conn:
        has_sequence = conn.execute(
            sa.text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_sequence'")
        ).first()
    if has_sequence:
        statements.append("DELETE FROM sqlite_sequence")
    return statements


@pytest.fixture
def db(engine: Engine, _wipe_sql: list[str]) -> Engine:
    """`engine`, with every table empty (alembic_version kept) and ids starting again at 1."""
    with engine.begin() as conn:
        for statement in _wipe_sql:
            conn.execute(sa.text(statement))
    return engine


@pytest.fixture
def session(db: Engine) -> Iterator[Session]:
    with Session(db, expire_on_commit=False) as session:
        yield session


@pytest.fixture
def pg_url(engine: Engine) -> str:
    """The URL of the throwaway Postgres database; tests using it run on Postgres only."""
    assert engine.dialect.name == "postgresql", "deselected on SQLite by the hook below"
    return engine.url.render_as_string(hide_password=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A Postgres-only test (it asks for `pg_url`) has no SQLite run: deselect it there rather
    than skip it, so that a skip always means "Postgres is missing"."""
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_sqlite = callspec is not None and callspec.params.get("engine") == "sqlite"
        needs_pg = "pg_url" in getattr(item, "fixturenames", ())
        (drop if on_sqlite and needs_pg else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent when xdist is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` (as `./run test` runs): the tests that run whole worlds stay one at a time."""
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist keeps xdist's own scheduler
    from workers import OneAtATimeScheduling

    return OneAtATimeScheduling(config, log)
