"""A week of demand at fleet scale: predictive + reactive scaling against reactive alone and a
fleet sized for the peak (docs/sim.md, "A week at fleet scale").

A week at 1,000 GPUs is billions of requests: the request-level simulator (fleet/sim/core.py)
would take hours. So this runs a **fluid model**, calibrated by the request-level simulator in
the same run:

- **Calibration.** For the scenario's deployment (model, GPU, TP, batch, SLA, the trace's
  request sizes) the request-level simulator runs `engines` engines at Poisson loads `LEVELS`
  of their predicted capacity (`scenario.capacity_rps`). Each level keeps what a fluid tick
  needs: every request's slack to the SLA (min(SLA − latency, TTFT SLA − TTFT)), the p95s, the
  mean wait and service time, and the mean KV tokens a running request holds.
- **Ticks** (the autoscaler's interval, 15 s). The tick's arrivals join a backlog that the
  serving replicas drain at their capacity; the tick's requests wait the backlog's drain time
  on top of the calibrated latency at the tick's utilisation (interpolated between levels;
  above the last level, the last one's). A request meets the SLA when its slack covers that
  wait. Nothing serving: every arrival waits.
- **The autoscaler** is the production policy (`decide`) on `Signals` built from the fluid
  state: queue per GPU (the backlog plus the engines' queue by Little's law), the p95s plus
  the backlog's wait, slot use and KV use by Little's law. The forecaster
  (fleet/autoscaler/forecast.py) sees each minute's demand as it happens, fits its profile
  every `refit_s`, and its need joins the decision as in the service. Boots take the
  scenario's boot distribution; a scale-down calls off the latest boot first, then drains a
  server at once (a drain's minute is not modelled).
- **The demand** (`Demand`): the Azure trace's hour of arrivals in `interval_s` buckets, its
  bursts as they came (normalised to mean 1), each simulated hour taking the pattern from a
  seeded offset of its own; laid on a daily cosine (trough at `peak_hour` − 12 h) and a
  per-weekday factor. The busiest tick of the scored week loads the whole fleet to
  `peak_load` of its capacity. The daily and weekly shapes are assumed (no public week-long
  trace ships with Fleet); the bursts are measured.
- **Scored**: the last `days` days; the `history_days` before them run the same way (the
  forecaster learns from them, the reactive variant runs them too) and are not counted.

Pure of I/O except reading the trace; time is simulated seconds from `start`.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.autoscaler import forecast as fc
from fleet.autoscaler.policy import decide
from fleet.autoscaler.signals import DeploymentState, Signals
from fleet.sim import autoscale as auto
from fleet.sim import scenario as sim
from fleet.sim.arrivals import TraceSizes
from fleet.traces import load_trace
from fleet_core import cost_model

__all__ = [
    "VARIANTS",
    "Calibration",
    "Demand",
    "WeekResult",
    "WeekScenario",
    "calibrate",
    "compare",
    "run",
    "table",
]

VARIANTS = ("predictive", "reactive", "peak")
LEVELS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
MINUTE_S = 60.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DailyModel(_Strict):
    trough: float = Field(default=0.3, gt=0, le=1)  # share of the daily peak at its lowest
    peak_hour: float = Field(default=14.0, ge=0, lt=24)  # UTC


class DemandModel(_Strict):
    trace: Literal["conv", "code"] = "conv"
    peak_load: float = Field(default=0.8, gt=0, le=1.5)  # the busiest tick, of the fleet's capacity
    daily: DailyModel = DailyModel()
    weekly: tuple[float, ...] = Field(default=(1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.65))

    def check(self) -> None:
        if len(self.weekly) != 7 or any(not w > 0 for w in self.weekly):
            raise sim.ScenarioError("demand.weekly: 7 factors > 0, Monday first")


class ForecastModel(_Strict):
    refit_s: float = Field(default=3600.0, gt=0)
    slot_s: float = fc.SLOT_S
    weeks: int = Field(default=4, ge=1)
    peak_q: float = Field(default=fc.PEAK_Q, gt=0, le=1)
    max_error: float = Field(default=0.35, gt=0)
    resume_error: float = Field(default=0.25, gt=0)

    def config(self) -> fc.ForecastConfig:
        try:
            return fc.ForecastConfig(
                slot_s=self.slot_s,
                weeks=self.weeks,
                peak_q=self.peak_q,
                max_error=self.max_error,
                resume_error=self.resume_error,
            )
        except ValueError as exc:
            raise sim.ScenarioError(f"forecast: {exc}") from None


class CalibrationModel(_Strict):
    engines: int = Field(default=4, ge=1)
    duration_s: float = Field(default=600.0, gt=0)


class WeekScenario(_Strict):
    kind: Literal["week"]
    name: str = "week"
    seed: int = 0
    start: datetime = datetime(2026, 12, 7, tzinfo=UTC)  # a Monday
    days: float = Field(default=7.0, gt=0)
    history_days: float = Field(default=21.0, ge=0)
    gpus: int = Field(ge=1)  # the fleet: serving + warm spares
    gpu: str = "H100"
    model: str = "llama-3.1-70b"
    tp_size: int = Field(default=8, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    max_num_tokens: int = Field(default=8192, ge=1)
    sla: sim.SlaModel
    demand: DemandModel = DemandModel()
    autoscale: sim.AutoscaleModel = sim.AutoscaleModel()
    forecast: ForecastModel = ForecastModel()
    calibration: CalibrationModel = CalibrationModel()

    @model_validator(mode="after")
    def _check(self) -> WeekScenario:
        if self.sla.latency_s is None or self.sla.ttft_s is None:
            raise ValueError("sla needs latency_s and ttft_s (the attainment is against both)")
        if self.gpus < self.tp_size:
            raise ValueError(
                f"gpus ({self.gpus}) is less than one server of tp_size {self.tp_size}"
            )
        return self

    @property
    def servers(self) -> int:
        return self.gpus // self.tp_size

    def deployment(self, engines: int, load: float, duration_s: float) -> sim.DeploymentModel:
        return sim.DeploymentModel(
            name=self.name,
            model=self.model,
            replicas={self.gpu: engines},
            tp_size=self.tp_size,
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            sla=self.sla,
            arrivals=sim.ArrivalsModel(
                load=load, duration_s=duration_s, sizes=sim.SizesModel(trace=self.demand.trace)
            ),
        )


def load(path: str | Path) -> WeekScenario | None:
    """A week scenario (`kind: week`) from `path`; None for any other scenario file (the
    request-level simulator's: fleet/sim/scenario.py). ScenarioError says what is wrong."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise sim.ScenarioError(f"{p}: {exc}") from exc
    if not isinstance(data, dict) or data.get("kind") != "week":
        return None
    try:
        return WeekScenario.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(x) for x in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        ]
        raise sim.ScenarioError(f"{p}: not a valid week scenario:\n" + "\n".join(lines)) from None


