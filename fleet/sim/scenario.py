"""A simulation scenario (YAML), `run` it, or `compare` variants on the SAME requests.

    name: mixed-code
    seed: 7
    warmup: 0.1                 # share of the requests left out of the figures
    deployments:
      - name: code
        model: llama-3.1-8b
        replicas: {H200: 3, H100: 3, L40S: 2}
        max_batch_size: 16
        strategy: estimated_completion_time
        batching: continuous    # or static
        sla: {latency_s: 30, ttft_s: 2}
        arrivals:
          trace: code           # replay the Azure trace's pattern...
          requests: 2400
          load: 0.8             # ...compressed to 80 % of the predicted capacity
        # or Poisson:
        # arrivals:
        #   rate: {kind: diurnal, mean_rps: 5, amplitude: 0.5}   # constant: {rps}; spikes: [...]
        #   duration_s: 3600
        #   sizes: {trace: code}            # or {prompt: 1000, output: 200}
        # autoscale:                # off unless given (fleet/sim/autoscale.py)
        #   interval_s: 15          # these five default to fleet/settings.py's
        #   queue_per_gpu: 10
        #   up_window_s: 60
        #   down_window_s: 600
        #   cooldown_down_s: 300
        #   min_replicas: 1
        #   max_replicas: 8
        #   boot_s: {mean: 900, sd: 120}    # or seconds; default 1200 (boot_estimate_s)
        #   load_s: {mean: 120, sd: 30}     # the model's load apart (default: inside boot_s)
        #   warm_pool: {H100: 4}    # its own spares; default: the scenario's warm_pool
        # calendar:                 # scheduled floors (autoscale only; fleet/sim/calendar.py)
        #   - {cron: "0 10 * * *", timezone: UTC, duration_s: 1800, min_replicas: 4}
    warm_pool: {H100: 6}        # spares shared by autoscaled deployments without their own
    # or, instead, spares in racks with power budgets (fleet/sim/racks.py,
    # fleet/provisioning/placement.py):
    # racks: [{name: r1, budget_w: 20000, spares: {H100: 4}, cached: [llama-3.1-8b]}]
    #   a rack's budget from its feeds instead (fleet/power/budget.py rack_budget):
    #   feeds: [{side: A, volts: 415, amps: 32, phase: three}, ...]
    #   budget_mode: nameplate      # or measured (needs `power`), budget_margin: 1.15
    # power:                    # drawn power, budget modes, the cap valve (fleet/sim/power.py)
    #   sample_s: 5             # the drawn-power sample
    #   window_s: 86400         # measured mode: a server's p99 over this (fleet/settings.py's)
    #   min_history_s: 3600     # nameplate until this much of it exists
    #   valve: {interval_s: 15, high_pct: 90, low_pct: 80, floor_pct: 50, step_pct: 10}
    #                           # or valve: null (no cap valve)
    # variants:                 # named for --compare: every rack's mode/margin, the valve
    #   nameplate: {budget_mode: nameplate}
    #   measured: {budget_mode: measured, budget_margin: 1.15}
    # faults: {xids_per_gpu_hour: 0.01}   # GPU Xids (fleet/sim/faults.py); per deployment too
    start: 2026-12-07T00:00:00Z # the wall-clock time of simulated second 0 (the default)
    calendar_interval_s: 30     # the calendar's tick (fleet/settings.py's default)

Capacity (for `load`): the cost model's steady state for the deployment's request mix at
max_batch_size streams per engine, summed (as bench/routing.py computes it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fleet.power.budget import Feed, rack_budget
from fleet.router.strategy import STRATEGIES
from fleet.sim import arrivals as arr
from fleet.sim import calendar as sim_calendar
from fleet.sim import power as sim_power
from fleet.sim.autoscale import AutoscaleSpec, BootTime
from fleet.sim.core import DeploymentSpec, RunResult, Simulation, Summary, summarize
from fleet.sim.engine import SimRequest
from fleet.sim.faults import DEFAULT_MIX, FaultSpec
from fleet.sim.racks import RackSpec
from fleet_core import cost_model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpikeModel(_Strict):
    at_s: float = Field(ge=0)
    duration_s: float = Field(gt=0)
    multiplier: float = Field(gt=0)


class RateModel(_Strict):
    kind: Literal["constant", "diurnal"] = "constant"
    rps: float | None = Field(default=None, gt=0)  # constant
    mean_rps: float | None = Field(default=None, gt=0)  # diurnal
    amplitude: float = Field(default=0.5, ge=0, le=1)
    peak_s: float = 14 * 3600.0
    period_s: float = Field(default=arr.DAY_S, gt=0)
    spikes: tuple[SpikeModel, ...] = ()

    def curve(self) -> arr.RateCurve:
        base: arr.RateCurve
        if self.kind == "constant":
            if self.rps is None:
                raise ValueError("a constant rate needs rps")
            base = arr.Constant(self.rps)
        else:
            if self.mean_rps is None:
                raise ValueError("a diurnal rate needs mean_rps")
            base = arr.Diurnal(self.mean_rps, self.amplitude, self.peak_s, self.period_s)
        if self.spikes:
            spikes = tuple(arr.Spike(s.at_s, s.duration_s, s.multiplier) for s in self.spikes)
            return arr.Spikes(base, spikes)
        return base


class SizesModel(_Strict):
    trace: str | None = None
    prompt: int | None = Field(default=None, ge=1)
    output: int | None = Field(default=None, ge=1)

    def sizes(self) -> arr.Sizes:
        if self.trace is not None:
            return arr.TraceSizes(self.trace)
        if self.prompt is None or self.output is None:
            raise ValueError("sizes need a trace, or both prompt and output")
        return arr.FixedSizes(self.prompt, self.output)


class ArrivalsModel(_Strict):
    # Trace replay
    trace: str | None = None
    offset: int = Field(default=0, ge=0)
    requests: int | None = Field(default=None, ge=2)
    speed: float | None = Field(default=None, gt=0)
    load: float | None = Field(default=None, gt=0)  # of predicted capacity (replay or Poisson)
    # Poisson
    rate: RateModel | None = None
    duration_s: float | None = Field(default=None, gt=0)
    sizes: SizesModel | None = None
    # What clients ask for: None = the true output length (ignore_eos, as the router bench)
    max_tokens: int | None = Field(default=None, ge=1)


class SlaModel(_Strict):
    latency_s: float | None = Field(default=None, gt=0)
    ttft_s: float | None = Field(default=None, gt=0)


def _check_pool(v: dict[str, int] | None) -> dict[str, int] | None:
    for gpu, n in (v or {}).items():
        cost_model.gpu_spec(gpu)
        if n < 0:
            raise ValueError(f"{gpu}: a negative count")
    return v


class BootModel(_Strict):
    """Boot-to-ready seconds: normal(mean, sd) (cut at 10 % of the mean), or fixed (sd 0)."""

    mean: float = Field(gt=0)
    sd: float = Field(default=0.0, ge=0)


class ServerPowerModel(_Strict):
    max_w: float = Field(gt=0)
    standby_w: float = Field(ge=0)
    idle_w: float | None = Field(default=None, gt=0)  # None: racks.SERVER_IDLE_W

    @model_validator(mode="after")
    def _order(self) -> ServerPowerModel:
        if self.idle_w is not None and not self.standby_w <= self.idle_w <= self.max_w:
            raise ValueError("need standby_w ≤ idle_w ≤ max_w")
        return self


class FeedModel(_Strict):
    """One power feed (fleet/power/budget.py Feed)."""

    side: str = Field(min_length=1)
    volts: float = Field(gt=0)
    amps: float = Field(gt=0)
    phase: Literal["single", "three"] = "single"
    max_utilisation_pct: float = Field(default=80.0, gt=0, le=100)


class RackModel(_Strict):
    """A rack of warm spares with a power budget (fleet/sim/racks.py): `budget_w`, or
    `feeds` (the budget is fleet/power/budget.py's `rack_budget` of them)."""

    name: str = Field(min_length=1)
    site: str = "site"
    budget_w: float | None = Field(default=None, gt=0)
    feeds: list[FeedModel] = Field(default_factory=list)
    budget_mode: Literal["nameplate", "measured"] = "nameplate"
    budget_margin: float = Field(default=1.15, ge=1.0, le=2.0)
    spares: dict[str, int] = Field(default_factory=dict)  # GPU model → warm servers
    cached: list[str] = Field(default_factory=list)  # models on the spares' disks
    feed_sides: list[str] = Field(default_factory=lambda: ["A", "B"], min_length=1)
    other_w: float = Field(default=0.0, ge=0)
    server: ServerPowerModel | None = None  # per spare; default: racks.SERVER_POWER

    @field_validator("spares")
    @classmethod
    def _spares(cls, v: dict[str, int]) -> dict[str, int]:
        _check_pool(v)
        return v

    @model_validator(mode="after")
    def _budget(self) -> RackModel:
        if (self.budget_w is None) == (not self.feeds):
            raise ValueError("give budget_w or feeds (one of them)")
        if self.feeds and self.budget() <= 0:
            raise ValueError("the feeds give no budget")
        return self

    def budget(self) -> float:
        if self.budget_w is not None:
            return self.budget_w
        return rack_budget(
            Feed(f.side, f.volts, f.amps, f.phase, f.max_utilisation_pct) for f in self.feeds
        )

    def spec(self) -> RackSpec:
        return RackSpec(
            name=self.name,
            budget_w=self.budget(),
            site=self.site,
            spares=tuple((g, n) for g, n in self.spares.items() if n > 0),
            cached=tuple(self.cached),
            feed_sides=tuple(self.feed_sides),
            other_w=self.other_w,
            server_max_w=self.server.max_w if self.server else None,
            server_standby_w=self.server.standby_w if self.server else None,
            server_idle_w=self.server.idle_w if self.server else None,
            budget_mode=self.budget_mode,
            budget_margin=self.budget_margin,
        )


class FaultsModel(_Strict):
    """GPU faults (fleet/sim/faults.py): Xids per GPU-hour, their mix, and the recovery times."""

    xids_per_gpu_hour: float = Field(ge=0)
    mix: dict[int, float] | None = None  # Xid → weight; None: the assumed DEFAULT_MIX
    restart_s: float = Field(default=FaultSpec.restart_s, gt=0)
    drain_deadline_s: float = Field(default=FaultSpec.drain_deadline_s, ge=0)
    max_reboots: int = Field(default=FaultSpec.max_reboots, ge=0)

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is not None and (any(w < 0 for w in v.values()) or sum(v.values()) <= 0):
            raise ValueError("weights must be ≥ 0 with a positive sum")
        return v

    def spec(self) -> FaultSpec:
        return FaultSpec(
            xids_per_gpu_hour=self.xids_per_gpu_hour,
            mix=DEFAULT_MIX if self.mix is None else tuple(self.mix.items()),
            restart_s=self.restart_s,
            drain_deadline_s=self.drain_deadline_s,
            max_reboots=self.max_reboots,
        )


def _time(v: float | BootModel) -> BootTime:
    return BootTime(v.mean, v.sd) if isinstance(v, BootModel) else BootTime(float(v))


class AutoscaleModel(_Strict):
    """The autoscaler's knobs (defaults: fleet/settings.py) and where its spares come from."""

    interval_s: float = Field(default=15.0, gt=0)
    queue_per_gpu: float = Field(default=10.0, gt=0)
    up_window_s: float = Field(default=60.0, ge=0)
    down_window_s: float = Field(default=600.0, ge=0)
    cooldown_down_s: float = Field(default=300.0, ge=0)
    cooldown_up_s: float | None = Field(default=None, ge=0)  # None: the up window
    lookahead: bool = True
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1000, ge=1)
    warm_pool: dict[str, int] | None = None  # None: the scenario's shared warm_pool
    boot_s: float | BootModel = Field(default=1200.0)  # fleet.settings boot_estimate_s
    # The model's load after the boot (None: inside boot_s); a spare with the model cached
    # (racks' `cached`) loads in load_cached_s
    load_s: float | BootModel | None = None
    load_cached_s: float | BootModel = 20.0

    @field_validator("warm_pool")
    @classmethod
    def _pool(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        return _check_pool(v)

    @field_validator("boot_s", "load_s", "load_cached_s")
    @classmethod
    def _boot(cls, v: float | BootModel | None) -> float | BootModel | None:
        if isinstance(v, (int, float)) and not v > 0:
            raise ValueError("must be > 0 seconds (or {mean, sd})")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleModel:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self

    def spec(self, sla: SlaModel, calendar: tuple[sim_calendar.Entry, ...] = ()) -> AutoscaleSpec:
        boot = _time(self.boot_s)
        assert sla.latency_s is not None and sla.ttft_s is not None
        return AutoscaleSpec(
            interval_s=self.interval_s,
            queue_per_gpu=self.queue_per_gpu,
            up_window_s=self.up_window_s,
            down_window_s=self.down_window_s,
            cooldown_down_s=self.cooldown_down_s,
            cooldown_up_s=self.cooldown_up_s,
            lookahead=self.lookahead,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            warm_pool=None if self.warm_pool is None else tuple(self.warm_pool.items()),
            boot=boot,
            load=None if self.load_s is None else _time(self.load_s),
            load_cached=_time(self.load_cached_s),
            sla_p95_s=sla.latency_s,
            sla_ttft_s=sla.ttft_s,
            calendar=calendar,
        )


class DeploymentModel(_Strict):
    name: str
    model: str = "llama-3.1-8b"
    replicas: dict[str, int]
    tp_size: int = Field(default=1, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    max_num_tokens: int = Field(default=8192, ge=1)
    chunked_prefill: bool = True
    router_limit: int | None = Field(default=None, ge=1)
    strategy: str = "estimated_completion_time"
    batching: Literal["continuous", "static"] = "continuous"
    sla: SlaModel = SlaModel()
    arrivals: ArrivalsModel
    autoscale: AutoscaleModel | None = None  # None: a fixed fleet (the default)
    faults: FaultsModel | None = None  # None: the scenario's `faults` (if any)
    # Scheduled floors, as the API's schedule entries (fleet/sim/calendar.py); needs autoscale
    calendar: tuple[sim_calendar.EntryModel, ...] = ()

    @model_validator(mode="after")
    def _autoscaled(self) -> DeploymentModel:
        if self.autoscale is not None and (self.sla.latency_s is None or self.sla.ttft_s is None):
            raise ValueError(
                "autoscale needs sla.latency_s and sla.ttft_s (the policy's latency targets)"
            )
        return self

    @model_validator(mode="after")
    def _calendar(self) -> DeploymentModel:
        self._calendar_entries()
        return self

    def _calendar_entries(self) -> tuple[sim_calendar.Entry, ...]:
        if not self.calendar:
            return ()
        if self.autoscale is None:
            raise ValueError("calendar needs autoscale (an entry is a floor under its target)")
        return sim_calendar.entries(self.name, self.calendar, self.autoscale.max_replicas)

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        cost_model.model_spec(v)
        return v

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, v: dict[str, int]) -> dict[str, int]:
        if not v or sum(v.values()) < 1:
            raise ValueError("at least one replica")
        for gpu, n in v.items():
            cost_model.gpu_spec(gpu)
            if n < 0:
                raise ValueError(f"{gpu}: a negative count")
        return v

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        if v not in STRATEGIES:
            raise ValueError(f"unknown strategy {v!r} (one of {', '.join(STRATEGIES)})")
        return v

    def spec(
        self,
        strategy: str | None = None,
        batching: str | None = None,
        faults: FaultsModel | None = None,
    ) -> DeploymentSpec:
        """`faults`: the scenario's, for a deployment without its own."""
        b = batching or self.batching
        mine = self.faults or faults
        if b not in ("continuous", "static"):
            raise ValueError(f"unknown batching {b!r}")
        return DeploymentSpec(
            name=self.name,
            model=self.model,
            replicas=tuple((g, n) for g, n in self.replicas.items() if n > 0),
            strategy=strategy or self.strategy,
            batching="static" if b == "static" else "continuous",
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            tp_size=self.tp_size,
            chunked_prefill=self.chunked_prefill,
            router_limit=self.router_limit,
            latency_sla_s=self.sla.latency_s,
            ttft_sla_s=self.sla.ttft_s,
            autoscale=(
                None
                if self.autoscale is None
                else self.autoscale.spec(self.sla, self._calendar_entries())
            ),
            faults=None if mine is None else mine.spec(),
        )


class ValveModel(_Strict):
    """The cap valve's knobs (fleet/power/caps.py; defaults: fleet/settings.py)."""

    interval_s: float = Field(default=sim_power.ValveSpec.interval_s, gt=0)
    high_pct: float = Field(default=sim_power.ValveSpec.high_pct, gt=0, le=100)
    low_pct: float = Field(default=sim_power.ValveSpec.low_pct, gt=0, le=100)
    floor_pct: float = Field(default=sim_power.ValveSpec.floor_pct, gt=0, le=100)
    step_pct: float = Field(default=sim_power.ValveSpec.step_pct, gt=0, le=50)

    @model_validator(mode="after")
    def _marks(self) -> ValveModel:
        if not self.low_pct < self.high_pct:
            raise ValueError("need low_pct < high_pct")
        return self


class PowerModel(_Strict):
    """Drawn power, budget modes and the cap valve (fleet/sim/power.py)."""

    sample_s: float = Field(default=sim_power.PowerSpec.sample_s, gt=0)
    window_s: float = Field(default=sim_power.PowerSpec.window_s, gt=0)
    min_history_s: float = Field(default=sim_power.PowerSpec.min_history_s, ge=0)
    valve: ValveModel | None = ValveModel()

    def spec(self, valve: bool = True) -> sim_power.PowerSpec:
        v = self.valve if valve else None
        return sim_power.PowerSpec(
            sample_s=self.sample_s,
            window_s=self.window_s,
            min_history_s=self.min_history_s,
            valve=None
            if v is None
            else sim_power.ValveSpec(v.interval_s, v.high_pct, v.low_pct, v.floor_pct, v.step_pct),
        )


class VariantModel(_Strict):
    """A named variant for --compare: every rack's budget mode / margin, the valve on or
    off; what it leaves out stays as the scenario says."""

    budget_mode: Literal["nameplate", "measured"] | None = None
    budget_margin: float | None = Field(default=None, ge=1.0, le=2.0)
    valve: bool | None = None


class Scenario(_Strict):
    name: str = "scenario"
    seed: int = 0
    warmup: float = Field(default=0.0, ge=0, lt=1)
    deployments: list[DeploymentModel] = Field(min_length=1)
    # Warm spares shared by the autoscaled deployments without a warm_pool of their own
    warm_pool: dict[str, int] = Field(default_factory=dict)
    faults: FaultsModel | None = None  # for every deployment without its own
    # The shared warm pool as servers in racks with power budgets (instead of warm_pool):
    # spares are then chosen and released by fleet/provisioning/placement.py
    racks: list[RackModel] = Field(default_factory=list)
    # The wall-clock time of simulated second 0 (the calendar's windows are on this clock);
    # without an offset: UTC
    start: datetime = sim_calendar.DEFAULT_START
    calendar_interval_s: float = Field(default=sim_calendar.TICK_S, gt=0)
    power: PowerModel | None = None  # drawn power etc. (fleet/sim/power.py); needs racks
    power_valve: bool = True  # a variant may turn the valve off
    variants: dict[str, VariantModel] = Field(default_factory=dict)

    def variant(self, name: str) -> Scenario:
        """The scenario as variant `name` changes it."""
        v = self.variants[name]
        racks = [
            r.model_copy(
                update={
                    k: getattr(v, k)
                    for k in ("budget_mode", "budget_margin")
                    if getattr(v, k) is not None
                }
            )
            for r in self.racks
        ]
        update: dict[str, object] = {"racks": racks}
        if v.valve is not None:
            update["power_valve"] = v.valve
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def _power(self) -> Scenario:
        if self.power is not None and not self.racks:
            raise ValueError("power needs racks")
        if any(r.budget_mode == "measured" for r in self.racks) and self.power is None:
            raise ValueError("a measured rack needs `power` (its draw is simulated there)")
        for name, v in self.variants.items():
            if v.budget_mode == "measured" and self.power is None:
                raise ValueError(f"variant {name}: measured needs `power`")
        return self

    @field_validator("warm_pool")
    @classmethod
    def _pool(cls, v: dict[str, int]) -> dict[str, int]:
        _check_pool(v)
        return v

    def shared_pool(self) -> dict[str, int]:
        """The shared warm pool's spares by GPU model (from `racks` when given)."""
        if not self.racks:
            return dict(self.warm_pool)
        pool: dict[str, int] = {}
        for rack in self.racks:
            for gpu, n in rack.spares.items():
                pool[gpu] = pool.get(gpu, 0) + n
        return pool

    @model_validator(mode="after")
    def _one_pool(self) -> Scenario:
        if self.racks and self.warm_pool:
            raise ValueError("give the shared warm pool as racks or as warm_pool, not both")
        names = [r.name for r in self.racks]
        if len(set(names)) != len(names):
            raise ValueError("rack names must be unique")
        return self

    @field_validator("start")
    @classmethod
    def _start(cls, v: datetime) -> datetime:
        return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)


