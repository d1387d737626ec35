"""Bulk power-on through slow BMCs: sequential vs concurrent vs concurrent-with-stagger.

    .venv/bin/python bench/power.py [--servers 100] [--latency 1.0] [--ipmi 40]
                                    [--sequential-sample 20] [--rack-delay 0.5]

Setup: one sushy-emulator (Redfish, fake driver) serving `servers - ipmi` systems and `--ipmi`
ipmi_sim processes (one BMC each), all powered off, behind fronts that add `--latency` seconds
to every BMC call, as real BMCs do (bench/latency_front.py): an HTTP proxy that sleeps before
forwarding each Redfish request, and a UDP relay per ipmi_sim that delays every datagram from
the client. Servers are in racks of 10, the two protocols interleaved.

IPMI is delayed by `--ipmi-latency` (default 0.4 s) per datagram, not `--latency`: pyghmi
resends a request unanswered after 0.5-1 s and restarts the RAKP handshake when one is late,
so with 1 s per datagram the round trip always exceeds its timer. Measured here (40 sims,
32 workers): every concurrent IPMI power-on failed with "no answer within 10 s", and with a
30 s call timeout the run wedged. A power-on is ~13 IPMI round trips (5 for the RMCP+ login,
reads, the Chassis Control, the read-back, logout), so 0.4 s each is ~5 s per action, the
same order as Redfish's 5 requests at 1 s.

Scenarios, on the same servers, each from all-off, each running `driver_for(target).power_on()`
(in a `with`, as fleet.power.actions does) for every server through `fleet.bmc.bulk.run_bulk`:
  (1) sequential    Stagger(workers=1, per_rack=None, rack_delay=0)
  (2) concurrent    Stagger(workers=32, per_rack=None, rack_delay=0)
  (3) staggered     Stagger(workers=32, per_rack=2, rack_delay=--rack-delay)
Sequential runs on a sample (`--sequential-sample`, both protocols in proportion; 0 = all) and
its wall time is extrapolated to all servers, labelled as such. Between scenarios everything
is powered off through the drivers WITHOUT the front, and the emulators are polled (bounded)
until they report off (sushy applies a Reset 1-11 s late, on a read).

Prints wall time, per-call p50/p95 (Outcome.finished - Outcome.started), failures, the ratios,
and the floor: latency x BMC calls per action, counted at the fronts. Never fails on timing;
exit 1 only when the setup fails. Every process started here is stopped on exit, error or ^C.
"""

from __future__ import annotations

import argparse
import math
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from types import FrameType

from latency_front import DelayLine, HttpFront, UdpFront  # run as a script: bench/ on sys.path

from fleet.bmc import ActionResult, BmcTarget, Timeouts, driver_for
from fleet.bmc.bulk import Job, Outcome, Stagger, run_bulk
from fleet.lab.ipmi_sim import IpmiSim, IpmiSimError
from fleet.lab.sushy import SushyEmulator, fake_systems
from fleet.models import BmcProtocol

RACK_SIZE = 10
WORKERS = 32
SETTLE_S = 30.0  # bound on waiting for the emulators to report a state
IPMI_PASSWORD = "bench-pass-1"  # ipmi_sim: at most 19 characters


@dataclass
class Server:
    name: str
    rack: str
    protocol: BmcProtocol
    slow: BmcTarget  # through the latency front
    fast: BmcTarget  # straight to the emulator
    system: str | None = None  # sushy uuid
    sim: IpmiSim | None = None


@dataclass
class Figures:
    label: str
    servers: int
    wall_s: float
    p50_s: float
    p95_s: float
    failures: list[str]
    not_off_at_start: int
    calls: dict[BmcProtocol, int]
    distinct: dict[BmcProtocol, int]
    per_protocol: dict[BmcProtocol, tuple[float, float, int]]  # p50, p95, n
    extrapolated_s: float | None = None


def percentile(samples: list[float], pct: float) -> float:
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


# ---------------------------------------------------------------------------------------------
# Setup


def start_sims(count: int, stack: ExitStack) -> list[IpmiSim]:
    """`count` ipmi_sim processes, started 8 at a time. A port taken by another process
    between picking and binding makes ipmi_sim exit: such a start is retried on a new one."""

    def start(_: int) -> IpmiSim:
        for attempt in range(3):
            sim = IpmiSim(IPMI_PASSWORD)
            stack.callback(sim.stop)
            try:
                return sim.start()
            except IpmiSimError:
                sim.stop()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(start, range(count)))


