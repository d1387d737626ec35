"""Per-replica load and latency figures, from what the supervisor scrapes off each engine.

The supervisor reads each engine's metrics paths (scrape.metrics_paths) and hands the parsed
EngineSample here (scrape.parse: the same neutral figures for trtllm, vllm and sglang). Running,
queued, KV used and the cache hit rate come from the sample as the engine reports them (for
trtllm, from its newest iteration entry, else its Prometheus gauges, else 0: see
scrape/trtllm.py); a figure the sample lacks keeps its previous value. TTFT and end-to-end
latency p50/p95 and inter-token latency p95 come from the histograms over the last
stats_window_s (histogram_quantile() as Prometheus computes it, on the bucket deltas); tokens/s
from the generation-token counter's delta, else from trtllm's iteration stats (generation
requests per iteration); the cache hit rate from the prefix hits ÷ lookups counters' deltas
where the engine counts them. Preemptions are the engine's cumulative count (vLLM
num_preemptions, SGLang num_retracted_requests), or for trtllm, which has no counter, its
iteration entries' paused requests summed across polls. Caveat (openai_server.py on main): with
return_perf_metrics the newest TensorRT-LLM also drains the iteration queue itself to feed
Prometheus, so /metrics may then come back empty and the gauges carry the load figures.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from fleet_agent.engine.engine_metrics import (
    PromSnapshot,
    bucket_delta,
    histogram_quantile,
    is_reset,
)
from fleet_agent.engine.scrape import EngineSample
from fleet_agent.engine.scrape.trtllm import PAUSED_IN_POLL, generation_requests

# What the windows keep of each scrape (a full scrape is ~60 families per replica).
_WINDOW_COUNTERS = ("generation_tokens", "prefix_queries", "prefix_hits")
_QUANTILES = (
    ("ttft", ((0.5, "ttft_p50_s"), (0.95, "ttft_p95_s"))),
    ("e2e", ((0.5, "e2e_p50_s"), (0.95, "e2e_p95_s"))),
    ("itl", ((0.95, "itl_p95_s"),)),
)


@dataclasses.dataclass
class ReplicaStats:
    """One replica's figures as of the latest poll, and the history their windows need."""

    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # since last poll
    queued: int | None = None
    running: int | None = None
    kv_used_fraction: float | None = None
    cache_hit_rate: float | None = None
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p95_s: float | None = None
    itl_p95_s: float | None = None  # where the engine has the inter-token histogram
    preemptions: int | None = None  # the engine's cumulative count; None: not exposed
    # (time, scrape) history for the windowed deltas; (time, generated tokens) per poll.
    scrapes: deque[tuple[float, PromSnapshot]] = dataclasses.field(default_factory=deque)
    iter_tokens: deque[tuple[float, float]] = dataclasses.field(default_factory=deque)


def update_stats(s: ReplicaStats, at: float, sample: EngineSample | None, window_s: float) -> None:
    """Fold one poll into `s`: `sample` parsed from what the engine answered at `at` (None:
    nothing read, or a layout no parser knows: the load figures become unknown, the windows
    keep their history); windows of `window_s`."""
    if sample is None:
        s.entries = []
        s.running = s.queued = None
        s.tokens_per_s = None
        return
    s.entries = sample.entries
    s.running, s.queued = sample.running, sample.waiting
    if sample.kv_used_fraction is not None:
        s.kv_used_fraction = sample.kv_used_fraction
    _count_preemptions(s, sample)

    # trtllm's iteration stats: each generation request decodes one token per iteration. Its
    # parser marks every sample with the poll's paused requests, even with no entries (idle).
    iteration_stats = PAUSED_IN_POLL in sample.counters
    if iteration_stats:
        s.iter_tokens.append((at, generation_requests(sample.entries)))
        _trim(s.iter_tokens, at, window_s)
    iter_rate = None
    if iteration_stats and len(s.iter_tokens) >= 2 and at > s.iter_tokens[0][0]:
        generated = sum(n for _, n in list(s.iter_tokens)[1:])
        iter_rate = generated / (at - s.iter_tokens[0][0])

    kept = PromSnapshot(
        {},
        {k: v for k, v in sample.counters.items() if k in _WINDOW_COUNTERS},
        {k: v for k, v in sample.histograms.items() if k in dict(_QUANTILES)},
    )
    if not kept.counters and not kept.histograms:
        # trtllm's iteration stats alone (its Prometheus text not read this poll): the
        # latency windows keep their figures and their history.
        s.tokens_per_s = iter_rate
        if sample.prefix_hit_rate is not None:
            s.cache_hit_rate = sample.prefix_hit_rate
        return
    if s.scrapes and is_reset(kept, s.scrapes[-1][1]):
        s.scrapes.clear()  # the engine restarted: its counters started over
    s.scrapes.append((at, kept))
    _trim(s.scrapes, at, window_s)
    base_at, base = s.scrapes[0] if len(s.scrapes) >= 2 else (at, None)

    counter_rate = None
    tokens_before = base.counters.get("generation_tokens") if base is not None else None
    if tokens_before is not None and "generation_tokens" in kept.counters and at > base_at:
        counter_rate = (kept.counters["generation_tokens"] - tokens_before) / (at - base_at)
    # The engine's token counter over the window; until it has two scrapes (or without it),
    # trtllm's iteration stats, which other engines do not have.
    s.tokens_per_s = counter_rate if counter_rate is not None else iter_rate

    s.cache_hit_rate = _window_hit_rate(kept, base, sample, s.cache_hit_rate)
    for family, quantiles in _QUANTILES:
        buckets = kept.histograms.get(family)
        window = None
        if buckets is not None:
            window = bucket_delta(buckets, base.histograms.get(family) if base else None)
        for q, field in quantiles:
            setattr(s, field, histogram_quantile(q, window) if window else None)


def _count_preemptions(s: ReplicaStats, sample: EngineSample) -> None:
    if "preemptions" in sample.counters:
        s.preemptions = int(sample.counters["preemptions"])
    elif PAUSED_IN_POLL in sample.counters:  # trtllm has no counter: sum its polls' pauses
        s.preemptions = (s.preemptions or 0) + int(sample.counters[PAUSED_IN_POLL])


def _window_hit_rate(
    now: PromSnapshot, base: PromSnapshot | None, sample: EngineSample, previous: float | None
) -> float | None:
    """Prefix hits ÷ lookups over the window where the engine counts both, else the engine's
    own rate, else the previous figure."""
    if base is not None and {"prefix_queries", "prefix_hits"} <= set(now.counters):
        queries = now.counters["prefix_queries"] - base.counters.get("prefix_queries", 0.0)
        hits = now.counters["prefix_hits"] - base.counters.get("prefix_hits", 0.0)
        if queries > 0:
            return hits / queries
    return sample.prefix_hit_rate if sample.prefix_hit_rate is not None else previous


def _trim(history: deque[Any], now: float, window_s: float) -> None:
    """Keep one entry at or before the window's start (the baseline) and all after it."""
    while len(history) >= 2 and history[1][0] <= now - window_s:
        history.popleft()