class ScenarioError(ValueError):
    pass


def load(path: str | Path) -> Scenario:
    """Read and check a scenario file; ScenarioError says what is wrong and where."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{p}: {exc}") from exc
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(x) for x in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        ]
        raise ScenarioError(f"{p}: not a valid scenario:\n" + "\n".join(lines)) from None


# --- requests ---------------------------------------------------------------------------------


def capacity_rps(spec: DeploymentSpec, sizes: Sequence[tuple[int, int]]) -> float:
    """Requests per second the deployment serves in the cost model's steady state for this mix
    at max_batch_size streams per engine."""
    eff_in, eff_out = cost_model.effective_lengths(sizes)
    mean_out = sum(o for _, o in sizes) / len(sizes)
    total = 0.0
    for gpu, n in spec.replicas:
        tok_s = cost_model.predicted_decode_tokens_per_s(
            spec.shape(gpu), spec.max_batch_size, eff_in, eff_out
        )
        total += n * tok_s / mean_out
    return total


def generate(scenario: Scenario, seed: int | None = None) -> list[SimRequest]:
    """Every deployment's requests, merged in arrival order, numbered 0..n-1."""
    base_seed = scenario.seed if seed is None else seed
    merged: list[tuple[float, int, arr.Arrival, int | None]] = []
    for index, dep in enumerate(scenario.deployments):
        a = dep.arrivals
        spec = dep.spec()
        got: list[arr.Arrival]
        if a.trace is not None:
            rate = None
            if a.load is not None:
                rows = arr.replay_trace(a.trace, offset=a.offset, count=a.requests)
                rate = a.load * capacity_rps(spec, [(x.prompt, x.output) for x in rows])
            got = arr.replay_trace(
                a.trace, offset=a.offset, count=a.requests, speed=a.speed, rate_rps=rate
            )
        else:
            if a.rate is None and a.load is None:
                raise ScenarioError(f"deployment {dep.name!r}: arrivals need a trace or a rate")
            if a.duration_s is None:
                raise ScenarioError(f"deployment {dep.name!r}: Poisson arrivals need duration_s")
            sizes = (a.sizes or SizesModel(trace="code")).sizes()
            curve: arr.RateCurve
            if a.rate is not None:
                curve = a.rate.curve()
            else:
                assert a.load is not None
                sample = (
                    sizes.rows
                    if isinstance(sizes, arr.TraceSizes)
                    else [sizes.draw(random.Random(base_seed))]
                )
                curve = arr.Constant(a.load * capacity_rps(spec, sample))
            got = arr.poisson(curve, sizes, a.duration_s, base_seed * 1000 + index)
        merged.extend((x.at, index, x, a.max_tokens) for x in got)
    merged.sort(key=lambda m: (m[0], m[1]))
    return [
        SimRequest(
            rid=k,
            arrival=x.at,
            prompt=x.prompt,
            output=min(x.output, mt) if mt else x.output,
            max_tokens=mt or x.output,
            deployment=index,
        )
        for k, (_, index, x, mt) in enumerate(merged)
    ]


