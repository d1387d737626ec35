"""Fleet-wide series read from the database at scrape time: deployments, autoscaler decisions,
the warm pool, the autopilot, and boot and model-load durations (docs/metrics.md).

The database is the fleet's memory, so any service process answers for the whole fleet and
every process shows the same values: dashboards take `max without (instance)` of them where
several processes are scraped. Nothing here writes to the database.

Boot and model-load durations are histograms although the database keeps only each server's
LAST measurement (`Server.boot_to_ready_s`, `Server.load_s`, written by the provisioner when a
server starts serving). Only the leader's provisioner measures, and the leader changes; so
rather than observe where the measurement is made (in whichever process leads at that moment,
lost when it stops), every process observes each new measurement it finds in the database on a
scrape (`MeasuredDurations`): a server's (start, duration) pair it has not seen before is one
boot. The first scrape of a process sees every server's last boot at once; Prometheus takes
that as the series' starting value, so `increase()` and `rate()` count only later boots. Only
a server booting twice between two scrapes (a boot takes minutes, scrapes come seconds apart)
would be counted once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlmodel import Session, col, func, select

from fleet.autoscaler.signals import RULES
from fleet.lifecycle.states import ServerState
from fleet.models import Autopilot, Deployment, Pool, Rack, ScalingDecision, Server, Site

# Rules a ScalingDecision row may name: the policy's and the calendar's firings.
DECISION_RULES = tuple(sorted({*RULES, "calendar"}))
# Seconds, power-on to serving: the virtual colo boots in seconds, a GPU server's firmware
# takes minutes.
BOOT_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1200, 1800, 3600)
# Seconds, engine start to every replica ready: weights from the local cache or the network.
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600, 900, 1800)


def deployment_families(session: Session) -> list[Metric]:
    """Per deployment: its bounds and target, its SLAs, and the replicas ready now."""
    target = GaugeMetricFamily(
        "fleet_deployment_target_servers",
        "Servers the deployment should run on now (autoscaler, calendar, operators)",
        labels=["deployment"],
    )
    minimum = GaugeMetricFamily(
        "fleet_deployment_min_replicas", "The deployment's minimum replicas", labels=["deployment"]
    )
    maximum = GaugeMetricFamily(
        "fleet_deployment_max_replicas", "The deployment's maximum replicas", labels=["deployment"]
    )
    sla_p95 = GaugeMetricFamily(
        "fleet_deployment_sla_p95_latency_seconds",
        "The deployment's SLA on the p95 request latency",
        labels=["deployment"],
    )
    sla_ttft = GaugeMetricFamily(
        "fleet_deployment_sla_ttft_seconds",
        "The deployment's SLA on the time to first token",
        labels=["deployment"],
    )
    ready = GaugeMetricFamily(
        "fleet_deployment_ready_replicas",
        "Replicas ready on serving servers, as their agents last reported",
        labels=["deployment"],
    )
    counts: dict[int, int] = {}
    serving = select(Server.deployment_id, Server.replicas).where(
        Server.state == ServerState.SERVING, col(Server.deployment_id).is_not(None)
    )
    for deployment_id, replicas in session.exec(serving):
        ok = sum(1 for r in replicas or () if isinstance(r, dict) and r.get("state") == "ready")
        counts[int(deployment_id or 0)] = counts.get(int(deployment_id or 0), 0) + ok
    for d in session.exec(select(Deployment).order_by(col(Deployment.name))):
        labels = [d.name]
        target.add_metric(labels, d.target_servers)
        minimum.add_metric(labels, d.min_replicas)
        maximum.add_metric(labels, d.max_replicas)
        sla_p95.add_metric(labels, d.sla_p95_latency_ms / 1000.0)
        sla_ttft.add_metric(labels, d.sla_ttft_ms / 1000.0)
        ready.add_metric(labels, counts.get(d.id or 0, 0))
    return [target, minimum, maximum, sla_p95, sla_ttft, ready]


def decisions_family(session: Session) -> Metric:
    """Scaling decisions recorded (fleet/autoscaler/service.py records one when the target or
    the rule changes), from the table: every process counts every leader's decisions. Every
    rule of every deployment starts at 0."""
    family = CounterMetricFamily(
        "fleet_autoscaler_decisions",
        "Scaling decisions recorded, by deployment and the rule that fired",
        labels=["deployment", "rule"],
    )
    counts: dict[tuple[str, str], int] = {}
    for name in session.exec(select(Deployment.name)):
        for rule in DECISION_RULES:
            counts[(name, rule)] = 0
    rows = session.exec(
        select(ScalingDecision.deployment, ScalingDecision.rule, func.count()).group_by(
            ScalingDecision.deployment, ScalingDecision.rule
        )
    )
    for deployment, rule, count in rows:
        counts[(deployment, rule)] = int(count)
    for (deployment, rule), count in sorted(counts.items()):
        family.add_metric([deployment, rule], count)
    return family


def warm_pool_families(session: Session) -> list[Metric]:
    """Warm spares (state `warm`: off, verified, ready to boot) per site and GPU model; 0 for a
    site and model whose warm-pool servers are all in use."""
    servers = GaugeMetricFamily(
        "fleet_warm_pool_servers",
        "Warm spares ready to boot, by site and GPU model",
        labels=["site", "gpu_model"],
    )
    gpus = GaugeMetricFamily(
        "fleet_warm_pool_gpus",
        "GPUs of the warm spares ready to boot, by site and GPU model",
        labels=["site", "gpu_model"],
    )
    pools: dict[tuple[str, str], list[int]] = {}
    columns = (Server.gpu_model, Server.gpu_count, Server.pool, Server.state)
    rows: sa.CursorResult[Any] = session.connection().execute(
        sa.select(col(Site.name).label("site"), *(col(c) for c in columns))
        .join(Rack, col(Rack.id) == Server.rack_id)
        .join(Site, col(Site.id) == Rack.site_id)
    )
    for row in rows:
        if row.state == ServerState.WARM or row.pool == Pool.WARM:
            spares = pools.setdefault((row.site, row.gpu_model), [0, 0])
            if row.state == ServerState.WARM:
                spares[0] += 1
                spares[1] += row.gpu_count
    for (site, gpu_model), (count, gpu_total) in sorted(pools.items()):
        servers.add_metric([site, gpu_model], count)
        gpus.add_metric([site, gpu_model], gpu_total)
    return [servers, gpus]


def autopilot_families(session: Session) -> list[Metric]:
    """The autopilot's pause and breaker (fleet/provisioning/autopilot.py), read without creating
    the row."""
    row = session.get(Autopilot, 1)
    paused = GaugeMetricFamily(
        "fleet_autopilot_paused", "1 while an operator has paused automatic actions"
    )
    breaker = GaugeMetricFamily(
        "fleet_autopilot_breaker_open",
        "1 while the breaker is open: too many servers turned unhealthy at once, automatic "
        "remediation stopped until an operator resumes",
    )
    paused.add_metric([], float(row is not None and row.paused))
    breaker.add_metric([], float(row is not None and row.breaker_open))
    return [paused, breaker]


class MeasuredDurations:
    """Boot-to-ready and model-load durations as histograms, observed from the database (the
    module docstring says why here rather than where the provisioner measures)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two scrapes at once must not observe a boot twice
        self._seen: dict[tuple[str, int], tuple[Any, float]] = {}
        self.boot = Histogram(
            "fleet_server_boot_duration_seconds",
            "Power-on to serving (boot to ready) of the servers Fleet booted, by GPU model",
            ["gpu_model"],
            buckets=BOOT_BUCKETS,
            registry=None,
        )
        self.load = Histogram(
            "fleet_server_load_duration_seconds",
            "Engines started to every replica ready (model load), by deployment and GPU model",
            ["deployment", "gpu_model"],
            buckets=LOAD_BUCKETS,
            registry=None,
        )

    def update(self, session: Session) -> None:
        """Observe every measurement not seen before; every GPU model (and each deployment's
        allowed ones) gets its series, at 0 before its first boot."""
        deployments = [(d.id, d.name, list(d.gpu_models)) for d in session.exec(select(Deployment))]
        names = {d_id: name for d_id, name, _ in deployments}
        columns = (
            Server.id,
            Server.gpu_model,
            Server.deployment_id,
            Server.boot_started_at,
            Server.boot_to_ready_s,
            Server.load_started_at,
            Server.load_s,
        )
        rows = list(session.connection().execute(sa.select(*(col(c) for c in columns))))
        models = sorted({row.gpu_model for row in rows})
        with self._lock:
            for model in models:
                self.boot.labels(model)
            for _, name, allowed in deployments:
                for model in models:
                    if not allowed or model in allowed:
                        self.load.labels(name, model)
            for row in rows:
                boot_s, load_s = row.boot_to_ready_s, row.load_s
                if boot_s is not None and self._new(("boot", row.id), row.boot_started_at, boot_s):
                    self.boot.labels(row.gpu_model).observe(boot_s)
                if load_s is not None and self._new(("load", row.id), row.load_started_at, load_s):
                    deployment = names.get(row.deployment_id, "")
                    self.load.labels(deployment, row.gpu_model).observe(load_s)

    def _new(self, key: tuple[str, int], started: datetime | None, seconds: float) -> bool:
        mark = (started, float(seconds))
        if self._seen.get(key) == mark:
            return False
        self._seen[key] = mark
        return True

    def collect(self) -> Iterator[Metric]:
        yield from self.boot.collect()
        yield from self.load.collect()


def families(session: Session, durations: MeasuredDurations) -> list[Metric]:
    """Everything this module exposes, read in one session."""
    durations.update(session)
    return [
        *deployment_families(session),
        decisions_family(session),
        *warm_pool_families(session),
        *autopilot_families(session),
        *durations.collect(),
    ]
