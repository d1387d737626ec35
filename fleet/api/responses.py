"""The API's answers that are not a table's public model (those live in fleet/models.py): lists,
reports and views. Each states exactly the JSON its route sends, so that `/openapi.json` shows
every response shape (tests/unit/test_openapi_responses.py checks that none is left empty) and
FastAPI checks every answer against it.

None carries a secret: BMC passwords, token hashes and agents' API keys have no field here, and a
model drops any key it does not declare.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from fleet.bmc.base import Action
from fleet.lifecycle.states import ServerState
from fleet.models import EventPublic, PowerState, ServerPublic

Row = TypeVar("Row")


class Page(BaseModel, Generic[Row]):
    """One page of a paged list (`?limit=&offset=`, fleet/api/deps.py `Paging`): the total count
    and absolute links to the neighbouring pages (null at either end)."""

    count: int
    next: str | None
    previous: str | None
    results: list[Row]


class Listing(BaseModel, Generic[Row]):
    """A whole list, not paged: one row per deployment or calendar entry, or bounded by the
    route's own `limit`."""

    count: int
    results: list[Row]


# ---------------------------------------------------------------------------------------------
# Servers and power


class TransitionOutcome(BaseModel):
    """An operator's move: the server after it, and the event it wrote (null: no move)."""

    server: ServerPublic
    event: EventPublic | None


class PowerOutcome(BaseModel):
    """One server's power action (fleet/power/actions.py `PowerReport`)."""

    server: str
    action: Action
    ok: bool
    sent: bool  # whether a command went to the BMC (not for the state it is already in)
    state_before: PowerState | None
    state_after: PowerState | None
    error: str | None  # one line naming the server, its BMC and the cause
    started: float  # seconds after the bulk action began (shows the per-rack stagger)
    seconds: float


class BulkPowerOutcome(BaseModel):
    count: int
    failed: int
    results: list[PowerOutcome]


class VerifyOutcome(BaseModel):
    """One server's first contact (fleet/power/actions.py `VerifyReport`)."""

    server: str
    ok: bool
    power_state: PowerState | None
    moved_to: ServerState | None  # the lifecycle state it reached, if it moved
    message: str


class BulkVerifyOutcome(BaseModel):
    count: int
    failed: int
    results: list[VerifyOutcome]


# ---------------------------------------------------------------------------------------------
# Provisioning: the warm pool, boots, drains and the autopilot


class WarmSpare(BaseModel):
    server: str
    rack: str
    gpus: int
    boot_cost_w: float  # what booting it adds to its rack's committed power
    rack_headroom_w: float
    fits: bool  # whether that keeps the rack within its budget
    boot_to_ready_s: float | None  # measured; null before its first boot
    versions_cached: list[str]  # "<model>@<version>" its agent reported verified in its cache


class WarmPoolGroup(BaseModel):
    site: str
    gpu_model: str
    count: int
    spares: list[WarmSpare]


class WarmPool(BaseModel):
    count: int  # spares in all groups
    pools: list[WarmPoolGroup]


class BootOutcome(BaseModel):
    deployment: str
    booted: list[str]  # in boot order
    short: int  # spares asked for that placement could not find
    reasons: list[str]  # why each shortfall (racks and watts)


class DrainView(BaseModel):
    server: str
    state: ServerState
    drain_reason: str | None


class AutopilotView(BaseModel):
    paused: bool
    reason: str
    changed_by: str | None
    changed_at: datetime | None
    breaker_open: bool
    breaker_reason: str | None
    breaker_at: datetime | None


# ---------------------------------------------------------------------------------------------
# The autoscaler

ScaleMode = Literal["pinned", "auto"]


class ScalingSignals(BaseModel):
    """A deployment's signals as the autoscaler's next tick sees them (fleet/autoscaler/)."""

    queue_per_gpu: float | None
    kv_use: float | None
    p95_latency_s: float | None
    ttft_p95_s: float | None
    serving_gpus: int
    # Requests running ÷ batch slots (max_batch_size × replicas); None: no batch size set.
    slot_use: float | None = None


class ScalingStatus(BaseModel):
    deployment: str
    mode: ScaleMode
    pinned_replicas: int | None
    target: int
    serving: int
    on_the_way: int  # booting or loading
    last_rule: str | None
    last_reason: str | None
    last_decision_at: datetime | None
    signals: ScalingSignals


class ScalingDecisionPublic(BaseModel):
    id: int
    deployment: str
    at: datetime
    rule: str
    target_before: int
    target_after: int
    reason: str
    inputs: dict[str, Any]  # the signals and settings the rule saw


class ScaleOutcome(BaseModel):
    deployment: str
    mode: ScaleMode
    pinned_replicas: int | None


# ---------------------------------------------------------------------------------------------
# The routing table (fleet/registry/routing_table.py; routers read it: fleet/router/discovery.py)


class RoutableReplica(BaseModel):
    server: str
    gpu_model: str
    agent_url: str
    index: int | None
    url: str
    state: str | None
    version: str | None = None  # "<model>@<version>" the replica runs (fleet/rollout/)


class RouteVersions(BaseModel):
    """The versions a deployment serves: routers send `canary_weight` of its requests to the
    canary's replicas during a rollout (docs/router.md)."""

    stable: str | None = None
    canary: str | None = None
    canary_weight: float = 0.0


class DeploymentRoutes(BaseModel):
    deployment: str
    models: list[str]  # the names requests may use for it
    model_uri: str
    engine: str = "trtllm"  # fleet_core/engines
    # Per class (interactive, batch): the fields the router adds to a request so that the
    # engine schedules it by priority ({}: none).
    priority_fields: dict[str, dict[str, Any]] = {}
    tp_size: int  # one replica's tensor-parallel size, whatever the engine calls it
    max_batch_size: int | None  # the most requests a replica runs at once, when set
    sla_p95_latency_ms: float
    sla_ttft_ms: float
    replicas: list[RoutableReplica]
    # No replica: the seconds a server takes to boot for it (what a router answers in
    # Retry-After when a request waited for one in vain); None while it has replicas.
    cold_start_s: float | None = None
    versions: RouteVersions = RouteVersions()


# ---------------------------------------------------------------------------------------------
# The calendar (fleet/calendar/entries.py)


class ScheduleWindow(BaseModel):
    """One window in UTC and, as ISO 8601 text with its offset, in the entry's time zone."""

    start: datetime
    start_local: str
    end: datetime
    end_local: str
    boot_at: datetime  # start − the lead: when the boots begin
    boot_at_local: str


class ScheduleEntryPublic(BaseModel):
    id: int
    deployment: str
    cron: str
    timezone: str
    min_replicas: int
    end_cron: str | None
    duration_s: int | None
    note: str
    created_at: datetime
    created_by: str
    active: bool
    active_until: datetime | None
    last_window_start: datetime | None
    last_fired_at: datetime | None
    lead_s: float
    lead_basis: str
    next: ScheduleWindow | None


class SchedulePreview(BaseModel):
    deployment: str
    timezone: str
    lead_s: float
    lead_basis: str
    count: int
    results: list[ScheduleWindow]


# ---------------------------------------------------------------------------------------------
# Probes (outside /api/v1)


class Liveness(BaseModel):
    status: Literal["ok"]


class ReadinessAnswer(BaseModel):
    status: Literal["ready", "not ready"]
    checks: dict[str, str]  # "database", "migrations": "ok" or what is wrong
