"""The agent's own HTTP API: /healthz, /readyz, /state, /metrics (open), and /probe and
/faults (the simulated backend only), which need the agent's key.

Starlette under uvicorn, on a socket bound before the server starts (port 0 picks a free one:
the caller learns it at once). Routers and the fleet read this API; nothing here writes to the
fleet.
"""

from __future__ import annotations

import hmac
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from fleet_agent.daemon import Agent
from fleet_core.fault_policy import Verdict

_VERDICT_LEVEL = {Verdict.HEALTHY: 0, Verdict.DEGRADED: 1, Verdict.UNHEALTHY: 2}
MIB = 1024 * 1024
# /probe and /faults: bounded work per request (the fleet's probe is 16 tokens by default).
MAX_PROBE_TOKENS = 256
MAX_PROBE_PROMPT_CHARS = 2000
MAX_FAULTS = 64
MAX_BODY_BYTES = 64 * 1024


class AgentCollector(Collector):
    """The agent's series (docs/metrics.md): `agent_gpu_*` per GPU from the latest snapshot,
    Xids counted from the snapshots, `agent_replica_*` per engine replica from the supervisor,
    and the agent's own state and counters.

    Xid events arrive once each, in the snapshot taken after them (fleet_core/telemetry.py),
    and the agent keeps `history_s` (15 minutes) of snapshots: each scrape counts the events
    of the snapshots newer than the last one it counted, so the counter misses nothing as long
    as Prometheus scrapes more often than that.
    """

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._lock = threading.Lock()  # two scrapes at once must not count an Xid twice
        self._counted_until = float("-inf")  # snapshots up to this time are counted
        self._xids: dict[str, int] = {}  # GPU index ("" when the event names none) -> count
        self._last_xid: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        yield from self._gpus()
        yield from self._replicas()
        yield from self._weights()
        yield from self._own_state()

    def _weights(self) -> Iterator[Metric]:
        """agent_weights_*: the cache's room and contents, and its fetches since start."""
        cache = self.agent.cache
        if cache is None:
            return
        report = cache.report()
        c = cache.counters
        yield GaugeMetricFamily(
            "agent_weights_cache_budget_bytes",
            "The weights cache's byte budget",
            value=report.budget_bytes,
        )
        yield GaugeMetricFamily(
            "agent_weights_cache_used_bytes",
            "Bytes the weights cache holds (verified files and partial ones)",
            value=report.used_bytes,
        )
        if report.free_bytes is not None:
            yield GaugeMetricFamily(
                "agent_weights_cache_free_bytes",
                "Free space on the weights cache's file system",
                value=report.free_bytes,
            )
        versions = GaugeMetricFamily(
            "agent_weights_versions", "Model versions in the cache, by state", labels=["state"]
        )
        for state in ("ready", "fetching", "failed"):
            versions.add_metric([state], sum(1 for e in report.entries if e.state == state))
        yield versions
        for name, help_text, value in (
            ("fetched_bytes", "Bytes fetched into the weights cache", c.fetched_bytes),
            ("fetch_seconds", "Seconds spent fetching weights", c.fetch_seconds),
            ("files_fetched", "Weight files fetched and verified", c.files_fetched),
            (
                "checksum_failures",
                "Fetched files whose sha256 did not match (discarded)",
                c.checksum_failures,
            ),
            ("fetch_failures", "Versions whose fetch failed", c.fetch_failures),
            ("resumes", "Fetches that resumed after a cut", c.resumes),
            ("evictions", "Versions evicted from the cache (least recently used)", c.evictions),
        ):
            yield CounterMetricFamily(f"agent_weights_{name}", help_text, value=value)

    def _gpus(self) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]

        def gauge(name: str, help_text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"agent_gpu_{name}", help_text, labels=labels)

        # field of GpuSample -> (family, factor to base units)
        fields: dict[str, tuple[GaugeMetricFamily, float]] = {
            "temperature_c": (gauge("temperature_celsius", "GPU temperature"), 1.0),
            "slowdown_temp_c": (
                gauge(
                    "slowdown_temperature_celsius",
                    "Temperature at which the GPU slows its clocks down (its own threshold)",
                ),
                1.0,
            ),
            "memory_used_mib": (gauge("memory_used_bytes", "GPU memory used"), MIB),
            "memory_total_mib": (gauge("memory_total_bytes", "GPU memory total"), MIB),
            "utilization_pct": (
                gauge(
                    "utilization_ratio",
                    "Share of the last sample period (about a second) a kernel ran, 0 to 1",
                ),
                0.01,
            ),
            "power_w": (gauge("power_watts", "GPU power draw"), 1.0),
            "power_limit_w": (gauge("power_limit_watts", "GPU power limit"), 1.0),
            "clock_events": (
                gauge("clock_events", "NVML clocks-event (throttle) reason bit mask"),
                1.0,
            ),
        }
        ecc = CounterMetricFamily(
            "agent_gpu_ecc_uncorrected_errors",
            "Uncorrected ECC errors since the driver loaded (volatile: a reload resets it)",
            labels=labels,
        )
        lost = gauge("lost", "1 when the GPU stopped answering (fell off the bus)")
        remap_pending = gauge("remap_pending", "1 when a row remap waits for a GPU reset")
        remap_failed = gauge("remap_failed", "1 when a row remap failed (no spare rows left)")
        xids = CounterMetricFamily(
            "agent_gpu_xid_errors",
            "NVIDIA driver Xid errors seen (NVML, DCGM or the kernel log)",
            labels=labels,
        )
        last_xid = gauge(
            "last_xid", "The code of the latest Xid error (0: none since the agent started)"
        )
        snapshot = self.agent.latest()
        gpus = snapshot.gpus if snapshot else ()
        uuids = {str(gpu.index): gpu.uuid or "" for gpu in gpus}
        counted, last = self._count_xids()
        for gpu in gpus:
            values = [str(gpu.index), gpu.uuid or ""]
            for field, (family, factor) in fields.items():
                value = getattr(gpu, field)
                if value is not None:
                    family.add_metric(values, float(value) * factor)
            if gpu.ecc_uncorrected_volatile is not None:
                ecc.add_metric(values, float(gpu.ecc_uncorrected_volatile))
            lost.add_metric(values, float(gpu.lost))
            if gpu.remap_pending is not None:
                remap_pending.add_metric(values, float(gpu.remap_pending))
            if gpu.remap_failed is not None:
                remap_failed.add_metric(values, float(gpu.remap_failed))
        for index in sorted({*uuids, *counted}):
            values = [index, uuids.get(index, "")]
            xids.add_metric(values, counted.get(index, 0))
            last_xid.add_metric(values, last.get(index, 0))
        yield from (family for family, _ in fields.values())
        yield from (ecc, lost, remap_pending, remap_failed, xids, last_xid)

    def _count_xids(self) -> tuple[dict[str, int], dict[str, int]]:
        # deque.copy() runs in C under the GIL: a consistent copy while the daemon appends.
        history = self.agent.history.copy()
        with self._lock:
            for snapshot in history:
                if snapshot.at <= self._counted_until:
                    continue
                for event in sorted(snapshot.xids, key=lambda e: e.at):
                    index = "" if event.gpu_index is None else str(event.gpu_index)
                    self._xids[index] = self._xids.get(index, 0) + 1
                    self._last_xid[index] = event.xid
                self._counted_until = snapshot.at
            return dict(self._xids), dict(self._last_xid)

    def _replicas(self) -> Iterator[Metric]:
        labels = ["deployment", "replica"]

        def gauge(name: str, help_text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"agent_replica_{name}", help_text, labels=labels)

        ready = gauge("ready", "1 when the engine replica answers /health (state ready)")
        gpus = gauge("gpus", "GPUs the replica runs on")
        # replica_stats() key -> family
        stats = {
            "queued": gauge("queued_requests", "Requests waiting in the engine's queue"),
            "running": gauge("running_requests", "Requests the engine is running (in the batch)"),
            "kv_used_fraction": gauge(
                "kv_cache_used_ratio", "KV-cache blocks in use ÷ the engine's maximum, 0 to 1"
            ),
            "cache_hit_rate": gauge(
                "kv_cache_hit_ratio", "KV-cache block reuse (prefix hits) ÷ lookups, 0 to 1"
            ),
            "load_seconds": gauge(
                "load_seconds", "Engine start to its first /health 200 (model load), last start"
            ),
        }
        paused = gauge(
            "paused_requests",
            "Requests the engine paused (preempted: evicted from the batch for KV-cache "
            "space) in its newest iteration; 0 when it ran none",
        )
        restarts = CounterMetricFamily(
            "agent_replica_restarts", "Engine restarts (crashes, unhealthy)", labels=labels
        )
        preemptions = CounterMetricFamily(
            "agent_replica_preemptions",
            "Requests the engine preempted (evicted from the batch for KV-cache space, resumed "
            "later), the engine's own cumulative count; absent where the engine has none",
            labels=labels,
        )
        supervisor = self.agent.supervisor
        deployment = (supervisor.deployment if supervisor is not None else None) or ""
        for replica in self.agent.replicas():
            index = int(replica["index"])
            values = [deployment, str(index)]
            ready.add_metric(values, float(replica.get("state") == "ready"))
            gpus.add_metric(values, len(replica.get("gpus") or ()))
            for key, family in stats.items():
                value = replica.get(key)
                if value is not None:
                    family.add_metric(values, float(value))
            paused.add_metric(values, self._paused(index))
            restarts.add_metric(values, int(replica.get("restarts") or 0))
            if replica.get("preemptions") is not None:  # the supervisor's ReplicaStats.preemptions
                preemptions.add_metric(values, float(replica["preemptions"]))
        yield from (ready, gpus, *stats.values(), paused, restarts, preemptions)

    def _paused(self, index: int) -> float:
        """numPausedRequests of the newest iteration the supervisor read from the engine."""
        supervisor = self.agent.supervisor
        if supervisor is None:
            return 0.0
        try:
            entries = supervisor.iteration_stats(index)
        except IndexError:  # the replica went away since replicas() was read
            return 0.0
        if not entries:
            return 0.0
        newest = max(entries, key=lambda e: e.get("iter") or 0)
        batching = newest.get("inflightBatchingStats")
        value = batching.get("numPausedRequests") if isinstance(batching, dict) else None
        return float(value) if isinstance(value, int | float) else 0.0

    def _own_state(self) -> Iterator[Metric]:
        state = self.agent.state()
        info = GaugeMetricFamily(
            "agent_info",
            "1, labelled with the agent's version and telemetry backend",
            labels=["version", "telemetry"],
        )
        info.add_metric([str(state["agent_version"]), str(state["telemetry"])], 1)
        yield info
        verdict = GaugeMetricFamily(
            "agent_health_verdict", "0 healthy, 1 degraded, 2 unhealthy (the fault policy)"
        )
        assessment = self.agent.assessment
        if assessment is not None:
            verdict.add_metric([], _VERDICT_LEVEL[assessment.verdict])
        yield verdict
        yield GaugeMetricFamily("agent_registered", "1 when registered", value=state["registered"])
        yield GaugeMetricFamily("agent_ready", "1 when /readyz answers 200", value=state["ready"])
        yield GaugeMetricFamily(
            "agent_draining", "1 while the server drains (no new requests)", value=state["draining"]
        )
        counters = state["counters"]
        for name, help_text in (
            ("heartbeats", "Heartbeats the fleet accepted"),
            ("heartbeat_failures", "Reports that failed (fleet unreachable or refused)"),
            ("registrations", "Registrations"),
            ("snapshots", "Telemetry snapshots taken"),
            ("telemetry_errors", "Telemetry reads that failed"),
        ):
            yield CounterMetricFamily(f"agent_{name}", help_text, value=counters[name])


