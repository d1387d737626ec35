"""Small helpers the benchmarks share (imported as scripts do: bench/ is on sys.path); the
processes, free_port and wait_for are fleet/lab/harness.py's, as for the tests and the demo."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from fleet.lab.harness import free_port, wait_for
from fleet_core.stats import quantile

__all__ = ["cpu_seconds", "free_port", "pct", "wait_until"]


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
    """Poll `probe` until it is truthy; RuntimeError if `proc` exits or `timeout` passes (a
    probe that cannot parse an answer yet counts as a no)."""

    def patient() -> Any:
        with suppress(ValueError):
            return probe()
        return None

    def exited() -> str | None:
        return None if proc.poll() is None else f"the process exited with {proc.returncode}"

    wait_for(what, patient, timeout, every=0.05, give_up=exited, error=RuntimeError)
