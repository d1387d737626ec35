"""The scaling policy: one deployment's signal history in, its new `target_servers` out.

Pure: frozen dataclasses in, a frozen dataclass out; time is a float (seconds, any epoch) the
caller passes in, never read from a clock; no database, no I/O. The service
(fleet/autoscaler/service.py), the simulator and the tests all call this same code
(docs/design.md, "ScalingPolicy").

Why it looks the way it does: a bare-metal GPU server takes 10-20 minutes from power-on to
serving. A decision therefore acts on the load of a quarter of an hour from now, a server
asked for is paid for long before it helps, and a server given back cannot be had again
quickly. So:

- **Capacity on its way counts.** The capacity a decision works with is
  `max(target, serving + on_the_way)`: the servers already serving, the ones booting or loading
  for it, and the ones asked for that the provisioner has not booted yet (an earlier decision
  raised the target; counting the target stops the next tick from asking again before the
  provisioner's tick). Load is projected onto that capacity in proportion
  (`value × GPUs now ÷ GPUs then`, with `gpus_per_server` per server): more servers divide the
  queue and the KV use, and the queueing part of the latency. That is the same approximation
  HPA makes for every metric; it overestimates latency after a scale-down (latency has a floor),
  which errs on the side of keeping servers.
- **Look ahead by the boot time.** A least-squares line through the waiting requests over
  the last `trend_window_s`, projected `boot_p90_s` ahead (the measured p90 boot-to-ready) onto
  the capacity, scales up before the queue crosses its target, so that the capacity is there
  when it does. Only a real ramp counts: a step, a spike, a load that has levelled off or a
  square wave is not extrapolated (rule 4).
- **Never scale down on missing data** (HPA's rule): a signal that is None anywhere in the
  down window, a gap in the observations, or a stale last observation holds (rule "no_data").
  Scale-up acts on whatever signals there are (a saturated engine may have finished no request
  to time), but never on a stale observation.
- **Up fast, down slowly** (HPA v2: stabilization 0 s up, 300 s down; Knative's and Ray
  Serve's windows): up after `up_window_s` (60 s) of every observation over a threshold, down
  after `down_window_s` (10 min) of every signal under `low_water` (50 %) of its target, one
  server at a time, `cooldown_down_s` after any scale change.

The rules, in order (the first that applies decides; `rule` names it):

1. **pinned** — an operator's `fleetctl deployments scale D --replicas N`: the target is N
   servers, clamped to [0, max_servers]. Manual mode may go below min_servers and the calendar
   floor (the operator's word wins: to stop a deployment, pin 0); never above max_servers.
2. **no_data** — no observation at or before `now`, or the newest is more than `max_gap_s` old.
3. **Scale up** (rule: the signal with the largest ratio: "queue_high", "latency_high",
   "ttft_high", "kv_high"), when every observation of the last `up_window_s` has a signal over
   its threshold: queue_per_gpu > queue_per_gpu_target, p95 > latency_fraction × SLA,
   TTFT p95 > latency_fraction × TTFT SLA, or kv_use > kv_high (strictly greater: a signal AT
   its threshold is not over it). "Every observation of the window" means an unbroken run of
   over-threshold observations (no two more than `max_gap_s` apart) that reaches back to one
   at or before `now - up_window_s`, the same baseline-at-the-window's-start rule the agent's
   windows use: a burst shorter than the window never scales.
   The ratio is the largest signal ÷ threshold of the newest observation, projected onto the
   capacity (above). Projected below 1, the capacity on its way covers the need: "hold"
   (the reason says how many are on the way). Otherwise the step is the largest of `steps`
   whose ratio it reaches (+1 at ≥ 1.0, +2 at ≥ 1.5, +4 at ≥ 2.0; at least 1), at most
   `max_step`, added to the current target. Within `cooldown_up_s` of the last scale-up:
   "cooldown". The default cooldown_up_s is 60 s, the up window: the target then grows by at
   most `max_step` per minute, which still answers any ramp well inside one boot time, while
   the projection keeps the steps from piling up. While the newest observation is over but
   the run is shorter than the window: "window".
4. **trend** — the newest observation is over nothing, but the waiting requests are rising:
   a least-squares line over `trend_window_s` (at least 3 observations, covering the window
   with no gap, every one with a queue value) projected `boot_p90_s` ahead onto the capacity
   is over the queue target: scale up by the step the projected ratio calls for (cooldown as
   above). The series is the total waiting (queue_per_gpu × serving_gpus, so that capacity
   arriving mid-window does not read as falling load), or queue_per_gpu where GPU counts are
   unknown. It is a trend only when the line rises with R² ≥ `trend_min_r2`, fits better than
   any single step (a jump seen soon after it happened tilts a line as much as a ramp, and so
   does a spike at the end), and the line over the window's newer half rises too (a load that
   rose and levelled off still tilts the whole window's line); the projection is the lower of
   the two lines'. A server bought for load that is not coming costs a quarter of an hour of
   a GPU server, and a step is the threshold rules' business once it holds for the up window.
   `lookahead=False` turns the rule off.
5. **Scale down** ("scale_down") by one server when, walking back from the newest
   observation, every one has every signal present and under `low_water` × its target
   (queue: the queue target; p95 and TTFT: their SLAs; KV: kv_high), no gap, back to one at or
   before `now - down_window_s`, and then:
   - it would not leave the deployment "at target": the PEAK of each signal over the window,
     projected onto the one-server-smaller capacity, must stay under `1 - tolerance` of its
     scale-up threshold. That is HPA's tolerance (a ratio within 1 ± 0.1 counts as at
     target), used where it prevents flapping: a scale-down that would put the deployment
     within 10 % of scaling straight back up is not taken ("hold"). Going to zero servers
     needs every signal at exactly zero for the whole window (no traffic at all);
   - the look-ahead line (if there is one) projected `boot_p90_s` ahead onto that capacity
     stays under it too ("hold": the load would want the server back before it could boot);
   - `cooldown_down_s` has passed since the last scale-up AND the last scale-down
     ("cooldown").
   Short of that: "no_data" when the walk met a missing signal or a gap (never scale down on
   missing data), "window" when it ran out of history before the window's start, "hold" when
   it met a signal at or over its low water.
6. **hold** otherwise.

Finally the answer is kept within [max(min_servers, floor), max_servers]; when that changes
it, the rule becomes "min", "floor" (the calendar's floor is the higher bound) or "max", and
the reason says what the rule wanted. When the floor is above max_servers, max wins (a hard
ceiling, e.g. a quota). A target outside the bounds is moved into them even on missing data.

`aggregate` turns the serving servers' heartbeat replica stats into one `Signals`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RULES",
    "Decision",
    "DeploymentState",
    "PolicyConfig",
    "Signals",
    "Trend",
    "aggregate",
    "decide",
    "fit_trend",
    "step_sse",
]

RULES = frozenset(
    {
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

MIN_TREND_POINTS = 3


@dataclass(frozen=True, slots=True)
class Signals:
    """One observation of a deployment, aggregated over its serving servers."""

    at: float  # seconds (any epoch)
    queue_per_gpu: float | None  # waiting requests / serving GPUs
    kv_use: float | None  # max over replicas of KV used ÷ max blocks (0..1)
    p95_latency_s: float | None  # end-to-end p95 (the engines' histograms)
    ttft_p95_s: float | None
    serving_gpus: int = 0


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


@dataclass(frozen=True, slots=True)
class Trend:
    """A least-squares line through (time, value) points; `level` is its value at `now`."""

    slope: float  # per second
    level: float
    r2: float
    points: int
    span_s: float

    def ahead(self, seconds: float) -> float:
        return self.level + self.slope * seconds


# ---------------------------------------------------------------------------------------------
# Signals: names, thresholds, classification

# The four signals: the rule each drives a scale-up with, how a reason writes it, its input key.
_NAMES = ("queue", "p95", "ttft", "kv")
_UP_RULE = {"queue": "queue_high", "p95": "latency_high", "ttft": "ttft_high", "kv": "kv_high"}
_LABEL = {"queue": "queue", "p95": "p95", "ttft": "TTFT p95", "kv": "KV use"}
_UNIT = {"queue": "/GPU", "p95": " s", "ttft": " s", "kv": ""}
_INPUT_KEY = {
    "queue": "queue_per_gpu",
    "p95": "p95_latency_s",
    "ttft": "ttft_p95_s",
    "kv": "kv_use",
}

Values = tuple[float | None, float | None, float | None, float | None]


def _values(o: Signals) -> Values:
    return (o.queue_per_gpu, o.p95_latency_s, o.ttft_p95_s, o.kv_use)


@dataclass(frozen=True, slots=True)
class _Limits:
    up: tuple[float, float, float, float]  # over these: scale up
    low: tuple[float, float, float, float]  # under these, all of them: may scale down


def _limits(state: DeploymentState, c: PolicyConfig) -> _Limits:
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
    return _Limits(up, low)


def _over(values: Values, up: tuple[float, float, float, float]) -> bool:
    return any(v is not None and v > t for v, t in zip(values, up, strict=True))


def _ratios(values: Values, up: tuple[float, float, float, float]) -> list[float | None]:
    return [None if v is None else v / t for v, t in zip(values, up, strict=True)]


def _step(ratio: float, c: PolicyConfig) -> int:
    """The largest step whose ratio threshold `ratio` reaches; at least 1, at most max_step."""
    best = 1
    for threshold, add in c.steps:
        if ratio >= threshold and add > best:
            best = add
    return min(best, c.max_step)


def _f(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "none"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


def _value(name: str, x: float | None) -> str:
    return f"{_f(x)}{_UNIT[name]}" if x is not None else "none"


def _json(x: float | int | str | None) -> float | int | str | None:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ---------------------------------------------------------------------------------------------
# The trend


def fit_trend(points: Sequence[tuple[float, float]], now: float) -> Trend | None:
    """Least squares through (at, value) points, x measured from `now` (epoch seconds lose
    precision when squared). Fewer than MIN_TREND_POINTS points or no spread in time: None. A
    constant series is a flat line with R² 0."""
    n = len(points)
    if n < MIN_TREND_POINTS:
        return None
    xs = [at - now for at, _ in points]
    ys = [y for _, y in points]
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sxy = syy = 0.0
    for x, y in zip(xs, ys, strict=True):
        dx = x - mx
        dy = y - my
        sxx += dx * dx
        sxy += dx * dy
        syy += dy * dy
    span = max(xs) - min(xs)
    if sxx <= 0.0:
        return None
    lo, hi = min(ys), max(ys)
    if hi == lo or syy <= 0.0:
        return Trend(slope=0.0, level=lo, r2=0.0, points=n, span_s=span)
    slope = sxy / sxx
    return Trend(
        slope=slope,
        level=my - slope * mx,
        r2=min(1.0, (sxy * sxy) / (sxx * syy)),
        points=n,
        span_s=span,
    )


def _line_sse(trend: Trend, points: Sequence[tuple[float, float]], now: float) -> float:
    return sum((y - trend.level - trend.slope * (at - now)) ** 2 for at, y in points)


def step_sse(values: Sequence[float]) -> float:
    """The least squared error of a step through `values` (in time order): one level before
    some point, another after it, each at its mean. A series a step explains as well as a
    line is a step, not a trend. Fewer than 2 values: infinity."""
    n = len(values)
    total = math.fsum(values)
    total_sq = math.fsum(v * v for v in values)
    best = math.inf
    left = left_sq = 0.0
    for k in range(1, n):
        v = values[k - 1]
        left += v
        left_sq += v * v
        right, right_sq = total - left, total_sq - left_sq
        sse = (left_sq - left * left / k) + (right_sq - right * right / (n - k))
        best = min(best, max(sse, 0.0))
    return best


@dataclass(frozen=True, slots=True)
class _Look:
    """The look-ahead: least-squares lines through the waiting requests.

    The series is the TOTAL waiting (queue_per_gpu × serving_gpus) when every point knows its
    GPUs, so that capacity arriving in the window (which divides the per-GPU queue in one
    jump) does not read as falling load; it is then divided by the GPUs of the capacity to
    come. Without GPU counts it is queue_per_gpu itself, projected like the other signals.

    - `full`, over the trend window: it must rise, with R² ≥ trend_min_r2;
    - it must fit better than a step (`line_sse < step_sse`): a jump seen soon after it
      happened tilts a line as steeply as a ramp would, and projected a boot time ahead it
      buys servers for load that is not coming; so does one spike at the end;
    - `recent`, over the window's newer half, must rise too: a load that rose and levelled
      off still tilts the whole window's line, the newer half's is flat by then.
    The projection is the lower of the two lines'. A server bought for nothing costs a
    quarter of an hour of a GPU server; a real ramp passes all of these, and a step is the
    threshold rules' business once it holds for the up window."""

    full: Trend
    recent: Trend | None
    line_sse: float
    step_sse: float
    total: bool  # the series is total waiting requests (else queue per GPU)

    def lines(self) -> list[Trend]:
        return [self.full] if self.recent is None else [self.full, self.recent]

    def ahead(self, seconds: float) -> float:
        return min(t.ahead(seconds) for t in self.lines())

    def per_gpu_ahead(self, seconds: float, gpus_now: float, gpus_after: float) -> float:
        """The projected queue per GPU `seconds` ahead, on `gpus_after` GPUs."""
        ahead = self.ahead(seconds)
        if self.total:
            if gpus_after > 0:
                return ahead / gpus_after
            return math.inf if ahead > 0 else 0.0
        return ahead * gpus_now / gpus_after if gpus_now > 0 and gpus_after > 0 else ahead

    def rising(self, c: PolicyConfig) -> bool:
        return (
            self.full.r2 >= c.trend_min_r2
            and self.line_sse < self.step_sse
            and all(t.slope > 0.0 for t in self.lines())
        )

    def describe(self) -> str:
        unit = "waiting" if self.total else "queued/GPU"
        return (
            f"{unit} rising {_f(self.full.slope)}/s over {self.full.span_s:.0f} s "
            f"(R² {self.full.r2:.2f})"
        )


