"""Multi-turn sessions for the routing benchmark: conversations whose turns resend their history.

    .venv/bin/python bench/routing_sessions.py [--rows 600] [--load 0.8] [--seed 0]
        [--mean-turns 4] [--think-s 5] [--max-batch-size 16]
        [--strategies estimated_completion_time,prefix_aware]

The workload is fleet/sim/sessions.py's, so the simulator and the bench run the same sessions:
`--rows` rows of the Azure conversation trace (fleet/data/traces/, Azure LLM inference 2023,
CC BY 4.0, Patel et al., Splitwise, ISCA 2024) grouped in order into sessions of a geometric
number of turns (mean `--mean-turns`), each turn's new message the row's prompt size and its
answer the row's output (max_tokens, ignore_eos); sessions start as a Poisson process at the rate
that offers `--load` of the fleet's PREDICTED capacity for the turns' sizes at full prefill
(the capacity a router that ignores prefixes has; the cost model's steady state, as
bench/routing.py computes it).

Here the turns are real chat requests (`/v1/chat/completions`, streamed), CLOSED LOOP per
session: turn 1 is [user: message]; when its answer has streamed in, the session thinks
(exponential, mean `--think-s` simulated seconds) and sends turn 2 = the same messages +
[assistant: the answer text it received] + [user: the next message], and so on. The stand-in
engines hash the rendered prompt's blocks (fleet_agent/engine/core.py), so the follow-up's
prompt really begins with the blocks of the previous turn's prompt, and an engine that computed
them reuses them. (The stand-in's answer words run ~6 characters a token, so a turn's prompt
carries its history's answers at ~1.5 × their token count: the sessions are somewhat longer
than the simulator's.) A turn that fails ends its session. Each message starts with a head
unique to (run, session, turn): no two sessions and no two runs share a block.

Printed per strategy: TTFT (first content token) and latency p50/p95 of the turns (simulated
seconds; the first `--warmup` share of the sessions left out), errors, and the engines' prefix-
cache hit rate over the run: reused ÷ looked-up KV blocks, from each stand-in's iteration stats
(its JSON /metrics: cumulative reusedBlocks / missedBlocks, read before and after). Then the
issue's goal: prefix-aware TTFT p95 <= 0.5 x estimated_completion_time's, latency p95 no worse.

bench/routing.py (one run for all of the issue's figures) calls `plan_sessions`,
`replay_sessions`, `BlockCounts.read` and `turn_figures`; this file's `main` runs the same
phase on its own, with routing.py's engines, agent shim and routers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fleet.sim import sessions as ss  # noqa: E402
from fleet_core import cost_model as cm  # noqa: E402

MODEL = "llama-3.1-8b"
FLEET = ("H200",) * 3 + ("H100",) * 3 + ("L40S",) * 2
GOAL_TTFT = 0.5  # issue 25: prefix-aware TTFT p95 <= 0.5 x ECT without prefix awareness
_FILLER = ("the quick brown fox jumps over the lazy dog and " * 2000)[: 4 * 20_000]


# --- the plan -----------------------------------------------------------------------------------


def predicted_capacity(
    sizes: Sequence[tuple[int, int]], batch: int, fleet: Sequence[str] = FLEET
) -> float:
    """Requests per simulated second the fleet serves in the cost model's steady state for
    this mix at `batch` streams per engine (bench/routing.py's arithmetic)."""
    eff_in, eff_out = cm.effective_lengths(sizes)
    mean_out = statistics.mean(o for _, o in sizes)
    tok_s = 0.0
    for gpu in fleet:
        shape = cm.EngineShape(
            gpu=cm.gpu_spec(gpu), model=cm.model_spec(MODEL), max_batch_size=batch
        )
        tok_s += cm.predicted_decode_tokens_per_s(shape, batch, eff_in, eff_out)
    return tok_s / mean_out


@dataclass(frozen=True)
class SessionPlan:
    sessions: list[ss.Session]
    turns: int
    rate: float  # sessions per simulated second
    capacity: float  # requests per simulated second at full prefill
    mean_prompt: float  # of the turns, tokens (history included)
    mean_output: float


def plan_sessions(
    *,
    load: float,
    capacity: Callable[[Sequence[tuple[int, int]]], float],
    trace: str = "conv",
    offset: int = 0,
    rows: int = 600,
    seed: int = 0,
    mean_turns: float = 4.0,
    think_mean_s: float = 5.0,
) -> SessionPlan:
    """The sessions (fleet/sim/sessions.py), started at the rate that offers `load` ×
    `capacity(sizes of the turns)` requests per simulated second."""
    from fleet.traces import load_trace

    data = [(r.prompt_tokens, r.output_tokens) for r in load_trace(trace)[offset : offset + rows]]
    groups = ss.group(data, mean_turns=mean_turns, seed=seed)
    sizes = ss.sizes(groups)
    cap = capacity(sizes)
    rate = ss.session_rate_for(load, cap, groups)
    return SessionPlan(
        ss.schedule(groups, rate, think_mean_s=think_mean_s, seed=seed),
        len(sizes),
        rate,
        cap,
        statistics.mean(p for p, _ in sizes),
        statistics.mean(o for _, o in sizes),
    )


def message_text(run: int, session: int, turn: int, tokens: int) -> str:
    """A new message of `tokens` tokens (4 characters each, the stand-in's tokenizer), its head
    unique to the run, session and turn."""
    head = f"{run:02d}-{session:05d}-{turn:02d} "
    return (head + _FILLER)[: 4 * max(tokens, 4)]


# --- the replay ---------------------------------------------------------------------------------


@dataclass
class TurnOutcome:
    """One turn; the fields bench/routing.py's Outcome has (loop seconds), and whose it was."""

    session: int
    turn: int
    due: float  # when it was due: the session's start, or the previous answer + think time
    sent: float = 0.0
    first: float | None = None  # first content token
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    prompt_chars: int = 0


async def _turn(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    outcome: TurnOutcome,
) -> str:
    """Send one turn, streamed; the answer's text (empty on error)."""
    loop = asyncio.get_running_loop()
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    outcome.prompt_chars = sum(len(m["content"]) for m in messages)
    outcome.sent = loop.time()
    parts: list[str] = []
    try:
        async with http.post(url, json=body) as reply:
            if reply.status != 200:
                outcome.error = f"HTTP {reply.status}"
                await reply.read()
                return ""
            buffer = b""
            async for chunk in reply.content.iter_any():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    data = event.strip()
                    if not data.startswith(b"data: ") or data == b"data: [DONE]":
                        continue
                    choices = json.loads(data[6:]).get("choices") or []
                    text = choices[0].get("delta", {}).get("content") if choices else None
                    if text:
                        if outcome.first is None:
                            outcome.first = loop.time()
                        parts.append(text)
                        outcome.tokens += 1
            outcome.end = loop.time()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        outcome.error = type(exc).__name__
        return ""
    return "".join(parts)


async def _session(
    http: aiohttp.ClientSession,
    url: str,
    s: ss.Session,
    run: int,
    start: float,
    speedup: float,
    out: list[TurnOutcome],
) -> None:
    loop = asyncio.get_running_loop()
    messages: list[dict[str, str]] = []
    due = start + s.start / speedup
    for k, turn in enumerate(s.turns):
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        messages.append({"role": "user", "content": message_text(run, s.index, k, turn.new)})
        outcome = TurnOutcome(s.index, k, due)
        out.append(outcome)
        answer = await _turn(http, url, messages, turn.output, outcome)
        if outcome.error is not None:
            return  # the session ends with its first failed turn
        messages.append({"role": "assistant", "content": answer})
        if k < len(s.think_s):
            due = loop.time() + s.think_s[k] / speedup


async def replay_sessions(
    base_url: str, sessions: Sequence[ss.Session], *, run: int, speedup: float = 1.0
) -> list[TurnOutcome]:
    """Every session closed loop (module doc), each starting at its planned time (simulated
    seconds ÷ `speedup` after now); the turns' outcomes."""
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=1800, sock_connect=10)
    out: list[TurnOutcome] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = loop.time() + 0.2
        url = f"{base_url}/v1/chat/completions"
        await asyncio.gather(*(_session(http, url, s, run, start, speedup, out) for s in sessions))
    return out


