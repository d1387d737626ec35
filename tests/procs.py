"""Process checks for tests that watch child processes come and go (not a test module). The
fleet's own children (`fleetctl serve`, `fleetctl router run`) are fleet/lab/harness.py's, which
also stops them."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running. A zombie (killed, not yet reaped) counts as gone, and so does a process reaped
    while we read its stat file: the kernel then answers ESRCH (ProcessLookupError), not ENOENT."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}
