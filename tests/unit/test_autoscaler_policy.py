"""fleet.autoscaler.policy: every rule at its threshold (both sides), a square-wave load that
must not make it oscillate, properties (Hypothesis), and `aggregate`.

The deployment: SLA p95 2 s and TTFT 0.5 s, 8-GPU servers, 4 of them serving (32 GPUs). With
the default config the scale-up thresholds are queue 10/GPU, p95 1.8 s, TTFT 0.45 s, KV 0.85;
the low waters (50 % of each target) are queue 5/GPU, p95 1.0 s, TTFT 0.25 s, KV 0.425.
Observations come every 10 s; `NOW` is an arbitrary epoch second. Nothing sleeps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.autoscaler import (
    RULES,
    Decision,
    DeploymentState,
    PolicyConfig,
    Signals,
    aggregate,
    decide,
    fit_trend,
    step_sse,
)

NOW = 1_800_000_000.0
CFG = PolicyConfig()
SLA = 2.0
TTFT_SLA = 0.5
GPUS = 8

UP = {
    "queue": CFG.queue_per_gpu_target,
    "p95": CFG.latency_fraction * SLA,
    "ttft": CFG.latency_fraction * TTFT_SLA,
    "kv": CFG.kv_high,
}
LOW = {
    "queue": CFG.low_water * CFG.queue_per_gpu_target,
    "p95": CFG.low_water * SLA,
    "ttft": CFG.low_water * TTFT_SLA,
    "kv": CFG.low_water * CFG.kv_high,
}
QUIET = {"queue": 2.0, "p95": 0.5, "ttft": 0.1, "kv": 0.2}  # every signal under its low water
MID = {"queue": 7.0, "p95": 1.2, "ttft": 0.3, "kv": 0.6}  # between low water and threshold
Values = Mapping[str, float | None]
RULE_OF = {"queue": "queue_high", "p95": "latency_high", "ttft": "ttft_high", "kv": "kv_high"}


def state(**kw: Any) -> DeploymentState:
    base: dict[str, Any] = {
        "name": "llama",
        "sla_p95_s": SLA,
        "sla_ttft_s": TTFT_SLA,
        "gpus_per_server": GPUS,
        "min_servers": 1,
        "max_servers": 20,
        "target": 4,
        "serving": 4,
    }
    base.update(kw)
    return DeploymentState(**base)


def sig(at: float, values: Values, gpus: int = 32) -> Signals:
    return Signals(
        at=at,
        queue_per_gpu=values["queue"],
        kv_use=values["kv"],
        p95_latency_s=values["p95"],
        ttft_p95_s=values["ttft"],
        serving_gpus=gpus,
    )


def series(
    start: float, end: float, values: Values, every: float = 10.0, gpus: int = 32
) -> list[Signals]:
    """Observations from `start` to `end` inclusive (relative to NOW), every `every` s."""
    n = round((end - start) / every)
    return [sig(NOW + start + i * every, values, gpus) for i in range(n + 1)]


def steady(values: Values, span: float = 900.0, **kw: Any) -> list[Signals]:
    return series(-span, 0.0, values, **kw)


def with_(base: Values, **kw: float | None) -> dict[str, float | None]:
    out = dict(base)
    out.update(kw)
    return out


def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


def run(
    history: Sequence[Signals],
    config: PolicyConfig = CFG,
    now: float = NOW,
    **kw: Any,
) -> Decision:
    decision = decide(state(**kw), history, now, config)
    assert decision.rule in RULES
    assert "\n" not in decision.reason
    json.dumps(decision.inputs, allow_nan=False)  # JSON-ready, no NaN or infinity
    return decision


# ---------------------------------------------------------------------------------------------
# pinned and bounds


def test_pinned_sets_the_target_whatever_the_signals() -> None:
    d = run(steady(with_(QUIET, queue=50.0)), pinned=7)
    assert (d.target, d.delta, d.rule) == (7, 3, "pinned")
    assert "pinned at 7" in d.reason


def test_pinned_is_capped_at_max_but_may_go_below_min() -> None:
    assert run([], pinned=20).target == 20  # at max: kept
    d = run([], pinned=21)
    assert (d.target, d.rule) == (20, "pinned")
    assert "max 20" in d.reason
    assert run([], pinned=0, min_servers=2, floor=3).target == 0  # the operator's word wins


def test_target_under_min_is_raised_even_without_data() -> None:
    d = run([], target=0, min_servers=1)
    assert (d.target, d.delta, d.rule) == (1, 1, "min")
    assert "no_data" in d.reason
    d = run([], target=1, min_servers=1)
    assert (d.target, d.rule) == (1, "no_data")


def test_the_calendar_floor_is_a_bound_of_its_own() -> None:
    d = run(steady(QUIET), target=2, min_servers=1, floor=3)
    assert (d.target, d.rule) == (3, "floor")
    d = run(steady(QUIET), target=3, min_servers=1, floor=3)
    assert (d.target, d.delta, d.rule) == (3, 0, "floor")  # wanted -1, held at the floor


def test_target_over_max_is_lowered() -> None:
    d = run(steady(MID), target=21, serving=21, max_servers=20)
    assert (d.target, d.delta, d.rule) == (20, -1, "max")
    d = run(steady(MID), target=20, serving=20, max_servers=20)
    assert (d.target, d.rule) == (20, "hold")


def test_scale_up_at_max_is_capped() -> None:
    d = run(steady(with_(QUIET, queue=30.0)), target=19, serving=19, max_servers=20)
    assert (d.target, d.delta, d.rule) == (20, 1, "max")
    assert "queue_high" in d.reason
    d = run(steady(with_(QUIET, queue=30.0)), target=20, serving=20, max_servers=20)
    assert (d.target, d.delta, d.rule) == (20, 0, "max")


def test_a_floor_above_max_yields_to_max() -> None:
    d = run(steady(MID), target=5, serving=5, min_servers=1, floor=9, max_servers=6)
    assert (d.target, d.rule) == (6, "floor")
    assert "capped at max 6" in d.reason


# ---------------------------------------------------------------------------------------------
# no data


def test_no_observations_is_no_data() -> None:
    d = run([])
    assert (d.target, d.delta, d.rule) == (4, 0, "no_data")
    d = run(steady(QUIET), now=NOW - 1000)  # every observation is in the future
    assert d.rule == "no_data"


def test_only_empty_observations_is_no_data() -> None:
    nothing = dict.fromkeys(QUIET)
    d = run(steady(nothing, gpus=0))
    assert (d.delta, d.rule) == (0, "no_data")


def test_a_stale_newest_observation_is_no_data() -> None:
    hot = with_(QUIET, queue=30.0)
    fresh = series(-900, -CFG.max_gap_s, hot)
    assert run(fresh).rule == "queue_high"  # exactly max_gap_s old: still fresh
    stale = [replace(o, at=o.at - 0.5) for o in fresh]
    d = run(stale)
    assert (d.delta, d.rule) == (0, "no_data")
    assert "old" in d.reason


# ---------------------------------------------------------------------------------------------
# scale up: each signal at its threshold, both sides


@pytest.mark.parametrize("name", ["queue", "p95", "ttft", "kv"])
def test_each_signal_scales_up_just_over_its_threshold(name: str) -> None:
    at = run(steady(with_(QUIET, **{name: UP[name]})))
    assert (at.delta, at.rule) == (0, "hold")  # AT the threshold is not over it
    over = run(steady(with_(QUIET, **{name: above(UP[name])})))
    assert (over.delta, over.rule) == (1, RULE_OF[name])
    assert over.target == 5


def test_the_largest_ratio_names_the_rule() -> None:
    d = run(steady({"queue": 12.0, "p95": 1.8 * 1.3, "ttft": 0.2, "kv": 0.9}))
    assert d.rule == "latency_high"  # 1.3× beats queue's 1.2× and KV's 1.06×
    assert d.inputs["ratio_signal"] == "p95"


@pytest.mark.parametrize(
    ("queue", "step"),
    [
        (above(10.0), 1),
        (below(15.0), 1),
        (15.0, 2),  # ratio 1.5
        (below(20.0), 2),
        (20.0, 4),  # ratio 2.0
        (100.0, 4),
    ],
)
def test_step_table(queue: float, step: int) -> None:
    d = run(steady(with_(QUIET, queue=queue)))
    assert d.delta == step


def test_max_step_caps_the_step() -> None:
    d = run(steady(with_(QUIET, queue=100.0)), replace(CFG, max_step=3))
    assert d.delta == 3


def test_scale_up_acts_on_the_signals_there_are() -> None:
    # A saturated engine may have finished no request to time: no latency, still a queue.
    d = run(steady(with_(QUIET, queue=25.0, p95=None, ttft=None)))
    assert (d.delta, d.rule) == (4, "queue_high")


# ---------------------------------------------------------------------------------------------
# the up window


def test_over_for_exactly_the_up_window_scales() -> None:
    history = series(-900, -70, MID) + series(-60, 0, with_(MID, queue=12.0))
    d = run(history)
    assert (d.delta, d.rule) == (1, "queue_high")


def test_over_for_less_than_the_up_window_waits() -> None:
    history = series(-900, -60, MID) + series(-50, 0, with_(MID, queue=12.0))
    d = run(history)
    assert (d.delta, d.rule) == (0, "window")
    assert "50 s of the 60 s up window" in d.reason
    # Half a second short of the window, same.
    hot = with_(MID, queue=12.0)
    shifted = [*series(-900, -69.5, MID), *series(-59.5, -9.5, hot), sig(NOW, hot)]
    assert run(shifted).rule == "window"


def test_a_burst_shorter_than_the_window_never_scales_however_high() -> None:
    history = series(-900, -60, QUIET) + series(-50, 0, with_(QUIET, queue=500.0, kv=1.0))
    d = run(history)
    assert (d.delta, d.rule) == (0, "window")


def test_one_quiet_observation_inside_the_window_resets_it() -> None:
    hot = with_(QUIET, queue=30.0)
    history = series(-900, 0, hot)
    history[-4] = replace(history[-4], queue_per_gpu=5.0)  # 30 s ago
    assert run(history).rule == "window"


def test_a_gap_in_the_up_window_breaks_the_run() -> None:
    hot = with_(QUIET, queue=30.0)
    history = series(-900, -130, hot) + series(-5, 0, hot, every=5.0)  # 125 s without a word
    d = run(history)
    assert (d.delta, d.rule) == (0, "window")


def test_an_up_window_of_zero_acts_on_one_observation() -> None:
    history = [*series(-900, -10, QUIET), sig(NOW, with_(QUIET, queue=30.0))]
    assert run(history, replace(CFG, up_window_s=0.0)).rule == "queue_high"


# ---------------------------------------------------------------------------------------------
# capacity on its way


def test_capacity_on_the_way_that_covers_the_need_holds() -> None:
    # 4 serving, 2 booting: 32 GPUs now, 48 once they serve. Queue 15 × 32 / 48 = 10: not
    # below 1× of the target, so one more; anything less than 15 is covered.
    d = run(steady(with_(QUIET, queue=15.0)), target=6, on_the_way=2)
    assert (d.delta, d.rule) == (1, "queue_high")
    assert d.inputs["projected_ratio"] == 1.0
    d = run(steady(with_(QUIET, queue=below(15.0))), target=6, on_the_way=2)
    assert (d.delta, d.rule) == (0, "hold")
    assert "2 on the way" in d.reason


def test_a_target_not_yet_booted_counts_as_on_the_way() -> None:
    # The last tick raised the target to 6; the provisioner has not booted anything yet.
    d = run(steady(with_(QUIET, queue=12.0)), target=6, serving=4, on_the_way=0)
    assert (d.delta, d.rule) == (0, "hold")


def test_the_step_is_the_projected_ratios() -> None:
    # 30/GPU on 32 GPUs, 64 GPUs coming: 15/GPU, 1.5× → +2 (not the +4 of 3×).
    d = run(steady(with_(QUIET, queue=30.0)), target=8, on_the_way=4)
    assert (d.target, d.delta) == (10, 2)


# ---------------------------------------------------------------------------------------------
# cooldowns


def test_cooldown_up_at_its_threshold() -> None:
    hot = steady(with_(QUIET, queue=12.0))
    d = run(hot, last_up_at=NOW - CFG.cooldown_up_s)
    assert (d.delta, d.rule) == (1, "queue_high")
    d = run(hot, last_up_at=NOW - CFG.cooldown_up_s + 0.5)
    assert (d.delta, d.rule) == (0, "cooldown")
    assert "last scale-up" in d.reason


def test_a_recent_scale_down_does_not_delay_a_scale_up() -> None:
    d = run(steady(with_(QUIET, queue=12.0)), last_down_at=NOW - 1)
    assert d.rule == "queue_high"


@pytest.mark.parametrize("field", ["last_up_at", "last_down_at"])
def test_cooldown_down_at_its_threshold(field: str) -> None:
    due: dict[str, Any] = {field: NOW - CFG.cooldown_down_s}
    d = run(steady(QUIET), **due)
    assert (d.delta, d.rule) == (-1, "scale_down")
    early: dict[str, Any] = {field: NOW - CFG.cooldown_down_s + 0.5}
    d = run(steady(QUIET), **early)
    assert (d.delta, d.rule) == (0, "cooldown")


# ---------------------------------------------------------------------------------------------
# look-ahead


def ramp(
    per_s: float, start: float = 2.0, span: float = 300.0, flat_before: float = 600.0
) -> list[Signals]:
    """Quiet but for a queue flat at `start` until `span` s ago, rising `per_s` /GPU/s since."""
    out = series(-span - flat_before, -span - 10, with_(QUIET, queue=start))
    for i in range(round(span / 10) + 1):
        t = -span + 10 * i
        out.append(sig(NOW + t, with_(QUIET, queue=start + per_s * (t + span))))
    return out


def test_a_ramp_that_will_cross_the_target_within_a_boot_scales_now() -> None:
    # 2 → 5 /GPU over 5 minutes: 0.01/GPU/s. In `boot` s it is 5 + 0.01 × boot: over the
    # target of 10 beyond 500 s.
    history = ramp(0.01)
    d = run(history, boot_p90_s=490.0)
    assert d.rule != "trend"
    assert d.delta == 0
    d = run(history, boot_p90_s=510.0)
    assert (d.delta, d.rule) == (1, "trend")
    assert "boot p90" in d.reason
    d = run(history, boot_p90_s=1100.0)  # 16/GPU: 1.6×
    assert (d.delta, d.rule) == (2, "trend")


def test_no_look_ahead_when_turned_off() -> None:
    d = run(ramp(0.01), replace(CFG, lookahead=False), boot_p90_s=1100.0)
    assert d.rule == "hold"


def test_the_look_ahead_counts_capacity_on_the_way() -> None:
    # 16/GPU on 32 GPUs in 1100 s; on 48: 10.7 (+1); on 64: 8 (covered).
    assert run(ramp(0.01), boot_p90_s=1100.0, target=6, on_the_way=2).delta == 1
    d = run(ramp(0.01), boot_p90_s=1100.0, target=8, on_the_way=4)
    assert (d.delta, d.rule) == (0, "hold")


def test_the_trend_follows_total_waiting_through_capacity_arriving() -> None:
    # Total waiting rises steadily while servers join: per GPU it falls in jumps, in total
    # it is a clean ramp.
    history = []
    for i in range(31):
        t = -300 + 10 * i
        gpus = 32 if t < -150 else 40
        waiting = 64.0 + 1.0 * (t + 300)  # +1 request/s
        history.append(sig(NOW + t, with_(QUIET, queue=waiting / gpus), gpus=gpus))
    history = series(-900, -310, with_(QUIET, queue=2.0)) + history
    # Now 364 waiting on 40 GPUs (9.1/GPU); in 900 s 1264 on 5 servers: 31.6/GPU.
    d = run(history, boot_p90_s=900.0, target=5, serving=5)
    assert (d.delta, d.rule) == (4, "trend")
    assert d.inputs["trend_series"] == "waiting"


def test_a_step_is_not_a_trend() -> None:
    # 2/GPU, then 8/GPU for the last 100 s: a line through it rises steeply, a step fits it.
    history = series(-900, -110, with_(QUIET, queue=2.0)) + series(-100, 0, MID | {"queue": 8.0})
    d = run(history, boot_p90_s=900.0)
    assert d.rule == "hold"
    assert d.inputs["trend_step_sse"] is not None
    assert d.inputs["trend_step_sse"] <= d.inputs["trend_line_sse"]  # type: ignore[operator]


def test_a_spike_at_the_end_is_not_a_trend() -> None:
    history = steady(with_(QUIET, queue=3.0))
    history[-1] = replace(history[-1], queue_per_gpu=9.0)
    assert run(history, boot_p90_s=900.0).rule == "hold"


def test_a_load_that_levelled_off_is_not_a_trend() -> None:
    # Rising 2 → 6 over the older half of the window, flat at 6 over the newer half.
    history = series(-900, -310, with_(QUIET, queue=2.0))
    for i in range(16):
        history.append(sig(NOW - 300 + 10 * i, with_(QUIET, queue=2.0 + 4.0 * i / 15)))
    history += series(-140, 0, with_(QUIET, queue=6.0))
    d = run(history, boot_p90_s=900.0)
    assert d.rule == "hold"
    assert d.inputs["trend_slope_per_s"] > 0  # type: ignore[operator]


def test_noise_is_not_a_trend() -> None:
    history = steady(with_(QUIET, queue=3.0))
    history = [
        replace(o, queue_per_gpu=3.0 + (2.0 if i % 2 else -2.0)) for i, o in enumerate(history)
    ]
    assert run(history, boot_p90_s=900.0).rule == "hold"


def test_no_trend_without_a_covered_window() -> None:
    history = [o for o in ramp(0.01) if o.at > NOW - 290]  # 290 s of a 300 s window
    assert run(history, boot_p90_s=1100.0).rule != "trend"


def test_the_trend_waits_for_the_up_cooldown() -> None:
    d = run(ramp(0.01), boot_p90_s=1100.0, last_up_at=NOW - 10)
    assert (d.delta, d.rule) == (0, "cooldown")


# ---------------------------------------------------------------------------------------------
# scale down


def test_quiet_for_the_whole_down_window_scales_down_by_one() -> None:
    d = run(series(-CFG.down_window_s, 0, QUIET))
    assert (d.target, d.delta, d.rule) == (3, -1, "scale_down")


def test_quiet_for_less_than_the_down_window_waits() -> None:
    d = run(series(-CFG.down_window_s + 10, 0, QUIET))
    assert (d.delta, d.rule) == (0, "window")
    assert "590 s of the 600 s down window" in d.reason


@pytest.mark.parametrize("name", ["queue", "p95", "ttft", "kv"])
def test_each_signal_must_be_under_its_low_water(name: str) -> None:
    d = run(steady(with_(QUIET, **{name: LOW[name]})))
    assert (d.delta, d.rule) == (0, "hold")  # AT low water is not under it
    d = run(steady(with_(QUIET, **{name: below(LOW[name])})))
    assert (d.delta, d.rule) == (-1, "scale_down")


@pytest.mark.parametrize("name", ["queue", "p95", "ttft", "kv"])
@pytest.mark.parametrize("ago", [0, 300, 600])
def test_never_scale_down_on_a_missing_signal(name: str, ago: int) -> None:
    history = steady(QUIET)
    i = len(history) - 1 - ago // 10
    history[i] = sig(history[i].at, with_(QUIET, **{name: None}))
    d = run(history)
    assert (d.delta, d.rule) == (0, "no_data")


def test_a_missing_signal_before_the_window_does_not_matter() -> None:
    history = steady(QUIET)
    history[-62] = sig(history[-62].at, with_(QUIET, queue=None))  # 610 s ago
    assert run(history).rule == "scale_down"


@pytest.mark.parametrize(("gap", "rule"), [(120.0, "scale_down"), (121.0, "no_data")])
def test_a_gap_in_the_down_window_is_missing_data(gap: float, rule: str) -> None:
    before = [replace(o, at=o.at - (gap - 120.0)) for o in series(-900, -420, QUIET)]
    history = before + series(-300, 0, QUIET)
    assert run(history).rule == rule


def test_tolerance_keeps_a_scale_down_clear_of_the_scale_up_threshold() -> None:
    # 2 serving → 1: every value doubles. Queue 4.5 (under its low water of 5) would become
    # 9/GPU, 0.9× of the target: within the tolerance of 0.1, so "at target", hold.
    quiet = {"queue": 0.0, "p95": 0.3, "ttft": 0.05, "kv": 0.1}
    edge = (1 - CFG.tolerance) * CFG.queue_per_gpu_target / 2
    d = run(steady(with_(quiet, queue=edge), gpus=16), target=2, serving=2)
    assert (d.delta, d.rule) == (0, "hold")
    assert "tolerance" in d.reason
    d = run(steady(with_(quiet, queue=below(edge)), gpus=16), target=2, serving=2)
    assert (d.target, d.rule) == (1, "scale_down")


def test_the_tolerance_uses_the_windows_peak_not_the_newest() -> None:
    quiet = {"queue": 0.0, "p95": 0.3, "ttft": 0.05, "kv": 0.1}
    history = steady(quiet, gpus=16)
    history[-30] = sig(history[-30].at, with_(quiet, queue=4.6), gpus=16)
    assert run(history, target=2, serving=2).rule == "hold"


def _slots(history: list[Signals], slot_use: float | None) -> list[Signals]:
    return [replace(o, slot_use=slot_use) for o in history]


def test_a_scale_in_that_would_fill_the_batches_is_not_taken() -> None:
    # Every signal quiet on 2 servers, but their engines' batches 40 % busy: on one server 80 %,
    # past the ceiling (75 %), where latency is no longer proportional to load: hold.
    quiet = {"queue": 0.0, "p95": 0.3, "ttft": 0.05, "kv": 0.1}
    edge = CFG.slot_ceiling / 2
    d = run(_slots(steady(quiet, gpus=16), edge), target=2, serving=2)
    assert (d.delta, d.rule) == (0, "hold")
    assert "batch slots" in d.reason and d.inputs["projected_slot_use"] == CFG.slot_ceiling
    d = run(_slots(steady(quiet, gpus=16), below(edge)), target=2, serving=2)
    assert (d.target, d.rule) == (1, "scale_down")
    # No batch size known (slot_use None): the other signals decide alone, as before.
    d = run(_slots(steady(quiet, gpus=16), None), target=2, serving=2)
    assert (d.target, d.rule) == (1, "scale_down")


def test_the_slot_check_uses_the_windows_peak_and_the_gpus_then() -> None:
    quiet = {"queue": 0.0, "p95": 0.3, "ttft": 0.05, "kv": 0.1}
    history = _slots(steady(quiet, gpus=24), 0.2)  # 3 servers: 0.3 on 2
    assert run(history, target=3, serving=3).rule == "scale_down"
    history[-20] = replace(history[-20], slot_use=0.55)  # 0.825 on 2, 200 s ago
    d = run(history, target=3, serving=3)
    assert (d.delta, d.rule) == (0, "hold")
    # Going to zero needs no traffic at all: an idle batch (0 running) does not stop it.
    zero = {"queue": 0.0, "p95": 0.0, "ttft": 0.0, "kv": 0.0}
    d = run(_slots(steady(zero, gpus=8), 0.0), target=1, serving=1, min_servers=0)
    assert (d.target, d.rule) == (0, "scale_down")


def test_slot_ceiling_is_checked() -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="slot_ceiling"):
            PolicyConfig(slot_ceiling=bad)


def test_requests_waiting_for_a_deployment_at_zero_activate_one_server_at_once() -> None:
    at_zero: dict[str, Any] = {"target": 0, "serving": 0, "min_servers": 0}
    d = run([], router_waiting=3, **at_zero)
    assert (d.target, d.rule) == (1, "activate")
    assert "3 request(s) wait" in d.reason and d.inputs["router_waiting"] == 3
    # No waiting: nothing to go on, it stays at zero.
    d = run([], **at_zero)
    assert (d.target, d.rule) == (0, "no_data")
    # A server already on its way, or one already asked for: no second one.
    assert run([], router_waiting=3, target=0, serving=0, on_the_way=1, min_servers=0).rule != (
        "activate"
    )
    assert run([], router_waiting=3, target=1, serving=0, min_servers=0).target == 1
    # The operator's pin and max win.
    assert run([], router_waiting=3, pinned=0, **at_zero).target == 0
    d = run([], router_waiting=3, max_servers=0, **at_zero)
    assert (d.target, d.rule) == (0, "max")


def test_late_heartbeats_do_not_make_a_scale_down_look_safe() -> None:
    # 2 servers serve, but the observations counted one's GPUs (the other's heartbeat was
    # late). Queue 4.9 on 16 GPUs is 9.8/GPU on one server: hold, whatever the 8 GPUs say.
    quiet = {"queue": 4.9, "p95": 0.3, "ttft": 0.05, "kv": 0.1}
    d = run(steady(quiet, gpus=8), target=2, serving=2)
    assert (d.delta, d.rule) == (0, "hold")


def test_a_rising_queue_blocks_a_scale_down() -> None:
    # Queue 1 → 3 over 5 minutes (under its low water all along): in 900 s 9/GPU, fine on 4
    # servers (0.9×: no trend up), but 12/GPU on 3.
    history = series(-900, -310, with_(QUIET, queue=1.0))
    for i in range(31):
        history.append(sig(NOW - 300 + 10 * i, with_(QUIET, queue=1.0 + 2.0 * i / 30)))
    d = run(history, boot_p90_s=900.0)
    assert (d.delta, d.rule) == (0, "hold")
    assert "rising" in d.reason
    assert run(history, replace(CFG, lookahead=False), boot_p90_s=900.0).rule == "scale_down"


def test_down_to_zero_only_without_any_traffic() -> None:
    idle = dict.fromkeys(QUIET, 0.0)
    d = run(steady(idle, gpus=8), target=1, serving=1, min_servers=0)
    assert (d.target, d.rule) == (0, "scale_down")
    d = run(steady(with_(idle, queue=0.01), gpus=8), target=1, serving=1, min_servers=0)
    assert (d.target, d.rule) == (1, "hold")


def test_at_min_a_quiet_deployment_is_held_by_min() -> None:
    d = run(steady(QUIET), target=1, serving=1, min_servers=1)
    assert (d.target, d.delta, d.rule) == (1, 0, "min")
    assert "scale_down" in d.reason


def test_busy_but_not_over_holds() -> None:
    d = run(steady(MID))
    assert (d.delta, d.rule) == (0, "hold")
    assert "low water" in d.reason


# ---------------------------------------------------------------------------------------------
# decisions explain themselves


def test_inputs_carry_the_signals_and_thresholds() -> None:
    d = run(steady(with_(QUIET, queue=25.0)))
    inputs = d.inputs
    assert inputs["queue_per_gpu"] == 25.0
    assert inputs["kv_use"] == QUIET["kv"]
    assert inputs["p95_latency_s"] == QUIET["p95"]
    assert inputs["queue_per_gpu_target"] == 10.0
    assert inputs["p95_threshold_s"] == pytest.approx(1.8)
    assert inputs["serving"] == 4 and inputs["on_the_way"] == 0
    assert "25/GPU > 10/GPU" in d.reason


def test_history_order_does_not_matter() -> None:
    history = series(-900, -70, MID) + series(-60, 0, with_(MID, queue=12.0))
    assert run(list(reversed(history))) == run(history)


# ---------------------------------------------------------------------------------------------
# a square wave must not make it oscillate (a toy fleet driven over time)


Load = Callable[[float], float]


def simulate(
    load: Load, config: PolicyConfig, hours: float = 2.0, tick: float = 10.0, boot: float = 900.0
) -> list[int]:
    """Drive `decide` every `tick` s against a toy fleet: `load(t)` requests waiting in all
    (spread over the serving GPUs), servers serving `boot` s after the target asks for them,
    surplus returned at once (booting ones first). Returns the target after every change."""
    target = serving = 2
    booting: list[float] = []  # when each booting server will serve
    last_up: float | None = None
    last_down: float | None = None
    history: list[Signals] = []
    targets = [target]
    t = 0.0
    while t < hours * 3600:
        serving += sum(1 for ready in booting if ready <= t)
        booting = [ready for ready in booting if ready > t]
        short = target - serving - len(booting)
        if short > 0:
            booting += [t + boot] * short
        for _ in range(-short):
            if booting:
                booting.pop()
            else:
                serving -= 1
        gpus = serving * GPUS
        q = load(t) / gpus
        history.append(
            Signals(t, q, min(1.0, 0.1 + 0.03 * q), 0.5 + 0.05 * q, 0.1 + 0.01 * q, gpus)
        )
        history = [o for o in history if o.at > t - 1200]
        s = DeploymentState(
            "wave", SLA, TTFT_SLA, GPUS, 1, 40, target=target, serving=serving,
            on_the_way=len(booting), boot_p90_s=boot, last_up_at=last_up, last_down_at=last_down,
        )  # fmt: skip
        d = decide(s, history, t, config)
        if d.delta > 0:
            last_up = t
        elif d.delta < 0:
            last_down = t
        if d.delta:
            targets.append(d.target)
        target = d.target
        t += tick
    return targets


def direction_changes(targets: Sequence[int]) -> int:
    moves = [1 if b > a else -1 for a, b in pairwise(targets) if a != b]
    return sum(1 for a, b in pairwise(moves) if a != b)


def square(high: float, low: float, period: float) -> Load:
    return lambda t: high if t % period < period / 2 else low


NAIVE = replace(
    CFG,
    up_window_s=0.0,
    down_window_s=0.0,
    cooldown_up_s=0.0,
    cooldown_down_s=0.0,
    tolerance=0.0,
    lookahead=False,
)


@pytest.mark.parametrize("period", [40.0, 100.0])
def test_a_square_wave_shorter_than_the_up_window_moves_nothing(period: float) -> None:
    # 25/GPU half the time, 1.25 the other half: never high for a whole up window, never
    # quiet for a whole down window.
    assert simulate(square(400.0, 20.0, period), CFG) == [2]


@pytest.mark.parametrize("period", [400.0, 1000.0])
@pytest.mark.parametrize("high", [400.0, 1000.0])
def test_a_square_wave_shorter_than_the_down_window_does_not_oscillate(
    period: float, high: float
) -> None:
    targets = simulate(square(high, 20.0, period), CFG)
    assert direction_changes(targets) == 0
    assert targets[-1] > 2  # it did answer the highs


def test_the_harness_catches_oscillation() -> None:
    # Without windows, cooldowns, tolerance the same loads flap: the count above means it.
    assert direction_changes(simulate(square(400.0, 20.0, 100.0), NAIVE, hours=1)) > 10
    assert direction_changes(simulate(square(400.0, 20.0, 400.0), NAIVE, hours=1)) > 10


def test_a_ramp_is_met_earlier_with_the_look_ahead() -> None:
    def ramp_load(t: float) -> float:
        return 40.0 + 760.0 * min(t, 3600.0) / 3600.0

    ahead = simulate(ramp_load, CFG, hours=0.5)
    behind = simulate(ramp_load, replace(CFG, lookahead=False), hours=0.5)
    assert ahead[-1] > behind[-1]


# ---------------------------------------------------------------------------------------------
# properties

# None, any value, or one small enough to be under every low water (so scale-downs happen).
optional = st.none() | st.floats(0.0, 60.0) | st.floats(0.0, 0.02)


@st.composite
def states(draw: st.DrawFn, in_bounds: bool = True) -> DeploymentState:
    max_servers = draw(st.integers(0, 30))
    min_servers = draw(st.integers(0, max_servers))
    floor = draw(st.integers(0, max_servers))
    lo = max(min_servers, floor)
    target = draw(st.integers(lo, max_servers) if in_bounds else st.integers(0, 40))
    return DeploymentState(
        name="p",
        sla_p95_s=draw(st.floats(0.1, 30.0)),
        sla_ttft_s=draw(st.floats(0.05, 5.0)),
        gpus_per_server=draw(st.sampled_from([1, 4, 8])),
        min_servers=min_servers,
        max_servers=max_servers,
        floor=floor,
        target=target,
        serving=draw(st.integers(0, 30)),
        on_the_way=draw(st.integers(0, 10)),
        boot_p90_s=draw(st.floats(0.0, 1800.0)),
        last_up_at=draw(st.none() | st.floats(NOW - 2000, NOW)),
        last_down_at=draw(st.none() | st.floats(NOW - 2000, NOW)),
    )


@st.composite
def histories(draw: st.DrawFn) -> list[Signals]:
    """Up to 80 observations, `every` s apart up to NOW: one set of values (a steady load,
    which the windows can act on) with up to 12 observations set otherwise."""
    n = draw(st.integers(0, 80))
    every = draw(st.floats(1.0, 60.0))
    gpus = draw(st.integers(0, 64))
    four = st.tuples(optional, optional, optional, optional)
    rows = [draw(four)] * n
    for i, values in draw(st.lists(st.tuples(st.integers(0, 79), four), max_size=12)):
        if i < n:
            rows[i] = values
    return [
        Signals(NOW - (n - 1 - i) * every, q, None if kv is None else kv / 60.0, p95, ttft, gpus)
        for i, (q, kv, p95, ttft) in enumerate(rows)
    ]


@given(states(in_bounds=False), histories())
@settings(max_examples=300)
def test_decisions_stay_within_bounds(s: DeploymentState, history: list[Signals]) -> None:
    d = decide(s, history, NOW)
    assert min(max(s.min_servers, s.floor), s.max_servers) <= d.target <= s.max_servers
    assert d.rule in RULES
    assert d.delta == d.target - s.target
    json.dumps(d.inputs, allow_nan=False)


@given(states(), histories())
@settings(max_examples=300)
def test_missing_data_never_decreases_the_target(
    s: DeploymentState, history: list[Signals]
) -> None:
    window = [o for o in history if o.at >= NOW - CFG.down_window_s]
    if not window or all(
        None not in (o.queue_per_gpu, o.kv_use, o.p95_latency_s, o.ttft_p95_s) for o in window
    ):
        history = [*history[:-1], Signals(NOW, None, None, None, None)]
    assert decide(s, history, NOW).delta >= 0


@given(
    states(),
    st.sampled_from(["queue", "p95", "ttft", "kv"]),
    st.integers(0, 60),
)
def test_a_quiet_deployment_with_one_hole_is_never_scaled_down(
    s: DeploymentState, name: str, ago: int
) -> None:
    history = steady(QUIET)
    i = len(history) - 1 - ago
    history[i] = sig(history[i].at, with_(QUIET, **{name: None}))
    s = replace(s, sla_p95_s=SLA, sla_ttft_s=TTFT_SLA)
    assert decide(s, history, NOW).delta >= 0


@given(
    states(),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_a_constant_signal_below_target_never_scales_up(
    s: DeploymentState, q: float, p95: float, ttft: float, kv: float
) -> None:
    values: dict[str, float | None] = {
        "queue": q * CFG.queue_per_gpu_target,
        "p95": p95 * CFG.latency_fraction * s.sla_p95_s,
        "ttft": ttft * CFG.latency_fraction * s.sla_ttft_s,
        "kv": kv * CFG.kv_high,
    }
    assert decide(s, steady(values), NOW).delta <= 0


@given(
    states(),
    st.tuples(optional, optional, optional, optional),
    st.floats(1.0, 10.0),
    st.sampled_from([0, 8, 32]),
)
@settings(max_examples=300)
def test_higher_sustained_load_never_yields_a_smaller_delta(
    s: DeploymentState,
    base: tuple[float | None, float | None, float | None, float | None],
    factor: float,
    gpus: int,
) -> None:
    q, p95, ttft, kv = base
    low: dict[str, float | None] = {
        "queue": q,
        "p95": p95,
        "ttft": ttft,
        "kv": None if kv is None else kv / 60.0,
    }
    high = {k: None if v is None else v * factor for k, v in low.items()}
    assert (
        decide(s, steady(high, gpus=gpus), NOW).delta
        >= decide(s, steady(low, gpus=gpus), NOW).delta
    )


# ---------------------------------------------------------------------------------------------
# fit_trend, step_sse


def test_fit_trend_recovers_a_line() -> None:
    points = [(NOW - 300 + 10 * i, 2.0 + 0.01 * 10 * i) for i in range(31)]
    trend = fit_trend(points, NOW)
    assert trend is not None
    assert trend.slope == pytest.approx(0.01)
    assert trend.level == pytest.approx(5.0)
    assert trend.r2 == pytest.approx(1.0)
    assert trend.ahead(500) == pytest.approx(10.0)


def test_fit_trend_of_a_constant_is_flat_and_of_too_little_is_none() -> None:
    flat = fit_trend([(NOW - i, 0.1) for i in range(10)], NOW)
    assert flat is not None and (flat.slope, flat.r2) == (0.0, 0.0)
    assert fit_trend([(NOW, 1.0), (NOW - 1, 2.0)], NOW) is None
    assert fit_trend([(NOW, 1.0)] * 5, NOW) is None  # no spread in time


def test_step_sse() -> None:
    assert step_sse([1.0, 1.0, 1.0, 5.0, 5.0]) == 0.0
    assert step_sse([1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.0)  # [1,2] | [3,4]: 0.5 + 0.5
    assert step_sse([1.0]) == math.inf


# ---------------------------------------------------------------------------------------------
# aggregate


def replica(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "index": 0,
        "state": "ready",
        "queued": 0,
        "running": 4,
        "kv_used_fraction": 0.2,
        "ttft_p95_s": 0.1,
        "e2e_p95_s": 1.0,
    }
    base.update(kw)
    return base


def test_aggregate_sums_queues_over_gpus_and_takes_the_worst_kv() -> None:
    servers = [
        {"gpu_count": 8, "replicas": [replica(queued=40, kv_used_fraction=0.5)]},
        {
            "gpu_count": 8,
            "replicas": [
                replica(queued=20, kv_used_fraction=0.9, e2e_p95_s=3.0, ttft_p95_s=0.3),
                replica(index=1, queued=20),
            ],
        },
    ]
    s = aggregate(servers, NOW)
    assert s.at == NOW
    assert s.queue_per_gpu == pytest.approx(80 / 16)
    assert s.kv_use == 0.9
    assert s.p95_latency_s == pytest.approx((1.0 + 3.0 + 1.0) / 3)
    assert s.ttft_p95_s == pytest.approx((0.1 + 0.3 + 0.1) / 3)
    assert s.serving_gpus == 16


def test_aggregate_counts_only_ready_replicas() -> None:
    servers = [
        {
            "gpu_count": 8,
            "replicas": [
                replica(queued=16),
                replica(index=1, state="loading", queued=None, kv_used_fraction=None),
            ],
        }
    ]
    s = aggregate(servers, NOW)
    assert s.serving_gpus == 4
    assert s.queue_per_gpu == 4.0


def test_aggregate_leaves_a_replica_without_a_queue_out_of_the_queue() -> None:
    servers = [
        {"gpu_count": 8, "replicas": [replica(queued=None), replica(index=1, queued=8)]},
    ]
    s = aggregate(servers, NOW)
    assert s.queue_per_gpu == 2.0  # 8 waiting on the 4 GPUs that said, not on 8
    assert s.serving_gpus == 8


def test_an_idle_deployment_has_zero_latency_not_missing_latency() -> None:
    idle = replica(queued=0, running=0, e2e_p95_s=None, ttft_p95_s=None, kv_used_fraction=0.0)
    s = aggregate([{"gpu_count": 8, "replicas": [idle, dict(idle, index=1)]}], NOW)
    assert (s.queue_per_gpu, s.p95_latency_s, s.ttft_p95_s, s.kv_use) == (0.0, 0.0, 0.0, 0.0)
    # One busy replica without a latency yet: that IS missing.
    busy = replica(queued=3, running=8, e2e_p95_s=None, ttft_p95_s=None)
    s = aggregate([{"gpu_count": 8, "replicas": [idle, busy]}], NOW)
    assert s.p95_latency_s is None and s.ttft_p95_s is None


def test_aggregate_of_nothing_is_all_none() -> None:
    assert aggregate([], NOW) == Signals(NOW, None, None, None, None, 0)
    s = aggregate([{"gpu_count": 8, "replicas": []}, {"gpu_count": 8}], NOW)
    assert s == Signals(NOW, None, None, None, None, 0)
    failed = replica(state="failed")
    assert aggregate([{"gpu_count": 8, "replicas": [failed]}], NOW).queue_per_gpu is None


def test_aggregate_ignores_junk_values() -> None:
    servers = [{"gpu_count": 8, "replicas": [replica(queued="lots", kv_used_fraction=math.nan)]}]
    s = aggregate(servers, NOW)
    assert s.queue_per_gpu is None
    assert s.kv_use is None


def test_aggregate_feeds_decide() -> None:
    servers = [{"gpu_count": 8, "replicas": [replica(queued=200)]} for _ in range(4)]
    history = [aggregate(servers, NOW - 60 + 10 * i) for i in range(7)]
    d = decide(state(), history, NOW)
    assert (d.delta, d.rule) == (4, "queue_high")  # 25/GPU: 2.5×
