"""Prefix-block reuse in the simulator, the multi-turn workload, and the ordering it pins:
prefix-aware routing against estimated completion time without prefix awareness."""

from __future__ import annotations

import itertools
import math

import pytest

from fleet.sim import sessions as ss
from fleet.sim.core import DeploymentSpec, Simulation, summarize
from fleet.sim.engine import Engine, SimRequest
from fleet_core import cost_model as cm

SHAPE = cm.EngineShape(gpu=cm.gpu_spec("H100"), model=cm.model_spec("llama-3.1-8b"))
FLEET = (("H200", 3), ("H100", 3), ("L40S", 2))  # bench/routing.py's


def drain(engine: Engine, requests: list[SimRequest]) -> None:
    """Add each request at its arrival and run the engine until it is empty."""
    pending = sorted(requests, key=lambda r: r.arrival)
    now = 0.0
    for _ in range(100_000):
        t = engine.next_time
        if pending and pending[0].arrival <= t:
            r = pending.pop(0)
            now = max(now, r.arrival)
            engine.add(r, now)
            continue
        if t == math.inf:
            return
        now = t
        engine.advance()
    raise AssertionError("the engine did not drain")


def test_a_cached_prefix_skips_its_prefill() -> None:
    blocks = tuple(range(100))  # 3,200 tokens of one stream
    first = SimRequest(0, 0.0, 3200, 10, 10, blocks=blocks)
    second = SimRequest(1, 5.0, 3300, 10, 10, blocks=(*blocks, 100, 101, 102))
    stranger = SimRequest(2, 10.0, 3300, 10, 10, blocks=tuple(range(1000, 1103)))
    engine = Engine(SHAPE)
    drain(engine, [first, second, stranger])
    assert first.cached == 0 and stranger.cached == 0
    assert second.cached == 3200  # the first's 100 blocks
    prefill = [r.first_token - r.start for r in (first, second, stranger)]
    assert prefill[1] < 0.3 * prefill[0] and prefill[1] < 0.3 * prefill[2]
    assert engine.prefix_lookups == 100 + 103 + 103
    assert engine.prefix_hits == 100
    assert engine.prefix_hit_rate() == pytest.approx(100 / 306)


def test_at_least_one_token_is_computed_and_no_blocks_means_no_reuse() -> None:
    blocks = tuple(range(10))
    engine = Engine(SHAPE)
    again = SimRequest(1, 1.0, 320, 5, 5, blocks=blocks)
    drain(engine, [SimRequest(0, 0.0, 320, 5, 5, blocks=blocks), again])
    assert again.cached == 9 * 32  # 10 whole blocks, the last one computed
    plain = [SimRequest(k, float(k), 320, 5, 5) for k in range(2)]
    engine = Engine(SHAPE)
    drain(engine, plain)
    assert [r.cached for r in plain] == [0, 0] and engine.prefix_lookups == 0


def test_the_prefix_cache_is_bounded_by_the_kv_capacity_lru() -> None:
    engine = Engine(SHAPE)
    cap = engine.max_blocks
    engine._remember(tuple(range(cap)))
    engine._remember(tuple(range(cap, cap + 10)))  # 10 more: the 10 oldest go
    assert len(engine.prefix) == cap
    assert 9 not in engine.prefix and 10 in engine.prefix and cap + 9 in engine.prefix
    # A lookup refreshes: blocks 10-19 become the most recent and outlive 20-29
    r = SimRequest(0, 0.0, 1000, 5, 5, blocks=tuple(range(10, 20)))
    engine._lookup(r)
    assert r.cached == 10 * 32
    engine._remember(tuple(range(cap + 10, cap + 30)))
    assert 10 in engine.prefix and 29 not in engine.prefix