def _trend(obs: Sequence[Signals], now: float, c: PolicyConfig) -> _Look | None:
    """The lines over the trend window: the window must be covered (reach back to an
    observation at or before its start) with no gap and a queue value in every point."""
    start = now - c.trend_window_s
    run: list[Signals] = []
    prev = now
    for o in reversed(obs):
        if prev - o.at > c.max_gap_s or o.queue_per_gpu is None:
            return None
        run.append(o)
        if o.at <= start:
            break
        prev = o.at
    else:
        return None
    run.reverse()
    total = all(o.serving_gpus > 0 for o in run)
    points = [(o.at, (o.queue_per_gpu or 0.0) * (o.serving_gpus if total else 1)) for o in run]
    full = fit_trend(points, now)
    if full is None:
        return None
    middle = now - c.trend_window_s / 2
    recent = fit_trend([p for p in points if p[0] >= middle], now)
    return _Look(
        full, recent, _line_sse(full, points, now), step_sse([y for _, y in points]), total
    )


# ---------------------------------------------------------------------------------------------
# decide


@dataclass(frozen=True, slots=True)
class _Want:
    target: int
    rule: str
    reason: str


def decide(
    state: DeploymentState,
    history: Sequence[Signals],
    now: float,
    config: PolicyConfig = PolicyConfig(),
) -> Decision:
    """The deployment's new target and the rule that fired (module docstring)."""
    c = config
    inputs: dict[str, float | int | str | None] = {
        "target": state.target,
        "serving": state.serving,
        "on_the_way": state.on_the_way,
        "min_servers": state.min_servers,
        "floor": state.floor,
        "max_servers": state.max_servers,
        "pinned": state.pinned,
        "gpus_per_server": state.gpus_per_server,
        "boot_p90_s": state.boot_p90_s,
        "queue_per_gpu_target": c.queue_per_gpu_target,
        "p95_threshold_s": c.latency_fraction * state.sla_p95_s,
        "ttft_threshold_s": c.latency_fraction * state.sla_ttft_s,
        "kv_high": c.kv_high,
        "low_water": c.low_water,
        "up_window_s": c.up_window_s,
        "down_window_s": c.down_window_s,
    }
    if state.pinned is not None:
        pinned = min(max(state.pinned, 0), state.max_servers)
        reason = f"pinned at {state.pinned} servers by an operator (manual mode)"
        if pinned != state.pinned:
            reason += f"; kept within [0, max {state.max_servers}]: {pinned}"
        return _decision(state, pinned, "pinned", reason, inputs)

    want = _want(state, history, now, c, inputs)
    return _bounded(state, want, inputs)


