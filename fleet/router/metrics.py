"""The router's Prometheus series (its own registry: one router, one set)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.router.admission import PRIORITIES
from fleet.router.callers import ANONYMOUS
from fleet.router.pool import DeploymentPool
from fleet.router.strategy import Replica
from fleet_core.stats import quantile

# Seconds: from a fast cached answer to a long generation.
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
P95_WINDOW_S = 60.0  # the p95s (gauge and autoscaler reports) cover the last minute
P95_MAX = 5000  # requests kept per deployment for them, at most
MAX_VERSIONS = 8  # versions per deployment in a load report (the fleet's bound)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "router_requests_total",
            "Requests answered, by deployment, priority, HTTP status and the model version of "
            'the replica that answered ("" when none did) and the caller\'s tenant',
            ["deployment", "priority", "code", "version", "tenant"],
            registry=r,
        )
        self.version_attempts = Counter(
            "router_version_attempts_total",
            "Tries sent to a replica, by deployment, the replica's model version and outcome "
            "(error: 5xx or no answer, retries included): what a rollout's analysis compares",
            ["deployment", "version", "outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "router_request_duration_seconds",
            "Time from the request's arrival to the last byte of its answer",
            ["deployment", "tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "router_time_to_first_token_seconds",
            "Time from the request's arrival to the first byte of its answer",
            ["deployment", "tenant"],
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
            "1 when the replica may take new requests (its agent says ready, not ejected)",
            ["deployment", "replica"],
            registry=r,
        )
        self._recent: dict[str, _Window] = {}
        self._recent_ttft: dict[str, _Window] = {}
        # Per (deployment, version): tries and errors since start, and the p95 windows
        self._tries: dict[tuple[str, str], list[int]] = {}
        # Per deployment: requests that arrived and their tokens (prompt + expected output),
        # refused ones included, since the router started: the load report's demand counters.
        self.arrivals: dict[str, list[int]] = {}
        self._recent_v: dict[tuple[str, str], _Window] = {}
        self._recent_ttft_v: dict[tuple[str, str], _Window] = {}
        self._known: set[tuple[str, str]] = set()  # (deployment, tenant)
        self.tenants: tuple[str, ...] = (ANONYMOUS,)  # whose series exist from the start
        self._known_versions: set[tuple[str, str]] = set()
        self._depth_shown: dict[str, int] = {}  # per deployment: the waiting the gauges show
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.clock: Callable[[], float] = time.monotonic
        r.register(_P95(self))

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: prometheus_client's lookup costs a few
        microseconds, several times per request on the hot path."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def finished(
        self,
        deployment: str,
        priority: str,
        code: str,
        seconds: float,
        version: str = "",
        tenant: str = ANONYMOUS,
    ) -> None:
        self._child(self.requests, deployment, priority, code, version, tenant).inc()
        if code == "200":
            self._child(self.duration, deployment, tenant).observe(seconds)
            now = self.clock()
            self._recent.setdefault(deployment, _Window()).add(now, seconds)
            if version:
                self._recent_v.setdefault((deployment, version), _Window()).add(now, seconds)

    def ttft(
        self, deployment: str, seconds: float, version: str = "", tenant: str = ANONYMOUS
    ) -> None:
        self._child(self.first_token, deployment, tenant).observe(seconds)
        now = self.clock()
        self._recent_ttft.setdefault(deployment, _Window()).add(now, seconds)
        if version:
            self._recent_ttft_v.setdefault((deployment, version), _Window()).add(now, seconds)

    def arrived(self, deployment: str, tokens: float) -> None:
        counts = self.arrivals.get(deployment)
        if counts is None:
            counts = self.arrivals[deployment] = [0, 0]
        counts[0] += 1
        counts[1] += max(0, round(tokens))

    def attempt(self, deployment: str, version: str, *, error: bool) -> None:
        """One try on a replica of `version` ended: an error when the replica answered 5xx or
        not at all (a retry elsewhere may still have saved the request)."""
        if not version:
            return
        counts = self._tries.get((deployment, version))
        if counts is None:
            counts = self._tries[(deployment, version)] = [0, 0]
        counts[0] += 1
        if error:
            counts[1] += 1
        self._child(self.version_attempts, deployment, version, "error" if error else "ok").inc()

    def version_figures(self, deployment: str, first: list[str]) -> dict[str, dict[str, Any]]:
        """Per version of `deployment` (those in `first`, then any counted, at most
        MAX_VERSIONS): tries and errors since the router started, p95s of the last minute —
        what the load report sends for a rollout's analysis."""
        now = self.clock()
        seen = [v for v in first if v]
        seen += sorted(v for d, v in self._tries if d == deployment and v not in seen)
        out: dict[str, dict[str, Any]] = {}
        for version in seen[:MAX_VERSIONS]:
            requests, errors = self._tries.get((deployment, version), (0, 0))
            durations = self._recent_v.get((deployment, version))
            ttfts = self._recent_ttft_v.get((deployment, version))
            out[version] = {
                "requests": requests,
                "errors": errors,
                "p95_s": durations.p95(now) if durations else None,
                "ttft_p95_s": ttfts.p95(now) if ttfts else None,
            }
        return out

    def p95s(self, deployment: str) -> tuple[float | None, float | None]:
        """(request duration p95, TTFT p95) over the last P95_WINDOW_S; None without requests
        then (an idle deployment has no latency to report, not an old one)."""
        now = self.clock()
        durations = self._recent.get(deployment)
        ttfts = self._recent_ttft.get(deployment)
        return (
            durations.p95(now) if durations else None,
            ttfts.p95(now) if ttfts else None,
        )

    def output(self, deployment: str, tokens: int) -> None:
        self._child(self.tokens, deployment).inc(tokens)

    def queue_depth(self, pool: DeploymentPool) -> None:
        """The waiting gauges, left alone when they show 0 and nothing waits (most requests:
        setting them costs a few microseconds)."""
        waiting = len(pool.queue)
        if not waiting and not self._depth_shown.get(pool.name, 1):
            return
        for priority in PRIORITIES:
            self._child(self.queue, pool.name, priority).set(pool.queue.depth(priority))
        self._depth_shown[pool.name] = waiting

    def inflight(self, pool: DeploymentPool, replica: Replica) -> None:
        self._child(self.replica_inflight, pool.name, replica.url).set(replica.inflight)

    def pool(self, pool: DeploymentPool) -> None:
        if (pool.name, "") not in self._known:
            self._known.add((pool.name, ""))
            self.tokens.labels(pool.name)
        for tenant in self.tenants:
            # Every series of a deployment exists (at 0) from the moment the router knows it
            # (and the tenant): the first request's increase is then visible to rate() and
            # the quantiles.
            if (pool.name, tenant) not in self._known:
                self._known.add((pool.name, tenant))
                self.duration.labels(pool.name, tenant)
                self.first_token.labels(pool.name, tenant)
                for version in (pool.stable, pool.canary) if pool.canary else (pool.stable,):
                    for priority in PRIORITIES:
                        self.requests.labels(pool.name, priority, "200", version, tenant)
        # ... and of each version it serves, once known ("": a table without versions)
        for version in (pool.stable, pool.canary) if pool.canary else (pool.stable,):
            if (pool.name, version) not in self._known_versions:
                self._known_versions.add((pool.name, version))
                for priority in PRIORITIES:
                    for tenant in self.tenants:
                        self.requests.labels(pool.name, priority, "200", version, tenant)
                if version:
                    for outcome in ("ok", "error"):
                        self.version_attempts.labels(pool.name, version, outcome)
        self.queue_depth(pool)
        for replica in pool.replicas.values():
            self.replica_inflight.labels(pool.name, replica.url).set(replica.inflight)
            ready = replica.ready and replica.ejected_until <= time.monotonic()
            self.replica_ready.labels(pool.name, replica.url).set(1 if ready else 0)


class _Window:
    """(time, value) of the last P95_WINDOW_S, at most P95_MAX of them."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, float]] = deque(maxlen=P95_MAX)

    def add(self, at: float, value: float) -> None:
        self.items.append((at, value))

    def p95(self, now: float) -> float | None:
        while self.items and self.items[0][0] < now - P95_WINDOW_S:
            self.items.popleft()
        return _p95(v for _, v in self.items)


class _P95(Collector):
    """The p95 per deployment, computed at scrape time (sorting on every request would cost
    more than the forwarding itself)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "router_request_duration_p95_seconds",
            f"p95 of the request durations of the last {P95_WINDOW_S:.0f} s (answered ones)",
            labels=["deployment"],
        )
        now = self.metrics.clock()
        for deployment, window in list(self.metrics._recent.items()):
            value = window.p95(now)
            if value is not None:
                family.add_metric([deployment], value)
        yield family


def _p95(values: Iterable[float]) -> float | None:
    return quantile(values, 0.95)
