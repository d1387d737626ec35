"""The scheduled-scaling calendar's entries.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 11:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "schedule_entry",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("cron", sa.String(length=200), nullable=False),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("end_cron", sa.String(length=200), nullable=True),
        sa.Column("duration_s", sa.Integer(), nullable=True),
        sa.Column("note", sa.String(length=500), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("created_by", sa.String(length=100), nullable=False),
        sa.Column("fired_for", _TS, nullable=True),
        sa.Column("fired_at", _TS, nullable=True),
        sa.Column("active_until", _TS, nullable=True),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployment.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_schedule_entry_deployment_id", "schedule_entry", ["deployment_id"])


def downgrade() -> None:
    op.drop_index("ix_schedule_entry_deployment_id", table_name="schedule_entry")
    op.drop_table("schedule_entry")
