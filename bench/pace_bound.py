"""The pace bound: how near the floor ANY router could keep the latency p95 on a mixed fleet.

    .venv/bin/python bench/pace_bound.py [--trace conv] [--requests 2400] [--load 0.8]
        [--busy 1,0.9,0.85] [--max-batch-size 16]

A fluid estimate (linear programming; scipy's HiGHS), printed by bench/routing.py beside the
floor and the burst bound, for issue 25's conversation goal (estimated completion time's p95
≤ 1.3 × the floor). The floor has every request alone on an idle H200. On a loaded fleet each
stream decodes at its batch's pace, slower than alone, and slower still while other requests'
prompts are prefilled in the same iterations; an H100 or an L40S decodes slower than an H200
at any batch. Keeping 95 % of requests within R × the floor's p95 then asks that the long
answers go where the pace is fast, and the fleet must still serve the whole load. The bound is
the smallest R for which some assignment of the slice's requests to GPU models does both.

The model, per GPU model g (its cost-model iteration time: `iter_s` per iteration, `token_s`
per token computed, `kv_s` per context token read; fleet/router/estimates.py):

- its streams run at an average batch b_g (1 … max batch): a decode iteration takes
  iter_s + b_g · (token_s + kv_s · c), c the slice's mean context per decoding stream (prompt
  plus half the answer, weighted by answer length);
- the prompts prefilled on g add `stall` seconds to each of its decode iterations on average:
  (prefill seconds on g) ÷ (its decode iterations) ≤ stall_g;
- a request on g takes iter_s + prompt · token_s (its prefill in one iteration, not waiting
  for anyone), then one iteration per output token at the pace iter_s + b_g · (…) + stall_g;
- g's busy seconds (prefill at token_s a prompt token, decode at a 1/b_g share of each
  iteration) fit in `busy` × its GPUs × the window from the first arrival to R × the floor's
  p95 after the last (the last requests may finish that late);
- at most 5 % of the requests take longer than R × the floor's p95 (the p95 is then within it).

For given b_g and stall_g the fewest late requests is a linear program (a request may be split
between GPU models: the fractional relaxation). The batches and stalls are searched on a grid,
coordinate by coordinate from a few starts, for each R from 1.2 up in steps of 0.05. Optimistic
on purpose, so that a goal below the bound is out of reach for routing: no bursts (the load is
averaged over the window), no queueing (the GPUs may be busy all the time at busy 1), every
stream at its GPU model's mean pace, prefill without waiting, request sizes rounded down
(prompts to 25 tokens, answers to 5). Not a theorem: the grid search can miss a better
setting, and a scheduler that varies the batch over time is not modelled; it says how busy a
goal would keep the fleet, against the slack the trace's bursts need. The slice, its offered
load and the floor are bench/routing.py's (`slice_for`).
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/pace_bound.py` puts bench/, not the repo, on the path
    sys.path.insert(0, str(REPO))

LATE_SHARE = 0.05  # a p95: one request in twenty may be late
BATCHES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16)
STALLS = (0.0, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)  # s a decode step
RATIOS = tuple(round(1.2 + 0.05 * i, 2) for i in range(17))  # 1.20 … 2.00


@dataclass(frozen=True)
class Group:
    """The GPUs of one model in the fleet, with the cost model's iteration split."""

    name: str
    count: int
    iter_s: float
    token_s: float
    kv_s: float


@dataclass(frozen=True)
class Setting:
    batches: tuple[int, ...]  # per group: the mean batch
    stalls: tuple[float, ...]  # per group: prefill seconds added to each decode iteration

    def with_batch(self, g: int, batch: int) -> Setting:
        return Setting((*self.batches[:g], batch, *self.batches[g + 1 :]), self.stalls)

    def with_stall(self, g: int, stall: float) -> Setting:
        return Setting(self.batches, (*self.stalls[:g], stall, *self.stalls[g + 1 :]))


@dataclass(frozen=True)
class Bound:
    ratio: float | None  # the smallest R on the grid that keeps 95 % within R x floor p95
    late: float  # the fewest late requests at that R (or at the largest R tried)
    setting: Setting | None


