"""Inventory at fleet scale: parse, import, re-import and the server list query, timed.

    .venv/bin/python bench/inventory.py [--servers 10000] [--database-url URL] [--queries 200]

The target is Postgres (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres): the run
creates a throwaway database `fleet_bench_<pid>` on that server and drops it at the end, also on
error or Ctrl-C. A SQLite file in a temporary directory runs the same steps as a baseline
(`--no-sqlite` skips it). A sqlite:/// URL as --database-url is used as it is (the file must not
exist yet).

Steps, per backend, on a freshly migrated database (fleet.db.upgrade):
  (a) parse + validate the generated YAML with fleet.inventory.parse_inventory (backend-free:
      measured once);
  (b) import it (fleet.inventory.import_inventory) in one transaction;
  (c) import it again: nothing changes, so it should be faster;
  (d) the server list query (Server ⋈ Rack ⋈ Site, filtered, ORDER BY name LIMIT 100 OFFSET k,
      plus a count) `--queries` times per filter, each in its own session as an API request
      would; p50 / p95 in ms.
Before (d), fleet.lifecycle.transitions moves the warm-pool servers to `warm` and about 2 % of the
fleet to
`maintenance`, so a state filter selects something other than everything, and ANALYZE gives
the planner the statistics autovacuum would have gathered by then. Each filter also runs
`--queries` / 4 times at offset 0: deep OFFSET pages cost more than the first.

This prints figures and never fails on timing (exit 1 only when a backend could not run).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa
import yaml
from cryptography.fernet import Fernet
from gen_inventory import generate, to_yaml  # run as a script: bench/ is on sys.path
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session

from fleet.crypto import SecretBox
from fleet.db import make_engine, session_scope, upgrade
from fleet.inventory import InventoryFile, import_inventory, parse_inventory
from fleet.inventory.servers import ServerFilter, list_servers
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Pool

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
PAGE_SIZE = 100
MAINTENANCE_SHARE = 0.02
ACTOR = "bench"


# ---------------------------------------------------------------------------------------------
# The query under test


def label(flt: ServerFilter) -> str:
    parts = [f"{k}={v}" for k, v in dataclasses.asdict(flt).items() if v is not None]
    return ", ".join(parts) or "(no filter)"


def list_page(session: Session, flt: ServerFilter, *, offset: int = 0) -> int:
    """What `GET /api/v1/servers` runs: the count and one page, as API models."""
    total, rows = list_servers(session, flt, PAGE_SIZE, offset)
    assert len(rows) <= PAGE_SIZE
    return total


def pick_filters(doc: dict[str, Any]) -> list[ServerFilter]:
    """Filters over values the generated inventory really has (from the middle of it)."""
    sites = doc["sites"]
    if not sites:
        return [ServerFilter()]
    site = sites[len(sites) // 2]
    rack = site["racks"][len(site["racks"]) // 2]
    return [
        ServerFilter(),
        ServerFilter(site=site["name"]),
        ServerFilter(rack=rack["name"]),
        ServerFilter(pool=Pool.WARM),
        ServerFilter(state=ServerState.MAINTENANCE),
        ServerFilter(gpu_model="H200"),
        ServerFilter(site=site["name"], pool=Pool.WARM, gpu_model="H100"),
    ]


# ---------------------------------------------------------------------------------------------
# Figures


@dataclass
class QueryFigures:
    matches: int
    p50_ms: float  # random pages
    p95_ms: float
    first_page_p50_ms: float  # offset 0


@dataclass
class BackendFigures:
    backend: str
    error: str | None = None
    import_s: float | None = None
    created: dict[str, int] = field(default_factory=dict)
    warnings: int = 0
    reimport_s: float | None = None
    reimport_changes: int | None = None
    transitions: int = 0
    transitions_s: float | None = None
    queries: dict[str, QueryFigures] = field(default_factory=dict)


def percentile(samples: list[float], pct: float) -> float:
    ordered = sorted(samples)
    rank = max(0, math.ceil(pct / 100 * len(ordered)) - 1)
    return ordered[rank]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ---------------------------------------------------------------------------------------------
# Throwaway databases


def _render(url: sa.URL) -> str:
    return url.render_as_string(hide_password=False)


def _normalise(url: str) -> sa.URL:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        # SQLAlchemy would pick psycopg2, which this project does not ship.
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


@contextmanager
def throwaway_postgres(server_url: sa.URL) -> Iterator[str]:
    """A new database `fleet_bench_<pid>` on the server of `server_url`, dropped afterwards."""
    name = f"fleet_bench_{os.getpid()}"
    admin = make_engine(
        _render(server_url), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield _render(server_url.set(database=name))
        finally:
            with admin.connect() as conn:
                # FORCE (Postgres 13+): a connection a failed step left open cannot block it.
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextmanager
def throwaway_sqlite() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as directory:
        yield f"sqlite:///{Path(directory) / 'fleet.db'}"


@contextmanager
def given_sqlite(url: sa.URL) -> Iterator[str]:
    path = url.database
    if path and path != ":memory:" and Path(path).exists():
        raise SystemExit(f"{path} exists: the benchmark only writes to a new SQLite file")
    yield _render(url)


# ---------------------------------------------------------------------------------------------
# The steps


def move_states(engine: Engine, doc: dict[str, Any], seed: int) -> int:
    """Warm pool → `warm`, ~2 % → `maintenance`, through fleet.lifecycle.transitions (one
    transaction)."""
    rng = random.Random(seed)
    moves = 0
    with session_scope(engine) as session:
        for site in doc["sites"]:
            for rack in site["racks"]:
                for srv in rack["servers"]:
                    if rng.random() < MAINTENANCE_SHARE:
                        to = ServerState.MAINTENANCE
                    elif srv["pool"] == Pool.WARM.value:
                        to = ServerState.WARM
                    else:
                        continue
                    lifecycle.transition(session, srv["name"], to, ACTOR, "bench", commit=False)
                    moves += 1
    return moves


def run_queries(
    engine: Engine, filters: list[ServerFilter], queries: int, seed: int
) -> dict[str, QueryFigures]:
    rng = random.Random(seed)
    out: dict[str, QueryFigures] = {}
    for flt in filters:
        with Session(engine) as session:  # warm-up, and the number of matches for the offsets
            matches = list_page(session, flt)
        pages = max(1, math.ceil(matches / PAGE_SIZE))
        samples: list[float] = []
        first: list[float] = []
        for i in range(queries + max(1, queries // 4)):
            offset = rng.randrange(pages) * PAGE_SIZE if i < queries else 0
            start = time.perf_counter()
            with Session(engine) as session:
                list_page(session, flt, offset=offset)
            (samples if i < queries else first).append((time.perf_counter() - start) * 1000)
        out[label(flt)] = QueryFigures(
            matches, statistics.median(samples), percentile(samples, 95), statistics.median(first)
        )
    return out


def run_backend(
    backend: str,
    url: str,
    inv: InventoryFile,
    doc: dict[str, Any],
    args: argparse.Namespace,
) -> BackendFigures:
    figures = BackendFigures(backend)
    box = SecretBox(Fernet.generate_key())
    engine = make_engine(url)
    try:
        upgrade(engine)

        def do_import() -> Any:
            with session_scope(engine) as session:
                return import_inventory(session, inv, box, actor=ACTOR)

        figures.import_s, report = timed(do_import)
        figures.created = {k: v for k, v in report.created.items() if v}
        figures.warnings = len(report.warnings)
        figures.reimport_s, again = timed(do_import)
        figures.reimport_changes = len(again.changes)
        figures.transitions_s, figures.transitions = timed(
            lambda: move_states(engine, doc, args.seed)
        )
        with engine.connect() as conn:  # as autovacuum would have by now: planner statistics
            conn.execute(sa.text("ANALYZE"))
            conn.commit()
        figures.queries = run_queries(engine, pick_filters(doc), args.queries, args.seed)
    finally:
        engine.dispose()
    return figures


# ---------------------------------------------------------------------------------------------
# Output


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def print_table(results: list[BackendFigures]) -> None:
    names = [r.backend for r in results]
    width = 50

    def row(label: str, cells: list[str]) -> None:
        print(f"{label:<{width}}" + "".join(f"{c:>22}" for c in cells))

    print()
    row("step", names)
    row(
        "(b) import, one transaction",
        [_s(r.import_s) for r in results],
    )
    row(
        "    created servers / feeds / racks",
        [" / ".join(str(r.created.get(k, 0)) for k in ("server", "feed", "rack")) for r in results],
    )
    row("    oversubscription warnings", [str(r.warnings) for r in results])
    row("(c) re-import, no changes", [_s(r.reimport_s) for r in results])
    row(
        "    changes reported (expect 0)",
        ["-" if r.reimport_changes is None else str(r.reimport_changes) for r in results],
    )
    row(
        "    speed-up over import",
        [
            f"{r.import_s / r.reimport_s:.1f}×" if r.import_s and r.reimport_s else "-"
            for r in results
        ],
    )
    row(
        "setup before (d): lifecycle moves",
        [f"{r.transitions} in {_s(r.transitions_s)}" for r in results],
    )
    print()
    print(
        f"(d) list servers: count + page of {PAGE_SIZE}; ms: p50 / p95 at a random offset,"
        " [p50 of the first page]"
    )
    labels: list[str] = []
    for r in results:
        labels.extend(k for k in r.queries if k not in labels)
    for label in labels:
        cells = []
        matches = ""
        for r in results:
            q = r.queries.get(label)
            if q is None:
                cells.append("-")
                continue
            matches = str(q.matches)
            cells.append(f"{q.p50_ms:.2f} / {q.p95_ms:.2f} [{q.first_page_p50_ms:.2f}]")
        row(f"  {label:<{width - 13}}{matches:>6} hits", cells)
    for r in results:
        if r.error:
            print(f"\n{r.backend}: did not run: {r.error}")


# ---------------------------------------------------------------------------------------------


def _terminate(signum: int, _frame: FrameType | None) -> None:
    # Turn SIGTERM into SystemExit so the throwaway database is still dropped.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--servers", type=int, default=10_000)
    parser.add_argument(
        "--database-url",
        default=DEFAULT_URL,
        help="Postgres server to create the throwaway database on, or a new sqlite:/// file",
    )
    parser.add_argument("--queries", type=int, default=200, help="list queries per filter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sqlite", action="store_true", help="skip the SQLite baseline")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)

    gen_s, doc = timed(lambda: generate(args.servers, args.seed))
    dump_s, text = timed(lambda: to_yaml(doc))
    racks = sum(len(s["racks"]) for s in doc["sites"])
    gpus = sum(v["gpu"]["count"] for s in doc["sites"] for r in s["racks"] for v in r["servers"])
    print(
        f"Fleet inventory benchmark: {args.servers:,} servers, {gpus:,} GPUs, {racks:,} racks, "
        f"{len(doc['sites'])} sites (seed {args.seed}); generated in {gen_s:.2f} s, "
        f"{len(text) / 1e6:.1f} MB of YAML in {dump_s:.2f} s"
    )

    parse_s, inv = timed(lambda: parse_inventory(text))
    validate_s, _ = timed(lambda: InventoryFile.model_validate(doc))
    print(
        f"(a) parse + validate (parse_inventory): {parse_s:.2f} s "
        f"= YAML load ≈ {parse_s - validate_s:.2f} s + model validation ≈ {validate_s:.2f} s"
    )
    # Baseline: the pure-Python loader parse_inventory falls back to without libyaml.
    py_s, _ = timed(lambda: yaml.load(text, Loader=yaml.SafeLoader))
    print(f"    baseline: yaml.SafeLoader (pure Python) loads the same text in {py_s:.2f} s")

    target = _normalise(args.database_url)
    runs: list[tuple[str, Callable[[], Any]]] = []
    if target.drivername.startswith("sqlite"):
        runs.append(("sqlite (given)", lambda: given_sqlite(target)))
    else:
        runs.append(("postgres", lambda: throwaway_postgres(target)))
    if not args.no_sqlite and not target.drivername.startswith("sqlite"):
        runs.append(("sqlite (temp file)", throwaway_sqlite))

    results: list[BackendFigures] = []
    for backend, database in runs:
        print(f"running on {backend} …", flush=True)
        try:
            with database() as url:
                results.append(run_backend(backend, url, inv, doc, args))
        except (sa.exc.SQLAlchemyError, OSError) as exc:
            if not isinstance(exc, sa.exc.OperationalError):  # cannot connect: one line is enough
                traceback.print_exc()
            first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
            results.append(BackendFigures(backend, error=first[0] if first else type(exc).__name__))
    print_table(results)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
