"""Leases for per-server work (fleet/leases.py): a power action holds a row, not a Postgres
connection, while its BMC answers.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03 23:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lease",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("holder", sa.String(length=100), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index("ix_lease_holder", "lease", ["holder"])


def downgrade() -> None:
    # Leases in flight go with the table: the older release locks with advisory locks.
    op.drop_index("ix_lease_holder", table_name="lease")
    op.drop_table("lease")
