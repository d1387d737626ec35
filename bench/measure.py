"""Small helpers the benchmarks share (imported as scripts do: bench/ is on sys.path)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from fleet_core.stats import quantile


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its own, not its children's); 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile as the fleet reports it (fleet_core/stats.py); NaN when there is nothing."""
    value = quantile(values, q)
    return float("nan") if value is None else value


def wait_until(
    what: str, probe: Callable[[], Any], proc: subprocess.Popen[bytes], timeout: float
) -> None:
    """Poll `probe` until it is truthy; RuntimeError if `proc` exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        with suppress(OSError, ValueError):
            if probe():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready within {timeout:g} s")
        time.sleep(0.05)
