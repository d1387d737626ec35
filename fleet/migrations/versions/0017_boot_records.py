"""Boot history (fleet/provisioning/boot_times.py): every measured boot-to-ready, kept for a
retention period, instead of each server's last one only.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "boot_record",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("server", sa.String(length=63), nullable=False),
        sa.Column("gpu_model", sa.String(length=32), nullable=False),
        sa.Column("cache_hit", sa.Boolean(), nullable=True),
        sa.Column("boot_s", sa.Float(), nullable=False),
        sa.Column("load_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_boot_record_at", "boot_record", ["at"])
    op.create_index("ix_boot_record_gpu_model", "boot_record", ["gpu_model"])


def downgrade() -> None:
    op.drop_index("ix_boot_record_gpu_model", table_name="boot_record")
    op.drop_index("ix_boot_record_at", table_name="boot_record")
    op.drop_table("boot_record")
