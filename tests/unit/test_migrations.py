"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pg import throwaway_database
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, select

import fleet.models  # noqa: F401  (registers every table on SQLModel.metadata)
from fleet import db as fleet_db


def _compare_types(*_: Any) -> bool:
    # Enum columns are plain strings of a declared length in both: compared as such below.
    return False


def test_migrated_schema_matches_the_models(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": _compare_types})
        diff = compare_metadata(context, SQLModel.metadata)
    assert diff == []


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    with throwaway_database("fleet_migrations") as url:
        yield url


def test_every_migration_downgrades_and_upgrades_again(fresh_url: str) -> None:
    """Down to the initial schema and back: the schema still matches the models, and the
    expression index behind unique BMC endpoints (lost by a careless SQLite table copy) is
    still there."""
    engine = fleet_db.make_engine(fresh_url)
    try:
        fleet_db.upgrade(engine)
        config = fleet_db.alembic_config(engine)
        command.downgrade(config, "0001")
        command.upgrade(config, "head")
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": _compare_types})
            assert compare_metadata(context, SQLModel.metadata) == []
            # (SQLAlchemy's inspector leaves expression indexes out on SQLite: ask the catalog.)
            catalog = (
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'server'"
                if engine.dialect.name == "sqlite"
                else "SELECT indexname FROM pg_indexes WHERE tablename = 'server'"
            )
            indexes = set(conn.execute(sa.text(catalog)).scalars())
        assert "uq_server_bmc_endpoint" in indexes
    finally:
        engine.dispose()


def test_existing_deployments_survive_0012_with_an_external_version(fresh_url: str) -> None:
    """A deployment from before model versions gets an `external` version named from its
    weights' URI and checksum, keeps its identity (so its probe reference still matches), and a
    client giving the same URI and checksum again reuses that version (fleet/catalog/)."""
    from fleet.catalog.versions import external_version
    from fleet.models import ArtifactFormat, Deployment, ModelArtifact, ModelVersion

    engine = fleet_db.make_engine(fresh_url)
    uri, checksum = "s3://fleet-models/meta/Llama-3.1-8B-Instruct", "sha256:" + "ab" * 32
    try:
        config = fleet_db.alembic_config(engine)
        command.upgrade(config, "0011")
        now = "2026-12-01 00:00:00+00:00"
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO deployment (name, model_uri, model_checksum, engine_params,"
                    " gpus_per_replica, gpu_models, min_replicas, max_replicas,"
                    " sla_p95_latency_ms, sla_ttft_ms, disruption_budget, created_at, updated_at)"
                    " VALUES ('chat', :u, :c, '{}', 1, '[]', 0, 1, 2000, 300, 1, :t, :t)"
                ),
                {"u": uri, "c": checksum, "t": now},
            )
        command.upgrade(config, "head")
        with Session(engine) as session:
            dep = session.exec(select(Deployment)).one()
            version = session.get(ModelVersion, dep.model_version_id)
            assert version is not None
            name = "legacy-" + hashlib.sha256(f"{uri}\n{checksum}".encode()).hexdigest()[:12]
            assert (version.model, version.version, version.digest) == (
                "Llama-3.1-8B-Instruct",
                name,
                checksum,
            )
            assert (dep.model_uri, dep.model_checksum) == (uri, checksum)
            [artifact] = session.exec(select(ModelArtifact)).all()
            assert (artifact.uri, artifact.format) == (uri, ArtifactFormat.EXTERNAL)
            assert external_version(session, uri, checksum).id == version.id
    finally:
        engine.dispose()


def test_0012_names_odd_legacy_deployments_as_the_catalog_does(fresh_url: str) -> None:
    """A URI whose basename starts with '_' and a checksum longer than a digest (sha512):
    the migration's version must be a valid name and the one the catalog finds again for the
    same URI and checksum (else re-applying an unchanged inventory is a 409)."""
    from fleet.catalog.versions import external_version
    from fleet.models import Deployment, ModelVersion
    from fleet_core.weights import NAME_RE

    engine = fleet_db.make_engine(fresh_url)
    odd = [
        ("a", "s3://b/_llama_", "sha256:" + "cd" * 32),
        ("b", "s3://b/llama-3.1-8b", "sha512:" + "ef" * 64),
    ]
    try:
        config = fleet_db.alembic_config(engine)
        command.upgrade(config, "0011")
        now = "2026-12-01 00:00:00+00:00"
        with engine.begin() as conn:
            for name, uri, checksum in odd:
                conn.execute(
                    sa.text(
                        "INSERT INTO deployment (name, model_uri, model_checksum, engine_params,"
                        " gpus_per_replica, gpu_models, min_replicas, max_replicas,"
                        " sla_p95_latency_ms, sla_ttft_ms, disruption_budget, created_at,"
                        " updated_at)"
                        " VALUES (:n, :u, :c, '{}', 1, '[]', 0, 1, 2000, 300, 1, :t, :t)"
                    ),
                    {"n": name, "u": uri, "c": checksum, "t": now},
                )
        command.upgrade(config, "head")
        with Session(engine) as session:
            for name, uri, checksum in odd:
                dep = session.exec(select(Deployment).where(Deployment.name == name)).one()
                version = session.get(ModelVersion, dep.model_version_id)
                assert version is not None
                assert NAME_RE.match(version.model), version.model
                assert len(version.digest) <= 71
                assert external_version(session, uri, checksum).id == version.id
    finally:
        engine.dispose()
