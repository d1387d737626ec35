"""Hardening: token expiry, an explicit opt-in for Redfish over plain HTTP, and the key the
fleet presents to an agent's local API.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 04:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (a batch table copy on SQLite would drop the BMC endpoint index).
    op.add_column("api_token", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "server",
        sa.Column("bmc_plain_http", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column(
        "server", sa.Column("agent_api_key_encrypted", sa.String(length=1000), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("server", "agent_api_key_encrypted")
    op.drop_column("server", "bmc_plain_http")
    op.drop_column("api_token", "expires_at")
