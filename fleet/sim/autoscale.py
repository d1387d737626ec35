"""The autoscaler in the simulator: the production policy (fleet/autoscaler/policy.py), imported.

Every `interval_s` of simulated time each autoscaled deployment is observed the way the
leader's tick observes it (fleet/autoscaler/service.py `autoscale_once`):

- one heartbeat per serving replica (a simulated engine is one server of `tp_size` GPUs, one
  replica): `queued` (the engine's own queue), `running`, `kv_used_fraction`, and `e2e_p95_s` /
  `ttft_p95_s` over the requests it finished in the last `STATS_WINDOW_S` (the agent's
  stats_window_s), measured from when the engine received them, as its histograms do;
- the router's load (`RouterLoad`): the requests waiting in its room, and the p95s its clients
  see over the same window (from arrival, the router's queueing included);
- `aggregate` turns them into one `Signals`; a window of them is kept as `History` keeps it,
  `DeploymentState` is built as `_state` builds it (servers = replicas, `boot_p90_s` from the
  boot-time distribution), and `decide` returns the target, with the `PolicyConfig` that
  `policy_config` builds from the scenario's knobs (defaults: fleet/settings.py).

The simulator then makes the target true (fleet/sim/core.py): a warm spare boots and serves
after a drawn boot-to-ready time; a scale-down drains one replica (no new requests; it leaves
when its in-flight requests have finished) and its GPUs go back to the warm pool. Wanting a
spare when the warm pool has none is a warm-pool exhaustion, recorded with its time.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.autoscaler.signals import DeploymentState, PolicyConfig, Signals, aggregate
from fleet.autoscaler.signals import RouterLoad as RouterLoad
from fleet.settings import Settings
from fleet.sim.calendar import Entry
from fleet_core.stats import quantile

STATS_WINDOW_S = 60.0  # fleet_agent/engine/supervisor.py stats_window_s: the p95s' window
_DEFAULTS = Settings.model_fields
Z90 = 1.2815515655446004  # the standard normal's 90th percentile


def _default(name: str) -> Any:
    return _DEFAULTS[name].default


@dataclass(frozen=True)
class BootTime:
    """Boot-to-ready seconds: normal(mean, sd), cut at 10 % of the mean; sd 0: fixed."""

    mean_s: float = float(_default("boot_estimate_s"))
    sd_s: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.sd_s <= 0:
            return self.mean_s
        return max(0.1 * self.mean_s, rng.gauss(self.mean_s, self.sd_s))

    @property
    def p90_s(self) -> float:
        return self.mean_s + Z90 * self.sd_s


@dataclass(frozen=True)
class AutoscaleSpec:
    interval_s: float = float(_default("autoscale_interval_s"))
    queue_per_gpu: float = float(_default("autoscale_queue_per_gpu"))
    up_window_s: float = float(_default("autoscale_up_window_s"))
    down_window_s: float = float(_default("autoscale_down_window_s"))
    cooldown_down_s: float = float(_default("autoscale_cooldown_down_s"))
    cooldown_up_s: float | None = None  # None: the up window (service.policy_config)
    lookahead: bool = True
    min_replicas: int = 1
    max_replicas: int = 1000
    warm_pool: tuple[tuple[str, int], ...] | None = None  # None: the scenario's shared pool
    boot: BootTime = BootTime()
    # Loading the model after the boot: None: inside `boot` (the default). With `load`, a spare
    # without the model on its disk loads in `load`, one with it (racks' `cached`) in
    # `load_cached` (docs/hardware.md: ~20 s for 145 GB from a local NVMe stripe).
    load: BootTime | None = None
    load_cached: BootTime = BootTime(20.0)
    sla_p95_s: float = 30.0
    sla_ttft_s: float = 2.0
    calendar: tuple[Entry, ...] = ()  # scheduled floors (fleet/sim/calendar.py)

    def ready_s(self, rng: random.Random, *, cached: bool) -> float:
        """A boot-to-ready draw: the boot, then the load (when modelled apart)."""
        boot = self.boot.draw(rng)
        if self.load is None:
            return boot
        return boot + (self.load_cached if cached else self.load).draw(rng)

    @property
    def ready_p90_s(self) -> float:
        """What the fleet would measure as the p90 boot-to-ready (boot + uncached load; the
        sum of the p90s, an upper bound of the p90 of the sum)."""
        return self.boot.p90_s + (self.load.p90_s if self.load is not None else 0.0)

    def policy_config(self) -> PolicyConfig:
        """As fleet/autoscaler/service.py `policy_config` builds it from the settings."""
        return PolicyConfig(
            queue_per_gpu_target=self.queue_per_gpu,
            up_window_s=self.up_window_s,
            down_window_s=self.down_window_s,
            cooldown_down_s=self.cooldown_down_s,
            cooldown_up_s=(self.up_window_s if self.cooldown_up_s is None else self.cooldown_up_s),
            lookahead=self.lookahead,
        )

    @property
    def keep_s(self) -> float:
        """The history kept (fleet/control/service_loops.py: the longer window + 10 min)."""
        return max(self.up_window_s, self.down_window_s) + 600.0


@dataclass(frozen=True)
class ScalePoint:
    """One tick of one deployment: the target after the decision and the replicas then."""

    at: float
    deployment: str
    target: int
    serving: int
    booting: int
    draining: int
    rule: str
    warm_left: int = 0  # spares left in the warm pool it draws from, after the decision
    floor: int = 0  # the calendar's floor then (fleet/sim/calendar.py)


@dataclass(frozen=True)
class Exhaustion:
    """A scale-up that wanted `short` more spares than the warm pool had."""

    at: float
    deployment: str
    short: int
    reasons: tuple[str, ...] = ()  # placement's (fleet/provisioning/placement.py), with racks


def p95(window: deque[tuple[float, float, float]], now: float) -> tuple[float | None, ...]:
    """(e2e p95, TTFT p95) over the (finish, e2e, ttft) entries of the last STATS_WINDOW_S;
    older entries are dropped. None when nothing finished in the window."""
    while window and window[0][0] < now - STATS_WINDOW_S:
        window.popleft()
    if not window:
        return None, None
    # The production policy's p95s come from the router's quantile: the same rule here.
    return quantile((x[1] for x in window), 0.95), quantile((x[2] for x in window), 0.95)


def observe(
    servers: Sequence[Mapping[str, Any]],
    at: float,
    router: RouterLoad,
    history: deque[Signals],
    keep_s: float,
    slots_per_replica: int | None = None,
) -> list[Signals]:
    """`aggregate` the heartbeats (every signal None when nothing serves, as the service does)
    and keep the window as `History.add` keeps it."""
    signals = (
        aggregate(servers, at, router, slots_per_replica=slots_per_replica)
        if servers
        else Signals(at, None, None, None, None)
    )
    history.append(signals)
    while history and history[0].at < at - keep_s:
        history.popleft()
    return list(history)


def state(
    name: str,
    spec: AutoscaleSpec,
    *,
    gpus_per_replica: int,
    target: int,
    serving: int,
    booting: int,
    last_up_at: float | None,
    last_down_at: float | None,
    floor: int = 0,
    router_waiting: int = 0,
) -> DeploymentState:
    """As the service's `_state`: one replica per server here; `floor` is the calendar's."""
    return DeploymentState(
        name=name,
        sla_p95_s=spec.sla_p95_s,
        sla_ttft_s=spec.sla_ttft_s,
        gpus_per_server=max(gpus_per_replica, 1),
        min_servers=spec.min_replicas,
        max_servers=spec.max_replicas,
        floor=floor,
        target=target,
        serving=serving,
        on_the_way=booting,
        boot_p90_s=spec.ready_p90_s,
        router_waiting=router_waiting,
        last_up_at=last_up_at,
        last_down_at=last_down_at,
    )
