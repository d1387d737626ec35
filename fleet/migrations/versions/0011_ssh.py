"""Servers over SSH (docs/ansible.md): each server's SSH address, port and pinned host key, the
graceful-reboot mark of remediation, rotated agent tokens, and diagnostic bundles.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 13:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Plain ADD COLUMN (a batch table copy on SQLite would drop the BMC endpoint index).
    op.add_column("server", sa.Column("ssh_address", sa.String(255), nullable=True))
    op.add_column(
        "server", sa.Column("ssh_port", sa.Integer(), server_default="22", nullable=False)
    )
    op.add_column("server", sa.Column("ssh_host_key", sa.String(64), nullable=True))
    op.add_column("server", sa.Column("ssh_reboot_sent_at", _TS, nullable=True))
    # A foreign key on an existing table: SQLite needs the batch copy (api_token has no
    # expression index for the copy to lose).
    with op.batch_alter_table("api_token") as batch:
        batch.add_column(sa.Column("replaced_by_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            "fk_api_token_replaced_by_id", "api_token", ["replaced_by_id"], ["id"]
        )
    op.create_table(
        "diagnostic_bundle",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("server_id", sa.Integer(), sa.ForeignKey("server.id"), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("created_by", sa.String(100), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("truncated", sa.Boolean(), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_diagnostic_bundle_server_id", "diagnostic_bundle", ["server_id"])


def downgrade() -> None:
    op.drop_index("ix_diagnostic_bundle_server_id", table_name="diagnostic_bundle")
    op.drop_table("diagnostic_bundle")
    with op.batch_alter_table("api_token") as batch:
        batch.drop_constraint("fk_api_token_replaced_by_id", type_="foreignkey")
        batch.drop_column("replaced_by_id")
    op.drop_column("server", "ssh_reboot_sent_at")
    op.drop_column("server", "ssh_host_key")
    op.drop_column("server", "ssh_port")
    op.drop_column("server", "ssh_address")
