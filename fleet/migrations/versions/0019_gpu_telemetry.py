"""Each GPU's latest measurements on its server row (the heartbeat's temperatures, power,
ECC, remapped rows and recent Xids), for the API's GPU views and the console.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04 16:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (no batch table copy: it would drop the BMC endpoint expression index).
    op.add_column(
        "server", sa.Column("gpu_telemetry", sa.JSON(), server_default="[]", nullable=False)
    )


def downgrade() -> None:
    op.execute("ALTER TABLE server DROP COLUMN gpu_telemetry")
