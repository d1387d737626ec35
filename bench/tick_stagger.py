"""One provisioner tick that boots many servers behind slow BMCs: sequential vs staggered.

    .venv/bin/python bench/tick_stagger.py [--servers 32] [--racks 4] [--latency 1.0]
                                           [--per-rack 2] [--rack-delay 2.0,0.5]

Setup, from scratch for each scenario: a SQLite database (a file, as `fleetctl serve` keeps
it) with `--racks` racks of warm spares (`--servers` in all, racks filled in turn, power for
all), a deployment, and ONE `boot_spares` for every spare (placement moves them to `booting`);
then ONE `provision_once` tick, the one that powers them on, timed. Its BMC driver is a fake
that takes `--latency` seconds per call (as a real BMC's Redfish round trips do) and records
when each call starts and ends; the tick's own path is the real one (write-ahead commit, the
power lock, `act_on`'s observed fields and Event per server).

Scenarios:
  (1) sequential   the tick as it was before issue 21: one BMC call after another. Measured
                   through the same tick with `bmc_workers=1` and no rack spacing, which runs
                   the calls one at a time in server order, as the old loop did.
  (2) staggered    the tick's settings: `bmc_workers=32`, at most `--per-rack` power-ons per
                   rack at once, starts `--rack-delay` apart (one scenario per delay given;
                   2.0 s is the default `FLEET_POWER_ON_RACK_DELAY_S`).

Printed per scenario: the tick's wall time, power-ons sent, the most power-ons in flight at
once in any one rack and overall (from the fake's timestamps), the smallest start spacing seen
in a rack, and the floor the stagger plans (the last start in a rack + one call). Never fails
on timing; exit 1 only when the setup or a power-on fails.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from cryptography.fernet import Fernet
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet import db
from fleet.bmc.base import ActionResult, BmcInfo, PowerDriver, Sensors
from fleet.crypto import SecretBox
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import (
    BmcProtocol,
    Deployment,
    FeedSide,
    Phase,
    Pool,
    PowerFeed,
    PowerState,
    Rack,
    Server,
    Site,
)
from fleet.provisioning.boots import boot_spares
from fleet.provisioning.tick import provision_once
from fleet.settings import Settings

DEPLOYMENT = "bench-llama-8b"
ACTOR = "bench"


@dataclass(frozen=True)
class Call:
    server: str
    start: float
    end: float


class SlowBmc(PowerDriver):
    """A BMC that takes `latency` seconds per power action and records each call."""

    latency: ClassVar[float] = 1.0
    rack_of: ClassVar[dict[str, str]] = {}
    power_of: ClassVar[dict[str, PowerState]] = {}
    calls: ClassVar[list[Call]] = []
    lock = threading.Lock()

    def power_state(self) -> PowerState:
        with self.lock:
            return self.power_of.get(self.target.server, PowerState.OFF)

    def _send(self, action: str, want: PowerState) -> ActionResult:
        start = time.monotonic()
        time.sleep(self.latency)
        with self.lock:
            before = self.power_of.get(self.target.server, PowerState.OFF)
            self.power_of[self.target.server] = want
            self.calls.append(Call(self.target.server, start, time.monotonic()))
        return ActionResult(action, True, before, want)  # type: ignore[arg-type]

    def power_on(self) -> ActionResult:
        return self._send("on", PowerState.ON)

    def power_off(self, force: bool = False) -> ActionResult:
        return self._send("force_off" if force else "off", PowerState.OFF)

    def power_cycle(self) -> ActionResult:
        return self._send("cycle", PowerState.ON)

    def identify(self, on: bool = True) -> None: ...

    def info(self) -> BmcInfo:
        return BmcInfo()

    def sensors(self) -> Sensors:
        return Sensors()


@dataclass
class Figures:
    label: str
    wall_s: float
    sent: int
    errors: list[str]
    per_rack_peak: int
    overall_peak: int
    min_spacing_s: float
    floor_s: float


# ---------------------------------------------------------------------------------------------
# Setup


def seed(engine: Engine, box: SecretBox, servers: int, racks: int) -> None:
    """`racks` racks of warm 4-GPU spares, `servers` in all, and a deployment to boot them for."""
    with Session(engine) as session:
        site = Site(name="bench")
        session.add(site)
        session.flush()
        assert site.id is not None
        rows: list[Rack] = []
        for r in range(racks):
            rack = Rack(name=f"bench-r{r + 1:02d}", site_id=site.id)
            session.add(rack)
            session.flush()
            assert rack.id is not None
            for side in (FeedSide.A, FeedSide.B):  # 415 V × 63 A × √3 × 80 % ≈ 36 kW a side
                session.add(
                    PowerFeed(
                        rack_id=rack.id,
                        name=f"{side.value}1",
                        side=side,
                        volts=415.0,
                        amps=63.0,
                        phase=Phase.THREE,
                    )
                )
            rows.append(rack)
        password = box.encrypt("not-used-by-the-fake")
        for i in range(servers):
            rack = rows[i % racks]
            assert rack.id is not None
            slot = i // racks
            server = Server(
                name=f"{rack.name}-s{slot + 1:02d}",
                rack_id=rack.id,
                u_position=1 + 4 * slot,
                u_height=4,
                bmc_protocol=BmcProtocol.IPMI,
                bmc_address=f"10.0.{i // 250}.{i % 250 + 1}",  # never reached: the fake answers
                bmc_port=623,
                bmc_username="root",
                bmc_password_encrypted=password,
                gpu_model="L40S",
                gpu_count=4,
                gpu_memory_mib=46068,
                idle_w=900.0,
                standby_w=60.0,
                max_w=2500.0,
                pool=Pool.WARM,
            )
            lifecycle.enroll(session, server, ACTOR, "bench setup")
            session.flush()
            lifecycle.transition(session, server, ServerState.WARM, ACTOR, "bench setup")
            SlowBmc.rack_of[server.name] = rack.name
        session.add(
            Deployment(
                name=DEPLOYMENT,
                model_uri="s3://models/llama-3.1-8b",
                model_checksum="sha256:bench",
                engine_params={"backend": "pytorch"},
                gpus_per_replica=4,
                gpu_models=["L40S"],
                max_replicas=servers,
                sla_p95_latency_ms=2000,
                sla_ttft_ms=300,
                disruption_budget=1,
            )
        )
        session.commit()
    booted = boot_spares(engine, DEPLOYMENT, servers, ACTOR, raise_target=True)
    if len(booted.booted) != servers:
        raise RuntimeError(f"placement booted {len(booted.booted)} of {servers}: {booted.reasons}")


# ---------------------------------------------------------------------------------------------
# Measurement


def peak(calls: Iterable[Call]) -> int:
    """The most calls in flight at once (an end before a start at the same instant)."""
    edges = sorted(itertools.chain.from_iterable(((c.start, 1), (c.end, -1)) for c in calls))
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def planned(n: int, limit: int, delay: float, latency: float) -> float:
    """When the stagger lets the last of a rack's `n` power-ons end: each start at least
    `delay` after the previous one and only once one of the rack's `limit` places is free."""
    starts: list[float] = []
    for i in range(n):
        begin = starts[-1] + delay if starts else 0.0
        if i >= limit:
            begin = max(begin, starts[i - limit] + latency)
        starts.append(begin)
    return starts[-1] + latency if starts else 0.0