def _want(
    state: DeploymentState,
    history: Sequence[Signals],
    now: float,
    c: PolicyConfig,
    inputs: dict[str, float | int | str | None],
) -> _Want:
    obs = [o for o in history if o.at <= now]
    ats = [o.at for o in obs]
    if ats != sorted(ats):
        obs.sort(key=lambda o: o.at)
    inputs["observations"] = len(obs)
    if not obs:
        return _Want(state.target, "no_data", "no observation yet: hold (never scale on no data)")
    latest = obs[-1]
    for name, v in zip(_NAMES, _values(latest), strict=True):
        inputs[_INPUT_KEY[name]] = v
    inputs["serving_gpus"] = latest.serving_gpus
    age = now - latest.at
    if age > c.max_gap_s:
        return _Want(
            state.target,
            "no_data",
            f"newest observation is {age:.0f} s old (more than {c.max_gap_s:.0f} s): hold",
        )

    limits = _limits(state, c)
    capacity = max(state.target, state.serving + state.on_the_way)
    per_server = max(state.gpus_per_server, 1)
    gpus_now = state.serving * per_server if state.serving > 0 else latest.serving_gpus
    gpus_then = capacity * per_server
    inputs["capacity"] = capacity

    latest_values = _values(latest)
    ratios = _ratios(latest_values, limits.up)
    known = [(r, n) for r, n in zip(ratios, _NAMES, strict=True) if r is not None]
    top_ratio, top = max(known, default=(0.0, "queue"))
    inputs["ratio"] = top_ratio if known else None
    inputs["ratio_signal"] = top if known else None

    if _over(latest_values, limits.up):
        return _up(state, obs, now, c, limits, capacity, gpus_now, gpus_then, top, inputs)

    look = _trend(obs, now, c) if c.lookahead else None
    if look is not None:
        inputs["trend_slope_per_s"] = look.full.slope
        inputs["trend_recent_slope_per_s"] = look.recent.slope if look.recent else None
        inputs["trend_line_sse"] = look.line_sse
        inputs["trend_step_sse"] = look.step_sse
        inputs["trend_r2"] = look.full.r2
        inputs["trend_series"] = "waiting" if look.total else "queue_per_gpu"
        inputs["trend_projection"] = look.ahead(state.boot_p90_s)
    rising = look if look is not None and look.rising(c) else None
    if rising is not None:
        want = _trend_up(state, now, c, capacity, gpus_now, gpus_then, rising, inputs)
        if want is not None:
            return want

    return _down(state, obs, now, c, limits, rising, top_ratio, top, inputs)


