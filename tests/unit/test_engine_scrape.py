"""Each engine's metrics read into the same replica stats (fleet_agent/engine/scrape,
replica_stats.py). The engine texts are the ones their projects publish
(tests/fixtures/engines/metrics/SOURCES.md); where a test needs a family no published text
carries (a rename, a data-parallel label, a later scrape), it says what it changed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet_agent.engine.engine_metrics import histogram_quantile
from fleet_agent.engine.replica_stats import ReplicaStats, update_stats
from fleet_agent.engine.scrape import (
    EngineSample,
    UnsupportedEngineVersion,
    metrics_paths,
    parse,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "engines" / "metrics"
SGLANG = (FIXTURES / "sglang_production_metrics_doc.txt").read_text()
VLLM = (FIXTURES / "vllm_design_metrics_doc.txt").read_text()
TRTLLM = (FIXTURES / "trtllm_serve_metrics_doc.json").read_text()
INF = float("inf")


def later(
    sample: EngineSample, counters: dict[str, float], observe: dict[str, float]
) -> EngineSample:
    """A later scrape of the same engine: counters grown by `counters`, and one observation of
    each histogram family at the value `observe[family]` (added to every bucket it falls in)."""
    grown = {k: v + counters.get(k, 0.0) for k, v in sample.counters.items()}
    grown.update({k: v for k, v in counters.items() if k not in sample.counters})
    histograms = {
        family: {
            le: n + (1.0 if family in observe and observe[family] <= le else 0.0)
            for le, n in buckets.items()
        }
        for family, buckets in sample.histograms.items()
    }
    return dataclasses.replace(sample, counters=grown, histograms=histograms)


# -- the real texts --------------------------------------------------------------------------


def test_sglang_published_text() -> None:
    sample = parse("sglang", {"/metrics": SGLANG})
    assert (sample.running, sample.waiting) == (162, 2826)
    assert sample.kv_used_fraction == pytest.approx(0.28)
    assert sample.prefix_hit_rate == pytest.approx(0.007507552643049313)
    assert sample.counters == {"generation_tokens": 7.557572e06, "prompt_tokens": 8.128902e06}
    assert sample.histograms["ttft"][INF] == 11008.0
    assert sample.histograms["ttft"][1.0] == 27.0
    assert sample.histograms["e2e"][INF] == 11228.0
    # this release's inter-token histogram is the older time_per_output_token_seconds
    assert sample.histograms["itl"][INF] == 7.400757e06
    assert set(sample.histograms) == {"ttft", "e2e", "itl"}  # not func_latency_seconds
    assert "preemptions" not in sample.counters  # the release had no retraction counter
    assert sample.entries == []


def test_vllm_published_text() -> None:
    sample = parse("vllm", {"/metrics": VLLM})
    assert sample.running == 8
    assert sample.waiting is None  # the published example elides it
    assert sample.counters == {"generation_tokens": 27453.0}
    assert sample.histograms["ttft"][0.02] == 13.0
    assert sample.histograms["ttft"][0.1] == 140.0
    # the example stops before the +Inf bucket: no quantile rather than a guess
    assert histogram_quantile(0.95, sample.histograms["ttft"]) is None


def test_trtllm_published_iteration_stats() -> None:
    sample = parse("trtllm", {"/metrics": TRTLLM})
    assert sample.running == 1
    assert sample.kv_used_fraction == pytest.approx(3 / 101256)
    assert sample.prefix_hit_rate == pytest.approx(0.00128)
    assert sample.entries == json.loads(TRTLLM)
    assert (sample.counters, sample.histograms) == ({"paused_requests": 0.0}, {})


@pytest.mark.parametrize(
    ("engine", "texts", "running", "kv"),
    [
        ("sglang", {"/metrics": SGLANG}, 162, 0.28),
        ("vllm", {"/metrics": VLLM}, 8, None),
        ("trtllm", {"/metrics": TRTLLM}, 1, 3 / 101256),
    ],
)
def test_every_engine_fills_the_same_replica_stats(
    engine: str, texts: dict[str, str], running: int, kv: float | None
) -> None:
    stats = ReplicaStats()
    update_stats(stats, 100.0, parse(engine, texts), 60.0)
    assert stats.running == running
    assert stats.kv_used_fraction == (pytest.approx(kv) if kv is not None else None)
    if engine == "sglang":
        assert stats.cache_hit_rate == pytest.approx(0.007507552643049313)
        # one scrape: the window is everything counted so far, as PromQL would see it
        assert stats.ttft_p95_s is not None and stats.e2e_p95_s is not None
        assert stats.itl_p95_s is not None


def test_metrics_paths() -> None:
    assert metrics_paths("trtllm") == ("/metrics", "/prometheus/metrics")
    assert metrics_paths("vllm") == ("/metrics",)
    assert metrics_paths("sglang") == ("/metrics",)
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        metrics_paths("tgi")


# -- two scrapes: windows ---------------------------------------------------------------------


def test_two_scrapes_give_windowed_latencies_tokens_and_preemptions() -> None:
    first = parse("sglang", {"/metrics": SGLANG})
    first = dataclasses.replace(first, counters={**first.counters, "preemptions": 4.0})
    # ten seconds later: 500 tokens, 2 more retractions, one request of TTFT 0.03 s and e2e 0.4 s
    second = later(
        first,
        {"generation_tokens": 500.0, "preemptions": 2.0},
        {"ttft": 0.03, "e2e": 0.4, "itl": 0.012},
    )
    stats = ReplicaStats()
    update_stats(stats, 100.0, first, 60.0)
    assert stats.preemptions == 4
    update_stats(stats, 110.0, second, 60.0)
    assert stats.tokens_per_s == pytest.approx(50.0)
    assert stats.preemptions == 6
    # the window holds that one observation: p95 inside its bucket (0.02, 0.04]
    assert 0.02 < stats.ttft_p95_s <= 0.04  # type: ignore[operator]
    assert 0.3 < stats.e2e_p95_s <= 0.5  # type: ignore[operator]
    assert 0.01 < stats.itl_p95_s <= 0.015  # type: ignore[operator]


def test_window_slides_and_a_restart_starts_it_over() -> None:
    base = parse("sglang", {"/metrics": SGLANG})
    stats = ReplicaStats()
    update_stats(stats, 0.0, base, 15.0)
    update_stats(stats, 20.0, later(base, {"generation_tokens": 200.0}, {}), 15.0)
    assert stats.tokens_per_s == pytest.approx(10.0)  # 200 / 20
    update_stats(stats, 40.0, later(base, {"generation_tokens": 600.0}, {}), 15.0)
    # the baseline is the newest scrape at or before the window's start (t=25): t=20
    assert stats.tokens_per_s == pytest.approx(20.0)  # (600 - 200) / (40 - 20)
    restarted = dataclasses.replace(base, counters={"generation_tokens": 10.0}, histograms={})
    update_stats(stats, 50.0, restarted, 15.0)
    assert stats.tokens_per_s is None  # one scrape since the counters started over
    assert stats.ttft_p95_s is None


def test_windowed_prefix_hit_rate_from_counters() -> None:
    base = dataclasses.replace(
        parse("sglang", {"/metrics": SGLANG}),
        counters={"prefix_queries": 1000.0, "prefix_hits": 100.0},
    )
    stats = ReplicaStats()
    update_stats(stats, 0.0, base, 60.0)
    update_stats(stats, 5.0, later(base, {"prefix_queries": 200.0, "prefix_hits": 150.0}, {}), 60.0)
    assert stats.cache_hit_rate == pytest.approx(0.75)


def test_nothing_read_is_unknown_not_zero() -> None:
    stats = ReplicaStats()
    update_stats(stats, 0.0, parse("sglang", {"/metrics": SGLANG}), 60.0)
    update_stats(stats, 5.0, None, 60.0)
    assert (stats.running, stats.queued, stats.tokens_per_s) == (None, None, None)
    assert stats.kv_used_fraction == pytest.approx(0.28)  # last known


# -- trtllm: today's behaviour ----------------------------------------------------------------

TRTLLM_GAUGES = """\
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="m"} 3
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="m"} 2
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="m"} 0.5
"""  # family names from tensorrt_llm/metrics/collector.py; no published text exists


def _entry(it: int, paused: int, gen: int) -> dict[str, object]:
    # field names of TensorRT-LLM's IterationStats (inflightBatchingStats), values invented
    return {
        "iter": it,
        "numActiveRequests": 4,
        "numQueuedRequests": 1,
        "inflightBatchingStats": {"numPausedRequests": paused, "numGenRequests": gen},
    }


def test_trtllm_gauges_stand_in_for_an_idle_engine() -> None:
    sample = parse("trtllm", {"/metrics": "[]", "/prometheus/metrics": TRTLLM_GAUGES})
    assert (sample.running, sample.waiting, sample.kv_used_fraction) == (3, 2, 0.5)
    idle = parse("trtllm", {"/metrics": "[]"})
    assert (idle.running, idle.waiting) == (0, 0)


def test_trtllm_paused_requests_summed_into_preemptions() -> None:
    stats = ReplicaStats()
    update_stats(stats, 0.0, parse("trtllm", {"/metrics": "[]"}), 60.0)
    assert stats.preemptions == 0  # a counter from the first poll, idle or not
    polls = [[_entry(1, 2, 4), _entry(2, 1, 4)], [], [_entry(3, 3, 4)]]
    for i, entries in enumerate(polls, start=1):
        update_stats(stats, float(i), parse("trtllm", {"/metrics": json.dumps(entries)}), 60.0)
    assert stats.preemptions == 6
    assert (stats.running, stats.queued) == (4, 1)
    assert stats.tokens_per_s == pytest.approx(12 / 3)  # numGenRequests over the polls


# -- renamed families and label sets ----------------------------------------------------------


def test_sglang_renamed_inter_token_histogram() -> None:
    renamed = SGLANG.replace(
        "sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds"
    )
    old, new = parse("sglang", {"/metrics": SGLANG}), parse("sglang", {"/metrics": renamed})
    assert new.histograms["itl"] == old.histograms["itl"]


def test_vllm_renamed_families_map_to_the_same_fields() -> None:
    # Built from the family names in vllm/v1/metrics/loggers.py across releases (no published
    # text carries them): the same values under the old and the new names.
    names = {
        "kv": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        "queries": ("vllm:gpu_prefix_cache_queries", "vllm:prefix_cache_queries"),
        "hits": ("vllm:gpu_prefix_cache_hits", "vllm:prefix_cache_hits"),
        "itl": ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    }

    def text(i: int) -> str:
        return (
            f'# TYPE {names["kv"][i]} gauge\n{names["kv"][i]}{{engine="0"}} 0.25\n'
            f'# TYPE {names["queries"][i]} counter\n{names["queries"][i]}_total{{engine="0"}} 400\n'
            f'# TYPE {names["hits"][i]} counter\n{names["hits"][i]}_total{{engine="0"}} 100\n'
            f"# TYPE {names['itl'][i]} histogram\n"
            f'{names["itl"][i]}_bucket{{engine="0",le="0.05"}} 3\n'
            f'{names["itl"][i]}_bucket{{engine="0",le="+Inf"}} 4\n'
        )

    old, new = parse("vllm", {"/metrics": text(0)}), parse("vllm", {"/metrics": text(1)})
    assert old == new
    assert new.kv_used_fraction == 0.25
    assert new.prefix_hit_rate == 0.25
    assert new.counters == {"prefix_queries": 400.0, "prefix_hits": 100.0}
    assert new.histograms["itl"] == {0.05: 3.0, INF: 4.0}
    # a 0.10-style text with both names is read once (the new one), not summed
    both = text(1) + text(0).replace("0.25", "0.9").replace(" 400", " 9999")
    assert parse("vllm", {"/metrics": both}) == new


def test_vllm_data_parallel_engines_summed() -> None:
    # the engine label of vLLM's data-parallel engine cores (loggers.py), two engines
    dp = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 5\n'
        'vllm:num_preemptions_total{engine="1",model_name="m"} 1\n'
    )
    sample = parse("vllm", {"/metrics": dp})
    assert (sample.running, sample.kv_used_fraction) == (5, 0.7)
    assert sample.counters["preemptions"] == 6.0


def test_vllm_v0_hit_rate_gauge_minus_one_is_unknown() -> None:
    v0 = (
        "# TYPE vllm:gpu_prefix_cache_hit_rate gauge\n"
        'vllm:gpu_prefix_cache_hit_rate{model_name="m"} -1.0\n'
    )
    assert parse("vllm", {"/metrics": v0}).prefix_hit_rate is None


# -- layouts no parser knows ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "texts", "named"),
    [
        ("vllm", {"/metrics": ""}, "vllm:num_requests_running"),
        ("vllm", {}, "vllm:kv_cache_usage_perc"),
        ("vllm", {"/metrics": SGLANG}, "vllm:num_requests_waiting"),
        ("vllm", {"/metrics": TRTLLM}, "vllm:num_preemptions_total"),
        ("sglang", {"/metrics": VLLM}, "sglang:num_running_reqs"),
        ("sglang", {"/metrics": "<html>404</html>"}, "sglang:token_usage"),
        ("trtllm", {"/metrics": VLLM, "/prometheus/metrics": VLLM}, "trtllm_num_requests_running"),
        ("trtllm", {}, "/metrics iteration stats"),
    ],
)
def test_unsupported_layout_is_said_not_zeroed(
    engine: str, texts: dict[str, str], named: str
) -> None:
    with pytest.raises(UnsupportedEngineVersion) as raised:
        parse(engine, texts)
    message = str(raised.value)
    assert message.startswith(f"unsupported engine version: {engine} /metrics has none of ")
    assert named in message
    assert isinstance(raised.value, ValueError)