def build_servers(
    args: argparse.Namespace, stack: ExitStack
) -> tuple[list[Server], SushyEmulator, dict[BmcProtocol, list[HttpFront | UdpFront]]]:
    n_ipmi = min(args.ipmi, args.servers)
    n_redfish = args.servers - n_ipmi
    timeouts = Timeouts(call=args.call_timeout, total=max(30.0, 3 * args.call_timeout))

    t0 = time.monotonic()
    sushy = SushyEmulator(fake_systems(max(1, n_redfish), prefix="bench"))
    stack.callback(sushy.stop)
    sushy.start()
    sims = start_sims(n_ipmi, stack)
    setup_s = time.monotonic() - t0

    line = DelayLine()
    stack.callback(line.close)
    http_front = HttpFront(sushy.port, args.latency)
    stack.callback(http_front.close)
    udp_fronts = []
    for sim in sims:
        front = UdpFront(sim.port, args.ipmi_latency, line)
        stack.callback(front.close)
        udp_fronts.append(front)
    print(
        f"setup: sushy-emulator with {n_redfish} systems + {n_ipmi} ipmi_sim processes "
        f"started in {setup_s:.1f} s; fronts add {args.latency:g} s per Redfish request, "
        f"{args.ipmi_latency:g} s per IPMI datagram",
        flush=True,
    )

    # Interleave the protocols so every rack holds both, in proportion.
    order: list[BmcProtocol] = []
    r = i = 0
    for k in range(args.servers):
        want_ipmi = (i + 1) * args.servers <= (k + 1) * n_ipmi if n_ipmi else False
        if want_ipmi and i < n_ipmi:
            order.append(BmcProtocol.IPMI)
            i += 1
        elif r < n_redfish:
            order.append(BmcProtocol.REDFISH)
            r += 1
        else:
            order.append(BmcProtocol.IPMI)
            i += 1

    servers: list[Server] = []
    r = i = 0
    for k, protocol in enumerate(order):
        name = f"bench-{k:03d}"
        rack = f"rack-{k // RACK_SIZE:02d}"
        if protocol is BmcProtocol.REDFISH:
            system = sushy.systems[r]
            r += 1

            def redfish(port: int, name: str = name, system: str = system) -> BmcTarget:
                return BmcTarget(
                    server=name,
                    protocol=BmcProtocol.REDFISH,
                    address=f"http://127.0.0.1:{port}",
                    port=port,
                    username=sushy.username,
                    password=sushy.password,
                    system_id=system,
                    timeouts=timeouts,
                )

            servers.append(
                Server(name, rack, protocol, redfish(http_front.port), redfish(sushy.port), system)
            )
        else:
            sim, front = sims[i], udp_fronts[i]
            i += 1
            slow = BmcTarget(
                server=name,
                protocol=BmcProtocol.IPMI,
                address="127.0.0.1",
                port=front.port,
                username=sim.username,
                password=sim.password,
                timeouts=timeouts,
            )
            servers.append(Server(name, rack, protocol, slow, sim.bmc_target(name), sim=sim))
    fronts: dict[BmcProtocol, list[HttpFront | UdpFront]] = {
        BmcProtocol.REDFISH: [http_front],
        BmcProtocol.IPMI: list(udp_fronts),
    }
    return servers, sushy, fronts


# ---------------------------------------------------------------------------------------------
# Emulator state, read directly (no front)


def is_on(server: Server, sushy: SushyEmulator) -> bool:
    if server.sim is not None:
        return server.sim.chassis_power()
    assert server.system is not None
    return sushy.read_power_state(server.system) == "On"


def wait_for(servers: list[Server], sushy: SushyEmulator, on: bool, bound: float) -> list[Server]:
    """Poll until every server reports `on`; the ones that did not within `bound` seconds."""
    deadline = time.monotonic() + bound
    pending = list(servers)
    while pending:
        pending = [s for s in pending if is_on(s, sushy) != on]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return pending


