"""EngineCore's priority scheduling and preemption (the vLLM and SGLang dialects' policies),
driven step by step on its simulated clock; the defaults stay trtllm-serve's."""

from __future__ import annotations

from typing import Any

from fleet_agent.engine.core import (
    CoreConfig,
    EngineCore,
    Finished,
    GenerationRequest,
    IterationResult,
)
from fleet_core import cost_model as cm


def make_core(*, max_batch_size: int = 8, **config: Any) -> EngineCore:
    shape = cm.EngineShape(
        gpu=cm.gpu_spec("H100"),
        model=cm.model_spec("llama-3.1-8b"),
        max_batch_size=max_batch_size,
        max_num_tokens=8192,
    )
    return EngineCore(CoreConfig(shape=shape, **config))


def prompt_of(tokens: int, tag: str) -> str:
    return (f"{tag}:" + "abcd" * tokens)[: tokens * 4]


def request(rid: str, tokens: int = 60, out: int = 100, priority: int = 0) -> GenerationRequest:
    return GenerationRequest(
        rid, prompt_of(tokens, rid), max_tokens=out, ignore_eos=True, priority=priority
    )


def drain(core: EngineCore) -> tuple[list[IterationResult], dict[str, Finished], dict[str, str]]:
    results: list[IterationResult] = []
    done: dict[str, Finished] = {}
    texts: dict[str, list[str]] = {}
    for _ in range(100_000):
        if not core.has_work():
            break
        result = core.step()
        results.append(result)
        for tok in result.tokens:
            texts.setdefault(tok.request_id, []).append(tok.text)
        done.update((f.request_id, f) for f in result.finished)
    assert not core.has_work(), "engine did not drain"
    assert core.used_blocks == 0  # every block held came back
    return results, done, {rid: "".join(parts) for rid, parts in texts.items()}


def first_token_order(results: list[IterationResult]) -> list[str]:
    return [t.request_id for r in results for t in r.tokens if t.index == 0]


def queue_behind_a_runner(core: EngineCore) -> None:
    """One request running, three batch requests queued, then an interactive one."""
    core.add_request(request("running", out=20))
    core.step()
    for i in range(3):
        core.add_request(request(f"batch{i}", out=20, priority=10))
    core.add_request(request("interactive", out=20, priority=0))


def test_default_is_first_come_first_served_and_never_preempts() -> None:
    core = make_core(max_batch_size=1)
    assert core.config.policy == "fcfs" and core.config.kv_policy == "reserve"
    queue_behind_a_runner(core)
    results, done, _ = drain(core)
    assert first_token_order(results) == ["batch0", "batch1", "batch2", "interactive"]
    assert core.num_preemptions == 0 and len(done) == 5
    assert all(r.stats["inflightBatchingStats"]["numPausedRequests"] == 0 for r in results)


def test_priority_policy_admits_the_lowest_priority_value_first() -> None:
    core = make_core(max_batch_size=1, policy="priority")
    queue_behind_a_runner(core)
    results, _, _ = drain(core)
    # The interactive request arrived last and starts first; equal priorities keep arrival order.
    assert first_token_order(results) == ["interactive", "batch0", "batch1", "batch2"]
    assert core.num_preemptions == 0


def test_reserve_policy_holds_prompt_plus_max_tokens_and_waits() -> None:
    # Room for 2 reservations of ceil((60 + 100) / 32) = 5 blocks: the third waits, nobody is
    # preempted even though allocated blocks stay far below the pool.
    core = make_core(kv_capacity_tokens=32 * 11)
    for i in range(3):
        core.add_request(request(f"r{i}"))
    core.step()
    assert core.num_active == 2 and core.num_waiting == 1
    _, done, _ = drain(core)
    assert len(done) == 3 and core.num_preemptions == 0


def test_preempt_policy_admits_on_prompt_blocks_and_preempts_the_newest() -> None:
    # 4 requests of 60 prompt tokens need 2 blocks each to start (prompt + first token) in a
    # pool of 12: all start, and as they grow the newest ones are preempted.
    core = make_core(kv_policy="preempt", kv_capacity_tokens=32 * 12)
    for i in range(4):
        core.add_request(request(f"r{i}"))
    first = core.step()
    assert core.num_active == 4 and first.preempted == ()
    results, done, _ = drain(core)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and preempted[0] == "r3"  # the newest running request goes first
    assert core.num_preemptions == len(preempted)
    assert sum(r.stats["inflightBatchingStats"]["numPausedRequests"] for r in results) == len(
        preempted
    )
    assert all(r.stats["kvCacheStats"]["usedNumBlocks"] <= 12 for r in results)
    assert {rid: f.completion_tokens for rid, f in done.items()} == {f"r{i}": 100 for i in range(4)}


