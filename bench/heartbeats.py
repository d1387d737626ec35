"""Agent heartbeats against a real `fleetctl serve` on Postgres: a burst, then open-loop rates,
beside Postgres's own single-row UPDATE rate measured in the same run.

    .venv/bin/python bench/heartbeats.py [--rates 60,120,180,240,320] [--seconds 15]
                                         [--burst 200] [--agents 56]
                                         [--servers 12500] [--processes 1,2]

`bench/heartbeats.py profile [--count 300]` shows where one heartbeat's time goes instead.

`--servers N` imports a generated inventory of N servers (bench/gen_inventory.py) instead of
the demo's 56, with an agent token each, and every one of them reports (`--agents` is then N):
the issue's scale is 12,500 servers (100,000 GPUs). `--processes 1,2` runs the whole series
against one `fleetctl serve`, then against two on the same database, agents split between
them as a load balancer would (both run the control loops; one leads). Before each series
every server reports once (`--first-reports`: not), so what is measured is the steady state.

Setup: a throwaway Postgres database on 127.0.0.1:5432, migrated; the demo inventory
(fleet/data/inventory/demo.yaml, 56 servers) imported; an agent token for each server; `fleetctl
serve`
as a child with its control loops on and its own defaults otherwise (the pool, the admission
cap and wait: docs/api.md), measured once idle (the reconciler's first sweep done).

Each request is the agent's real heartbeat (fleet_agent/daemon.py: 8 GPUs with their telemetry, a
replica with its stats, the verdict) for one of the servers in turn, on keep-alive connections
(as agents' HTTP clients keep them), with a 30 s client timeout. Measured:

  burst      `--burst` heartbeats at once on an idle service: answers by status, wall time,
             p99 of the 200s;
  open loop  for each rate, requests sent on schedule for `--seconds` whatever the answers
             (what agents do): answers by status, 200s per second (the sustained rate),
             p50/p99 of the 200s, and the slowest /healthz of a prober (another process,
             every 50 ms, a new connection each) during the run.

An answer is 200, or 503 with Retry-After past the admission cap; anything else (another
status, no answer within 30 s, a 503 without Retry-After) is counted as an error. Never fails
on timing; exit 1 only when the setup fails or an error is counted.

The pieces (payload, raw HTTP client, open loop, prober) are shared with
tests/e2e/worlds/test_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from measure import cpu_seconds, pct  # run as a script: bench/ is on sys.path

from fleet.data import DEMO_INVENTORY
from fleet.lab.harness import ServeProcess

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
CLIENT_TIMEOUT_S = 30.0
GPUS = 8
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# What an agent sends


def heartbeat_body(server: str, gpus: int = GPUS) -> bytes:
    """The agent's heartbeat (fleet_agent/daemon.py `heartbeat()`): healthy, `gpus` GPUs with the
    telemetry NVML gives, one tensor-parallel replica over all of them with its stats."""
    now = datetime.now(UTC).isoformat()
    body: dict[str, Any] = {
        "server": server,
        "verdict": "healthy",
        "action": "none",
        "reasons": [],
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{secrets.token_hex(4)}-{i:04d}-bench-{secrets.token_hex(6)}",
                "health": "healthy",
                "lost": False,
                "temperature_c": 41.0 + i,
                "slowdown_temp_c": 87.0,
                "memory_used_mib": 71_000 + i,
                "memory_total_mib": 81_559,
                "utilization_pct": 87.5,
                "power_w": 612.4,
                "power_limit_w": 700.0,
                "ecc_uncorrected_volatile": 0,
                "remapped_rows_correctable": 0,
                "remapped_rows_uncorrectable": 0,
                "remap_pending": False,
                "remap_failed": False,
                "clock_events": 0,
                "xids": [],
            }
            for i in range(gpus)
        ],
        "snapshot_at": now,
        "draining": False,
        "ready": True,
        "replicas": [
            {
                "index": 0,
                "gpus": list(range(gpus)),
                "port": 8001,
                "url": None,
                "state": "ready",
                "restarts": 0,
                "load_seconds": 41.2,
                "queued": 3,
                "running": 12,
                "kv_used_fraction": 0.41,
                "cache_hit_rate": 0.2,
                "tokens_per_s": 912.0,
                "ttft_p50_s": 0.08,
                "ttft_p95_s": 0.21,
                "e2e_p50_s": 1.1,
                "e2e_p95_s": 2.4,
            }
        ],
    }
    return json.dumps(body).encode()


# ---------------------------------------------------------------------------------------------
# A small HTTP/1.1 client: cheap enough that the load generator is not what saturates


@dataclass(frozen=True)
class Answer:
    sent_at: float  # time.monotonic()
    seconds: float
    status: int | None  # None: no answer (timeout, connection refused or reset)
    retry_after: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """200, or 503 saying when to come back."""
        return self.status == 200 or (self.status == 503 and self.retry_after is not None)


def request_bytes(
    method: str,
    path: str,
    host: str,
    body: bytes = b"",
    token: str | None = None,
    *,
    keep_alive: bool = True,
) -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    if not keep_alive:
        head.append("Connection: close")
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    if body or method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def parse_answer(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Heartbeats:
    """Heartbeat requests for the agents in `tokens` ({server: token}), in turn, on keep-alive
    connections as agents' HTTP clients keep them (a connection per request in flight, reused
    when its answer is in)."""

    def __init__(
        self, url: str, tokens: dict[str, str], gpus: dict[str, int] | None = None
    ) -> None:
        self.hostport = url.removeprefix("http://")
        host, _, port = self.hostport.partition(":")
        self.host, self.port = host, int(port)
        self._payloads = [
            request_bytes(
                "POST",
                HEARTBEAT_PATH,
                self.hostport,
                heartbeat_body(server, (gpus or {}).get(server, GPUS)),
                token,
            )
            for server, token in tokens.items()
        ]
        self._next = 0
        self._idle: list[Connection] = []

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """asyncio.run(work), closing the connections it left open (they live in its loop)."""
        return run_closing(work, [self])

    def close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    def one(self) -> Coroutine[Any, Any, Answer]:
        payload = self._payloads[self._next % len(self._payloads)]
        self._next += 1
        return self.send(payload)

    async def send(self, payload: bytes, timeout: float = CLIENT_TIMEOUT_S) -> Answer:
        started = time.monotonic()
        conn: Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                for reused in (bool(self._idle), False):
                    conn = (
                        self._idle.pop()
                        if reused
                        else await asyncio.open_connection(self.host, self.port)
                    )
                    reader, writer = conn
                    try:
                        writer.write(payload)
                        await writer.drain()
                        head = await reader.readuntil(b"\r\n\r\n")
                    except (ConnectionError, asyncio.IncompleteReadError):
                        writer.close()
                        conn = None
                        if reused:  # the server had closed it (keep-alive timeout): anew
                            continue
                        raise
                    status, headers = parse_answer(head)
                    await reader.readexactly(int(headers.get("content-length", "0")))
                    if headers.get("connection", "").lower() == "close":
                        writer.close()
                    else:
                        self._idle.append(conn)
                    conn = None
                    seconds = time.monotonic() - started
                    return Answer(started, seconds, status, headers.get("retry-after"))
                raise ConnectionError("no connection")  # pragma: no cover - the loop returns
        except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            if conn is not None:
                conn[1].close()
            error = f"{type(exc).__name__}: {exc}"
            return Answer(started, time.monotonic() - started, None, None, error)


class Spread:
    """Agents split between several services (a load balancer's round-robin by agent): each
    service's `Heartbeats` holds its share of the agents; requests take the services in turn."""

    def __init__(
        self, urls: Sequence[str], tokens: dict[str, str], gpus: dict[str, int] | None = None
    ) -> None:
        servers = list(tokens)
        self.parts = [
            Heartbeats(url, {s: tokens[s] for s in servers[i :: len(urls)]}, gpus)
            for i, url in enumerate(urls)
        ]
        self._next = 0

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return run_closing(work, self.parts)

    def one(self) -> Coroutine[Any, Any, Answer]:
        part = self.parts[self._next % len(self.parts)]
        self._next += 1
        return part.one()


def run_closing(work: Coroutine[Any, Any, T], clients: Sequence[Heartbeats]) -> T:
    """asyncio.run(work), closing the connections the clients left open (they live in its
    loop)."""

    async def go() -> T:
        try:
            return await work
        finally:
            for client in clients:
                client.close_idle()

    return asyncio.run(go())


async def closed_loop(make: Callable[[], Awaitable[Answer]], n: int, width: int) -> list[Answer]:
    """`n` requests, `width` in flight at a time."""
    answers: list[Answer] = []

    async def lane(count: int) -> None:
        for _ in range(count):
            answers.append(await make())

    await asyncio.gather(*(lane(n // width + (i < n % width)) for i in range(width)))
    return answers


async def burst(make: Callable[[], Awaitable[Answer]], n: int) -> list[Answer]:
    """`n` requests at once."""
    return list(await asyncio.gather(*(make() for _ in range(n))))


async def open_loop(
    make: Callable[[], Awaitable[Answer]], rate: float, seconds: float
) -> list[Answer]:
    """Requests at `rate` per second for `seconds`, each on schedule whatever the earlier ones
    are doing (agents do not wait for each other); all answers."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i in range(round(rate * seconds)):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(make()))
    return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------------------------------
# The /healthz prober: a process of its own, so that the load generator's own work never
# shows up as the service's latency


def probe(url: str, seconds: float, every: float) -> None:
    """GET /healthz on a new connection every `every` s for `seconds`; one JSON line each:
    [seconds since start, latency s, status or null]."""
    host, _, port = url.removeprefix("http://").partition(":")
    payload = request_bytes("GET", "/healthz", f"{host}:{port}", keep_alive=False)
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        status: int | None = None
        try:
            with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S) as sock:
                sock.sendall(payload)
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            status = parse_answer(b"".join(chunks))[0]
        except (OSError, ValueError, IndexError):
            pass
        print(json.dumps([round(now - start, 3), time.monotonic() - now, status]), flush=True)
        time.sleep(max(0.0, every - (time.monotonic() - now)))


@contextmanager
def prober(url: str, seconds: float, every: float = 0.05) -> Iterator[list[tuple[float, ...]]]:
    """Runs `probe` in a child for the block; its samples (t, latency, status or -1) land in
    the yielded list when the block ends."""
    samples: list[tuple[float, ...]] = []
    child = subprocess.Popen(
        [sys.executable, __file__, "probe", url, "--seconds", str(seconds), "--every", str(every)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield samples
    finally:
        child.terminate()
        out, _ = child.communicate(timeout=30)
        for line in out.splitlines():
            with suppress(ValueError):  # the last line may be cut short by the signal
                t, latency, status = json.loads(line)
                samples.append((t, latency, -1 if status is None else status))


# ---------------------------------------------------------------------------------------------
# The world: a database with the demo inventory, agent tokens, the service


def prepare_database(url: str, secret_key: str, servers: int | None = None) -> dict[str, str]:
    """Migrate, import the demo inventory (or a generated one of `servers` servers), and an
    agent token per server ({server: token})."""
    return prepare_fleet(url, secret_key, servers)[0]


def prepare_fleet(
    url: str, secret_key: str, servers: int | None = None
) -> tuple[dict[str, str], dict[str, int]]:
    """`prepare_database`, and each server's GPU count ({server: gpus})."""
    import yaml
    from gen_inventory import generate
    from sqlmodel import select

    from fleet import db
    from fleet.auth import create_token
    from fleet.crypto import SecretBox
    from fleet.inventory import import_inventory
    from fleet.inventory.schema import parse_inventory
    from fleet.models import Role, Server

    engine = db.make_engine(url)
    try:
        db.upgrade(engine)
        text = DEMO_INVENTORY.read_bytes() if servers is None else yaml.safe_dump(generate(servers))
        inventory = parse_inventory(text)
        with db.session_scope(engine) as session:
            import_inventory(session, inventory, SecretBox(secret_key.encode()), "bench")
        tokens, gpus = {}, {}
        with db.session_scope(engine) as session:
            rows = session.exec(select(Server.name, Server.gpu_count).order_by(Server.name))
            for name, count in rows.all():
                tokens[name] = create_token(session, f"agent-{name}"[:60], Role.AGENT, name)
                gpus[name] = count
        return tokens, gpus
    finally:
        engine.dispose()


def postgres_update_rate(url: str, clients: int, seconds: float = 3.0) -> float:
    """Postgres's own pace on this machine: single-row UPDATEs of `server` (its heartbeat
    column, autocommit, one round trip each) per second from `clients` threads, each on a
    connection of its own, by psycopg without SQLAlchemy."""
    import threading

    import psycopg
    import sqlalchemy as sa

    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn) as conn:
        ids = [row[0] for row in conn.execute("SELECT id FROM server ORDER BY id")]
    done: list[int] = []
    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        n = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                conn.execute(
                    "UPDATE server SET last_heartbeat_at = now() WHERE id = %s",
                    (ids[(k + n * clients) % len(ids)],),
                )
                n += 1
        done.append(n)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.monotonic() - started)


@contextmanager
def throwaway_database() -> Iterator[str]:
    import sqlalchemy as sa

    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"fleet_heartbeats_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield sa.make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def start_service(
    database_url: str,
    secret_key: str,
    data_dir: Path,
    log: Path,
    name: str = "serve",
    **settings: str,
) -> ServeProcess:
    """`fleetctl serve` with its loops on (settings: `name=value` for FLEET_NAME), ready."""
    service = ServeProcess(
        name,
        data_dir,
        {
            "FLEET_DATABASE_URL": database_url,
            "FLEET_SECRET_KEY": secret_key,
            "FLEET_RUN_LOOPS": "true",
        }
        | {f"FLEET_{k.upper()}": v for k, v in settings.items()},
        log=log,
    )
    service.start(error=RuntimeError)
    return service


def wait_settled(url: str, timeout: float = 60.0) -> None:
    """Until the reconciler's first sweep is done (its start-up burst of BMC reads, 56
    unreachable BMCs here, is not the load measured): the service is idle then."""
    import httpx

    deadline = time.monotonic() + timeout
    prefix = 'fleet_loop_ticks_total{loop="reconciler"} '
    while True:
        lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
        if any(line.startswith(prefix) and float(line[len(prefix) :]) >= 1 for line in lines):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reconciler did not tick within {timeout:g} s")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Figures


def summary(answers: Sequence[Answer], seconds: float) -> dict[str, Any]:
    statuses = Counter("none" if a.status is None else str(a.status) for a in answers)
    good = [a.seconds for a in answers if a.status == 200]
    return {
        "sent": len(answers),
        "statuses": dict(sorted(statuses.items())),
        "errors": sum(not a.ok for a in answers),
        "ok_per_s": len(good) / seconds if seconds > 0 else float("nan"),
        "p50_ms": pct(good, 0.5) * 1000,
        "p99_ms": pct(good, 0.99) * 1000,
        "p99_all_ms": pct([a.seconds for a in answers], 0.99) * 1000,
        # what the requests without a proper answer met (the load generator's own limits or
        # the service's), the commonest first
        "why": Counter(
            (a.error or f"HTTP {a.status} without Retry-After")[:80] for a in answers if not a.ok
        ).most_common(3),
    }


def show(label: str, figures: dict[str, Any], healthz: Sequence[tuple[float, ...]]) -> None:
    probes = [s[1] * 1000 for s in healthz]
    statuses = " ".join(f"{k}×{v}" for k, v in figures["statuses"].items())
    print(
        f"  {label:<10} sent {figures['sent']:5d}  {statuses:<19} errors {figures['errors']:2d}  "
        f"200/s {figures['ok_per_s']:5.1f}  p50 {figures['p50_ms']:5.0f} ms  "
        f"p99 {figures['p99_ms']:5.0f} ms (all {figures['p99_all_ms']:5.0f})  /healthz "
        f"p50 {pct(probes, 0.5):4.1f} p99 {pct(probes, 0.99):5.1f} "
        f"max {max(probes, default=float('nan')):5.1f} ms ({len(probes)})"
        + (f"  service CPU {figures['cpu'] * 100:3.0f} %" if "cpu" in figures else ""),
        flush=True,
    )
    for why, n in figures["why"]:
        print(f"  {'':<10} {n} × {why}", flush=True)


def series(
    url: str,
    key: str,
    tmp: Path,
    tokens: dict[str, str],
    gpus: dict[str, int],
    count: int,
    rates: Sequence[float],
    args: argparse.Namespace,
) -> int:
    """The burst and the open-loop rates against `count` services; the errors counted."""
    overrides = dict(item.split("=", 1) for item in args.set)
    if args.servers is not None:
        # Generated BMC addresses are not all on 127.0.0.1 (bench/gen_inventory.py): no loop may
        # call them. Measured then: the API alone.
        overrides.setdefault("run_loops", "false")
    services = [
        start_service(url, key, tmp / f"data{i}", tmp / f"serve{i}.log", f"serve{i}", **overrides)
        for i in range(count)
    ]
    errors: int = 0
    try:
        print(f"{count} × fleetctl serve, heartbeats of each server's GPUs", flush=True)
        if overrides.get("run_loops", "true") != "false":
            for service in services:
                wait_settled(service.url)
        beats = Spread([service.url for service in services], tokens, gpus)
        probed = services[0].url
        if not args.first_reports:
            # Steady state: each server's first report is heavier (its verdict is new: an
            # Event); with thousands of servers it would be most of what is measured.
            started = time.monotonic()
            warm = beats.run(closed_loop(beats.one, len(tokens), 8 * count))
            bad = sum(not a.ok or a.status != 200 for a in warm)
            print(
                f"  warm-up: every server reported once ({len(warm)} in "
                f"{time.monotonic() - started:.0f} s, {bad} not 200)",
                flush=True,
            )
        with prober(probed, 3600) as healthz:
            started = time.monotonic()
            answers = beats.run(burst(beats.one, args.burst))
            wall = time.monotonic() - started
            time.sleep(1.0)
        figures = summary(answers, wall)
        errors += int(figures["errors"])
        show(f"burst {args.burst}", figures, healthz)
        print(f"  {'':<14} wall {wall:.2f} s", flush=True)
        for rate in rates:
            time.sleep(2.0)  # let the previous rate's backlog drain
            cpu = sum(cpu_seconds(service.proc.pid) for service in services)
            with prober(probed, 3600) as healthz:
                answers = beats.run(open_loop(beats.one, rate, args.seconds))
            figures = summary(answers, args.seconds)
            used = sum(cpu_seconds(service.proc.pid) for service in services) - cpu
            figures["cpu"] = used / args.seconds
            errors += int(figures["errors"])
            show(f"{rate:g}/s", figures, healthz)
    finally:
        for service in services:
            service.kill()
    return errors


def profile(count: int) -> None:
    """Where one heartbeat's time goes, in-process (the ASGI app through Starlette's test
    client on a throwaway Postgres database, loops off): the statements it runs and the time
    spent in the database driver (SQLAlchemy's cursor events), and, when `yappi` is installed
    (it profiles every thread: the route runs in a worker thread), CPU by package."""
    import base64
    from collections import Counter as Tally

    import sqlalchemy as sa
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from fleet import db
    from fleet.api.app import create_app
    from fleet.settings import Settings

    key = base64.urlsafe_b64encode(os.urandom(32)).decode()
    with tempfile.TemporaryDirectory() as tmp, throwaway_database() as url:
        tokens, gpus = prepare_fleet(url, key)
        settings = Settings(
            database_url=url, secret_key=SecretStr(key), run_loops=False, data_dir=Path(tmp)
        )
        engine = db.engine_from_settings(settings)
        statements: Tally[str] = Tally()
        in_driver = [0.0]
        began: dict[int, float] = {}

        def before(_c: Any, cursor: Any, *_: Any) -> None:
            began[id(cursor)] = time.perf_counter()

        def after(_c: Any, cursor: Any, statement: str, *_: Any) -> None:
            in_driver[0] += time.perf_counter() - began.pop(id(cursor), time.perf_counter())
            statements[" ".join(statement.split())[:70]] += 1

        sa.event.listen(engine, "before_cursor_execute", before)
        sa.event.listen(engine, "after_cursor_execute", after)
        bodies = [(heartbeat_body(s, gpus[s]), t) for s, t in tokens.items()]
        with TestClient(create_app(settings, engine)) as client:

            def beat(n: int) -> None:
                for i in range(n):
                    body, token = bodies[i % len(bodies)]
                    reply = client.post(
                        HEARTBEAT_PATH,
                        content=body,
                        headers={
                            "Authorization": f"Bearer {token}",
                            "Content-Type": "application/json",
                        },
                    )
                    assert reply.status_code == 200, reply.text

            beat(len(bodies))  # each server's first report writes more (GPU rows, events)
            statements.clear()
            in_driver[0] = 0.0
            started = time.perf_counter()
            beat(count)
            wall = time.perf_counter() - started
            print(
                f"{count} heartbeats in-process: {wall / count * 1000:.2f} ms each (wall, with "
                f"the test client), {sum(statements.values()) / count:.1f} statements, "
                f"{in_driver[0] / count * 1000:.2f} ms in the database driver"
            )
            for statement, n in statements.most_common():
                print(f"  {n / count:4.1f} × {statement}")
            try:  # optional: not a dependency of the project
                yappi: Any = importlib.import_module("yappi")
            except ImportError:
                print("(pip install yappi for CPU by package)")
                return
            yappi.set_clock_type("cpu")
            yappi.start(builtins=False)
            beat(count)
            yappi.stop()
            total = sum(t.ttot for t in yappi.get_thread_stats())
            shares: Tally[str] = Tally()
            for stat in yappi.get_func_stats():
                module = stat.module.replace(os.sep, "/")
                package = next(
                    (p for p in _PACKAGES if f"/{p}/" in module or module.endswith(f"/{p}.py")),
                    "other",
                )
                shares[package] += stat.tsub
            print(f"CPU by package (yappi; {total / count * 1000:.1f} ms per heartbeat profiled):")
            for package, seconds in shares.most_common(12):
                print(f"  {package:<12} {seconds / total * 100:5.1f} %")
        engine.dispose()


_PACKAGES = (
    "sqlalchemy",
    "psycopg",
    "sqlmodel",
    "pydantic",
    "pydantic_core",
    "fastapi",
    "starlette",
    "anyio",
    "asyncio",
    "httpx",
    "fleet",
    "json",
    "threading",
    "concurrent",
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command")
    probe_ap = sub.add_parser("probe", help="(internal) the /healthz prober")
    probe_ap.add_argument("url")
    probe_ap.add_argument("--seconds", type=float, required=True)
    probe_ap.add_argument("--every", type=float, default=0.05)
    profile_ap = sub.add_parser("profile", help="where one heartbeat's time goes, in-process")
    profile_ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--rates", default="60,120,180,240,320", help="heartbeats/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0, help="per rate")
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--agents", type=int, default=56, help="servers reporting (demo: 56)")
    ap.add_argument(
        "--servers", type=int, help="a generated inventory of this many servers, all reporting"
    )
    ap.add_argument("--processes", default="1", help="service processes, e.g. 1,2")
    ap.add_argument(
        "--first-reports",
        action="store_true",
        help="measure without a warm-up (every server's first report counted)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a service setting (e.g. api_max_in_flight=8); repeat",
    )
    args = ap.parse_args(argv)
    if args.command == "profile":
        profile(args.count)
        return 0
    if args.command == "probe":
        with suppress(KeyboardInterrupt, BrokenPipeError):
            probe(args.url, args.seconds, args.every)
        return 0

    from cryptography.fernet import Fernet

    rates = [float(r) for r in args.rates.split(",") if r]
    processes = [int(p) for p in args.processes.split(",") if p]
    key = Fernet.generate_key().decode()
    errors = 0
    with tempfile.TemporaryDirectory() as tmp, throwaway_database() as url:
        started = time.monotonic()
        tokens, gpus = prepare_fleet(url, key, args.servers)
        if args.servers is None:
            tokens = dict(list(tokens.items())[: args.agents])
        print(
            f"Postgres on 127.0.0.1, {len(tokens)} agents reporting "
            f"({'a generated inventory' if args.servers else 'the demo inventory'}, prepared in "
            f"{time.monotonic() - started:.0f} s); {os.cpu_count()} CPUs; Python "
            f"{sys.version.split()[0]}",
            flush=True,
        )
        for clients in (1, 8):
            rate = postgres_update_rate(url, clients)
            print(f"  Postgres alone: {rate:6.0f} single-row UPDATEs/s on {clients} client(s)")
        for count in processes:
            errors += series(url, key, Path(tmp) / f"x{count}", tokens, gpus, count, rates, args)
    if errors:
        print(f"{errors} requests without a proper answer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
