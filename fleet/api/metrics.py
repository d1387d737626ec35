"""Prometheus metrics of the fleet service (docs/metrics.md lists every series).

- `FleetCollector`: the fleet as the database holds it, read on each scrape (servers, racks
  and their measured power, deployments, decisions, warm pool, autopilot, boot and load durations:
  fleet/observability/fleet_metrics.py),
  and the BMC calls this process made (fleet/bmc/metrics.py).
- `LoopCollector`: the singleton loops of this process.
- `HttpMetrics`: this process's API requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select
from starlette.requests import Request
from starlette.types import Scope

from fleet.bmc import metrics as bmc_metrics
from fleet.control.loops import SingletonLoop
from fleet.lifecycle.states import ServerState
from fleet.models import BudgetMode, PowerState, Rack, Server, Site, utcnow
from fleet.observability.fleet_metrics import MeasuredDurations, families
from fleet.power.racks import RackView, is_fresh, rack_views
from fleet.power.reconcile_policy import is_mismatched
from fleet.registry.heartbeat_ingest import HeartbeatIngest, IngestStats
from fleet.settings import Settings, get_settings


class FleetCollector(Collector):
    """The fleet read from the database on each scrape, and this process's BMC calls."""

    def __init__(self, engine: Engine, settings: Settings | None = None) -> None:
        self._engine = engine
        self._settings = settings or get_settings()
        self._durations = MeasuredDurations()

    def collect(self) -> Iterator[Metric]:
        servers = GaugeMetricFamily(
            "fleet_servers",
            "Servers by lifecycle state, pool, site and GPU model",
            labels=["state", "pool", "site", "gpu_model"],
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
        power = _PowerFamilies()
        mismatched = GaugeMetricFamily(
            "fleet_power_mismatch_servers",
            "Servers whose BMC power state contradicts their lifecycle state (for an operator)",
        )
        unreachable = GaugeMetricFamily(
            "fleet_bmc_unreachable_servers", "Servers whose BMC the reconciler cannot read"
        )
        with Session(self._engine) as session:
            flagged = unreachable_count = 0
            for state, power_state, reachable in session.exec(
                select(Server.state, Server.power_state, Server.bmc_reachable)
            ):
                flagged += is_mismatched(ServerState(state), PowerState(power_state))
                unreachable_count += reachable is False
            mismatched.add_metric([], flagged)
            unreachable.add_metric([], unreachable_count)
            keys = (col(Server.state), col(Server.pool), col(Site.name), col(Server.gpu_model))
            rows = session.connection().execute(
                sa.select(*keys, func.count())
                .join(Rack, col(Rack.id) == Server.rack_id)
                .join(Site, col(Site.id) == Rack.site_id)
                .group_by(*keys)
            )
            for state, pool, site, gpu_model, count in rows:
                servers.add_metric([str(state), str(pool), site, gpu_model], count)
            now = utcnow()
            for view in rack_views(session, now=now, settings=self._settings):
                budget.add_metric([view.rack.name], view.power.budget_w)
                committed.add_metric([view.rack.name], view.power.committed_w)
                headroom.add_metric([view.rack.name], view.power.headroom_w)
                power.add_rack(view)
            power.add_servers(session, now, self._settings)
            more = families(session, self._durations)
        yield from (servers, budget, committed, headroom, mismatched, unreachable)
        yield from power.all()
        yield from more
        yield from bmc_metrics.collect()


class _PowerFamilies:
    """Measured rack and server power (docs/power.md). A figure not known (no fresh reading,
    no history yet) is left out, not exported as 0: an absent series means unknown."""

    def __init__(self) -> None:
        rack = ["rack"]
        self.drawn = GaugeMetricFamily(
            "fleet_rack_drawn_watts",
            "Power the rack's servers draw now: their fresh readings summed (BMC, else estimate)",
            labels=rack,
        )
        self.estimated = GaugeMetricFamily(
            "fleet_rack_drawn_estimated_watts",
            "The part of the rack's drawn power that is agent-based estimates",
            labels=rack,
        )
        self.peak = GaugeMetricFamily(
            "fleet_rack_drawn_peak_24h_watts",
            "The rack's largest drawn power over the last 24 hours (closed buckets)",
            labels=rack,
        )
        self.p99 = GaugeMetricFamily(
            "fleet_rack_drawn_p99_7d_watts",
            "p99 of the rack's drawn power over the last 7 days (closed buckets)",
            labels=rack,
        )
        self.measured = GaugeMetricFamily(
            "fleet_rack_budget_measured",
            "1 where the rack commits servers at their measured draw, 0 at nameplate",
            labels=rack,
        )
        self.cap = GaugeMetricFamily(
            "fleet_rack_gpu_cap_ratio",
            "GPU power limit the cap valve holds on the rack's serving GPUs, of TDP (1: none)",
            labels=rack,
        )
        self.override = GaugeMetricFamily(
            "fleet_rack_budget_override",
            "1 while an admin's override of the rack's budget holds",
            labels=rack,
        )
        self.server = GaugeMetricFamily(
            "fleet_server_drawn_watts",
            "Power a server draws now: its BMC's reading, or the agent's GPU power plus idle",
            labels=["server", "rack", "source"],
        )

    def add_rack(self, view: RackView) -> None:
        name = [view.rack.name]
        if view.drawn_w is not None:
            self.drawn.add_metric(name, view.drawn_w)
            self.estimated.add_metric(name, view.drawn_estimated_w)
        if view.peak_24h_w is not None:
            self.peak.add_metric(name, view.peak_24h_w)
        if view.p99_7d_w is not None:
            self.p99.add_metric(name, view.p99_7d_w)
        self.measured.add_metric(name, float(view.rack.budget_mode == BudgetMode.MEASURED))
        cap = view.rack.gpu_cap_pct
        self.cap.add_metric(name, 1.0 if cap is None else cap / 100.0)
        self.override.add_metric(name, float(view.rack.budget_override_at is not None))

    def add_servers(self, session: Session, now: datetime, settings: Settings) -> None:
        columns = (Server.name, Rack.name, Server.drawn_w, Server.drawn_source, Server.drawn_at)
        rows = session.connection().execute(
            sa.select(*(col(c) for c in columns))
            .join(Rack, col(Rack.id) == Server.rack_id)
            .where(col(Server.drawn_w).is_not(None))
        )
        for row in rows:
            if is_fresh(row.drawn_at, now, settings):
                labels = [str(row[0]), str(row[1]), str(row.drawn_source or "bmc")]
                self.server.add_metric(labels, row.drawn_w)

    def all(self) -> tuple[Metric, ...]:
        return (
            self.drawn,
            self.estimated,
            self.peak,
            self.p99,
            self.measured,
            self.cap,
            self.override,
            self.server,
        )


class LoopCollector(Collector):
    """Singleton loops: whether this process leads them, and their ticks."""

    def __init__(self, loops: list[SingletonLoop]) -> None:
        self._loops = loops

    def collect(self) -> Iterator[Metric]:
        leader = GaugeMetricFamily(
            "fleet_loop_leader", "1 where this process runs the loop (the leader)", labels=["loop"]
        )
        ticks = CounterMetricFamily("fleet_loop_ticks", "Ticks run", labels=["loop"])
        failed = CounterMetricFamily(
            "fleet_loop_failed_ticks", "Ticks that raised", labels=["loop"]
        )
        seconds = GaugeMetricFamily(
            "fleet_loop_last_tick_seconds", "Duration of the last tick", labels=["loop"]
        )
        for loop in self._loops:
            with loop.stats.lock:
                stats = (
                    loop.stats.leader,
                    loop.stats.ticks,
                    loop.stats.failed_ticks,
                    loop.stats.last_tick_s,
                )
            leader.add_metric([loop.name], float(stats[0]))
            ticks.add_metric([loop.name], stats[1])
            failed.add_metric([loop.name], stats[2])
            seconds.add_metric([loop.name], stats[3])
        yield from (leader, ticks, failed, seconds)


class HeartbeatCollector(Collector):
    """Steady heartbeats (fleet/registry/heartbeat_ingest.py): answered on the fast path,
    measurements written by batches, rows changed before their batch, batches refused. All
    0 where there is no fast path (SQLite, or turned off)."""

    def __init__(self, ingest: HeartbeatIngest | None) -> None:
        self._ingest = ingest

    def collect(self) -> Iterator[Metric]:
        stats = self._ingest.stats if self._ingest is not None else IngestStats()
        for name, text, value in (
            ("fleet_heartbeats_fast", "Heartbeats answered on the fast path", stats.fast),
            (
                "fleet_heartbeat_batch_rows",
                "Heartbeat measurements written in batches",
                stats.written,
            ),
            (
                "fleet_heartbeat_batch_diverted",
                "Batched heartbeats whose row changed first (only the time written)",
                stats.diverted,
            ),
            (
                "fleet_heartbeat_batch_failures",
                "Heartbeat batches the database refused",
                stats.failed_batches,
            ),
        ):
            family = CounterMetricFamily(name, text)
            family.add_metric([], value)
            yield family


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
        self.record(request.scope, status, seconds)

    def record(self, scope: Scope, status: int, seconds: float) -> None:
        # The route template, not the path: /servers/{name}, so label values stay bounded.
        # Requests answered before routing (refused at the edge, unknown paths): "unmatched".
        template = getattr(scope.get("route"), "path", "unmatched")
        self.requests.labels(scope["method"], template, str(status)).inc()
        self.latency.labels(scope["method"], template).observe(seconds)
