"""The inventory file format, and parsing that names the place of every error.

Errors never echo the offending value: a bad row may be a BMC password.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from fleet.errors import ValidationFailed
from fleet.models import (
    INT32_MAX,
    MAX_ARTIFACTS,
    MAX_REPLICAS,
    MAX_SLA_MS,
    MAX_WATTS,
    MODEL_NAME_PATTERN,
    NAME_PATTERN,
    ArtifactFormat,
    BmcProtocol,
    BudgetMode,
    EngineParams,
    FeedSide,
    GpuModelNames,
    Int,
    Number,
    OptInt,
    OptNumber,
    Phase,
    Pool,
    RackStatus,
    TrtllmParams,
)
from fleet.validation import SSH_FINGERPRINT_PATTERN, error_messages
from fleet_core.engines import EngineName


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError("must be 1-65535")
    return value


Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
# The schema states the range that `_port` checks (with its own message).
Port = Annotated[
    Int, AfterValidator(_port), WithJsonSchema({"type": "integer", "minimum": 1, "maximum": 65535})
]
# A GPU model's throughput figures: finite, and far beyond any GPU (B200: 4.5 PFLOPS FP8).
MAX_FIGURE = 1_000_000.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class GpuModelIn(_Strict):
    name: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    memory_mib: Int = Field(gt=0, le=INT32_MAX)
    tdp_w: Number = Field(gt=0, le=MAX_WATTS)
    idle_w: Number = Field(ge=0, le=MAX_WATTS)
    hbm_tb_s: Number = Field(default=0, ge=0, le=MAX_FIGURE)
    bf16_tflops: Number = Field(default=0, ge=0, le=MAX_FIGURE)
    fp8_tflops: Number = Field(default=0, ge=0, le=MAX_FIGURE)


class BmcIn(_Strict):
    protocol: BmcProtocol
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    port: Port
    username: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    # Optional on re-import: an omitted password keeps the stored one (export never writes it).
    password: SecretStr | None = None
    system_id: Annotated[str, StringConstraints(max_length=255)] | None = None
    # Redfish over http:// (the password in clear): only for a BMC without TLS, such as the
    # lab's emulators; without it an http address is refused (fleet/bmc/redfish.py).
    plain_http: StrictBool = False


class SshIn(_Strict):
    """Where the server's OS answers SSH (not its BMC) and its pinned host key: the SHA-256
    fingerprint OpenSSH prints (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`). Left out,
    the key pinned in the fleet (by an earlier file or `fleetctl servers ssh-trust`) is kept."""

    address: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    port: Port = 22
    host_key: Annotated[str, StringConstraints(pattern=SSH_FINGERPRINT_PATTERN)] | None = None


class GpuIn(_Strict):
    model: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    count: Int = Field(ge=0, le=64)
    # OptInt, not `Int | None`: on that union pydantic writes the bounds as `gt`/`le`, which
    # no JSON Schema reader knows.
    memory_mib: OptInt = Field(default=None, gt=0, le=INT32_MAX)


class PowerIn(_Strict):
    idle_w: Number = Field(ge=0, le=MAX_WATTS)
    standby_w: Number = Field(ge=0, le=MAX_WATTS)
    max_w: Number = Field(gt=0, le=MAX_WATTS)


class ServerIn(_Strict):
    name: Name
    serial: Annotated[str, StringConstraints(max_length=100)] | None = None
    u: Int = Field(ge=1, le=60)
    u_height: Int = Field(default=1, ge=1, le=16)
    bmc: BmcIn
    gpu: GpuIn
    power: PowerIn
    pool: Pool = Pool.WARM
    # Left out: the fleet's SSH address, port and pinned key stay as they are.
    ssh: SshIn | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_models_cached(cls, data: Any) -> Any:
        # The static list of cached models is gone: agents report their cache (docs/weights.md).
        if isinstance(data, dict) and "models_cached" in data:
            raise ValueError(
                "models_cached is no longer part of the inventory: each server's agent "
                "reports the model versions in its weights cache (docs/weights.md); remove it"
            )
        return data


class RackedServerIn(ServerIn):
    """A server listed at the top level, placed into a rack by name (in the file or the fleet)."""

    rack: Name


class FeedIn(_Strict):
    name: Name
    side: FeedSide
    volts: Number = Field(gt=0, le=1000)
    amps: Number = Field(gt=0, le=1000)
    phase: Phase = Phase.SINGLE
    max_utilisation_pct: Number = Field(default=80.0, gt=0, le=100)


Description = Annotated[str, StringConstraints(max_length=500)]


class RackIn(_Strict):
    name: Name
    u_height: Int = Field(default=42, ge=1, le=60)
    status: RackStatus = RackStatus.ACTIVE
    description: Description = ""
    # How its servers commit power (docs/power.md). Left out: the fleet's value is kept (a new
    # rack: nameplate, margin 1.15), so re-importing an older file does not undo a
    # `PATCH /racks/{name}`.
    budget_mode: BudgetMode | None = None
    budget_margin: OptNumber = Field(default=None, ge=1.0, le=2.0)
    feeds: list[FeedIn] = Field(default_factory=list)
    servers: list[ServerIn] = Field(default_factory=list)


class SiteIn(_Strict):
    name: Name
    description: Description = ""
    racks: list[RackIn] = Field(default_factory=list)


class ModelRefIn(_Strict):
    """Weights named by a URI and a checksum, delivered outside Fleet (as before model
    versions): the import makes (or reuses) an `external` version for them."""

    uri: Annotated[str, StringConstraints(min_length=1, max_length=1000)]
    checksum: Annotated[str, StringConstraints(min_length=1, max_length=200)]


ModelName = Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN, max_length=63)]


class ArtifactIn(_Strict):
    """One file of a model version (fleet/catalog/versions.py checks the URI's scheme, the name
    as a relative path, and sha256 and size, required unless the format is external)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    uri: Annotated[str, StringConstraints(min_length=1, max_length=1000)]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    size_bytes: OptInt = Field(default=None, ge=0, le=2**53 - 1)  # as the API (models.py)
    format: ArtifactFormat = ArtifactFormat.HF_SAFETENSORS
    gpu_model: Annotated[str, StringConstraints(min_length=1, max_length=32)] | None = None
    tp_size: OptInt = Field(default=None, ge=1, le=64)


class ModelVersionIn(_Strict):
    """A model version (immutable: re-importing it with other files is refused)."""

    model: ModelName
    version: ModelName
    description: Description = ""
    artifacts: list[ArtifactIn] = Field(min_length=1, max_length=MAX_ARTIFACTS)


class ReplicasIn(_Strict):
    min: Int = Field(default=0, ge=0, le=MAX_REPLICAS)
    max: Int = Field(default=1, ge=0, le=MAX_REPLICAS)


class SlaIn(_Strict):
    p95_latency_ms: Number = Field(ge=1, le=MAX_SLA_MS)
    ttft_ms: Number = Field(ge=1, le=MAX_SLA_MS)


class DeploymentIn(_Strict):
    name: Name
    # The version it serves ("<model>@<version>", under `models:` or in the fleet), or, as
    # before versions, `model: {uri, checksum}`: one of the two.
    model_version: Annotated[str, StringConstraints(min_length=3, max_length=127)] | None = None
    model: ModelRefIn | None = None
    # The engine (fleet_core/engines: trtllm, vllm, sglang) and its options, named after its
    # flags, checked as the agent checks them. A mapping under `engine` (files from before
    # engines) is trtllm-serve's options.
    engine: EngineName | TrtllmParams = "trtllm"
    engine_params: EngineParams | None = None
    gpus_per_replica: Int = Field(default=1, ge=1, le=64)
    gpu_models: GpuModelNames = Field(default_factory=list)
    replicas: ReplicasIn = Field(default_factory=ReplicasIn)
    sla: SlaIn
    disruption_budget: Int = Field(default=1, ge=1, le=MAX_REPLICAS)
    # Warm spares per allowed GPU model kept holding its version (pre-staged).
    cached_spares: Int = Field(default=0, ge=0, le=MAX_REPLICAS)


class InventoryFile(_Strict):
    gpu_models: list[GpuModelIn] = Field(default_factory=list)
    models: list[ModelVersionIn] = Field(default_factory=list)
    sites: list[SiteIn] = Field(default_factory=list)
    servers: list[RackedServerIn] = Field(default_factory=list)
    deployments: list[DeploymentIn] = Field(default_factory=list)


# libyaml when present (about 2× faster on large files), the pure-Python parser otherwise.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# Bounds on the work one file may cause, checked on YAML's event stream before anything is
# built from it (building costs ~15 µs a node). Unbounded, 800,000 bad servers in 22 MB took
# over two minutes of CPU and 6 GB to refuse, with a 200 MB answer; the scan now stops at the
# first entry past the bound, in half a second. bench/gen_inventory.py's 10,000 servers are
# 17,000 entries in 480,000 nodes (every key, value, list and mapping); the demo's 56 are 70
# entries in 3,200. A bigger fleet imports in parts (top-level `servers:` join racks already
# in the fleet).
MAX_ENTRIES = 25_000
MAX_NODES = 750_000
MAX_ERRORS = 100  # listed in a refusal; the rest are counted
ENTRY_LISTS = frozenset(
    {"gpu_models", "models", "artifacts", "sites", "racks", "feeds", "servers", "deployments"}
)
# Control characters (and lone surrogates, which no database stores) are refused in every
# string: they would reach terminals and logs. Descriptions alone may span lines.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
CONTROL_OR_BREAK = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
MULTILINE_KEYS = frozenset({"description"})
TOP_LEVEL = "(top level): must be a mapping with sites, servers, deployments, models or gpu_models"


def bounded(errors: list[str]) -> list[str]:
    """The first MAX_ERRORS problems, and how many more there are."""
    if len(errors) <= MAX_ERRORS:
        return errors
    return [*errors[:MAX_ERRORS], f"… and {len(errors) - MAX_ERRORS} more problems"]


class _Frame:
    """A mapping or list being scanned: its place, its children so far, the last key seen."""

    __slots__ = ("children", "entries", "is_map", "key", "place")

    def __init__(self, place: str, is_map: bool, entries: bool) -> None:
        self.place, self.is_map, self.entries = place, is_map, entries
        self.children = 0
        self.key: str | None = None


def _scan(text: str | bytes) -> None:
    """Walk the YAML events (no objects built): refuse anchors and aliases, control characters
    and files past MAX_ENTRIES or MAX_NODES, naming the place of each problem."""
    errors: list[str] = []
    anchors: set[str] = set()
    stack: list[_Frame] = []
    nodes = entries = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            stack.pop()
            continue
        if not isinstance(event, yaml.NodeEvent):
            continue
        nodes += 1
        if nodes > MAX_NODES:
            raise ValidationFailed(
                [
                    f"more than {MAX_NODES} YAML nodes (keys, values, lists, mappings): "
                    "split the file and import each part"
                ]
            )
        parent = stack[-1] if stack else None
        is_key = parent is not None and parent.is_map and parent.children % 2 == 0
        if parent is None:
            place, key = "", None
        elif parent.is_map:
            place, key = parent.place, parent.key
            if not is_key:
                place = f"{place}.{key}" if place else str(key)
        else:
            place, key = f"{parent.place}[{parent.children}]", None
            if parent.entries:
                entries += 1
                if entries > MAX_ENTRIES:
                    raise ValidationFailed(
                        [
                            f"{place}: more than {MAX_ENTRIES} entries (GPU models, models, "
                            "artifacts, sites, racks, feeds, servers, deployments): split the "
                            "file and import each part"
                        ]
                    )
        if parent is not None:
            parent.children += 1
        where = place or "(top level)"
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in anchors:
                errors.append(f"{where}: undefined alias (quote a value that starts with '*')")
            else:
                errors.append(
                    f"{where}: YAML anchors and aliases (&name / *name) are not supported: "
                    "write it out"
                )
            continue
        if event.anchor is not None:
            anchors.add(event.anchor)
        if isinstance(event, yaml.ScalarEvent):
            value = event.value
            if is_key:
                assert parent is not None
                parent.key = value
                if CONTROL_OR_BREAK.search(value):
                    errors.append(f"{where}: a key holds control characters")
            else:
                pattern = CONTROL if key in MULTILINE_KEYS else CONTROL_OR_BREAK
                if pattern.search(value):
                    errors.append(f"{where}: control characters are not allowed")
        else:
            is_map = isinstance(event, yaml.MappingStartEvent)
            if is_key:
                assert parent is not None
                parent.key = "(key)"
            stack.append(_Frame(place, is_map, not is_map and key in ENTRY_LISTS))
        if len(errors) == MAX_ERRORS:
            # Enough to act on; counting the rest is not worth the work.
            raise ValidationFailed(
                [*errors, "… and maybe more problems past these"], total=len(errors), at_least=True
            )
    if errors:
        raise ValidationFailed(errors)


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
    """YAML text -> InventoryFile, or ValidationFailed listing its problems (up to MAX_ERRORS)
    with their places. The work is bounded before any object is built (`_scan`)."""
    try:
        _scan(text)
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown place"
        raise ValidationFailed([f"not valid YAML at {where}: {_problem(exc)}"]) from None
    except yaml.YAMLError as exc:
        raise ValidationFailed([f"not valid YAML: {exc}"]) from None
    if data is None:
        # An empty file, or one of comments only, is the empty inventory; a document that
        # says null (`null`, `~`) is not a mapping.
        node = yaml.compose(text, Loader=_Loader)
        if node is not None and node.value:
            raise ValidationFailed([TOP_LEVEL])
        data = {}
    if not isinstance(data, dict):
        raise ValidationFailed([TOP_LEVEL])
    try:
        return InventoryFile.model_validate(data)
    except ValidationError as exc:
        # Only the listed problems are formatted; the others are counted.
        first = exc.errors(include_url=False, include_input=False)[:MAX_ERRORS]
        more = exc.error_count() - len(first)
        tail = [f"… and {more} more problems"] if more else []
        raise ValidationFailed([*error_messages(first), *tail], total=exc.error_count()) from None