# --- the engines' prefix-cache counters ---------------------------------------------------------


@dataclass
class BlockCounts:
    """KV blocks reused and missed by the prefix-cache lookups of a set of stand-in engines,
    cumulative (the last iteration entry of each one's JSON /metrics, which empties on read:
    `last` keeps each engine's newest figures for when nothing ran since)."""

    reused: float = 0.0
    missed: float = 0.0
    last: dict[str, tuple[float, float]] = field(default_factory=dict)

    def read(self, urls: Sequence[str]) -> BlockCounts:
        """The counts now, summed over `urls` (a new object; `self` keeps the newest)."""
        total = BlockCounts(last=self.last)
        for url in urls:
            figures = self.last.get(url, (0.0, 0.0))
            try:
                with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:
                    entries = json.loads(reply.read() or b"[]")
                if entries:
                    kv = entries[-1].get("kvCacheStats") or {}
                    figures = (float(kv.get("reusedBlocks", 0)), float(kv.get("missedBlocks", 0)))
            except (OSError, ValueError, urllib.error.URLError):
                pass
            self.last[url] = figures
            total.reused += figures[0]
            total.missed += figures[1]
        return total

    def rate_since(self, before: BlockCounts) -> float:
        reused, missed = self.reused - before.reused, self.missed - before.missed
        return reused / (reused + missed) if reused + missed > 0 else math.nan


