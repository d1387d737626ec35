"""What the agent and the fleet say to each other: register, heartbeat, and the fleet's answer.

One set of pydantic models for both sides: the service validates reports with them
(fleet/registry/agent_reports.py, POST /api/v1/agent/register and /heartbeat) and the agent builds
its reports and reads the answer with them (fleet_agent/fleet_client.py). The JSON field names are
the wire format: changing one breaks every agent in the field. Pure: no I/O.

Reports are strict (`extra="forbid"`, bounded sizes): the fleet refuses what it does not know.
The answer (`Reply`) is read leniently by the agent: a field it lacks keeps the agent's current
value, and fields it does not know are ignored, so a newer fleet can answer an older agent. The
service answers with a subclass whose fields are all required (fleet/registry/agent_reports.py).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from fleet_core.fault_policy import RepairAction, Verdict

MAX_GPUS = 64
MAX_REASONS = 256
MAX_CACHE_ENTRIES = 256
MAX_REPLICA_ERROR = 500  # characters of a replica's last error in a heartbeat
REGISTER_PATH = "/api/v1/agent/register"
HEARTBEAT_PATH = "/api/v1/agent/heartbeat"


class GpuHealth(StrEnum):
    """One GPU's health as the agent's policy judges it (the verdicts, or not judged yet)."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuFound(_Strict):
    index: int = Field(ge=0, le=MAX_GPUS - 1)
    uuid: str | None = Field(default=None, max_length=64)
    name: str | None = Field(default=None, max_length=100)
    memory_mib: int | None = Field(default=None, ge=0)
    pci_bus_id: str | None = Field(default=None, max_length=32)


class Registration(_Strict):
    server: str = Field(max_length=63)
    agent_version: str = Field(min_length=1, max_length=32)
    agent_url: str | None = Field(default=None, max_length=255, pattern=r"^https?://\S+$")
    # The key the agent's local API asks of /probe callers (fleet_agent/config.py api_key).
    agent_api_key: SecretStr | None = Field(default=None, min_length=16, max_length=256)
    telemetry: str = Field(max_length=32)
    driver_version: str | None = Field(default=None, max_length=32)
    gpus: list[GpuFound] = Field(default_factory=list, max_length=MAX_GPUS)

    def to_wire(self) -> dict[str, Any]:
        """The JSON body the agent sends: the key in clear (a SecretStr dumps as stars), since
        the fleet stores it to call the agent's /probe."""
        body = self.model_dump(mode="json")
        key = self.agent_api_key
        body["agent_api_key"] = key.get_secret_value() if key is not None else None
        return body


MAX_XIDS = 16  # distinct Xid codes a GPU reports at once (more is one bad GPU: 16 say so)


class GpuReading(_Strict):
    """One GPU's measurements as of a heartbeat (NVML or DCGM through the agent's backend,
    fleet_core/telemetry.py): what the fleet stores per server and its console shows. None: the
    backend could not read it, never a made-up zero."""

    index: int = Field(ge=0, le=MAX_GPUS - 1)
    lost: bool = False
    temperature_c: float | None = None
    slowdown_temp_c: float | None = None  # where the GPU starts to slow itself down
    memory_used_mib: int | None = Field(default=None, ge=0)
    memory_total_mib: int | None = Field(default=None, ge=0)
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    power_w: float | None = Field(default=None, ge=0)
    power_limit_w: float | None = Field(default=None, ge=0)  # the enforced limit
    ecc_uncorrected_volatile: int | None = Field(default=None, ge=0)  # since the driver loaded
    remapped_rows_correctable: int | None = Field(default=None, ge=0)
    remapped_rows_uncorrectable: int | None = Field(default=None, ge=0)
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    clock_events: int | None = Field(default=None, ge=0)  # NVML clocks-event reason bits
    # The Xid codes seen on this GPU within the agent's fault-policy window, ascending.
    xids: list[int] = Field(default_factory=list, max_length=MAX_XIDS)


class GpuStatus(GpuReading):
    """A GPU in a heartbeat: its measurements, its uuid and the agent's verdict on it."""

    uuid: str | None = Field(default=None, max_length=64)
    health: GpuHealth = GpuHealth.UNKNOWN


class HealthReason(_Strict):
    code: str = Field(max_length=64)
    gpu: int | None = Field(default=None, ge=0, le=MAX_GPUS - 1)
    message: str = Field(max_length=500)
    action: RepairAction
    verdict: Verdict


class ReplicaStatus(_Strict):
    """One engine replica as the agent's supervisor sees it (fleet_agent/engine/supervisor.py)."""

    index: int = Field(ge=0, le=MAX_GPUS - 1)
    gpus: list[int] = Field(default_factory=list, max_length=MAX_GPUS)
    port: int | None = Field(default=None, ge=1, le=65535)
    url: str | None = Field(default=None, max_length=255, pattern=r"^https?://\S+$")
    state: str = Field(max_length=32)
    # The engine's process (its watchdog's, fleet_agent/engine/leash.py): the same pid after an
    # agent restart says the engine was adopted, not started again.
    pid: int | None = Field(default=None, ge=1)
    restarts: int = Field(default=0, ge=0)
    load_seconds: float | None = Field(default=None, ge=0)
    queued: int | None = Field(default=None, ge=0)
    running: int | None = Field(default=None, ge=0)
    kv_used_fraction: float | None = Field(default=None, ge=0, le=1)
    cache_hit_rate: float | None = Field(default=None, ge=0, le=1)
    tokens_per_s: float | None = Field(default=None, ge=0)
    ttft_p50_s: float | None = Field(default=None, ge=0)
    ttft_p95_s: float | None = Field(default=None, ge=0)
    e2e_p50_s: float | None = Field(default=None, ge=0)
    e2e_p95_s: float | None = Field(default=None, ge=0)
    # Requests the engine preempted (KV cache full: paused and resumed), since it started.
    preemptions: int | None = Field(default=None, ge=0)
    version: str | None = Field(default=None, max_length=130)  # the model version it serves
    engine: str | None = Field(default=None, max_length=16)  # trtllm | vllm | sglang
    # Its supervisor's last error, one line: an engine's exit code and last log line, a load
    # timeout, a version the agent does not drive. With state "failed" the fleet fails a loading
    # server at once, saying this, instead of waiting out its load deadline.
    error: str | None = Field(default=None, max_length=MAX_REPLICA_ERROR)