def _fresh(requests: Sequence[SimRequest]) -> list[SimRequest]:
    return [
        SimRequest(r.rid, r.arrival, r.prompt, r.output, r.max_tokens, r.deployment)
        for r in requests
    ]


# --- running ----------------------------------------------------------------------------------


def run_requests(
    scenario: Scenario,
    requests: Sequence[SimRequest],
    *,
    strategy: str | None = None,
    batching: str | None = None,
    per_iteration: bool = False,
    seed: int | None = None,
) -> RunResult:
    """One run; `seed` (default: the scenario's) draws the boot times."""
    specs = [d.spec(strategy, batching, scenario.faults) for d in scenario.deployments]
    power_from = 0.0
    if requests:  # the power figures leave out the warmup, as the summary does
        power_from = requests[int(len(requests) * scenario.warmup)].arrival - requests[0].arrival
    sim = Simulation(
        specs,
        per_iteration=per_iteration,
        warm_pool=tuple(scenario.warm_pool.items()),
        seed=scenario.seed if seed is None else seed,
        start=scenario.start,
        calendar_interval_s=scenario.calendar_interval_s,
        racks=[r.spec() for r in scenario.racks],
        power=None if scenario.power is None else scenario.power.spec(scenario.power_valve),
        power_from_s=power_from,
    )
    return sim.run(_fresh(requests))


