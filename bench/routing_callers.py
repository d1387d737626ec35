"""Callers: does a noisy tenant over its rate limit hurt a quiet one? (docs/router.md, "Callers")

    .venv/bin/python bench/routing_callers.py [--seconds 10] [--noisy-rpm 600] [--window 5]
        [--quiet-rate 4] [--noisy-connections 8] [--speedup 20]

Standalone (about 30 s): one stand-in engine (python -m fleet_agent.engine.standin, H100, 8B)
behind a fresh `fleetctl router run --table FILE` with FLEET_ROUTER_CLIENT_AUTH=keys and a
callers file of two tenants (`write_callers`): "noisy", one key limited to `--noisy-rpm`
requests per minute (enforced over `--window` seconds), and "quiet", one key without limits.

`measure_callers(base, model, noisy_key, quiet_key)` is the part bench/routing.py calls with its
own router (configured with such a callers file): the quiet tenant sends requests open loop at
`quiet_rate` per second for `seconds`, alone, then again while `noisy_connections` closed-loop
clients of the noisy tenant hammer the router far over its limit. It returns the quiet
tenant's latency percentiles in both phases, and the noisy tenant's requests: admitted, refused
with 429 (each checked for a Retry-After of at least 1 s) and anything else. Each request asks
for 16 tokens, not streamed; latency is from the send to the whole answer. Never fails on
timing: the figures are printed, a 429 without Retry-After is counted, not raised.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from measure import free_port, pct, wait_until  # run as a script: bench/ is on sys.path

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
MODEL = "llama-3.1-8b"
MAX_TOKENS = 16


def new_key() -> str:
    """A client key in the fleet's format (`fk_` + 32 random bytes, URL-safe)."""
    return "fk_" + secrets.token_urlsafe(32)


def write_callers(path: Path, noisy_key: str, quiet_key: str, noisy_rpm: int) -> None:
    """The callers file (the shape of GET /api/v1/routing/callers, hashes only): tenant "noisy"
    with one key limited to `noisy_rpm` requests per minute, tenant "quiet" with one unlimited
    key."""

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    doc = {
        "tenants": [{"name": "noisy", "concurrency_share": 1.0}, {"name": "quiet"}],
        "keys": [
            {
                "id": 1,
                "name": "noisy-bot",
                "tenant": "noisy",
                "hash": digest(noisy_key),
                "requests_per_minute": noisy_rpm,
                "tokens_per_minute": None,
            },
            {
                "id": 2,
                "name": "quiet-app",
                "tenant": "quiet",
                "hash": digest(quiet_key),
                "requests_per_minute": None,
                "tokens_per_minute": None,
            },
        ],
    }
    path.write_text(json.dumps(doc, indent=1))


@dataclass
class CallersFigures:
    """Seconds; the quiet tenant alone and beside the noisy one; the noisy tenant's answers."""

    quiet_alone_p50_s: float
    quiet_alone_p95_s: float
    quiet_alone_n: int
    quiet_noisy_p50_s: float
    quiet_noisy_p95_s: float
    quiet_noisy_n: int
    quiet_failed: int  # quiet requests not answered 200, both phases
    noisy_admitted: int
    noisy_429: int
    noisy_429_without_retry_after: int
    noisy_other: int  # neither 200 nor 429
    retry_after_s: list[int] = field(default_factory=list)  # the distinct values seen
    without_key_status: int = 0  # a request without a key
    unknown_key_status: int = 0  # a request with a well-formed key the router does not know

    def lines(self) -> list[str]:
        return [
            f"quiet tenant alone:       p50 {self.quiet_alone_p50_s * 1000:7.1f} ms, "
            f"p95 {self.quiet_alone_p95_s * 1000:7.1f} ms ({self.quiet_alone_n} requests)",
            f"quiet beside noisy:       p50 {self.quiet_noisy_p50_s * 1000:7.1f} ms, "
            f"p95 {self.quiet_noisy_p95_s * 1000:7.1f} ms ({self.quiet_noisy_n} requests)",
            f"quiet requests failed:    {self.quiet_failed}",
            f"noisy tenant:             {self.noisy_admitted} admitted, {self.noisy_429} refused "
            f"with 429 ({self.noisy_429_without_retry_after} without Retry-After; values "
            f"{self.retry_after_s}), {self.noisy_other} other",
            f"without a key:            HTTP {self.without_key_status}; with an unknown key: "
            f"HTTP {self.unknown_key_status}",
        ]

    def goal_lines(self, allowed: float) -> list[str]:
        """The issue's key items, judged: 401 without a key; 429 with Retry-After over the rate
        while the quiet tenant is served (its latency beside the noisy one, as a ratio)."""
        refused = self.without_key_status == 401 and self.unknown_key_status == 401
        limited = self.noisy_429 > 0 and self.noisy_429_without_retry_after == 0
        served = self.quiet_failed == 0 and self.noisy_other == 0
        ratio = self.quiet_noisy_p95_s / max(self.quiet_alone_p95_s, 1e-9)
        return [
            f"callers: no key / an unknown key: {self.without_key_status} / "
            f"{self.unknown_key_status}, {'met' if refused else 'NOT met'} (401)",
            f"callers: over its rate the noisy tenant got {self.noisy_429} × 429, "
            f"{self.noisy_429_without_retry_after} without Retry-After, {self.noisy_admitted} "
            f"admitted ({allowed:g} per window allowed); the quiet tenant p95 "
            f"{self.quiet_alone_p95_s * 1000:.1f} ms alone, {self.quiet_noisy_p95_s * 1000:.1f} ms "
            f"beside it ({ratio:.2f} x), {self.quiet_failed} failed; "
            f"{'met' if limited and served else 'NOT met'}",
        ]


