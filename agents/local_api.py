"""The agent's own HTTP API: /healthz, /readyz, /state, /metrics (and /faults for the stand-in).

Starlette under uvicorn, on a socket bound before the server starts (port 0 picks a free one:
the caller learns it at once). Routers and the fleet read this API; nothing here writes to the
fleet.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
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

from agents.daemon import Agent
from agents.fault_policy import Verdict

_VERDICT_LEVEL = {Verdict.HEALTHY: 0, Verdict.DEGRADED: 1, Verdict.UNHEALTHY: 2}
MIB = 1024 * 1024


class AgentCollector(Collector):
    """The agent's series (docs/metrics.md): `agent_gpu_*` per GPU from the latest snapshot,
    Xids counted from the snapshots, `agent_replica_*` per engine replica from the supervisor,
    and the agent's own state and counters.

    Xid events arrive once each, in the snapshot taken after them (agents/telemetry/base.py),
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
        yield from self._own_state()

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
        yield from (ready, gpus, *stats.values(), paused, restarts)

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
        """Fault injection into the SIMULATED backend (a stand-in): one fault or a list."""
        inject = getattr(agent.telemetry, "inject", None)
        if inject is None:
            backend = agent.telemetry.name
            detail = f"fault injection needs the simulated backend, not {backend}"
            return JSONResponse({"detail": detail}, status_code=409)
        from agents.telemetry.simulated import Fault

        try:
            body: Any = await request.json()
            items = body if isinstance(body, list) else [body]
            injected = [Fault.from_dict(item) for item in items]
            for fault in injected:
                inject(fault)
            agent.wake()  # judge the GPUs now, not at the next sample
        except (ValueError, TypeError, AttributeError) as exc:
            return JSONResponse({"detail": f"bad fault: {exc}"}, status_code=422)
        return JSONResponse({"injected": len(injected)})

    async def probe(request: Request) -> Response:
        """The fleet's inference-quality probe: the prompt on every ready replica, greedy
        decoding; the answers are compared by the fleet with the deployment's reference."""
        try:
            body = await request.json()
            prompt = str(body["prompt"])
            max_tokens = int(body.get("max_tokens", 16))
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"detail": f"bad probe: {exc}"}, status_code=422)
        model = agent.assignment.get("deployment") or "model"
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
    """uvicorn in a daemon thread on a pre-bound socket."""

    def __init__(self, agent: Agent, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, int(self.socket.getsockname()[1])
        config = uvicorn.Config(build_app(agent), log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True, name="agent-api"
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> LocalApi:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.socket.close()
