"""vLLM's and SGLang's Prometheus metrics, as their stand-in dialects export them at /metrics.

vLLM (vllm/v1/metrics/loggers.py, PrometheusStatLogger, the 0.11 line): every family labelled
model_name=<first served name>, engine="0"; counters end in `_total` on the wire. SGLang
(python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector and
TokenizerMetricsCollector): labelled model_name=<served name>. Names, help texts and buckets are
theirs; only the families the stand-in can fill are exported.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleet_agent.engine.core import EngineCore, Finished, IterationResult

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


class VllmMetrics:
    """vLLM V1's `vllm:*` families the stand-in fills."""

    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        self.lv = {"model_name": model_name, "engine": "0"}
        names = list(self.lv)
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            names,
            registry=r,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            names,
            registry=r,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            names,
            registry=r,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            names,
            registry=r,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            names,
            registry=r,
        )
        self.preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            names,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        lv = self.lv
        for reason in ("stop", "length", "abort"):  # vLLM creates every reason's series
            self.success.labels(**lv, finished_reason=reason)
        families: tuple[Counter | Histogram, ...] = (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
        )
        for family in families:
            family.labels(**lv)

    def iteration(self, result: IterationResult) -> None:
        lv = self.lv
        if result.preempted:
            self.preemptions.labels(**lv).inc(len(result.preempted))
        self.generation_tokens.labels(**lv).inc(len(result.tokens))
        for tok in result.tokens:
            if tok.index:
                self.itl.labels(**lv).observe(result.duration_s)

    def finished(self, f: Finished) -> None:
        lv = self.lv
        self.success.labels(**lv, finished_reason=f.finish_reason).inc()
        self.ttft.labels(**lv).observe(f.first_token_time - f.arrival_time)
        self.e2e.labels(**lv).observe(f.finish_time - f.arrival_time)
        self.queue.labels(**lv).observe(f.first_scheduled_time - f.arrival_time)
        self.prompt_tokens.labels(**lv).inc(f.prompt_tokens)
        self.prefix_queries.labels(**lv).inc(f.prompt_tokens)
        self.prefix_hits.labels(**lv).inc(f.cached_prompt_tokens)

    def refresh(self, core: EngineCore) -> None:
        lv = self.lv
        self.running.labels(**lv).set(core.num_active)
        self.waiting.labels(**lv).set(core.num_waiting)
        self.kv_usage.labels(**lv).set(core.used_blocks / core.max_blocks)


_SG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
_SG_E2E = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
           1200, 1800, 2400]  # fmt: skip
_SG_ITL = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
           0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]  # fmt: skip


class SglangMetrics:
    """SGLang's `sglang:*` families the stand-in fills (with --enable-metrics)."""

    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        self.lv = {"model_name": model_name}
        names = list(self.lv)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, names, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, names, registry=r)

        self.running = gauge("num_running_reqs", "The number of running requests.")
        self.used_tokens = gauge("num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("token_usage", "The token usage.")
        self.queue = gauge("num_queue_reqs", "The number of requests in the waiting queue.")
        self.hit_rate = gauge("cache_hit_rate", "The prefix cache hit rate.")
        self.max_tokens = gauge(
            "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        self.retracted = gauge("num_retracted_reqs", "The number of retracted requests.")
        self.retracted_total = counter(
            "num_retracted_requests", "Total number of retracted requests."
        )
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("num_requests", "Number of requests processed.")
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=_SG_TTFT,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=_SG_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            names,
            buckets=_SG_E2E,
            registry=r,
        )
        lv = self.lv
        families: tuple[Counter | Histogram, ...] = (
            self.retracted_total,
            self.prompt_tokens,
            self.generation_tokens,
            self.cached_tokens,
            self.requests,
            self.ttft,
            self.itl,
            self.e2e,
        )
        for family in families:
            family.labels(**lv)

    def iteration(self, result: IterationResult) -> None:
        lv = self.lv
        self.retracted.labels(**lv).set(len(result.preempted))
        if result.preempted:
            self.retracted_total.labels(**lv).inc(len(result.preempted))
        for tok in result.tokens:
            if tok.index:
                self.itl.labels(**lv).observe(result.duration_s)

    def finished(self, f: Finished) -> None:
        lv = self.lv
        self.requests.labels(**lv).inc()
        self.ttft.labels(**lv).observe(f.first_token_time - f.arrival_time)
        self.e2e.labels(**lv).observe(f.finish_time - f.arrival_time)
        self.prompt_tokens.labels(**lv).inc(f.prompt_tokens)
        self.generation_tokens.labels(**lv).inc(f.completion_tokens)
        self.cached_tokens.labels(**lv).inc(f.cached_prompt_tokens)

    def refresh(self, core: EngineCore) -> None:
        lv = self.lv
        tokens = core.max_blocks * core.shape.tokens_per_block
        used = core.used_blocks * core.shape.tokens_per_block
        self.running.labels(**lv).set(core.num_active)
        self.queue.labels(**lv).set(core.num_waiting)
        self.used_tokens.labels(**lv).set(used)
        self.token_usage.labels(**lv).set(used / tokens)
        self.max_tokens.labels(**lv).set(tokens)
        self.hit_rate.labels(**lv).set(core.prefix_hit_rate)
