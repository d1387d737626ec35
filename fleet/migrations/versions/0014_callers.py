"""Callers of the routers: tenants, their client keys (stored as SHA-256) and each router's
last reported usage per key (docs/api.md "Tenants and client keys").

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("concurrency_share", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tenant_name", "tenant", ["name"], unique=True)
    op.create_table(
        "client_key",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("requests_per_minute", sa.BigInteger(), nullable=True),
        sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_client_key_key_hash", "client_key", ["key_hash"], unique=True)
    op.create_index("ix_client_key_tenant_id", "client_key", ["tenant_id"])
    op.create_table(
        "router_usage",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("router", sa.String(length=100), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("callers", sa.JSON(), nullable=False),
        sa.Column("window_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("router"),
    )
    op.create_index("ix_router_usage_at", "router_usage", ["at"])


def downgrade() -> None:
    # Keys and tenants go with their tables: routers of the older release authenticate nobody.
    op.drop_index("ix_router_usage_at", table_name="router_usage")
    op.drop_table("router_usage")
    op.drop_index("ix_client_key_tenant_id", table_name="client_key")
    op.drop_index("ix_client_key_key_hash", table_name="client_key")
    op.drop_table("client_key")
    op.drop_index("ix_tenant_name", table_name="tenant")
    op.drop_table("tenant")