# --- calibration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """What the request-level simulator measured at one load."""

    load: float
    slack: list[float]  # sorted: min(SLA − latency, TTFT SLA − TTFT) per request
    p95_s: float
    ttft_p95_s: float
    wait_s: float  # mean arrival → first scheduled
    service_s: float  # mean first scheduled → finish
    attainment: float  # at no added wait

    def met(self, wait: float) -> float:
        """The share whose slack covers `wait` more seconds."""
        return 1.0 - bisect.bisect_left(self.slack, wait) / len(self.slack)


@dataclass(frozen=True)
class Calibration:
    capacity_rps: float  # one engine (= one server here), at max_batch_size streams
    kv_tokens_per_request: float  # mean tokens a running request holds (prompt + half its answer)
    kv_capacity_tokens: float  # one engine's
    levels: list[Level]

    def at(self, load: float) -> tuple[Level, Level, float]:
        """The levels around `load` and the weight of the upper one."""
        ls = self.levels
        if load <= ls[0].load:
            return ls[0], ls[0], 0.0
        if load >= ls[-1].load:
            return ls[-1], ls[-1], 0.0
        i = bisect.bisect_right([lv.load for lv in ls], load)
        lo, hi = ls[i - 1], ls[i]
        return lo, hi, (load - lo.load) / (hi.load - lo.load)


