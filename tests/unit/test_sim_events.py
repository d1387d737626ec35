"""The simulator's event queue (`fleet.sim.core._Events`): the engines' block ends come out in
exactly the order one heap of them gives, (time, sequence), whatever buckets they fall in."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from fleet.sim.core import BUCKET_S, _Due, _Events
from fleet.sim.engine import Engine
from fleet_core import cost_model as cm

ENGINE = Engine(cm.EngineShape(gpu=cm.gpu_spec("H100"), model=cm.model_spec("llama-3.1-8b")))


def _drained(queue: _Events) -> list[tuple[float, int]]:
    """(time, sequence) of every end left, in the order the queue gives them."""
    out: list[tuple[float, int]] = []
    while queue.first() is not None:
        due = queue.pop()
        out.append((due.t, due.seq))
    return out


def _drain_in_step(
    seed: int, steps: int
) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """Random pushes and pops, as the loop makes them (no end earlier than the last one taken):
    what the queue gives and what one heap gives."""
    rng = random.Random(seed)
    queue = _Events()
    heap: list[tuple[float, int]] = []
    got: list[tuple[float, int]] = []
    want: list[tuple[float, int]] = []
    now = 0.0
    seq = 0
    for _ in range(steps):
        if rng.random() < 0.55:
            seq += 1
            kind = rng.random()
            if kind < 0.2:
                t = now  # at once
            elif kind < 0.4:
                t = (int(now / BUCKET_S) + rng.randint(0, 3)) * BUCKET_S  # on a bucket's edge
            elif kind < 0.5:
                t = now + rng.uniform(0, 30.0)  # far ahead
            else:
                t = now + rng.expovariate(1 / (3 * BUCKET_S))
            due = _Due(max(t, now), seq, ENGINE)
            queue.push(due)
            heapq.heappush(heap, (due.t, due.seq))
        else:
            head = queue.first()
            assert (head is None) == (not heap)
            if head is None:
                continue
            due = queue.pop()
            assert due is head
            got.append((due.t, due.seq))
            want.append(heapq.heappop(heap))
            now = due.t
    got += _drained(queue)
    want += [heapq.heappop(heap) for _ in range(len(heap))]
    return got, want


@pytest.mark.parametrize("seed", range(8))
def test_the_queue_gives_the_ends_in_one_heaps_order(seed: int) -> None:
    got, want = _drain_in_step(seed, 20_000)
    assert len(got) > 5_000
    assert got == want


def test_ends_at_equal_times_come_out_by_sequence() -> None:
    queue = _Events()
    for seq in (3, 1, 2):
        queue.push(_Due(5 * BUCKET_S, seq, ENGINE))
    queue.push(_Due(0.0, 9, ENGINE))
    assert _drained(queue) == [(0.0, 9), (5 * BUCKET_S, 1), (5 * BUCKET_S, 2), (5 * BUCKET_S, 3)]


def test_an_end_at_no_finite_time_comes_out_last() -> None:
    queue = _Events()
    queue.push(_Due(math.inf, 1, ENGINE))
    queue.push(_Due(1e9, 2, ENGINE))
    queue.push(_Due(0.5, 3, ENGINE))
    assert [seq for _, seq in _drained(queue)] == [3, 2, 1]
