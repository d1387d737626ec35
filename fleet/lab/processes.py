"""The lab's child processes: identity across pid reuse, death with the parent, process groups,
the sentinel that cleans up after a crashed lab, what they cost (from /proc), and engine ports.

Cleanup when the lab process dies without running `down()` (SIGKILL, a crash):
- agents get PR_SET_PDEATHSIG=SIGKILL (Linux; set with prctl in the child before exec);
- a tiny sentinel process (stdlib only) holds a pipe from the lab: when the pipe closes, however
  the lab ended, it SIGTERMs, then SIGKILLs every process group the lab registered with it
  (emulators, agents and whatever an agent started in its group) and removes the emulators'
  temporary directories. The emulator classes take no preexec hook, hence the sentinel.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.lab import LabError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # every emulator, agent and engine of the lab listens on loopback

_PR_SET_PDEATHSIG = 1
_prctl: Any = None
if sys.platform == "linux":  # resolved here: the child of fork() should only call it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int


# Engine ports come from below the kernel's ephemeral range (Linux: 32768-60999), so that no
# outgoing connection of another process can take one between our check and the engine's bind.
_BLOCK_RANGE = (20_000, 32_000)


def free_port_block(count: int, attempts: int = 200) -> int:
    """A base port with `count` free 127.0.0.1 TCP ports from it, outside the ephemeral range
    (a bounded random search)."""
    rng = random.Random()
    low, high = _BLOCK_RANGE
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise LabError(f"no block of {count} free ports on {HOST} in {low}-{high}")


def distinct_free_block(count: int, taken: set[int], attempts: int = 100) -> int:
    """A base of `count` ports free now and none of them in `taken`: ports handed out but maybe
    not bound yet, which free_port_block cannot see."""
    for _ in range(attempts):
        base = free_port_block(count)
        if taken.isdisjoint(range(base, base + count)):
            return base
    raise LabError(f"no block of {count} free ports on {HOST} apart from {len(taken)} handed out")


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec_fn: SIGKILL this child when the thread that forked it exits (Linux only)."""
    if _prctl is None:
        return None

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0)
        if os.getppid() != parent:  # the lab died before prctl: nobody would kill us later
            os._exit(1)

    return preexec


@dataclass(frozen=True, slots=True)
class ProcRef:
    """A process by pid AND start time (clock ticks after boot), so a reused pid never matches."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcRef | None:
        stat = _proc_stat(pid)
        return None if stat is None else cls(pid, int(stat[19]))

    def alive(self) -> bool:
        stat = _proc_stat(self.pid)
        return stat is not None and int(stat[19]) == self.start and stat[0] not in ("Z", "X")


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on: index 2 pgid, 11-14 CPU ticks, 19 start."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def child_exited(pid: int) -> bool:
    """Has child `pid` exited? Not reaped: while it is a zombie its pgid cannot be reused."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


_SENTINEL = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the lab's terminal is the lab's
groups = {}
for line in sys.stdin:  # until EOF: the lab closed the pipe, or died
    op, _, rest = line.rstrip("\n").partition(" ")
    pgid, _, path = rest.partition(" ")
    if op == "+":
        groups[int(pgid)] = path
    elif op == "-":
        groups.pop(int(pgid), None)
def alive(g):
    try:
        os.killpg(g, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
def send(sig):
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
send(signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[1])
while any(alive(g) for g in groups) and time.monotonic() < deadline:
    time.sleep(0.05)
send(signal.SIGKILL)
for path in groups.values():
    if path:
        shutil.rmtree(path, ignore_errors=True)
"""


class Sentinel:
    """The process that cleans up after the lab when the lab dies (see the module doc)."""

    def __init__(self, grace: float) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _SENTINEL, str(grace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # it must outlive the lab, and a terminal's signals
        )
        self.ref = ProcRef.of(self._proc.pid)

    def watch(self, pgid: int, cleanup_dir: Path | None = None) -> None:
        self._send(f"+ {pgid} {cleanup_dir or ''}")

    def forget(self, pgid: int) -> None:
        self._send(f"- {pgid}")

    def _send(self, line: str) -> None:
        with self._lock:
            stdin = self._proc.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(line.encode() + b"\n")
                stdin.flush()
            except BrokenPipeError:
                log.warning("lab sentinel is gone: processes may outlive a crash of the lab")

    def close(self, timeout: float) -> None:
        """Close the pipe (the sentinel stops what is still registered) and reap it."""
        with self._lock:
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                with contextlib.suppress(BrokenPipeError):
                    self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)


@dataclass(frozen=True, slots=True)
class ProcUsage:
    processes: int = 0
    cpu_s: float = 0.0  # user + system, including reaped children of these processes
    rss_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    """The lab's own cost (its process and sentinel), its emulators' and its agents'."""

    lab: ProcUsage
    emulators: ProcUsage
    agents: ProcUsage

    @property
    def total(self) -> ProcUsage:
        parts = (self.lab, self.emulators, self.agents)
        return ProcUsage(
            sum(p.processes for p in parts),
            sum(p.cpu_s for p in parts),
            sum(p.rss_bytes for p in parts),
        )


def usage_of(lab: set[int], emulators: set[int], agents: set[int]) -> Usage:
    """Sum /proc figures: `lab` by pid, emulators and agents by process group."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, list[float]] = {k: [0, 0.0, 0] for k in ("lab", "emulators", "agents")}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _proc_stat(pid)
        if stat is None:
            continue
        pgid = int(stat[2])
        kind = (
            "lab"
            if pid in lab
            else "emulators"
            if pgid in emulators
            else "agents"
            if pgid in agents
            else None
        )
        if kind is None:
            continue
        ticks = sum(int(v) for v in stat[11:15])  # utime stime cutime cstime
        totals[kind][0] += 1
        totals[kind][1] += ticks / tick
        totals[kind][2] += _rss_bytes(pid)
    parts = {k: ProcUsage(int(v[0]), float(v[1]), int(v[2])) for k, v in totals.items()}
    return Usage(parts["lab"], parts["emulators"], parts["agents"])
