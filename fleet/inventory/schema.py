"""The inventory file format, and parsing that names the place of every error.

Errors never echo the offending value: a bad row may be a BMC password.
"""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
)

from fleet.errors import ValidationFailed
from fleet.models import NAME_PATTERN, BmcProtocol, FeedSide, Phase, Pool, RackStatus
from fleet.validation import validation_messages


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError("must be 1-65535")
    return value


Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
Port = Annotated[int, AfterValidator(_port)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class GpuModelIn(_Strict):
    name: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    memory_mib: int = Field(gt=0)
    tdp_w: float = Field(gt=0)
    idle_w: float = Field(ge=0)
    hbm_tb_s: float = Field(default=0, ge=0)
    bf16_tflops: float = Field(default=0, ge=0)
    fp8_tflops: float = Field(default=0, ge=0)


class BmcIn(_Strict):
    protocol: BmcProtocol
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    port: Port
    username: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    # Optional on re-import: an omitted password keeps the stored one (export never writes it).
    password: SecretStr | None = None
    system_id: Annotated[str, StringConstraints(max_length=255)] | None = None


class GpuIn(_Strict):
    model: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    count: int = Field(ge=0, le=64)
    memory_mib: int | None = Field(default=None, gt=0)


class PowerIn(_Strict):
    idle_w: float = Field(ge=0)
    standby_w: float = Field(ge=0)
    max_w: float = Field(gt=0)


class ServerIn(_Strict):
    name: Name
    serial: Annotated[str, StringConstraints(max_length=100)] | None = None
    u: int = Field(ge=1, le=60)
    u_height: int = Field(default=1, ge=1, le=16)
    bmc: BmcIn
    gpu: GpuIn
    power: PowerIn
    pool: Pool = Pool.WARM
    models_cached: list[str] = Field(default_factory=list)


class RackedServerIn(ServerIn):
    """A server listed at the top level, placed into a rack by name (in the file or the fleet)."""

    rack: Name


class FeedIn(_Strict):
    name: Name
    side: FeedSide
    volts: float = Field(gt=0, le=1000)
    amps: float = Field(gt=0, le=1000)
    phase: Phase = Phase.SINGLE
    max_utilisation_pct: float = Field(default=80.0, gt=0, le=100)


Description = Annotated[str, StringConstraints(max_length=500)]


class RackIn(_Strict):
    name: Name
    u_height: int = Field(default=42, ge=1, le=60)
    status: RackStatus = RackStatus.ACTIVE
    description: Description = ""
    feeds: list[FeedIn] = Field(default_factory=list)
    servers: list[ServerIn] = Field(default_factory=list)


class SiteIn(_Strict):
    name: Name
    description: Description = ""
    racks: list[RackIn] = Field(default_factory=list)


class ModelRefIn(_Strict):
    uri: Annotated[str, StringConstraints(min_length=1, max_length=1000)]
    checksum: Annotated[str, StringConstraints(min_length=1, max_length=200)]


class ReplicasIn(_Strict):
    min: int = Field(default=0, ge=0)
    max: int = Field(default=1, ge=0)


class SlaIn(_Strict):
    p95_latency_ms: float = Field(gt=0)
    ttft_ms: float = Field(gt=0)


class DeploymentIn(_Strict):
    name: Name
    model: ModelRefIn
    engine: dict[str, Any] = Field(default_factory=dict)
    gpus_per_replica: int = Field(default=1, ge=1, le=64)
    gpu_models: list[str] = Field(default_factory=list)
    replicas: ReplicasIn = Field(default_factory=ReplicasIn)
    sla: SlaIn
    disruption_budget: int = Field(default=1, ge=1)


class InventoryFile(_Strict):
    gpu_models: list[GpuModelIn] = Field(default_factory=list)
    sites: list[SiteIn] = Field(default_factory=list)
    servers: list[RackedServerIn] = Field(default_factory=list)
    deployments: list[DeploymentIn] = Field(default_factory=list)


# libyaml when present (about 2× faster on large files), the pure-Python parser otherwise.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _reject_aliases(data: Any) -> None:
    """Anchors and aliases share one object among many places; refuse them, because expanding
    a few nested aliases can blow a tiny file up to gigabytes (a "billion laughs" file)."""
    seen: set[int] = set()
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict | list):
            if id(node) in seen:
                raise ValidationFailed(
                    ["YAML anchors and aliases (&name / *name) are not supported: write it out"]
                )
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)


def _problem(exc: yaml.MarkedYAMLError) -> str:
    # Aliases and tags are the problems YAML reports with the text of a value in them, and an
    # unquoted password may start with '*' or '!': name the rule, not the value.
    problem = str(exc.problem or "")
    if "alias" in problem:
        return "undefined alias (quote a value that starts with '*')"
    if "tag" in problem:
        return "unknown tag (quote a value that starts with '!')"
    return problem


def parse_inventory(text: str | bytes) -> InventoryFile:
    """YAML text -> InventoryFile, or ValidationFailed listing every problem with its place."""
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown place"
        raise ValidationFailed([f"not valid YAML at {where}: {_problem(exc)}"]) from None
    except yaml.YAMLError as exc:
        raise ValidationFailed([f"not valid YAML: {exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValidationFailed(
            ["(top level): must be a mapping with sites, servers, deployments or gpu_models"]
        )
    _reject_aliases(data)
    try:
        return InventoryFile.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed(validation_messages(exc)) from None