def build_app(agent: Agent) -> Starlette:
    """Reads (/healthz, /readyz, /state, /metrics) are open: routers and Prometheus poll them.
    /probe runs the model and /faults changes what the agent reports: both need the agent's
    key (`Authorization: Bearer <key>`), which the fleet learns at registration."""
    key = agent.api_key.encode()
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        state = agent.state()
        body = {"ready": state["ready"], "draining": state["draining"]}
        if state["assessment"]:
            body["verdict"] = state["assessment"]["verdict"]
        return JSONResponse(body, status_code=200 if state["ready"] else 503)

    async def state_(_: Request) -> Response:
        return Response(json.dumps(agent.state(), default=str), media_type="application/json")

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(generate_latest(registry).decode())

    async def faults(request: Request) -> Response:
        """Fault injection into the SIMULATED backend (the lab's stand-in): one fault or a
        list. Never on real GPUs: an injected Xid 79 makes the fleet drain and power cycle."""
        if not _authorized(request, key):
            return _unauthorized()
        from fleet_agent.telemetry.simulated import Fault, SimulatedTelemetry

        telemetry = agent.telemetry
        if not isinstance(telemetry, SimulatedTelemetry):
            detail = (
                "fault injection is for the lab: the simulated telemetry backend only, "
                f"not {telemetry.name}"
            )
            return JSONResponse({"detail": detail}, status_code=403)
        try:
            body: Any = await _json_body(request)
            items = body if isinstance(body, list) else [body]
            if len(items) > MAX_FAULTS:
                raise ValueError(f"at most {MAX_FAULTS} faults at once, not {len(items)}")
            injected = [Fault.from_dict(item) for item in items]
        except _TooLarge as exc:
            return JSONResponse({"detail": str(exc)}, status_code=413)
        except (ValueError, TypeError, AttributeError) as exc:
            return JSONResponse({"detail": f"bad fault: {exc}"}, status_code=422)
        for fault in injected:
            telemetry.inject(fault)
        agent.wake()  # judge the GPUs now, not at the next sample
        return JSONResponse({"injected": len(injected)})

    async def probe(request: Request) -> Response:
        """The fleet's inference-quality probe: the prompt on every ready replica, greedy
        decoding; the answers are compared by the fleet with the deployment's reference."""
        if not _authorized(request, key):
            return _unauthorized()
        try:
            prompt, max_tokens = _probe_request(await _json_body(request))
        except _TooLarge as exc:
            return JSONResponse({"detail": str(exc)}, status_code=413)
        except ValueError as exc:
            return JSONResponse({"detail": f"bad probe: {exc}"}, status_code=422)
        model = agent.assignment.deployment or "model"
        answers = []
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
            for replica in agent.replicas():
                if replica.get("state") != "ready" or not replica.get("url"):
                    continue
                answers.append(await _probe_replica(client, replica, model, prompt, max_tokens))
        return JSONResponse({"deployment": model, "answers": answers})

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/state", state_),
            Route("/metrics", metrics),
            Route("/faults", faults, methods=["POST"]),
            Route("/probe", probe, methods=["POST"]),
        ]
    )


