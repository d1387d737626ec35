"""Rack power (docs/power.md): budget modes and the admin override per rack, the GPU cap the
valve holds, the budget gate's write-ahead commitment, measured draw per server, and the
bucketed draw history of servers and racks.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 10:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Plain ADD COLUMN (a batch table copy on SQLite would drop the BMC endpoint index).
    op.add_column(
        "rack",
        sa.Column("budget_mode", sa.String(length=9), server_default="nameplate", nullable=False),
    )
    op.add_column(
        "rack", sa.Column("budget_margin", sa.Float(), server_default="1.15", nullable=False)
    )
    op.add_column("rack", sa.Column("budget_override_reason", sa.String(500), nullable=True))
    op.add_column("rack", sa.Column("budget_override_by", sa.String(100), nullable=True))
    op.add_column("rack", sa.Column("budget_override_at", _TS, nullable=True))
    op.add_column("rack", sa.Column("gpu_cap_pct", sa.Float(), nullable=True))
    op.add_column("rack", sa.Column("gpu_cap_changed_at", _TS, nullable=True))
    op.add_column("server", sa.Column("power_committed_until", _TS, nullable=True))
    op.add_column("server", sa.Column("drawn_w", sa.Float(), nullable=True))
    op.add_column("server", sa.Column("drawn_source", sa.String(16), nullable=True))
    op.add_column("server", sa.Column("drawn_at", _TS, nullable=True))
    op.add_column("server", sa.Column("gpu_power_limit_w", sa.Float(), nullable=True))
    op.create_table(
        "power_sample",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("subject", sa.String(63), nullable=False),
        sa.Column("bucket_start", _TS, nullable=False),
        sa.Column("bucket_s", sa.Float(), nullable=False),
        sa.Column("max_w", sa.Float(), nullable=False),
        sa.Column("mean_w", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("estimated", sa.Boolean(), nullable=False),
        sa.UniqueConstraint("kind", "subject", "bucket_start"),
    )
    op.create_index("ix_power_sample_bucket_start", "power_sample", ["bucket_start"])


def downgrade() -> None:
    op.drop_index("ix_power_sample_bucket_start", table_name="power_sample")
    op.drop_table("power_sample")
    for column in ("gpu_power_limit_w", "drawn_at", "drawn_source", "drawn_w"):
        op.drop_column("server", column)
    op.drop_column("server", "power_committed_until")
    for column in (
        "gpu_cap_changed_at",
        "gpu_cap_pct",
        "budget_override_at",
        "budget_override_by",
        "budget_override_reason",
        "budget_margin",
        "budget_mode",
    ):
        op.drop_column("rack", column)