def all_off(
    servers: list[Server], sushy: SushyEmulator, powered: list[Server] | None = None
) -> int:
    """Power everything off straight through the drivers (no front); the count left on.
    `powered`: servers just powered on, whose Reset may still be pending in sushy."""
    # A Reset On still pending in sushy would land after our Off: wait for the ons first.
    redfish = [s for s in powered or [] if s.protocol is BmcProtocol.REDFISH]
    wait_for(redfish, sushy, True, 15.0)
    left = list(servers)
    for _ in range(3):
        left = [s for s in left if is_on(s, sushy)]
        if not left:
            break
        jobs = [Job(s.name, s.rack, _call(s.fast, off=True)) for s in left]
        run_bulk(jobs, Stagger(workers=WORKERS, per_rack=None, rack_delay=0.0))
        left = wait_for(left, sushy, False, SETTLE_S)
    return len(left)


def _call(target: BmcTarget, *, off: bool = False) -> Callable[[], ActionResult]:
    def call() -> ActionResult:
        with driver_for(target) as driver:
            return driver.power_off(force=True) if off else driver.power_on()

    return call


# ---------------------------------------------------------------------------------------------
# Scenarios


def scenario(
    label: str,
    servers: list[Server],
    stagger: Stagger,
    sushy: SushyEmulator,
    fronts: dict[BmcProtocol, list[HttpFront | UdpFront]],
) -> Figures:
    not_off = sum(is_on(s, sushy) for s in servers)
    before = {p: sum(f.count.value for f in fs) for p, fs in fronts.items()}
    before_distinct = {p: sum(f.distinct.value for f in fs) for p, fs in fronts.items()}
    print(f"running {label} ({len(servers)} servers) …", flush=True)
    jobs = [Job(s.name, s.rack, _call(s.slow)) for s in servers]
    start = time.monotonic()
    outcomes: list[Outcome[ActionResult]] = run_bulk(jobs, stagger)
    wall = time.monotonic() - start
    calls = {p: sum(f.count.value for f in fs) - before[p] for p, fs in fronts.items()}
    distinct = {
        p: sum(f.distinct.value for f in fs) - before_distinct[p] for p, fs in fronts.items()
    }
    by_name = {s.name: s for s in servers}
    durations = [o.finished - o.started for o in outcomes]
    per_protocol = {}
    for protocol in (BmcProtocol.REDFISH, BmcProtocol.IPMI):
        d = [o.finished - o.started for o in outcomes if by_name[o.server].protocol is protocol]
        if d:
            per_protocol[protocol] = (statistics.median(d), percentile(d, 95), len(d))
    failures = [str(o.error) for o in outcomes if o.error is not None]
    print(f"  done in {wall:.1f} s, {len(failures)} failed", flush=True)
    failures += [
        f"{o.server}: no Reset sent (was {o.value.state_before.value})"
        for o in outcomes
        if o.value is not None and not o.value.sent
    ]
    return Figures(
        label,
        len(servers),
        wall,
        statistics.median(durations),
        percentile(durations, 95),
        failures,
        not_off,
        calls,
        distinct,
        per_protocol,
    )


def sample(servers: list[Server], size: int) -> list[Server]:
    """`size` servers, both protocols in proportion."""
    if size <= 0 or size >= len(servers):
        return servers
    ipmi = [s for s in servers if s.protocol is BmcProtocol.IPMI]
    redfish = [s for s in servers if s.protocol is BmcProtocol.REDFISH]
    n_ipmi = round(size * len(ipmi) / len(servers))
    return redfish[: size - n_ipmi] + ipmi[:n_ipmi]


# ---------------------------------------------------------------------------------------------
# Output