def _body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "x" * 200, "max_tokens": MAX_TOKENS}).encode()


async def _quiet(
    session: aiohttp.ClientSession, url: str, key: str, body: bytes, rate: float, seconds: float
) -> tuple[list[float], int]:
    """Open loop at `rate` per second: (latencies of 200s, failures)."""
    latencies: list[float] = []
    failed = 0
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    async def one() -> None:
        nonlocal failed
        sent = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as reply:
                await reply.read()
                if reply.status == 200:
                    latencies.append(time.perf_counter() - sent)
                else:
                    failed += 1
        except aiohttp.ClientError:
            failed += 1

    start = time.perf_counter()
    tasks = []
    for n in range(max(1, int(rate * seconds))):
        await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return latencies, failed


async def _noisy(
    session: aiohttp.ClientSession, url: str, key: str, body: bytes, until: float
) -> tuple[int, int, int, int, set[int]]:
    """One closed-loop client: (admitted, 429s, 429s without Retry-After, other, values)."""
    admitted = refused = bare = other = 0
    values: set[int] = set()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    while time.perf_counter() < until:
        try:
            async with session.post(url, data=body, headers=headers) as reply:
                await reply.read()
                if reply.status == 200:
                    admitted += 1
                elif reply.status == 429:
                    refused += 1
                    value = reply.headers.get("Retry-After", "")
                    if value.isdigit() and int(value) >= 1:
                        values.add(int(value))
                    else:
                        bare += 1
                else:
                    other += 1
        except aiohttp.ClientError:
            other += 1
    return admitted, refused, bare, other, values


async def measure_callers(
    base: str,
    model: str,
    noisy_key: str,
    quiet_key: str,
    *,
    seconds: float = 10.0,
    quiet_rate: float = 4.0,
    noisy_connections: int = 8,
) -> CallersFigures:
    """The quiet tenant alone, then beside the noisy one hammering (see the module doc)."""
    url = f"{base.rstrip('/')}/v1/completions"
    body = _body(model)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        statuses = []
        for headers in ({}, {"Authorization": f"Bearer {new_key()}"}):
            async with session.post(url, data=body, headers=headers) as reply:
                await reply.read()
                statuses.append(reply.status)
        alone, failed_alone = await _quiet(session, url, quiet_key, body, quiet_rate, seconds)
        until = time.perf_counter() + seconds + 1.0  # the noisy clients outlast the quiet phase
        noisy = [
            asyncio.create_task(_noisy(session, url, noisy_key, body, until))
            for _ in range(noisy_connections)
        ]
        await asyncio.sleep(0.5)  # the noisy clients are over their limit by now
        beside, failed_beside = await _quiet(session, url, quiet_key, body, quiet_rate, seconds)
        counts = await asyncio.gather(*noisy)
    values: set[int] = set().union(*(c[4] for c in counts))
    return CallersFigures(
        quiet_alone_p50_s=pct(alone, 0.5),
        quiet_alone_p95_s=pct(alone, 0.95),
        quiet_alone_n=len(alone),
        quiet_noisy_p50_s=pct(beside, 0.5),
        quiet_noisy_p95_s=pct(beside, 0.95),
        quiet_noisy_n=len(beside),
        quiet_failed=failed_alone + failed_beside,
        noisy_admitted=sum(c[0] for c in counts),
        noisy_429=sum(c[1] for c in counts),
        noisy_429_without_retry_after=sum(c[2] for c in counts),
        noisy_other=sum(c[3] for c in counts),
        retry_after_s=sorted(values),
        without_key_status=statuses[0],
        unknown_key_status=statuses[1],
    )


