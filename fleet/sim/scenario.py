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
        #   warm_pool: {H100: 4}    # its own spares; default: the scenario's warm_pool
    warm_pool: {H100: 6}        # spares shared by autoscaled deployments without their own

Capacity (for `load`): the cost model's steady state for the deployment's request mix at
max_batch_size streams per engine, summed (as bench/routing.py computes it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
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

from agents.engine import cost_model
from fleet.router.strategy import STRATEGIES
from fleet.sim import arrivals as arr
from fleet.sim.autoscale import AutoscaleSpec, BootTime
from fleet.sim.core import DeploymentSpec, RunResult, Simulation, Summary, summarize
from fleet.sim.engine import SimRequest


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

    @field_validator("warm_pool")
    @classmethod
    def _pool(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        return _check_pool(v)

    @field_validator("boot_s")
    @classmethod
    def _boot(cls, v: float | BootModel) -> float | BootModel:
        if isinstance(v, (int, float)) and not v > 0:
            raise ValueError("boot_s must be > 0 seconds (or {mean, sd})")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleModel:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self

    def spec(self, sla: SlaModel) -> AutoscaleSpec:
        boot = (
            BootTime(self.boot_s.mean, self.boot_s.sd)
            if isinstance(self.boot_s, BootModel)
            else BootTime(float(self.boot_s))
        )
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
            sla_p95_s=sla.latency_s,
            sla_ttft_s=sla.ttft_s,
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

    @model_validator(mode="after")
    def _autoscaled(self) -> DeploymentModel:
        if self.autoscale is not None and (self.sla.latency_s is None or self.sla.ttft_s is None):
            raise ValueError(
                "autoscale needs sla.latency_s and sla.ttft_s (the policy's latency targets)"
            )
        return self

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

    def spec(self, strategy: str | None = None, batching: str | None = None) -> DeploymentSpec:
        b = batching or self.batching
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
            autoscale=None if self.autoscale is None else self.autoscale.spec(self.sla),
        )


class Scenario(_Strict):
    name: str = "scenario"
    seed: int = 0
    warmup: float = Field(default=0.0, ge=0, lt=1)
    deployments: list[DeploymentModel] = Field(min_length=1)
    # Warm spares shared by the autoscaled deployments without a warm_pool of their own
    warm_pool: dict[str, int] = Field(default_factory=dict)

    @field_validator("warm_pool")
    @classmethod
    def _pool(cls, v: dict[str, int]) -> dict[str, int]:
        _check_pool(v)
        return v


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
    specs = [d.spec(strategy, batching) for d in scenario.deployments]
    sim = Simulation(
        specs,
        per_iteration=per_iteration,
        warm_pool=tuple(scenario.warm_pool.items()),
        seed=scenario.seed if seed is None else seed,
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
    scenario: Scenario, variants: Sequence[str], seed: int | None = None
) -> list[tuple[str, Summary]]:
    """Each variant ("strategy", "batching" or "strategy/batching") on the SAME requests."""
    requests = generate(scenario, seed)
    rows: list[tuple[str, Summary]] = []
    for v in variants:
        strategy, batching = parse_variant(v)
        result = run_requests(scenario, requests, strategy=strategy, batching=batching, seed=seed)
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
    lines = [head, "-" * len(head)]
    for name, s in rows:
        sla = "-" if s.sla_attainment is None else f"{100 * s.sla_attainment:.1f}%"
        lines.append(
            f"{name:<34} {s.requests:>6} {s.latency_p50:>8.2f} {s.latency_p95:>8.2f} "
            f"{s.latency_p99:>8.2f} {s.ttft_p50:>8.3f} {s.ttft_p95:>8.3f} {s.ttft_p99:>8.3f} "
            f"{sla:>6} {s.gpu_hours:>7.2f} {s.kwh:>7.2f} {s.peak_replicas:>5} "
            f"{s.exhaustions:>4}"
        )
    return "\n".join(lines)