def scenario(label: str, settings: Settings, args: argparse.Namespace) -> Figures:
    SlowBmc.latency, SlowBmc.rack_of, SlowBmc.power_of, SlowBmc.calls = args.latency, {}, {}, []
    box = SecretBox(Fernet.generate_key())
    with tempfile.TemporaryDirectory(prefix="fleet-bench-tick-") as tmp:
        engine = db.make_engine(f"sqlite:///{Path(tmp) / 'fleet.db'}")
        try:
            db.upgrade(engine)
            seed(engine, box, args.servers, args.racks)
            print(f"running {label} …", flush=True)
            start = time.monotonic()
            report = provision_once(engine, box, settings, drivers=SlowBmc)
            wall = time.monotonic() - start
        finally:
            engine.dispose()
    calls = sorted(SlowBmc.calls, key=lambda c: (SlowBmc.rack_of[c.server], c.start))
    by_rack = [
        list(g) for _, g in itertools.groupby(calls, key=lambda c: SlowBmc.rack_of[c.server])
    ]
    spacing = [b.start - a.start for rack in by_rack for a, b in itertools.pairwise(rack)]
    largest = max((len(rack) for rack in by_rack), default=0)
    if settings.bmc_workers == 1:
        floor = len(calls) * args.latency  # one call after another
    else:
        floor = planned(
            largest, settings.power_on_per_rack, settings.power_on_rack_delay_s, args.latency
        )
    print(f"  done in {wall:.1f} s", flush=True)
    return Figures(
        label,
        wall,
        len(report.power_actions),
        report.errors,
        max((peak(rack) for rack in by_rack), default=0),
        peak(calls),
        min(spacing, default=float("nan")),
        floor,
    )


def report(results: list[Figures], args: argparse.Namespace) -> None:
    print()
    print(
        f"{args.servers} boots in {args.racks} racks, {args.latency:g} s per BMC call, "
        "one provision_once tick on SQLite"
    )
    print(
        f"{'scenario':<36}{'wall':>8}{'floor':>8}{'sent':>6}{'per-rack peak':>15}"
        f"{'overall peak':>14}{'min spacing':>13}"
    )
    for f in results:
        print(
            f"{f.label:<36}{f.wall_s:>7.1f}s{f.floor_s:>7.1f}s{f.sent:>6}{f.per_rack_peak:>15}"
            f"{f.overall_peak:>14}{f.min_spacing_s:>12.2f}s"
        )
        for line in f.errors[:5]:
            print(f"  ! {line}")
    sequential = results[0]
    print()
    for f in results[1:]:
        print(f"  sequential / {f.label.strip():<30} {sequential.wall_s / f.wall_s:6.1f}×")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--servers", type=int, default=32)
    parser.add_argument("--racks", type=int, default=4)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds per BMC call")
    parser.add_argument("--per-rack", type=int, default=2, help="FLEET_POWER_ON_PER_RACK")
    parser.add_argument(
        "--rack-delay",
        default="2.0,0.5",
        help="FLEET_POWER_ON_RACK_DELAY_S values, comma-separated: one scenario each",
    )
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.rack_delay.split(",") if d]

    scenarios = [
        (
            "(1) sequential (the old tick)",
            Settings(bmc_workers=1, power_on_per_rack=args.per_rack, power_on_rack_delay_s=0.0),
        ),
        *(
            (
                f"(2) staggered ({args.per_rack}/rack, {d:g} s)",
                Settings(bmc_workers=32, power_on_per_rack=args.per_rack, power_on_rack_delay_s=d),
            )
            for d in delays
        ),
    ]
    results: list[Figures] = []
    for label, settings in scenarios:
        try:
            figures = scenario(label, settings, args)
        except Exception as exc:
            print(f"setup failed: {exc}", file=sys.stderr)
            return 1
        results.append(figures)
    report(results, args)
    failed = [f for f in results if f.sent != args.servers]
    if failed:
        print(f"power-ons missing in {', '.join(f.label for f in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
