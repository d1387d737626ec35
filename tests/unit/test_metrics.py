"""The service's and the agent's Prometheus collectors (docs/metrics.md): fleet-wide series from
the database (on SQLite and on Postgres), the boot and load histograms fed from it, the BMC call
instrumentation of every PowerDriver, and the agent's GPU, Xid and replica series.
tests/e2e/worlds/test_prometheus.py checks the same through a real Prometheus."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import httpx
import pytest
from factories import add_rack, add_server, add_site
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.api.metrics import FleetCollector
from fleet.bmc import metrics as bmc_metrics
from fleet.bmc.base import (
    ActionResult,
    BmcAuthFailed,
    BmcInfo,
    BmcTarget,
    BmcUnreachable,
    PowerDriver,
    Sensors,
)
from fleet.lifecycle.states import ServerState
from fleet.models import (
    BmcProtocol,
    Deployment,
    Pool,
    PowerState,
    ScalingDecision,
    Server,
    utcnow,
)
from fleet.observability.fleet_metrics import DECISION_RULES
from fleet.provisioning.autopilot import set_paused
from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.engine.supervisor import EngineSupervisor
from fleet_agent.fleet_client import FleetClient
from fleet_agent.local_api import MIB, AgentCollector
from fleet_agent.telemetry.simulated import Fault, SimulatedTelemetry

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(*collectors: Any) -> Samples:
    """Every sample the collectors give, as Prometheus would read it: {(name, labels): value}."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def named(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


# ---------------------------------------------------------------------------------------------
# The fleet, from the database


@pytest.fixture
def fleet(session: Session) -> Deployment:
    """Site a: two warm H100 spares (one booted, serving a deployment with 2 replicas, one
    ready) and a baseline serving one; site b: an enrolled L40S of the warm pool."""
    rack_a = add_rack(session, add_site(session, "a"), "a-r1")
    rack_b = add_rack(session, add_site(session, "b"), "b-r1")
    deployment = Deployment(
        name="llama",
        model_uri="s3://m/llama",
        model_checksum="sha256:1",
        gpu_models=["H100"],
        min_replicas=1,
        max_replicas=4,
        sla_p95_latency_ms=2500,
        sla_ttft_ms=400,
        target_servers=2,
    )
    session.add(deployment)
    session.commit()
    add_server(session, rack_a, "a-1", ServerState.WARM, pool=Pool.WARM, bmc_port=1)
    booted = add_server(session, rack_a, "a-2", ServerState.SERVING, pool=Pool.WARM, bmc_port=2)
    booted.deployment_id = deployment.id
    booted.replicas = [{"index": 0, "state": "ready"}, {"index": 1, "state": "loading"}]
    session.add(booted)
    add_server(session, rack_a, "a-3", ServerState.SERVING, pool=Pool.BASELINE, bmc_port=3)
    add_server(session, rack_b, "b-1", pool=Pool.WARM, bmc_port=4, gpu_model="L40S", gpu_count=2)
    session.commit()
    return deployment


def test_servers_warm_pool_deployments_and_autopilot(db: Engine, fleet: Deployment) -> None:
    samples = scrape(FleetCollector(db))
    servers = named(samples, "fleet_servers")
    assert servers == {
        frozenset({"state": s, "pool": p, "site": site, "gpu_model": m}.items()): n
        for s, p, site, m, n in (
            ("warm", "warm", "a", "H100", 1),
            ("serving", "warm", "a", "H100", 1),
            ("serving", "baseline", "a", "H100", 1),
            ("enrolled", "warm", "b", "L40S", 1),
        )
    }
    # The warm pool: spares ready to boot; site b's is enrolled (not verified yet): 0.
    assert value(samples, "fleet_warm_pool_servers", site="a", gpu_model="H100") == 1
    assert value(samples, "fleet_warm_pool_gpus", site="a", gpu_model="H100") == 8
    assert value(samples, "fleet_warm_pool_servers", site="b", gpu_model="L40S") == 0
    assert value(samples, "fleet_deployment_target_servers", deployment="llama") == 2
    assert value(samples, "fleet_deployment_min_replicas", deployment="llama") == 1
    assert value(samples, "fleet_deployment_max_replicas", deployment="llama") == 4
    assert value(samples, "fleet_deployment_ready_replicas", deployment="llama") == 1
    assert value(samples, "fleet_deployment_sla_p95_latency_seconds", deployment="llama") == 2.5
    assert value(samples, "fleet_deployment_sla_ttft_seconds", deployment="llama") == 0.4
    # No autopilot row yet: neither paused nor open (and the scrape does not create it).
    assert value(samples, "fleet_autopilot_paused") == 0
    assert value(samples, "fleet_autopilot_breaker_open") == 0