def calibrate(scenario: WeekScenario, seed: int) -> Calibration:
    """Run the request-level simulator at each of LEVELS (module docstring)."""
    c = scenario.calibration
    levels = []
    sla = scenario.sla
    for i, load in enumerate(LEVELS):
        # Enough simulated time at low loads for a few thousand requests.
        sc = sim.Scenario(
            name=f"{scenario.name}-calibration",
            seed=seed * 1000 + i,
            warmup=0.1,
            deployments=[scenario.deployment(c.engines, load, c.duration_s)],
        )
        result, summary = sim.run(sc)
        reqs = result.requests[int(len(result.requests) * 0.1) :]
        done = [r for r in reqs if r.finish == r.finish]
        if len(done) < 20:
            raise sim.ScenarioError(
                f"calibration at load {load}: only {len(done)} requests; raise "
                "calibration.duration_s"
            )
        slack = sorted(
            min(
                (sla.latency_s - (r.finish - r.arrival)) if sla.latency_s else math.inf,
                (sla.ttft_s - (r.first_token - r.arrival)) if sla.ttft_s else math.inf,
            )
            for r in done
        )
        levels.append(
            Level(
                load=load,
                slack=slack,
                p95_s=summary.latency_p95,
                ttft_p95_s=summary.ttft_p95,
                wait_s=sum(r.start - r.arrival for r in done) / len(done),
                service_s=sum(r.finish - r.start for r in done) / len(done),
                attainment=summary.sla_attainment if summary.sla_attainment is not None else 1.0,
            )
        )
    dep = scenario.deployment(1, 1.0, 1.0)
    spec = dep.spec()
    mix = TraceSizes(scenario.demand.trace).rows
    kv_per = sum(p + o / 2 for p, o in mix) / len(mix)
    return Calibration(
        capacity_rps=sim.capacity_rps(spec, mix),
        kv_tokens_per_request=kv_per,
        kv_capacity_tokens=float(cost_model.kv_capacity_tokens(spec.shape(scenario.gpu))),
        levels=levels,
    )


# --- demand ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Demand:
    """Requests per second for each tick of [−history, days), from second 0 of the history."""

    interval_s: float
    rates: list[float]  # per tick
    scored_from: int  # the first scored tick
    burst_peak: float  # the trace's largest bucket ÷ its mean

    @property
    def peak_rps(self) -> float:
        return max(self.rates[self.scored_from :])