# --- figures ------------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class TurnFigures:
    label: str
    ttft: list[float]  # simulated seconds, measured turns that succeeded
    latency: list[float]
    errors: dict[str, int]
    turns: int  # measured
    hit_rate: float  # the engines' prefix-cache hit rate over the run
    mean_prompt_tokens: float  # as sent (chars / 4)


def turn_figures(
    label: str,
    outcomes: Sequence[TurnOutcome],
    sessions: Sequence[ss.Session],
    *,
    hit_rate: float,
    warmup: float = 0.1,
    speedup: float = 1.0,
) -> TurnFigures:
    """The turns of the sessions that start after the first `warmup` share of the starts."""
    cut = pct([s.start for s in sessions], warmup) if warmup > 0 else -math.inf
    measured_sessions = {s.index for s in sessions if s.start >= cut}
    measured = [o for o in outcomes if o.session in measured_sessions]
    good = [o for o in measured if o.error is None and o.end is not None and o.first is not None]
    errors: dict[str, int] = {}
    for o in measured:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1
    return TurnFigures(
        label,
        [(o.first - o.sent) * speedup for o in good if o.first is not None],
        [(o.end - o.sent) * speedup for o in good if o.end is not None],
        errors,
        len(measured),
        hit_rate,
        statistics.mean(o.prompt_chars / 4 for o in measured) if measured else math.nan,
    )


def report(figures: Sequence[TurnFigures]) -> list[str]:
    """Print the figures; return the goal line (printed too), if both strategies ran."""
    print(
        f"{'strategy':<28} {'turns':>5} {'TTFT p50':>8} {'p95':>6} {'latency p50':>11} "
        f"{'p95':>6} {'prefix hits':>11} {'prompt':>7} errors"
    )
    for f in figures:
        print(
            f"{f.label:<28} {f.turns:>5} {pct(f.ttft, 0.5):8.3f} {pct(f.ttft, 0.95):6.3f} "
            f"{pct(f.latency, 0.5):11.2f} {pct(f.latency, 0.95):6.2f} {f.hit_rate:11.2f} "
            f"{f.mean_prompt_tokens:7.0f} {sum(f.errors.values())} {f.errors or ''}"
        )
    by = {f.label: f for f in figures}
    ect, aware = by.get("estimated_completion_time"), by.get("prefix_aware")
    if ect is None or aware is None:
        return []
    ttft = pct(aware.ttft, 0.95) / pct(ect.ttft, 0.95)
    latency = pct(aware.latency, 0.95) / pct(ect.latency, 0.95)
    met = ttft <= GOAL_TTFT and latency <= 1.0
    line = (
        f"Goal: prefix_aware TTFT p95 <= {GOAL_TTFT} x estimated_completion_time: {ttft:.2f}; "
        f"latency p95 no worse: {latency:.2f} x; {'met' if met else 'NOT met'} "
        f"(prefix hit rate {aware.hit_rate:.2f} against {ect.hit_rate:.2f})"
    )
    print(line)
    return [f"multi-turn: {line}"]


