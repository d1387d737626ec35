"""The autoscaling policy's vocabulary: what it observes, what it is told, what it answers.

- `Signals`: one observation of a deployment, which `aggregate` makes from the serving
  servers' heartbeats and the routers' reports (`RouterLoad`);
- `DeploymentState` and `PolicyConfig`: the deployment as it is now, and the policy's knobs;
- `Decision`: the policy's answer, its rule one of `RULES`;
- the four signals' names, their scale-up and low-water thresholds, and how a reason writes
  them (shared by the decision, fleet/autoscaler/policy.py, and the look-ahead,
  fleet/autoscaler/trend.py).

Pure like the policy (whose docstring is the rule book): plain data in and out, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INPUT_KEY",
    "LABEL",
    "RULES",
    "SIGNAL_NAMES",
    "UP_RULE",
    "Decision",
    "DeploymentState",
    "Limits",
    "PolicyConfig",
    "RouterLoad",
    "Signals",
    "Values",
    "aggregate",
    "any_over",
    "fmt",
    "fmt_signal",
    "limits_for",
    "signal_ratios",
    "values_of",
]

RULES = frozenset(
    {
        "activate",
        "forecast",
        "queue_high",
        "latency_high",
        "ttft_high",
        "kv_high",
        "trend",
        "scale_down",
        "hold",
        "no_data",
        "pinned",
        "min",
        "floor",
        "max",
        "cooldown",
        "window",
    }
)


@dataclass(frozen=True, slots=True)
class Signals:
    """One observation of a deployment, aggregated over its serving servers."""

    at: float  # seconds (any epoch)
    queue_per_gpu: float | None  # waiting requests / serving GPUs
    kv_use: float | None  # max over replicas of KV used ÷ max blocks (0..1)
    p95_latency_s: float | None  # end-to-end p95 (the engines' histograms)
    ttft_p95_s: float | None
    serving_gpus: int = 0
    # Requests running ÷ the batch slots (max_batch_size) of the replicas that report running;
    # None where the batch size is unknown. Not a scale-up signal: what a scale-in checks
    # (latency is not proportional near a full batch: policy rule 6).
    slot_use: float | None = None


@dataclass(frozen=True, slots=True)
class RouterLoad:
    """What the routers in front of a deployment report (fleet/router/): requests waiting in
    them for a free replica, and the p95s their clients see (queueing in the router included)."""

    waiting: int = 0
    p95_s: float | None = None
    ttft_p95_s: float | None = None


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The policy's knobs (module docstring for how each is used).

    Choices beyond the first brief: `cooldown_up_s` defaults to the up window (60 s), so the
    target grows by at most `max_step` a minute while the projection onto capacity on its way
    keeps steps from piling up; `trend_min_r2` and the step test keep noise and jumps out of
    the look-ahead; `max_gap_s` (eight 15-s ticks) is how long a silence may be before it is
    missing data."""

    queue_per_gpu_target: float = 10.0
    latency_fraction: float = 0.9  # scale up when p95 > 90 % of the SLA (latency and TTFT)
    kv_high: float = 0.85
    # A scale-in must leave the window's peak batch-slot use, on one server fewer, under this.
    slot_ceiling: float = 0.75
    up_window_s: float = 60.0  # sustained this long (every observation in the window over)
    down_window_s: float = 600.0
    low_water: float = 0.5  # scale down when EVERY signal < 50 % of its target for the window
    steps: tuple[tuple[float, int], ...] = ((1.0, 1), (1.5, 2), (2.0, 4))  # ratio → +servers
    tolerance: float = 0.1  # a scale-down must leave every signal < (1 - 0.1) of its threshold
    cooldown_up_s: float = 60.0  # after a scale-up, the next one waits (= the up window)
    cooldown_down_s: float = 300.0  # after any scale change, a scale-down waits
    lookahead: bool = True
    trend_window_s: float = 300.0  # linear trend over the last minutes
    max_step: int = 4
    trend_min_r2: float = 0.5  # the line must explain half the variance to count as a trend
    max_gap_s: float = 120.0  # observations further apart than this are missing data

    def __post_init__(self) -> None:
        positive = {
            "queue_per_gpu_target": self.queue_per_gpu_target,
            "latency_fraction": self.latency_fraction,
            "kv_high": self.kv_high,
            "low_water": self.low_water,
            "max_gap_s": self.max_gap_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (got {value})")
        windows = {
            "up_window_s": self.up_window_s,
            "down_window_s": self.down_window_s,
            "cooldown_up_s": self.cooldown_up_s,
            "cooldown_down_s": self.cooldown_down_s,
            "trend_window_s": self.trend_window_s,
        }
        for name, value in windows.items():
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 (got {value})")
        if not 0 < self.slot_ceiling <= 1:
            raise ValueError(f"slot_ceiling must be in (0, 1] (got {self.slot_ceiling})")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1) (got {self.tolerance})")
        if self.max_step < 0:
            raise ValueError(f"max_step must be >= 0 (got {self.max_step})")