def hour_pattern(trace: str, interval_s: float) -> list[float]:
    """The trace's arrivals per `interval_s` bucket over its span, normalised to mean 1."""
    rows = load_trace(trace)
    span = rows[-1].at_s - rows[0].at_s
    buckets = max(1, int(span // interval_s))
    counts = [0] * buckets
    for r in rows:
        i = int((r.at_s - rows[0].at_s) // interval_s)
        if i < buckets:
            counts[i] += 1
    mean = sum(counts) / buckets
    return [x / mean for x in counts]


def build_demand(scenario: WeekScenario, capacity_rps: float, seed: int) -> Demand:
    d = scenario.demand
    d.check()
    interval = scenario.autoscale.interval_s
    pattern = hour_pattern(d.trace, interval)
    rng = random.Random(f"{seed}-demand")
    history_s = scenario.history_days * 86_400.0
    total_s = history_s + scenario.days * 86_400.0
    ticks = int(total_s // interval)
    t0 = scenario.start.timestamp() - history_s
    per_hour = max(1, int(3600 // interval))
    offsets: dict[int, int] = {}
    shape = []
    for i in range(ticks):
        t = t0 + i * interval
        hour = int((t - t0) // 3600)
        if hour not in offsets:
            offsets[hour] = rng.randrange(len(pattern))
        burst = pattern[(offsets[hour] + i % per_hour) % len(pattern)]
        shape.append(cycle(t, d) * burst)
    scored = int(history_s // interval)
    top = max(shape[scored:])
    scale = d.peak_load * scenario.servers * capacity_rps / top
    return Demand(interval, [x * scale for x in shape], scored, max(pattern))


def cycle(t: float, d: DemandModel) -> float:
    """The daily cosine × the weekday's factor at epoch second `t` (UTC)."""
    day = (t % 86_400.0) / 3600.0
    weekday = int(((t // 86_400.0) + 3) % 7)  # 1970-01-01 was a Thursday
    daily = (
        d.daily.trough
        + (1 - d.daily.trough) * (1 + math.cos(2 * math.pi * (day - d.daily.peak_hour) / 24)) / 2
    )
    return d.weekly[weekday] * daily


# --- the run ---------------------------------------------------------------------------------


@dataclass
class WeekResult:
    variant: str
    requests: float = 0.0  # scored
    met: float = 0.0
    gpu_hours: float = 0.0  # scored: serving + booting
    booting_gpu_hours: float = 0.0
    peak_servers: int = 0
    exhaustions: int = 0  # scored ticks short of warm spares
    forecast_ticks: int = 0  # scored ticks the forecast won
    forecast_off: list[tuple[float, str]] = field(default_factory=list)  # (time, "off"/"on")
    wait_p99_s: float = 0.0  # of the backlog's wait, per request
    missed_by_hour: list[float] = field(default_factory=lambda: [0.0] * 24)  # UTC hour of day
    gpu_hours_by_hour: list[float] = field(default_factory=lambda: [0.0] * 24)
    # (second of the scored days, req/s, target, serving, rule, share within SLA)
    timeline: list[tuple[float, float, int, int, str, float]] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else math.nan


def run(
    scenario: WeekScenario,
    variant: str,
    calibration: Calibration,
    demand: Demand,
    seed: int,
    *,
    timeline_every: int = 0,
) -> WeekResult:
    if variant not in VARIANTS:
        raise sim.ScenarioError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    a = scenario.autoscale
    spec = a.spec(scenario.sla)
    config = spec.policy_config()
    cal = calibration
    fleet = scenario.servers
    interval = demand.interval_s
    t0 = scenario.start.timestamp() - scenario.history_days * 86_400.0
    gpus = scenario.tp_size
    rng = random.Random(f"{seed}-boots")
    out = WeekResult(variant)
    waits: list[tuple[float, float]] = []  # (wait, requests) per scored tick

    if variant == "peak":
        serving = fleet
    else:
        # The autoscaled fleets start at half their capacity busy.
        start = math.ceil(demand.rates[0] / cal.capacity_rps / 0.5)
        serving = min(fleet, max(spec.min_replicas, start))
    target = serving
    booting: list[float] = []  # ready times
    backlog = 0.0
    history: deque[Signals] = deque()
    last_up: float | None = None
    last_down: float | None = None
    fcfg = scenario.forecast.config()
    accuracy = fc.Accuracy(fcfg)
    minutes: list[tuple[float, float]] = []
    samples: deque[tuple[float, int, float | None]] = deque(maxlen=fc.BUSY_KEPT)
    profile: fc.Profile | None = None
    next_fit = t0
    minute_requests = 0.0
    minute_slot = 0.0
    minute_ticks = 0
    per_minute = max(1, round(MINUTE_S / interval))
    keep_minutes = int(fcfg.weeks * 7 * 1440)
    # The look-ahead the service plans with: the boots' p90 plus FLEET_BOOT_MARGIN_PCT
    # (fleet/provisioning/boot_times.py), here over the scenario's boot distribution.
    lead = spec.ready_p90_s * (1 + float(auto._default("boot_margin_pct")) / 100)
    seen: fc.Forecast | None = None
    per_server: float | None = None

    for i, rate in enumerate(demand.rates):
        now = t0 + i * interval
        scored = i >= demand.scored_from
        # Boots that finished join.
        if booting:
            ready = [b for b in booting if b <= now]
            if ready:
                booting = [b for b in booting if b > now]
                serving += len(ready)
        capacity = serving * cal.capacity_rps
        arrived = rate * interval
        start_backlog = backlog
        offered = backlog + arrived
        served = min(offered, capacity * interval)
        backlog = offered - served
        if capacity > 0:
            load = min(1.0, offered / (capacity * interval))
            wait = (start_backlog + backlog) / 2 / capacity
        else:
            load = 1.0
            wait = math.inf
        lo, hi, w = cal.at(load)
        met = 1.0
        if scored:
            met = (1 - w) * lo.met(wait) + w * hi.met(wait) if capacity > 0 else 0.0
            out.requests += arrived
            out.met += arrived * met
            hour = int((now % 86_400) // 3600)
            out.missed_by_hour[hour] += arrived * (1 - met)
            on = serving + len(booting)
            out.gpu_hours += on * gpus * interval / 3600
            out.gpu_hours_by_hour[hour] += on * gpus * interval / 3600
            out.booting_gpu_hours += len(booting) * gpus * interval / 3600
            out.peak_servers = max(out.peak_servers, on)
            waits.append((wait, arrived))

        # What the autoscaler sees (module docstring).
        slot_use: float | None = None
        if serving > 0:
            per = rate / serving
            p95 = (1 - w) * lo.p95_s + w * hi.p95_s + wait
            ttft = (1 - w) * lo.ttft_p95_s + w * hi.ttft_p95_s + wait
            engine_queue = rate * ((1 - w) * lo.wait_s + w * hi.wait_s)
            running = per * ((1 - w) * lo.service_s + w * hi.service_s)
            slot_use = min(1.0, running / scenario.max_batch_size)
            kv = min(1.0, running * cal.kv_tokens_per_request / cal.kv_capacity_tokens)
            signals = Signals(
                now,
                (backlog + engine_queue) / (serving * gpus),
                kv,
                p95,
                ttft,
                serving * gpus,
                slot_use,
            )
        else:
            signals = Signals(now, None, None, None, None)
        history.append(signals)
        while history and history[0].at < now - spec.keep_s:
            history.popleft()

        # The minute's demand, as the routers would count it.
        minute_requests += arrived
        minute_slot += slot_use or 0.0
        minute_ticks += 1
        if minute_ticks == per_minute:
            minute = now - (per_minute - 1) * interval
            minutes.append((minute, minute_requests))
            use = minute_slot / per_minute if serving else None
            if use is not None and use >= fc.BUSY:
                samples.append((minute_requests, serving, use))
            accuracy.observe(minute, minute_requests)
            switched = accuracy.update()
            if switched is not None and scored:
                out.forecast_off.append((now - scenario.start.timestamp(), switched))
            minute_requests = minute_slot = 0.0
            minute_ticks = 0

        if variant == "peak":
            continue

        forecast_servers: int | None = None
        basis = ""
        if variant == "predictive":
            # The forecast moves only as minutes complete: made again at each minute's end.
            if now >= next_fit:
                profile = fc.fit(minutes[-keep_minutes:], now, fcfg)
                per_server = fc.capacity_per_server(samples, config.slot_ceiling)
                next_fit = now + scenario.forecast.refit_s
            if minute_ticks == 0 and profile is not None:
                seen = fc.forecast(profile, minutes[-60:], now, lead)
                if seen is not None:
                    accuracy.predict(fc.minute_of(now + lead), seen.point_rpm)
            if seen is not None and per_server is not None and accuracy.on:
                forecast_servers = min(fc.servers_for(seen.peak_rpm, per_server), fleet)
                basis = seen.describe(lead)
        state = auto.state(
            scenario.name,
            spec,
            gpus_per_replica=gpus,
            target=target,
            serving=serving,
            booting=len(booting),
            last_up_at=last_up,
            last_down_at=last_down,
            router_waiting=round(backlog) if serving == 0 else 0,
        )
        state = replace(state, boot_p90_s=lead)  # as the service's state carries it
        if forecast_servers is not None:
            state = _with(state, forecast_servers, basis)
        decision = decide(state, list(history), now, config)
        if decision.target != target:
            if decision.rule not in ("min", "floor", "pinned"):
                if decision.target > target:
                    last_up = now
                else:
                    last_down = now
            target = decision.target
        if decision.rule == "forecast" and scored:
            out.forecast_ticks += 1
        # Make the target true: boot from the warm pool, or call off boots and drain.
        have = serving + len(booting)
        if target > have:
            room = fleet - have
            n = min(target - have, room)
            if n < target - have and scored:
                out.exhaustions += 1
            booting.extend(now + spec.ready_s(rng, cached=False) for _ in range(n))
        elif target < have:
            extra = have - target
            booting.sort()
            while extra and booting:
                booting.pop()
                extra -= 1
            serving -= extra
        if timeline_every and i % timeline_every == 0 and scored:
            at = now - scenario.start.timestamp()
            out.timeline.append((at, rate, target, serving, decision.rule, met))
    out.wait_p99_s = _weighted_quantile(waits, 0.99)
    return out


def _with(state: DeploymentState, servers: int, basis: str) -> DeploymentState:
    return replace(state, forecast_servers=servers, forecast_basis=basis)


def _weighted_quantile(values: Sequence[tuple[float, float]], q: float) -> float:
    total = sum(w for _, w in values)
    if total <= 0:
        return math.nan
    acc = 0.0
    for v, weight in sorted(values):
        acc += weight
        if acc >= q * total:
            return v
    return sorted(values)[-1][0]


# --- compare ---------------------------------------------------------------------------------


def compare(
    scenario: WeekScenario, variants: Sequence[str], seed: int | None = None
) -> tuple[Calibration, Demand, list[WeekResult]]:
    s = scenario.seed if seed is None else seed
    for v in variants:
        if v not in VARIANTS:
            raise sim.ScenarioError(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
    cal = calibrate(scenario, s)
    demand = build_demand(scenario, cal.capacity_rps, s)
    return cal, demand, [run(scenario, v, cal, demand, s) for v in variants]


def report(scenario: WeekScenario, cal: Calibration, demand: Demand) -> list[str]:
    """What the run stands on, before its table."""
    rates = demand.rates[demand.scored_from :]
    mean = sum(rates) / len(rates)
    top = cal.levels[-1]
    return [
        f"{scenario.name}: {scenario.servers} servers of {scenario.tp_size} × {scenario.gpu} "
        f"({scenario.gpus} GPUs), {scenario.model}, SLA p95 {scenario.sla.latency_s:g} s / "
        f"TTFT {scenario.sla.ttft_s:g} s",
        f"calibrated: {cal.capacity_rps:.3g} req/s per server (cost model, max batch "
        f"{scenario.max_batch_size}); at {top.load:.0%} load p95 {top.p95_s:.3g} s, TTFT p95 "
        f"{top.ttft_p95_s:.3g} s, {top.attainment:.2%} within SLA "
        f"({len(LEVELS)} loads × {scenario.calibration.engines} engines × "
        f"{scenario.calibration.duration_s:g} s, request-level)",
        f"demand: {scenario.days:g} days scored after {scenario.history_days:g} of history; "
        f"peak {demand.peak_rps:,.0f} req/s ({scenario.demand.peak_load:.0%} of the fleet), "
        f"mean {mean:,.0f} req/s; the {scenario.demand.trace} trace's bursts up to "
        f"{demand.burst_peak:.2f}× its mean per {demand.interval_s:g} s",
    ]


def table(results: Sequence[WeekResult]) -> str:
    peak = next((r for r in results if r.variant == "peak"), None)
    columns = (
        "variant",
        "SLA attainment",
        "GPU-hours",
        "of peak-sized",
        "booting GPU-h",
        "peak servers",
        "forecast won (ticks)",
        "short of spares (ticks)",
        "backlog wait p99",
    )
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        share = f"{r.gpu_hours / peak.gpu_hours:.1%}" if peak else "—"
        lines.append(
            f"| {r.variant} | {r.attainment:.2%} | {r.gpu_hours:,.0f} | {share} | "
            f"{r.booting_gpu_hours:,.0f} | {r.peak_servers} | {r.forecast_ticks} | "
            f"{r.exhaustions} | {r.wait_p99_s:.1f} s |"
        )
    return "\n".join(lines)