def run(scenario: Scenario, seed: int | None = None) -> tuple[RunResult, Summary]:
    result = run_requests(scenario, generate(scenario, seed), seed=seed)
    return result, summarize(result, warmup=scenario.warmup)


def parse_variant(text: str) -> tuple[str | None, str | None]:
    """ "least_pending", "static", "round_robin/static" → (strategy, batching)."""
    strategy: str | None = None
    batching: str | None = None
    for part in text.split("/"):
        part = part.strip()
        if part in ("continuous", "static"):
            batching = part
        elif part in STRATEGIES:
            strategy = part
        else:
            raise ValueError(
                f"unknown variant part {part!r}: a strategy ({', '.join(STRATEGIES)}) "
                "or a batching (continuous, static)"
            )
    return strategy, batching


def compare(
    scenario: Scenario,
    variants: Sequence[str],
    seed: int | None = None,
    on_result: Callable[[str, RunResult], None] | None = None,
) -> list[tuple[str, Summary]]:
    """Each variant ("strategy", "batching", "strategy/batching", or one the scenario names
    under `variants`) on the SAME requests; `on_result(variant, result)` sees each run (e.g.
    to chart it) before the next starts."""
    requests = generate(scenario, seed)
    rows: list[tuple[str, Summary]] = []
    for v in variants:
        if v in scenario.variants:
            strategy, batching, sc = None, None, scenario.variant(v)
        else:
            (strategy, batching), sc = parse_variant(v), scenario
        result = run_requests(sc, requests, strategy=strategy, batching=batching, seed=seed)
        if on_result is not None:
            on_result(v, result)
        rows.append((v, summarize(result, warmup=scenario.warmup)))
    return rows


