"""The SIMULATED GPUs' shared state: what the simulated driver (fleet_agent/telemetry/simulated.py)
and the stand-in engines running "on" its GPUs (fleet_agent/engine/standin/) tell each other.

On a real server NVML's power limit is global per GPU and every process running there obeys it,
and NVML reads the power the processes' kernels draw. Without GPUs a small directory stands in
for that (the agent puts it at <work_dir>/simulated-gpus and passes it to its engines as
FLEET_STANDIN_GPU_STATE_DIR):

    limits.json      {"limits_w": {"0": 350.0, ...}}  written by the simulated backend when the
                     agent sets a limit; read by the stand-in engines (their iterations slow down)
    gpu-<i>.json     {"at": epoch s, "power_w": ..., "busy": 0..1, "memory_used_mib": ...,
                     "capped": bool}  written by the stand-in engine that runs on GPU i, about
                     twice a second; read by the simulated backend (power, utilisation, memory)

Writes are atomic (temporary file, then rename); a reader that finds nothing, or something it
cannot parse, falls back to the defaults (no limit; idle).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "FLEET_STANDIN_GPU_STATE_DIR"
LIMITS_FILE = "limits.json"
MAX_FILE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class GpuActivity:
    """What an engine made one GPU do, averaged over the last report period."""

    at: float  # wall-clock seconds since the epoch of the report
    power_w: float
    busy: float  # fraction of the time an iteration ran
    memory_used_mib: int
    capped: bool  # the power limit slowed an iteration during the period


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read(path: Path) -> Any:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def write_limits(state_dir: Path, limits_w: Mapping[int, float]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(
        state_dir / LIMITS_FILE, {"limits_w": {str(i): w for i, w in sorted(limits_w.items())}}
    )


def read_limits(state_dir: Path) -> dict[int, float]:
    """GPU index → enforced limit (watts); GPUs absent from the file have their default."""
    data = _read(state_dir / LIMITS_FILE)
    raw = data.get("limits_w") if isinstance(data, dict) else None
    if not isinstance(raw, dict):
        return {}
    limits: dict[int, float] = {}
    for key, value in raw.items():
        watts = _finite(value)
        with contextlib.suppress(ValueError):
            if watts is not None and watts > 0:
                limits[int(key)] = watts
    return limits


def limits_mtime_ns(state_dir: Path) -> int | None:
    try:
        return (state_dir / LIMITS_FILE).stat().st_mtime_ns
    except OSError:
        return None


def write_activity(state_dir: Path, gpu: int, activity: GpuActivity) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(
        state_dir / f"gpu-{gpu}.json",
        {
            "at": activity.at,
            "power_w": round(activity.power_w, 2),
            "busy": round(activity.busy, 4),
            "memory_used_mib": activity.memory_used_mib,
            "capped": activity.capped,
        },
    )


def read_activity(state_dir: Path, gpu: int, now: float, max_age_s: float) -> GpuActivity | None:
    """GPU `gpu`'s latest report if it is at most max_age_s old (an engine that stopped
    reporting left the GPU idle), else None."""
    data = _read(state_dir / f"gpu-{gpu}.json")
    if not isinstance(data, dict):
        return None
    at, power, busy = (
        _finite(data.get("at")),
        _finite(data.get("power_w")),
        _finite(data.get("busy")),
    )
    memory = data.get("memory_used_mib")
    if at is None or power is None or busy is None or not isinstance(memory, int):
        return None
    if now - at > max_age_s:
        return None
    return GpuActivity(
        at=at,
        power_w=max(0.0, power),
        busy=min(1.0, max(0.0, busy)),
        memory_used_mib=max(0, memory),
        capped=data.get("capped") is True,
    )
