"""The inference engines Fleet drives, by the name a deployment's `engine` gives (pure).

`spec(name)` is the EngineSpec (base.py) of "trtllm" (TensorRT-LLM's trtllm-serve), "vllm"
(vLLM's `vllm serve`) or "sglang" (SGLang's launch_server); layout.py places replicas on a
host's GPUs and ports, whatever the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from fleet_core.engines.base import EngineSpec, Launch, LaunchSpec, Priority
from fleet_core.engines.sglang import SGLANG
from fleet_core.engines.trtllm import TRTLLM
from fleet_core.engines.vllm import VLLM

EngineName = Literal["trtllm", "vllm", "sglang"]
ENGINES: dict[str, EngineSpec] = {e.name: e for e in (TRTLLM, VLLM, SGLANG)}
DEFAULT_ENGINE: EngineName = "trtllm"

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "EngineName",
    "EngineSpec",
    "Launch",
    "LaunchSpec",
    "Priority",
    "check_engine_params",
    "spec",
]


def spec(name: str) -> EngineSpec:
    """The engine called `name`; ValueError naming the ones there are."""
    engine = ENGINES.get(name) if isinstance(name, str) else None
    if engine is None:
        raise ValueError(f"engine {name!r}: expected one of {', '.join(ENGINES)}")
    return engine


def check_engine_params(engine: str, params: Mapping[str, Any]) -> None:
    """ValueError naming the engine and each option it lacks, or the first bad value."""
    spec(engine).check_params(params)