def table(rows: Sequence[tuple[str, Summary]]) -> str:
    """A plain-text table of summaries (seconds; SLA as a percentage; peak replicas serving
    or booting, and warm-pool exhaustions)."""
    head = (
        f"{'variant':<34} {'reqs':>6} {'lat p50':>8} {'p95':>8} {'p99':>8} "
        f"{'ttft p50':>8} {'p95':>8} {'p99':>8} {'SLA':>6} {'GPU-h':>7} {'kWh':>7} "
        f"{'peak':>5} {'exh':>4}"
    )
    faults = any(s.xids for _, s in rows)
    if faults:
        head += f" {'xids':>5} {'fail':>5} {'retry':>5} {'boot':>5} {'quar':>5}"
    power = any(s.power for _, s in rows)
    if power:
        head += (
            f" {'srv p95':>8} {'servers':>7} {'peak':>5} {'srv/kW':>7} {'exceed':>6} "
            f"{'thr GPU-s':>9}"
        )
    lines = [head, "-" * len(head)]
    for name, s in rows:
        sla = "-" if s.sla_attainment is None else f"{100 * s.sla_attainment:.1f}%"
        lines.append(
            f"{name:<34} {s.requests:>6} {s.latency_p50:>8.2f} {s.latency_p95:>8.2f} "
            f"{s.latency_p99:>8.2f} {s.ttft_p50:>8.3f} {s.ttft_p95:>8.3f} {s.ttft_p99:>8.3f} "
            f"{sla:>6} {s.gpu_hours:>7.2f} {s.kwh:>7.2f} {s.peak_replicas:>5} "
            f"{s.exhaustions:>4}"
            + (
                f" {s.xids:>5} {s.failed:>5} {s.retried:>5} {s.reboots:>5} {s.quarantined:>5}"
                if faults
                else ""
            )
            + (_power_cells(s) if power else "")
        )
    return "\n".join(lines)


