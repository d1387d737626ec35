"""KV-prefix-aware routing, pure: block hashes, the per-replica index, the credit and the
strategy that weighs it against load, the pool's books, the engine's hit rate."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.router.admission import AdmissionQueue
from fleet.router.discovery import apply_agent_state
from fleet.router.estimates import Throughput, iteration_costs
from fleet.router.pool import DeploymentPool
from fleet.router.prefix import (
    BLOCK_TOKENS,
    DEFAULT_CAPACITY,
    MIN_PROMISED,
    PREFIX_CREDIT,
    PrefixIndex,
    index_capacity,
    request_blocks,
    text_blocks,
    token_blocks,
)
from fleet.router.strategy import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    ModelAffinity,
    Replica,
    Request,
    completion_time,
    credits_prefix,
    estimated_completion_time,
    make,
    prefix_aware,
)
from fleet_agent.engine.core import CoreConfig, EngineCore
from fleet_core import cost_model
from fleet_core.tokens import count_tokens

MODEL = "llama-3.1-8b"
TEXT = "".join(f"word{i} " for i in range(2000))[:12_800]  # 3,200 tokens: 100 blocks
P = 3200


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}


# ---------------------------------------------------------------------------------------------
# Hashing


def test_text_blocks_are_the_whole_blocks_chained() -> None:
    blocks = text_blocks(TEXT)
    assert len(blocks) == count_tokens(TEXT) // BLOCK_TOKENS == 100
    assert blocks == text_blocks(TEXT)  # deterministic (not Python's salted hash)
    assert len(set(blocks)) == len(blocks)
    # A prompt that differs only in block 10 shares blocks 0-9 and none after (chained)
    width = BLOCK_TOKENS * 4
    edited = TEXT[: 10 * width + 5] + "X" + TEXT[10 * width + 6 :]
    other = text_blocks(edited)
    assert other[:10] == blocks[:10]
    assert not set(other[10:]) & set(blocks)
    assert text_blocks("short") == ()
    assert len(text_blocks(TEXT[: width - 1])) == 1  # ⌈127 / 4⌉ = 32 tokens: one whole block


def test_the_block_count_is_the_stand_ins() -> None:
    """The stand-in engine hashes prompt_tokens // tokens_per_block blocks of 4 × 32 characters
    (fleet_agent/engine/core.py): the router's boundaries are the same."""
    shape = cost_model.EngineShape(
        gpu=cost_model.gpu_spec("H100"), model=cost_model.model_spec("llama-3.1-8b")
    )
    core = EngineCore(CoreConfig(shape=shape))
    for n in (0, 127, 128, 129, 4000, len(TEXT)):
        prompt = TEXT[:n]
        engine = core._prompt_block_hashes(prompt, count_tokens(prompt))
        assert len(text_blocks(prompt)) == len(engine)


def test_a_follow_up_turn_starts_with_the_previous_turns_blocks() -> None:
    first = chat(("system", "You are terse."), ("user", TEXT[:3000]))
    answer = " ".join(["ok"] * 400)
    second = chat(
        ("system", "You are terse."),
        ("user", TEXT[:3000]),
        ("assistant", answer),
        ("user", "and then?"),
    )
    a, b = request_blocks(first, chat=True), request_blocks(second, chat=True)
    assert a and len(b) > len(a)
    assert b[: len(a)] == a
    # The completions endpoint: the prompt text as is
    assert request_blocks({"prompt": TEXT}, chat=False) == text_blocks(TEXT)


def test_token_prompts_and_batches() -> None:
    ids = list(range(100))
    assert len(token_blocks(ids)) == 3
    assert request_blocks({"prompt": ids}, chat=False) == token_blocks(ids)
    assert token_blocks(ids[:64] + [7] * 36)[:2] == token_blocks(ids)[:2]
    assert request_blocks({"prompt": ["a" * 500, "b" * 500]}, chat=False) == ()
    assert request_blocks({"messages": "nonsense"}, chat=True) == ()


# ---------------------------------------------------------------------------------------------
# The index


def test_the_index_credits_leading_blocks_only_and_leaves_a_token_to_compute() -> None:
    index = PrefixIndex()
    blocks = text_blocks(TEXT)
    assert index.cached(blocks, P) == 0.0
    index.insert(blocks[:40], 40 * BLOCK_TOKENS + 5)
    assert index.leading(blocks) == 40
    assert index.cached(blocks, P) == 40 * BLOCK_TOKENS
    # All 40 blocks held, but the prompt is exactly 40 blocks: the last block is computed
    assert index.cached(blocks[:40], 40 * BLOCK_TOKENS) == 39 * BLOCK_TOKENS
    # A gap: blocks after it do not count
    other = PrefixIndex()
    other.insert(blocks[1:], P)
    assert other.cached(blocks, P) == 0.0
    assert index.cached((), 100) == 0.0


