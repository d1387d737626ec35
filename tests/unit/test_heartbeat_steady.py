"""The steady key (fleet/registry/heartbeat_steady.py): equal for reports that differ only in
what they measure, different for every change the fleet acts on."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.registry.heartbeat_steady import steady_key
from fleet_core.wire import Heartbeat

PEER = "10.20.0.7"


def report(**changes: Any) -> Heartbeat:
    body: dict[str, Any] = {
        "server": "gpu-a",
        "verdict": "healthy",
        "action": "none",
        "reasons": [],
        "ready": True,
        "draining": False,
        "gpus": [
            {"index": i, "health": "healthy", "temperature_c": 40.0, "power_w": 300.0}
            for i in range(2)
        ],
        "replicas": [
            {
                "index": 0,
                "gpus": [0, 1],
                "port": 8001,
                "url": "http://10.20.0.7:8001",
                "state": "ready",
                "queued": 3,
                "ttft_p95_s": 0.2,
            }
        ],
        "cache": {
            "budget_bytes": 10**12,
            "used_bytes": 10**11,
            "free_bytes": 5 * 10**11,
            "entries": [{"key": "llama@1", "state": "ready", "bytes": 10**11}],
        },
    }
    return Heartbeat.model_validate(body | changes)


def test_measurements_leave_the_key_alone() -> None:
    base = report()
    measured = base.model_copy(deep=True)
    measured.gpus[0].temperature_c = 83.0
    measured.gpus[1].power_w = 690.0
    measured.gpus[1].uuid = "GPU-other"
    measured.replicas[0].queued = 40
    measured.replicas[0].ttft_p95_s = 1.9
    measured.replicas[0].restarts = 1
    assert measured.cache is not None
    measured.cache.free_bytes = 4 * 10**11
    assert steady_key(measured, PEER) == steady_key(base, PEER)


def _changed(path: str, value: Any) -> Heartbeat:
    changed = report().model_copy(deep=True)
    target: Any = changed
    *parents, last = path.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else getattr(target, part)
    setattr(target, last, value)
    return changed


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("verdict", "unhealthy"),
        ("action", "reboot"),
        ("ready", False),
        ("draining", True),
        ("gpus.1.health", "unhealthy"),
        ("gpus.0.lost", True),
        ("replicas.0.state", "loading"),
        ("replicas.0.url", "http://10.20.0.8:8001"),
        ("replicas.0.port", 8002),
        ("cache.used_bytes", 2 * 10**11),
        ("cache.entries.0.state", "failed"),
        ("cache.entries.0.checksum_failures", 1),
    ],
)
def test_every_change_the_fleet_acts_on_changes_the_key(path: str, value: Any) -> None:
    assert steady_key(_changed(path, value), PEER) != steady_key(report(), PEER)


def test_reasons_a_gpu_more_or_fewer_and_the_peer_change_the_key() -> None:
    reason = {
        "code": "thermal",
        "gpu": 0,
        "message": "GPU 0 at 91 C",
        "action": "none",
        "verdict": "degraded",
    }
    base = steady_key(report(), PEER)
    assert steady_key(report(reasons=[reason]), PEER) != base
    assert steady_key(report(gpus=[{"index": 0, "health": "healthy"}]), PEER) != base
    assert steady_key(report(cache=None), PEER) != base
    assert steady_key(report(), "10.20.0.9") != base
