"""Priority passed to the engine: interactive p95 TTFT under a saturating mixed load, with the
router passing its class to the engine and without.

    .venv/bin/python bench/engine_priority.py [--seconds 30] [--speedup 20]

One STAND-IN replica in vLLM's dialect (`python -m fleet_agent.engine.standin.vllm serve ...
--scheduling-policy priority --max-num-seqs N`, 8B FP8 on a simulated H100, time compressed
by FLEET_STANDIN_SPEEDUP) behind `fleetctl router run` (a routing-table file: one deployment,
engine vllm, one replica). The router's per-replica limit is set far above the engine's
--max-num-seqs, so that requests wait inside the engine (where its priority policy orders
them), not in the router's waiting room (which orders classes by itself, engine or not).

Load, the same in both arms: `batch` clients in a closed loop (x-fleet-priority: batch, long
answers) keep the engine's batch full and its queue long; interactive requests (the default
class, short answers) arrive open loop at a fixed rate (a Poisson process, seeded). Every
request streams; TTFT is from the write to the first token chunk, client side.

Arms, one after the other on the same engine (it is left to empty between them):
  with      the router as deployed (FLEET_ROUTER_PASS_PRIORITY on): vLLM's `priority` field,
            0 interactive, 10 batch, reaches the engine
  without   FLEET_ROUTER_PASS_PRIORITY=false: every request reaches the engine without one
            (vLLM's default 0 for all: first come, first served)

Prints, side by side: interactive requests, p50 and p95 TTFT, batch requests completed and
their p95 TTFT; the run's parameters. Never fails on timing: exits non-zero only when
something does not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp
from measure import free_port, pct, wait_until  # run as a script: bench/ is on sys.path

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # a Hugging Face name: no weights directory needed
DEPLOYMENT = "llama-8b"


@dataclass
class Arm:
    name: str
    interactive_ttft: list[float] = field(default_factory=list)
    batch_ttft: list[float] = field(default_factory=list)
    batch_done: int = 0
    failed: int = 0


def start_engine(port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "FLEET_STANDIN_GPU": "H100",
        "FLEET_STANDIN_LOAD_S": "0.1",
        "FLEET_STANDIN_SPEEDUP": str(args.speedup),
    }
    argv = [sys.executable, "-m", "fleet_agent.engine.standin.vllm", "serve", MODEL]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--scheduling-policy", "priority"]
    argv += ["--max-num-seqs", str(args.max_num_seqs)]
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def start_router(
    engine_url: str, tmp: Path, arm: str, args: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], str]:
    table = tmp / f"table-{arm}.json"
    row = {
        "deployment": DEPLOYMENT,
        "models": [DEPLOYMENT, MODEL],
        "model_uri": f"hf://{MODEL}",
        "engine": "vllm",
        "tp_size": 1,
        "replicas": [{"server": "bench", "gpu_model": "H100", "url": engine_url}],
    }
    table.write_text(json.dumps({"results": [row]}))
    port = free_port()
    env = {
        **os.environ,
        "FLEET_ROUTER_PASS_PRIORITY": "true" if arm == "with" else "false",
        # Far above the engine's --max-num-seqs: requests queue in the engine, not the router.
        "FLEET_ROUTER_REPLICA_LIMIT": str(args.batch_clients + 256),
        "FLEET_ROUTER_QUEUE_TIMEOUT_S": "600",
        "FLEET_ROUTER_REPORT_S": "0",
        # About engine priority, not callers: explicitly unauthenticated.
        "FLEET_ROUTER_CLIENT_AUTH": "none",
        "FLEET_ROUTER_LOG_LEVEL": "WARNING",
    }
    argv = [sys.executable, "-m", "fleet.cli", "router", "run", "--table", str(table)]
    argv += ["--port", str(port)]
    with (tmp / f"router-{arm}.log").open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def one(
    http: aiohttp.ClientSession, url: str, priority: str, tokens: int, tag: str
) -> float | None:
    """One streamed completion; its TTFT (None: it failed)."""
    body = {
        "model": MODEL,
        "prompt": f"{tag}: " + "x" * 400,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    began = time.monotonic()
    ttft: float | None = None
    async with http.post(url, json=body, headers={"x-fleet-priority": priority}) as reply:
        if reply.status != 200:
            await reply.read()
            return None
        async for chunk in reply.content.iter_any():
            if ttft is None and b"data: {" in chunk:  # a completion's first event has a token
                ttft = time.monotonic() - began
    return ttft


async def run_arm(router_url: str, arm: Arm, args: argparse.Namespace) -> None:
    url = f"{router_url}/v1/completions"
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.seconds
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:

        async def batch_client(i: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                ttft = await one(http, url, "batch", args.batch_tokens, f"batch {i}.{n}")
                if ttft is None:
                    arm.failed += 1
                else:
                    arm.batch_ttft.append(ttft)
                    arm.batch_done += 1

        async def interactive(i: int) -> None:
            ttft = await one(http, url, "interactive", args.interactive_tokens, f"chat {i}")
            if ttft is None:
                arm.failed += 1
            else:
                arm.interactive_ttft.append(ttft)

        clients = [asyncio.create_task(batch_client(i)) for i in range(args.batch_clients)]
        # The batch load fills the engine first; then interactive requests arrive.
        await asyncio.sleep(min(args.warmup_s, args.seconds / 4))
        chats: list[asyncio.Task[None]] = []
        i = 0
        while time.monotonic() < deadline and i < 100_000:
            chats.append(asyncio.create_task(interactive(i)))
            i += 1
            await asyncio.sleep(rng.expovariate(args.interactive_rps))
        await asyncio.gather(*chats, *clients)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="load per arm")
    p.add_argument("--speedup", type=float, default=20.0, help="FLEET_STANDIN_SPEEDUP")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the engine's batch limit")
    p.add_argument("--batch-clients", type=int, default=48, help="closed-loop batch clients")
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--interactive-rps", type=float, default=4.0)
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="engine-priority-"))
    port = free_port()
    engine = start_engine(port, args, tmp / "engine.log")
    engine_url = f"http://127.0.0.1:{port}"
    arms = [Arm("with"), Arm("without")]
    try:
        wait_until(
            "the stand-in engine",
            partial(urlopen_ok, f"{engine_url}/health"),
            engine,
            60,
        )
        for arm in arms:
            router, router_url = start_router(engine_url, tmp, arm.name, args)
            try:
                ready = f"{router_url}/readyz"
                wait_until("the router", partial(urlopen_ok, ready), router, 60)
                asyncio.run(run_arm(router_url, arm, args))
            finally:
                stop(router)
            time.sleep(1.0)  # the engine is empty again (every request was awaited)
    finally:
        stop(engine)
    print(
        f"one stand-in vLLM replica (8B FP8, simulated H100, speedup {args.speedup:g}, "
        f"--max-num-seqs {args.max_num_seqs}, --scheduling-policy priority) behind the router; "
        f"{args.batch_clients} closed-loop batch clients ({args.batch_tokens} tokens), "
        f"interactive at {args.interactive_rps:g}/s ({args.interactive_tokens} tokens), "
        f"{args.seconds:g} s per arm; logs in {tmp}"
    )
    print(f"{'':34}{'with priority':>16}{'without':>16}")
    rows: list[tuple[str, Callable[[Arm], str]]] = [
        ("interactive requests", lambda a: f"{len(a.interactive_ttft)}"),
        ("interactive TTFT p50 (ms)", lambda a: f"{1000 * pct(a.interactive_ttft, 0.5):.0f}"),
        ("interactive TTFT p95 (ms)", lambda a: f"{1000 * pct(a.interactive_ttft, 0.95):.0f}"),
        ("batch requests completed", lambda a: f"{a.batch_done}"),
        ("batch TTFT p95 (ms)", lambda a: f"{1000 * pct(a.batch_ttft, 0.95):.0f}"),
        ("failed", lambda a: f"{a.failed}"),
    ]
    for label, cell in rows:
        print(f"{label:34}{cell(arms[0]):>16}{cell(arms[1]):>16}")
    return 0


def urlopen_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:  # not listening yet
        return False


if __name__ == "__main__":
    sys.exit(main())
