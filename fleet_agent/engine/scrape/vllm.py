"""vLLM's /metrics (`vllm serve`, Prometheus text, `vllm:` prefix), read into an EngineSample.

Families from vllm/v1/metrics/loggers.py (PrometheusStatLogger) and docs/design/metrics.md, newest
name first where a release renamed one: `vllm:kv_cache_usage_perc` (was `gpu_cache_usage_perc`),
`vllm:prefix_cache_queries`/`_hits` (were `gpu_prefix_cache_*`; the V0 engine had only the
`gpu_prefix_cache_hit_rate` gauge, -1 before any lookup), `vllm:inter_token_latency_seconds`
(was `time_per_output_token_seconds`). `vllm:num_preemptions` is the engine's cumulative count
of requests preempted (KV cache full: put back in the waiting queue, recomputed later). Under
data parallelism every family carries an `engine` label per engine core: summed.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet_agent.engine.scrape.sample import EngineSample, FamilyTable, read_prometheus

PATHS = ("/metrics",)

TABLE = FamilyTable(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_used=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    hit_rate=("vllm:gpu_prefix_cache_hit_rate",),
    counters={
        "generation_tokens": ("vllm:generation_tokens_total",),
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "preemptions": ("vllm:num_preemptions_total",),
    },
    prefix=(
        ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
        ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"),
    ),
    histograms={
        "ttft": ("vllm:time_to_first_token_seconds",),
        "e2e": ("vllm:e2e_request_latency_seconds",),
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    },
)


def parse(texts: Mapping[str, str]) -> EngineSample:
    """`texts`: path -> body as read; raises UnsupportedEngineVersion without a vLLM family."""
    return read_prometheus("vllm", texts.get("/metrics"), TABLE)
