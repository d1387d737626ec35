"""Each engine's metrics, read into the same EngineSample (pure): which paths the supervisor
scrapes per engine (metrics_paths) and the parser for what came back (parse). A layout with none
of the families a parser reads raises UnsupportedEngineVersion, never zeros.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from fleet_agent.engine.scrape import sglang, trtllm, vllm
from fleet_agent.engine.scrape.sample import EngineSample, UnsupportedEngineVersion

__all__ = ["EngineSample", "UnsupportedEngineVersion", "metrics_paths", "parse"]

_PARSERS: dict[str, tuple[tuple[str, ...], Callable[[Mapping[str, str]], EngineSample]]] = {
    "trtllm": (trtllm.PATHS, trtllm.parse),
    "vllm": (vllm.PATHS, vllm.parse),
    "sglang": (sglang.PATHS, sglang.parse),
}


def metrics_paths(engine: str) -> tuple[str, ...]:
    """The HTTP paths whose bodies parse(engine, …) reads."""
    return _parser(engine)[0]


def parse(engine: str, texts: Mapping[str, str]) -> EngineSample:
    """`texts`: path -> body for the paths that answered; raises UnsupportedEngineVersion.
    Fractions are clamped to [0, 1]: an engine's rounding (or bug) must not make the whole
    heartbeat invalid."""
    sample = _parser(engine)[1](texts)
    return dataclasses.replace(
        sample,
        kv_used_fraction=_fraction(sample.kv_used_fraction),
        prefix_hit_rate=_fraction(sample.prefix_hit_rate),
    )


def _fraction(value: float | None) -> float | None:
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return min(value, 1.0)


def _parser(
    engine: str,
) -> tuple[tuple[str, ...], Callable[[Mapping[str, str]], EngineSample]]:
    try:
        return _PARSERS[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(_PARSERS)}") from None
