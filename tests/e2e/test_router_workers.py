"""`fleetctl router run --workers 2`: two whole routers sharing one port (SO_REUSEPORT), in front
of a real stand-in engine; the parent passes SIGTERM on, and a worker that dies stops the rest."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
from procs import alive
from test_router_proxy import Router, engines, replica, stack, wait_for

__all__ = ["stack"]  # the fixture, used by name


def children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def test_two_workers_share_the_port_and_stop_together(stack: ExitStack, tmp_path: Path) -> None:
    [engine] = engines(stack, tmp_path, ["H100"], speedup=50)
    router = Router(tmp_path, [replica(engine, "H100")], FLEET_ROUTER_WORKERS="2")
    stack.callback(router.stop)
    parent = router.proc.pid
    workers = children(parent)
    assert len(workers) == 2

    def one(k: int) -> int:
        # a connection of its own each: the kernel spreads new connections over the workers
        reply = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "llama", "prompt": f"request {k}", "max_tokens": 2},
            timeout=30,
        )
        return reply.status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(40)))
    assert codes == [200] * 40
    wait_for("the engine's count", lambda: engine.served() == 40, 10)

    # SIGTERM to the parent alone: it passes it on and waits for both
    os.kill(parent, signal.SIGTERM)
    assert router.proc.wait(timeout=15) == 0
    assert not any(alive(w) for w in workers)


def test_a_worker_that_dies_stops_the_others(stack: ExitStack, tmp_path: Path) -> None:
    [engine] = engines(stack, tmp_path, ["H100"], speedup=50)
    router = Router(tmp_path, [replica(engine, "H100")], FLEET_ROUTER_WORKERS="2")
    stack.callback(router.stop)
    first, second = sorted(children(router.proc.pid))
    os.kill(first, signal.SIGKILL)
    assert router.proc.wait(timeout=15) == 1  # whatever supervises it restarts the router
    wait_for("the other worker to stop", lambda: not alive(second), 10)
