"""Fleet's own overhead from `spares boot` to serving, in the virtual colo: 1, 8, 32 servers.

    .venv/bin/python bench/provision.py [--sizes 1,8,32] [--db sqlite|postgres]
                                        [--boot-delay 1.0] [--load 1.0]
                                        [--provision-interval S] [--heartbeat-interval S]

For each size, from scratch: a lab of that many 4-GPU L40S spares behind ipmi_sim BMC
emulators (IPMI applies a power-on at once; sushy's 1-11 s Redfish delay would only add noise
that is not Fleet's), in racks of 8 with power for all; a real `fleetctl serve` with its
control loops on a fresh database (`--db sqlite`: the embedded default; `postgres`: a
throwaway database on 127.0.0.1:5432); a deployment of 4-GPU replicas (one per server, so one
stand-in engine per agent); then ONE `POST /api/v1/spares/boot` for every server, and the
wall time until all of them serve.

The lab's share of that time is fixed: its boot delay (power-on → the agent starts) plus the
stand-in engines' load time (FLEET_STANDIN_LOAD_S). The difference is Fleet's overhead:
placement and the boot transaction, the provisioner's ticks (the power-on waits for one, so
do booting → loading and loading → serving), the BMC calls, the agent's and engine's process
start, registration and heartbeats. The service runs with its own defaults unless
`--provision-interval` / `--heartbeat-interval` say otherwise (both printed).

Printed per size: wall time, lab delays, overhead, per-server p50/p95 of `boot_to_ready_s`
(as the fleet records it) and of each phase from the servers' Events (boot → power-on sent,
→ agent registered, → loading, → serving). Never fails on timing; exit 1 only when the setup
fails. Every process started here (service, emulators, agents, engines) is stopped on exit,
error or ^C.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml
from cryptography.fernet import Fernet

from fleet import db
from fleet.cli.lab import lab_token_maker
from fleet.lab.harness import ServeProcess, start_lab

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
RACK_SIZE = 8
DEPLOYMENT = "bench-llama-8b"
MODEL_URI = "s3://models/llama-3.1-8b"
PHASES = ("power-on sent", "agent registered", "loading", "serving")


class SetupError(RuntimeError):
    """Something the measurement needs did not come up."""


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: every process stops


# ---------------------------------------------------------------------------------------------
# Setup


def inventory(count: int) -> str:
    feeds = [  # 415 V × 63 A × √3 × 80 % ≈ 36 kW per side: 8 servers at 2.5 kW fit easily
        {"name": f"{s.lower()}1", "side": s, "volts": 415, "amps": 63, "phase": "three"}
        for s in "AB"
    ]
    racks: list[dict[str, Any]] = []
    for i in range(count):
        if i % RACK_SIZE == 0:
            racks.append({"name": f"bench-r{len(racks) + 1:02d}", "feeds": [], "servers": []})
            racks[-1]["feeds"] = [dict(f) for f in feeds]
        rack = racks[-1]
        rack["servers"].append(
            {
                "name": f"{rack['name']}-l40s-{len(rack['servers']) + 1:02d}",
                "u": 1 + 4 * len(rack["servers"]),
                "u_height": 4,
                "gpu": {"model": "L40S", "count": 4},
                "power": {"idle_w": 900, "standby_w": 60, "max_w": 2500},
                "bmc": {
                    "protocol": "ipmi",
                    "address": "10.0.0.1",  # the lab points it at its emulator
                    "port": 623,
                    "username": "root",
                    "password": "not-used-by-the-lab",
                },
            }
        )
    return yaml.safe_dump({"sites": [{"name": "bench", "racks": racks}]}, sort_keys=False)


@contextmanager
def database(kind: str, data_dir: Path) -> Iterator[tuple[dict[str, str], str]]:
    """(the service's FLEET_* database settings, the URL this process uses)."""
    if kind == "sqlite":
        yield {"FLEET_DATA_DIR": str(data_dir)}, f"sqlite:///{data_dir / 'fleet.db'}"
        return
    import secrets

    import sqlalchemy as sa

    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"fleet_bench_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = sa.make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
        engine = db.make_engine(url)
        try:
            db.upgrade(engine)
        finally:
            engine.dispose()
        settings = {
            "FLEET_DATA_DIR": str(data_dir),
            "FLEET_DATABASE_URL": url,
            "FLEET_SECRET_KEY": Fernet.generate_key().decode(),
        }
        try:
            yield settings, url
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


class Service(ServeProcess):
    """`fleetctl serve` with its loops on (at their defaults unless told), and its API as the
    admin."""

    def __init__(self, data_dir: Path, settings: dict[str, str], log: Path) -> None:
        super().__init__("serve", data_dir, settings | {"FLEET_RUN_LOOPS": "true"}, log=log)
        self.token = ""

    def start_as_admin(self) -> None:
        self.start(admin_token=True, error=SetupError)
        self.token = self.admin_token(error=SetupError)

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}", **kwargs.pop("headers", {})}
        reply = httpx.request(
            method, f"{self.url}/api/v1{path}", headers=headers, timeout=60, **kwargs
        )
        if reply.status_code >= 400:
            raise SetupError(f"{method} {path}: HTTP {reply.status_code}: {reply.text[:300]}")
        return reply.json()


