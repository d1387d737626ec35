"""Model weights end to end (issue 23): versions fetched into every server's cache from a real
HTTP server and a real S3 API server, spares pre-staged, cached spares booted first, and
rollouts through a real router, good and bad.

The world (tests/colo_world.py): `fleetctl serve` on its embedded SQLite database with its
loops on, a lab of five 1 × H100 IPMI servers whose agents run STAND-IN engines and keep their
cache across power cycles (a 3 GiB budget each), and the weights' sources on 127.0.0.1:

- nginx (tests/weights_peers.py) serving generated sparse files (multi-GB ones cost no disk);
- moto's S3 API server, signatures checked, holding one shard of the first version;
- tests/faulty_http.py, a plain HTTP server that cuts the first download of the big shard
  part-way and flips a byte in the next one, then behaves.

One scenario, in order (`pytest -s` prints the figures):

1. Bad input refused at the API: a version with an unknown URI scheme (400; the CLI one line,
   exit 1; nothing created).
2. Bad sources, found by pre-staging (three deployments, `cached_spares: 1` each): an
   unreachable source, a wrong sha256 and a version larger than the cache budget each fail on
   their spare with a clear error (`server.weights_failed`, `deployment.weights_failed`),
   nothing of them becomes visible in the cache, and the spares go back to warm.
3. Deployment `chat` on `llama-3.1-8b@v1` (a 2 GiB shard over HTTP, a shard from S3, a config)
   with `cached_spares: 1`: one spare is pre-staged. Its download is cut and resumes with a
   Range request; the resumed copy carries a flipped byte, is caught, discarded and fetched
   again (Events say both); the spare powers off holding v1 verified.
4. Two scale-outs: placement takes the staged spare first (its Event and `autoscaler explain`
   say "cached"), then one without the version. The cached spare reaches serving without one
   request to the source; the other fetches the version in its boot (counted at the source).
   Both boots are recorded by kind; how much faster the cached one is, is bench/weights_boot.py's
   to measure (here the shard is mostly holes and two seconds of noise hide the fetch).
5. Through a router under steady load: a rollout to v2 (good) completes; a rollout to `bad`
   (half its answers are HTTP 500) is rolled back automatically at the canary step, with
   fewer failed requests than the canary's share of the window. Router metrics count requests
   by version; every cache stayed within its budget and kept what was in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from colo_world import World, colo_world, ipmi_inventory
from faulty_http import FaultyFiles, FaultyServer
from weights_peers import moto_peer, nginx_binary, nginx_peer, sparse_file

from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    SERVING_SETTINGS,
    RouterProcess,
)
from fleet.lab.harness import wait_for as _wait_for

for tool in ("ipmi_sim", "ipmitool"):
    if shutil.which(tool) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{tool} is required in CI", pytrace=False)
        pytest.skip(f"{tool} not installed (Debian openipmi, ipmitool)", allow_module_level=True)
if nginx_binary() is None:
    if os.environ.get("CI") == "true":
        pytest.fail("nginx is required in CI", pytrace=False)
    pytest.skip("nginx not installed (Debian nginx-light)", allow_module_level=True)

GIB, MIB = 1 << 30, 1 << 20
SITE, RACK = "wt", "wt-r01"
SERVERS = tuple(f"{RACK}-h100-{i}" for i in range(1, 6))
MODEL = "llama-3.1-8b"  # the stand-in's cost model knows it by this name
BUDGET = 3 * GIB  # each server's cache
BIG = 2 * GIB  # v1's first shard: multi-GB, sparse
CUT_AFTER = 300 * MIB  # the first download of it stops here
FLIP_AT = 1 * GIB + 12345  # the second (the resumed one) has this byte inverted
SERVICE_SETTINGS = (
    FAST_SERVICE_SETTINGS
    | SERVING_SETTINGS
    | {
        # A boot now includes a fetch of up to 2 GiB on a busy 2-core machine.
        "FLEET_BOOT_DEADLINE_S": "120",
        "FLEET_LOAD_DEADLINE_S": "120",
        "FLEET_STAGE_DEADLINE_S": "120",
        "FLEET_ROLLOUT_INTERVAL_S": "0.5",
        "FLEET_ROLLOUT_STEP_S": "6",
        "FLEET_ROLLOUT_MIN_REQUESTS": "20",
        "FLEET_AUTOSCALE_INTERVAL_S": "1",
    }
)
AGENT_ENV = FAST_AGENT_SETTINGS | {"FLEET_AGENT_CACHE_BYTES": str(BUDGET)}
SERVE_TIMEOUT_S = 150.0
wait_for = partial(_wait_for, every=0.25)


# ---------------------------------------------------------------------------------------------
# The weights' sources and the versions that name them


class Sources:
    """nginx, moto and the faulty server over one directory of generated files."""

    def __init__(self, root: Path, nginx: Any, s3: Any, faulty: FaultyServer) -> None:
        self.root, self.nginx, self.s3, self.faulty = root, nginx, s3, faulty
        self.files: dict[str, Any] = {}

    def make(self, name: str, size: int, seed: int) -> Any:
        made = sparse_file(self.root / name, size, seed=seed)
        self.files[name] = made
        return made

    def text(self, name: str, body: str) -> tuple[str, int]:
        path = self.root / name
        path.write_text(body)
        return hashlib.sha256(body.encode()).hexdigest(), len(body.encode())

    def artifact(self, name: str, uri: str, *, as_name: str | None = None) -> dict[str, Any]:
        made = self.files[name]
        return {
            "name": as_name or name,
            "uri": uri,
            "sha256": made.sha256,
            "size_bytes": made.size,
        }


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sources]:
    base = tmp_path_factory.mktemp("weights-sources")
    root = base / "files"
    root.mkdir()
    with nginx_peer(root, base / "nginx") as nginx, moto_peer(base / "moto") as s3:
        files = FaultyFiles(root, cut_after=CUT_AFTER, flip_at=FLIP_AT)
        faulty = FaultyServer(files)
        try:
            yield Sources(root, nginx, s3, faulty)
        finally:
            faulty.stop()


def versions(src: Sources) -> dict[str, dict[str, Any]]:
    """Every version the scenario uses (files generated now), by name."""
    src.make("v1-shard1.safetensors", BIG, seed=1)
    src.make("v1-shard2.safetensors", 64 * MIB, seed=2)
    src.make("v2-shard1.safetensors", 256 * MIB, seed=3)
    src.make("bad-shard1.safetensors", 256 * MIB, seed=4)
    src.make("big.safetensors", BUDGET + 512 * MIB, seed=5)
    src.make("small.safetensors", 8 * MIB, seed=6)
    config_sha, config_size = src.text("config.json", json.dumps({"model_type": "llama"}))
    bad_sha, bad_size = src.text("bad-standin.json", json.dumps({"errors": 0.5}))
    src.s3.create_bucket("weights")
    src.s3.upload("weights", "llama/v1/shard2", src.root / "v1-shard2.safetensors")
    src.faulty.files.faults["v1-shard1.safetensors"] = ["cut", "flip"]
    config = {
        "name": "config.json",
        "uri": src.nginx.url("config.json"),
        "sha256": config_sha,
        "size_bytes": config_size,
    }

    def version(name: str, artifacts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": MODEL, "version": name, "artifacts": artifacts}

    return {
        "v1": version(
            "v1",
            [
                src.artifact(
                    "v1-shard1.safetensors",
                    f"{src.faulty.url}/v1-shard1.safetensors",
                    as_name="model-00001-of-00002.safetensors",
                ),
                src.artifact(
                    "v1-shard2.safetensors",
                    "s3://weights/llama/v1/shard2",
                    as_name="model-00002-of-00002.safetensors",
                ),
                config,
            ],
        ),
        "v2": version(
            "v2",
            [
                src.artifact(
                    "v2-shard1.safetensors",
                    src.nginx.url("v2-shard1.safetensors"),
                    as_name="model.safetensors",
                ),
                config,
            ],
        ),
        "bad": version(
            "bad",
            [
                src.artifact(
                    "bad-shard1.safetensors",
                    src.nginx.url("bad-shard1.safetensors"),
                    as_name="model.safetensors",
                ),
                config,
                {
                    "name": "fleet-standin.json",
                    "uri": src.nginx.url("bad-standin.json"),
                    "sha256": bad_sha,
                    "size_bytes": bad_size,
                },
            ],
        ),
        # Bad sources: nothing listens on port 9 of 127.0.0.1 (discard: not run here)...
        "unreachable": version(
            "unreachable",
            [{**src.artifact("small.safetensors", "http://127.0.0.1:9/small"), "name": "m"}],
        ),
        # ...a sha256 that is not the file's...
        "wrongsum": version(
            "wrongsum",
            [
                {
                    **src.artifact("small.safetensors", src.nginx.url("small.safetensors")),
                    "sha256": "0" * 64,
                }
            ],
        ),
        # ...and more than the cache can ever hold.
        "toolarge": version(
            "toolarge", [src.artifact("big.safetensors", src.nginx.url("big.safetensors"))]
        ),
    }


# ---------------------------------------------------------------------------------------------
# The world


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, sources: Sources) -> Iterator[World]:
    base = tmp_path_factory.mktemp("weights-world")
    inventory = ipmi_inventory(SITE, RACK, SERVERS, "H100", 1)
    with colo_world(
        base,
        inventory,
        SERVICE_SETTINGS,
        boot_delay_s=0.5,
        agent_env=AGENT_ENV | sources.s3.agent_env(),
    ) as w:
        yield w


def deployment(name: str, version: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model_version": f"{MODEL}@{version}",
        "gpus_per_replica": 1,
        "gpu_models": ["H100"],
        "min_replicas": 0,
        "max_replicas": 2,
        "sla_p95_latency_ms": 60_000,
        "sla_ttft_ms": 60_000,
        **extra,
    }


def events(world: World, kind: str, **params: Any) -> list[dict[str, Any]]:
    return world.api.events(kind=kind, **params)


def server(world: World, name: str) -> dict[str, Any]:
    return dict(world.api("GET", f"/servers/{name}"))


def cache_entry(row: dict[str, Any], key: str) -> dict[str, Any] | None:
    return next((e for e in row.get("cache_entries") or [] if e["key"] == key), None)


def holders(world: World, key: str, state: str = "ready") -> list[str]:
    return sorted(
        s["name"]
        for s in world.servers()
        if (e := cache_entry(s, key)) is not None and e["state"] == state
    )


# ---------------------------------------------------------------------------------------------
# Load through the router


class Load:
    """Closed-loop clients through the router; every answer's status and time kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.codes: list[tuple[float, int]] = []
        self.last_body = ""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": "Say hello to the fleet.", "max_tokens": 4}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and len(self.codes) < 200_000:
                try:
                    reply = client.post(f"{self.url}/v1/completions", json=body)
                    code = reply.status_code
                    if code != 200:
                        self.last_body = reply.text
                except httpx.HTTPError as exc:
                    code, self.last_body = 0, repr(exc)
                self.codes.append((time.monotonic(), code))

    def answers(self) -> str:
        counts: dict[int, int] = {}
        for _, code in list(self.codes):
            counts[code] = counts.get(code, 0) + 1
        return f"answers by HTTP status: {counts}; last body: {self.last_body[:300]!r}"

    def since(self, t: float) -> list[int]:
        return [code for at, code in list(self.codes) if at >= t]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(35)