# --- on its own ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=600, help="trace rows (turns) to replay")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-turns", type=float, default=4.0)
    ap.add_argument("--think-s", type=float, default=5.0, help="mean think time, simulated s")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--strategies", default="estimated_completion_time,prefix_aware")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[int, list[str]]:
    """The sessions against a router per strategy: (exit code, the goal line)."""
    import routing  # bench/routing.py: the engines, the agent shim, a router per strategy

    variants = [routing.Variant.parse(s.strip()) for s in args.strategies.split(",") if s.strip()]
    batch = args.max_batch_size
    plan = plan_sessions(
        load=args.load,
        capacity=lambda sizes: predicted_capacity(sizes, batch),
        offset=args.offset,
        rows=args.rows,
        seed=args.seed,
        mean_turns=args.mean_turns,
        think_mean_s=args.think_s,
    )
    print(
        f"Sessions: {len(plan.sessions)} from {plan.turns} rows of the conv trace (mean "
        f"{plan.turns / len(plan.sessions):.1f} turns; turn prompts {plan.mean_prompt:.0f} "
        f"tokens with history, answers {plan.mean_output:.0f}); capacity at full prefill "
        f"{plan.capacity:.1f} req/s; {args.load:.0%} of it = {plan.rate:.2f} sessions/s; think "
        f"time mean {args.think_s:g} s; last start {plan.sessions[-1].start:.0f} s",
        flush=True,
    )
    import tempfile
    from contextlib import ExitStack

    figures: list[TurnFigures] = []
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sessions-")))
        fleet = stack.enter_context(routing.engines(FLEET, batch, args.speedup, logs))
        urls = [e.url for e in fleet]
        agent_base, _ = stack.enter_context(routing.agent_shim(urls, logs))
        table = logs / "routing.json"
        routing.write_table(table, fleet, agent_base, batch)
        counts = BlockCounts()
        for run, variant in enumerate(variants):
            # (unauthenticated: this phase measures routing, not callers)
            env = {"FLEET_ROUTER_CLIENT_AUTH": "none"}
            with routing.router(variant, table, logs, len(fleet), env) as (base, _):
                before = counts.read(urls)
                outcomes = asyncio.run(
                    replay_sessions(base, plan.sessions, run=run, speedup=args.speedup)
                )
                after = counts.read(urls)
                status, body = routing.http_get(f"{base}/state")
            views = []
            if status == 200:
                views = [
                    r.get("prefix") or {} for r in json.loads(body)["deployments"][0]["replicas"]
                ]
            f = turn_figures(
                variant.label,
                outcomes,
                plan.sessions,
                hit_rate=after.rate_since(before),
                warmup=args.warmup,
                speedup=args.speedup,
            )
            figures.append(f)
            promised = [v["promised_hit_rate"] for v in views if v.get("promised_hit_rate")]
            print(
                f"  {variant.label}: done, TTFT p95 {pct(f.ttft, 0.95):.3f} s; the router's "
                f"prefix index: {sum(v.get('blocks', 0) for v in views)} blocks over "
                f"{len(views)} replicas, promised hit rate "
                f"{statistics.mean(promised) if promised else math.nan:.2f} (mean of replicas)",
                flush=True,
            )
    return 0, report(figures)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))[0]


if __name__ == "__main__":
    sys.exit(main())