# ---------------------------------------------------------------------------------------------
# One size


@dataclass
class Figures:
    servers: int
    wall_s: float | None  # None: not all served within the bound
    lab_s: float
    boot_to_ready: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def phases(service: Service, names: list[str]) -> dict[str, list[float]]:
    """Seconds from each server's warm → booting to each later step, from its Events."""
    out: dict[str, list[float]] = {p: [] for p in PHASES}
    for name in names:
        rows = service.api("GET", "/events", params={"subject": name, "limit": 100})["results"]
        steps: dict[str, datetime] = {}
        for row in sorted(rows, key=lambda r: r["id"]):
            if row["kind"] == "server.transition" and row["to_state"] == "booting":
                steps = {"boot": _at(row["at"])}  # this boot's steps only
                continue
            key = {
                ("server.power", None): "power-on sent",
                ("server.agent_registered", None): "agent registered",
                ("server.transition", "loading"): "loading",
                ("server.transition", "serving"): "serving",
            }.get((row["kind"], row["to_state"]))
            if key == "power-on sent" and row["details"].get("action") != "on":
                continue
            if key is not None and "boot" in steps:
                steps.setdefault(key, _at(row["at"]))
        if "boot" in steps:
            for phase in PHASES:
                if phase in steps:
                    out[phase].append((steps[phase] - steps["boot"]).total_seconds())
    return out


def measure(count: int, args: argparse.Namespace, workdir: Path) -> Figures:
    lab_s = args.boot_delay + args.load
    (workdir / "data").mkdir(parents=True)
    with ExitStack() as stack:
        settings, url = stack.enter_context(database(args.db, workdir / "data"))
        if args.provision_interval is not None:
            settings["FLEET_PROVISION_INTERVAL_S"] = str(args.provision_interval)
        if args.heartbeat_interval is not None:
            settings["FLEET_HEARTBEAT_INTERVAL_S"] = str(args.heartbeat_interval)
        service = Service(workdir / "data", settings, workdir / "serve.log")
        stack.callback(service.stop)
        service.start_as_admin()
        engine = db.make_engine(url)
        stack.callback(engine.dispose)
        colo = start_lab(
            service.url,
            service.token,
            inventory(count),
            workdir / "lab",
            token_for=lab_token_maker(engine),
            boot_delay_s=args.boot_delay,
            agent_env={"FLEET_STANDIN_LOAD_S": str(args.load)},
        )
        stack.callback(colo.down)  # before the service stops: agents go first
        for _ in range(10):  # a server the reconciler reads right now is busy: again
            reports = service.api("POST", "/verify", json={"select": {"state": "enrolled"}})
            if not reports["failed"]:
                break
            time.sleep(0.5)
        else:
            raise SetupError(f"verify: {reports['failed']} servers not verified")
        service.api(
            "POST",
            "/deployments",
            json={
                "name": DEPLOYMENT,
                "model_uri": MODEL_URI,
                "model_checksum": "sha256:1",
                "engine_params": {"backend": "pytorch", "tp_size": 4},
                "gpus_per_replica": 4,
                "gpu_models": ["L40S"],
                "max_replicas": count,
                "sla_p95_latency_ms": 2000,
                "sla_ttft_ms": 300,
            },
        )
        time.sleep(1.0)  # the loops' first ticks (leadership, first BMC reads) out of the way

        began = time.monotonic()
        booted = service.api(
            "POST", "/spares/boot", json={"deployment": DEPLOYMENT, "count": count}
        )["booted"]
        if len(booted) != count:
            raise SetupError(f"spares boot: {len(booted)} of {count} booted")
        bound = 120.0 + 3.0 * count
        wall: float | None = None
        note = ""
        while time.monotonic() - began < bound:
            rows = service.api("GET", "/servers", params={"limit": 1000})["results"]
            states = [r["state"] for r in rows if r["name"] in booted]
            if states.count("serving") == count:
                wall = time.monotonic() - began
                break
            if "failed" in states:
                note = f"{states.count('failed')} failed"
                break
            time.sleep(0.1)
        else:
            note = f"not all serving within {bound:g} s"
        rows = service.api("GET", "/servers", params={"limit": 1000})["results"]
        if note:  # say where the others are, and what their agents said last
            for row in rows:
                if row["name"] in booted and row["state"] != "serving":
                    log = workdir / "lab" / "servers" / row["name"] / "agent.log"
                    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
                    last = " | ".join([x for x in lines if "fleet_agent.engine" in x][-2:])
                    print(
                        f"  {row['name']}: {row['state']} {row['failed_reason'] or ''}"
                        f" replicas={[r.get('state') for r in row['replicas']]} {last}",
                        flush=True,
                    )
        ready = [float(r["boot_to_ready_s"]) for r in rows if r["boot_to_ready_s"] is not None]
        return Figures(count, wall, lab_s, ready, phases(service, booted), note)