# --- standalone ----------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _answers(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as reply:
        return bool(reply.status == 200)


@contextmanager
def _process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        _stop(proc)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase")
    ap.add_argument("--noisy-rpm", type=int, default=600, help="the noisy key's limit")
    ap.add_argument("--window", type=float, default=5.0, help="FLEET_ROUTER_RATE_WINDOW_S")
    ap.add_argument("--quiet-rate", type=float, default=4.0, help="quiet requests per second")
    ap.add_argument("--noisy-connections", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=20.0, help="FLEET_STANDIN_SPEEDUP")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[int, list[str]]:
    """The engine, the router with the callers file, the two phases: (exit code, goal lines)."""
    with tempfile.TemporaryDirectory(prefix="bench-callers-") as tmp_name:
        tmp = Path(tmp_name)
        engine_port, router_port = free_port(), free_port()
        engine_env = dict(os.environ)
        engine_env |= {
            "FLEET_STANDIN_GPU": "H100",
            "FLEET_STANDIN_LOAD_S": "0.05",
            "FLEET_STANDIN_SPEEDUP": str(args.speedup),
        }
        engine_argv = [sys.executable, "-m", "fleet_agent.engine.standin", MODEL]
        engine_argv += ["--host", HOST, "--port", str(engine_port), "--max_batch_size", "64"]
        noisy_key, quiet_key = new_key(), new_key()
        write_callers(tmp / "callers.json", noisy_key, quiet_key, args.noisy_rpm)
        row = {
            "deployment": "llama",
            "models": ["llama", MODEL],
            "model_uri": f"s3://models/{MODEL}",
            "max_batch_size": 64,
            "replicas": [{"url": f"http://{HOST}:{engine_port}", "gpu_model": "H100"}],
        }
        (tmp / "table.json").write_text(json.dumps({"results": [row]}))
        router_env = dict(os.environ)
        router_env.setdefault("FLEET_ROUTER_LOG_LEVEL", "WARNING")
        router_env |= {
            "FLEET_ROUTER_CLIENT_AUTH": "keys",
            "FLEET_ROUTER_CALLERS_FILE": str(tmp / "callers.json"),
            "FLEET_ROUTER_RATE_WINDOW_S": str(args.window),
        }
        router_argv = [sys.executable, "-m", "fleet.cli", "router", "run"]
        router_argv += ["--table", str(tmp / "table.json"), "--host", HOST]
        router_argv += ["--port", str(router_port)]
        base = f"http://{HOST}:{router_port}"
        with (
            _process(engine_argv, engine_env, tmp / "engine.log") as engine,
            _process(router_argv, router_env, tmp / "router.log") as router,
        ):
            try:
                wait_until(
                    "engine", lambda: _answers(f"http://{HOST}:{engine_port}/health"), engine, 60
                )
                wait_until("router", lambda: _answers(f"{base}/readyz"), router, 60)
            except RuntimeError as exc:
                for log in ("engine.log", "router.log"):
                    sys.stderr.write((tmp / log).read_text()[-2000:])
                print(f"routing_callers: {exc}", file=sys.stderr)
                return 1, []
            figures = asyncio.run(
                measure_callers(
                    base,
                    "llama",
                    noisy_key,
                    quiet_key,
                    seconds=args.seconds,
                    quiet_rate=args.quiet_rate,
                    noisy_connections=args.noisy_connections,
                )
            )
    allowed = args.noisy_rpm * args.window / 60
    print(
        f"noisy key: {args.noisy_rpm}/min over a {args.window:g} s window ({allowed:g} per "
        f"window); {args.noisy_connections} noisy connections, quiet at {args.quiet_rate:g}/s, "
        f"{args.seconds:g} s per phase; stand-in speed-up {args.speedup:g}"
    )
    for line in figures.lines():
        print(line)
    goals = figures.goal_lines(allowed)
    for line in goals:
        print(line)
    print(json.dumps(asdict(figures)))  # last: the figures for a caller (a test reads them)
    return 0, goals


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))[0]


if __name__ == "__main__":
    sys.exit(main())