def test_the_index_is_bounded_and_drops_the_least_recently_booked() -> None:
    index = PrefixIndex(capacity=100)
    a = text_blocks(TEXT)[:60]
    b = text_blocks("b" + TEXT)[:60]
    index.insert(a, 60 * BLOCK_TOKENS + 1)
    index.insert(b, 60 * BLOCK_TOKENS + 1)
    assert len(index) == 100
    # The oldest 20 of a went: a's head is gone, so a has no prefix left
    assert index.leading(a) == 0 and index.leading(b) == 60
    index.insert(a[:10], 10 * BLOCK_TOKENS + 1)  # a's head again: now the most recent
    assert index.leading(a) == 10 and len(index) == 100
    # To make room, the oldest went: a[20:30] (b, booked later, stays whole)
    assert index.leading(b) == 60
    assert not set(a[20:30]) & set(index.blocks) and set(a[30:]) <= set(index.blocks)


def test_the_engines_hit_rate_discounts_an_index_that_over_promises() -> None:
    index = PrefixIndex()
    blocks = text_blocks(TEXT)
    index.insert(blocks, P)
    assert index.trust() == 1.0
    # Book the same prompt until the index has promised enough to be judged (the first
    # booking, which found nothing, fades: DECAY per booking)
    for _ in range(300):
        index.insert(blocks, P)
    assert index.looked_up >= MIN_PROMISED
    promised = index.promised / index.looked_up
    assert 0.9 < promised <= 1.0
    index.engine_rate = None
    assert index.trust() == 1.0  # no figure: trusted
    index.engine_rate = promised / 2  # the engine finds half of what the index promises
    assert index.trust() == pytest.approx(0.5)
    assert index.cached(blocks, P) == pytest.approx(0.5 * 99 * BLOCK_TOKENS)
    index.engine_rate = 0.0  # block reuse off in the engine: no credit at all
    assert index.cached(blocks, P) == 0.0
    index.engine_rate = 1.0  # it hits more than promised (another router's requests): 1
    assert index.trust() == 1.0
    view = index.view()
    assert view["blocks"] == 100 and view["trust"] == 1.0 and view["engine_hit_rate"] == 1.0


def test_apply_agent_state_reads_the_engines_hit_rate() -> None:
    r = Replica(url="http://e0")
    row = {"url": "http://e0", "state": "ready", "cache_hit_rate": 0.42}
    apply_agent_state([r], {"ready": True, "replicas": [row]})
    assert r.prefix.engine_rate == 0.42
    apply_agent_state([r], {"ready": True, "replicas": [{"url": "http://e0", "state": "ready"}]})
    assert r.prefix.engine_rate is None


def test_index_capacity_is_the_engines_kv_capacity() -> None:
    h200 = cost_model.EngineShape(
        gpu=cost_model.gpu_spec("H200"), model=cost_model.guess_model("s3://m/llama-3.1-8b")
    )
    assert index_capacity("H200", "s3://m/llama-3.1-8b") == cost_model.kv_capacity_blocks(h200)
    assert index_capacity("H200", "x") > index_capacity("L40S", "x")
    assert index_capacity("TPU-v9", "x") == DEFAULT_CAPACITY


# ---------------------------------------------------------------------------------------------
# The strategy


def fleet(n: int = 3, **fields: Any) -> list[Replica]:
    return [
        Replica(url=f"http://e{i}", models=frozenset({"m"}), capacity=3000.0, **fields)
        for i in range(n)
    ]


def turn(prompt: str = TEXT, output: float = 100.0) -> Request:
    return Request("m", count_tokens(prompt), output, text_blocks(prompt))


def test_prefix_aware_goes_where_the_prefix_is_cached() -> None:
    rs = fleet()
    request = turn()
    rs[2].prefix.insert(request.blocks[:80], request.prompt_tokens)
    aware = prefix_aware()
    assert {aware.choose(rs, request, 0.0).url for _ in range(6)} == {"http://e2"}  # type: ignore[union-attr]
    # Without prefix awareness the tie goes round
    ect = estimated_completion_time()
    assert {ect.choose(rs, request, 0.0).url for _ in range(6)} == {r.url for r in rs}  # type: ignore[union-attr]


def test_a_loaded_or_slow_replica_loses_its_prefix() -> None:
    """The cached replica's estimate counts only the prefill left (3,168 of 3,200 tokens
    cached: 580 - 3,168 × 0.15 = 105 work units); the credit beyond it, 3,168 × 2 × 0.15 work
    units at the fastest candidate's 3,000 a second (0.32 s), comes off the whole estimate. The
    others: max(580 / 3000, 580 / 400) = 1.45 s."""
    request = turn()
    rs = fleet(stream_rate=400.0)
    rs[2].prefix.insert(request.blocks, request.prompt_tokens)
    aware = prefix_aware()
    # Loaded: (6,000 + 105) / 3000 - 0.32 = 1.72 s
    rs[2].output_left = 6000.0
    assert aware.choose(rs, request, 0.0) is not rs[2]
    # Some queued work: the cached replica still wins ((2,000 + 105) / 3000 - 0.32 = 0.38 s)
    rs[2].output_left = 2000.0
    assert aware.choose(rs, request, 0.0) is rs[2]
    # Slow: an eighth of the others' speed, alone it takes 105 / 50 = 2.1 s (1.78 s credited)
    rs[2].output_left = 0.0
    rs[2].capacity, rs[2].stream_rate = 375.0, 50.0
    assert aware.choose(rs, request, 0.0) is not rs[2]
    # A quarter of their speed (an L40S against H200s): the prefix still pays (1.05 - 0.32 s)
    rs[2].capacity, rs[2].stream_rate = 750.0, 100.0
    assert aware.choose(rs, request, 0.0) is rs[2]
    # Full: never chosen
    rs[2].inflight = rs[2].limit
    assert aware.choose(rs, request, 0.0) is not rs[2]


