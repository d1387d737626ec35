"""The demo's script (pure: plain data in, plain data out): its fleet, its timeline, its traffic.

The fleet: the first `servers` 4 × L40S servers of fleet/data/inventory/demo.yaml's ams1-r03 rack,
all warm
spares, behind the Redfish emulator (sushy-tools installs with pip, so the demo needs no system
package; the inventory's own L40S BMCs speak IPMI). Three deployments, one per engine
(fleet/data/inventory/demo-fleet.yaml: trtllm, vllm, sglang; or all on one engine), each
Llama-3.1-70B FP8 on four L40S (TP 4, one replica a server), whose stand-in engines run ~10
tokens/s per request: a few requests a second keep a server busy, so the machine running the
demo is not the bottleneck. Each gets its own share of the traffic (its own draw of the trace),
so the autoscaler scales each on its own signals.

The timeline, over `duration` seconds of traffic (the fractions are of the duration):

    0.00  traffic starts: the Azure conversation trace, time-compressed, thinned to the base rate
    0.20  a calendar entry's window opens ("launch"): at least 4 replicas until 0.40; it fires
          one measured p90 boot earlier
    0.35  a spike: the rate triples until 0.55 (the autoscaler scales up on the queue)
    0.45  a fatal Xid (79, fallen off the bus) on a serving server: it drains, is power cycled
    0.55  load falls to a quarter: the autoscaler returns servers to the warm pool
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

from fleet.lab.engines import on_engine
from fleet.traces import TraceRequest
from fleet_core import engines

RACK = "ams1-r03"
DEPLOYMENT = "llama-70b"  # the first of the demo's fleet: the calendar entry and the live view
MODEL_URI = "s3://fleet-models/meta-llama/Llama-3.1-70B-Instruct-FP8"


@dataclass(frozen=True)
class Timeline:
    duration_s: float
    launch_at: float = 0.20
    launch_until: float = 0.40
    spike_at: float = 0.35
    spike_until: float = 0.55
    fault_at: float = 0.45
    fall_at: float = 0.55
    spike_factor: float = 3.0
    fall_factor: float = 0.25

    def at(self, fraction: float) -> float:
        return fraction * self.duration_s

    def rate_factor(self, t: float) -> float:
        """The multiple of the base rate at `t` seconds into the traffic."""
        if self.at(self.spike_at) <= t < self.at(self.spike_until):
            return self.spike_factor
        if t >= self.at(self.fall_at):
            return self.fall_factor
        return 1.0


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt_tokens: int
    output_tokens: int
    deployment: str = DEPLOYMENT  # the "model" the request names


def demo_inventory(full: dict[str, Any], servers: int) -> dict[str, Any]:
    """The demo's fleet: the first `servers` servers of RACK, warm, behind Redfish."""
    for site in full.get("sites", []):
        for rack in site.get("racks", []):
            if rack["name"] != RACK:
                continue
            if not 2 <= servers <= len(rack["servers"]):
                raise ValueError(
                    f"--servers must be between 2 and {len(rack['servers'])} (the {RACK} rack)"
                )
            picked = deepcopy(rack["servers"][:servers])
            for server in picked:
                server["pool"] = "warm"
                bmc = server["bmc"]
                # The lab points every BMC at its emulator; only the protocol matters here.
                server["bmc"] = {
                    "protocol": "redfish",
                    "address": "127.0.0.1",
                    "port": 8000,
                    "username": bmc.get("username", "admin"),
                    "password": bmc.get("password", "demo-bmc-password"),
                }
            demo_rack = {k: v for k, v in rack.items() if k != "servers"} | {"servers": picked}
            demo_site = {k: v for k, v in site.items() if k != "racks"} | {"racks": [demo_rack]}
            return {"sites": [demo_site]}
    raise ValueError(f"the inventory has no rack {RACK}")


def deployments(
    fleet: dict[str, Any], servers: int, engine: str | None = None
) -> list[dict[str, Any]]:
    """The demo's deployments as the API takes them, from demo-fleet.yaml's entries (`fleet`,
    the inventory document): each on its own engine, or all on `engine`. Each may grow onto
    every server the others' floors leave."""
    entries = list(fleet.get("deployments") or [])
    floors = sum(int(e["replicas"]["min"]) for e in entries)
    out = []
    for entry in entries:
        moved = on_engine(entry, engine or str(entry.get("engine") or engines.DEFAULT_ENGINE))
        low = int(entry["replicas"]["min"])
        out.append(
            {
                "name": moved["name"],
                "model_uri": moved["model"]["uri"],
                "model_checksum": moved["model"]["checksum"],
                "engine": moved["engine"],
                "engine_params": moved["engine_params"],
                "gpus_per_replica": moved["gpus_per_replica"],
                "gpu_models": moved["gpu_models"],
                "min_replicas": low,
                "max_replicas": max(low, servers - (floors - low)),
                "sla_p95_latency_ms": moved["sla"]["p95_latency_ms"],
                "sla_ttft_ms": moved["sla"]["ttft_ms"],
                "disruption_budget": moved.get("disruption_budget", 1),
            }
        )
    return out


def replica_shape(deployment: dict[str, Any]) -> tuple[int, int]:
    """(tensor parallel size, batch limit) of one replica, whatever its engine names them."""
    spec = engines.spec(deployment["engine"])
    params = deployment["engine_params"]
    tp, _ = spec.parallelism(params)
    batch = spec.max_batch_size(params)
    if batch is None:
        raise ValueError(f"deployment {deployment['name']}: the demo needs a batch limit")
    return tp, batch


def arrivals(
    trace: Sequence[TraceRequest],
    timeline: Timeline,
    base_rps: float,
    *,
    max_prompt: int = 1024,
    max_output: int = 24,
    seed: int = 0,
    deployment: str = DEPLOYMENT,
) -> list[Arrival]:
    """The trace's hour compressed into the duration, its shape kept, thinned so that its mean
    is `base_rps` before the timeline's factors; sizes capped to what the demo's engines
    answer in seconds, every request for `deployment`. Deterministic for a seed."""
    if not trace:
        return []
    rng = random.Random(seed)
    span = max(trace[-1].at_s - trace[0].at_s, 1e-9)
    scale = timeline.duration_s / span
    keep = base_rps * timeline.duration_s / len(trace)  # the thinning before the factors
    out: list[Arrival] = []
    for request in trace:
        t = (request.at_s - trace[0].at_s) * scale
        if t >= timeline.duration_s:
            break
        # Each factor f keeps f × `keep` of the trace's requests at that time (f ≤ 1 / keep).
        p = keep * timeline.rate_factor(t)
        copies = int(p) + (1 if rng.random() < p - int(p) else 0)
        for i in range(copies):
            out.append(
                Arrival(
                    at_s=t + i * 1e-3,
                    prompt_tokens=max(1, min(request.prompt_tokens, max_prompt)),
                    output_tokens=max(1, min(request.output_tokens, max_output)),
                    deployment=deployment,
                )
            )
    return out


def mixed_arrivals(
    trace: Sequence[TraceRequest],
    timeline: Timeline,
    base_rps: float,
    names: Sequence[str],
    *,
    seed: int = 0,
) -> list[Arrival]:
    """`arrivals` for each deployment of `names` (a draw of its own: seed + its index), each
    at `base_rps`, merged in time order."""
    merged = [
        a
        for i, name in enumerate(names)
        for a in arrivals(trace, timeline, base_rps, seed=seed + i, deployment=name)
    ]
    return sorted(merged, key=lambda a: a.at_s)
