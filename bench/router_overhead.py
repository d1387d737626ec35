"""The router's own cost: added latency and maximum request rate, beside nginx proxy_pass.

    .venv/bin/python bench/router_overhead.py [--seconds 5] [--connections 1,16,64]

Upstream: a TRIVIAL UPSTREAM, not an engine: a raw asyncio HTTP/1.1 server (this file with
--upstream, its own process) that answers every POST with the same small OpenAI completion
JSON (one token, usage included) at once, keep-alive. It costs a few tens of microseconds per
request, so what is measured is the path in front of it.

Paths, each measured the same way:
  direct    client → upstream
  router    client → `fleetctl router run` (a subprocess: one event loop, one process, the
            default; a routing-table file with one replica, no agent) → upstream
  router×2  the same with `--workers 2`: two router processes sharing the port (SO_REUSEPORT),
            each a whole router with its own books; its CPU column sums both workers
  nginx     client → nginx proxy_pass (1 worker, keep-alive to the upstream) → upstream; only
            where `nginx` is on the PATH (Debian's nginx; skipped, and said so, where absent)

Client: closed loop, raw asyncio protocols (an aiohttp client costs more per request than the
router does, and `wrk` is used instead where installed: it is not here), N connections kept
alive, each sending its next request (POST /v1/completions, model "llama", a 5-token prompt,
max_tokens 1, not streamed) as soon as the last answer is complete; latency from the write to
the last byte. Per path and N: requests/s, latency p50/p99, CPU of each process (share of one
core, from /proc). Added latency = router p50 (p99) - direct p50 (p99) at the same N; at N = 1
that is the router's cost per request, unqueued.

Goal (the issue): >= 10,000 requests/s through the router and added p50 <= 1 ms; the summary
gives both for one worker and for two. On a small machine the client, the upstream and the
router share the cores: the CPU columns say which one ran out (a process at ~100 % is the limit;
one router process is one event loop, so one core is its ceiling; two workers on a 2-core
machine compete with the client and the upstream for the second core). Never fails on timing:
exits non-zero only when something does not start.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from measure import (  # run as a script: bench/ is on sys.path
    cpu_seconds,
    free_port,
    pct,
    wait_until,
)

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
GOAL_RPS, GOAL_ADDED_P50_S = 10_000, 1e-3

BODY = json.dumps(
    {"model": "llama", "prompt": "Say hello to the fleet.", "max_tokens": 1, "stream": False}
).encode()
ANSWER = json.dumps(
    {
        "id": "cmpl-overhead",
        "object": "text_completion",
        "created": 0,
        "model": "llama-3.1-8b",
        "choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7},
    }
).encode()


# --- helpers ------------------------------------------------------------------------------------


def answers(port: int) -> bool:
    """One POST of the benchmark's request answered 200."""
    request = urllib.request.Request(
        f"http://{HOST}:{port}/v1/completions",
        data=BODY,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=2) as reply:
        return bool(reply.status == 200)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def tail(path: Path, lines: int = 15) -> str:
    with suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


# --- the trivial upstream -------------------------------------------------------------------------

RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(ANSWER)}\r\n".encode()
    + b"Connection: keep-alive\r\n\r\n"
    + ANSWER
)


class _Upstream(asyncio.Protocol):
    """A TRIVIAL UPSTREAM (not an engine): every complete request gets RESPONSE at once."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            size = _content_length(self.buf[:end]) or 0
            if len(self.buf) < end + 4 + size:
                return
            self.buf = self.buf[end + 4 + size :]
            assert self.transport is not None
            self.transport.write(RESPONSE)


def serve_upstream(port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Upstream, HOST, port, backlog=4096)
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        async with server:
            await done.wait()

    asyncio.run(main())


# --- the client -----------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One keep-alive connection, closed loop: the next request when the answer is complete."""

    def __init__(self, request: bytes, record: list[float], errors: list[str], until: float):
        self.request = request
        self.record = record
        self.errors = errors
        self.until = until
        self.buf = b""
        self.started = 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.buf = b""
        self.started = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end]
        size = _content_length(head)
        if size is None:  # chunked (nginx may answer so): complete at the last chunk
            if not self.buf.endswith(b"0\r\n\r\n"):
                return
        elif len(self.buf) < end + 4 + size:
            return
        now = time.perf_counter()
        if not head.startswith(b"HTTP/1.1 200"):
            self.errors.append(head.split(b"\r\n", 1)[0].decode(errors="replace"))
        else:
            self.record.append(now - self.started)
        assert self.transport is not None
        if now < self.until:
            self._send()
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def closed_loop(
    port: int, connections: int, warmup: float, seconds: float
) -> tuple[list[float], list[str], float, float]:
    """(latencies in the window, errors, window start, window end) of `connections` streams."""
    loop = asyncio.get_running_loop()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    record: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    until = start + warmup + seconds
    protocols: list[_Client] = []
    for _ in range(connections):
        _, proto = await loop.create_connection(
            lambda: _Client(request, record, errors, until), HOST, port
        )
        protocols.append(proto)
    await asyncio.sleep(warmup)
    record.clear()  # the window begins: the answers so far were the warm-up
    errors.clear()
    window0 = time.perf_counter()
    await asyncio.gather(*(p.closed for p in protocols))
    window1 = min(time.perf_counter(), until)
    return record, errors, window0, window1


