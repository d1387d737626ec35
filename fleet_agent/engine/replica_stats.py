"""Per-replica load and latency figures, from what the supervisor scrapes off each engine.

The supervisor is the ONLY reader of each engine's /metrics, which hands out the iteration
stats queued since the previous read and forgets them (docs/source/commands/trtllm-serve/
trtllm-serve.rst). The entries of the latest poll are kept raw (EngineSupervisor.iteration_stats())
and the newest one gives queued, running, KV used ÷ max blocks and the cache hit rate. An idle
engine runs no iterations: with no new entries the Prometheus gauges
(trtllm_num_requests_running / _waiting, trtllm_kv_cache_utilization) stand in, else
running = queued = 0. TTFT and end-to-end latency p50/p95 come from the Prometheus histograms
over the last stats_window_s (histogram_quantile() as Prometheus computes it, on the bucket
deltas); tokens/s from the trtllm_generation_tokens_total delta, else from the iteration stats
(generation requests per iteration). Caveat (openai_server.py on main): with
return_perf_metrics the newest TensorRT-LLM also drains the iteration queue itself to feed
Prometheus, so /metrics may then come back empty and the gauges carry the load figures.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from fleet_agent.engine.engine_metrics import (
    E2E,
    GENERATION_TOKENS,
    KV_HIT_RATE,
    KV_UTILIZATION,
    RUNNING,
    TTFT,
    WAITING,
    PromSnapshot,
    bucket_delta,
    histogram_quantile,
    is_reset,
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
    # (time, scrape) history for the windowed deltas; (time, generated tokens) per poll.
    scrapes: deque[tuple[float, PromSnapshot]] = dataclasses.field(default_factory=deque)
    iter_tokens: deque[tuple[float, float]] = dataclasses.field(default_factory=deque)


def update_stats(
    s: ReplicaStats,
    at: float,
    entries: list[dict[str, Any]] | None,
    prom: PromSnapshot | None,
    window_s: float,
) -> None:
    """Fold one poll into `s`: `entries` from /metrics (None: not read), `prom` from
    /prometheus/metrics (None: not read), both taken at `at`; windows of `window_s`."""
    entries = entries or []
    s.entries = entries
    latest = max(entries, key=lambda e: _num(e.get("iter")) or 0.0) if entries else None
    if latest is not None:
        s.running = _int(latest.get("numActiveRequests"))
        s.queued = _int(latest.get("numQueuedRequests"))
        kv = latest.get("kvCacheStats")
        if isinstance(kv, Mapping):
            used, total = _num(kv.get("usedNumBlocks")), _num(kv.get("maxNumBlocks"))
            if used is not None and total:
                s.kv_used_fraction = used / total
            s.cache_hit_rate = _hit_rate(kv)
    elif prom is not None and (RUNNING in prom.gauges or WAITING in prom.gauges):
        s.running = int(sum(prom.gauges.get(RUNNING, [])))
        s.queued = int(sum(prom.gauges.get(WAITING, [])))
    else:
        s.running = s.queued = 0  # an idle engine runs no iterations, so reports none
    if latest is None and prom is not None:
        if prom.gauges.get(KV_UTILIZATION):
            s.kv_used_fraction = max(prom.gauges[KV_UTILIZATION])
        if prom.gauges.get(KV_HIT_RATE):
            s.cache_hit_rate = max(prom.gauges[KV_HIT_RATE])

    # Iteration stats: each generation request decodes one token per iteration.
    tokens = 0.0
    for entry in entries:
        batching = entry.get("inflightBatchingStats")
        if isinstance(batching, Mapping):
            tokens += _num(batching.get("numGenRequests")) or 0.0
    s.iter_tokens.append((at, tokens))
    _trim(s.iter_tokens, at, window_s)
    iter_rate = None
    if len(s.iter_tokens) >= 2 and at > s.iter_tokens[0][0]:
        generated = sum(n for _, n in list(s.iter_tokens)[1:])
        iter_rate = generated / (at - s.iter_tokens[0][0])

    prom_rate = None
    if prom is not None:
        # Only what the windows need is kept (a full scrape is ~60 families per replica).
        kept = PromSnapshot(
            {},
            {k: v for k, v in prom.counters.items() if k == GENERATION_TOKENS},
            {k: v for k, v in prom.histograms.items() if k in {TTFT, E2E}},
        )
        if s.scrapes and is_reset(kept, s.scrapes[-1][1]):
            s.scrapes.clear()
        s.scrapes.append((at, kept))
        _trim(s.scrapes, at, window_s)
        base_at, base = s.scrapes[0] if len(s.scrapes) >= 2 else (None, None)
        if base is not None and base_at is not None and GENERATION_TOKENS in prom.counters:
            before = base.counters.get(GENERATION_TOKENS)
            if before is not None and at > base_at:
                prom_rate = (prom.counters[GENERATION_TOKENS] - before) / (at - base_at)
        for family, fields in (
            (TTFT, ("ttft_p50_s", "ttft_p95_s")),
            (E2E, ("e2e_p50_s", "e2e_p95_s")),
        ):
            buckets = prom.histograms.get(family)
            window = None
            if buckets is not None:
                window = bucket_delta(buckets, base.histograms.get(family) if base else None)
            for q, field in zip((0.5, 0.95), fields, strict=True):
                setattr(s, field, histogram_quantile(q, window) if window else None)
    s.tokens_per_s = prom_rate if prom_rate is not None else iter_rate


def _trim(history: deque[Any], now: float, window_s: float) -> None:
    """Keep one entry at or before the window's start (the baseline) and all after it."""
    while len(history) >= 2 and history[1][0] <= now - window_s:
        history.popleft()


def _hit_rate(kv: Mapping[str, Any]) -> float | None:
    rate = _num(kv.get("cacheHitRate"))
    if rate is not None:
        return rate
    reused, missed = _num(kv.get("reusedBlocks")), _num(kv.get("missedBlocks"))
    if reused is None or missed is None or reused + missed <= 0:
        return None
    return reused / (reused + missed)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    number = _num(value)
    return None if number is None else int(number)
