"""What every inference engine the agent supervises must say about itself (pure).

One `EngineSpec` per engine (trtllm.py, vllm.py, sglang.py): how a deployment's `engine_params`
are checked (the engine's own option names, so that a flag the engine lacks is refused, named,
when the deployment is written), the GPUs one replica takes (tensor × pipeline parallel), the
command line of one replica, the HTTP routes the supervisor probes, how the engine states its
version and which versions the agent drives, and the request field that carries the router's
priority class. The fleet (deployment validation), the agent (its supervisor) and the router
(priority) all read the same spec; the agent's metrics parsers live beside the supervisor
(fleet_agent/engine/), since they need prometheus_client.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

Priority = Literal["interactive", "batch"]


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One replica to start."""

    command: tuple[str, ...]  # the engine's program, from the agent's settings (default_command)
    model_path: str  # the checkpoint directory (the weights cache's path, or model_root's)
    served_names: tuple[str, ...]  # the names clients send as "model" (the router forwards them)
    params: Mapping[str, Any]  # the deployment's engine_params (already checked)
    host: str
    port: int
    config_dir: str  # where the engine's own config files go (Launch.files)


@dataclass(frozen=True)
class Launch:
    """The argv of one replica and the files to write before it starts."""

    argv: list[str]
    files: dict[str, str] = field(default_factory=dict)  # name in config_dir -> text


class EngineSpec(ABC):
    """An inference engine as Fleet drives it."""

    name: ClassVar[str]  # what a deployment's `engine` says: "trtllm", "vllm", "sglang"
    program: ClassVar[str]  # its server's name, for messages: "trtllm-serve", "vllm serve"
    default_command: ClassVar[tuple[str, ...]]  # how the agent runs it unless configured
    health_path: ClassVar[str] = "/health"
    # The versions whose documented command line and metrics this agent speaks (PEP 440): the
    # `gpu-<engine>` extra in pyproject.toml pins the same range.
    supported_versions: ClassVar[str]
    # The engine_params keys of one replica's tensor and pipeline parallel sizes, and of the
    # most requests one replica runs at once.
    parallel_keys: ClassVar[tuple[str, str]]
    batch_key: ClassVar[str]

    @abstractmethod
    def check_params(self, params: Mapping[str, Any]) -> None:
        """ValueError naming each option the engine does not have, or the first bad value."""

    def parallelism(self, params: Mapping[str, Any]) -> tuple[int, int]:
        """(tensor parallel, pipeline parallel) sizes of one replica: it takes their product
        of GPUs. Absent options count 1; call on checked params."""
        tp, pp = self.parallel_keys
        return positive_int(params, tp), positive_int(params, pp)

    def max_batch_size(self, params: Mapping[str, Any]) -> int | None:
        """The most requests one replica runs at once, when the params set it."""
        value = params.get(self.batch_key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @abstractmethod
    def launch(self, spec: LaunchSpec) -> Launch:
        """The replica's argv (and config files)."""

    @abstractmethod
    def version_argv(self, command: Sequence[str]) -> list[str]:
        """A command that prints the installed engine's version (exit status 0)."""

    def parse_version(self, output: str) -> str:
        """The version in `version_argv`'s output (its last version-looking word)."""
        found = _VERSION_WORD.findall(output)
        if not found:
            raise ValueError(f"{self.program}: no version in its output {output.strip()[:80]!r}")
        return str(found[-1])

    def check_version(self, output: str) -> str:
        """The version `version_argv` printed, if this agent drives it; else a one-line
        ValueError naming what is installed and what is supported."""
        text = self.parse_version(output)
        try:
            version = Version(text)
            supported = SpecifierSet(self.supported_versions)
        except (InvalidVersion, InvalidSpecifier) as exc:
            raise ValueError(f"{self.program}: cannot read version {text!r}: {exc}") from None
        if not supported.contains(version, prereleases=True):
            raise ValueError(
                f"{self.program} {text} is installed; this agent drives {self.name} "
                f"{self.supported_versions} (pip install 'fleet[gpu-{self.name}]')"
            )
        return text

    def priority_fields(
        self, priority: Priority, params: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Fields to add to a generation request so that the engine schedules it by the
        router's class ({}: the engine has no such field, or the deployment's `params`, when
        given, turned its priority scheduling off)."""
        return {}

    @abstractmethod
    def params_schema(self) -> dict[str, Any]:
        """The JSON schema of this engine's engine_params (the API documents it)."""


def metadata_version_argv(interpreter: Sequence[str], distribution: str) -> list[str]:
    """A command that prints `distribution`'s installed version through `interpreter`'s
    importlib.metadata: it imports nothing of the engine (no CUDA), for engines whose server
    has no --version of its own."""
    script = f"import importlib.metadata as m; print({distribution!r}, m.version({distribution!r}))"
    return [*interpreter, "-c", script]


_VERSION_WORD = re.compile(r"\b\d+\.\d+(?:\.\d+)?(?:[.+-]?[A-Za-z0-9.+-]*)?")


# ---------------------------------------------------------------------------------------------
# Checks the specs share


def check_known(engine: EngineSpec, params: Mapping[str, Any], known: frozenset[str]) -> None:
    """ValueError naming every option `engine` does not have."""
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"engine_params {', '.join(unknown)}: {engine.program} has no such option"
            f"{'s' if len(unknown) > 1 else ''} (engine {engine.name}; its options are "
            f"{', '.join(sorted(known))})"
        )


def check_parallel_keys(engine: EngineSpec, params: Mapping[str, Any]) -> None:
    """The parallel sizes are absent (1) or integers, never null: the GPUs a replica takes are
    their product (the schemas say so too)."""
    for key in engine.parallel_keys:
        if key in params and params[key] is None:
            raise ValueError(f"engine_params.{key} must be an integer, not null (absent: 1)")


def check_int(params: Mapping[str, Any], key: str, *, minimum: int = 1) -> None:
    value = params.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"engine_params.{key} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"engine_params.{key} must be at least {minimum}, not {value}")


def check_fraction(params: Mapping[str, Any], key: str) -> None:
    value = params.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"engine_params.{key} must be a number, not {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"engine_params.{key} must be in (0, 1], not {value}")


def check_bool(params: Mapping[str, Any], key: str) -> None:
    if key in params and not isinstance(params[key], bool):
        raise ValueError(f"engine_params.{key} must be true or false, not {params[key]!r}")


def check_choice(params: Mapping[str, Any], key: str, choices: Sequence[str]) -> None:
    value = params.get(key)
    if value is not None and (not isinstance(value, str) or value not in choices):
        raise ValueError(f"engine_params.{key} {value!r}: expected one of {sorted(choices)}")


def positive_int(params: Mapping[str, Any], key: str) -> int:
    """An integer option that defaults to 1 (parallel sizes)."""
    value = params.get(key, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1
