"""Wake-up counters (fleet/control/wakeups.py): a change that the provisioner should act on
wakes the leader's loop from any replica, instead of waiting for its next tick.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 06:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "wakeup",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.bulk_insert(table, [{"name": "provisioner", "seq": 0}])


def downgrade() -> None:
    op.drop_table("wakeup")
