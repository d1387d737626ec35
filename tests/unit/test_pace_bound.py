"""bench/pace_bound.py's linear program on fleets small enough to solve by hand: the pace a
batch allows against the load it must carry, and which requests must go to the fast GPUs."""

from __future__ import annotations

import importlib.util
import math
import sys
from typing import Any

import pytest
from repo_paths import ROOT


def _pace_bound() -> Any:
    path = ROOT / "bench" / "pace_bound.py"
    spec = importlib.util.spec_from_file_location("pace_bound", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pace_bound"] = module
    spec.loader.exec_module(module)
    return module


pb = _pace_bound()


def test_one_gpu_the_batch_the_load_needs_sets_the_pace() -> None:
    """100 answers of 100 tokens arriving over 20 s on one GPU whose iteration costs 10 ms +
    1 ms per stream: each takes 100 × (0.01/b + 0.001) busy seconds, 100/b + 10 in all, which
    the window (20 s and the latency limit, ~2 s: the last answers may end that late) holds
    from a batch of 10 up, where a stream's pace is 20 ms a token: 2.01 s an answer, against
    1.11 s alone. Under 2.01 s every answer is late (a batch of 8 needs 22.5 s)."""
    gpu = pb.Group("G", 1, iter_s=0.01, token_s=0.001, kv_s=0.0)
    lp = pb.PaceBound([(0, 100)] * 100, [gpu], span_s=20.0)
    late, setting = lp.search(2.02, busy=1.0, max_batch=16)
    assert late == pytest.approx(0.0)
    assert setting.batches[0] >= 10
    assert lp.late(1.9, pb.Setting((8,), (0.0,)), busy=1.0) == math.inf  # does not fit
    assert lp.search(1.9, busy=1.0, max_batch=16)[0] == pytest.approx(100.0)
    # Alone: 0.01 + 100 × 0.011 = 1.11 s; 1.85 × that (2.05 s) is the first ratio on the grid
    # at or above 2.01 s
    bound = lp.bound(1.11, busy=1.0, max_batch=16)
    assert bound.ratio == pytest.approx(1.85)
    # Less of the window to work in asks for a bigger batch (12 at 90 %: 2.21 s), hence a
    # slower pace; at 80 % a batch of 14 (2.41 s), past the grid's 2 × 1.11 s
    assert lp.bound(1.11, busy=0.9, max_batch=16).ratio == pytest.approx(2.0)
    assert lp.bound(1.11, busy=0.8, max_batch=16).ratio is None


def test_long_answers_need_the_fast_gpu_and_what_it_cannot_hold_is_late() -> None:
    """A fast and a slow GPU (40 ms an iteration). A long answer (100 tokens) is within 2.1 s
    only on the fast one at a batch of at most 10, where it costs 0.2 busy seconds: a window
    of 7.9 s (5.8 s of arrivals and the 2.1 s limit) holds 39.5 of the 50 (the program is
    fractional), and the rest are late wherever they go. The short answers (10 tokens) fit
    the slow GPU's time with room to spare."""
    fast = pb.Group("fast", 1, iter_s=0.01, token_s=0.001, kv_s=0.0)
    slow = pb.Group("slow", 1, iter_s=0.04, token_s=0.001, kv_s=0.0)
    sizes = [(0, 100)] * 50 + [(0, 10)] * 50
    lp = pb.PaceBound(sizes, [fast, slow], span_s=5.8)
    late, setting = lp.search(2.1, busy=1.0, max_batch=16)
    assert late == pytest.approx(10.5)
    assert setting.batches[0] == 10
    # With a window of 10.1 s the fast GPU holds them all
    roomy = pb.PaceBound(sizes, [fast, slow], span_s=8.0)
    assert roomy.search(2.1, busy=1.0, max_batch=16)[0] == pytest.approx(0.0)


def test_prefill_slows_the_streams_it_shares_iterations_with() -> None:
    """Prompts cost arithmetic in the iterations the streams decode in. 10 requests of 100
    prompt tokens (0.1 s of prefill each) and 100 output tokens over 10 s: at a batch of 2
    there are 500 decode iterations and 1 s of prefill to share among them, 2 ms each at
    least; the stall counts in every answer: 0.01 + 0.1 + 100 × (0.01 + 2 × 0.001 + 0.002) =
    1.51 s."""
    gpu = pb.Group("G", 1, iter_s=0.01, token_s=0.001, kv_s=0.0)
    lp = pb.PaceBound([(100, 100)] * 10, [gpu], span_s=10.0)
    assert lp.late(100.0, pb.Setting((2,), (0.001,)), busy=1.0) == math.inf
    assert lp.late(1.52, pb.Setting((2,), (0.002,)), busy=1.0) == pytest.approx(0.0)
    assert lp.late(1.50, pb.Setting((2,), (0.002,)), busy=1.0) == pytest.approx(10.0)
    # A batch of 1 does not fit the window (11.52 s): 1 s of prefill and 11 s of decode
    assert lp.late(1.52, pb.Setting((1,), (0.004,)), busy=1.0) == math.inf


def test_bad_input_is_refused() -> None:
    gpu = pb.Group("G", 1, iter_s=0.01, token_s=0.001, kv_s=0.0)
    with pytest.raises(ValueError):
        pb.PaceBound([], [gpu], span_s=1.0)
    with pytest.raises(ValueError):
        pb.PaceBound([(1, 1)], [gpu], span_s=0.0)