class PaceBound:
    """The linear program for one slice: requests binned by size, rounded down."""

    def __init__(
        self, sizes: Sequence[tuple[int, int]], groups: Sequence[Group], span_s: float
    ) -> None:
        if not sizes or span_s <= 0 or not groups:
            raise ValueError("need requests, a span > 0 and at least one GPU model")
        bins = collections.Counter((p // 25 * 25, o // 5 * 5) for p, o in sizes)
        self.prompt = np.array([p for p, _ in bins], dtype=float)
        self.output = np.array([max(o, 1) for _, o in bins], dtype=float)
        self.count = np.array(list(bins.values()), dtype=float)
        self.requests = len(sizes)
        self.groups = tuple(groups)
        self.span_s = span_s
        answers = sum(o for _, o in sizes)
        self.context = sum(o * (p + o / 2) for p, o in sizes) / max(answers, 1)
        k, n = len(self.count), len(self.groups)
        # Each bin's requests are all placed: sum over groups of x[bin, group] = its count
        rows = np.repeat(np.arange(k), n)
        self._eq = coo_matrix((np.ones(k * n), (rows, np.arange(k * n))), shape=(k, k * n))

    def late(self, limit_s: float, setting: Setting, busy: float) -> float:
        """The fewest requests over `limit_s` (inf: the load does not fit)."""
        k, n = len(self.count), len(self.groups)
        cost = np.zeros((k, n))
        ub = np.zeros((2 * n, k, n))
        rhs = np.zeros(2 * n)
        for g, grp in enumerate(self.groups):
            b, stall = setting.batches[g], setting.stalls[g]
            per_stream = grp.token_s + grp.kv_s * self.context
            pace = grp.iter_s + b * per_stream + stall
            prefill = self.prompt * grp.token_s
            took = grp.iter_s + prefill + self.output * pace
            cost[:, g] = took > limit_s
            ub[2 * g, :, g] = prefill + self.output * (grp.iter_s / b + per_stream)  # busy s
            rhs[2 * g] = busy * grp.count * (self.span_s + limit_s)  # the window
            ub[2 * g + 1, :, g] = prefill * b - stall * self.output  # prefill per iteration
        result = linprog(
            cost.ravel(),
            A_ub=ub.reshape(2 * n, k * n),
            b_ub=rhs,
            A_eq=self._eq,
            b_eq=self.count,
            bounds=(0, None),
            method="highs",
        )
        return float(result.fun) if result.status == 0 else math.inf

    def search(
        self, limit_s: float, busy: float, max_batch: int, enough: float = 0.0
    ) -> tuple[float, Setting]:
        """The fewest late requests over the grid of batches and stalls, by coordinate search
        (each group's batch along its line, then its stall, until nothing improves), or the
        first setting found with at most `enough` late."""
        n = len(self.groups)
        batches = [b for b in BATCHES if b <= max_batch] or [max_batch]
        best = (math.inf, Setting((max_batch,) * n, (0.0,) * n))
        # From the largest batch without stalls (the pace at its best), and with some, and from
        # a smaller batch: the count of late requests has plateaus that one start can miss
        smaller = max(1, 3 * max_batch // 4)
        for batch, stall in ((max_batch, STALLS[0]), (max_batch, STALLS[3]), (smaller, STALLS[3])):
            setting = Setting((batch,) * n, (stall,) * n)
            late = self.late(limit_s, setting, busy)
            for _ in range(8):  # rounds; each improves or stops
                moved = False
                for g in range(n):
                    for along_batch in (True, False):  # the stall's line from the batch found
                        here = setting
                        trials = (
                            [here.with_batch(g, b) for b in batches]
                            if along_batch
                            else [here.with_stall(g, x) for x in STALLS]
                        )
                        for trial in trials:
                            if trial == here:
                                continue
                            got = self.late(limit_s, trial, busy)
                            if got < late - 1e-6:
                                late, setting, moved = got, trial, True
                        if late <= enough + 1e-6:
                            return late, setting
                if not moved:
                    break
            if late < best[0]:
                best = (late, setting)
        return best

    def bound(
        self, floor_p95: float, busy: float, max_batch: int, ratios: Sequence[float] = RATIOS
    ) -> Bound:
        """The smallest ratio of `ratios` at which at most 5 % are late."""
        allowed = LATE_SHARE * self.requests
        late, setting = math.inf, None
        for ratio in ratios:
            late, setting = self.search(ratio * floor_p95, busy, max_batch, enough=allowed)
            if late <= allowed + 1e-6:
                return Bound(ratio, late, setting)
        return Bound(None, late, setting)


def groups_for(fleet: Sequence[str], model: str) -> list[Group]:
    from fleet.router.estimates import iteration_costs

    out = []
    for gpu, count in collections.Counter(fleet).items():
        iter_s, token_s, kv_s = iteration_costs(gpu, model)
        if token_s <= 0:
            raise ValueError(f"the cost model does not know {model} on {gpu}")
        out.append(Group(gpu, count, iter_s, token_s, kv_s))
    return out


def describe(bound: Bound, groups: Sequence[Group]) -> str:
    if bound.setting is None:
        return "none found"
    parts = [
        f"{g.name} batch {b}, +{stall * 1e3:.2f} ms prefill a step"
        for g, b, stall in zip(groups, bound.setting.batches, bound.setting.stalls, strict=True)
    ]
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    import routing  # bench/routing.py: the same slice, capacity and floor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", default="conv", help="conv | code")
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--load", type=float, default=0.8, help="offered load ÷ fleet capacity")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--busy", default="1,0.9,0.85", help="shares of the window GPUs may be busy")
    args = ap.parse_args(argv)
    try:
        busy = [float(x) for x in args.busy.split(",") if x.strip()]
        if not busy or not all(0 < b <= 1 for b in busy):
            raise ValueError
    except ValueError:
        ap.error("--busy takes shares in (0, 1], comma-separated")
    if args.requests < 10 or not args.load > 0 or args.max_batch_size < 1:
        ap.error("need --requests >= 10, --load > 0 and --max-batch-size >= 1")
    try:
        s = routing.slice_for(
            args.trace, args.offset, args.requests, args.load, args.max_batch_size
        )
    except ValueError as exc:
        ap.error(str(exc))
    groups = groups_for(routing.FLEET, routing.MODEL)
    lp = PaceBound(s.sizes, groups, s.span_s)
    print(
        f"{args.trace} trace, {args.requests} requests at {args.load:.0%} of the predicted "
        f"capacity over {s.span_s:.1f} s; floor p95 {s.floor_p95:.2f} s; mean context "
        f"{lp.context:.0f} tokens"
    )
    for share in busy:
        b = lp.bound(s.floor_p95, share, args.max_batch_size)
        found = f"{b.ratio:.2f} × the floor" if b.ratio is not None else f"> {RATIOS[-1]}"
        print(
            f"GPUs busy ≤ {share:.0%}: pace bound {found} "
            f"({b.late:.0f} late; {describe(b, groups)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
