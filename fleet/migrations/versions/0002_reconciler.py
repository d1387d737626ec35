"""Reconciler bookkeeping on servers: BMC failures in a row, last BMC read, power settle time.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("bmc_failures", sa.Integer(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("bmc_checked_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("power_settle_until", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    # Column by column (SQLite 3.35+ drops plain columns in place): a batch table copy would
    # lose the server table's expression index (the unique BMC endpoint).
    for column in ("power_settle_until", "bmc_checked_at", "bmc_failures"):
        op.execute(f"ALTER TABLE server DROP COLUMN {column}")
