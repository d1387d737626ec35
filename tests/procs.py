"""Process checks for tests that watch child processes come and go (not a test module)."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress
from pathlib import Path


def alive(pid: int) -> bool:
    """Running. A zombie (killed, not yet reaped) counts as gone, and so does a process reaped
    while we read its stat file: the kernel then answers ESRCH (ProcessLookupError), not ENOENT."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to a child's process group (started with start_new_session), then SIGKILL if it
    has not ended within 10 s."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
