"""The stand-in engine's continuous batching, driven step by step on its simulated clock."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from fleet_agent.engine.core import (
    CoreConfig,
    EngineCore,
    Finished,
    GenerationRequest,
    IterationResult,
    RequestRejected,
    natural_output_tokens,
)
from fleet_core import cost_model as cm
from fleet_core.tokens import count_tokens


def make_core(
    *,
    gpu: str = "H100",
    max_batch_size: int = 64,
    max_num_tokens: int = 8192,
    fraction: float = 0.9,
    **config: Any,
) -> EngineCore:
    shape = cm.EngineShape(
        gpu=cm.gpu_spec(gpu),
        model=cm.model_spec("llama-3.1-8b"),
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        kv_cache_free_gpu_memory_fraction=fraction,
    )
    return EngineCore(CoreConfig(shape=shape, **config))


def prompt_of(tokens: int, tag: str = "") -> str:
    """A prompt of exactly `tokens` tokens (4 characters each), distinct per tag."""
    text = (f"{tag}:" + "abcd" * tokens)[: tokens * 4]
    assert count_tokens(text) == tokens
    return text


def run(core: EngineCore, limit: int = 100_000) -> Iterator[IterationResult]:
    for _ in range(limit):
        if not core.has_work():
            return
        yield core.step()
    raise AssertionError("engine did not drain")


def finish_all(core: EngineCore) -> dict[str, tuple[Finished, str]]:
    texts: dict[str, list[str]] = {}
    done: dict[str, tuple[Finished, str]] = {}
    for result in run(core):
        for tok in result.tokens:
            texts.setdefault(tok.request_id, []).append(tok.text)
        for f in result.finished:
            done[f.request_id] = (f, "".join(texts[f.request_id]))
    return done


def long_prompt(min_natural: int, seed: str = "0/None") -> str:
    """A prompt whose natural output is at least `min_natural` tokens."""
    for i in range(10_000):
        p = f"prompt number {i}"
        if natural_output_tokens(p, seed) >= min_natural:
            return p
    raise AssertionError("no such prompt")


def test_requests_prefill_together_then_decode_together() -> None:
    core = make_core()
    for i in range(3):
        core.add_request(GenerationRequest(f"r{i}", prompt_of(100, str(i)), max_tokens=5))
    first = core.step()
    assert dict(first.prefill) == {"r0": 100, "r1": 100, "r2": 100}
    assert first.decoded == ()
    assert [t.index for t in first.tokens] == [0, 0, 0]  # prefill yields the first token
    second = core.step()
    assert second.prefill == ()
    assert set(second.decoded) == {"r0", "r1", "r2"}
    ifb = second.stats["inflightBatchingStats"]
    assert (ifb["numGenRequests"], ifb["numContextRequests"], ifb["numCtxTokens"]) == (3, 0, 0)
    assert first.duration_s == pytest.approx(
        cm.iteration_seconds(core.shape, 0, 300, 300)
    )  # three 100-token contexts
    assert second.duration_s == pytest.approx(cm.iteration_seconds(core.shape, 3, 0, 303))
    done = finish_all(core)
    assert {f.completion_tokens for f, _ in done.values()} == {5}


def test_max_batch_size_bounds_the_running_set() -> None:
    core = make_core(max_batch_size=2)
    for i in range(5):
        core.add_request(GenerationRequest(f"r{i}", prompt_of(40, str(i)), max_tokens=3))
    result = core.step()
    assert result.stats["numActiveRequests"] == 2
    assert result.stats["numQueuedRequests"] == 3
    assert result.stats["maxNumActiveRequests"] == 2
    peak = max(r.stats["numActiveRequests"] for r in run(core))
    assert peak == 2
    assert core.num_active == core.num_waiting == 0


def test_max_num_tokens_bounds_an_iteration_without_chunking() -> None:
    core = make_core(max_num_tokens=512)
    for i in range(3):
        core.add_request(GenerationRequest(f"r{i}", prompt_of(300, str(i)), max_tokens=4))
    results = list(run(core))
    for r in results:
        assert r.stats["inflightBatchingStats"]["numCtxTokens"] + len(r.decoded) <= 512
    # One 300-token prompt per iteration: 300 + 300 > 512.
    assert [dict(r.prefill) for r in results[:3]] == [{"r0": 300}, {"r1": 300}, {"r2": 300}]
    with pytest.raises(RequestRejected, match="max_num_tokens"):
        core.add_request(GenerationRequest("big", prompt_of(600), max_tokens=4))


def test_chunked_prefill_splits_long_prompts_on_block_boundaries() -> None:
    core = make_core(max_num_tokens=256, enable_chunked_prefill=True)
    core.add_request(GenerationRequest("long", prompt_of(1000), max_tokens=2))
    chunks = []
    first_token_at = None
    for r in run(core):
        chunks += [n for rid, n in r.prefill if rid == "long"]
        if first_token_at is None and r.tokens:
            first_token_at = r.iteration
    assert chunks == [256, 256, 256, 232]
    assert first_token_at == 4  # with the last chunk

    # Decodes take their share of the budget first; the chunk is what is left, block-aligned.
    core = make_core(max_num_tokens=256, enable_chunked_prefill=True)
    for i in range(10):
        core.add_request(GenerationRequest(f"d{i}", prompt_of(20, str(i)), max_tokens=50))
    core.step()
    core.add_request(GenerationRequest("long", prompt_of(1000), max_tokens=2))
    r = core.step()
    assert len(r.decoded) == 10
    assert dict(r.prefill) == {"long": 224}  # 256 - 10 = 246 → 7 blocks


def test_kv_admission_reserves_prompt_plus_max_tokens() -> None:
    core = make_core(fraction=0.002)  # a small cache: a few hundred blocks
    blocks = core.max_blocks
    per_request = 8  # 128 prompt + 128 max_tokens = 256 tokens = 8 blocks
    fit = blocks // per_request
    for i in range(fit + 5):
        core.add_request(GenerationRequest(f"r{i}", prompt_of(128, str(i)), max_tokens=128))
    first = core.step()
    assert core.num_active == fit
    assert first.stats["numQueuedRequests"] == 5
    kv = first.stats["kvCacheStats"]
    # Blocks are allocated as tokens arrive, reserved up front: used < reserved.
    assert kv["usedNumBlocks"] == fit * 5  # 128 prompt tokens + 1 generated = 5 blocks
    assert kv["freeNumBlocks"] == blocks - kv["usedNumBlocks"]
    assert core.reserved_blocks == fit * per_request
    # Back-pressure: the queue moves only as requests finish and release their reservation.
    admitted_while_full = [
        r.stats["numNewActiveRequests"] for r in run(core) if r.stats["numQueuedRequests"] == 5
    ]
    assert sum(admitted_while_full) == 0
    assert core.num_waiting == 0


def test_requests_that_can_never_run_are_rejected() -> None:
    core = make_core(fraction=0.002, max_seq_len=131_072)  # a --max_seq_len beyond the cache
    with pytest.raises(RequestRejected, match="KV blocks"):
        core.add_request(GenerationRequest("huge", prompt_of(100), max_tokens=core.max_blocks * 32))
    core = make_core(max_seq_len=1000)
    with pytest.raises(RequestRejected, match="max_seq_len"):
        core.add_request(GenerationRequest("long", prompt_of(900), max_tokens=200))
    with pytest.raises(RequestRejected):
        core.add_request(GenerationRequest("zero", "hi", max_tokens=0))
    # Without max_tokens a request may write up to max_seq_len and reserves KV for all of it.
    core.add_request(GenerationRequest("open", prompt_of(100)))
    core.step()
    assert core.reserved_blocks == 1000 // 32 + 1


def test_default_max_seq_len_is_the_model_context_within_the_cache() -> None:
    assert make_core().max_seq_len == 131_072
    small = make_core(fraction=0.002)
    assert small.max_seq_len == small.max_blocks * 32


def test_output_is_deterministic_for_prompt_and_seed() -> None:
    def texts(engine_seed: int, request_seed: int | None) -> dict[str, str]:
        core = make_core(seed=engine_seed)
        for i in range(4):
            core.add_request(
                GenerationRequest(f"r{i}", f"question {i}?", max_tokens=2000, seed=request_seed)
            )
        return {rid: text for rid, (_, text) in finish_all(core).items()}

    base = texts(0, None)
    assert base == texts(0, None)
    assert base != texts(1, None)
    assert base != texts(0, 7)
    assert all(t.startswith(" ") and len(t.split()) >= 16 for t in base.values())


def test_natural_length_is_realistic_and_capped_by_max_tokens() -> None:
    lengths = [natural_output_tokens(f"p{i}", "0/None") for i in range(1000)]
    assert min(lengths) >= 16 and max(lengths) <= 1024
    assert 90 <= statistics.median(lengths) <= 180
    assert len(set(lengths)) > 300

    prompt = long_prompt(200)
    core = make_core()
    core.add_request(GenerationRequest("capped", prompt, max_tokens=50))
    core.add_request(GenerationRequest("free", prompt + "!", max_tokens=1024))
    core.add_request(GenerationRequest("eos", prompt + "?", max_tokens=300, ignore_eos=True))
    done = finish_all(core)
    capped, text = done["capped"]
    assert (capped.finish_reason, capped.completion_tokens) == ("length", 50)
    assert len(text.split()) == 50
    free = done["free"][0]
    assert free.finish_reason == "stop"
    assert free.completion_tokens == natural_output_tokens(prompt + "!", "0/None")
    eos = done["eos"][0]
    assert (eos.finish_reason, eos.completion_tokens) == ("length", 300)


def test_stop_string_ends_the_output() -> None:
    prompt = long_prompt(100)
    core = make_core()
    core.add_request(GenerationRequest("full", prompt, max_tokens=100))
    full_text = finish_all(core)["full"][1]
    words = full_text.split()
    stop_word = words[10]
    first = words.index(stop_word)
    core = make_core()
    core.add_request(GenerationRequest("stopped", prompt, max_tokens=100, stop=(stop_word,)))
    finished, text = finish_all(core)["stopped"]
    assert finished.finish_reason == "stop"
    assert finished.completion_tokens == first + 1
    assert stop_word not in text.split()
    assert text.split() == words[:first]


def test_prefix_blocks_are_reused() -> None:
    core = make_core()
    shared = prompt_of(320, "system")
    core.add_request(GenerationRequest("a", shared + "first question", max_tokens=2))
    list(run(core))
    core.add_request(GenerationRequest("b", shared + "second question", max_tokens=2))
    r = core.step()
    kv = r.stats["kvCacheStats"]
    assert kv["reusedBlocks"] == 10  # 320 shared tokens = 10 whole blocks
    assert dict(r.prefill)["b"] == count_tokens(shared + "second question") - 320
    assert kv["missedBlocks"] == 10  # a's blocks, the first time round
    assert kv["cacheHitRate"] == pytest.approx(0.5)
    assert kv["allocTotalBlocks"] == kv["allocNewBlocks"] + kv["reusedBlocks"]
    finished = finish_all(core)["b"][0]
    assert finished.cached_prompt_tokens == 320

    off = make_core(enable_block_reuse=False)
    off.add_request(GenerationRequest("a", shared, max_tokens=2))
    list(run(off))
    off.add_request(GenerationRequest("b", shared, max_tokens=2))
    assert dict(off.step().prefill)["b"] == 320


def test_abort_frees_blocks() -> None:
    core = make_core()
    core.add_request(GenerationRequest("a", prompt_of(256), max_tokens=500))
    core.add_request(GenerationRequest("b", prompt_of(256, "b"), max_tokens=500))
    core.step()
    assert core.used_blocks > 0
    assert core.abort("a") and core.abort("b")
    assert not core.abort("a")
    assert core.used_blocks == 0 and not core.has_work()
    with pytest.raises(RuntimeError):
        core.step()

    queued = make_core(max_batch_size=1)
    queued.add_request(GenerationRequest("a", "first", max_tokens=5))
    queued.add_request(GenerationRequest("b", "second", max_tokens=5))
    queued.step()
    assert queued.num_waiting == 1 and queued.abort("b") and queued.num_waiting == 0
    queued.add_request(GenerationRequest("b", "again", max_tokens=5))  # the id is free again


def test_iteration_stats_have_tensorrt_llm_fields() -> None:
    core = make_core()
    core.add_request(GenerationRequest("a", "Where is New York?", max_tokens=3))
    results = list(run(core))
    assert [r.stats["iter"] for r in results] == [1, 2, 3]
    for r in results:
        s = r.stats
        assert {
            "iter",
            "iterLatencyMS",
            "numActiveRequests",
            "numQueuedRequests",
            "numCompletedRequests",
            "maxNumActiveRequests",
            "gpuMemUsage",
            "cpuMemUsage",
            "kvCacheStats",
            "inflightBatchingStats",
            "timestamp",
        } <= s.keys()
        assert set(s["kvCacheStats"]) == {
            "maxNumBlocks",
            "freeNumBlocks",
            "usedNumBlocks",
            "tokensPerBlock",
            "allocTotalBlocks",
            "allocNewBlocks",
            "reusedBlocks",
            "missedBlocks",
            "cacheHitRate",
        }
        assert set(s["inflightBatchingStats"]) == {
            "numScheduledRequests",
            "numContextRequests",
            "numGenRequests",
            "numPausedRequests",
            "numCtxTokens",
            "microBatchId",
            "avgNumDecodedTokensPerIter",
        }
        assert s["iterLatencyMS"] == pytest.approx(r.duration_s * 1e3)
        assert re.fullmatch(r"\d\d-\d\d-\d{4} \d\d:\d\d:\d\d", s["timestamp"])
        assert s["gpuMemUsage"] == cm.gpu_memory_used_bytes(core.shape)
        assert s["kvCacheStats"]["tokensPerBlock"] == 32
    assert [r.stats["numCompletedRequests"] for r in results] == [0, 0, 1]
    assert results[-1].stats["kvCacheStats"]["usedNumBlocks"] == 0


def test_simulated_clock_and_request_times() -> None:
    core = make_core()
    core.add_request(GenerationRequest("a", prompt_of(64), max_tokens=10))
    total = 0.0
    for r in run(core):
        total += r.duration_s
        if r.finished:
            f = r.finished[0]
    assert core.now() == pytest.approx(total)
    assert f.arrival_time == 0.0 == f.first_scheduled_time
    assert 0 < f.first_token_time < f.finish_time == pytest.approx(total)

    ticks = iter([100.0, 100.5, 101.0])
    timed = EngineCore(core.config, clock=lambda: next(ticks))
    timed.add_request(GenerationRequest("a", "hi", max_tokens=1))  # arrives at 100.0
    r = timed.step()  # starts at 100.5
    f = r.finished[0]
    assert (f.arrival_time, f.first_scheduled_time) == (100.0, 100.5)
    assert f.finish_time == pytest.approx(100.5 + r.duration_s)


def test_duplicate_request_ids_are_refused() -> None:
    core = make_core()
    core.add_request(GenerationRequest("a", "hi", max_tokens=1))
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request(GenerationRequest("a", "hi", max_tokens=1))
