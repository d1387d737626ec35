"""The agent's readiness, drain state and engine replica stats on servers.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("replicas", "agent_draining", "agent_ready")


def upgrade() -> None:
    # Plain ADD COLUMN (no batch table copy: it would drop the BMC endpoint expression index).
    op.add_column("server", sa.Column("agent_ready", sa.Boolean(), nullable=True))
    op.add_column(
        "server",
        sa.Column("agent_draining", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column("server", sa.Column("replicas", sa.JSON(), server_default="[]", nullable=False))


def downgrade() -> None:
    for column in _COLUMNS:
        op.execute(f"ALTER TABLE server DROP COLUMN {column}")