def test_reuse_is_the_same_per_iteration_and_in_blocks() -> None:
    spec = DeploymentSpec("d", "llama-3.1-8b", (("H100", 2),), strategy="prefix_aware")
    reqs = ss.multi_turn(spec, count=150, load=0.7, seed=3)

    def times(per_iteration: bool) -> list[tuple[float, float, int]]:
        fresh = [
            SimRequest(r.rid, r.arrival, r.prompt, r.output, r.max_tokens, blocks=r.blocks)
            for r in reqs
        ]
        result = Simulation([spec], per_iteration=per_iteration).run(fresh)
        return [(r.first_token, r.finish, r.cached) for r in result.requests]

    fast, slow = times(False), times(True)
    assert sum(c for _, _, c in fast) > 0
    assert [c for _, _, c in fast] == [c for _, _, c in slow]
    for (f1, f2, _), (s1, s2, _) in zip(fast, slow, strict=True):
        assert f1 == pytest.approx(s1, rel=1e-6, abs=1e-9)
        assert f2 == pytest.approx(s2, rel=1e-6, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# The workload


def test_sessions_resend_their_history() -> None:
    rows = [(100, 20), (50, 30), (70, 10), (400, 40), (60, 5)] * 40
    groups = ss.group(rows, mean_turns=3.0, seed=1)
    assert groups == ss.group(rows, mean_turns=3.0, seed=1)  # deterministic
    assert sum(len(g) for g in groups) == len(rows)  # every row once, in order
    assert [t.new for g in groups for t in g] == [p for p, _ in rows]
    lengths = [len(g) for g in groups]
    assert max(lengths) > 1 and 2.0 < sum(lengths) / len(lengths) < 4.5
    for g in groups:
        assert g[0].prompt == g[0].new
        for before, after in itertools.pairwise(g):
            assert after.prompt == before.prompt + before.output + after.new
    # A turn that would pass max_prompt starts a new session
    capped = ss.group(rows, mean_turns=50.0, max_prompt=500, seed=1)
    assert all(t.prompt <= 500 for g in capped for t in g[1:])


def test_session_requests_share_their_blocks_and_arrive_after_think_time() -> None:
    groups = ss.group([(300, 40)] * 30, mean_turns=4.0, seed=2)
    sessions = ss.schedule(groups, 2.0, think_mean_s=3.0, seed=2)
    reqs = ss.sim_requests(sessions, answer_s_per_token=0.01)
    assert [r.rid for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(reqs))
    by_session: dict[int, list[SimRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.blocks[0] >> 20, []).append(r)
    assert len(by_session) == len(groups)
    for s in sessions:
        turns = by_session[s.index]
        assert turns[0].arrival == s.start
        for k, (before, after) in enumerate(itertools.pairwise(turns)):
            assert len(after.blocks) == after.prompt // 32
            assert after.blocks[: len(before.blocks)] == before.blocks
            gap = after.arrival - before.arrival
            assert gap == pytest.approx(before.output * 0.01 + s.think_s[k])
    # Distinct sessions share no block
    firsts = [turns[0].blocks[0] for turns in by_session.values()]
    assert len(set(firsts)) == len(firsts)


def test_the_session_rate_offers_the_load() -> None:
    groups = ss.group([(1000, 200)] * 100, mean_turns=4.0, seed=0)
    turns = sum(len(g) for g in groups)
    assert ss.session_rate_for(0.8, 50.0, groups) == pytest.approx(40.0 * len(groups) / turns)
    with pytest.raises(ValueError):
        ss.schedule(groups, 0.0)


# ---------------------------------------------------------------------------------------------
# The ordering (issue 25): multi-turn at 80 % load on the bench's fleet


def _p95s(strategy: str, seed: int) -> tuple[float, float, float]:
    spec = DeploymentSpec("llama", "llama-3.1-8b", FLEET, strategy=strategy, max_batch_size=16)
    result = Simulation([spec], seed=seed).run(ss.multi_turn(spec, load=0.8, seed=seed))
    s = summarize(result, warmup=0.1)
    engines = [e for _, e in result.engines]
    hits = sum(e.prefix_hits for e in engines) / sum(e.prefix_lookups for e in engines)
    return s.ttft_p95, s.latency_p95, hits


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_aware_routing_halves_ttft_on_the_multi_turn_workload(seed: int) -> None:
    """Issue 25's goal, pinned: TTFT p95 <= 0.5 × ECT's and latency p95 no worse. Measured
    (docs/sim.md, "Prefix reuse and the multi-turn ordering"), seeds 0-5: TTFT p95 0.35-0.42 ×
    ECT's, latency p95 0.94-1.00 ×, the engines' prefix hit rate 0.67-0.69 against ECT's
    0.27-0.33."""
    ect_ttft, ect_latency, ect_hits = _p95s("estimated_completion_time", seed)
    ttft, latency, hits = _p95s("prefix_aware", seed)
    assert ttft <= 0.5 * ect_ttft
    assert latency <= ect_latency
    assert hits > ect_hits + 0.25
    # The default (affinity over prefix-aware) chooses the same with one deployment
    assert _p95s("model_affinity", seed)[:2] == (ttft, latency)
