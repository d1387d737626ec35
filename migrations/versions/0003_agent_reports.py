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
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_version", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("agent_url", sa.String(length=255), nullable=True))
        batch_op.add_column(
            sa.Column("agent_registered_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("health_action", sa.String(length=32), nullable=True))
        batch_op.add_column(
            sa.Column("health_reasons", sa.JSON(), server_default="[]", nullable=False)
        )
        batch_op.add_column(sa.Column("deployment_id", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_server_deployment_id"), ["deployment_id"])
        batch_op.create_foreign_key(
            "fk_server_deployment_id", "deployment", ["deployment_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.drop_constraint("fk_server_deployment_id", type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_server_deployment_id"))
        for column in (
            "deployment_id",
            "health_reasons",
            "health_action",
            "agent_registered_at",
            "agent_url",
            "agent_version",
        ):
            batch_op.drop_column(column)
