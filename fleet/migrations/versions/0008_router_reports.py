"""Routers' load reports (waiting requests, client-side p95) for the autoscaler.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 11:35:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "router_report",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("router", sa.String(length=100), nullable=False),
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("p95_s", sa.Float(), nullable=True),
        sa.Column("ttft_p95_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("router", "deployment"),
    )
    op.create_index("ix_router_report_deployment", "router_report", ["deployment"])


def downgrade() -> None:
    op.drop_index("ix_router_report_deployment", table_name="router_report")
    op.drop_table("router_report")