def router_requests_by_version(router_url: str) -> dict[str, float]:
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("router_requests_total{") and 'version="' in line:
            version = re.search(r'version="([^"]*)"', line)
            assert version is not None
            out[version.group(1)] = out.get(version.group(1), 0.0) + float(line.split()[-1])
    return out


# ---------------------------------------------------------------------------------------------
# The scenario


def test_weights_reach_the_gpus_staged_cached_and_rolled_out(
    world: World, sources: Sources, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    made = versions(sources)
    figures: list[str] = []

    # 1. An unknown scheme: refused by the API and the CLI, nothing created.
    ftp = {
        "model": MODEL,
        "version": "ftp",
        "artifacts": [
            {"name": "m", "uri": "ftp://127.0.0.1/m", "sha256": "a" * 64, "size_bytes": 1}
        ],
    }
    reply = world.api.request("POST", "/models", json=ftp)
    assert reply.status_code == 400 and "ftp" in reply.text, reply.text
    spec = tmp_path / "ftp.yaml"
    spec.write_text(yaml.safe_dump(ftp))
    refused = world.fleetctl("models", "create", "-f", str(spec))
    assert refused.exit_code != 0
    assert len(refused.output.strip().splitlines()) == 1 and "scheme" in refused.output
    assert world.api.request("GET", f"/models/{MODEL}/versions/ftp").status_code == 404

    for name, body in made.items():
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump(body))
        created = world.fleetctl("models", "create", "-f", str(spec))
        assert created.exit_code == 0, created.output

    # 2. Bad sources, found on pre-staged spares: each a clear error on the server and the
    #    deployment; nothing of them in any cache; the spares back to warm.
    broken = {"unreachable": "unreachable", "wrongsum": "sha256", "toolarge": "does not fit"}
    for version in broken:
        world.api("POST", "/deployments", json=deployment(f"b-{version}", version, cached_spares=1))
    for version, words in broken.items():
        key = f"{MODEL}@{version}"

        def failures(key: str = key) -> list[dict[str, Any]]:
            return [e for e in events(world, "server.weights_failed") if key in e["message"]]

        seen_failed = wait_for(f"{key} failed on a spare", failures, SERVE_TIMEOUT_S, why=world.why)
        assert words in seen_failed[0]["message"].lower(), seen_failed[0]
        on_deployment = [
            e
            for e in events(world, "deployment.weights_failed", subject=f"b-{version}")
            if key in e["message"]
        ]
        assert on_deployment, f"no deployment.weights_failed for {key}"
        figures.append(f"{key}: {seen_failed[0]['message']}")
    for version in broken:
        world.api("PATCH", f"/deployments/b-{version}", json={"cached_spares": 0})
    wait_for(
        "every spare back to warm",
        lambda: set(world.states().values()) == {"warm"},
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    for name in SERVERS:
        cache = world.colo.cache_dir(name)
        for version in broken:
            shown = cache / MODEL / version / MODEL
            assert not shown.exists() or not any(shown.iterdir()), f"{shown} holds files"

    # 3. chat on v1, one spare pre-staged: cut → resumed; flipped byte → discarded, again.
    v1 = f"{MODEL}@v1"
    world.api("POST", "/deployments", json=deployment("chat", "v1", cached_spares=1))

    def staged_spares() -> list[str]:
        held = holders(world, v1)
        states = world.states()
        return held if held and all(states[name] == "warm" for name in held) else []

    [staged] = wait_for(
        "a spare holding v1 and back to warm", staged_spares, SERVE_TIMEOUT_S, why=world.why
    )
    seen = sources.faulty.files.seen
    big = [s for s in seen if s.path == "v1-shard1.safetensors"]
    assert big[0].fault == "cut" and big[1].range == f"bytes={CUT_AFTER}-", big
    assert any(e["subject"] == staged for e in events(world, "server.weights_resumed"))
    assert any(e["subject"] == staged for e in events(world, "server.weights_checksum_mismatch"))
    assert any(e["subject"] == staged for e in events(world, "server.staged"))
    figures.append(f"staged {staged}: GETs of the big shard {[(s.range, s.fault) for s in big]}")

    # 4. Scale out twice: the staged spare first, then a cold one; the cached boot asks the
    #    source for nothing. (No more staging meanwhile: the pool would be topped up to one
    #    spare holding v1 again.)
    world.api("PATCH", "/deployments/chat", json={"cached_spares": 0})

    def big_gets() -> list[Any]:
        return [s for s in sources.faulty.files.seen if s.path == "v1-shard1.safetensors"]

    gets_before = len(big_gets())
    explain = world.fleetctl("autoscaler", "explain", "chat")
    assert explain.exit_code == 0, explain.output
    booted = world.api("POST", "/spares/boot", json={"deployment": "chat", "count": 1})
    assert booted["booted"] == [staged], booted
    wait_for(
        "the cached spare serving",
        lambda: world.states()[staged] == "serving",
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    moves = [
        e for e in events(world, "server.transition", subject=staged) if "cached" in e["message"]
    ]
    assert moves, "the boot's Event does not say the version was cached"
    assert len(big_gets()) == gets_before, big_gets()[gets_before:]
    booted = world.api("POST", "/spares/boot", json={"deployment": "chat", "count": 1})
    [cold] = booted["booted"]
    wait_for(
        "the cold spare serving",
        lambda: world.states()[cold] == "serving",
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    hot, cold_row = server(world, staged), server(world, cold)
    hot_s, cold_s = hot["boot_to_ready_cached_s"], cold_row["boot_to_ready_uncached_s"]
    assert hot_s is not None and cold_s is not None, {
        k: (hot.get(k), cold_row.get(k))
        for k in (
            "boot_to_ready_s",
            "boot_to_ready_cached_s",
            "boot_to_ready_uncached_s",
            "boot_kind",
            "state",
            "model_version",
        )
    }
    fetched = big_gets()[gets_before:]
    assert [(s.range, s.fault) for s in fetched] == [(None, None)], fetched
    assert any(e["subject"] == cold for e in events(world, "server.weights_ready")), cold
    assert (cache_entry(cold_row, v1) or {}).get("state") == "ready", cold_row["cache_entries"]
    figures.append(
        f"warm → serving: cached {hot_s:.1f} s (no GET), not cached {cold_s:.1f} s (one GET of "
        "the big shard)"
    )

    world.api("PATCH", "/deployments/chat", json={"cached_spares": 1})

    # 5. Rollouts through a real router under load.
    settings = {
        "FLEET_ROUTER_FLEET_URL": world.service.url,
        "FLEET_ROUTER_TOKEN": world.api.token,
        "FLEET_ROUTER_FLEET_POLL_S": "0.3",
        "FLEET_ROUTER_REPORT_S": "0.5",
        # About rollouts, not callers: explicitly unauthenticated.
        "FLEET_ROUTER_CLIENT_AUTH": "none",
    }
    router = RouterProcess(tmp_path / "router.log", settings)
    try:
        with Load(router.url) as load:
            wait_for(
                "answers through the router",
                lambda: load.since(t0).count(200) > 20,
                60,
                why=lambda: f"{load.answers()}\n{router.tail()}\n{world.why()}",
            )
            good = world.fleetctl(
                "deployments",
                "rollout",
                "chat",
                "--version",
                "v2",
                "--canary",
                "50%",
                "--step-s",
                "6",
                "--min-requests",
                "20",
            )
            assert good.exit_code == 0, good.output
            wait_for(
                "the rollout to v2 complete",
                lambda: (
                    world.api("GET", "/deployments/chat")["model_version"] == f"{MODEL}@v2"
                    and not world.api("GET", "/deployments/chat")["canary_version"]
                ),
                SERVE_TIMEOUT_S,
                why=world.why,
            )
            assert events(world, "deployment.rollout_complete", subject="chat")
            wait_for(
                "both servers serving v2",
                lambda: all(
                    r.get("version") == f"{MODEL}@v2" and r.get("state") == "ready"
                    for s in (staged, cold)
                    for r in server(world, s)["replicas"]
                ),
                SERVE_TIMEOUT_S,
                why=world.why,
            )
            opened = time.monotonic()
            bad = world.fleetctl(
                "deployments",
                "rollout",
                "chat",
                "--version",
                "bad",
                "--canary",
                "50%",
                "--step-s",
                "6",
                "--min-requests",
                "20",
            )
            assert bad.exit_code == 0, bad.output
            [rollback] = wait_for(
                "the rollout to bad rolled back",
                lambda: events(world, "deployment.rollback", subject="chat"),
                SERVE_TIMEOUT_S,
                why=world.why,
            )
            closed = time.monotonic()
            window = [c for at, c in list(load.codes) if opened <= at <= closed]
            failed = sum(1 for c in window if c != 200)
            figures.append(
                f"bad rollout: {failed} of {len(window)} requests failed in its window;"
                f" rollback: {rollback['message']}"
            )
            assert window and failed < 0.5 * len(window), (failed, len(window))
            dep = world.api("GET", "/deployments/chat")
            assert dep["model_version"] == f"{MODEL}@v2" and not dep["canary_version"]
        by_version = router_requests_by_version(router.url)
        figures.append(f"router requests by version: {by_version}")
        for v in ("v1", "v2", "bad"):
            assert by_version.get(f"{MODEL}@{v}", 0) > 0, by_version
    finally:
        router.stop()

    # The spares follow the version: one warm spare comes to hold v2.
    [restaged] = wait_for(
        "a warm spare holding v2",
        lambda: [s for s in holders(world, f"{MODEL}@v2") if world.states()[s] == "warm"],
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    figures.append(f"{restaged} staged v2 after the rollout")

    # Every cache within its budget; nothing in use evicted (the serving servers hold v2).
    for row in world.servers():
        if row["cache_used_bytes"] is not None:
            assert row["cache_used_bytes"] <= row["cache_budget_bytes"], row["name"]
    for name in (staged, cold):
        entry = cache_entry(server(world, name), f"{MODEL}@v2")
        assert entry is not None and entry["state"] == "ready", name
    print("\n" + "\n".join(figures) + f"\ntotal {time.monotonic() - t0:.0f} s")
