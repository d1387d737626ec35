"""The agent applies the fleet's GPU power limit (Reply.gpu_power_limit_w): once per change,
through its telemetry backend, and reports the enforced limit in every heartbeat.

Real Agent ticks against a scripted fleet (httpx.MockTransport) and the simulated GPUs behind
a recording wrapper; the clock is the test's, so nothing sleeps."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.fleet_client import FleetClient
from fleet_agent.telemetry import PowerLimitFailed, PowerLimitUnsupported
from fleet_agent.telemetry.simulated import SimulatedTelemetry
from fleet_core.telemetry import Snapshot


class Fleet:
    """Answers every report with the current limit; keeps the heartbeats."""

    def __init__(self) -> None:
        self.limit: float | None = None
        self.heartbeats: list[dict[str, Any]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/heartbeat"):
            self.heartbeats.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "server": "gpu-1",
                "heartbeat_interval_s": 5.0,
                "assignment": {"kind": "none"},
                "gpu_power_limit_w": self.limit,
            },
        )


class Gpus:
    """The simulated H100s, recording every set_power_limit; `fail` makes the next calls raise."""

    name = "nvml"

    def __init__(self) -> None:
        self.inner = SimulatedTelemetry("H100", 4, seed=7)
        self.calls: list[float | None] = []
        self.fail: Exception | None = None

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def close(self) -> None:
        self.inner.close()

    def set_power_limit(self, watts: float | None) -> dict[int, float]:
        self.calls.append(watts)
        if self.fail is not None:
            raise self.fail
        return self.inner.set_power_limit(watts)


class ReadOnlyGpus:
    """A backend with no way to set a limit at all."""

    name = "readonly"

    def __init__(self) -> None:
        self.inner = SimulatedTelemetry("H100", 2, seed=7)

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def close(self) -> None:
        self.inner.close()


class Rig:
    def __init__(self, telemetry: Any) -> None:
        self.fleet = Fleet()
        self.now = 1_750_000_000.0
        client = FleetClient(
            "http://fleet.test", "flt_x", 1.0, transport=httpx.MockTransport(self.fleet.handler)
        )
        settings = AgentSettings(server="gpu-1", token=SecretStr("flt_x"))
        self.agent = Agent(settings, telemetry, client, clock=lambda: self.now)

    def report(self, limit: float | None) -> None:
        """One tick that reports (registration first, heartbeats after) and hears `limit`."""
        self.fleet.limit = limit
        self.now += 10.0
        self.agent.tick()

    def last_limits(self) -> list[float | None]:
        return [g["power_limit_w"] for g in self.fleet.heartbeats[-1]["gpus"]]


def test_a_changed_limit_is_applied_once_and_the_heartbeat_carries_it() -> None:
    gpus = Gpus()
    rig = Rig(gpus)
    rig.report(None)  # registration: the first reply restores the default (no stale cap)
    assert gpus.calls == [None]
    rig.report(350.0)
    assert gpus.calls == [None, 350.0]
    assert rig.last_limits() == [700.0] * 4  # this heartbeat's snapshot predates the reply
    for _ in range(3):
        rig.report(350.0)
    assert gpus.calls == [None, 350.0]  # unchanged: not set again
    assert rig.last_limits() == [350.0] * 4
    rig.report(500.0)
    rig.report(500.0)
    assert gpus.calls == [None, 350.0, 500.0]
    assert rig.last_limits() == [500.0] * 4
    rig.report(None)  # the valve lifted the cap: back to the boards' default
    rig.report(None)
    assert gpus.calls == [None, 350.0, 500.0, None]
    assert rig.last_limits() == [700.0] * 4
    state = rig.agent.state()["power_limit"]
    assert state == {
        "requested_w": None,
        "applied": dict.fromkeys(range(4), 700.0),
        "error": None,
        "changes": 4,
    }


def test_a_failed_set_is_tried_again_at_the_next_reply(caplog: pytest.LogCaptureFixture) -> None:
    gpus = Gpus()
    rig = Rig(gpus)
    rig.report(None)
    gpus.fail = PowerLimitFailed("power limit set on GPU none; not on GPU 2: NVMLError_Timeout")
    with caplog.at_level(logging.WARNING, logger="fleet_agent.daemon"):
        rig.report(300.0)
    assert "GPU power limit 300 W not set, trying again" in caplog.text
    assert rig.agent.state()["power_limit"]["error"].endswith("NVMLError_Timeout")
    gpus.fail = None
    rig.report(300.0)
    rig.report(300.0)
    assert gpus.calls == [None, 300.0, 300.0]
    assert rig.last_limits() == [300.0] * 4
    assert rig.agent.state()["power_limit"]["error"] is None


def test_a_backend_that_cannot_set_limits_says_so_once_per_value(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpus = Gpus()
    gpus.fail = PowerLimitUnsupported("dcgm-exporter is read-only")
    rig = Rig(gpus)
    with caplog.at_level(logging.INFO, logger="fleet_agent.daemon"):
        rig.report(None)
        rig.report(400.0)
        rig.report(400.0)
        rig.report(400.0)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "GPU power limit 400 W requested by the fleet NOT applied: dcgm-exporter is read-only"
    ]
    assert gpus.calls == [None, 400.0]  # not asked again for the same value
    assert rig.agent.state()["power_limit"]["error"] == "dcgm-exporter is read-only"
    rig.report(350.0)
    assert gpus.calls == [None, 400.0, 350.0]


def test_a_backend_without_the_call_is_named(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(ReadOnlyGpus())
    with caplog.at_level(logging.INFO, logger="fleet_agent.daemon"):
        rig.report(None)  # nothing asked: no error
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        rig.report(450.0)
    assert "telemetry readonly cannot set GPU power limits" in caplog.text
    assert rig.agent.state()["power_limit"]["applied"] is None
    rig.report(450.0)
    assert rig.last_limits() == [700.0, 700.0]  # what the boards enforce, reported as is
