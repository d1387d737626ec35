"""A deployment names the engine its replicas run (fleet_core/engines: trtllm, vllm, sglang).
Every existing deployment ran trtllm-serve, and its engine_params are trtllm-serve's options:
they keep both.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "deployment",
        sa.Column("engine", sa.String(length=16), nullable=False, server_default="trtllm"),
    )


def downgrade() -> None:
    # Before this revision every deployment runs trtllm-serve: one on another engine would
    # come back with options trtllm-serve does not have. Refused rather than guessed.
    others = op.get_bind().execute(
        sa.text("SELECT name FROM deployment WHERE engine <> 'trtllm' ORDER BY name")
    )
    names = [row[0] for row in others]
    if names:
        raise RuntimeError(
            f"deployments on engines other than trtllm: {', '.join(names)}; delete them or "
            "move them to trtllm before downgrading below 0013"
        )
    with op.batch_alter_table("deployment") as batch:
        batch.drop_column("engine")
