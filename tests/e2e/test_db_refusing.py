"""Postgres refusing the service's connections (out of connection slots) gives 503 with
`Retry-After`, never 500, and the service recovers by itself once connections are allowed.

The slots run out for the service's own database role: `ALTER ROLE ... CONNECTION LIMIT 0`
makes Postgres refuse each new connection ("too many connections for role"), as it refuses
them when `max_connections` is reached ("sorry, too many clients already"): both are a
connection failure (SQLAlchemy's OperationalError). Its pool is emptied first, so every
request needs a new connection.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from live import make_token, serve
from sqlalchemy.engine import Engine

from fleet import db as fleet_db
from fleet.models import Role

API = "/api/v1"


@pytest.fixture
def limited_role(pg_url: str, db: Engine) -> Iterator[str]:
    """A login role of the test's own with every right on the test database's tables; its URL."""
    role = f"fleet_limited_{os.getpid()}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP ROLE IF EXISTS "{role}"'))
        conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
        for grant in (
            "ALL ON ALL TABLES IN SCHEMA public",
            "ALL ON ALL SEQUENCES IN SCHEMA public",
            "USAGE ON SCHEMA public",
        ):
            conn.execute(sa.text(f'GRANT {grant} TO "{role}"'))
    try:
        yield sa.make_url(pg_url).set(username=role).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"
                ),
                {"r": role},
            )
            conn.execute(sa.text(f'DROP OWNED BY "{role}"'))
            conn.execute(sa.text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


def set_limit(pg_url: str, role: str, limit: int) -> None:
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER ROLE "{role}" CONNECTION LIMIT {limit}'))
    finally:
        admin.dispose()


def test_refused_connections_are_503_with_retry_after_and_the_service_recovers(
    limited_role: str, pg_url: str, db: Engine, tmp_path: Path
) -> None:
    role = sa.make_url(limited_role).username
    assert role
    engine = fleet_db.make_engine(limited_role, pool_size=4, max_overflow=2, pool_timeout=2)
    token = make_token(db, Role.VIEWER, name="viewer")
    try:
        with serve(engine, tmp_path, api_max_in_flight=4) as service:
            client = service.client(token)
            assert client.get(f"{API}/servers").status_code == 200

            engine.dispose()  # the pool's connections go: each request needs a new one
            set_limit(pg_url, role, 0)
            answers: list[httpx.Response] = []
            guard = threading.Lock()

            def ask() -> None:
                with httpx.Client(
                    base_url=service.url, headers={"Authorization": f"Bearer {token}"}
                ) as own:
                    for _ in range(5):
                        reply = own.get(f"{API}/servers", timeout=30)
                        with guard:
                            answers.append(reply)

            askers = [threading.Thread(target=ask) for _ in range(6)]
            for asker in askers:
                asker.start()
            for asker in askers:
                asker.join(timeout=60)
            assert len(answers) == 30
            statuses = sorted({reply.status_code for reply in answers})
            assert statuses == [503], statuses
            for reply in answers:
                assert int(reply.headers["Retry-After"]) >= 1
                detail = reply.json()["detail"]
                assert "database" in detail and "too many" not in detail, detail

            set_limit(pg_url, role, -1)
            assert client.get(f"{API}/servers").status_code == 200  # by itself, at once
    finally:
        set_limit(pg_url, role, -1)
        engine.dispose()
