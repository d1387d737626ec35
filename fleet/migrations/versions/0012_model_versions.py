"""Model versions and the agents' weights cache (docs/weights.md): versions and their files,
the version a deployment (and, during a rollout, a server) serves, the rollout's state, cached
spares per deployment, and each server's reported cache in place of the static `models_cached`.

Every existing deployment gets a version of the `external` format from its `model_uri` and
`model_checksum` (weights delivered outside Fleet, as before): it keeps working unchanged, and
its digest stays its checksum, so the quality probe's references still match.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 17:00:00
"""

import hashlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


# The same rules as fleet/catalog/versions.py's legacy_model_name and legacy_digest (kept
# here as they are today: a migration must not change when the code does), so that a
# deployment given the same model_uri and checksum later finds the version made here.


def _legacy_name(uri: str) -> tuple[str, str]:
    """(model name, artifact name) for a deployment's old model_uri: the URI's basename."""
    parsed = urlsplit(uri)
    path = parsed.path if parsed.scheme else uri
    base = PurePosixPath(path.rstrip("/")).name or parsed.netloc or "model"
    model = re.sub(r"[^A-Za-z0-9._-]", "-", base).strip("._-")[:63].rstrip("._-") or "model"
    return model, base[:255] or "model"


def _legacy_digest(checksum: str) -> str:
    if len(checksum) <= 71:
        return checksum
    return "sha256:" + hashlib.sha256(checksum.encode()).hexdigest()


def upgrade() -> None:
    op.create_table(
        "model_version",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model", sa.String(63), nullable=False),
        sa.Column("version", sa.String(63), nullable=False),
        sa.Column("description", sa.String(500), nullable=False, server_default=""),
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("created_by", sa.String(100), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.UniqueConstraint("model", "version"),
    )
    op.create_index("ix_model_version_model", "model_version", ["model"])
    op.create_table(
        "model_artifact",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("version_id", sa.Integer(), sa.ForeignKey("model_version.id"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("uri", sa.String(1000), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("gpu_model", sa.String(32), nullable=True),
        sa.Column("tp_size", sa.Integer(), nullable=True),
        sa.UniqueConstraint("version_id", "name", "gpu_model", "tp_size"),
    )
    op.create_index("ix_model_artifact_version_id", "model_artifact", ["version_id"])

    # deployment has no expression index a batch copy could lose.
    with op.batch_alter_table("deployment") as batch:
        batch.add_column(sa.Column("model_version_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("canary_version_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("canary_weight", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("rollout", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(
            sa.Column("cached_spares", sa.Integer(), nullable=False, server_default="0")
        )
        batch.create_foreign_key(
            "fk_deployment_model_version_id", "model_version", ["model_version_id"], ["id"]
        )
        batch.create_foreign_key(
            "fk_deployment_canary_version_id", "model_version", ["canary_version_id"], ["id"]
        )

    # Plain ADD COLUMN on server (a batch copy on SQLite would drop the BMC endpoint index).
    for column in (
        sa.Column("model_version_id", sa.Integer(), nullable=True),
        sa.Column("cache_entries", sa.JSON(), nullable=False, server_default="[]"),
        sa.Column("cache_budget_bytes", sa.BigInteger(), nullable=True),
        sa.Column("cache_used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("cache_free_bytes", sa.BigInteger(), nullable=True),
        sa.Column("cache_reported_at", _TS, nullable=True),
        sa.Column("stage_version_id", sa.Integer(), nullable=True),
        sa.Column("stage_started_at", _TS, nullable=True),
        sa.Column("boot_cache_hit", sa.Boolean(), nullable=True),
        sa.Column("boot_to_ready_cached_s", sa.Float(), nullable=True),
        sa.Column("boot_to_ready_uncached_s", sa.Float(), nullable=True),
    ):
        op.add_column("server", column)
    op.create_index("ix_server_model_version_id", "server", ["model_version_id"])

    conn = op.get_bind()
    now = datetime.now(UTC)
    versions: dict[tuple[str, str], int] = {}
    rows = conn.execute(sa.text("SELECT id, model_uri, model_checksum FROM deployment"))
    for dep_id, uri, checksum in list(rows):
        model, artifact = _legacy_name(uri)
        version = "legacy-" + hashlib.sha256(f"{uri}\n{checksum}".encode()).hexdigest()[:12]
        key = (model, version)
        if key not in versions:
            conn.execute(
                sa.text(
                    "INSERT INTO model_version (model, version, description, digest,"
                    " size_bytes, created_by, created_at) VALUES (:m, :v, :d, :g, 0,"
                    " 'migration 0012', :t)"
                ),
                {
                    "m": model,
                    "v": version,
                    "d": "weights delivered outside Fleet (before model versions)",
                    "g": _legacy_digest(checksum),
                    "t": now,
                },
            )
            vid = conn.execute(
                sa.text("SELECT id FROM model_version WHERE model = :m AND version = :v"),
                {"m": model, "v": version},
            ).scalar_one()
            conn.execute(
                sa.text(
                    "INSERT INTO model_artifact (version_id, name, uri, format)"
                    " VALUES (:vid, :n, :u, 'external')"
                ),
                {"vid": vid, "n": artifact, "u": uri},
            )
            versions[key] = vid
        conn.execute(
            sa.text("UPDATE deployment SET model_version_id = :vid WHERE id = :id"),
            {"vid": versions[key], "id": dep_id},
        )
    # The static field is replaced by what agents report.
    op.drop_column("server", "models_cached")
    # Routers' figures per model version, for rollouts' analysis (fleet/rollout/).
    op.add_column(
        "router_report", sa.Column("versions", sa.JSON(), nullable=False, server_default="{}")
    )


def downgrade() -> None:
    op.drop_column("router_report", "versions")
    op.add_column("server", sa.Column("models_cached", sa.JSON(), nullable=True))
    op.execute("UPDATE server SET models_cached = '[]'")
    op.drop_index("ix_server_model_version_id", table_name="server")
    for name in (
        "boot_to_ready_uncached_s",
        "boot_to_ready_cached_s",
        "boot_cache_hit",
        "stage_started_at",
        "stage_version_id",
        "cache_reported_at",
        "cache_free_bytes",
        "cache_used_bytes",
        "cache_budget_bytes",
        "cache_entries",
        "model_version_id",
    ):
        op.drop_column("server", name)
    with op.batch_alter_table("deployment") as batch:
        batch.drop_constraint("fk_deployment_canary_version_id", type_="foreignkey")
        batch.drop_constraint("fk_deployment_model_version_id", type_="foreignkey")
        for name in (
            "cached_spares",
            "rollout",
            "canary_weight",
            "canary_version_id",
            "model_version_id",
        ):
            batch.drop_column(name)
    op.drop_index("ix_model_artifact_version_id", table_name="model_artifact")
    op.drop_table("model_artifact")
    op.drop_index("ix_model_version_model", table_name="model_version")
    op.drop_table("model_version")
