"""The leash: a small watchdog each engine runs under, so that an engine whose agent is gone
stops by itself instead of holding its GPUs for good.

    python -m fleet_agent.engine.leash --lease FILE --bound S [--grace G] -- ARGV...

It runs ARGV in its own process group (the supervisor starts the leash as a group leader; the
engine and its ranks stay in that group, so signalling the group reaches them all), forwards
SIGTERM and SIGINT to the engine, and while the engine runs checks the lease file: the
supervisor touches it on every poll; once its mtime is older than S seconds (the agent is
gone, not merely restarting), the engine gets SIGTERM, and the whole group SIGKILL after G
seconds. The leash exits with the engine's status (128 + signal when a signal ended it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any


def lease_age(path: str, now: float, started: float) -> float:
    """Seconds since the lease was last touched (since `started` while the file is absent)."""
    try:
        return now - os.stat(path).st_mtime
    except OSError:
        return now - started


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fleet_agent.engine.leash")
    parser.add_argument("--lease", required=True, help="the file the agent touches")
    parser.add_argument("--bound", type=float, required=True, help="seconds without a touch")
    parser.add_argument("--grace", type=float, default=30.0, help="SIGTERM to SIGKILL, seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no engine command after --")
    if args.bound <= 0 or args.grace < 0:
        parser.error("--bound must be positive and --grace not negative")
    return args


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> Any:
    """A preexec_fn: SIGTERM the child when its parent (this leash) dies, however it dies
    (Linux's PR_SET_PDEATHSIG); at once if the parent is already gone."""

    def arm() -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    started = time.time()
    # Inherits our group, stdio, env and cwd; and dies with us: a leash SIGKILLed must not
    # leave its engine running with no watchdog (the next agent would find its port taken).
    engine = subprocess.Popen(args.command, preexec_fn=_die_with_parent(os.getpid()))

    def forward(signum: int, frame: FrameType | None) -> None:
        if engine.poll() is None:
            engine.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    check_s = min(1.0, args.bound / 4)
    kill_at: float | None = None
    while engine.poll() is None:
        now = time.time()
        if kill_at is None and lease_age(args.lease, now, started) > args.bound:
            print(
                f"leash: lease {args.lease} untouched for over {args.bound:g} s (agent gone):"
                f" stopping pid {engine.pid}",
                file=sys.stderr,
                flush=True,
            )
            engine.send_signal(signal.SIGTERM)
            kill_at = now + args.grace
        elif kill_at is not None and now >= kill_at:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the engine, its ranks, and the leash
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.wait(timeout=check_s)
    code = engine.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
