"""Provisioning: boot/drain bookkeeping and fault history on servers, deployment targets, the
autopilot row (pause and breaker) and the inference-quality probe's reference answers.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)
_SERVER_COLUMNS: list[sa.Column[object]] = [
    sa.Column("boot_kind", sa.String(length=16), nullable=True),
    sa.Column("boot_started_at", _TS, nullable=True),
    sa.Column("load_started_at", _TS, nullable=True),
    sa.Column("power_on_sent_at", _TS, nullable=True),
    sa.Column("power_off_sent_at", _TS, nullable=True),
    sa.Column("drain_reason", sa.String(length=16), nullable=True),
    sa.Column("drain_started_at", _TS, nullable=True),
    sa.Column("failed_reason", sa.String(length=500), nullable=True),
    sa.Column("last_fault", sa.String(length=200), nullable=True),
    sa.Column("reboot_fault", sa.String(length=200), nullable=True),
    sa.Column("reboot_count", sa.Integer(), server_default="0", nullable=False),
    sa.Column("boot_to_ready_s", sa.Float(), nullable=True),
    sa.Column("load_s", sa.Float(), nullable=True),
    sa.Column("probed_at", _TS, nullable=True),
]


def upgrade() -> None:
    # Plain ADD COLUMN (a batch table copy on SQLite would drop the BMC endpoint index).
    for column in _SERVER_COLUMNS:
        op.add_column("server", column)
    op.add_column(
        "deployment",
        sa.Column("target_servers", sa.Integer(), server_default="0", nullable=False),
    )
    op.create_table(
        "autopilot",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("changed_by", sa.String(length=100), nullable=True),
        sa.Column("changed_at", _TS, nullable=True),
        sa.Column("breaker_open", sa.Boolean(), nullable=False),
        sa.Column("breaker_reason", sa.String(length=500), nullable=True),
        sa.Column("breaker_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "probe_reference",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("model_checksum", sa.String(length=200), nullable=False),
        sa.Column("prompt", sa.String(length=2000), nullable=False),
        sa.Column("answer", sa.String(length=20000), nullable=False),
        sa.Column("recorded_at", _TS, nullable=False),
        sa.Column("recorded_from", sa.String(length=63), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployment.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("deployment_id", "model_checksum"),
    )
    op.create_index("ix_probe_reference_deployment_id", "probe_reference", ["deployment_id"])


def downgrade() -> None:
    op.drop_index("ix_probe_reference_deployment_id", table_name="probe_reference")
    op.drop_table("probe_reference")
    op.drop_table("autopilot")
    op.execute("ALTER TABLE deployment DROP COLUMN target_servers")
    for column in reversed(_SERVER_COLUMNS):
        op.execute(f"ALTER TABLE server DROP COLUMN {column.name}")