def test_autopilot_pause_and_breaker(db: Engine, session: Session) -> None:
    row = set_paused(session, True, "tests", "maintenance window")
    row.breaker_open = True
    session.add(row)
    session.commit()
    samples = scrape(FleetCollector(db))
    assert value(samples, "fleet_autopilot_paused") == 1
    assert value(samples, "fleet_autopilot_breaker_open") == 1


def test_decisions_count_per_rule_from_zero(
    db: Engine, session: Session, fleet: Deployment
) -> None:
    for rule in ("queue_high", "queue_high", "scale_down", "calendar"):
        session.add(
            ScalingDecision(
                deployment="llama",
                rule=rule,
                target_before=1,
                target_after=2,
                reason="test",
                inputs={},
            )
        )
    session.commit()
    decisions = named(scrape(FleetCollector(db)), "fleet_autoscaler_decisions_total")
    counts = {dict(labels)["rule"]: v for labels, v in decisions.items()}
    assert set(counts) == set(DECISION_RULES)  # every rule, 0 until it fires
    assert counts["queue_high"] == 2 and counts["scale_down"] == 1 and counts["calendar"] == 1
    assert counts["min"] == 0


def test_boots_and_loads_are_observed_once_from_the_database(
    db: Engine, session: Session, fleet: Deployment
) -> None:
    collector = FleetCollector(db)
    before = scrape(collector)
    # Every GPU model has its series before any boot; the deployment's load for its model.
    for model in ("H100", "L40S"):
        assert value(before, "fleet_server_boot_duration_seconds_count", gpu_model=model) == 0
    load = {"deployment": "llama", "gpu_model": "H100"}
    assert value(before, "fleet_server_load_duration_seconds_count", **load) == 0

    server = _server(session, "a-2")
    started = utcnow() - timedelta(minutes=5)
    server.boot_started_at, server.boot_to_ready_s = started, 95.0
    server.load_started_at, server.load_s = started + timedelta(seconds=80), 15.0
    session.add(server)
    session.commit()
    for _ in range(2):  # a second scrape finds nothing new
        after = scrape(collector)
        assert value(after, "fleet_server_boot_duration_seconds_count", gpu_model="H100") == 1
        assert value(after, "fleet_server_boot_duration_seconds_sum", gpu_model="H100") == 95
        bucket = {"gpu_model": "H100", "le": "90.0"}
        assert value(after, "fleet_server_boot_duration_seconds_bucket", **bucket) == 0
        assert value(after, "fleet_server_load_duration_seconds_count", **load) == 1
        assert value(after, "fleet_server_load_duration_seconds_sum", **load) == 15

    # The next boot of the same server is a new observation; another process (collector) sees
    # every boot the database holds on its first scrape.
    server.boot_started_at, server.boot_to_ready_s = utcnow(), 60.0
    session.add(server)
    session.commit()
    again = scrape(collector)
    assert value(again, "fleet_server_boot_duration_seconds_count", gpu_model="H100") == 2
    other = scrape(FleetCollector(db))
    assert value(other, "fleet_server_boot_duration_seconds_count", gpu_model="H100") == 1


