"""SGLang's /metrics (`python -m sglang.launch_server --enable-metrics`, Prometheus text,
`sglang:` prefix), read into an EngineSample.

Families from python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector,
TokenizerMetricsCollector) and docs/references/production_metrics.md: `sglang:num_running_reqs`,
`sglang:num_queue_reqs`, `sglang:token_usage` (KV-pool tokens in use ÷ the pool),
`sglang:cache_hit_rate` (radix-cache prefix hits). Retraction is SGLang's preemption (a running
request evicted back to the queue when the KV pool runs out): newer releases count it in
`sglang:num_retracted_requests_total`; older ones only have the `sglang:num_retracted_reqs`
gauge of the latest batch, which cannot be summed into a count, so preemptions stay unknown
there. `sglang:inter_token_latency_seconds` was `sglang:time_per_output_token_seconds`. Prefix
hits and lookups: `sglang:cached_tokens_total` of `sglang:prompt_tokens_total` where the release
counts cached tokens. Data-parallel ranks (dp_rank label) are summed.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet_agent.engine.scrape.sample import EngineSample, FamilyTable, read_prometheus

PATHS = ("/metrics",)

TABLE = FamilyTable(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_used=("sglang:token_usage",),
    hit_rate=("sglang:cache_hit_rate",),
    counters={
        "generation_tokens": ("sglang:generation_tokens_total",),
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "preemptions": ("sglang:num_retracted_requests_total",),
    },
    prefix=(("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),),
    histograms={
        "ttft": ("sglang:time_to_first_token_seconds",),
        "e2e": ("sglang:e2e_request_latency_seconds",),
        "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    },
)


def parse(texts: Mapping[str, str]) -> EngineSample:
    """`texts`: path -> body as read; raises UnsupportedEngineVersion without an SGLang family."""
    return read_prometheus("sglang", texts.get("/metrics"), TABLE)
