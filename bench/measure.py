"""Small helpers the benchmarks share (imported as scripts do: bench/ is on sys.path)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path


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
    """The q-quantile by nearest rank (index ⌊q·n⌋); NaN when there is nothing."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
