"""Demand history (fleet/autoscaler/demand.py): the routers' arrival counters, and each
deployment's demand per minute packed by the hour, which predictive scaling learns from.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 13:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("router_report") as batch:
        batch.add_column(sa.Column("arrived", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("arrived_tokens", sa.BigInteger(), nullable=True))
    op.create_table(
        "demand_hour",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("servers", sa.LargeBinary(), nullable=False),
        sa.Column("slot_use", sa.LargeBinary(), nullable=False),
        sa.Column("p95_s", sa.LargeBinary(), nullable=False),
        sa.Column("ttft_p95_s", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("deployment", "hour"),
    )
    op.create_index("ix_demand_hour_hour", "demand_hour", ["hour"])


def downgrade() -> None:
    op.drop_index("ix_demand_hour_hour", table_name="demand_hour")
    op.drop_table("demand_hour")
    with op.batch_alter_table("router_report") as batch:
        batch.drop_column("arrived_tokens")
        batch.drop_column("arrived")
