"""Every table of the fleet database, and the API models around them.

Families follow one pattern: `XBase` (fields shared by all), `X` (the table), `XCreate` /
`XUpdate` (what a client may send), `XPublic` (what a client may see). Secrets live only on the
table and on `Create`/`Update` as `SecretStr`; no `Public` model has a field that could carry one.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Self

import sqlalchemy as sa
from annotated_types import MaxLen
from pydantic import (
    AfterValidator,
    BeforeValidator,
    SecretStr,
    StrictBool,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)
from sqlalchemy.engine import Dialect
from sqlmodel import Field, SQLModel
from sqlmodel._compat import SQLModelConfig

from fleet.calendar.entry_spec import ScheduleEntryCreate as ScheduleEntryCreate
from fleet.lifecycle.states import OPERATOR_TARGETS, ServerState
from fleet.lifecycle.states import PowerState as PowerState
from fleet.validation import (
    INT32_MAX as INT32_MAX,
)
from fleet.validation import (
    MAX_REPLICAS as MAX_REPLICAS,
)
from fleet.validation import (
    MAX_SLA_MS as MAX_SLA_MS,
)
from fleet.validation import (
    MAX_WATTS as MAX_WATTS,
)
from fleet.validation import (
    NAME_HELP as NAME_HELP,
)
from fleet.validation import (
    NAME_PATTERN as NAME_PATTERN,
)
from fleet.validation import (
    SSH_FINGERPRINT_PATTERN as SSH_FINGERPRINT_PATTERN,
)
from fleet.validation import (
    Int as Int,
)
from fleet.validation import (
    ModelUris as ModelUris,
)
from fleet.validation import (
    Number as Number,
)
from fleet.validation import (
    OptInt as OptInt,
)
from fleet.validation import (
    OptNumber as OptNumber,
)
from fleet.validation import (
    exactly_one_of as exactly_one_of,
)
from fleet_core.engines import ENGINES, EngineName
from fleet_core.engines import spec as engine_spec

# The agent's verdict and a GPU's health are the core's types (fleet_core: the fault policy and
# the agent's reports); the server and GPU rows store them.
from fleet_core.fault_policy import Verdict as Verdict
from fleet_core.wire import GpuHealth as GpuHealth
from fleet_core.wire import GpuReading


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """An aware UTC datetime; a naive one (from a client) is taken to be UTC already."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


_NUMERIC = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _iso_text(value: Any) -> Any:
    # pydantic reads a number (or numeric text: query parameters arrive as text) as Unix
    # seconds; the schema says ISO 8601, and so does the API.
    if isinstance(value, bool | int | float) or (
        isinstance(value, str) and _NUMERIC.fullmatch(value)
    ):
        raise ValueError("must be an ISO 8601 date-time, e.g. 2026-05-01T09:00:00Z")
    return value


def _in_utc(value: datetime) -> datetime:
    try:
        return as_utc(value)
    except OverflowError:  # 9999-12-31T23:00-05:00 is past year 9999 in UTC
        raise ValueError("out of range in UTC") from None


# A client's date-time (body or query): ISO 8601 text, as aware UTC.
IsoDateTime = Annotated[datetime, BeforeValidator(_iso_text), AfterValidator(_in_utc)]