@dataclass(frozen=True, slots=True)
class DeploymentState:
    """What the policy needs to know of one deployment now, in servers (the service converts
    replicas: ⌈replicas ÷ replicas per server⌉)."""

    name: str
    sla_p95_s: float
    sla_ttft_s: float
    gpus_per_server: int  # GPUs per server serving it (for queue per GPU projections)
    min_servers: int
    max_servers: int
    floor: int = 0  # the scheduled-scaling calendar's floor
    target: int = 0  # current target_servers
    serving: int = 0
    on_the_way: int = 0  # booting + loading: they count as capacity
    boot_p90_s: float = 900.0  # measured p90 boot-to-ready (the look-ahead horizon)
    pinned: int | None = None  # manual mode: `fleetctl deployments scale D --replicas N`
    # Requests waiting in the routers for it (their fresh reports, summed): for a deployment at
    # zero servers the only sign of demand there is.
    router_waiting: int = 0
    # Predictive scaling (fleet/autoscaler/forecast.py): the servers the forecast needs one
    # boot ahead, and what it stands on; None: no forecast (off, or too little history).
    forecast_servers: int | None = None
    forecast_basis: str = ""
    last_up_at: float | None = None
    last_down_at: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The new target, the rule that fired (one of RULES), why in one line, and the inputs."""

    deployment: str
    target: int  # the new target (== state.target when holding)
    delta: int
    rule: str  # one of RULES
    reason: str  # one line an operator reads, with the numbers
    inputs: dict[str, float | int | str | None]  # JSON-ready: the signals and thresholds used


# ---------------------------------------------------------------------------------------------
# Signals: names, thresholds, classification

# The four signals: the rule each drives a scale-up with, how a reason writes it, its input key.
SIGNAL_NAMES = ("queue", "p95", "ttft", "kv")
UP_RULE = {"queue": "queue_high", "p95": "latency_high", "ttft": "ttft_high", "kv": "kv_high"}
LABEL = {"queue": "queue", "p95": "p95", "ttft": "TTFT p95", "kv": "KV use"}
_UNIT = {"queue": "/GPU", "p95": " s", "ttft": " s", "kv": ""}
INPUT_KEY = {
    "queue": "queue_per_gpu",
    "p95": "p95_latency_s",
    "ttft": "ttft_p95_s",
    "kv": "kv_use",
}

Values = tuple[float | None, float | None, float | None, float | None]


def values_of(o: Signals) -> Values:
    return (o.queue_per_gpu, o.p95_latency_s, o.ttft_p95_s, o.kv_use)


@dataclass(frozen=True, slots=True)
class Limits:
    """A deployment's thresholds, one per signal in SIGNAL_NAMES order."""

    up: tuple[float, float, float, float]  # over these: scale up
    low: tuple[float, float, float, float]  # under these, all of them: may scale down


def limits_for(state: DeploymentState, c: PolicyConfig) -> Limits:
    targets = (c.queue_per_gpu_target, state.sla_p95_s, state.sla_ttft_s, c.kv_high)
    up = (
        c.queue_per_gpu_target,
        c.latency_fraction * state.sla_p95_s,
        c.latency_fraction * state.sla_ttft_s,
        c.kv_high,
    )
    low = (
        c.low_water * targets[0],
        c.low_water * targets[1],
        c.low_water * targets[2],
        c.low_water * targets[3],
    )
    return Limits(up, low)


def any_over(values: Values, up: tuple[float, float, float, float]) -> bool:
    return any(v is not None and v > t for v, t in zip(values, up, strict=True))


def signal_ratios(values: Values, up: tuple[float, float, float, float]) -> list[float | None]:
    return [None if v is None else v / t for v, t in zip(values, up, strict=True)]


def fmt(x: float | None, digits: int = 3) -> str:
    """A number as a reason writes it: `digits` significant digits, ∞, or none."""
    if x is None:
        return "none"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


def fmt_signal(name: str, x: float | None) -> str:
    return f"{fmt(x)}{_UNIT[name]}" if x is not None else "none"


