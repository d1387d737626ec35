"""trtllm-serve's Prometheus metrics, as the stand-in exports them at /prometheus/metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleet_agent.engine.core import Finished


class PromMetrics:
    """trtllm-serve's `trtllm_*` metrics (names and buckets of tensorrt_llm/metrics/collector.py;
    trtllm-serve labels every series model_name="undefined", engine_type="undefined")."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": "undefined", "engine_type": "undefined"}
        names = list(self.labels)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"trtllm_{name}", doc, names, registry=r)

        self.success = Counter(
            "trtllm_request_success_total",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.e2e = Histogram(
            "trtllm_e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            names,
            registry=r,
            buckets=[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
        )  # fmt: skip
        self.ttft = Histogram(
            "trtllm_time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            registry=r,
            buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
        )  # fmt: skip
        self.tpot = Histogram(
            "trtllm_time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            names,
            registry=r,
            buckets=[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0],
        )  # fmt: skip
        self.queue = Histogram(
            "trtllm_request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            registry=r,
            buckets=[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "trtllm_prompt_tokens_total",
            "Cumulative number of prompt (input) tokens processed.",
            names,
            registry=r,
        )
        self.generation_tokens = Counter(
            "trtllm_generation_tokens_total",
            "Cumulative number of generation (output) tokens produced.",
            names,
            registry=r,
        )
        self.completed = Counter(
            "trtllm_num_requests_completed_total",
            "Total number of completed requests across iterations",
            names,
            registry=r,
        )
        self.running = gauge("num_requests_running", "Number of active requests")
        self.waiting = gauge("num_requests_waiting", "Number of queued requests")
        self.kv_util = gauge("kv_cache_utilization", "KV cache utilization")
        self.kv_hit = gauge("kv_cache_hit_rate", "KV cache hit rate")
        self.kv_max = gauge("kv_cache_max_blocks", "Maximum number of KV cache blocks")
        self.kv_free = gauge("kv_cache_free_blocks", "Number of free KV cache blocks")
        self.kv_used = gauge("kv_cache_used_blocks", "Number of used KV cache blocks")
        self.kv_tpb = gauge("kv_cache_tokens_per_block", "Number of tokens per KV cache block")
        self.iter_latency = gauge("iteration_latency_seconds", "Iteration latency in seconds")
        self.gpu_mem = gauge("gpu_memory_usage_bytes", "GPU memory usage in bytes")
        self.max_active = gauge("max_num_active_requests", "Maximum number of active requests")
        self.ctx_requests = gauge("num_context_requests", "Number of context (prefill) requests")
        self.gen_requests = gauge(
            "num_generation_requests", "Number of generation (decode) requests"
        )
        self.scheduled = gauge("num_scheduled_requests", "Number of scheduled requests")
        self.ctx_tokens = gauge("total_context_tokens", "Total number of context tokens")
        # The stand-in's own (not trtllm-serve's): what its simulated GPUs draw, per GPU, in a
        # registry of their own that every dialect's metrics page ends with.
        r = self.power_registry = CollectorRegistry()
        self.gpu_power = Gauge(
            "fleet_standin_gpu_power_watts",
            "Per-GPU power over the last report period (phase-aware power model)",
            [*names, "gpu"],
            registry=r,
        )
        self.gpu_energy = Counter(
            "fleet_standin_gpu_energy_joules",
            "Per-GPU energy since the engine started",
            [*names, "gpu"],
            registry=r,
        )
        self.gpu_power_limit = Gauge(
            "fleet_standin_gpu_power_limit_watts",
            "Per-GPU power limit the engine runs under",
            [*names, "gpu"],
            registry=r,
        )

    def iteration(self, stats: Mapping[str, Any]) -> None:
        lv = self.labels
        kv = stats["kvCacheStats"]
        ifb = stats["inflightBatchingStats"]
        self.iter_latency.labels(**lv).set(stats["iterLatencyMS"] / 1e3)
        if stats["numCompletedRequests"]:
            self.completed.labels(**lv).inc(stats["numCompletedRequests"])
        self.kv_hit.labels(**lv).set(kv["cacheHitRate"])
        self.kv_free.labels(**lv).set(kv["freeNumBlocks"])
        self.kv_used.labels(**lv).set(kv["usedNumBlocks"])
        self.ctx_requests.labels(**lv).set(ifb["numContextRequests"])
        self.gen_requests.labels(**lv).set(ifb["numGenRequests"])
        self.scheduled.labels(**lv).set(ifb["numScheduledRequests"])
        self.ctx_tokens.labels(**lv).set(ifb["numCtxTokens"])

    def finished(self, f: Finished) -> None:
        lv = self.labels
        self.success.labels(**lv, finished_reason=f.finish_reason).inc()
        self.e2e.labels(**lv).observe(f.finish_time - f.arrival_time)
        self.ttft.labels(**lv).observe(f.first_token_time - f.arrival_time)
        if f.completion_tokens > 1:
            tpot = (f.finish_time - f.first_token_time) / (f.completion_tokens - 1)
            self.tpot.labels(**lv).observe(tpot)
        self.queue.labels(**lv).observe(f.first_scheduled_time - f.arrival_time)
        self.prompt_tokens.labels(**lv).inc(f.prompt_tokens)
        self.generation_tokens.labels(**lv).inc(f.completion_tokens)