def _server(session: Session, name: str) -> Server:
    return session.exec(select(Server).where(Server.name == name)).one()


# ---------------------------------------------------------------------------------------------
# BMC calls: every PowerDriver is instrumented


class ScriptedBmc(PowerDriver):
    """Answers `power_state` from `state`; raises `fail` when set; power_on reads the state
    first, as the real drivers do (one operation, not two)."""

    fail: Exception | None = None

    def power_state(self) -> PowerState:
        if self.fail is not None:
            raise self.fail
        return PowerState.OFF

    def power_on(self) -> ActionResult:
        before = self.power_state()
        return ActionResult("on", True, before, PowerState.ON)

    def power_off(self, force: bool = False) -> ActionResult:
        return ActionResult("off", False, PowerState.OFF, PowerState.OFF)

    def power_cycle(self) -> ActionResult:
        return self.power_on()

    def identify(self, on: bool = True) -> None: ...

    def info(self) -> BmcInfo:
        return BmcInfo()

    def sensors(self) -> Sensors:
        return Sensors()


class _BmcSeries:
    def collect(self) -> Iterator[Any]:
        yield from bmc_metrics.collect()


def test_bmc_calls_are_timed_once_and_errors_counted_by_kind() -> None:
    target = BmcTarget("srv", BmcProtocol.REDFISH, "127.0.0.1", 1, "u", "p")
    bmc = ScriptedBmc(target)
    labels = {"protocol": "redfish"}

    def count(operation: str) -> float:
        key = ("fleet_bmc_call_duration_seconds_count", operation)
        found = scrape(_BmcSeries())
        return found.get((key[0], frozenset({**labels, "operation": operation}.items())), 0.0)

    def errors(operation: str) -> dict[str, float]:
        found = named(scrape(_BmcSeries()), "fleet_bmc_call_errors_total")
        return {
            dict(k)["error"]: v
            for k, v in found.items()
            if dict(k)["operation"] == operation and dict(k)["protocol"] == "redfish"
        }

    on_before, state_before = count("power_on"), count("power_state")
    bmc.power_on()  # reads the state inside: one power_on, no power_state
    assert count("power_on") == on_before + 1 and count("power_state") == state_before
    assert set(errors("power_on")) == set(bmc_metrics.KINDS)  # every kind, at 0 from the start
    errors_before = errors("power_state")

    bmc.power_state()
    bmc.fail = BmcUnreachable(target, "connection refused")
    with pytest.raises(BmcUnreachable):
        bmc.power_state()
    bmc.fail = BmcAuthFailed(target, "401")
    with pytest.raises(BmcAuthFailed):
        bmc.power_state()
    bmc.fail = RuntimeError("a driver bug")
    with pytest.raises(RuntimeError):
        bmc.power_state()
    after = errors("power_state")
    assert count("power_state") == state_before + 4  # failed calls are timed too
    assert after["unreachable"] == errors_before.get("unreachable", 0) + 1
    assert after["auth"] == errors_before.get("auth", 0) + 1
    assert after["other"] == errors_before.get("other", 0) + 1
    assert after["transient"] == errors_before.get("transient", 0)


def test_the_real_drivers_are_instrumented() -> None:
    from fleet.bmc.ipmi import IpmiDriver
    from fleet.bmc.redfish import RedfishDriver

    for driver in (IpmiDriver, RedfishDriver):
        for operation in bmc_metrics.OPERATIONS:
            assert getattr(getattr(driver, operation), "__fleet_bmc_timed__", False), operation