# ---------------------------------------------------------------------------------------------
# Report


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(results: list[Figures], args: argparse.Namespace) -> None:
    print()
    print(
        f"spares boot → serving, virtual colo (IPMI, 4-GPU L40S, 1 stand-in engine per server), "
        f"database: {'embedded SQLite' if args.db == 'sqlite' else 'Postgres'}"
    )
    tick = f"{args.provision_interval:g}" if args.provision_interval else "5 (default)"
    beat = f"{args.heartbeat_interval:g}" if args.heartbeat_interval else "5 (default)"
    print(
        f"lab: boot delay {args.boot_delay:g} s + engine load {args.load:g} s; service: "
        f"provision interval {tick} s, heartbeat interval {beat} s"
    )
    header = (
        f"{'servers':>7} | {'wall s':>6} | {'lab s':>5} | {'Fleet s':>7} | "
        f"{'boot→ready p50':>14} | {'p95':>5}"
    )
    print(header)
    print("-" * len(header))
    for f in results:
        overhead = None if f.wall_s is None else f.wall_s - f.lab_s
        print(
            f"{f.servers:>7} | {_s(f.wall_s):>6} | {f.lab_s:>5.1f} | {_s(overhead):>7} | "
            f"{_s(_quantile(f.boot_to_ready, 0.5)):>14} | {_s(_quantile(f.boot_to_ready, 0.95)):>5}"
            + (f"   ({f.note})" if f.note else "")
        )
    print()
    print("per server, seconds from warm → booting (the `spares boot` call) to each step, p50/p95:")
    header = f"{'servers':>7} | " + " | ".join(f"{p:>16}" for p in PHASES)
    print(header)
    print("-" * len(header))
    for f in results:
        cells = []
        for phase in PHASES:
            values = f.phases.get(phase, [])
            p50, p95 = _quantile(values, 0.5), _quantile(values, 0.95)
            cells.append(f"{_s(p50) + ' / ' + _s(p95):>16}")
        print(f"{f.servers:>7} | " + " | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1,8,32", help="comma-separated server counts")
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--boot-delay", type=float, default=1.0, help="lab: power-on → agent")
    parser.add_argument("--load", type=float, default=1.0, help="stand-in engine load, s")
    parser.add_argument("--provision-interval", type=float, default=None)
    parser.add_argument("--heartbeat-interval", type=float, default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    signal.signal(signal.SIGTERM, _terminate)

    results: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-provision-") as tmp:
        for count in sizes:
            print(f"{count} server(s)…", flush=True)
            try:
                results.append(measure(count, args, Path(tmp) / f"n{count}"))
            except Exception:
                traceback.print_exc()
                print(f"setup failed ({count} servers)", file=sys.stderr)
                return 1
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
