"""The agent daemon end to end: a real `fleetctl serve` process (embedded SQLite, the demo
inventory), an agent with the SIMULATED telemetry backend (the stand-in for GPUs), its local API.

The service is stopped for 30 s (the acceptance scenario: the agent keeps running, backs off,
and registers again by itself once the service is back), so this module takes about 40 s.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from fleet.data import DEMO_INVENTORY
from fleet.lab.harness import FLEETCTL, ServeProcess, free_port
from fleet.lab.harness import wait_for as _wait_for
from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.fleet_client import FleetClient, printable
from fleet_agent.main import run
from fleet_agent.telemetry.simulated import Fault, SimulatedTelemetry

DEMO = DEMO_INVENTORY
SERVER = "fra1-r01-h100-01"  # a DGX H100: 8 GPUs in the inventory
OUTAGE_S = 30.0
HEARTBEAT_S = 0.5
AGENT_KEY = "the-agents-local-api-key-0123456789"


wait_for = partial(_wait_for, timeout=20.0)


class Service(ServeProcess):
    """`fleetctl serve` on the embedded default (SQLite in its own data dir)."""

    def __init__(self, data_dir: Path) -> None:
        settings = {"FLEET_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "FLEET_RUN_LOOPS": "false"}
        super().__init__("serve", data_dir, settings)

    def fleetctl(self, *args: str) -> str:
        done = subprocess.run(
            [str(FLEETCTL), *args], env=self.env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def events(self, token: str, kind: str) -> list[dict[str, Any]]:
        page = httpx.get(
            f"{self.url}/api/v1/events",
            params={"subject": SERVER, "kind": kind, "limit": 100},
            headers={"Authorization": f"Bearer {token}"},
        ).json()
        return list(page["results"])

    def server(self, token: str) -> dict[str, Any]:
        reply = httpx.get(
            f"{self.url}/api/v1/servers/{SERVER}", headers={"Authorization": f"Bearer {token}"}
        )
        body: dict[str, Any] = reply.json()
        return body


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    service = Service(tmp_path / "fleet")
    service.data_dir.mkdir()
    try:
        yield service
    finally:
        service.stop()


@contextmanager
def running_agent(settings: AgentSettings) -> Iterator[str]:
    """The agent (fleet_agent.main.run, as `fleetctl agent run` runs it) in a thread; its URL."""
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(settings, stop), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.listen_port}"
    try:
        wait_for("the agent's API", lambda: httpx.get(f"{url}/healthz").status_code == 200)
        yield url
    finally:
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()


def agent_settings(service: Service, token: str, **changes: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "server": SERVER,
        "token": SecretStr(token),
        "fleet_url": service.url,
        "listen_port": free_port(),
        "telemetry": "simulated",
        "sim_gpu_model": "H100",
        "sim_gpus": 8,
        "heartbeat_interval_s": HEARTBEAT_S,
        "backoff_initial_s": 0.2,
        "backoff_max_s": 2.0,
        "request_timeout_s": 2.0,
    }
    return AgentSettings(**(values | changes))


def state(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/state").json()
    return body


def test_agent_registers_heartbeats_and_survives_a_fleet_outage(service: Service) -> None:
    service.start("--import", str(DEMO))
    agent_token = service.fleetctl("token", "create", "--role", "agent", "--server", SERVER)
    viewer = service.fleetctl("token", "create", "--role", "viewer", "--name", "watch").strip()
    settings = agent_settings(service, agent_token.strip())

    with running_agent(settings) as url:
        wait_for("registration", lambda: state(url)["registered"])
        wait_for("heartbeats", lambda: state(url)["counters"]["heartbeats"] >= 2)
        seen = state(url)
        gpus = seen["snapshot"]["gpus"]
        assert len(gpus) == 8 and all(g["memory_total_mib"] == 81559 for g in gpus)
        assert seen["assessment"]["verdict"] == "healthy" and seen["ready"] is True
        metrics = httpx.get(f"{url}/metrics").text
        for gpu in range(8):
            assert f'agent_gpu_temperature_celsius{{gpu="{gpu}"' in metrics
        assert "agent_gpu_power_watts{" in metrics and "agent_registered 1.0" in metrics
        assert httpx.get(f"{url}/readyz").status_code == 200
        row = service.server(viewer)
        assert row["agent_version"] and row["agent_url"] == url
        assert row["health_verdict"] == "healthy"
        assert len(service.events(viewer, "server.agent_registered")) == 1

        service.stop()  # the fleet is gone for 30 s
        down_at = time.monotonic()
        wait_for("the agent to notice", lambda: not state(url)["registered"])
        while time.monotonic() - down_at < OUTAGE_S:
            assert httpx.get(f"{url}/healthz").status_code == 200  # it keeps running
            time.sleep(1.0)
        during = state(url)
        assert during["last_error"] and during["counters"]["heartbeat_failures"] >= 3
        snapshots_before = during["counters"]["snapshots"]

        service.start()  # same database, same port
        wait_for("re-registration", lambda: state(url)["registered"], timeout=15)
        heartbeats = state(url)["counters"]["heartbeats"]
        wait_for("heartbeats again", lambda: state(url)["counters"]["heartbeats"] > heartbeats)
        assert state(url)["counters"]["snapshots"] > snapshots_before  # GPUs read all along
        assert len(service.events(viewer, "server.agent_registered")) == 2
        assert service.server(viewer)["health_verdict"] == "healthy"


def test_an_injected_fault_reaches_readyz_state_and_the_fleet(service: Service) -> None:
    service.start("--import", str(DEMO))
    token = service.fleetctl("token", "create", "--role", "agent", "--server", SERVER).strip()
    viewer = service.fleetctl("token", "create", "--role", "viewer", "--name", "watch").strip()
    settings = agent_settings(service, token, api_key=SecretStr(AGENT_KEY))
    with running_agent(settings) as url:
        wait_for("registration", lambda: state(url)["registered"])
        fault = {"kind": "xid", "xid": 79, "gpu": 3}
        anyone = httpx.post(f"{url}/faults", json=fault)
        assert anyone.status_code == 401 and "key" in anyone.json()["detail"]
        assert state(url)["assessment"]["verdict"] == "healthy"  # nothing injected
        key = {"Authorization": f"Bearer {AGENT_KEY}"}
        injected = httpx.post(f"{url}/faults", json=fault, headers=key)
        assert injected.status_code == 200, injected.text
        wait_for("not ready", lambda: httpx.get(f"{url}/readyz").status_code == 503)
        verdict = state(url)["assessment"]
        assert (verdict["verdict"], verdict["action"]) == ("unhealthy", "reboot")
        assert any(r["code"] == "xid_79" and r["gpu"] == 3 for r in verdict["reasons"])
        wait_for("the fleet's view", lambda: service.server(viewer)["health_action"] == "reboot")
        row = service.server(viewer)
        assert row["health_verdict"] == "unhealthy" and row["state"] == "enrolled"
        assert row["health_reasons"][0]["code"] == "xid_79"
        bad = httpx.post(f"{url}/faults", json={"kind": "meteor"}, headers=key)
        assert bad.status_code == 422 and "meteor" in bad.json()["detail"]


# ---------------------------------------------------------------------------------------------
# The loop's reactions, with a scripted fleet (httpx.MockTransport)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def scripted_agent(answers: list[int | Exception]) -> tuple[Agent, list[str], Clock]:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path.rsplit("/", 1)[-1])
        answer = answers.pop(0) if answers else 200
        if isinstance(answer, Exception):
            raise answer
        body = {
            "server": "gpu-1",
            "state": "enrolled",
            "heartbeat_interval_s": 7.0,
            "expected_gpus": 2,
            "assignment": {"kind": "none"},
        }
        if answer >= 400:
            return httpx.Response(answer, json={"detail": f"no ({answer})"})
        return httpx.Response(answer, json=body)

    settings = AgentSettings(
        server="gpu-1",
        token=SecretStr("flt_x"),
        telemetry="simulated",
        backoff_initial_s=0.5,
        backoff_max_s=30.0,
    )
    client = FleetClient(
        "http://fleet.invalid", "flt_x", 1.0, transport=httpx.MockTransport(handler)
    )
    clock = Clock()
    telemetry = SimulatedTelemetry("H100", 2, clock=clock)
    agent = Agent(settings, telemetry, client, clock=clock, rng=random.Random(1))
    return agent, calls, clock


def test_registers_first_then_heartbeats_at_the_fleets_interval() -> None:
    agent, calls, clock = scripted_agent([])
    assert agent.tick() == 1.0  # the next sample; the next report is 7 s away
    assert calls == ["register"] and agent.next_report_at == clock.now + 7.0
    clock.now += 3.0
    agent.tick()
    assert calls == ["register"]  # nothing changed, not yet due
    clock.now += 4.0
    agent.tick()
    assert calls == ["register", "heartbeat"]
    assert agent.expected_gpus == 2 and agent.counters.snapshots == 3


def test_a_change_of_verdict_is_reported_at_once() -> None:
    agent, calls, clock = scripted_agent([])
    agent.tick()
    assert isinstance(agent.telemetry, SimulatedTelemetry)
    agent.telemetry.inject(Fault(kind="xid", xid=79, gpu=1))
    clock.now += 1.0
    agent.tick()
    assert calls == ["register", "heartbeat"]
    assert agent.assessment is not None and agent.assessment.verdict.value == "unhealthy"
    assert not agent.ready


def test_an_unreachable_fleet_backs_off_with_jitter_and_registers_again() -> None:
    outage = httpx.ConnectError("connection refused")
    agent, calls, clock = scripted_agent([200, outage, outage, outage, outage, 200, 200])
    agent.tick()
    waits = []
    for _ in range(4):
        clock.now = agent.next_report_at
        agent.tick()
        waits.append(agent.next_report_at - clock.now)
    assert not agent.registered
    assert all(0.5 <= w <= 30.0 for w in waits)
    assert max(waits) <= 0.5 * 2**4  # capped by the exponential, not yet by backoff_max_s
    clock.now = agent.next_report_at
    agent.tick()
    assert agent.registered and agent.next_report_at == clock.now + 7.0
    assert calls == ["register", "heartbeat", "register", "register", "register", "register"]


def test_a_refused_report_waits_long_and_keeps_reading_the_gpus() -> None:
    agent, _, clock = scripted_agent([403])
    agent.tick()
    assert 0.5 <= agent.next_report_at - clock.now <= 30.0
    assert "HTTP 403" in (agent.last_error or "")
    assert agent.counters.snapshots == 1 and not agent.registered


def test_python_m_agents_refuses_bad_settings_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    done = subprocess.run(
        [sys.executable, "-m", "fleet_agent"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "FLEET_AGENT_SERVER" in lines[0], done.stderr


def test_reports_carry_no_control_characters() -> None:
    """The fleet refuses control characters in every string (fleet/api/edge.py): a driver's
    Xid text with an ESC or NUL must not get every heartbeat refused."""
    report = {
        "reasons": [{"code": "xid", "message": "Xid 79\x1b[31m fell off\x00 the bus\x9b"}],
        "gpus": [{"uuid": "GPU-\n1"}],
        "ready": True,
        "n": 3,
    }
    assert printable(report) == {
        "reasons": [{"code": "xid", "message": "Xid 79 [31m fell off  the bus "}],
        "gpus": [{"uuid": "GPU- 1"}],
        "ready": True,
        "n": 3,
    }