# ---------------------------------------------------------------------------------------------
# The agent


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class StubSupervisor:
    """What the agent and its collector read of an EngineSupervisor: one replica on 2 GPUs,
    whose newest iteration paused 3 requests."""

    deployment = "llama"
    ready = True

    def apply(self, *_: Any, **__: Any) -> None: ...

    def replica_stats(self) -> list[dict[str, Any]]:
        return [
            {
                "index": 0,
                "gpus": [0, 1],
                "state": "ready",
                "restarts": 2,
                "load_seconds": 41.5,
                "queued": 5,
                "running": 8,
                "kv_used_fraction": 0.75,
                "cache_hit_rate": 0.4,
                "preemptions": 17,
            }
        ]

    def iteration_stats(self, index: int) -> list[dict[str, Any]]:
        assert index == 0
        return [
            {"iter": 7, "inflightBatchingStats": {"numPausedRequests": 1}},
            {"iter": 8, "inflightBatchingStats": {"numPausedRequests": 3}},
        ]


def _agent() -> tuple[Agent, Clock]:
    def fleet(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"state": "serving", "assignment": {"kind": "none"}})

    settings = AgentSettings(server="gpu-1", token=SecretStr("flt_x"), telemetry="simulated")
    client = FleetClient("http://fleet.invalid", "flt_x", 1.0, transport=httpx.MockTransport(fleet))
    clock = Clock()
    telemetry = SimulatedTelemetry("H100", 2, clock=clock)
    supervisor = cast(EngineSupervisor, StubSupervisor())
    agent = Agent(settings, telemetry, client, clock=clock, rng=random.Random(1))
    agent.supervisor = supervisor
    return agent, clock


def test_agent_gpu_series_in_base_units_and_xids_counted_once() -> None:
    agent, clock = _agent()
    agent.tick()
    collector = AgentCollector(agent)
    samples = scrape(collector)
    snapshot = agent.latest()
    assert snapshot is not None
    gpu = snapshot.gpus[1]
    ids = {"gpu": "1", "uuid": gpu.uuid or ""}
    assert gpu.memory_total_mib is not None
    assert value(samples, "agent_gpu_memory_total_bytes", **ids) == gpu.memory_total_mib * MIB
    assert 0 <= value(samples, "agent_gpu_utilization_ratio", **ids) <= 1
    assert value(samples, "agent_gpu_slowdown_temperature_celsius", **ids) > 80
    assert value(samples, "agent_gpu_xid_errors_total", **ids) == 0  # 0 before any Xid
    assert value(samples, "agent_gpu_last_xid", **ids) == 0
    assert value(samples, "agent_info", version="0.1.0", telemetry="simulated") == 1

    assert isinstance(agent.telemetry, SimulatedTelemetry)
    agent.telemetry.inject(Fault(kind="xid", xid=79, gpu=1, count=2))
    clock.now += 1.0
    agent.tick()
    for _ in range(2):  # counted once, however often scraped
        samples = scrape(collector)
        assert value(samples, "agent_gpu_xid_errors_total", **ids) == 2
        assert value(samples, "agent_gpu_last_xid", **ids) == 79
        other = {"gpu": "0", "uuid": snapshot.gpus[0].uuid or ""}
        assert value(samples, "agent_gpu_xid_errors_total", **other) == 0
    assert value(samples, "agent_health_verdict") == 2


def test_agent_replica_series() -> None:
    agent, _ = _agent()
    agent.tick()
    samples = scrape(AgentCollector(agent))
    replica = {"deployment": "llama", "replica": "0"}
    expected = {
        "agent_replica_ready": 1,
        "agent_replica_gpus": 2,
        "agent_replica_queued_requests": 5,
        "agent_replica_running_requests": 8,
        "agent_replica_kv_cache_used_ratio": 0.75,
        "agent_replica_kv_cache_hit_ratio": 0.4,
        "agent_replica_load_seconds": 41.5,
        "agent_replica_paused_requests": 3,  # the newest iteration's
        "agent_replica_restarts_total": 2,
        "agent_replica_preemptions_total": 17,  # the engine's cumulative count
    }
    assert {name: value(samples, name, **replica) for name in expected} == expected