class _TooLarge(Exception):
    """A request body over MAX_BODY_BYTES (413)."""


def _authorized(request: Request, key: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken says nothing about how much of the key was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)


def _unauthorized() -> Response:
    detail = "this needs the agent's key: Authorization: Bearer <FLEET_AGENT_API_KEY>"
    return JSONResponse({"detail": detail}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


async def _json_body(request: Request) -> Any:
    """The JSON body, refused (_TooLarge) past MAX_BODY_BYTES before more is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _TooLarge(f"body over {MAX_BODY_BYTES} bytes")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise _TooLarge(f"body over {MAX_BODY_BYTES} bytes")
    return json.loads(data)


def _probe_request(body: Any) -> tuple[str, int]:
    """(prompt, max_tokens) of a probe body; ValueError naming the field otherwise."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with prompt (and max_tokens)")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not 1 <= len(prompt) <= MAX_PROBE_PROMPT_CHARS:
        raise ValueError(f"prompt: a string of 1 to {MAX_PROBE_PROMPT_CHARS} characters")
    max_tokens = body.get("max_tokens", 16)
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_PROBE_TOKENS
    ):
        raise ValueError(f"max_tokens: an integer from 1 to {MAX_PROBE_TOKENS}")
    return prompt, max_tokens


async def _probe_replica(
    client: httpx.AsyncClient, replica: dict[str, Any], model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,  # greedy: the same model gives the same answer
        "seed": 0,
    }
    try:
        reply = await client.post(f"{replica['url']}/v1/completions", json=body)
        reply.raise_for_status()
        text = str(reply.json()["choices"][0]["text"])
        return {"replica": replica["index"], "text": text, "error": None}
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        return {"replica": replica["index"], "text": None, "error": f"{type(exc).__name__}: {exc}"}


class LocalApi:
    """uvicorn in a daemon thread on a pre-bound socket. With `tls_cert` and `tls_key` it
    answers https; with `client_ca` too, only clients presenting a certificate signed by that CA
    (the fleet, routers) complete the TLS handshake."""

    def __init__(
        self,
        agent: Agent,
        host: str,
        port: int,
        *,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        client_ca: Path | None = None,
    ) -> None:
        if (tls_cert is None) != (tls_key is None) or (client_ca and tls_cert is None):
            raise ValueError("local API TLS: a certificate and its key (and then a client CA)")
        config = uvicorn.Config(
            build_app(agent),
            log_level="warning",
            access_log=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            ssl_ca_certs=client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
        )
        # Loaded here, not in the thread: a certificate that does not load fails the caller.
        try:
            config.load()
        except OSError as exc:  # ssl.SSLError included
            raise ValueError(
                f"local API TLS: cannot load certificate {tls_cert} with key {tls_key} "
                f"(client CA {client_ca}): {exc}"
            ) from exc
        self.tls = tls_cert is not None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, int(self.socket.getsockname()[1])
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True, name="agent-api"
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> LocalApi:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.socket.close()
