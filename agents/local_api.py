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


class AgentCollector(Collector):
    """`agent_gpu_*` per GPU from the latest snapshot, and the agent's own state."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]
        gauges = {
            "temperature_c": GaugeMetricFamily(
                "agent_gpu_temperature_celsius", "GPU temperature", labels=labels
            ),
            "memory_used_mib": GaugeMetricFamily(
                "agent_gpu_memory_used_mib", "GPU memory used", labels=labels
            ),
            "memory_total_mib": GaugeMetricFamily(
                "agent_gpu_memory_total_mib", "GPU memory total", labels=labels
            ),
            "utilization_pct": GaugeMetricFamily(
                "agent_gpu_utilization_percent", "GPU utilisation", labels=labels
            ),
            "power_w": GaugeMetricFamily("agent_gpu_power_watts", "GPU power draw", labels=labels),
            "ecc_uncorrected_volatile": GaugeMetricFamily(
                "agent_gpu_ecc_uncorrected_volatile",
                "Uncorrected ECC errors since the driver loaded",
                labels=labels,
            ),
            "clock_events": GaugeMetricFamily(
                "agent_gpu_clock_events", "NVML clocks-event reason bit mask", labels=labels
            ),
        }
        lost = GaugeMetricFamily(
            "agent_gpu_lost", "1 when the GPU stopped answering", labels=labels
        )
        remap = GaugeMetricFamily(
            "agent_gpu_remap_pending", "1 when a row remap waits for a GPU reset", labels=labels
        )
        snapshot = self.agent.latest()
        for gpu in snapshot.gpus if snapshot else ():
            values = [str(gpu.index), gpu.uuid or ""]
            for field, family in gauges.items():
                value = getattr(gpu, field)
                if value is not None:
                    family.add_metric(values, float(value))
            lost.add_metric(values, float(gpu.lost))
            if gpu.remap_pending is not None:
                remap.add_metric(values, float(gpu.remap_pending))
        yield from gauges.values()
        yield from (lost, remap)

        state = self.agent.state()
        verdict = GaugeMetricFamily(
            "agent_health_verdict", "0 healthy, 1 degraded, 2 unhealthy (the fault policy)"
        )
        assessment = self.agent.assessment
        if assessment is not None:
            verdict.add_metric([], _VERDICT_LEVEL[assessment.verdict])
        yield verdict
        yield GaugeMetricFamily("agent_registered", "1 when registered", value=state["registered"])
        yield GaugeMetricFamily("agent_ready", "1 when /readyz answers 200", value=state["ready"])
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
