"""The autoscaler: pinned replicas, the calendar's floor and cooldown clocks on deployments,
and its decision records.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("deployment", sa.Column("pinned_replicas", sa.Integer(), nullable=True))
    op.add_column(
        "deployment",
        sa.Column("floor_servers", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column("deployment", sa.Column("last_scale_up_at", _TS, nullable=True))
    op.add_column("deployment", sa.Column("last_scale_down_at", _TS, nullable=True))
    op.create_table(
        "scaling_decision",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("at", _TS, nullable=False),
        sa.Column("rule", sa.String(length=32), nullable=False),
        sa.Column("target_before", sa.Integer(), nullable=False),
        sa.Column("target_after", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(length=1000), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_scaling_decision_deployment", "scaling_decision", ["deployment"])


def downgrade() -> None:
    op.drop_index("ix_scaling_decision_deployment", table_name="scaling_decision")
    op.drop_table("scaling_decision")
    for column in ("last_scale_down_at", "last_scale_up_at", "floor_servers", "pinned_replicas"):
        op.execute(f"ALTER TABLE deployment DROP COLUMN {column}")
