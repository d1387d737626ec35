"""Initial schema: sites, racks, power feeds, servers, GPUs, deployments, events, API tokens.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 04:42:09.854336
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployment",
        sa.Column("model_uri", sa.String(length=1000), nullable=False),
        sa.Column("model_checksum", sa.String(length=200), nullable=False),
        sa.Column("engine_params", sa.JSON(), nullable=False),
        sa.Column("gpus_per_replica", sa.Integer(), nullable=False),
        sa.Column("gpu_models", sa.JSON(), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("sla_p95_latency_ms", sa.Float(), nullable=False),
        sa.Column("sla_ttft_ms", sa.Float(), nullable=False),
        sa.Column("disruption_budget", sa.Integer(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("deployment", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_deployment_name"), ["name"], unique=True)

    op.create_table(
        "event",
        sa.Column("subject_type", sa.String(length=32), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("from_state", sa.String(length=32), nullable=True),
        sa.Column("to_state", sa.String(length=32), nullable=True),
        sa.Column("message", sa.String(length=2000), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("event", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_event_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_event_kind"), ["kind"], unique=False)
        batch_op.create_index("ix_event_subject", ["subject_type", "subject"], unique=False)

    op.create_table(
        "gpu_model_spec",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("tdp_w", sa.Float(), nullable=False),
        sa.Column("idle_w", sa.Float(), nullable=False),
        sa.Column("hbm_tb_s", sa.Float(), nullable=False),
        sa.Column("bf16_tflops", sa.Float(), nullable=False),
        sa.Column("fp8_tflops", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("gpu_model_spec", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpu_model_spec_name"), ["name"], unique=True)

    op.create_table(
        "site",
        sa.Column("description", sa.String(length=500), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("site", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_site_name"), ["name"], unique=True)

    op.create_table(
        "rack",
        sa.Column("u_height", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=14), nullable=False),
        sa.Column("description", sa.String(length=500), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["site_id"],
            ["site.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("rack", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rack_name"), ["name"], unique=True)
        batch_op.create_index(batch_op.f("ix_rack_site_id"), ["site_id"], unique=False)

    op.create_table(
        "power_feed",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("side", sa.String(length=1), nullable=False),
        sa.Column("volts", sa.Float(), nullable=False),
        sa.Column("amps", sa.Float(), nullable=False),
        sa.Column("phase", sa.String(length=6), nullable=False),
        sa.Column("max_utilisation_pct", sa.Float(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rack_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rack_id"],
            ["rack.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("rack_id", "name"),
    )
    with op.batch_alter_table("power_feed", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_power_feed_rack_id"), ["rack_id"], unique=False)

    op.create_table(
        "server",
        sa.Column("serial", sa.String(length=100), nullable=True),
        sa.Column("u_position", sa.Integer(), nullable=False),
        sa.Column("u_height", sa.Integer(), nullable=False),
        sa.Column("bmc_protocol", sa.String(length=7), nullable=False),
        sa.Column("bmc_address", sa.String(length=255), nullable=False),
        sa.Column("bmc_port", sa.Integer(), nullable=False),
        sa.Column("bmc_username", sa.String(length=100), nullable=False),
        sa.Column("bmc_system_id", sa.String(length=255), nullable=True),
        sa.Column("gpu_model", sa.String(length=32), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("gpu_memory_mib", sa.Integer(), nullable=False),
        sa.Column("idle_w", sa.Float(), nullable=False),
        sa.Column("standby_w", sa.Float(), nullable=False),
        sa.Column("max_w", sa.Float(), nullable=False),
        sa.Column("pool", sa.String(length=8), nullable=False),
        sa.Column("models_cached", sa.JSON(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("rack_id", sa.Integer(), nullable=False),
        sa.Column("bmc_password_encrypted", sa.String(length=1000), nullable=False),
        sa.Column("state", sa.String(length=12), nullable=False),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("power_state", sa.String(length=7), nullable=False),
        sa.Column("power_state_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("bmc_reachable", sa.Boolean(), nullable=True),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("health_verdict", sa.String(length=9), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["rack_id"],
            ["rack.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_server_name"), ["name"], unique=True)
        batch_op.create_index(batch_op.f("ix_server_rack_id"), ["rack_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_server_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_server_pool"), ["pool"], unique=False)
        batch_op.create_index(batch_op.f("ix_server_gpu_model"), ["gpu_model"], unique=False)
    # Plain CREATE INDEX: batch mode would reflect the table, and SQLite cannot reflect an
    # expression index.
    op.create_index(
        "uq_server_bmc_endpoint",
        "server",
        ["bmc_address", "bmc_port", sa.text("coalesce(bmc_system_id, '')")],
        unique=True,
    )

    op.create_table(
        "api_token",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("role", sa.String(length=8), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("server_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["server_id"],
            ["server.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_token_token_hash"), ["token_hash"], unique=True)

    op.create_table(
        "gpu",
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=32), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("health", sa.String(length=9), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("server_id", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["server_id"],
            ["server.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("server_id", "index"),
        sa.UniqueConstraint("uuid"),
    )
    with op.batch_alter_table("gpu", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpu_server_id"), ["server_id"], unique=False)
    _create_event_guard()


# Events are append-only. Postgres refuses UPDATE and DELETE unless a maintenance job (event
# retention, the test harness) says otherwise for its own transaction:
#   SET LOCAL fleet.event_maintenance = 'on'
# SQLite has no session settings: it refuses UPDATE only.
_PG_GUARD = """
CREATE FUNCTION fleet_event_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('fleet.event_maintenance', true) = 'on' THEN
        IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'events are append-only: % refused', TG_OP;
