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
  square wave is not extrapolated (rule 5).
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
2. **activate** — a deployment at zero servers (target, serving and on the way all 0) with
   requests waiting for it in the routers (`router_waiting`, their reports: a router holds a
   request for a deployment with no replica in its waiting room, fleet/router/pool.py): one
   server at once, no up window (KEDA's activation, Knative's activator). Nothing serves it,
   so there are no signals to wait for; the rules below take over once it serves.
3. **no_data** — no observation at or before `now`, or the newest is more than `max_gap_s` old.
4. **Scale up** (rule: the signal with the largest ratio: "queue_high", "latency_high",
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
5. **trend** — the newest observation is over nothing, but the waiting requests are rising:
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
6. **Scale down** ("scale_down") by one server when, walking back from the newest
   observation, every one has every signal present and under `low_water` × its target
   (queue: the queue target; p95 and TTFT: their SLAs; KV: kv_high), no gap, back to one at or
   before `now - down_window_s`, and then:
   - it would not leave the deployment "at target": the PEAK of each signal over the window,
     projected onto the one-server-smaller capacity, must stay under `1 - tolerance` of its
     scale-up threshold. That is HPA's tolerance (a ratio within 1 ± 0.1 counts as at
     target), used where it prevents flapping: a scale-down that would put the deployment
     within 10 % of scaling straight back up is not taken ("hold"). Going to zero servers
     needs every signal at exactly zero for the whole window (no traffic at all);
   - the engines' batches would not run near full: the PEAK batch-slot use over the window
     (requests running ÷ max_batch_size slots, `Signals.slot_use`), projected onto the
     one-server-smaller capacity, must stay under `slot_ceiling` (75 %) ("hold"). Queue and
     latency grow with load in proportion only while the batches have room; near a full batch
     they jump, so a projection of them alone let a deployment be scaled in from two servers
     to one under a load one could not serve, and straight back up (docs/sim.md). Without a
     batch size (the deployment's engine options set none) there is no slot use and this
     check is skipped;
   - the look-ahead line (if there is one) projected `boot_p90_s` ahead onto that capacity
     stays under it too ("hold": the load would want the server back before it could boot);
   - `cooldown_down_s` has passed since the last scale-up AND the last scale-down
     ("cooldown").
   Short of that: "no_data" when the walk met a missing signal or a gap (never scale down on
   missing data), "window" when it ran out of history before the window's start, "hold" when
   it met a signal at or over its low water.
7. **hold** otherwise.

Then **forecast**: with a forecast (`forecast_servers`, fleet/autoscaler/forecast.py: the
servers the deployment's seasonal demand needs over the next boot-to-ready), the target is
the larger of the rule's answer and the forecast's (AWS predictive scaling's rule: the
forecast only ever adds). The forecast wins only by raising the target: it starts spares a
boot ahead of the demand it sees coming, and holds a scale-in whose server would be wanted
back before it could boot. The inputs say both sides (`reactive_target`, `forecast_servers`)
and which won (`won`). A pinned deployment has no forecast.

Finally the answer is kept within [max(min_servers, floor), max_servers]; when that changes
it, the rule becomes "min", "floor" (the calendar's floor is the higher bound) or "max", and
the reason says what the rule wanted. When the floor is above max_servers, max wins (a hard
ceiling, e.g. a quota). A target outside the bounds is moved into them even on missing data.

The types, the per-signal thresholds and `aggregate` (heartbeat replica stats → one `Signals`)
are in fleet/autoscaler/signals.py; the look-ahead's lines (rule 5) in fleet/autoscaler/trend.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fleet.autoscaler.signals import (
    INPUT_KEY,
    LABEL,
    SIGNAL_NAMES,
    UP_RULE,
    Decision,
    DeploymentState,
    Limits,
    PolicyConfig,
    Signals,
    any_over,
    fmt,
    fmt_signal,
    limits_for,
    signal_ratios,
    values_of,
)
from fleet.autoscaler.trend import QueueTrend, queue_trend

__all__ = ["decide"]


def _step(ratio: float, c: PolicyConfig) -> int:
    """The largest step whose ratio threshold `ratio` reaches; at least 1, at most max_step."""
    best = 1
    for threshold, add in c.steps:
        if ratio >= threshold and add > best:
            best = add
    return min(best, c.max_step)


def _json(x: float | int | str | None) -> float | int | str | None:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ---------------------------------------------------------------------------------------------
# decide


@dataclass(frozen=True, slots=True)
class _Proposal:
    """What the first rule that applies asks for, before `_bounded` keeps the target within
    [max(min_servers, floor), max_servers] (and renames the rule when that changes it)."""

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

    proposal = _propose(state, history, now, c, inputs)
    if state.forecast_servers is not None:
        proposal = _with_forecast(state, proposal, inputs)
    return _bounded(state, proposal, inputs)


def _with_forecast(
    state: DeploymentState, reactive: _Proposal, inputs: dict[str, float | int | str | None]
) -> _Proposal:
    """The larger of the reactive answer and the forecast's servers (module docstring)."""
    need = state.forecast_servers
    assert need is not None
    inputs["forecast_servers"] = need
    inputs["forecast_basis"] = state.forecast_basis
    inputs["reactive_target"] = reactive.target
    inputs["reactive_rule"] = reactive.rule
    if need > reactive.target:
        inputs["won"] = "forecast"
        verb = "holds" if reactive.target < state.target <= need else "wants"
        return _Proposal(
            need,
            "forecast",
            f"forecast {verb} {need} servers: {state.forecast_basis}; reactive: "
            f"{reactive.target} ({reactive.rule}: {reactive.reason})",
        )
    inputs["won"] = "reactive"
    return reactive


def _propose(
    state: DeploymentState,
    history: Sequence[Signals],
    now: float,
    c: PolicyConfig,
    inputs: dict[str, float | int | str | None],
) -> _Proposal:
    if state.target == 0 and state.serving == 0 and state.on_the_way == 0:
        inputs["router_waiting"] = state.router_waiting
        if state.router_waiting > 0:
            return _Proposal(
                1,
                "activate",
                f"{state.router_waiting} request(s) wait in the routers for a deployment at zero "
                "servers: +1 at once (the first server has no up window)",
            )
    obs = [o for o in history if o.at <= now]
    ats = [o.at for o in obs]
    if ats != sorted(ats):
        obs.sort(key=lambda o: o.at)
    inputs["observations"] = len(obs)
    if not obs:
        return _Proposal(
            state.target, "no_data", "no observation yet: hold (never scale on no data)"
        )
    latest = obs[-1]
    for name, v in zip(SIGNAL_NAMES, values_of(latest), strict=True):
        inputs[INPUT_KEY[name]] = v
    inputs["serving_gpus"] = latest.serving_gpus
    age = now - latest.at
    if age > c.max_gap_s:
        return _Proposal(
            state.target,
            "no_data",
            f"newest observation is {age:.0f} s old (more than {c.max_gap_s:.0f} s): hold",
        )

    limits = limits_for(state, c)
    capacity = max(state.target, state.serving + state.on_the_way)
    per_server = max(state.gpus_per_server, 1)
    gpus_now = state.serving * per_server if state.serving > 0 else latest.serving_gpus
    gpus_then = capacity * per_server
    inputs["capacity"] = capacity

    latest_values = values_of(latest)
    ratios = signal_ratios(latest_values, limits.up)
    known = [(r, n) for r, n in zip(ratios, SIGNAL_NAMES, strict=True) if r is not None]
    top_ratio, top = max(known, default=(0.0, "queue"))
    inputs["ratio"] = top_ratio if known else None
    inputs["ratio_signal"] = top if known else None

    if any_over(latest_values, limits.up):
        return _up(state, obs, now, c, limits, capacity, gpus_now, gpus_then, top, inputs)

    look = queue_trend(obs, now, c) if c.lookahead else None
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
        proposal = _trend_up(state, now, c, capacity, gpus_now, gpus_then, rising, inputs)
        if proposal is not None:
            return proposal

    return _down(state, obs, now, c, limits, rising, top_ratio, top, inputs)


def _up(
    state: DeploymentState,
    obs: Sequence[Signals],
    now: float,
    c: PolicyConfig,
    limits: Limits,
    capacity: int,
    gpus_now: float,
    gpus_then: float,
    top: str,
    inputs: dict[str, float | int | str | None],
) -> _Proposal:
    latest = obs[-1]
    value = values_of(latest)[SIGNAL_NAMES.index(top)]
    threshold = limits.up[SIGNAL_NAMES.index(top)]
    assert value is not None  # `top` is the largest of the latest's known ratios
    ratio = value / threshold
    what = f"{LABEL[top]} {fmt_signal(top, value)} > {fmt_signal(top, threshold)} ({fmt(ratio)}×)"
    # Walk back the unbroken run of over-threshold observations.
    start = now - c.up_window_s
    since = latest.at
    covered = False
    prev = now
    for o in reversed(obs):
        if prev - o.at > c.max_gap_s or not any_over(values_of(o), limits.up):
            break
        since = o.at
        if o.at <= start:
            covered = True
            break
        prev = o.at
    inputs["over_for_s"] = now - since
    if not covered:
        return _Proposal(
            state.target,
            "window",
            f"{what} for {now - since:.0f} s of the {c.up_window_s:.0f} s up window: wait",
        )
    # Multiplied before divided: 1.5 × 32 ÷ 48 is exactly 1.0.
    projected = ratio * gpus_now / gpus_then if gpus_now and gpus_then else ratio
    inputs["projected_ratio"] = projected
    pending = capacity - state.serving
    if projected < 1.0:
        return _Proposal(
            state.target,
            "hold",
            f"{what} for {c.up_window_s:.0f} s, but {pending} on the way: "
            f"{fmt(projected)}× once {capacity} serve: hold",
        )
    step = _step(projected, c)
    reason = (
        f"{what} for {c.up_window_s:.0f} s; {state.serving} serving, {pending} on the way, "
        f"{fmt(projected)}× on {capacity}: +{step}"
    )
    return _cooled_up(state, now, c, _Proposal(state.target + step, UP_RULE[top], reason))


def _trend_up(
    state: DeploymentState,
    now: float,
    c: PolicyConfig,
    capacity: int,
    gpus_now: float,
    gpus_then: float,
    look: QueueTrend,
    inputs: dict[str, float | int | str | None],
) -> _Proposal | None:
    ahead = look.per_gpu_ahead(state.boot_p90_s, gpus_now, gpus_then)
    projected = ahead / c.queue_per_gpu_target
    inputs["projected_ratio"] = projected
    if not projected > 1.0:
        return None
    step = _step(projected, c)
    reason = (
        f"{look.describe()}: {fmt(ahead)}/GPU on {capacity} servers in "
        f"{state.boot_p90_s:.0f} s (boot p90), {fmt(projected)}× of "
        f"{fmt(c.queue_per_gpu_target)}: +{step}"
    )
    return _cooled_up(state, now, c, _Proposal(state.target + step, "trend", reason))


def _cooled_up(
    state: DeploymentState, now: float, c: PolicyConfig, proposal: _Proposal
) -> _Proposal:
    if state.last_up_at is not None and now - state.last_up_at < c.cooldown_up_s:
        return _Proposal(
            state.target,
            "cooldown",
            f"{proposal.reason} waits: last scale-up {now - state.last_up_at:.0f} s ago "
            f"(cooldown {c.cooldown_up_s:.0f} s)",
        )
    return proposal


def _down(
    state: DeploymentState,
    obs: Sequence[Signals],
    now: float,
    c: PolicyConfig,
    limits: Limits,
    rising: QueueTrend | None,
    top_ratio: float,
    top: str,
    inputs: dict[str, float | int | str | None],
) -> _Proposal:
    start = now - c.down_window_s
    prev = now
    covered = False
    since: float | None = None
    run: list[Signals] = []
    low_q, low_p, low_t, low_k = limits.low
    for o in reversed(obs):
        gap = prev - o.at
        if gap > c.max_gap_s:
            return _Proposal(
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
        for name, v, low in zip(SIGNAL_NAMES, values, limits.low, strict=True):
            if v is not None and v >= low:
                return _Proposal(
                    state.target,
                    "hold",
                    f"{LABEL[top]} at {fmt(top_ratio)}× of its scale-up threshold; "
                    f"{LABEL[name]} {fmt_signal(name, v)} ≥ low water {fmt_signal(name, low)} "
                    f"{when}: hold",
                )
        missing = [LABEL[n] for n, v in zip(SIGNAL_NAMES, values, strict=True) if v is None]
        return _Proposal(
            state.target,
            "no_data",
            f"no {', '.join(missing)} {when}: hold (never scale down on missing data)",
        )
    assert since is not None  # obs is not empty, and every other exit above returns
    inputs["low_for_s"] = now - since
    if not covered:
        return _Proposal(
            state.target,
            "window",
            f"every signal under {c.low_water:.0%} of its target for {now - since:.0f} s of "
            f"the {c.down_window_s:.0f} s down window: wait",
        )
    lowest = max(state.min_servers, state.floor)
    want = state.target - 1
    low_reason = f"every signal under {c.low_water:.0%} of its target for {c.down_window_s:.0f} s"
    if want < lowest or want < 0:
        return _Proposal(want, "scale_down", f"{low_reason}: -1")

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
        for i, v in enumerate(values_of(o)):
            if v is not None and v * gpus > peaks[i]:
                peaks[i] = v * gpus
    peak = 0.0
    peak_name = "queue"
    for name, top_load, up in zip(SIGNAL_NAMES, peaks, limits.up, strict=True):
        projected = top_load / after_gpus / up if after_gpus > 0 else math.inf
        if top_load == 0.0:
            projected = 0.0
        if projected > peak:
            peak, peak_name = projected, name
    inputs["projected_ratio"] = peak
    limit = 1.0 - c.tolerance
    if not peak < limit:
        return _Proposal(
            state.target,
            "hold",
            f"{low_reason}, but on {want} servers the window's peak {LABEL[peak_name]} would "
            f"be {fmt(peak)}× of its scale-up threshold (not under {fmt(limit)}: "
            f"tolerance {fmt(c.tolerance)}): hold",
        )
    # Saturation: the queue and the latencies grow with the load in proportion only while the
    # engines' batches have room; near a full batch they jump. So the batch slots the window's
    # peak kept busy, projected onto one server fewer, must stay under the ceiling.
    busiest = max(
        (
            o.slot_use * (max(o.serving_gpus, fallback_gpus) or after_gpus)
            for o in run
            if o.slot_use is not None
        ),
        default=None,
    )
    if busiest is not None:
        slot_use = 0.0 if busiest == 0 else busiest / after_gpus if after_gpus > 0 else math.inf
        inputs["projected_slot_use"] = slot_use
        if not slot_use < c.slot_ceiling:
            return _Proposal(
                state.target,
                "hold",
                f"{low_reason}, but on {want} servers the window's peak would keep "
                f"{fmt(slot_use * 100)} % of the engines' batch slots busy (not under "
                f"{c.slot_ceiling:.0%}: latency jumps near a full batch): hold",
            )
    if rising is not None:
        latest_gpus = obs[-1].serving_gpus or fallback_gpus
        ahead = rising.per_gpu_ahead(state.boot_p90_s, latest_gpus, after_gpus)
        projected = ahead / c.queue_per_gpu_target
        if not projected < limit:
            return _Proposal(
                state.target,
                "hold",
                f"{low_reason}, but {rising.describe()}: {fmt(ahead)}/GPU on {want} servers "
                f"in {state.boot_p90_s:.0f} s, {fmt(projected)}× (not under {fmt(limit)}): hold",
            )
    for label, at in (("scale-up", state.last_up_at), ("scale-down", state.last_down_at)):
        if at is not None and now - at < c.cooldown_down_s:
            return _Proposal(
                state.target,
                "cooldown",
                f"{low_reason}: -1 waits: last {label} {now - at:.0f} s ago "
                f"(cooldown {c.cooldown_down_s:.0f} s)",
            )
    return _Proposal(
        want,
        "scale_down",
        f"{low_reason}; peak {fmt(peak)}× of the scale-up threshold on {want} servers: -1",
    )


def _bounded(
    state: DeploymentState, proposal: _Proposal, inputs: dict[str, float | int | str | None]
) -> Decision:
    """Keep the answer within [max(min_servers, floor), max_servers]; max wins a conflict."""
    highest = state.max_servers
    lowest = min(max(state.min_servers, state.floor), highest)
    if proposal.target > highest:
        return _decision(
            state,
            highest,
            "max",
            f"{proposal.reason}; capped at max {highest} ({proposal.rule})",
            inputs,
        )
    if proposal.target < lowest:
        rule = "floor" if state.floor > state.min_servers else "min"
        bound = state.floor if rule == "floor" else state.min_servers
        capped = f", capped at max {highest}" if bound > highest else ""
        return _decision(
            state,
            lowest,
            rule,
            f"{proposal.reason}; kept at {rule} {bound}{capped} ({proposal.rule})",
            inputs,
        )
    return _decision(state, proposal.target, proposal.rule, proposal.reason, inputs)


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