def report(
    results: list[Figures], servers: list[Server], latency: float, ipmi_latency: float
) -> None:
    total = len(servers)
    print()
    print(
        f"{'scenario':<34}{'servers':>8}{'wall':>10}{'p50':>8}{'p95':>8}"
        f"{'  redfish p50/p95':>18}{'  ipmi p50/p95':>16}{'fail':>6}"
    )
    for f in results:
        cells = []
        for protocol in (BmcProtocol.REDFISH, BmcProtocol.IPMI):
            p = f.per_protocol.get(protocol)
            cells.append("-" if p is None else f"{p[0]:.2f}/{p[1]:.2f}")
        print(
            f"{f.label:<34}{f.servers:>8}{f.wall_s:>9.1f}s{f.p50_s:>7.2f}s{f.p95_s:>7.2f}s"
            f"{cells[0]:>18}{cells[1]:>16}{len(f.failures):>6}"
        )
        if f.extrapolated_s is not None:
            print(f"{'  extrapolated to ' + str(total) + ' servers':<42}{f.extrapolated_s:>9.1f}s")
        if f.not_off_at_start:
            print(f"  ! {f.not_off_at_start} servers were not off at the start")
        for line in f.failures[:5]:
            print(f"  ! {line}")
        if len(f.failures) > 5:
            print(f"  ! … {len(f.failures) - 5} more")

    seq, conc, stag = results
    seq_wall = seq.extrapolated_s or seq.wall_s
    label = " (sequential extrapolated)" if seq.extrapolated_s is not None else ""
    print()
    print(f"ratios{label}:")
    print(f"  sequential / concurrent  {seq_wall / conc.wall_s:6.1f}×")
    print(f"  sequential / staggered   {seq_wall / stag.wall_s:6.1f}×")
    print(f"  staggered / concurrent   {stag.wall_s / conc.wall_s:6.2f}×")

    print()
    print("floor (front delay × BMC calls per power_on, counted at the fronts, sequential run):")
    floors: dict[BmcProtocol, float] = {}
    for protocol, unit in ((BmcProtocol.REDFISH, "requests"), (BmcProtocol.IPMI, "datagrams")):
        n = seq.per_protocol.get(protocol, (0.0, 0.0, 0))[2]
        if not n:
            continue
        per = seq.distinct[protocol] / n
        resent = (seq.calls[protocol] - seq.distinct[protocol]) / n
        p50 = seq.per_protocol[protocol][0]
        delay = ipmi_latency if protocol is BmcProtocol.IPMI else latency
        floors[protocol] = per * delay
        extra = f" (+{resent:.1f} retransmits)" if resent else ""
        print(
            f"  {protocol.value:<8} {per:4.1f} {unit}{extra} per action → floor"
            f" {per * delay:5.2f} s; measured p50 {p50:.2f} s"
            f" (overhead {p50 - per * delay:+.2f} s)"
        )
    work = sum(floors.get(s.protocol, 0.0) for s in servers)
    ideal = max(max(floors.values(), default=0.0), work / WORKERS)
    print(
        f"  concurrent floor for {total} servers at {WORKERS} workers ≈ {ideal:.1f} s "
        "(max of the slowest action and the sum of all floors / workers)"
    )


# ---------------------------------------------------------------------------------------------


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: every emulator and front stops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--servers", type=int, default=100)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds added per BMC call")
    parser.add_argument("--ipmi", type=int, default=40, help="how many servers speak IPMI")
    parser.add_argument("--sequential-sample", type=int, default=20, help="0: all servers")
    parser.add_argument("--rack-delay", type=float, default=0.5)
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=10.0,
        help="Timeouts.call for every BMC call (10 s: the driver default)",
    )
    parser.add_argument(
        "--ipmi-latency",
        type=float,
        default=0.4,
        help="seconds added per IPMI datagram (see the module docstring for why not --latency)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)

    with ExitStack() as stack:
        try:
            servers, sushy, fronts = build_servers(args, stack)
            left = all_off(servers, sushy)
        except Exception:
            traceback.print_exc()
            print("setup failed", file=sys.stderr)
            return 1
        if left:
            print(f"setup: {left} servers would not power off", file=sys.stderr)
            return 1

        results: list[Figures] = []
        seq_servers = sample(servers, args.sequential_sample)
        seq = scenario(
            "(1) sequential" + (" [sample]" if len(seq_servers) < len(servers) else ""),
            seq_servers,
            Stagger(workers=1, per_rack=None, rack_delay=0.0),
            sushy,
            fronts,
        )
        if len(seq_servers) < len(servers):
            seq.extrapolated_s = seq.wall_s * len(servers) / len(seq_servers)
        results.append(seq)
        powered = seq_servers
        for label, stagger in (
            ("(2) concurrent", Stagger(workers=WORKERS, per_rack=None, rack_delay=0.0)),
            (
                f"(3) staggered (2/rack, {args.rack_delay:g} s)",
                Stagger(workers=WORKERS, per_rack=2, rack_delay=args.rack_delay),
            ),
        ):
            reset_s = time.monotonic()
            left = all_off(servers, sushy, powered)
            print(
                f"  all off again in {time.monotonic() - reset_s:.1f} s"
                + (f" ({left} still on)" if left else ""),
                flush=True,
            )
            results.append(scenario(label, servers, stagger, sushy, fronts))
            powered = servers
        all_off(servers, sushy, powered)
        report(results, servers, args.latency, args.ipmi_latency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
