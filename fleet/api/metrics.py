"""Prometheus metrics of the fleet service: request counters and fleet gauges read at scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine
from sqlmodel import Session, func, select
from starlette.requests import Request

from fleet.models import Server
from fleet.racks import rack_views


class FleetCollector(Collector):
    """Servers by state and rack power, read from the database on each scrape."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        servers = GaugeMetricFamily(
            "fleet_servers",
            "Servers by lifecycle state, pool and GPU model",
            labels=["state", "pool", "gpu_model"],
        )
        budget = GaugeMetricFamily("fleet_rack_budget_watts", "Usable rack power", labels=["rack"])
        committed = GaugeMetricFamily(
            "fleet_rack_committed_watts",
            "Power committed to servers on or booting",
            labels=["rack"],
        )
        headroom = GaugeMetricFamily(
            "fleet_rack_headroom_watts", "Budget minus committed power", labels=["rack"]
        )
        with Session(self._engine) as session:
            rows = session.exec(
                select(Server.state, Server.pool, Server.gpu_model, func.count()).group_by(
                    Server.state, Server.pool, Server.gpu_model
                )
            )
            for state, pool, gpu_model, count in rows:
                servers.add_metric([str(state), str(pool), gpu_model], count)
            for view in rack_views(session):
                budget.add_metric([view.rack.name], view.power.budget_w)
                committed.add_metric([view.rack.name], view.power.committed_w)
                headroom.add_metric([view.rack.name], view.power.headroom_w)
        yield from (servers, budget, committed, headroom)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "fleet_http_requests",
            "API requests",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "fleet_http_request_duration_seconds",
            "API request latency",
            ["method", "route"],
            registry=registry,
        )

    def observe(self, request: Request, status: int, seconds: float) -> None:
        # The route template, not the path: /servers/{name}, so label values stay bounded.
        template = getattr(request.scope.get("route"), "path", "unmatched")
        self.requests.labels(request.method, template, str(status)).inc()
        self.latency.labels(request.method, template).observe(seconds)
