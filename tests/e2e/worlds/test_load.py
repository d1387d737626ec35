"""Acceptance (issue 19, "no wedge"): `fleetctl serve` on Postgres under heartbeat load.

One real service process with its control loops, on a throwaway Postgres database with the
demo inventory (56 servers) and an agent token for each server; the agents' real heartbeat
(8 GPUs, bench/heartbeats.py, which also measures the figures in docs/development.md):

1. a burst of 200 concurrent heartbeats on the idle service, then open-loop heartbeats above
   what it can serve for 30 s: every request is answered, 200 or 503 with Retry-After (before,
   80 at once gave 40 × 500 after 30 s and 140/s wedged it for good). "Above what it can
   serve" is measured, not assumed: the burst's 200s per second of wall time are what this
   service answers on this machine (160–207/s here; the full path went from ~150/s to 210–225/s
   sustained as it was made faster, and a fixed 250/s then overloaded it only some of the
   time), and the load is twice that (318–338/s in two runs here: 4,000–4,700 503s);
2. a prober in a process of its own asks /healthz every 50 ms throughout: every answer is 200,
   their p99 is under 250 ms (liveness answers on the event loop, no pool, no thread) and none
   takes a second (before, /healthz hung for 29.5 s). On this project's 2-core machines, with
   the load generator, the prober, Postgres and the service sharing them, probes come back
   late as the burst lands (the scheduler, not the service): one in ~660 at 102–131 ms here,
   13 of 582 at 101–168 ms in one CI run (p99 126 ms). So the p99 bound is 250 ms: a /healthz
   that waited on the pool or on a blocked loop takes seconds, far above it; the 100 ms
   figure is measured, not asserted, by bench/heartbeats.py (docs/development.md);
3. after the load, a heartbeat gets 200 again within seconds, and /readyz is ready;
4. SIGTERM during another burst ends the process within 10 s.

The service runs with FLEET_HEARTBEAT_FAST_PATH=false: what is overloaded here is the full
path (the ORM, the worker threads, the pool), which every server's first report and every
report that changes something takes; with the fast path on, the same demo fleet's identical
heartbeats are answered at over 1,000/s (bench/heartbeats.py, docs/development.md), more than
the load generator here can send above capacity. The fast path itself is tested in
tests/unit/test_heartbeat_fast_path.py.

Bounded: about a minute in all (setup, 3 s of burst, 30 s of load, recovery, shutdown).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from factories import TEST_SECRET_KEY
from pg import throwaway_database
from repo_paths import ROOT

from fleet_core.stats import quantile

sys.path.insert(0, str(ROOT / "bench"))
import heartbeats as hb  # bench/ is a directory of scripts, not a package
import measure

BURST = 200
# The load is this many times what the burst measured one service process answers on the full
# path (bench/heartbeats.py `--set heartbeat_fast_path=false`: 160–207/s in a burst, 210–225/s
# sustained here), within bounds the load generator can keep to on a 2-core machine.
OVERLOAD_FACTOR = 2.0
OVERLOAD_PER_S = (250.0, 1000.0)
OVERLOAD_S = 30.0
HEALTHZ_BOUND_S = 0.25  # p99 of the probes: scheduler noise, not a wedge (see above)
HEALTHZ_STALL_S = 1.0  # any single probe
PROBE_EVERY_S = 0.05
RECOVERY_S = 10.0
SIGTERM_BOUND_S = 10.0


@pytest.fixture
def load_db(pg_url: str) -> Iterator[str]:
    admin = sa.make_url(pg_url).set(database="postgres").render_as_string(hide_password=False)
    with throwaway_database("fleet_load", admin) as url:
        yield url


def test_heartbeat_burst_and_overload_are_answered_and_the_service_recovers_and_stops(
    load_db: str, tmp_path: Path
) -> None:
    key = TEST_SECRET_KEY.decode()
    tokens = hb.prepare_database(load_db, key)
    log = tmp_path / "serve.log"
    service = hb.start_service(load_db, key, tmp_path / "data", log, heartbeat_fast_path="false")
    proc, url = service.proc, service.url
    try:

        def tail() -> str:
            return "\n".join(log.read_text(errors="replace").splitlines()[-30:])

        # Idle first: the reconciler's first sweep (56 unreachable BMCs) is behind it.
        hb.wait_settled(url)

        beats = hb.Heartbeats(url, tokens)
        with hb.prober(url, 3600, every=PROBE_EVERY_S) as healthz:
            burst = beats.run(hb.burst(beats.one, BURST))
            rate = overload_rate(burst)
            load = beats.run(hb.open_loop(beats.one, rate, OVERLOAD_S))

        # 1. Every request answered: 200, or 503 saying when to come back.
        for phase, answers in (("burst", burst), ("overload", load)):
            wrong = [a for a in answers if not a.ok]
            assert not wrong, f"{phase}: {len(wrong)} without a proper answer: {wrong[:5]}"
        statuses = {a.status for a in load}
        assert statuses == {200, 503}, (
            f"the load ({rate:.0f}/s) was not above capacity: {statuses}\n{tail()}"
        )
        print(f"\noverload: {rate:.0f}/s for {OVERLOAD_S:.0f} s: {statuses_of(load)}")

        # 2. Liveness throughout (checked last, so that a failure here still shows the rest).
        assert len(healthz) >= (OVERLOAD_S / PROBE_EVERY_S) / 4, "the prober hardly ran"
        probes = [(round(t, 2), round(s, 3), status) for t, s, status in healthz]
        failed = [p for p in probes if p[2] != 200 or p[1] >= HEALTHZ_STALL_S]
        p99 = quantile((s for _, s, _ in probes), 0.99)
        assert p99 is not None

        # 3. Back to normal within seconds.
        deadline = time.monotonic() + RECOVERY_S
        while (answer := beats.run(beats.one())).status != 200:
            assert time.monotonic() < deadline, f"no 200 after the load: {answer}\n{tail()}"
            time.sleep(0.2)
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200

        # 4. SIGTERM in the middle of another burst.
        async def burst_then_sigterm() -> float:
            flight = asyncio.ensure_future(hb.burst(beats.one, BURST))
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.to_thread(proc.wait, SIGTERM_BOUND_S + 5)
            ended = time.monotonic() - sent
            await flight
            return ended

        try:
            ended = beats.run(burst_then_sigterm())
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM did not end the service within {SIGTERM_BOUND_S + 5} s")
        print(f"\nSIGTERM under load: the service ended after {ended:.2f} s")
        assert ended <= SIGTERM_BOUND_S, f"SIGTERM took {ended:.1f} s\n{tail()}"

        slowest = max(probes, key=lambda p: p[1])
        print(f"/healthz: {len(probes)} probes, p99 {p99 * 1000:.0f} ms, slowest {slowest}")
        assert not failed, (
            f"/healthz failing or over {HEALTHZ_STALL_S} s in {len(failed)} of {len(probes)} "
            f"probes (t s, latency s, status): {failed[:20]}"
        )
        late = [p for p in probes if p[1] >= HEALTHZ_BOUND_S]
        assert p99 < HEALTHZ_BOUND_S, f"/healthz p99 {p99:.3f} s; over the bound: {late[:20]}"
    finally:
        service.kill()


def overload_rate(burst: list[hb.Answer]) -> float:
    """Heartbeats per second well above what the service answered in the burst (its 200s over
    the burst's wall time), within OVERLOAD_PER_S."""
    served = [a for a in burst if a.status == 200]
    assert served, f"the burst on the idle service got no 200: {statuses_of(burst)}"
    wall = max(a.sent_at + a.seconds for a in burst) - min(a.sent_at for a in burst)
    low, high = OVERLOAD_PER_S
    return min(high, max(low, OVERLOAD_FACTOR * len(served) / wall))


def statuses_of(answers: list[hb.Answer]) -> dict[int | None, int]:
    return dict(Counter(a.status for a in answers))


HANGS_ON_SHUTDOWN = """
import asyncio, contextlib, sys, time
import uvicorn
from fastapi import FastAPI
from fleet.cli.serve import serve_bounded

@contextlib.asynccontextmanager
async def lifespan(_):
    print("started", flush=True)
    yield
    time.sleep(120)  # a shutdown that never ends (a loop stuck in a BMC call)

config = uvicorn.Config(FastAPI(lifespan=lifespan), port=int(sys.argv[1]), log_level="warning")
serve_bounded(config, 1.0)
"""


def test_the_shutdown_watchdog_ends_a_process_whose_shutdown_hangs(tmp_path: Path) -> None:
    """fleet/cli/'s last resort: SIGTERM, then a shutdown that hangs; the process exits anyway at
    the bound (FLEET_SHUTDOWN_TIMEOUT_S), saying why."""
    root = ROOT
    child = subprocess.Popen(
        [sys.executable, "-c", HANGS_ON_SHUTDOWN, str(measure.free_port())],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "started\n"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=20)
        assert child.returncode == 1, err
        assert "shutdown still running after 1 s: exiting" in err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
