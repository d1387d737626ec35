"""The engine's Prometheus text (/prometheus/metrics of trtllm-serve), parsed and summed (pure):
the `trtllm_*` family names the supervisor reads, one scrape as a PromSnapshot, PromQL's
histogram_quantile() on cumulative buckets, and the bucket deltas between two scrapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

TTFT = "trtllm_time_to_first_token_seconds"
E2E = "trtllm_e2e_request_latency_seconds"
GENERATION_TOKENS = "trtllm_generation_tokens_total"
RUNNING, WAITING = "trtllm_num_requests_running", "trtllm_num_requests_waiting"
KV_UTILIZATION, KV_HIT_RATE = "trtllm_kv_cache_utilization", "trtllm_kv_cache_hit_rate"


@dataclasses.dataclass(frozen=True)
class PromSnapshot:
    """One scrape of /prometheus/metrics, label sets summed (or kept, for gauges)."""

    gauges: dict[str, list[float]]  # family -> one value per label set
    counters: dict[str, float]  # sample name (…_total) -> sum over label sets
    histograms: dict[str, dict[float, float]]  # family -> upper bound (le) -> cumulative count


def parse_prometheus(text: str) -> PromSnapshot:
    """Parse the text exposition format with prometheus_client's own parser."""
    gauges: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    histograms: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            buckets = histograms.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name == family.name + "_bucket" and "le" in sample.labels:
                    le = float(sample.labels["le"])  # "+Inf" -> inf
                    if _sane(sample.value):
                        buckets[le] = buckets.get(le, 0.0) + float(sample.value)
        elif family.type == "counter":
            for sample in family.samples:
                if sample.name.endswith("_total") and _sane(sample.value):
                    counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
        elif family.type in {"gauge", "untyped", "unknown"}:
            values = gauges.setdefault(family.name, [])
            values.extend(
                float(s.value) for s in family.samples if s.name == family.name and _sane(s.value)
            )
    return PromSnapshot(gauges, counters, histograms)


def _sane(value: float) -> bool:
    """A value the figures can use: finite and not negative (no gauge, counter or bucket the
    agent reads can be below 0; NaN or ±Inf from a broken engine would poison every window and,
    reported, make the fleet refuse the whole heartbeat)."""
    return math.isfinite(value) and value >= 0


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative buckets {le: count}, interpolated linearly within the bucket
    like PromQL's histogram_quantile (promql/quantile.go): None without observations or without
    the +Inf bucket; a rank in the +Inf bucket gives the highest finite bound; the first bucket
    starts at 0 (unless its bound is not positive)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    items = sorted(buckets.items())
    if len(items) < 2 or not math.isinf(items[-1][0]):
        return None
    counts: list[float] = []
    for _, count in items:  # counts must not decrease (Prometheus repairs small dips too)
        counts.append(max(count, counts[-1]) if counts else count)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i in range(len(items) - 1) if counts[i] >= rank), len(items) - 1)
    if b == len(items) - 1:
        return items[-2][0]
    if b == 0 and items[0][0] <= 0:
        return items[0][0]
    start = 0.0 if b == 0 else items[b - 1][0]
    below = 0.0 if b == 0 else counts[b - 1]
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return start
    return start + (items[b][0] - start) * ((rank - below) / in_bucket)


def bucket_delta(
    now: Mapping[float, float], before: Mapping[float, float] | None
) -> dict[float, float]:
    """Observations between two scrapes of one histogram (all of `now` without a `before`)."""
    if before is None:
        return dict(now)
    return {le: count - before.get(le, 0.0) for le, count in now.items()}


def is_reset(now: PromSnapshot, before: PromSnapshot) -> bool:
    """A counter or bucket went down: the engine's registry started over."""
    if any(now.counters.get(name, value) < value for name, value in before.counters.items()):
        return True
    for family, buckets in before.histograms.items():
        current = now.histograms.get(family, {})
        if any(current.get(le, count) < count for le, count in buckets.items()):
            return True
    return False