# --- the paths ------------------------------------------------------------------------------------


@dataclass
class Path_:
    name: str
    port: int
    pids: dict[str, int]  # process label -> pid, for the CPU columns
    children: set[str] = field(default_factory=set)  # labels whose children's CPU counts too


@contextmanager
def upstream(logs: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--upstream", str(port)]
    with (logs / "upstream.log").open("ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until("trivial upstream", lambda: answers(port), proc, 20)
        yield port, proc
    finally:
        stop(proc)


@contextmanager
def router(
    logs: Path, upstream_port: int, workers: int = 1
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    table = logs / f"routing-{free_port()}.json"
    row = {
        "deployment": "llama",
        "models": ["llama", "llama-3.1-8b"],
        "model_uri": "s3://models/llama-3.1-8b",
        "tp_size": 1,
        "max_batch_size": 4096,  # never the limit here: this measures the proxy path
        "replicas": [
            {
                "server": "s0",
                "gpu_model": "H100",
                "agent_url": None,
                "url": f"http://{HOST}:{upstream_port}",
                "state": "ready",
            }
        ],
    }
    table.write_text(json.dumps({"results": [row]}))
    port = free_port()
    env = dict(os.environ)
    env.setdefault("FLEET_ROUTER_LOG_LEVEL", "WARNING")
    # The proxying overhead without callers (none: no key lookup, no rate books); a
    # FLEET_ROUTER_CLIENT_AUTH in the environment measures it with them.
    env.setdefault("FLEET_ROUTER_CLIENT_AUTH", "none")
    argv = [sys.executable, "-m", "fleet.cli", "router", "run", "--table", str(table)]
    argv += ["--host", HOST, "--port", str(port)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    log = logs / f"router-{workers}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until("router", lambda: answers(port), proc, 30)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{tail(log)}") from None
        yield port, proc
    finally:
        stop(proc)


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream engine {{ server {host}:{upstream}; keepalive 256; }}
    server {{
        listen {host}:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


@contextmanager
def nginx(
    binary: str, logs: Path, upstream_port: int
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    tmp = logs / "nginx"
    tmp.mkdir()
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, host=HOST, upstream=upstream_port, port=port))
    argv = [binary, "-p", str(tmp), "-c", str(conf)]
    log = logs / "nginx.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until("nginx", lambda: answers(port), proc, 20)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{tail(log)}\n{tail(tmp / 'nginx-error.log')}") from None
        yield port, proc
    finally:
        stop(proc)


def children_of(parent: int) -> list[int]:
    """The pids whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == parent:
                found.append(int(entry.name))
    return found


def nginx_worker(master: int) -> int | None:
    """nginx serves from a worker, a child of the master: its pid, for the CPU column."""
    return next(iter(children_of(master)), None)


# --- measurement ----------------------------------------------------------------------------------


@dataclass
class Row:
    path: str
    connections: int
    rps: float
    p50: float
    p99: float
    errors: int
    cpu: dict[str, float]


def measure(path: Path_, connections: int, warmup: float, seconds: float) -> Row:
    gc.collect()
    gc.disable()
    try:
        pids = dict(path.pids)

        def used(label: str, pid: int) -> float:
            if label not in path.children:
                return cpu_seconds(pid)
            return sum(cpu_seconds(child) for child in children_of(pid))

        before = {k: used(k, p) for k, p in pids.items()}
        client0 = time.process_time()
        t0 = time.perf_counter()
        record, errors, w0, w1 = asyncio.run(closed_loop(path.port, connections, warmup, seconds))
        wall = time.perf_counter() - t0
        client = (time.process_time() - client0) / wall
        after = {k: used(k, p) for k, p in pids.items()}
    finally:
        gc.enable()
    cpu = {"client": client} | {k: (after[k] - before[k]) / wall for k in pids}
    return Row(
        path.name,
        connections,
        len(record) / max(1e-9, w1 - w0),
        pct(record, 0.50),
        pct(record, 0.99),
        len(errors),
        cpu,
    )


def us(x: float) -> str:
    return "—" if x != x else f"{x * 1e6:,.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per case")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    ap.add_argument(
        "--connections", default="1,16,64", help="closed-loop connections, comma-separated"
    )
    ap.add_argument("--upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.upstream is not None:  # the child process of upstream()
        serve_upstream(args.upstream)
        return 0
    counts = [int(c) for c in args.connections.split(",") if c.strip()]
    nginx_bin = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    print(
        f"Router overhead: client → [router | nginx] → TRIVIAL UPSTREAM (fixed JSON, not an "
        f"engine); {args.warmup:g} s warm-up + {args.seconds:g} s per case; "
        f"{os.cpu_count()} cores; Python {sys.version.split()[0]}"
    )
    if shutil.which("wrk"):
        print("  (wrk is installed, but this benchmark uses its own client for every path)")
    if nginx_bin is None:
        print("  nginx: not installed (`which nginx` finds nothing): its column is skipped")

    rows: list[Row] = []
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-overhead-")))
        try:
            up_port, up = stack.enter_context(upstream(logs))
            paths = [Path_("direct", up_port, {"upstream": up.pid})]
            r_port, r_proc = stack.enter_context(router(logs, up_port))
            paths.append(Path_("router", r_port, {"router": r_proc.pid, "upstream": up.pid}))
            w_port, w_proc = stack.enter_context(router(logs, up_port, workers=2))
            paths.append(
                Path_("router×2", w_port, {"router": w_proc.pid, "upstream": up.pid}, {"router"})
            )
            if nginx_bin is not None:
                n_port, n_proc = stack.enter_context(nginx(nginx_bin, logs, up_port))
                worker = nginx_worker(n_proc.pid) or n_proc.pid
                paths.append(Path_("nginx", n_port, {"nginx": worker, "upstream": up.pid}))
        except RuntimeError as exc:
            print(f"bench/router_overhead.py: {exc}", file=sys.stderr)
            return 1
        for n in counts:
            for path in paths:
                row = measure(path, n, args.warmup, args.seconds)
                rows.append(row)
                print(
                    f"  {path.name:<8} × {n:>3} connections: {row.rps:>8,.0f} req/s, "
                    f"p50 {us(row.p50)} µs, p99 {us(row.p99)} µs",
                    flush=True,
                )

    print()
    header = (
        f"{'path':<8} {'conns':>5} {'req/s':>8} {'p50 µs':>8} {'p99 µs':>8} "
        f"{'added p50':>9} {'added p99':>9} {'errors':>6} | CPU (share of one core)"
    )
    print(header)
    print("-" * len(header))
    direct = {r.connections: r for r in rows if r.path == "direct"}
    for r in rows:
        base = direct.get(r.connections)
        added50 = added99 = "—"
        if base is not None and r.path != "direct":
            added50, added99 = us(r.p50 - base.p50), us(r.p99 - base.p99)
        cpu = ", ".join(f"{k} {v:.0%}" for k, v in r.cpu.items())
        print(
            f"{r.path:<8} {r.connections:>5} {r.rps:>8,.0f} {us(r.p50):>8} {us(r.p99):>8} "
            f"{added50:>9} {added99:>9} {r.errors:>6} | {cpu}"
        )
    for name, what in (("router", "1 worker"), ("router×2", "2 workers")):
        via = [r for r in rows if r.path == name]
        if not via:
            continue
        best = max(via, key=lambda r: r.rps)
        one = min(via, key=lambda r: r.connections)
        base = direct.get(one.connections)
        added = one.p50 - base.p50 if base else float("nan")
        cores = best.cpu.get("router", 0)
        print()
        print(
            f"Router ({what}) max rate: {best.rps:,.0f} req/s (at {best.connections} connections; "
            f"router CPU {cores:.0%} of one core) — goal ≥ {GOAL_RPS:,}: "
            f"{'met' if best.rps >= GOAL_RPS else 'NOT met'}"
        )
        print(
            f"Router ({what}) added p50 at {one.connections} connection(s): {us(added)} µs — "
            f"goal ≤ {GOAL_ADDED_P50_S * 1e6:,.0f} µs: "
            f"{'met' if added <= GOAL_ADDED_P50_S else 'NOT met'}"
        )
        if name == "router" and cores > 0.9:
            print(
                "  The router's one process is at a full core at its best rate: that core is "
                "its ceiling (one event loop); `--workers` adds processes."
            )
        busy = sum(best.cpu.values())
        if busy > 0.9 * (os.cpu_count() or 1):
            print(
                f"  The machine was saturated at that rate ({busy:.0%} of {os.cpu_count()} "
                "cores between client, router and upstream): the figure is a floor."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