def _power_cells(s: Summary) -> str:
    p = s.power
    if p is None:
        return f" {s.served_p95:>8.2f}" + " " * 41
    return (
        f" {s.served_p95:>8.2f} {p.serving_mean:>7.1f} {p.serving_peak:>5} "
        f"{p.servers_per_kw:>7.3f} {p.exceedances:>6} {p.throttled_gpu_s:>9.0f}"
    )


def rack_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """Per rack, the variants side by side: servers serving (mean, peak), servers per kW of
    budget, peak drawn kW, kW committed at the end, exceedances, throttled GPU-seconds and cap
    changes."""
    runs = [(name, s.power) for name, s in rows if s.power is not None]
    if not runs:
        return ""
    racks = runs[0][1].racks
    head = f"{'rack':<12} {'budget kW':>9}"
    for name, _ in runs:
        head += (
            f" | {name[:12]:<12} {'mode':<9} {'srv':>5} {'peak':>4} {'srv/kW':>6} "
            f"{'peak kW':>7} {'commit':>6} {'exc':>4} {'thr GPU-s':>9} {'caps':>4}"
        )
    lines = [head, "-" * len(head)]
    for k, rack in enumerate(racks):
        line = f"{rack.rack:<12} {rack.budget_w / 1000:>9.1f}"
        for _, p in runs:
            r = p.racks[k]
            line += (
                f" | {'':<12} {r.mode:<9} {r.serving_mean:>5.1f} {r.serving_peak:>4} "
                f"{r.servers_per_kw:>6.3f} {r.peak_w / 1000:>7.1f} {r.committed_w / 1000:>6.1f} "
                f"{r.exceedances:>4} "
                f"{r.throttled_gpu_s:>9.0f} {r.cap_changes:>4}"
            )
        lines.append(line)
    return "\n".join(lines)


def report(result: RunResult) -> list[str]:
    """What happened besides the figures, a line each: calendar firings, warm-pool
    exhaustion (with placement's reasons), faults."""
    lines = [
        f"calendar: {f.deployment} window {f.window_start:%Y-%m-%d %H:%M} UTC fired at "
        f"{f.at:.0f} s (lead {f.lead_s:.0f} s, {f.lead_basis}): target {f.target_before} → "
        f"{f.target_after}"
        for f in result.fired
    ]
    if result.exhaustions:
        first = result.exhaustions[0]
        lines.append(
            f"warm pool exhausted at {len(result.exhaustions)} tick(s), first at {first.at:.0f} s "
            f"({first.deployment}: {first.short} short)"
        )
        lines += [f"  {why}" for why in first.reasons]
    f = result.faults
    if f is not None:
        xids = ", ".join(f"Xid {code} × {n}" for code, n in sorted(f.xids.items())) or "none"
        lines.append(
            f"faults: {xids}; {f.restarts} engine restarts, {f.drains} self-drains, "
            f"{f.reboots} power cycles, {f.quarantined} quarantined; {f.retried} requests "
            f"retried elsewhere, {f.failed} lost mid-stream"
        )
    return lines