class UtcDateTime(sa.types.TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on both backends (SQLite drops the zone on the way back)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _ts(**kw: Any) -> Any:
    return Field(sa_type=UtcDateTime, **kw)


def _json(default: type[list[Any]] | type[dict[str, Any]]) -> Any:
    # JSON (not JSONB) so one migration serves SQLite and Postgres. The factory is a function
    # of ours, not the builtin: pydantic inspects a default factory's signature each time it
    # builds a row, and a builtin's is parsed from its text signature (~170 µs against ~8 µs;
    # importing 10,000 servers made 30,000 of them: bench/inventory.py).
    def empty() -> Any:
        return default()

    return Field(default_factory=empty, sa_type=sa.JSON, nullable=False)


class StrEnumType(sa.types.TypeDecorator[StrEnum]):
    """A StrEnum stored as a plain string (adding a value never needs an ALTER TYPE), read back
    as the enum member so rows and API models agree on types."""

    impl = sa.String
    cache_ok = True

    def __init__(self, enum: type[StrEnum]) -> None:
        super().__init__(max(len(v) for v in enum))
        self._enum = enum
        # A dict lookup per row read: `enum(value)` costs several times more, and reading
        # 10,000 servers reads 30,000 of these.
        self._members: dict[str, StrEnum] = {m.value: m for m in enum}

    def process_bind_param(self, value: StrEnum | str | None, dialect: Dialect) -> str | None:
        return None if value is None else self._enum(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> StrEnum | None:
        if value is None:
            return None
        member = self._members.get(value)
        return self._enum(value) if member is None else member  # unknown: enum's ValueError


def _enum(enum: type[StrEnum], **kw: Any) -> Any:
    return Field(sa_type=StrEnumType(enum), **kw)


# ---------------------------------------------------------------------------------------------
# Enumerations


class RackStatus(StrEnum):
    ACTIVE = "active"
    PLANNED = "planned"
    DECOMMISSIONED = "decommissioned"


class BudgetMode(StrEnum):
    """How a rack's servers commit power (docs/power.md): at their nameplate maximum, or at
    their measured p99 draw times the rack's margin."""

    NAMEPLATE = "nameplate"
    MEASURED = "measured"


class FeedSide(StrEnum):
    A = "A"
    B = "B"


class Phase(StrEnum):
    SINGLE = "single"
    THREE = "three"


class BmcProtocol(StrEnum):
    REDFISH = "redfish"
    IPMI = "ipmi"


class Pool(StrEnum):
    BASELINE = "baseline"
    WARM = "warm"


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    VIEWER = "viewer"
    ROUTER = "router"  # a viewer that may also report its load (fleet/router/)
    AGENT = "agent"


# ---------------------------------------------------------------------------------------------
# Sites, racks, power feeds


class SiteBase(SQLModel):
    name: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    description: str = Field(default="", max_length=500)


class Site(SiteBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    created_at: datetime = _ts(default_factory=utcnow)
    updated_at: datetime = _ts(default_factory=utcnow)


class SitePublic(SiteBase):
    rack_count: int
    server_count: int
    created_at: datetime


class RackBase(SQLModel):
    name: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    u_height: Int = Field(default=42, ge=1, le=60)
    status: RackStatus = _enum(RackStatus, default=RackStatus.ACTIVE)
    description: str = Field(default="", max_length=500)
    # Budget mode and margin (docs/power.md): measured mode commits a powered server at its
    # measured p99 draw × margin, never below idle nor above its maximum.
    budget_mode: BudgetMode = _enum(BudgetMode, default=BudgetMode.NAMEPLATE)
    budget_margin: Number = Field(default=1.15, ge=1.0, le=2.0)


class Rack(RackBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    site_id: int = Field(foreign_key="site.id", index=True)
    # An admin's override of the budget gate (fleet/power/gate.py): shown until the rack's
    # committed draw is back inside its budget, then cleared by the reconciler.
    budget_override_reason: str | None = Field(default=None, max_length=500)
    budget_override_by: str | None = Field(default=None, max_length=100)
    budget_override_at: datetime | None = _ts(default=None)
    # The GPU power cap the valve holds on this rack's serving servers (fleet/power/caps.py),
    # in percent of each GPU's TDP; None: uncapped.
    gpu_cap_pct: float | None = None
    gpu_cap_changed_at: datetime | None = _ts(default=None)
    created_at: datetime = _ts(default_factory=utcnow)
    updated_at: datetime = _ts(default_factory=utcnow)


class RackPublic(RackBase):
    site: str
    feeds: int
    servers: int
    budget_w: float
    committed_w: float
    headroom_w: float
    all_on_w: float
    drawn_w: float | None  # measured now: Σ servers' latest readings (BMC, else estimate)
    drawn_estimated_w: float  # the part of drawn_w that is agent-based estimates
    peak_24h_w: float | None
    p99_7d_w: float | None
    budget_override_reason: str | None
    budget_override_by: str | None
    budget_override_at: datetime | None
    gpu_cap_pct: float | None


class PowerFeedBase(SQLModel):
    name: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    side: FeedSide = _enum(FeedSide)
    volts: Number = Field(gt=0, le=1000)
    amps: Number = Field(gt=0, le=1000)
    phase: Phase = _enum(Phase, default=Phase.SINGLE)
    max_utilisation_pct: Number = Field(default=80.0, gt=0, le=100)


class PowerFeed(PowerFeedBase, table=True):
    __tablename__ = "power_feed"
    __table_args__ = (sa.UniqueConstraint("rack_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    rack_id: int = Field(foreign_key="rack.id", index=True)


class PowerFeedPublic(PowerFeedBase):
    rack: str
    usable_w: float


# ---------------------------------------------------------------------------------------------
# Servers and GPUs


class ServerBase(SQLModel):
    name: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    serial: str | None = Field(default=None, max_length=100)
    u_position: Int = Field(ge=1, le=60)
    u_height: Int = Field(default=1, ge=1, le=16)
    bmc_protocol: BmcProtocol = _enum(BmcProtocol)
    bmc_address: str = Field(max_length=255, min_length=1)
    bmc_port: Int = Field(ge=1, le=65535)
    bmc_username: str = Field(max_length=100, min_length=1)
    bmc_system_id: str | None = Field(default=None, max_length=255)
    # Redfish over plain HTTP (no TLS: the password travels in clear) only when the inventory
    # says so for this server; the virtual colo's emulators do.
    bmc_plain_http: bool = Field(default=False, sa_column_kwargs={"server_default": sa.false()})
    gpu_model: str = Field(max_length=32, index=True)
    gpu_count: Int = Field(ge=0, le=64)
    gpu_memory_mib: Int = Field(ge=0, le=INT32_MAX)
    idle_w: Number = Field(ge=0, le=MAX_WATTS)
    standby_w: Number = Field(ge=0, le=MAX_WATTS)
    max_w: Number = Field(gt=0, le=MAX_WATTS)
    pool: Pool = _enum(Pool, default=Pool.WARM, index=True)
    # Where the server's OS answers SSH (not its BMC), and the host key pinned for it: the
    # fingerprint OpenSSH prints (`SHA256:<base64>`), from the inventory or recorded by the
    # explicit `fleetctl servers ssh-trust` (fleet/ssh/). None: no SSH / nothing pinned yet.
    ssh_address: str | None = Field(default=None, max_length=255)
    ssh_port: Int = Field(default=22, ge=1, le=65535, sa_column_kwargs={"server_default": "22"})
    ssh_host_key: str | None = Field(
        default=None, max_length=64, schema_extra={"pattern": SSH_FINGERPRINT_PATTERN}
    )


class Server(ServerBase, table=True):
    __table_args__ = (
        # One BMC endpoint, one server (sushy-tools holds many systems behind one address).
        sa.Index(
            "uq_server_bmc_endpoint",
            "bmc_address",
            "bmc_port",
            sa.text("coalesce(bmc_system_id, '')"),
            unique=True,
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    rack_id: int = Field(foreign_key="rack.id", index=True)
    # Ciphertext only (fleet.crypto.SecretBox); never selected into an API model.
    bmc_password_encrypted: str = Field(max_length=1000)
    # Lifecycle state: written only by fleet.lifecycle.transitions.
    state: ServerState = _enum(ServerState, default=ServerState.ENROLLED, index=True)
    state_changed_at: datetime = _ts(default_factory=utcnow)
    # Observations, kept apart from the state (docs/design.md).
    power_state: PowerState = _enum(PowerState, default=PowerState.UNKNOWN)
    power_state_at: datetime | None = _ts(default=None)
    bmc_reachable: bool | None = None
    # The reconciler's bookkeeping: BMC reads failed in a row (K of them mark the BMC
    # unreachable), when it last read this BMC, and until when a power action Fleet sent is
    # still settling (BMCs apply resets seconds late: no "correction" before then).
    bmc_failures: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    bmc_checked_at: datetime | None = _ts(default=None)
    power_settle_until: datetime | None = _ts(default=None)
    # The budget gate's write-ahead commitment (fleet/power/gate.py): a power-on admitted under
    # the placement lock counts at max draw until then, before the BMC has said it is on.
    power_committed_until: datetime | None = _ts(default=None)
    # Measured draw (fleet/power/measure.py): the latest reading, where it came from ("bmc",
    # or "estimate": the agent's summed GPU power plus the server's idle_w) and when.
    drawn_w: float | None = None
    drawn_source: str | None = Field(default=None, max_length=16)
    drawn_at: datetime | None = _ts(default=None)
    # The per-GPU power limit the fleet asks of the agent (the cap valve); None: the default.
    gpu_power_limit_w: float | None = None
    last_heartbeat_at: datetime | None = _ts(default=None)
    health_verdict: Verdict | None = _enum(Verdict, default=None)
    # What the agent reports (fleet/registry/agent_reports.py): who it is, where its local API
    # listens,
    # and its fault policy's repair action and reasons. Observations, like the fields above.
    agent_version: str | None = Field(default=None, max_length=32)
    agent_url: str | None = Field(default=None, max_length=255)
    # Ciphertext of the key the agent's local API asks of the fleet (sent at registration).
    agent_api_key_encrypted: str | None = Field(default=None, max_length=1000)
    agent_registered_at: datetime | None = _ts(default=None)
    health_action: str | None = Field(default=None, max_length=32)
    health_reasons: list[dict[str, Any]] = _json(list)
    # The agent's readiness and its engine replicas' stats (queue, KV use, latency) as of the
    # last heartbeat: routers and the autoscaler read these.
    agent_ready: bool | None = None
    agent_draining: bool = Field(default=False, sa_column_kwargs={"server_default": sa.false()})
    replicas: list[dict[str, Any]] = _json(list)
    # Each GPU's measurements as of the last heartbeat (fleet_core.wire.GpuReading: temperature,
    # power, memory, ECC, remapped rows, recent Xids), replaced by every report; the API shows
    # them with the GPU rows (GpuPublic.reading).
    gpu_telemetry: list[dict[str, Any]] = _json(list)
    # Provisioning (fleet/provisioning/tick.py): how the current boot goes ("power_on",
    # "cycle",
    # "resume"), when it began, the write-ahead marks of power commands (committed before the
    # BMC call, so a crash never leads to a second command), why it drains or failed, fault
    # and reboot history (escalation is the fleet's: an agent forgets across reboots), and
    # the measured boot-to-ready and load times placement prefers.
    boot_kind: str | None = Field(default=None, max_length=16)
    boot_started_at: datetime | None = _ts(default=None)
    load_started_at: datetime | None = _ts(default=None)
    power_on_sent_at: datetime | None = _ts(default=None)
    power_off_sent_at: datetime | None = _ts(default=None)
    drain_reason: str | None = Field(default=None, max_length=16)
    drain_started_at: datetime | None = _ts(default=None)
    failed_reason: str | None = Field(default=None, max_length=500)
    last_fault: str | None = Field(default=None, max_length=200)
    reboot_fault: str | None = Field(default=None, max_length=200)
    reboot_count: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    boot_to_ready_s: float | None = None
    load_s: float | None = None
    probed_at: datetime | None = _ts(default=None)  # the last inference-quality probe
    # Remediation's graceful step (fleet/provisioning/graceful_reboot.py): when the fleet asked
    # the OS over SSH to reboot; the BMC power cycle follows if the agent is not back in time.
    ssh_reboot_sent_at: datetime | None = _ts(default=None)
    # The deployment whose replicas this server runs (set by provisioning); the agent's
    # heartbeat is answered with it as the server's assignment.
    deployment_id: int | None = Field(default=None, foreign_key="deployment.id", index=True)
    # The model version it serves (docs/weights.md): its deployment's, or the canary's while a
    # rollout moves servers between the two (fleet/rollout/). None: its deployment's current.
    model_version_id: int | None = Field(default=None, index=True)
    # The agent's weights cache as of its last heartbeat (fleet_core.wire.CacheReport):
    # placement prefers spares holding the version, pre-staging keeps K of them.
    cache_entries: list[dict[str, Any]] = _json(list)
    cache_budget_bytes: int | None = Field(default=None, sa_type=sa.BigInteger)
    cache_used_bytes: int | None = Field(default=None, sa_type=sa.BigInteger)
    cache_free_bytes: int | None = Field(default=None, sa_type=sa.BigInteger)
    cache_reported_at: datetime | None = _ts(default=None)
    # Pre-staging (fleet/provisioning/staging.py): when a warm spare was powered on to fetch
    # a version, and which one; cleared when it is back off with the version verified.
    stage_version_id: int | None = Field(default=None)
    stage_started_at: datetime | None = _ts(default=None)
    # Boot-to-ready per cache state: whether the current boot began with its version cached,
    # and the latest figure of each kind (the autoscaler's look-ahead and the calendar's lead
    # use the one for the spare they would boot).
    boot_cache_hit: bool | None = None
    boot_to_ready_cached_s: float | None = None
    boot_to_ready_uncached_s: float | None = None
    created_at: datetime = _ts(default_factory=utcnow)
    updated_at: datetime = _ts(default_factory=utcnow)


@sa.event.listens_for(Server.state, "set")
def _state_is_written_by_lifecycle(target: Server, value: Any, old: Any, initiator: Any) -> None:
    """The rule of docs/design.md, enforced at run time: only fleet.lifecycle.transitions moves a
    server's
    state (with a compare-and-set UPDATE, which fires no attribute event). A server not yet in
    the database may carry the initial state and nothing else."""
    if sa.inspect(target).has_identity or value != ServerState.ENROLLED:
        raise AttributeError(
            f"server {target.name}: state is written only by fleet.lifecycle.transitions.transition"
        )


class ServerCreate(ServerBase):
    """A server as the inventory importer validates it (flat, references by name)."""

    model_config = SQLModelConfig(extra="forbid")

    rack: str
    bmc_password: SecretStr | None = None


def _null_only_where_nullable(schema: dict[str, Any], cls: type) -> None:
    """An update's schema offers null only for its `nullable_fields`: the others are optional
    (left out, they keep their value) but not nullable, and the schema says what is accepted."""
    nullable: frozenset[str] = getattr(cls, "nullable_fields", frozenset())
    for name, prop in schema.get("properties", {}).items():
        if name in nullable or {"type": "null"} not in prop.get("anyOf", ()):
            continue
        rest = [option for option in prop.pop("anyOf") if option != {"type": "null"}]
        if len(rest) == 1:
            prop.update(rest[0])
        else:
            prop["anyOf"] = rest
        if "default" in prop and prop["default"] is None:
            del prop["default"]


class _Update(SQLModel):
    """A partial update: a field left out keeps its value; null is refused unless listed."""

    model_config = SQLModelConfig(json_schema_extra=_null_only_where_nullable)
    nullable_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="after")
    def _no_nulls(self) -> Self:
        nulls = sorted(
            f
            for f in self.model_fields_set
            if getattr(self, f) is None and f not in self.nullable_fields
        )
        if nulls:
            raise ValueError(f"{', '.join(nulls)}: must not be null (leave a field out to keep it)")
        return self


class RackUpdate(_Update):
    """What an operator may change on a rack through the API (`PATCH /racks/{name}`): how its
    servers commit power (docs/power.md). The inventory file sets the same fields."""

    model_config = SQLModelConfig(extra="forbid")

    budget_mode: BudgetMode | None = None
    budget_margin: OptNumber = Field(default=None, ge=1.0, le=2.0)


class ServerUpdate(_Update):
    """What an operator may change on a server through the API (not its state). A new BMC
    endpoint drops the stored password unless one comes with it; the credentials themselves
    (bmc_username, bmc_password) only an admin may change (fleet/inventory/servers.py)."""

    model_config = SQLModelConfig(extra="forbid")
    nullable_fields: ClassVar[frozenset[str]] = frozenset(
        {"bmc_system_id", "ssh_address", "ssh_host_key"}
    )

    pool: Pool | None = None
    bmc_protocol: BmcProtocol | None = None
    bmc_address: str | None = Field(default=None, max_length=255, min_length=1)
    bmc_port: OptInt = Field(default=None, ge=1, le=65535)
    bmc_username: str | None = Field(default=None, max_length=100, min_length=1)
    bmc_password: SecretStr | None = None
    bmc_system_id: str | None = Field(default=None, max_length=255)
    # StrictBool: a JSON `0` or `"yes"` is refused (422), as the schema says, not read as false.
    bmc_plain_http: StrictBool | None = None
    ssh_address: str | None = Field(default=None, max_length=255, min_length=1)
    ssh_port: OptInt = Field(default=None, ge=1, le=65535)
    ssh_host_key: str | None = Field(
        default=None, max_length=64, schema_extra={"pattern": SSH_FINGERPRINT_PATTERN}
    )


class ServerPublic(ServerBase):
    site: str
    rack: str
    deployment: str | None  # the deployment whose replicas it runs (provisioning sets it)
    state: ServerState
    state_changed_at: datetime
    power_state: PowerState
    power_state_at: datetime | None
    bmc_reachable: bool | None
    last_heartbeat_at: datetime | None
    health_verdict: Verdict | None
    health_action: str | None
    health_reasons: list[dict[str, Any]]
    agent_ready: bool | None
    agent_draining: bool
    replicas: list[dict[str, Any]]
    agent_version: str | None
    agent_url: str | None
    agent_registered_at: datetime | None
    boot_kind: str | None
    boot_started_at: datetime | None
    drain_reason: str | None
    failed_reason: str | None
    last_fault: str | None
    reboot_count: int
    boot_to_ready_s: float | None
    load_s: float | None
    boot_to_ready_cached_s: float | None = None
    boot_to_ready_uncached_s: float | None = None
    model_version: str | None = None  # "<model>@<version>" it serves (fleet/catalog/)
    cache_entries: list[dict[str, Any]] = []
    cache_budget_bytes: int | None = None
    cache_used_bytes: int | None = None
    cache_free_bytes: int | None = None
    cache_reported_at: datetime | None = None
    drawn_w: float | None
    drawn_source: str | None
    drawn_at: datetime | None
    gpu_power_limit_w: float | None
    bmc_password_set: bool
    created_at: datetime
    updated_at: datetime


class TransitionRequest(SQLModel):
    model_config = SQLModelConfig(extra="forbid")

    # Any state is read (the API explains why a fleet-only target is refused), but the schema
    # lists only the targets an operator may choose.
    to: Annotated[
        ServerState,
        WithJsonSchema({"type": "string", "enum": sorted(s.value for s in OPERATOR_TARGETS)}),
    ]
    reason: str = Field(min_length=1, max_length=500)


class GpuBase(SQLModel):
    index: Int = Field(ge=0, le=63)
    uuid: str | None = Field(default=None, max_length=64)
    model: str = Field(max_length=32)
    memory_mib: Int = Field(ge=0, le=INT32_MAX)
    health: GpuHealth = _enum(GpuHealth, default=GpuHealth.UNKNOWN)


class Gpu(GpuBase, table=True):
    __table_args__ = (sa.UniqueConstraint("server_id", "index"),)

    id: int | None = Field(default=None, primary_key=True)
    server_id: int = Field(foreign_key="server.id", index=True)
    uuid: str | None = Field(default=None, max_length=64, unique=True)


class GpuPublic(GpuBase):
    server: str
    # Its measurements as of the server's last heartbeat (None: no agent has reported it).
    reading: GpuReading | None = None


class GpuModelSpec(SQLModel, table=True):
    """A GPU model added by an inventory file (built-in ones live in fleet.inventory.gpu_models)."""

    __tablename__ = "gpu_model_spec"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=32, unique=True, index=True)
    memory_mib: int
    tdp_w: float
    idle_w: float
    hbm_tb_s: float = 0
    bf16_tflops: float = 0
    fp8_tflops: float = 0


# ---------------------------------------------------------------------------------------------
# Model versions (fleet/catalog/; docs/weights.md)


class ArtifactFormat(StrEnum):
    HF_SAFETENSORS = "hf-safetensors"  # a file of a Hugging Face checkpoint (weights, config)
    TRTLLM_ENGINE = "trtllm-engine"  # a TensorRT-LLM engine file, built for a GPU model and TP
    EXTERNAL = "external"  # delivered outside Fleet (before model versions): never fetched


class ModelVersion(SQLModel, table=True):
    """One version of a model: the files in `model_artifact`. Immutable once created (a new
    set of files is a new version); deleted only when no deployment references it."""

    __tablename__ = "model_version"
    __table_args__ = (sa.UniqueConstraint("model", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(max_length=63, index=True)
    version: str = Field(max_length=63)
    description: str = Field(default="", max_length=500)
    # sha256 over its artifacts' names and digests (fleet/catalog/): the probe's reference key.
    digest: str = Field(max_length=71)
    size_bytes: int = Field(default=0, sa_type=sa.BigInteger)
    created_by: str = Field(max_length=100)
    created_at: datetime = _ts(default_factory=utcnow)


class ModelArtifact(SQLModel, table=True):
    """One file of a model version. `gpu_model`/`tp_size` set: only servers of that GPU model
    serving at that TP size fetch it (a TensorRT-LLM engine is built for both)."""

    __tablename__ = "model_artifact"
    __table_args__ = (sa.UniqueConstraint("version_id", "name", "gpu_model", "tp_size"),)

    id: int | None = Field(default=None, primary_key=True)
    version_id: int = Field(foreign_key="model_version.id", index=True)
    name: str = Field(max_length=255)
    uri: str = Field(max_length=1000)
    sha256: str | None = Field(default=None, max_length=64)
    size_bytes: int | None = Field(default=None, sa_type=sa.BigInteger)
    format: ArtifactFormat = _enum(ArtifactFormat, default=ArtifactFormat.HF_SAFETENSORS)
    gpu_model: str | None = Field(default=None, max_length=32)
    tp_size: int | None = Field(default=None)


# A model's or version's name: one path component on every agent's disk (fleet_core.weights).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_ARTIFACTS = 1000


class ModelArtifactCreate(SQLModel):
    """One file of a new version (`POST /models`, the inventory's `models:`). The service
    checks what the schema cannot: the URI's scheme, the name as a path, sha256 and size
    required unless the format is external (fleet/catalog/versions.py)."""

    model_config = SQLModelConfig(extra="forbid")

    name: str = Field(min_length=1, max_length=255)
    uri: str = Field(min_length=1, max_length=1000)
    sha256: str | None = Field(default=None, min_length=1, max_length=64)
    # At most 2**53 - 1 (8 PiB): every integer up to it is exact as a JSON number read as a
    # double (as JSON Schema validators read them), so the schema and this check agree.
    size_bytes: int | None = Field(default=None, ge=0, le=2**53 - 1)
    format: ArtifactFormat = ArtifactFormat.HF_SAFETENSORS
    gpu_model: str | None = Field(default=None, min_length=1, max_length=32)
    tp_size: OptInt = Field(default=None, ge=1, le=64)


class ModelVersionCreate(SQLModel):
    model_config = SQLModelConfig(extra="forbid")

    model: str = Field(max_length=63, schema_extra={"pattern": MODEL_NAME_PATTERN})
    version: str = Field(max_length=63, schema_extra={"pattern": MODEL_NAME_PATTERN})
    description: str = Field(default="", max_length=500)
    artifacts: list[ModelArtifactCreate] = Field(min_length=1, max_length=MAX_ARTIFACTS)


class ModelArtifactPublic(SQLModel):
    name: str
    uri: str
    sha256: str | None
    size_bytes: int | None
    format: ArtifactFormat
    gpu_model: str | None
    tp_size: int | None


class VersionHolder(SQLModel):
    """A server whose agent reported the version in its cache, and in which state."""

    server: str
    state: str  # ready | fetching | failed
    bytes: int = 0
    total_bytes: int | None = None
    verified_at: datetime | None = None
    error: str | None = None
    reported_at: datetime | None = None


class ModelVersionPublic(SQLModel):
    key: str  # "<model>@<version>"
    model: str
    version: str
    description: str
    digest: str
    size_bytes: int
    external: bool  # weights delivered outside Fleet: never fetched
    created_by: str
    created_at: datetime
    artifacts: list[ModelArtifactPublic] = []
    # Deployments serving it ("stable") or rolling it out ("canary"), and the servers holding it
    # in their cache (`GET /models/{model}/versions/{version}` only; lists leave them empty).
    deployments: list[dict[str, str]] = []
    cached_on: list[VersionHolder] = []


# ---------------------------------------------------------------------------------------------
# Deployments


class DeploymentBase(SQLModel):
    name: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    model_uri: str = Field(min_length=1, max_length=1000)
    model_checksum: str = Field(min_length=1, max_length=200)
    # The inference engine its replicas run (fleet_core/engines) and that engine's options,
    # named after its own flags.
    engine: str = Field(
        default="trtllm", max_length=16, sa_column_kwargs={"server_default": "trtllm"}
    )
    engine_params: dict[str, Any] = _json(dict)
    gpus_per_replica: Int = Field(default=1, ge=1, le=64)
    gpu_models: list[str] = _json(list)
    min_replicas: Int = Field(default=0, ge=0, le=MAX_REPLICAS)
    max_replicas: Int = Field(default=1, ge=0, le=MAX_REPLICAS)
    sla_p95_latency_ms: Number = Field(ge=1, le=MAX_SLA_MS)
    sla_ttft_ms: Number = Field(ge=1, le=MAX_SLA_MS)
    disruption_budget: Int = Field(default=1, ge=1, le=MAX_REPLICAS)
    # Warm spares per allowed GPU model that hold the version in their cache (pre-staged).
    cached_spares: Int = Field(
        default=0, ge=0, le=MAX_REPLICAS, sa_column_kwargs={"server_default": "0"}
    )


def deployment_rule_problems(
    min_replicas: int,
    max_replicas: int,
    engine: str,
    engine_params: dict[str, Any],
    gpus_per_replica: int,
) -> list[str]:
    """The rules across a deployment's fields, which no schema states: the API answers them
    with 400 (the request matched its schema), an inventory file lists them with its errors.
    The engine checks its own params, as the agent will before it starts one."""
    problems = []
    if min_replicas > max_replicas:
        problems.append(f"min_replicas ({min_replicas}) exceeds max_replicas ({max_replicas})")
    try:
        spec = engine_spec(engine)
        spec.check_params(engine_params)
    except ValueError as exc:
        problems.append(str(exc))
        return problems
    tp, pp = spec.parallelism(engine_params)
    tp_key, pp_key = spec.parallel_keys
    if tp * pp != gpus_per_replica:
        problems.append(
            f"gpus_per_replica ({gpus_per_replica}) must equal {tp_key} × {pp_key} "
            f"({tp} × {pp}) for engine {engine}"
        )
    return problems


# engine_params: what the agent will run (fleet_core/engines turns them into the engine's
# command line). Checked here for what any engine needs (finite numbers, a bounded size: every
# routing table and deployment listing carries them); against the deployment's engine by
# deployment_rule_problems (a 400 naming the option), with the agent's own check.
MAX_ENGINE_PARAMS_BYTES = 16 * 1024
# Integer options of any engine: JSON has one number type, 2.0 is the integer 2 (JSON Schema
# says so too), and the agent writes it into a flag, where only `2` will do.
_INT_KEYS = frozenset(
    key
    for engine in ENGINES.values()
    for key, prop in engine.params_schema()["properties"].items()
    if "integer" in (prop.get("type") or ())
)


def _valid_engine_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if params is None:
        return None
    try:
        text = json.dumps(params, allow_nan=False, separators=(",", ":"))
    except ValueError:
        raise ValueError("numbers must be finite (no NaN or infinity)") from None
    if len(text.encode()) > MAX_ENGINE_PARAMS_BYTES:
        raise ValueError(f"at most {MAX_ENGINE_PARAMS_BYTES} bytes of JSON")
    return {
        key: int(value)
        if key in _INT_KEYS and isinstance(value, float) and value.is_integer()
        else value
        for key, value in params.items()
    }


def _engine_params_schema() -> dict[str, Any]:
    """The options of every engine (fleet_core/engines), each engine's own names; an option
    two engines name alike but type differently takes either type here (the deployment's
    engine decides, with a 400)."""
    properties: dict[str, Any] = {}
    for engine in ENGINES.values():
        for key, prop in engine.params_schema()["properties"].items():
            if key in properties and properties[key] != prop:
                properties[key] = {}
            else:
                properties.setdefault(key, prop)
    return {
        "type": "object",
        "description": "the options of the deployment's engine, named after its flags "
        f"(docs/engine.md, Engines); at most {MAX_ENGINE_PARAMS_BYTES} bytes of JSON",
        "properties": properties,
        "additionalProperties": False,
    }


EngineParams = Annotated[
    dict[str, Any], AfterValidator(_valid_engine_params), WithJsonSchema(_engine_params_schema())
]
# The options of trtllm-serve alone: an inventory file's `engine:` mapping (before engines).
TrtllmParams = Annotated[
    dict[str, Any],
    AfterValidator(_valid_engine_params),
    WithJsonSchema(
        engine_spec("trtllm").params_schema()
        | {"description": "trtllm-serve's options (files from before engines)"}
    ),
]
OptEngineParams = Annotated[
    dict[str, Any] | None,
    AfterValidator(_valid_engine_params),
    WithJsonSchema(_engine_params_schema()),
]
# GPU model names a deployment may run on (fleet.inventory.gpu_models and the inventory's own).
GpuModelNames = Annotated[
    list[Annotated[str, StringConstraints(min_length=1, max_length=32)]], MaxLen(64)
]


class Deployment(DeploymentBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    # Servers it should run on now (operators: `fleetctl spares boot`; later the autoscaler).
    # Provisioning holds it: short → spares boot (replacements too), over → servers return.
    target_servers: int = Field(default=0, ge=0, sa_column_kwargs={"server_default": "0"})
    # The autoscaler (fleet/autoscaler/): manual mode (`fleetctl deployments scale D
    # --replicas N` pins it), the calendar's floor, and its cooldown clocks.
    pinned_replicas: int | None = Field(default=None, ge=0)
    floor_servers: int = Field(default=0, ge=0, sa_column_kwargs={"server_default": "0"})
    last_scale_up_at: datetime | None = _ts(default=None)
    last_scale_down_at: datetime | None = _ts(default=None)
    # The model version it serves (fleet/catalog/; docs/weights.md). `model_uri` and
    # `model_checksum` above follow it: the served model's name (the weights' URI for an
    # external version) and the version's digest, which keys the probe's reference.
    model_version_id: int | None = Field(default=None, foreign_key="model_version.id")
    # A rollout (fleet/rollout/): the version being rolled out, the share of requests routers
    # send it, and the plan and its progress (steps, step, status, figures of the last analysis).
    canary_version_id: int | None = Field(default=None, foreign_key="model_version.id")
    canary_weight: float = Field(default=0.0, ge=0, le=1, sa_column_kwargs={"server_default": "0"})
    rollout: dict[str, Any] = _json(dict)
    created_at: datetime = _ts(default_factory=utcnow)
    updated_at: datetime = _ts(default_factory=utcnow)


class DeploymentCreate(DeploymentBase):
    """A new deployment; `deployment_rule_problems` checks it across fields. It serves a model
    version (`model_version`: "<model>@<version>", fleet/catalog/), or, as before versions,
    weights named by `model_uri` and `model_checksum`: an `external` version is made (or
    reused) for them. One or the other (the service says so with a 400)."""

    model_config = SQLModelConfig(extra="forbid")

    model_uri: str | None = Field(  # type: ignore[assignment]
        default=None, min_length=1, max_length=1000
    )
    model_checksum: str | None = Field(  # type: ignore[assignment]
        default=None, min_length=1, max_length=200
    )
    model_version: str | None = Field(default=None, min_length=3, max_length=127)
    engine: EngineName = "trtllm"
    engine_params: EngineParams = Field(default_factory=dict)
    gpu_models: GpuModelNames = Field(default_factory=list)

    def rule_problems(self) -> list[str]:
        return deployment_rule_problems(
            self.min_replicas,
            self.max_replicas,
            self.engine,
            self.engine_params,
            self.gpus_per_replica,
        )


class DeploymentUpdate(_Update):
    model_config = SQLModelConfig(extra="forbid")

    model_uri: str | None = Field(default=None, min_length=1, max_length=1000)
    model_checksum: str | None = Field(default=None, min_length=1, max_length=200)
    engine: EngineName | None = None
    engine_params: OptEngineParams = None
    gpus_per_replica: OptInt = Field(default=None, ge=1, le=64)
    gpu_models: GpuModelNames | None = None
    min_replicas: OptInt = Field(default=None, ge=0, le=MAX_REPLICAS)
    max_replicas: OptInt = Field(default=None, ge=0, le=MAX_REPLICAS)
    sla_p95_latency_ms: OptNumber = Field(default=None, ge=1, le=MAX_SLA_MS)
    sla_ttft_ms: OptNumber = Field(default=None, ge=1, le=MAX_SLA_MS)
    disruption_budget: OptInt = Field(default=None, ge=1, le=MAX_REPLICAS)
    cached_spares: OptInt = Field(default=None, ge=0, le=MAX_REPLICAS)
    # Serve another version at once, on every server (no canary): `fleetctl deployments
    # rollout` moves servers step by step instead. 409 while a rollout runs.
    model_version: str | None = Field(default=None, min_length=3, max_length=127)


class DeploymentPublic(DeploymentBase):
    # What the fleet holds it at (read-only here): the autoscaler's target, the calendar's
    # floor and an operator's pin (`fleetctl deployments scale`).
    target_servers: int = 0
    floor_servers: int = 0
    pinned_replicas: int | None = None
    model_version: str | None = None  # "<model>@<version>"
    canary_version: str | None = None
    canary_weight: float = 0.0
    rollout: dict[str, Any] = {}
    created_at: datetime
    updated_at: datetime


# ---------------------------------------------------------------------------------------------
# Events (append-only) and API tokens


class EventBase(SQLModel):
    subject_type: str = Field(max_length=32)
    subject: str = Field(max_length=255)
    actor: str = Field(max_length=100)
    kind: str = Field(max_length=64)
    from_state: str | None = Field(default=None, max_length=32)
    to_state: str | None = Field(default=None, max_length=32)
    message: str = Field(default="", max_length=2000)
    details: dict[str, Any] = _json(dict)


class Event(EventBase, table=True):
    __table_args__ = (sa.Index("ix_event_subject", "subject_type", "subject"),)

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = _ts(default_factory=utcnow, index=True)
    kind: str = Field(max_length=64, index=True)


class EventPublic(EventBase):
    id: int
    at: datetime


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_token"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=100)
    role: Role = _enum(Role)
    # SHA-256 of the token: tokens are 256-bit random, so a slow hash buys nothing.
    token_hash: str = Field(max_length=64, unique=True, index=True)
    # Agent tokens act for exactly one server.
    server_id: int | None = Field(default=None, foreign_key="server.id")
    created_at: datetime = _ts(default_factory=utcnow)
    revoked_at: datetime | None = _ts(default=None)
    # None: never expires. An expired token answers 401 like a revoked one.
    expires_at: datetime | None = _ts(default=None)
    # A rotated agent token: the token that replaced it (this one expires after the overlap).
    replaced_by_id: int | None = Field(default=None, foreign_key="api_token.id")


# ---------------------------------------------------------------------------------------------
# Callers of the routers (fleet/callers.py, docs/api.md "Tenants and client keys"): tenants
# share a deployment's slots when it is contended; client keys authenticate requests to the
# routers, each with its own rate limits.

# Requests and tokens per minute a key may be given: far beyond any client, within BIGINT.
MAX_KEY_RPM = 10_000_000
MAX_KEY_TPM = 10_000_000_000
MAX_KEY_NAME = 100


class Tenant(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    # The part of a contended deployment's slots it may hold (0 < share <= 1).
    concurrency_share: float = Field(default=1.0, gt=0, le=1)
    created_at: datetime = _ts(default_factory=utcnow)


class TenantCreate(SQLModel):
    model_config = SQLModelConfig(extra="forbid")

    name: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    concurrency_share: Number = Field(default=1.0, gt=0, le=1)


class TenantUpdate(_Update):
    model_config = SQLModelConfig(extra="forbid")

    concurrency_share: OptNumber = Field(default=None, gt=0, le=1)


class TenantPublic(SQLModel):
    id: int
    name: str
    concurrency_share: float
    created_at: datetime
    keys: int  # its active keys (neither revoked nor expired)


class ClientKey(SQLModel, table=True):
    __tablename__ = "client_key"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=MAX_KEY_NAME)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    # SHA-256 of the key: keys are 256-bit random, so a slow hash buys nothing. Routers match
    # a request's key by it (GET /routing/callers); nothing else reads it.
    key_hash: str = Field(max_length=64, unique=True, index=True)
    # None: unlimited.
    requests_per_minute: int | None = Field(default=None, sa_type=sa.BigInteger)
    tokens_per_minute: int | None = Field(default=None, sa_type=sa.BigInteger)
    created_at: datetime = _ts(default_factory=utcnow)
    revoked_at: datetime | None = _ts(default=None)
    expires_at: datetime | None = _ts(default=None)


class ClientKeyCreate(SQLModel):
    model_config = SQLModelConfig(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_KEY_NAME)
    tenant: str = Field(max_length=63, schema_extra={"pattern": NAME_PATTERN})
    requests_per_minute: OptInt = Field(default=None, ge=1, le=MAX_KEY_RPM)
    tokens_per_minute: OptInt = Field(default=None, ge=1, le=MAX_KEY_TPM)
    # `90d`, `12h` or `30m` (fleet/auth.py parse_lifetime); none: it never expires.
    expires_in: str | None = Field(default=None, min_length=1, max_length=20)


class ClientKeyUpdate(_Update):
    """A key's limits: a field left out keeps its value, null lifts the limit."""

    model_config = SQLModelConfig(extra="forbid")
    nullable_fields: ClassVar[frozenset[str]] = frozenset(
        {"requests_per_minute", "tokens_per_minute"}
    )

    requests_per_minute: OptInt = Field(default=None, ge=1, le=MAX_KEY_RPM)
    tokens_per_minute: OptInt = Field(default=None, ge=1, le=MAX_KEY_TPM)


class ClientKeyPublic(SQLModel):
    """A key as lists show it: never its value or hash."""

    id: int
    name: str
    tenant: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None
    active: bool  # neither revoked nor expired


class ClientKeyCreated(ClientKeyPublic):
    """A new key: `key` is its value, shown this once (only its hash is kept)."""

    key: str


class RouterUsage(SQLModel, table=True):
    """One router's last reported usage per client key ("<key id>" → requests and tokens it
    admitted over its rate window): the other routers count it against the keys' limits."""

    __tablename__ = "router_usage"

    id: int | None = Field(default=None, primary_key=True)
    router: str = Field(max_length=100, unique=True)
    at: datetime = _ts(default_factory=utcnow, index=True)
    callers: dict[str, Any] = _json(dict)
    # The trailing window those figures cover (None: the router did not say).
    window_s: float | None = None


class DiagnosticBundle(SQLModel, table=True):
    """What `fleetctl servers diagnose` collected from one server over SSH (fleet/ssh/
    diagnose.py): a gzipped tar of each command's output, bounded in size, kept in the
    database so every service replica can serve it."""

    __tablename__ = "diagnostic_bundle"

    id: int | None = Field(default=None, primary_key=True)
    server_id: int = Field(foreign_key="server.id", index=True)
    created_at: datetime = _ts(default_factory=utcnow)
    created_by: str = Field(max_length=100)
    # Per command: its name, exit status, bytes kept, whether it was cut, seconds taken.
    summary: list[dict[str, Any]] = _json(list)
    truncated: bool = False
    size_bytes: int
    sha256: str = Field(max_length=64)
    content: bytes = Field(sa_column=sa.Column(sa.LargeBinary(), nullable=False))


class Autopilot(SQLModel, table=True):
    """One row: whether automatic actions may run, and the remediation breaker."""

    id: int | None = Field(default=None, primary_key=True)
    paused: bool = False
    reason: str = Field(default="", max_length=500)
    changed_by: str | None = Field(default=None, max_length=100)
    changed_at: datetime | None = _ts(default=None)
    breaker_open: bool = False
    breaker_reason: str | None = Field(default=None, max_length=500)
    breaker_at: datetime | None = _ts(default=None)


class ProbeReference(SQLModel, table=True):
    """The answer a deployment's model gives to the quality probe's prompt (greedy decoding):
    the first answer recorded for a model checksum is the reference every replica must match."""

    __tablename__ = "probe_reference"
    __table_args__ = (sa.UniqueConstraint("deployment_id", "model_checksum"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(foreign_key="deployment.id", index=True)
    model_checksum: str = Field(max_length=200)
    prompt: str = Field(max_length=2000)
    answer: str = Field(max_length=20000)
    recorded_at: datetime = _ts(default_factory=utcnow)
    recorded_from: str = Field(max_length=63)  # the server whose answer became the reference


class ScalingDecision(SQLModel, table=True):
    """One autoscaler decision: the rule that fired, the target before and after, the inputs."""

    __tablename__ = "scaling_decision"

    id: int | None = Field(default=None, primary_key=True)
    deployment: str = Field(max_length=63, index=True)
    at: datetime = _ts(default_factory=utcnow)
    rule: str = Field(max_length=32)
    target_before: int
    target_after: int
    reason: str = Field(max_length=1000)
    inputs: dict[str, Any] = _json(dict)


# ---------------------------------------------------------------------------------------------
# The scheduled-scaling calendar (fleet/calendar/)


class ScheduleEntry(SQLModel, table=True):
    __tablename__ = "schedule_entry"

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(foreign_key="deployment.id", index=True)
    cron: str = Field(max_length=200)
    timezone: str = Field(max_length=64)
    min_replicas: int
    end_cron: str | None = Field(default=None, max_length=200)
    duration_s: int | None = None
    note: str = Field(default="", max_length=500)
    created_at: datetime = _ts(default_factory=utcnow)
    created_by: str = Field(max_length=100)
    # Written by the leader's calendar tick only. `fired_for` is the start T of the last window
    # it fired (or found missed): a window fires once, across replicas and restarts.
    fired_for: datetime | None = _ts(default=None)
    fired_at: datetime | None = _ts(default=None)  # None with fired_for set: missed
    active_until: datetime | None = _ts(default=None)  # the open window's end (None: closed)


class RouterReport(SQLModel, table=True):
    """A router's latest view of one deployment: requests waiting in it and the latency its
    clients see. The autoscaler adds the waiting to the engines' queues and takes the worse of
    the router's and the engines' p95 (fleet/autoscaler/signals.py, `aggregate`)."""

    __tablename__ = "router_report"
    __table_args__ = (sa.UniqueConstraint("router", "deployment"),)

    id: int | None = Field(default=None, primary_key=True)
    router: str = Field(max_length=100)
    deployment: str = Field(max_length=63, index=True)
    at: datetime = _ts(default_factory=utcnow)
    waiting: int = Field(default=0, ge=0)
    p95_s: float | None = None
    ttft_p95_s: float | None = None
    # Per model version ("<model>@<version>" → requests and errors answered by replicas of it
    # since the router started, p95s of the last minute): a rollout's analysis (fleet/rollout/).
    versions: dict[str, Any] = _json(dict)
    # Requests (and their tokens: prompt + expected output) that arrived for the deployment
    # since the router started, refused ones included: the autoscaler's demand history takes
    # differences (fleet/autoscaler/demand.py). None: a router that does not count them.
    arrived: int | None = Field(default=None, sa_type=sa.BigInteger)
    arrived_tokens: int | None = Field(default=None, sa_type=sa.BigInteger)


class DemandHour(SQLModel, table=True):
    """One deployment's demand for one hour, a value per minute (fleet/autoscaler/demand.py):
    requests and tokens that arrived at the routers, the servers serving and their batch-slot
    use, and the p95 and TTFT p95 the autoscaler saw. Packed as 60 little-endian float32 each
    (NaN: a minute not seen), so a year of 100 deployments is 876,000 rows, not 52 million;
    written by the leader's autoscaler only."""

    __tablename__ = "demand_hour"
    __table_args__ = (sa.UniqueConstraint("deployment", "hour"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment: str = Field(max_length=63)
    hour: datetime = _ts(index=True)
    requests: bytes = Field(sa_type=sa.LargeBinary)
    tokens: bytes = Field(sa_type=sa.LargeBinary)
    servers: bytes = Field(sa_type=sa.LargeBinary)
    slot_use: bytes = Field(sa_type=sa.LargeBinary)
    p95_s: bytes = Field(sa_type=sa.LargeBinary)
    ttft_p95_s: bytes = Field(sa_type=sa.LargeBinary)


class PowerSample(SQLModel, table=True):
    """One bucket of measured draw for a server or a rack (fleet/power/series.py): the largest
    and the mean reading within it. Written once per bucket when it closes, so the write rate
    is servers ÷ bucket width (10,000 servers at 300 s: 33 rows/s), and pruned past the
    retention (docs/power.md)."""

    __tablename__ = "power_sample"
    __table_args__ = (sa.UniqueConstraint("kind", "subject", "bucket_start"),)

    id: int | None = Field(default=None, primary_key=True)
    kind: str = Field(max_length=8)  # "server" or "rack"
    subject: str = Field(max_length=63)
    bucket_start: datetime = _ts(index=True)
    bucket_s: float
    max_w: float
    mean_w: float
    samples: int
    estimated: bool = False  # some reading in it was an agent-based estimate, not a BMC's


class Lease(SQLModel, table=True):
    """Work that must not run twice at once across service processes, e.g. `power:<server>`
    (fleet/leases.py): who holds it and until when; gone when the work ends. A row whose
    expiry has passed belongs to nobody and is taken over by the next taker."""

    name: str = Field(primary_key=True, max_length=200)
    holder: str = Field(max_length=100, index=True)
    taken_at: datetime = _ts()
    expires_at: datetime = _ts()


class Wakeup(SQLModel, table=True):
    """A leader loop's wake-up counter (fleet/control/wakeups.py): any replica bumps it in the
    transaction that changed what the loop should act on; the leader polls it."""

    name: str = Field(primary_key=True, max_length=32)
    seq: int = Field(default=0, sa_type=sa.BigInteger)


class BootRecord(SQLModel, table=True):
    """One measured boot: power-on to serving, and its load part, of a server the provisioner
    booted (fleet/provisioning/boot_times.py keeps the history and its quantiles)."""

    __tablename__ = "boot_record"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = _ts(default_factory=utcnow, index=True)  # when it started serving
    server: str = Field(max_length=63)
    gpu_model: str = Field(max_length=32, index=True)
    # True: the boot began with its version in the weights cache; False: it fetched first;
    # None: not recorded (a resume, or a stage that a scale-out took over).
    cache_hit: bool | None = None
    boot_s: float
    load_s: float | None = None