def test_the_credit_holds_where_the_replicas_own_time_bounds_it() -> None:
    """An idle replica's estimate is its own time (its decode at its batch's pace), not its
    queue. The credit comes off the whole estimate, so an idle H100 holding a conversation's
    3,200-token history keeps the next turn against an H200 with four streams, although it
    decodes slower (1.16 s against 1.06 s): the credit, 2 × 0.15 work units a cached token
    beyond the prefill skipped at the fastest candidate's 5,000 a second, is 0.19 s. Before,
    only the queue view took it and the turn went to the H200 to be prefilled again. An idle
    L40S (3.4 s to decode it) loses the turn all the same."""
    history = TEXT
    text = history + "x" * 1600
    request = Request(MODEL, count_tokens(text), 261.0, text_blocks(text))

    def replica(gpu: str, streams: int = 0) -> Replica:
        r = Replica(url=f"http://{gpu}", gpu_model=gpu, limit=16, capacity=5000.0)
        r.inflight, r.prompt_inflight, r.output_left = streams, streams * 4000, streams * 130.0
        r.iter_s, r.token_s, r.kv_s = iteration_costs(gpu, MODEL)
        return r

    busy_h200 = replica("H200", streams=4)
    for gpu, keeps in [("H100", True), ("L40S", False)]:
        cached = replica(gpu)
        cached.prefix.insert(text_blocks(history), count_tokens(history))
        assert completion_time(cached, request) > completion_time(busy_h200, request)
        chosen = prefix_aware().choose([busy_h200, cached], request, 0.0)
        assert (chosen is cached) is keeps, gpu
        assert estimated_completion_time().choose([busy_h200, cached], request, 0.0) is busy_h200


def test_the_credit_weight() -> None:
    """Credit 1 prices a cached token at the prefill it skips: a backlog of 1,000 units
    (0.33 s) outweighs its 475 units (0.16 s); at the default (PREFIX_CREDIT) the conversation
    stays."""
    request = turn()
    rs = fleet()
    rs[2].prefix.insert(request.blocks, request.prompt_tokens)
    rs[2].output_left = 1000.0
    assert prefix_aware().choose(rs, request, 0.0) is rs[2]
    plain = prefix_aware()
    plain.prefix_credit = 1.0
    assert plain.choose(rs, request, 0.0) is not rs[2]
    assert PREFIX_CREDIT > 1.0


def test_strategy_names_and_the_default() -> None:
    assert "prefix_aware" in STRATEGIES and "estimated_completion_time" in STRATEGIES
    assert credits_prefix(make("prefix_aware"))
    assert credits_prefix(make(DEFAULT_STRATEGY))
    assert isinstance(make(DEFAULT_STRATEGY), ModelAffinity)
    assert not credits_prefix(make("estimated_completion_time"))
    assert not credits_prefix(make("least_pending"))


# ---------------------------------------------------------------------------------------------
# The pool's books


def pool(strategy: str) -> DeploymentPool:
    p = DeploymentPool("d", make(strategy), AdmissionQueue(8))
    for r in fleet(2):
        p.replicas[r.url] = r
        p.throughput[r.url] = Throughput(r.capacity)
    return p


def test_booking_inserts_the_blocks_and_books_the_uncached_prefill() -> None:
    p = pool("prefix_aware")
    request = turn()
    first = p._book(p.replicas["http://e0"], request)
    e0 = p.replicas["http://e0"]
    assert first.booked == request.prompt_tokens == e0.prompt_inflight
    assert e0.prefix.leading(request.blocks) == len(request.blocks)
    second = p._book(e0, request)  # the same prompt again: all but the last block cached
    assert second.booked == request.prompt_tokens - 99 * BLOCK_TOKENS
    assert e0.prompt_inflight == first.booked + second.booked
    p.release(second, output_tokens=100, ok=True, failed=False)
    p.release(first, output_tokens=100, ok=True, failed=False)
    assert e0.prompt_inflight == 0 and e0.inflight == 0


def test_without_prefix_awareness_the_books_hold_the_whole_prompt() -> None:
    p = pool("estimated_completion_time")
    request = turn()
    e0 = p.replicas["http://e0"]
    tickets = [p._book(e0, request) for _ in range(2)]
    assert [t.booked for t in tickets] == [request.prompt_tokens] * 2
    assert e0.prefix.leading(request.blocks) == len(request.blocks)  # indexed all the same
    for t in tickets:
        p.release(t, output_tokens=100, ok=True, failed=False)
    assert e0.prompt_inflight == 0
