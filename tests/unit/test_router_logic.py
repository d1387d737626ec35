"""The router's pure parts: strategies, the waiting room, the estimates, the books of a pool,
the agent's /state onto replicas, and prompt token counts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleet.router.admission import AdmissionQueue
from fleet.router.discovery import apply_agent_state
from fleet.router.estimates import OutputEstimate, Throughput, prior_capacity
from fleet.router.pool import DeploymentPool, NoReplica, QueueFull
from fleet.router.strategy import (
    STRATEGIES,
    ModelAffinity,
    Replica,
    Request,
    RoundRobin,
    completion_time,
    estimated_completion_time,
    least_kv,
    least_pending,
    make,
)
from fleet.router.tokens import max_output, prompt_tokens
from fleet_core.tokens import count_tokens

SMALL = Request("m", prompt_tokens=100, expected_output=50)


def replicas(n: int, **fields: object) -> list[Replica]:
    return [Replica(url=f"http://e{i}", models=frozenset({"m"}), **fields) for i in range(n)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Strategies


def test_round_robin_takes_turns_and_skips_what_is_unavailable() -> None:
    rs = replicas(3)
    rr = RoundRobin()
    assert [rr.choose(rs, SMALL, 0.0).url for _ in range(4)] == [  # type: ignore[union-attr]
        "http://e0",
        "http://e1",
        "http://e2",
        "http://e0",
    ]
    rs[1].ready = False
    rs[2].inflight = rs[2].limit
    assert {rr.choose(rs, SMALL, 0.0).url for _ in range(3)} == {"http://e0"}  # type: ignore[union-attr]
    rs[0].ejected_until = 10.0
    assert rr.choose(rs, SMALL, 5.0) is None
    assert rr.choose(rs, SMALL, 10.0) is rs[0]
    assert rr.choose([], SMALL, 0.0) is None


def test_least_pending_counts_the_routers_own_in_flight_then_the_engine_queue() -> None:
    rs = replicas(3)
    rs[0].inflight, rs[1].inflight, rs[2].inflight = 4, 2, 2
    rs[1].queued, rs[2].queued = 3, 1
    assert least_pending().choose(rs, SMALL, 0.0) is rs[2]


def test_ties_rotate_so_no_replica_is_everyones_favourite() -> None:
    rs = replicas(3)
    strategy = least_pending()
    assert {strategy.choose(rs, SMALL, 0.0).url for _ in range(3)} == {r.url for r in rs}  # type: ignore[union-attr]


def test_least_kv_takes_the_emptiest_cache() -> None:
    rs = replicas(3)
    rs[0].kv_use, rs[1].kv_use, rs[2].kv_use = 0.7, 0.2, None  # None: unknown counts as empty
    rs[2].inflight = 1
    rs[1].inflight = 0
    assert least_kv().choose(rs, SMALL, 0.0) is rs[2]
    rs[2].kv_use = 0.5
    assert least_kv().choose(rs, SMALL, 0.0) is rs[1]


def test_estimated_completion_time_weighs_work_by_measured_speed() -> None:
    fast, slow = replicas(2)
    fast.capacity, slow.capacity = 4000.0, 1000.0
    # The fast replica has 3× the work but 4× the speed: it finishes sooner.
    fast.output_left, slow.output_left = 3000.0, 1000.0
    ect = estimated_completion_time()
    assert ect.choose([fast, slow], SMALL, 0.0) is fast
    assert completion_time(fast, SMALL) == pytest.approx((3000 + 15 + 50) / 4000)
    # Prompt tokens in flight count, at the prefill weight.
    fast.prompt_inflight = 40_000
    assert ect.choose([fast, slow], SMALL, 0.0) is slow


def test_a_big_request_and_a_small_one_may_go_different_ways() -> None:
    """The request's own cost is divided by each replica's speed: a long generation prefers
    the fast GPU even behind a queue that a short one would rather avoid."""
    fast, slow = replicas(2)
    fast.capacity, slow.capacity = 3000.0, 1000.0
    fast.output_left = 1500.0
    ect = estimated_completion_time()
    short = Request("m", prompt_tokens=10, expected_output=10)
    long = Request("m", prompt_tokens=10, expected_output=2000)
    assert ect.choose([fast, slow], short, 0.0) is slow
    assert ect.choose([fast, slow], long, 0.0) is fast


def test_model_affinity_keeps_a_model_on_its_replicas_until_they_are_saturated() -> None:
    home = Replica(url="http://home", models=frozenset({"m"}), capacity=1000.0)
    other = Replica(url="http://other", models=frozenset({"x"}), capacity=1000.0)
    affinity = ModelAffinity(estimated_completion_time(), spread=2.0)
    assert affinity.choose([home, other], SMALL, 0.0) is home
    home.output_left = 1000.0  # (1000 + 65) / 1000 vs 65 / 1000: more than twice as long
    assert affinity.choose([home, other], SMALL, 0.0) is other
    home.output_left, home.inflight = 0.0, home.limit  # at its limit: spreads at once
    assert affinity.choose([home, other], SMALL, 0.0) is other
    # Nobody has the model (or everybody has it): the inner strategy decides over all.
    assert affinity.choose([other], SMALL, 0.0) is other


def test_make_knows_every_strategy_and_refuses_others() -> None:
    for name in STRATEGIES:
        assert make(name).name == name
    with pytest.raises(ValueError, match="unknown routing strategy 'fastest'"):
        make("fastest")


# ---------------------------------------------------------------------------------------------
# The waiting room and the estimates


def test_the_queue_is_bounded_and_interactive_leaves_first() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(3)
    assert queue.push("b1", "batch") and queue.push("i1", "interactive")
    assert queue.push("b2", "batch")
    assert not queue.push("i2", "interactive")  # full: the caller answers 429
    assert (queue.depth("interactive"), queue.depth("batch"), len(queue)) == (1, 2, 3)
    assert queue.peek() == "i1"
    assert [queue.pop(), queue.pop()] == ["i1", "b1"]
    assert len(queue) == 1 and queue.ordered() == ["b2"]
    assert queue.remove("b2") and not queue.remove("b2")
    assert queue.pop() is None and queue.peek() is None
    assert len(queue) == 0 and queue.ordered() == []
    assert queue.push("i3", "interactive") and len(queue) == 1  # room again
    with pytest.raises(ValueError):
        AdmissionQueue(-1)


def test_the_output_estimate_is_a_running_mean_capped_by_max_tokens() -> None:
    estimate = OutputEstimate(value=256.0, horizon=4)
    for tokens in (100, 300):
        estimate.observe(tokens)
    assert estimate.value == pytest.approx(200.0)
    assert estimate.expected(50) == 50 and estimate.expected(None) == pytest.approx(200.0)
    for _ in range(50):  # beyond the horizon it follows the recent answers
        estimate.observe(20)
    assert estimate.value == pytest.approx(20.0, abs=0.5)


def test_throughput_is_measured_only_at_a_real_concurrency() -> None:
    meter = Throughput(value=500.0, min_concurrency=4.0, window_s=2.0)
    # One request at a time for 3 s: its rate says nothing of the capacity.
    meter.started(0.0)
    meter.finished(3.0, 300.0)
    assert meter.value == 500.0 and not meter.measured
    # Eight at a time, closed loop: one finishes (100 work units) every 0.125 s and the next
    # starts at once: 800 units a second.
    for _ in range(8):
        meter.started(3.0)
    at = 3.0
    for _ in range(64):
        at += 0.125
        meter.finished(at, 100.0)
        meter.started(at)
    assert meter.measured and meter.value == pytest.approx(800.0, rel=0.05)


def test_the_prior_ranks_gpus_as_the_cost_model_does() -> None:
    h200, h100, l40s = (prior_capacity(g, "s3://m/llama-3.1-8b") for g in ("H200", "H100", "L40S"))
    assert h200 > h100 > l40s > 1.0
    assert prior_capacity("TPUv9", "llama-3.1-8b") == 1.0  # unknown: measurement takes over


# ---------------------------------------------------------------------------------------------
# A deployment's pool: booking, waiting, releasing


def pool(n: int, limit: int, bound: int = 8) -> DeploymentPool:
    p = DeploymentPool("d", least_pending(), AdmissionQueue(bound), eject_after=2, eject_s=5.0)
    for r in replicas(n, limit=limit):
        p.replicas[r.url] = r
        p.throughput[r.url] = Throughput(r.capacity)
    return p


def test_books_open_and_close_exactly() -> None:
    async def scenario() -> None:
        p = pool(1, limit=4)
        ticket = await p.acquire(SMALL, "interactive", timeout=1)
        replica = ticket.replica
        assert (replica.inflight, replica.prompt_inflight, replica.output_left) == (1, 100, 50)
        ticket.streamed(20)
        assert replica.output_left == 30
        ticket.streamed(40)  # more than expected: the remainder stops at zero
        assert replica.output_left == 0
        p.release(ticket, output_tokens=60, ok=True, failed=False)
        p.release(ticket, output_tokens=60, ok=True, failed=False)  # twice: no effect
        assert (replica.inflight, replica.prompt_inflight, replica.output_left) == (0, 0, 0)

    asyncio.run(scenario())


def test_waiters_are_admitted_interactive_first_and_a_full_room_says_so() -> None:
    async def scenario() -> None:
        p = pool(1, limit=1, bound=2)
        first = await p.acquire(SMALL, "interactive", timeout=1)
        batch = asyncio.create_task(p.acquire(SMALL, "batch", timeout=5))
        await asyncio.sleep(0)
        interactive = asyncio.create_task(p.acquire(SMALL, "interactive", timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="2 requests are waiting"):
            await p.acquire(SMALL, "interactive", timeout=5)
        p.release(first, output_tokens=10, ok=True, failed=False)
        second = await asyncio.wait_for(interactive, 1)  # the later interactive one goes first
        assert not batch.done()
        p.release(second, output_tokens=10, ok=True, failed=False)
        third = await asyncio.wait_for(batch, 1)
        p.release(third, output_tokens=10, ok=True, failed=False)

    asyncio.run(scenario())


def test_a_waiter_times_out_and_a_cancelled_one_leaves_no_booking() -> None:
    async def scenario() -> None:
        p = pool(1, limit=1)
        held = await p.acquire(SMALL, "interactive", timeout=1)
        with pytest.raises(NoReplica, match=r"no replica freed up within 0\.05 s"):
            await p.acquire(SMALL, "interactive", timeout=0.05)
        assert len(p.queue) == 0
        waiting = asyncio.create_task(p.acquire(SMALL, "batch", timeout=5))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        p.release(held, output_tokens=1, ok=True, failed=False)
        assert next(iter(p.replicas.values())).inflight == 0 and len(p.queue) == 0

    asyncio.run(scenario())


def test_a_deployment_at_zero_holds_its_requests_until_a_replica_comes() -> None:
    """Scaled to zero: a request waits in the room (the demand the router reports, on which
    the autoscaler boots a server at once) and goes to the first replica that appears; one
    that waits in vain is told how long a boot takes."""

    async def scenario() -> None:
        p = pool(0, limit=4)
        p.cold_start_s = 840.0
        with pytest.raises(NoReplica, match=r"no server serving it .* ~840 s to boot") as caught:
            await p.acquire(SMALL, "interactive", timeout=0.05)
        assert caught.value.retry_after_s == 840.0 and len(p.queue) == 0
        waiting = asyncio.create_task(p.acquire(SMALL, "interactive", timeout=5))
        await asyncio.sleep(0.01)
        assert len(p.queue) == 1 and not waiting.done()  # held, not refused
        [replica] = replicas(1, limit=4)
        p.replicas[replica.url] = replica  # the routing table lists the new server's replica
        p.pump()  # as the proxy does when a replica becomes ready
        ticket = await asyncio.wait_for(waiting, 1)
        assert ticket.replica is replica and replica.inflight == 1
        # With replicas that are merely busy, the timeout says so, with no boot time.
        p.replicas[replica.url].inflight = replica.limit
        with pytest.raises(NoReplica, match="no replica freed up") as busy:
            await p.acquire(SMALL, "interactive", timeout=0.05)
        assert busy.value.retry_after_s is None

    asyncio.run(scenario())


def test_a_deployment_switched_off_refuses_at_once_with_no_boot_promised() -> None:
    """Max replicas 0: nothing will boot for it, so a request neither waits nor is told to
    come back after a boot."""

    async def scenario() -> None:
        p = pool(0, limit=4)
        p.off = True
        with pytest.raises(NoReplica, match="switched off") as caught:
            await p.acquire(SMALL, "interactive", timeout=30)  # at once: not after 30 s
        assert caught.value.retry_after_s is None and len(p.queue) == 0

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_failures_in_a_row_eject_a_replica_for_a_while() -> None:
    async def scenario() -> None:
        now = [100.0]
        p = pool(2, limit=4)
        p.clock = lambda: now[0]
        bad = p.replicas["http://e0"]
        for _ in range(2):
            ticket = await p.acquire(
                SMALL, "interactive", exclude=frozenset({"http://e1"}), timeout=1
            )
            p.release(ticket, output_tokens=0, ok=False, failed=True)
        assert bad.ejected_until == 105.0 and not bad.available(now[0])
        with pytest.raises(NoReplica, match="has no replica"):
            await p.acquire(SMALL, "interactive", exclude=frozenset(p.replicas), timeout=1)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------
# The agent's /state, and tokens


def test_agent_state_marks_replicas_ready_only_when_agent_and_replica_are() -> None:
    a, b = replicas(2)
    state = {
        "ready": True,
        "draining": False,
        "replicas": [
            {
                "url": "http://e0/",
                "state": "ready",
                "queued": 3,
                "running": 5,
                "kv_used_fraction": 0.4,
            },
            {"url": "http://e1", "state": "loading"},
        ],
    }
    apply_agent_state([a, b], state)
    assert (a.ready, a.queued, a.running, a.kv_use) == (True, 3, 5, 0.4)
    assert not b.ready
    apply_agent_state([a, b], {**state, "draining": True})
    assert not a.ready
    apply_agent_state([a, b], {"ready": True, "replicas": []})  # gone from the agent's list
    assert not a.ready


def test_prompt_tokens_follow_the_engines_counting() -> None:
    text = "x" * 401
    assert prompt_tokens({"prompt": text}, chat=False) == count_tokens(text) == 101
    assert prompt_tokens({"prompt": [text]}, chat=False) == 101
    assert prompt_tokens({"prompt": [1, 2, 3]}, chat=False) == 3
    messages = [{"role": "user", "content": "hello"}]
    rendered = "<|user|>\nhello\n<|assistant|>\n"
    assert prompt_tokens({"messages": messages}, chat=True) == count_tokens(rendered)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert prompt_tokens({"messages": parts}, chat=True) == count_tokens(rendered)
    assert max_output({"max_tokens": 7}) == 7
    assert max_output({"max_completion_tokens": 9, "max_tokens": 7}) == 9
    assert max_output({}) is None and max_output({"max_tokens": "many"}) is None


def test_a_retry_that_excludes_the_free_replica_does_not_block_the_queue() -> None:
    async def scenario() -> None:
        p = pool(2, limit=1)
        held = await p.acquire(SMALL, "interactive", timeout=1)  # one replica busy
        other = next(url for url in p.replicas if url != held.replica.url)
        p.replicas[other].inflight = 1  # ... and the other too, for now
        retry = asyncio.create_task(
            p.acquire(SMALL, "interactive", exclude=frozenset({other}), timeout=5)
        )
        await asyncio.sleep(0)
        fresh = asyncio.create_task(p.acquire(SMALL, "batch", timeout=5))
        await asyncio.sleep(0)
        p.replicas[other].inflight = 0  # the one the retry may not use frees up
        p.pump()
        ticket = await asyncio.wait_for(fresh, 1)  # the batch request goes past the retry
        assert ticket.replica.url == other and not retry.done()
        p.release(held, output_tokens=1, ok=True, failed=False)
        assert (await asyncio.wait_for(retry, 1)).replica.url == held.replica.url

    asyncio.run(scenario())


def test_router_p95s_cover_the_last_minute_only() -> None:
    from fleet.router.metrics import RouterMetrics

    now = [1000.0]
    metrics = RouterMetrics()
    metrics.clock = lambda: now[0]
    for seconds in (20.0, 21.0, 22.0):
        metrics.finished("d", "interactive", "200", seconds)
        metrics.ttft("d", 2.0)
    assert metrics.p95s("d") == (22.0, 2.0)
    now[0] += 61  # a quiet minute: nothing to report, not the old spike
    assert metrics.p95s("d") == (None, None)
    metrics.finished("d", "interactive", "200", 1.0)
    assert metrics.p95s("d") == (1.0, None)
    metrics.finished("d", "interactive", "429", 0.001)  # refusals are not latencies
    assert metrics.p95s("d")[0] == 1.0


def test_a_replica_on_unknown_hardware_starts_at_the_mean_of_the_known() -> None:
    from fleet.router.config import RouterSettings
    from fleet.router.discovery import WorkerView

    view = WorkerView(RouterSettings(), http=None)  # type: ignore[arg-type]
    view.apply_table(
        [
            {
                "deployment": "d",
                "model_uri": "s3://m/llama-3.1-8b",
                "replicas": [
                    {"url": "http://a", "gpu_model": "H100"},
                    {"url": "http://b", "gpu_model": "H200"},
                    {"url": "http://c", "gpu_model": "MI300X"},
                ],
            }
        ]
    )
    replicas = view.pools["d"].replicas
    known = (replicas["http://a"].capacity + replicas["http://b"].capacity) / 2
    assert replicas["http://c"].capacity == pytest.approx(known)
    assert all(r.ready for r in replicas.values())  # no agent listed: taken as ready


def test_a_model_served_by_two_deployments_goes_to_the_one_with_replicas() -> None:
    from fleet.router.config import RouterSettings
    from fleet.router.discovery import WorkerView

    view = WorkerView(RouterSettings(), http=None)  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = [
        # First by name, staging the same model for later: no replica yet.
        {"deployment": "a-staging", "models": ["a-staging", "llama"], "replicas": []},
        {
            "deployment": "chat",
            "models": ["chat", "llama"],
            "replicas": [{"url": "http://a"}, {"url": "http://b"}],
        },
    ]
    view.apply_table(rows)
    assert view.by_model["llama"].name == "chat"
    assert view.by_model["a-staging"].name == "a-staging"  # its own name still reaches it
    rows[0]["replicas"] = [{"url": "http://c"}, {"url": "http://d"}]  # a tie: first by name
    view.apply_table(rows)
    assert view.by_model["llama"].name == "a-staging"
