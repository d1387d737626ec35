"""Warm → serving with the version pre-staged in the spare's cache, and without, in the lab.

    .venv/bin/python bench/weights_boot.py [--size-gib 2] [--rounds 3] [--boot-delay 1.0]

Each round from scratch: a real `fleetctl serve` (embedded SQLite, loops on), a lab of two
1 × H100 IPMI spares (fleet/lab/), nginx on 127.0.0.1 serving one model version: a file of
`--size-gib` that every downloader must write out in full (tests/weights_peers.py: sparse on
the source's disk, but with 8 random bytes every 64 KiB, so the agent cannot write holes) and a
config. The deployment asks for one cached spare: the fleet pre-stages a spare (power on,
fetch, verify, power off). Then two scale-outs, one at a time: placement takes the staged
spare first, then the other, which must fetch the version before its engine starts. Printed
per round: each server's boot-to-ready as the fleet records it (`boot_to_ready_cached_s`,
`boot_to_ready_uncached_s`: power-on → all replicas ready), and the difference; then the
range. The lab's boot delay and the stand-in's load time are the same for both; what differs
is the fetch and verify (network, sha256, and this machine's disk). Never fails on timing;
exit 1 when the setup fails. Everything it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from colo_world import ipmi_inventory  # noqa: E402
from weights_peers import nginx_binary, nginx_peer, sparse_file  # noqa: E402

from fleet import db  # noqa: E402
from fleet.cli.lab import lab_token_maker  # noqa: E402
from fleet.lab.harness import (  # noqa: E402
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    ServeProcess,
    start_lab,
    wait_for,
)

MODEL = "llama-3.1-8b"
SERVERS = ("bench-h100-1", "bench-h100-2")
BOUND_S = 600.0


class SetupError(RuntimeError):
    """Something the measurement needs did not come up."""


def one_round(work: Path, size: int, boot_delay: float) -> tuple[float, float]:
    """(cached, uncached) boot-to-ready seconds as the fleet recorded them."""
    root = work / "files"
    made = sparse_file(root / "model.safetensors", size, seed=7, mark_every=64 << 10)
    (root / "config.json").write_text('{"model_type": "llama"}')
    config = (root / "config.json").read_bytes()
    with ExitStack() as stack:
        nginx = stack.enter_context(nginx_peer(root, work / "nginx"))
        service = ServeProcess(
            "serve",
            work / "data",
            FAST_SERVICE_SETTINGS
            | {
                "FLEET_BOOT_DEADLINE_S": str(BOUND_S),
                "FLEET_LOAD_DEADLINE_S": str(BOUND_S),
                "FLEET_STAGE_DEADLINE_S": str(BOUND_S),
                "FLEET_PROBE_INTERVAL_S": "0",
            },
        )
        stack.callback(service.stop)
        service.start(admin_token=True, error=SetupError)
        token = service.admin_token(error=SetupError)

        def api(method: str, path: str, **kwargs: Any) -> Any:
            reply = httpx.request(
                method,
                f"{service.url}/api/v1{path}",
                headers={"Authorization": f"Bearer {token}"},
                timeout=60,
                **kwargs,
            )
            if reply.status_code >= 400:
                raise SetupError(f"{method} {path}: HTTP {reply.status_code}: {reply.text[:300]}")
            return reply.json() if reply.content else None

        engine = db.make_engine(f"sqlite:///{work / 'data' / 'fleet.db'}")
        stack.callback(engine.dispose)
        colo = start_lab(
            service.url,
            token,
            ipmi_inventory("b", "b-r1", SERVERS, "H100", 1),
            work / "lab",
            token_for=lab_token_maker(engine),
            boot_delay_s=boot_delay,
            agent_env=FAST_AGENT_SETTINGS | {"FLEET_AGENT_CACHE_BYTES": str(size + (1 << 30))},
        )
        stack.callback(colo.down)
        for _ in range(10):
            if not api("POST", "/verify", json={"select": {"state": "enrolled"}})["failed"]:
                break
            time.sleep(0.5)

        def states() -> dict[str, str]:
            return {r["name"]: r["state"] for r in api("GET", "/servers")["results"]}

        wait_for(
            "both spares warm", lambda: set(states().values()) == {"warm"}, 60, error=SetupError
        )
        api(
            "POST",
            "/models",
            json={
                "model": MODEL,
                "version": "v1",
                "artifacts": [
                    {
                        "name": "model.safetensors",
                        "uri": nginx.url("model.safetensors"),
                        "sha256": made.sha256,
                        "size_bytes": made.size,
                    },
                    {
                        "name": "config.json",
                        "uri": nginx.url("config.json"),
                        "sha256": hashlib.sha256(config).hexdigest(),
                        "size_bytes": len(config),
                    },
                ],
            },
        )
        api(
            "POST",
            "/deployments",
            json={
                "name": "chat",
                "model_version": f"{MODEL}@v1",
                "gpu_models": ["H100"],
                "max_replicas": 2,
                "cached_spares": 1,
                "sla_p95_latency_ms": 60_000,
                "sla_ttft_ms": 60_000,
            },
        )

        def staged() -> list[str]:
            rows = api("GET", "/servers")["results"]
            return [
                r["name"]
                for r in rows
                if r["state"] == "warm"
                and any(
                    e["key"] == f"{MODEL}@v1" and e["state"] == "ready" for e in r["cache_entries"]
                )
            ]

        [hot] = wait_for("a spare pre-staged", staged, BOUND_S, error=SetupError)
        api("PATCH", "/deployments/chat", json={"cached_spares": 0})
        for expect in ("cached", "cold"):
            booted = api("POST", "/spares/boot", json={"deployment": "chat", "count": 1})["booted"]
            if expect == "cached" and booted != [hot]:
                raise SetupError(f"placement took {booted}, not the staged {hot}")
            [name] = booted

            def serving(name: str = name) -> bool:
                return states()[name] == "serving"

            wait_for(f"{name} serving", serving, BOUND_S, error=SetupError)
        rows = {r["name"]: r for r in api("GET", "/servers")["results"]}
        [cold] = [n for n in SERVERS if n != hot]
        return rows[hot]["boot_to_ready_cached_s"], rows[cold]["boot_to_ready_uncached_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--boot-delay", type=float, default=1.0)
    args = parser.parse_args()
    if nginx_binary() is None:
        print("nginx is required (Debian nginx-light)", file=sys.stderr)
        return 1
    size = int(args.size_gib * (1 << 30))
    print(f"warm → serving, {args.size_gib:g} GiB version, boot delay {args.boot_delay:g} s")
    print("round  cached s  not cached s  difference s")
    diffs = []
    for n in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="fleet-weights-boot-") as tmp:
            try:
                hot, cold = one_round(Path(tmp), size, args.boot_delay)
            except SetupError as exc:
                print(f"setup failed: {exc}", file=sys.stderr)
                return 1
        diffs.append(cold - hot)
        print(f"{n:5d}  {hot:8.1f}  {cold:12.1f}  {cold - hot:12.1f}", flush=True)
    print(
        f"difference: min {min(diffs):.1f} s, median {statistics.median(diffs):.1f} s,"
        f" max {max(diffs):.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