def _up(
    state: DeploymentState,
    obs: Sequence[Signals],
    now: float,
    c: PolicyConfig,
    limits: _Limits,
    capacity: int,
    gpus_now: float,
    gpus_then: float,
    top: str,
    inputs: dict[str, float | int | str | None],
) -> _Want:
    latest = obs[-1]
    value = _values(latest)[_NAMES.index(top)]
    threshold = limits.up[_NAMES.index(top)]
    assert value is not None  # `top` is the largest of the latest's known ratios
    ratio = value / threshold
    what = f"{_LABEL[top]} {_value(top, value)} > {_value(top, threshold)} ({_f(ratio)}×)"
    # Walk back the unbroken run of over-threshold observations.
    start = now - c.up_window_s
    since = latest.at
    covered = False
    prev = now
    for o in reversed(obs):
        if prev - o.at > c.max_gap_s or not _over(_values(o), limits.up):
            break
        since = o.at
        if o.at <= start:
            covered = True
            break
        prev = o.at
    inputs["over_for_s"] = now - since
    if not covered:
        return _Want(
            state.target,
            "window",
            f"{what} for {now - since:.0f} s of the {c.up_window_s:.0f} s up window: wait",
        )
    # Multiplied before divided: 1.5 × 32 ÷ 48 is exactly 1.0.
    projected = ratio * gpus_now / gpus_then if gpus_now and gpus_then else ratio
    inputs["projected_ratio"] = projected
    pending = capacity - state.serving
    if projected < 1.0:
        return _Want(
            state.target,
            "hold",
            f"{what} for {c.up_window_s:.0f} s, but {pending} on the way: "
            f"{_f(projected)}× once {capacity} serve: hold",
        )
    step = _step(projected, c)
    reason = (
        f"{what} for {c.up_window_s:.0f} s; {state.serving} serving, {pending} on the way, "
        f"{_f(projected)}× on {capacity}: +{step}"
    )
    return _cooled_up(state, now, c, _Want(state.target + step, _UP_RULE[top], reason))


