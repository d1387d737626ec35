"""Why the service's engine can run without server-side prepared statements
(`FLEET_DB_PREPARED_STATEMENTS=false`), against Debian's PgBouncer in transaction mode.

psycopg prepares a statement on its 5th run on a connection (`prepare_threshold`), under a
name counted per client connection (`_pg3_0`, ...). Behind a transaction-mode pooler before
PgBouncer 1.21 the prepared statement lives on whichever server connection ran it: with one
server connection and two client connections, the second client's `_pg3_0` collides with the
first's. And `fleetctl db upgrade` through PgBouncer: the whole upgrade is one transaction.
(The service itself behind PgBouncer: tests/e2e/test_power_api.py and test_leader.py.)
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pg import throwaway_database
from pgbouncer_peer import PgBouncerPeer, pgbouncer_binary, pgbouncer_peer
from pydantic import SecretStr

from fleet import db
from fleet.db import engine_from_settings
from fleet.settings import Settings

pytestmark = pytest.mark.skipif(
    pgbouncer_binary() is None, reason="pgbouncer not installed (Debian pgbouncer)"
)


def pgbouncer_version() -> tuple[int, int]:
    binary = pgbouncer_binary()
    assert binary is not None
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    assert found, out
    return int(found[1]), int(found[2])


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncerPeer]:
    with pgbouncer_peer(server_connections=1) as peer:
        yield peer


def run_twice_per_client(bouncer: PgBouncerPeer, pg_url: str, prepared: bool, tmp: Path) -> None:
    """Two client connections of the service's engine, each running one statement 8 times in
    transactions of its own (commits: a rollback would reset psycopg's counts)."""
    database = sa.make_url(pg_url).database
    assert database
    settings = Settings(
        data_dir=tmp,
        database_url=bouncer.url(database),
        secret_key=SecretStr("x" * 44),
        db_prepared_statements=prepared,
    )
    engine = engine_from_settings(settings)
    try:
        first, second = engine.connect(), engine.connect()
        try:
            for _ in range(8):
                for conn in (first, second):
                    assert conn.execute(sa.text("SELECT 1 + :n"), {"n": 1}).scalar() == 2
                    conn.commit()
        finally:
            first.close()
            second.close()
    finally:
        engine.dispose()


def test_the_services_engine_without_prepared_statements_shares_one_server_connection(
    bouncer: PgBouncerPeer, pg_url: str, tmp_path: Path
) -> None:
    run_twice_per_client(bouncer, pg_url, prepared=False, tmp=tmp_path)


def test_prepared_statements_collide_behind_pgbouncer_before_1_21(
    bouncer: PgBouncerPeer, pg_url: str, tmp_path: Path
) -> None:
    """What the setting is for: with prepared statements on, the second client's prepare fails
    (PgBouncer 1.21 and later track prepared statements themselves when configured to)."""
    if pgbouncer_version() >= (1, 21):
        pytest.skip("PgBouncer 1.21+ can carry prepared statements across server connections")
    with pytest.raises(sa.exc.DBAPIError, match="prepared statement"):
        run_twice_per_client(bouncer, pg_url, prepared=True, tmp=tmp_path)


def test_the_schema_migrates_through_pgbouncer(bouncer: PgBouncerPeer, pg_url: str) -> None:
    admin = sa.make_url(pg_url).set(database="postgres").render_as_string(hide_password=False)
    with throwaway_database("fleet_bouncer", admin) as url:
        database = sa.make_url(url).database
        assert database
        engine = db.make_engine(bouncer.url(database), connect_args={"prepare_threshold": None})
        try:
            db.upgrade(engine)
            db.check_migrated(engine)
        finally:
            engine.dispose()
