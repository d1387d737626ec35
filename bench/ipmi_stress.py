"""Many IPMI calls at once from one process, to healthy and dead BMCs: do any hang or linger?

    .venv/bin/python bench/ipmi_stress.py [--seconds 60] [--threads 12] [--busy 2]
                                          [--wrong-password]

What the service does under a busy fleet, in one process: `--threads` callers, each picking
a target at random and a call at random (power state, sensors, on, off, cycle) on a fresh
`IpmiDriver` (2 s a call, 4 s in all, as tests/e2e/test_bmc_ipmi.py), closed after. Targets:
two `ipmi_sim` emulators (fleet/lab/ipmi_sim.py) and a UDP port nothing listens on; with
`--wrong-password` also a driver with a wrong password for the first emulator (a rotation
half done). `--busy` loops of pure Python in child processes keep the cores busy, as CI's
other tests do.

Printed: the calls made, the slowest, each healthy BMC's failures, and how many IPMI worker
threads are left 12 s after the load stopped (each a call abandoned by its caller that pyghmi
still holds) with where they wait. A healthy BMC should fail no call and no worker should be
left. Never fails on these figures; exit 1 when an emulator does not start.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.bmc.base import BmcError, BmcTarget, Timeouts  # noqa: E402
from fleet.bmc.ipmi import IpmiDriver  # noqa: E402
from fleet.lab.ipmi_sim import IpmiSim, IpmiSimError, free_udp_port  # noqa: E402
from fleet.models import BmcProtocol  # noqa: E402

TIMEOUTS = Timeouts(call=2.0, total=4.0, attempts=3, backoff=0.1)
LINGER_S = 12.0
HEALTHY = ("ok-1", "ok-2")


def busy(until: float) -> None:
    while time.monotonic() < until:
        pass


def call_of(driver: IpmiDriver, name: str) -> Callable[[], object]:
    calls: dict[str, Callable[[], object]] = {
        "state": driver.power_state,
        "sensors": driver.sensors,
        "on": driver.power_on,
        "off": lambda: driver.power_off(force=True),
        "cycle": driver.power_cycle,
    }
    return calls[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=12)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the callers")
    parser.add_argument("--wrong-password", action="store_true")
    args = parser.parse_args()

    def target(server: str, port: int, password: str) -> BmcTarget:
        return BmcTarget(
            server, BmcProtocol.IPMI, "127.0.0.1", port, "admin", password, timeouts=TIMEOUTS
        )

    first, second = IpmiSim("stress-1"), IpmiSim("stress-2")
    try:
        first.start()
        second.start()
    except IpmiSimError as exc:
        first.stop()
        print(f"ipmi_sim did not start: {exc}", file=sys.stderr)
        return 1
    stop = time.monotonic() + args.seconds
    loops = [multiprocessing.Process(target=busy, args=(stop,)) for _ in range(args.busy)]
    done: list[tuple[float, str, str, str | None]] = []
    try:
        targets = [
            target(HEALTHY[0], first.port, "stress-1"),
            target(HEALTHY[1], second.port, "stress-2"),
            target("dead", free_udp_port(), "stress-3"),
        ]
        if args.wrong_password:
            targets.append(target("wrong-password", first.port, "not-it"))

        def caller(seed: int) -> None:
            rnd = random.Random(seed)
            while time.monotonic() < stop:
                chosen = rnd.choice(targets)
                name = rnd.choice(["state", "state", "sensors", "on", "cycle", "off"])
                driver = IpmiDriver(chosen)
                began = time.monotonic()
                error: str | None = None
                try:
                    call_of(driver, name)()
                except BmcError as exc:
                    error = type(exc).__name__
                finally:
                    driver.close()
                done.append((time.monotonic() - began, chosen.server, name, error))

        for loop in loops:
            loop.start()
        callers = [threading.Thread(target=caller, args=(i,)) for i in range(args.threads)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join()
        time.sleep(LINGER_S)
        report(done, args)
    finally:
        for loop in loops:
            loop.join()
        first.stop()
        second.stop()
    return 0


def report(done: list[tuple[float, str, str, str | None]], args: argparse.Namespace) -> None:
    print(f"{len(done)} calls by {args.threads} threads in {args.seconds:g} s")
    for seconds, server, name, error in sorted(done, reverse=True)[:5]:
        print(f"  slowest: {seconds:.2f} s {server} {name} {error or 'ok'}")
    for server in HEALTHY:
        mine = [error for _, s, _, error in done if s == server]
        failed = collections.Counter(e for e in mine if e)
        print(f"{server}: {sum(failed.values())} of {len(mine)} calls failed {dict(failed)}")
    frames = sys._current_frames()
    left = [t for t in threading.enumerate() if t.name.startswith("ipmi")]
    print(f"IPMI worker threads left {LINGER_S:g} s after the load: {len(left)}")
    where: collections.Counter[str] = collections.Counter()
    for thread in left:
        frame = frames.get(thread.ident or -1)
        if frame is not None:
            stack = traceback.extract_stack(frame)[-4:]
            where[" <- ".join(f"{f.name}:{f.lineno}" for f in reversed(stack))] += 1
    for place, count in where.most_common(5):
        print(f"  {count} waiting in {place}")


if __name__ == "__main__":
    sys.exit(main())