def _trend_up(
    state: DeploymentState,
    now: float,
    c: PolicyConfig,
    capacity: int,
    gpus_now: float,
    gpus_then: float,
    look: _Look,
    inputs: dict[str, float | int | str | None],
) -> _Want | None:
    ahead = look.per_gpu_ahead(state.boot_p90_s, gpus_now, gpus_then)
    projected = ahead / c.queue_per_gpu_target
    inputs["projected_ratio"] = projected
    if not projected > 1.0:
        return None
    step = _step(projected, c)
    reason = (
        f"{look.describe()}: {_f(ahead)}/GPU on {capacity} servers in "
        f"{state.boot_p90_s:.0f} s (boot p90), {_f(projected)}× of "
        f"{_f(c.queue_per_gpu_target)}: +{step}"
    )
    return _cooled_up(state, now, c, _Want(state.target + step, "trend", reason))


def _cooled_up(state: DeploymentState, now: float, c: PolicyConfig, want: _Want) -> _Want:
    if state.last_up_at is not None and now - state.last_up_at < c.cooldown_up_s:
        return _Want(
            state.target,
            "cooldown",
            f"{want.reason} waits: last scale-up {now - state.last_up_at:.0f} s ago "
            f"(cooldown {c.cooldown_up_s:.0f} s)",
        )
    return want


