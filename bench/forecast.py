"""Predictive scaling at fleet scale: what the forecaster adds to the autoscaler's tick, and
what the demand history costs to keep.

    .venv/bin/python bench/forecast.py [--deployments 100] [--weeks 4] [--repeat 5]
                                       [--db postgresql+psycopg://postgres@127.0.0.1/fleet_bench]

Setup (seeded): `--deployments` deployments, each with `--weeks` weeks of per-minute demand in
`demand_hour` rows (a daily cosine × weekdays, noise, a few spikes; 2 servers, their slot use
following the demand) in a fresh database (SQLite in a temporary directory, or `--db`, whose
tables are dropped and made again).

Timed, `--repeat` times each (median and best):
  (1) the baseline: one reactive tick's policy work, `decide` for every deployment on an hour
      of signals at 15 s (240 observations: what the service's History keeps);
  (2) refit: for every deployment, read its weeks of rows and fit the profile and capacity
      (`Predictor.fit`: what each deployment costs once per FLEET_FORECAST_REFIT_S);
  (3) forecast: `Predictor.need` for every deployment (what every tick adds).
Then the history's size: rows, bytes per row as the database stores them (table, indexes and
TOAST), and a year for `--deployments` deployments at that rate. Never fails on timing.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlmodel import Session, SQLModel, create_engine

from fleet.autoscaler import demand
from fleet.autoscaler.demand import Forecasts
from fleet.autoscaler.policy import decide
from fleet.autoscaler.signals import DeploymentState, Signals
from fleet.models import DemandHour

NOW = datetime(2026, 12, 7, 9, 50, tzinfo=UTC)  # a Monday morning


def seed(engine: sa.Engine, deployments: int, weeks: int, rng: random.Random) -> int:
    rows = 0
    start = (NOW - timedelta(weeks=weeks)).replace(minute=0)
    with Session(engine) as session:
        for d in range(deployments):
            base = rng.uniform(100, 3000)
            hour = start
            batch = []
            while hour < NOW.replace(minute=0):
                values, uses = [], []
                for m in range(60):
                    t = hour + timedelta(minutes=m)
                    h = t.hour + t.minute / 60
                    daily = 0.3 + 0.7 * (1 + math.cos(2 * math.pi * (h - 14) / 24)) / 2
                    weekly = 1.0 if t.weekday() < 5 else 0.7
                    spike = 4.0 if rng.random() < 0.001 else 1.0
                    v = base * daily * weekly * spike * rng.uniform(0.85, 1.15)
                    values.append(v)
                    uses.append(min(1.0, 0.8 * v / base))
                batch.append(
                    DemandHour(
                        deployment=f"dep-{d:03d}",
                        hour=hour,
                        requests=demand.pack(values),
                        tokens=demand.pack([v * 600 for v in values]),
                        servers=demand.pack([2.0] * 60),
                        slot_use=demand.pack(uses),
                        p95_s=demand.pack([1.0] * 60),
                        ttft_p95_s=demand.pack([0.1] * 60),
                    )
                )
                hour += timedelta(hours=1)
            session.add_all(batch)
            session.commit()
            rows += len(batch)
    return rows


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), min(runs)


def size_per_row(engine: sa.Engine, rows: int, sqlite_path: Path | None) -> float:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            total = conn.execute(sa.text("SELECT pg_total_relation_size('demand_hour')")).scalar()
            return float(total or 0) / rows
    assert sqlite_path is not None
    return sqlite_path.stat().st_size / rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--weeks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--db", default=None)
    args = ap.parse_args()
    rng = random.Random(7)
    tmp = tempfile.TemporaryDirectory()
    sqlite_path = None
    if args.db:
        engine = create_engine(args.db)
        DemandHour.__table__.drop(engine, checkfirst=True)  # type: ignore[attr-defined]
    else:
        sqlite_path = Path(tmp.name) / "bench.db"
        engine = create_engine(f"sqlite:///{sqlite_path}")
    SQLModel.metadata.create_all(engine, tables=[DemandHour.__table__])  # type: ignore[attr-defined]
    t = time.perf_counter()
    rows = seed(engine, args.deployments, args.weeks, rng)
    print(
        f"seeded {rows:,} rows ({args.deployments} deployments × {args.weeks} weeks) on "
        f"{engine.dialect.name} in {time.perf_counter() - t:.0f} s"
    )
    names = [f"dep-{d:03d}" for d in range(args.deployments)]
    epoch = NOW.timestamp()

    # (1) the baseline: the reactive policy's tick on an hour of signals
    history = [Signals(epoch - 15 * (239 - i), 4.0, 0.4, 1.0, 0.2, 16, 0.5) for i in range(240)]
    state = DeploymentState("d", 2.0, 0.5, 8, 1, 20, target=4, serving=4)
    base = timed(lambda: [decide(state, history, epoch) for _ in names], args.repeat)

    # (2) refit, (3) forecast
    forecasts = Forecasts.new()

    def refit() -> None:
        with Session(engine) as session:
            since = forecasts.history_since(epoch)
            for name in names:
                forecasts.predictor(name).fit(demand.read(session, name, since), epoch, 0.75)

    fit = timed(refit, args.repeat)
    needs = [forecasts.predictor(n).need(epoch, 1054.0, 0.75) for n in names]
    tick = timed(
        lambda: [forecasts.predictor(n).need(epoch, 1054.0, 0.75) for n in names], args.repeat
    )
    acting = sum(1 for servers, _, _ in needs if servers is not None)
    per = size_per_row(engine, rows, sqlite_path)
    year = 8760 * args.deployments * per
    n = args.deployments
    print(f"(1) reactive decide, {n} deployments, 1 h of signals: median {base[0] * 1e3:.1f} ms")
    print(
        f"(2) refit {n} deployments ({args.weeks} weeks each, read + fit): median "
        f"{fit[0] * 1e3:.0f} ms, best {fit[1] * 1e3:.0f} ms ({fit[0] / n * 1e3:.1f} ms each, "
        f"once per FLEET_FORECAST_REFIT_S)"
    )
    print(
        f"(3) forecast {n} deployments: median {tick[0] * 1e3:.1f} ms, best "
        f"{tick[1] * 1e3:.1f} ms per tick = {tick[0] / base[0]:.2f}× the reactive policy's "
        f"work; {acting} of {n} forecasts acting"
    )
    print(
        f"history: {per:,.0f} bytes per deployment-hour as stored; a year of {n} deployments "
        f"≈ {year / 1e9:.2f} GB"
    )
    tmp.cleanup()


if __name__ == "__main__":
    main()
