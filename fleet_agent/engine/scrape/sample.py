"""One engine scrape in engine-neutral terms (pure): EngineSample, the error for a layout no
parser knows, and the table-driven reading of a Prometheus text shared by the per-engine parsers.

Each neutral figure names the engine's families newest release first; the first family the text
carries wins, so a release that exposes an old name beside its new one (vLLM 0.10 keeps
`vllm:gpu_cache_usage_perc` next to `vllm:kv_cache_usage_perc`) is read once, not twice. Label
sets (model_name, vLLM's engine index under data parallelism, SGLang's ranks) are summed for
request counts, counters and histogram buckets, and the largest is taken for fractions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fleet_agent.engine.engine_metrics import PromSnapshot, parse_prometheus

# The neutral names EngineSample.counters and .histograms use.
COUNTERS = ("generation_tokens", "prompt_tokens", "preemptions", "prefix_queries", "prefix_hits")
HISTOGRAMS = ("ttft", "e2e", "itl")


class UnsupportedEngineVersion(ValueError):
    """The engine's metrics carry none of the families its parser reads (another release's
    layout, another engine, an empty text): said plainly rather than read as zeros."""

    def __init__(self, engine: str, families: tuple[str, ...]) -> None:
        super().__init__(
            f"unsupported engine version: {engine} /metrics has none of {', '.join(families)}"
        )
        self.engine = engine
        self.families = families


@dataclasses.dataclass(frozen=True)
class EngineSample:
    """One scrape, engine-neutral. Counters are the engine's cumulative values; histograms are
    cumulative buckets {le: count}; None or a missing key: the engine does not expose it."""

    running: int | None
    waiting: int | None
    kv_used_fraction: float | None
    prefix_hit_rate: float | None
    # generation_tokens, prompt_tokens, preemptions, prefix_queries, prefix_hits; trtllm adds
    # paused_requests: its pauses in this poll's iterations (a delta, see scrape/trtllm.py)
    counters: dict[str, float]
    histograms: dict[str, dict[float, float]]  # ttft, e2e, itl
    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # trtllm's /metrics


@dataclasses.dataclass(frozen=True)
class FamilyTable:
    """Where one engine keeps each neutral figure: family names, newest release first.

    `prefix` pairs (queries, hits) counters of one release, so a hit rate never divides one
    release's hits by another's queries. `hit_rate` gauges below 0 mean "no lookups yet"
    (vLLM 0.x writes -1)."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_used: tuple[str, ...] = ()
    hit_rate: tuple[str, ...] = ()
    counters: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    prefix: tuple[tuple[str, str], ...] = ()
    histograms: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def families(self) -> tuple[str, ...]:
        """Every family this table looks for, for the unsupported-version message."""
        names = [*self.running, *self.waiting, *self.kv_used, *self.hit_rate]
        for group in self.counters.values():
            names.extend(group)
        for queries, hits in self.prefix:
            names.extend((queries, hits))
        for group in self.histograms.values():
            names.extend(group)
        return tuple(dict.fromkeys(names))


def read_prometheus(engine: str, body: str | None, table: FamilyTable) -> EngineSample:
    """One Prometheus body read through `table`; a body that is not the text format (JSON from
    another engine, an HTML error page) or carries none of the table's families is refused."""
    snap = None
    if body:
        try:
            snap = parse_prometheus(body)
        except ValueError:  # prometheus_client's parser: not the text exposition format
            snap = None
    if snap is None or not has_any(snap, table):
        raise UnsupportedEngineVersion(engine, table.families())
    return read_table(snap, table)


def has_any(snap: PromSnapshot, table: FamilyTable) -> bool:
    """Does the scrape carry at least one family of the table?"""
    return any(_present(snap, name) for name in table.families())


def read_table(snap: PromSnapshot, table: FamilyTable) -> EngineSample:
    """The neutral figures of one parsed scrape; what the engine lacks stays None or absent."""
    running = _gauge_sum(snap, table.running)
    waiting = _gauge_sum(snap, table.waiting)
    kv = _gauge_max(snap, table.kv_used)
    counters: dict[str, float] = {}
    for neutral, names in table.counters.items():
        value = _counter(snap, names)
        if value is not None:
            counters[neutral] = value
    for queries, hits in table.prefix:
        q, h = _counter(snap, (queries,)), _counter(snap, (hits,))
        if q is not None and h is not None:
            counters["prefix_queries"], counters["prefix_hits"] = q, h
            break
    histograms: dict[str, dict[float, float]] = {}
    for neutral, names in table.histograms.items():
        family = next((n for n in names if n in snap.histograms), None)
        if family is not None:
            histograms[neutral] = dict(snap.histograms[family])
    rate = _gauge_max(snap, table.hit_rate)
    if rate is not None and rate < 0:
        rate = None
    if rate is None and counters.get("prefix_queries"):
        rate = counters["prefix_hits"] / counters["prefix_queries"]  # lifetime, until a window
    return EngineSample(
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_used_fraction=kv,
        prefix_hit_rate=rate,
        counters=counters,
        histograms=histograms,
    )


def _present(snap: PromSnapshot, name: str) -> bool:
    return (
        name in snap.gauges
        or name in snap.histograms
        or name in snap.counters
        or _total(name) in snap.counters
    )


def _total(name: str) -> str:
    return name if name.endswith("_total") else name + "_total"


def _gauge_values(snap: PromSnapshot, names: tuple[str, ...]) -> list[float] | None:
    for name in names:
        if name in snap.gauges:
            return snap.gauges[name]
    return None


def _gauge_sum(snap: PromSnapshot, names: tuple[str, ...]) -> float | None:
    values = _gauge_values(snap, names)
    return None if values is None else sum(values)


def _gauge_max(snap: PromSnapshot, names: tuple[str, ...]) -> float | None:
    values = _gauge_values(snap, names)
    return max(values) if values else None


def _counter(snap: PromSnapshot, names: tuple[str, ...]) -> float | None:
    """A counter by its sample name (…_total); an untyped exposition lands among the gauges."""
    for name in names:
        if _total(name) in snap.counters:
            return snap.counters[_total(name)]
        if _total(name) in snap.gauges:
            return sum(snap.gauges[_total(name)])
    return None