def _down(
    state: DeploymentState,
    obs: Sequence[Signals],
    now: float,
    c: PolicyConfig,
    limits: _Limits,
    rising: _Look | None,
    top_ratio: float,
    top: str,
    inputs: dict[str, float | int | str | None],
) -> _Want:
    start = now - c.down_window_s
    prev = now
    covered = False
    since: float | None = None
    run: list[Signals] = []
    low_q, low_p, low_t, low_k = limits.low
    for o in reversed(obs):
        gap = prev - o.at
        if gap > c.max_gap_s:
            return _Want(
                state.target,
                "no_data",
                f"no observation for {gap:.0f} s ({now - prev:.0f} s ago) in the down window: "
                "hold (never scale down on missing data)",
            )
        q, p, t, k = o.queue_per_gpu, o.p95_latency_s, o.ttft_p95_s, o.kv_use
        # The common case first, inline (this loop runs over the whole down window).
        if (
            q is not None
            and p is not None
            and t is not None
            and k is not None
            and q < low_q
            and p < low_p
            and t < low_t
            and k < low_k
        ):
            run.append(o)
            since = o.at
            if o.at <= start:
                covered = True
                break
            prev = o.at
            continue
        when = "now" if o is obs[-1] else f"{now - o.at:.0f} s ago"
        values = (q, p, t, k)
        for name, v, low in zip(_NAMES, values, limits.low, strict=True):
            if v is not None and v >= low:
                return _Want(
                    state.target,
                    "hold",
                    f"{_LABEL[top]} at {_f(top_ratio)}× of its scale-up threshold; "
                    f"{_LABEL[name]} {_value(name, v)} ≥ low water {_value(name, low)} {when}: "
                    "hold",
                )
        missing = [_LABEL[n] for n, v in zip(_NAMES, values, strict=True) if v is None]
        return _Want(
            state.target,
            "no_data",
            f"no {', '.join(missing)} {when}: hold (never scale down on missing data)",
        )
    assert since is not None  # obs is not empty, and every other exit above returns
    inputs["low_for_s"] = now - since
    if not covered:
        return _Want(
            state.target,
            "window",
            f"every signal under {c.low_water:.0%} of its target for {now - since:.0f} s of "
            f"the {c.down_window_s:.0f} s down window: wait",
        )
    lowest = max(state.min_servers, state.floor)
    want = state.target - 1
    low_reason = f"every signal under {c.low_water:.0%} of its target for {c.down_window_s:.0f} s"
    if want < lowest or want < 0:
        return _Want(want, "scale_down", f"{low_reason}: -1")

    # Tolerance: the window's peaks, projected onto one server fewer, stay clear of scale-up.
    per_server = max(state.gpus_per_server, 1)
    after_gpus = want * per_server
    fallback_gpus = state.serving * per_server
    # The largest value × the GPUs serving then, per signal. The GPUs are the observation's or
    # the servers serving now, whichever is more: an observation made while some heartbeats
    # were late counts fewer GPUs than served, and would make the projection look kinder.
    peaks = [0.0, 0.0, 0.0, 0.0]
    for o in run:
        gpus = max(o.serving_gpus, fallback_gpus) or after_gpus
        for i, v in enumerate(_values(o)):
            if v is not None and v * gpus > peaks[i]:
                peaks[i] = v * gpus
    peak = 0.0
    peak_name = "queue"
    for name, top_load, up in zip(_NAMES, peaks, limits.up, strict=True):
        projected = top_load / after_gpus / up if after_gpus > 0 else math.inf
        if top_load == 0.0:
            projected = 0.0
        if projected > peak:
            peak, peak_name = projected, name
    inputs["projected_ratio"] = peak
    limit = 1.0 - c.tolerance
    if not peak < limit:
        return _Want(
            state.target,
            "hold",
            f"{low_reason}, but on {want} servers the window's peak {_LABEL[peak_name]} would "
            f"be {_f(peak)}× of its scale-up threshold (not under {_f(limit)}: "
            f"tolerance {_f(c.tolerance)}): hold",
        )
    if rising is not None:
        latest_gpus = obs[-1].serving_gpus or fallback_gpus
        ahead = rising.per_gpu_ahead(state.boot_p90_s, latest_gpus, after_gpus)
        projected = ahead / c.queue_per_gpu_target
        if not projected < limit:
            return _Want(
                state.target,
                "hold",
                f"{low_reason}, but {rising.describe()}: {_f(ahead)}/GPU on {want} servers "
                f"in {state.boot_p90_s:.0f} s, {_f(projected)}× (not under {_f(limit)}): hold",
            )
    for label, at in (("scale-up", state.last_up_at), ("scale-down", state.last_down_at)):
        if at is not None and now - at < c.cooldown_down_s:
            return _Want(
                state.target,
                "cooldown",
                f"{low_reason}: -1 waits: last {label} {now - at:.0f} s ago "
                f"(cooldown {c.cooldown_down_s:.0f} s)",
            )
    return _Want(
        want,
        "scale_down",
        f"{low_reason}; peak {_f(peak)}× of the scale-up threshold on {want} servers: -1",
    )


