"""GPU faults in the simulator: Xids drawn at a rate, judged by the agent's own fault policy.

The judgement and the escalation are imported, not re-implemented:

- each serving engine draws Xids as a Poisson process at `xids_per_gpu_hour` × its GPUs; the
  code comes from `mix` (weights). Every Xid becomes one telemetry `Snapshot` carrying it, and
  `fleet_core.fault_policy.assess` judges the engine's snapshots of the policy's window (10 min),
  so three Xid 94s on one GPU stay healthy and a fourth reboots, as on a real agent;
- `degraded` + `restart_engine` (an application Xid: the CUDA context is gone, the engine
  process dies): the requests not yet streaming are retried on other replicas (the router
  retries a connect error before the first byte), the streaming ones fail, and the engine
  supervisor brings the engine back after `restart_s`;
- `unhealthy` (reboot or hardware inspection): the agent's self-drain — not ready at once, the
  in-flight requests get `drain_deadline_s` to finish (the agent's default), then the engines
  stop (the rest are retried or fail as above). The provisioner then applies
  `fleet.provisioning.escalation.escalate` with `max_reboots` (fleet/settings.py's default): a
  power cycle
  (back after a boot drawn from the deployment's boot distribution) or quarantine (gone for
  good; an autoscaled deployment replaces it from the warm pool at its next tick);
- anything else (`degraded`/`none`, healthy) changes nothing but is counted.

Not modelled: the breaker (remediation stops when many servers turn unhealthy at once), the
disruption budget (it limits drains and power cycles in progress), thermal and ECC-counter
faults other than through Xids, faults while draining or booting.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from fleet.settings import Settings
from fleet_core.agent_defaults import DRAIN_DEADLINE_S
from fleet_core.fault_policy import Assessment, Thresholds, assess
from fleet_core.telemetry import GpuSample, Snapshot, XidEvent

# An ASSUMED mix (not a measurement: set your own from your fleet's kernel logs). Application
# Xids (13, 31, 43) are the most common in operators' reports; the rest are the reset classes.
DEFAULT_MIX: tuple[tuple[int, float], ...] = (
    (13, 0.25),
    (31, 0.10),
    (43, 0.05),
    (79, 0.15),
    (48, 0.10),
    (94, 0.15),
    (74, 0.10),
    (119, 0.05),
    (64, 0.05),
)
WINDOW_S = Thresholds().window_s  # the policy's window: older Xid snapshots are dropped


@dataclass(frozen=True)
class FaultSpec:
    xids_per_gpu_hour: float = 0.0
    mix: tuple[tuple[int, float], ...] = DEFAULT_MIX
    restart_s: float = 30.0  # an engine restart: weights from page cache + engine start (assumed)
    drain_deadline_s: float = DRAIN_DEADLINE_S  # the agent's default (fleet_agent/config.py)
    max_reboots: int = int(Settings.model_fields["max_reboots_same_fault"].default)

    def __post_init__(self) -> None:
        if not self.mix or any(w < 0 for _, w in self.mix) or sum(w for _, w in self.mix) <= 0:
            raise ValueError("faults.mix needs at least one Xid with a positive weight")


@dataclass
class FaultCounts:
    """What happened, for the summary."""

    xids: Counter[int] = field(default_factory=Counter)
    restarts: int = 0  # engine restarts (application Xids)
    drains: int = 0  # self-drains (unhealthy verdicts)
    reboots: int = 0  # power cycles
    quarantined: int = 0
    retried: int = 0  # requests re-routed after their engine went away
    failed: int = 0  # requests lost mid-stream


def next_fault_in(spec: FaultSpec, gpus: int, rng: random.Random) -> float:
    """Seconds to the engine's next Xid (inf when faults are off)."""
    rate = spec.xids_per_gpu_hour * gpus / 3600.0
    return rng.expovariate(rate) if rate > 0 else float("inf")


def draw_xid(spec: FaultSpec, rng: random.Random) -> int:
    codes = [c for c, _ in spec.mix]
    return rng.choices(codes, weights=[w for _, w in spec.mix])[0]


def judge(
    history: list[Snapshot], xid: int, at: float, gpus: int, rng: random.Random
) -> tuple[Assessment, list[Snapshot]]:
    """The agent's verdict after Xid `xid` on one of the engine's GPUs at `at`; `history` is
    the engine's earlier Xid snapshots. Returns the assessment and the history to keep."""
    gpu = rng.randrange(max(gpus, 1))
    samples = tuple(GpuSample(index=i, uuid=f"GPU-{i}") for i in range(max(gpus, 1)))
    event = XidEvent(xid=xid, at=at, gpu_index=gpu, source="simulated")
    snapshot = Snapshot(at=at, backend="simulated", gpus=samples, xids=(event,))
    kept = [s for s in history if s.at >= at - WINDOW_S] + [snapshot]
    return assess(kept, expected_gpus=len(samples)), kept


def fault_code(assessment: Assessment) -> str:
    """What the provisioner records as `last_fault`: the reasons' codes."""
    return ", ".join(r.code for r in assessment.reasons)[:200] or "?"
