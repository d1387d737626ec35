"""TensorRT-LLM's `trtllm-serve` metrics, read into an EngineSample: /metrics (JSON: the
iteration stats queued since the previous read, handed out once and forgotten;
docs/source/commands/trtllm-serve/trtllm-serve.rst) and /prometheus/metrics (Prometheus text,
`trtllm_` prefix; tensorrt_llm/metrics/collector.py).

The newest iteration entry gives running, queued, KV used ÷ max blocks and the cache hit rate.
An idle engine runs no iterations: with no new entries the Prometheus gauges stand in, else
running = waiting = 0. TensorRT-LLM has no preemption counter: each entry's
inflightBatchingStats.numPausedRequests (requests paused in that iteration, evicted from the
batch for KV-cache space) goes to update_stats (replica_stats.py) as the poll's
counters["paused_requests"] and is summed there across polls; every entry is read exactly
once, so the sum counts each pause once.
"""

from __future__ import annotations

import json
import math
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
)
from fleet_agent.engine.scrape.sample import (
    EngineSample,
    FamilyTable,
    UnsupportedEngineVersion,
    read_prometheus,
)

PATHS = ("/metrics", "/prometheus/metrics")
ITERATION_STATS = "/metrics iteration stats (a JSON list)"
PAUSED_IN_POLL = "paused_requests"  # EngineSample.counters key, trtllm only: see parse()

TABLE = FamilyTable(
    running=(RUNNING,),
    waiting=(WAITING,),
    kv_used=(KV_UTILIZATION,),
    hit_rate=(KV_HIT_RATE,),
    counters={
        "generation_tokens": (GENERATION_TOKENS,),
        "prompt_tokens": ("trtllm_prompt_tokens_total",),
    },
    histograms={
        "ttft": (TTFT,),
        "e2e": (E2E,),
        "itl": ("trtllm_time_per_output_token_seconds",),
    },
)


def parse(texts: Mapping[str, str]) -> EngineSample:
    """`texts`: path -> body of what was read. Either path alone is enough (a release without
    /prometheus/metrics; a /metrics drained by the server itself); neither: unsupported."""
    entries = _entries(texts.get("/metrics"))
    prom: EngineSample | None = None
    if texts.get("/prometheus/metrics"):
        try:
            prom = read_prometheus("trtllm", texts["/prometheus/metrics"], TABLE)
        except UnsupportedEngineVersion:
            prom = None
    if entries is None and prom is None:
        raise UnsupportedEngineVersion("trtllm", (ITERATION_STATS, *TABLE.families()))
    entries = entries or []
    latest = max(entries, key=lambda e: number(e.get("iter")) or 0.0) if entries else None
    kv_used = hit_rate = None
    if latest is not None:
        running, waiting = (
            _int(latest.get("numActiveRequests")),
            _int(latest.get("numQueuedRequests")),
        )
        kv = latest.get("kvCacheStats")
        if isinstance(kv, Mapping):
            used, total = number(kv.get("usedNumBlocks")), number(kv.get("maxNumBlocks"))
            if used is not None and total:
                kv_used = used / total
            hit_rate = _hit_rate(kv)
    elif prom is not None and (prom.running is not None or prom.waiting is not None):
        running, waiting = prom.running or 0, prom.waiting or 0
    else:
        running = waiting = 0  # an idle engine runs no iterations, so reports none
    if latest is None and prom is not None:
        kv_used, hit_rate = prom.kv_used_fraction, prom.prefix_hit_rate
    return EngineSample(
        running=running,
        waiting=waiting,
        kv_used_fraction=kv_used,
        prefix_hit_rate=hit_rate,
        # Not cumulative, unlike the others: the pauses in the iterations this poll read, which
        # update_stats sums into the preemption count (every entry is handed out once).
        counters={
            **(prom.counters if prom is not None else {}),
            PAUSED_IN_POLL: paused_requests(entries),
        },
        histograms=dict(prom.histograms) if prom is not None else {},
        entries=entries,
    )


def generation_requests(entries: list[dict[str, Any]]) -> float:
    """Tokens decoded across the entries: each generation request decodes one per iteration."""
    return sum(_batching(entry, "numGenRequests") for entry in entries)


def paused_requests(entries: list[dict[str, Any]]) -> float:
    """Requests paused (preempted for KV-cache space) across the entries' iterations."""
    return sum(_batching(entry, "numPausedRequests") for entry in entries)


def number(value: Any) -> float | None:
    """A finite JSON number as float; anything else (bool, string, NaN) None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _batching(entry: Mapping[str, Any], key: str) -> float:
    batching = entry.get("inflightBatchingStats")
    return (number(batching.get(key)) or 0.0) if isinstance(batching, Mapping) else 0.0


def _entries(body: str | None) -> list[dict[str, Any]] | None:
    """The JSON list of iteration entries; None when absent or not JSON (not trtllm's)."""
    if body is None:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def _hit_rate(kv: Mapping[str, Any]) -> float | None:
    rate = number(kv.get("cacheHitRate"))
    if rate is not None:
        return rate
    reused, missed = number(kv.get("reusedBlocks")), number(kv.get("missedBlocks"))
    if reused is None or missed is None or reused + missed <= 0:
        return None
    return reused / (reused + missed)


def _int(value: Any) -> int | None:
    n = number(value)
    return None if n is None else int(n)