def _bounded(
    state: DeploymentState, want: _Want, inputs: dict[str, float | int | str | None]
) -> Decision:
    """Keep the answer within [max(min_servers, floor), max_servers]; max wins a conflict."""
    highest = state.max_servers
    lowest = min(max(state.min_servers, state.floor), highest)
    if want.target > highest:
        return _decision(
            state,
            highest,
            "max",
            f"{want.reason}; capped at max {highest} ({want.rule})",
            inputs,
        )
    if want.target < lowest:
        rule = "floor" if state.floor > state.min_servers else "min"
        bound = state.floor if rule == "floor" else state.min_servers
        capped = f", capped at max {highest}" if bound > highest else ""
        return _decision(
            state,
            lowest,
            rule,
            f"{want.reason}; kept at {rule} {bound}{capped} ({want.rule})",
            inputs,
        )
    return _decision(state, want.target, want.rule, want.reason, inputs)


def _decision(
    state: DeploymentState,
    target: int,
    rule: str,
    reason: str,
    inputs: dict[str, float | int | str | None],
) -> Decision:
    return Decision(
        deployment=state.name,
        target=target,
        delta=target - state.target,
        rule=rule,
        reason=reason,
        inputs={k: _json(v) for k, v in inputs.items()},
    )


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
    servers: Sequence[Mapping[str, Any]], at: float, router: RouterLoad | None = None
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
    - serving_gpus: the GPUs of the counted replicas.
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
    )


def _worse(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