def test_a_preempted_request_recomputes_and_writes_the_same_text() -> None:
    # Without prefix reuse, so that the resumed prefill is the whole sequence.
    roomy = make_core(kv_policy="preempt", enable_block_reuse=False)
    tight = make_core(kv_policy="preempt", kv_capacity_tokens=32 * 12, enable_block_reuse=False)
    for core in (roomy, tight):
        for i in range(4):
            core.add_request(request(f"r{i}"))
    _, _, expected = drain(roomy)
    results, done, texts = drain(tight)
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert texts == expected  # nothing lost, nothing repeated
    # Resumed, it prefills its prompt and every token it had written, in one iteration here.
    victim = next(rid for r in results for rid in r.preempted)
    at = next(i for i, r in enumerate(results) if victim in r.preempted)
    written = sum(1 for r in results[: at + 1] for t in r.tokens if t.request_id == victim)
    later = results[at + 1 :]
    resumed = next(dict(r.prefill)[victim] for r in later if victim in dict(r.prefill))
    assert resumed == 60 + written
    assert done[victim].completion_tokens == 100


def test_preemption_under_priority_takes_the_lowest_priority_request() -> None:
    core = make_core(policy="priority", kv_policy="preempt", kv_capacity_tokens=32 * 12)
    core.add_request(request("batch-old", priority=10))
    core.add_request(request("batch-new", priority=10))
    core.add_request(request("urgent-a", priority=0))
    core.add_request(request("urgent-b", priority=0))
    results, done, _ = drain(core)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted[0] == "batch-new"  # largest (priority, arrival), not the newest arrival
    assert not {"urgent-a", "urgent-b"} & set(preempted[:2])
    assert len(done) == 4


def test_no_admission_in_an_iteration_that_preempted() -> None:
    core = make_core(kv_policy="preempt", kv_capacity_tokens=32 * 12)
    for i in range(4):
        core.add_request(request(f"r{i}"))
    for _ in range(10_000):
        if not core.has_work():
            break
        waiting = core.num_waiting
        result = core.step()
        if result.preempted:
            assert result.stats["numNewActiveRequests"] == 0
            assert core.num_waiting == waiting + len(result.preempted)


def test_a_waiting_request_preempts_one_worse_by_more_than_the_threshold() -> None:
    def run(threshold: int | None) -> tuple[list[str], int]:
        core = make_core(
            max_batch_size=1,
            policy="priority",
            kv_policy="preempt",
            priority_preemption_threshold=threshold,
        )
        core.add_request(request("batch", out=50, priority=20))
        core.step()
        core.add_request(request("interactive", out=5, priority=0))
        results, done, _ = drain(core)
        assert done["batch"].completion_tokens == 50
        return [f.request_id for r in results for f in r.finished], core.num_preemptions

    assert run(10) == (["interactive", "batch"], 1)
    assert run(20) == (["batch", "interactive"], 0)  # a difference of exactly 20 is not enough
    assert run(None) == (["batch", "interactive"], 0)


def test_abort_frees_held_blocks() -> None:
    core = make_core(kv_policy="preempt")
    core.add_request(request("a"))
    core.add_request(request("b"))
    core.step()
    held = core.used_blocks
    assert held == 2 * 2 and core.abort("a") and core.used_blocks == held - 2


def test_abort_works_in_the_priority_queue() -> None:
    core = make_core(max_batch_size=1, policy="priority")
    queue_behind_a_runner(core)
    assert core.abort("interactive") and core.abort("batch1")
    assert core.num_waiting == 2
    results, _, _ = drain(core)
    assert first_token_order(results) == ["batch0", "batch2"]


def test_a_preempted_request_longer_than_the_token_budget_still_runs() -> None:
    """Without chunked prefill, a preempted request's recompute (prompt + what it wrote) may
    outgrow max_num_tokens; alone, it runs whole instead of stalling the engine."""
    shape = cm.EngineShape(
        gpu=cm.gpu_spec("H100"),
        model=cm.model_spec("llama-3.1-8b"),
        max_batch_size=8,
        max_num_tokens=512,
    )
    core = EngineCore(
        CoreConfig(
            shape=shape,
            kv_policy="preempt",
            enable_chunked_prefill=False,
            enable_block_reuse=False,
            kv_capacity_tokens=40 * 32,
        )
    )
    core.add_request(request("a", tokens=500, out=600))
    core.add_request(request("b", tokens=500, out=600))
    _, done, texts = drain(core)
    assert set(done) == {"a", "b"} and core.num_preemptions >= 1
    assert all(len(texts[r].split()) == 600 for r in ("a", "b"))
