"""Agent reports on servers: agent identity and URL, repair action and reasons, assignment.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ADD COLUMN on both databases: a batch "recreate" on SQLite would copy
    # the server table and lose its expression index (the unique BMC endpoint).
    op.add_column("server", sa.Column("agent_version", sa.String(length=32), nullable=True))
    op.add_column("server", sa.Column("agent_url", sa.String(length=255), nullable=True))
    op.add_column(
        "server", sa.Column("agent_registered_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("server", sa.Column("health_action", sa.String(length=32), nullable=True))
    op.add_column(
        "server", sa.Column("health_reasons", sa.JSON(), server_default="[]", nullable=False)
    )
    if op.get_bind().dialect.name == "sqlite":
        # SQLite adds a column with its REFERENCES clause, but not a constraint afterwards.
        op.execute("ALTER TABLE server ADD COLUMN deployment_id INTEGER REFERENCES deployment (id)")
    else:
        op.add_column("server", sa.Column("deployment_id", sa.Integer(), nullable=True))
        op.create_foreign_key(
            "fk_server_deployment_id", "server", "deployment", ["deployment_id"], ["id"]
        )
    op.create_index("ix_server_deployment_id", "server", ["deployment_id"])


def downgrade() -> None:
    op.drop_index("ix_server_deployment_id", table_name="server")
    columns = (
        "deployment_id",
        "health_reasons",
        "health_action",
        "agent_registered_at",
        "agent_url",
        "agent_version",
    )
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_server_deployment_id", "server", type_="foreignkey")
        for column in columns:
            op.drop_column("server", column)
        return
    # SQLite cannot drop a column under a foreign key: copy the table (batch), then restore the
    # expression index the copy loses.
    op.drop_index("uq_server_bmc_endpoint", table_name="server")
    with op.batch_alter_table("server", recreate="always") as batch_op:
        for column in columns:
            batch_op.drop_column(column)
    op.create_index(
        "uq_server_bmc_endpoint",
        "server",
        ["bmc_address", "bmc_port", sa.text("coalesce(bmc_system_id, '')")],
        unique=True,
    )