class CachedVersion(_Strict):
    """One model version in the agent's weights cache (fleet_agent/weights/cache.py)."""

    key: str = Field(max_length=130)  # "<model>@<version>" (fleet_core.weights.version_key)
    state: Literal["ready", "fetching", "failed"]
    bytes: int = Field(default=0, ge=0)  # on disk now (verified files, plus partial ones)
    total_bytes: int | None = Field(default=None, ge=0)  # the version's artifacts, summed
    verified_at: datetime | None = None  # every artifact's sha256 checked (state "ready")
    last_used_at: datetime | None = None  # an engine last started on it (LRU order)
    error: str | None = Field(default=None, max_length=500)  # why "failed": one line
    # Since the agent started: fetches of this version that resumed after a cut, and files
    # whose sha256 did not match (discarded and fetched again): the fleet records each rise.
    resumes: int = Field(default=0, ge=0)
    checksum_failures: int = Field(default=0, ge=0)


class CacheReport(_Strict):
    """The agent's weights cache as of this heartbeat: what it holds and the room left."""

    budget_bytes: int = Field(ge=0)
    used_bytes: int = Field(ge=0)
    free_bytes: int | None = Field(default=None, ge=0)  # the cache's file system, free
    entries: list[CachedVersion] = Field(default_factory=list, max_length=MAX_CACHE_ENTRIES)


class Heartbeat(_Strict):
    server: str = Field(max_length=63)
    verdict: Verdict
    action: RepairAction = RepairAction.NONE
    reasons: list[HealthReason] = Field(default_factory=list, max_length=MAX_REASONS)
    gpus: list[GpuStatus] = Field(default_factory=list, max_length=MAX_GPUS)
    snapshot_at: datetime | None = None
    draining: bool = False
    ready: bool | None = None  # the agent's /readyz: GPUs fine, not draining, replicas ready
    replicas: list[ReplicaStatus] = Field(default_factory=list, max_length=MAX_GPUS)
    cache: CacheReport | None = None  # None: an agent without a weights cache (older ones)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ArtifactRef(BaseModel):
    """One file of a model version, as the agent fetches it into its cache."""

    name: str  # its path inside the version's directory ("model-00001-of-00002.safetensors")
    uri: str  # file://, http(s):// or s3://
    sha256: str | None = None  # 64 lowercase hex digits; None only for an external version
    size_bytes: int | None = None
    format: str = "hf-safetensors"


class ModelRef(BaseModel):
    """A model version as the agent needs it: where its files come from. `external`: the
    weights are delivered outside Fleet (deployments from before model versions): nothing is
    fetched, the engine reads model_root/<deployment>/<basename of the one artifact's URI>."""

    model: str
    version: str
    key: str  # "<model>@<version>": the cache's name for it
    external: bool = False
    artifacts: list[ArtifactRef] = Field(default_factory=list)


class Assignment(BaseModel):
    """What the server should run: nothing, a deployment's replicas, drain, or stage (fetch
    the versions in `stage` into the cache and start no engine: a warm spare pre-staged)."""

    kind: Literal["none", "serve", "drain", "stage"]
    deployment: str | None = None
    model_uri: str | None = None  # the served model's reference (legacy: its weights' URI)
    model_checksum: str | None = None  # the version's digest (the probe's reference key)
    model: ModelRef | None = None  # the version to serve (kind "serve")
    # The engine that serves it (fleet_core/engines: trtllm, vllm, sglang) and its options.
    engine: str = "trtllm"
    engine_params: dict[str, Any] = Field(default_factory=dict)
    gpus_per_replica: int | None = None
    replicas: int = 0
    # Versions to fetch now (kind "stage", or ahead of a rollout) and versions the cache must
    # not evict (in use or being rolled out anywhere in the deployment: their keys).
    stage: list[ModelRef] = Field(default_factory=list)
    keep: list[str] = Field(default_factory=list)


class Reply(BaseModel):
    """The fleet's answer to a registration or a heartbeat, as the agent reads it."""

    server: str | None = None
    state: str | None = None  # the server's lifecycle state (fleet.lifecycle.states)
    heartbeat_interval_s: float | None = None
    expected_gpus: int | None = None  # what the inventory says: the policy flags a missing GPU
    assignment: Assignment = Field(default_factory=lambda: Assignment(kind="none"))
    # Replica URLs of this heartbeat that the fleet dropped (field: why); the agent logs them.
    refused_urls: list[str] = Field(default_factory=list)
    # The per-GPU power limit the fleet's cap valve asks for (watts; None: the GPU's default).
    # The agent applies it to every GPU (NVML nvmlDeviceSetPowerManagementLimit), clamped to
    # what the GPU allows, and reports the enforced limit in its telemetry.
    gpu_power_limit_w: float | None = Field(default=None, gt=0)