# ---------------------------------------------------------------------------------------------
# aggregate: heartbeats → Signals


def _num(x: Any) -> float | None:
    """A finite number as JSON gives it (an int or a float; not a bool), else None."""
    kind = type(x)
    if kind is float:
        return x if math.isfinite(x) else None
    if kind is int:
        return float(x)
    return None


def aggregate(
    servers: Sequence[Mapping[str, Any]],
    at: float,
    router: RouterLoad | None = None,
    *,
    slots_per_replica: int | None = None,
) -> Signals:
    """One observation from the serving servers' last heartbeats.

    Each server is a mapping with `gpu_count` and `replicas` (the heartbeat's replica dicts:
    `queued`, `running`, `kv_used_fraction`, `ttft_p95_s`, `e2e_p95_s`, optionally `state`).
    Only replicas that are ready (or say no state) count: the router sends traffic to no other.
    A replica stands for an equal share of its server's GPUs (a server serves one deployment,
    so GPUs its replicas leave over are that deployment's too; this keeps `serving_gpus` in the
    same units as `DeploymentState.gpus_per_server`). A server without `gpu_count` counts one
    GPU per replica.

    - queue_per_gpu: requests waiting ÷ GPUs, both over the replicas that report `queued`
      (one that does not is left out of both, not counted as an empty queue);
    - kv_use: the largest replica's (one full KV cache preempts requests, whatever the rest);
    - p95 and TTFT p95: the mean over the replicas that report one. A fleet-wide p95 cannot be
      rebuilt from per-replica quantiles; with the router spreading requests evenly the mean is
      close, where the max would let one slow replica (a sick GPU, the fault policy's business)
      buy servers. An idle replica (queued and running 0) has no latency to report, which is
      not missing data: when no replica reports one and every one is idle, latency is 0.
    - serving_gpus: the GPUs of the counted replicas;
    - slot_use: requests running ÷ `slots_per_replica` (the deployment's max_batch_size) for
      every counted replica that reports `running`; None without a batch size.
    Nothing to count at all: every signal None.

    With `router` (the routers' reports): its waiting requests join the queue (they wait for a
    replica as surely as the engines' queued ones do), and each p95 is the worse of the
    engines' and the routers' — the routers' is what clients see, queueing in them included.
    """
    queued = 0.0
    queue_gpus = 0.0
    serving_gpus = 0.0
    kv: float | None = None
    e2e_sum = ttft_sum = 0.0
    e2e_n = ttft_n = 0
    counted = 0
    running_sum = 0.0
    slots = 0  # replicas reporting `running`
    all_idle = True
    for server in servers:
        replicas = server.get("replicas") or ()
        if not replicas:
            continue
        gpu_count = _num(server.get("gpu_count"))
        gpus = gpu_count / len(replicas) if gpu_count else 1.0
        for r in replicas:
            state = r.get("state")
            if state is not None and state != "ready":
                continue
            counted += 1
            serving_gpus += gpus
            q = _num(r.get("queued"))
            if q is not None:
                queued += q
                queue_gpus += gpus
            running = _num(r.get("running"))
            if running is not None:
                running_sum += running
                slots += 1
            if not (q == 0 and running == 0):
                all_idle = False
            k = _num(r.get("kv_used_fraction"))
            if k is not None and (kv is None or k > kv):
                kv = k
            e = _num(r.get("e2e_p95_s"))
            if e is not None:
                e2e_sum += e
                e2e_n += 1
            t = _num(r.get("ttft_p95_s"))
            if t is not None:
                ttft_sum += t
                ttft_n += 1
    if counted == 0:
        return Signals(at, None, None, None, None, 0)
    idle_zero = 0.0 if all_idle else None
    p95 = e2e_sum / e2e_n if e2e_n else idle_zero
    ttft = ttft_sum / ttft_n if ttft_n else idle_zero
    if router is not None:
        if router.waiting:
            queued += router.waiting
            queue_gpus = queue_gpus or serving_gpus
        p95 = _worse(p95, router.p95_s)
        ttft = _worse(ttft, router.ttft_p95_s)
    return Signals(
        at=at,
        queue_per_gpu=queued / queue_gpus if queue_gpus > 0 else None,
        kv_use=kv,
        p95_latency_s=p95,
        ttft_p95_s=ttft,
        serving_gpus=round(serving_gpus),
        slot_use=running_sum / (slots * slots_per_replica)
        if slots and slots_per_replica and slots_per_replica > 0
        else None,
    )


def _worse(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
