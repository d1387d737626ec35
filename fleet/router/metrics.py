"""The router's Prometheus series (its own registry: one router, one set)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.router.admission import PRIORITIES
from fleet.router.pool import DeploymentPool
from fleet.router.strategy import Replica

# Seconds: from a fast cached answer to a long generation.
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
P95_WINDOW = 1000  # the latest requests per deployment the p95 gauge covers


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "router_requests_total",
            "Requests answered, by deployment, priority and HTTP status",
            ["deployment", "priority", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "router_request_duration_seconds",
            "Time from the request's arrival to the last byte of its answer",
            ["deployment"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "router_time_to_first_token_seconds",
            "Time from the request's arrival to the first byte of its answer",
            ["deployment"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "router_output_tokens",
            "Output tokens relayed",
            ["deployment"],
            registry=r,
        )
        self.queue = Gauge(
            "router_queue_depth",
            "Requests waiting in the router for a free replica",
            ["deployment", "priority"],
            registry=r,
        )
        self.replica_inflight = Gauge(
            "router_replica_inflight",
            "Requests in flight through this router, per replica",
            ["deployment", "replica"],
            registry=r,
        )
        self.replica_ready = Gauge(
            "router_replica_ready",
            "1 when the replica may take new requests (agent ready, not ejected)",
            ["deployment", "replica"],
            registry=r,
        )
        self._recent: dict[str, deque[float]] = {}
        self._recent_ttft: dict[str, deque[float]] = {}
        r.register(_P95(self._recent))

    def finished(self, deployment: str, priority: str, code: str, seconds: float) -> None:
        self.requests.labels(deployment, priority, code).inc()
        if code == "200":
            self.duration.labels(deployment).observe(seconds)
            recent = self._recent.setdefault(deployment, deque(maxlen=P95_WINDOW))
            recent.append(seconds)

    def ttft(self, deployment: str, seconds: float) -> None:
        self.first_token.labels(deployment).observe(seconds)
        self._recent_ttft.setdefault(deployment, deque(maxlen=P95_WINDOW)).append(seconds)

    def p95s(self, deployment: str) -> tuple[float | None, float | None]:
        """(request duration p95, TTFT p95) over the latest requests; None before any."""
        return (
            _p95(self._recent.get(deployment, ())),
            _p95(self._recent_ttft.get(deployment, ())),
        )

    def output(self, deployment: str, tokens: int) -> None:
        self.tokens.labels(deployment).inc(tokens)

    def queue_depth(self, pool: DeploymentPool) -> None:
        for priority in PRIORITIES:
            self.queue.labels(pool.name, priority).set(pool.queue.depth(priority))

    def inflight(self, pool: DeploymentPool, replica: Replica) -> None:
        self.replica_inflight.labels(pool.name, replica.url).set(replica.inflight)

    def pool(self, pool: DeploymentPool) -> None:
        self.queue_depth(pool)
        for replica in pool.replicas.values():
            self.replica_inflight.labels(pool.name, replica.url).set(replica.inflight)
            self.replica_ready.labels(pool.name, replica.url).set(1 if replica.ready else 0)


class _P95(Collector):
    """The p95 per deployment, computed at scrape time (sorting on every request would cost
    more than the forwarding itself)."""

    def __init__(self, recent: dict[str, deque[float]]) -> None:
        self.recent = recent

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "router_request_duration_p95_seconds",
            f"p95 of the latest {P95_WINDOW} successful requests' durations",
            labels=["deployment"],
        )
        for deployment, window in list(self.recent.items()):
            value = _p95(window)
            if value is not None:
                family.add_metric([deployment], value)
        yield family


def _p95(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else None