END $$;
CREATE TRIGGER event_append_only BEFORE UPDATE OR DELETE ON event
    FOR EACH ROW EXECUTE FUNCTION fleet_event_append_only();
"""
_SQLITE_GUARD = """
CREATE TRIGGER event_append_only BEFORE UPDATE ON event
BEGIN SELECT RAISE(ABORT, 'events are append-only: UPDATE refused'); END;
"""


def _create_event_guard() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_GUARD)
    else:
        op.execute(_SQLITE_GUARD)


def _drop_event_guard() -> None:
    op.execute(
        "DROP TRIGGER IF EXISTS event_append_only"
        + (" ON event" if op.get_bind().dialect.name == "postgresql" else "")
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS fleet_event_append_only()")


def downgrade() -> None:
    _drop_event_guard()
    with op.batch_alter_table("gpu", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpu_server_id"))

    op.drop_table("gpu")
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_token_token_hash"))

    op.drop_table("api_token")
    op.drop_index("uq_server_bmc_endpoint", table_name="server")
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_server_gpu_model"))
        batch_op.drop_index(batch_op.f("ix_server_pool"))
        batch_op.drop_index(batch_op.f("ix_server_state"))
        batch_op.drop_index(batch_op.f("ix_server_rack_id"))
        batch_op.drop_index(batch_op.f("ix_server_name"))

    op.drop_table("server")
    with op.batch_alter_table("power_feed", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_power_feed_rack_id"))

    op.drop_table("power_feed")
    with op.batch_alter_table("rack", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rack_site_id"))
        batch_op.drop_index(batch_op.f("ix_rack_name"))

    op.drop_table("rack")
    with op.batch_alter_table("site", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_site_name"))

    op.drop_table("site")
    with op.batch_alter_table("gpu_model_spec", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpu_model_spec_name"))

    op.drop_table("gpu_model_spec")
    with op.batch_alter_table("event", schema=None) as batch_op:
        batch_op.drop_index("ix_event_subject")
        batch_op.drop_index(batch_op.f("ix_event_kind"))
        batch_op.drop_index(batch_op.f("ix_event_at"))

    op.drop_table("event")
    with op.batch_alter_table("deployment", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_deployment_name"))

    op.drop_table("deployment")
