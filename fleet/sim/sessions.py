"""A multi-turn workload from a trace's sizes: conversations whose turns resend their history.

A follow-up turn of a chat sends the whole conversation again: its prompt begins with the
previous turn's prompt and answer, so an engine that still holds those KV blocks computes only
the new message (prefix reuse). Built from a trace (the Azure conversation trace by default),
deterministic for a seed:

- Sessions: the trace's rows in order, consecutive rows grouped into sessions of a geometric
  number of turns (mean `mean_turns`, at most `max_turns`); a session also ends before a turn
  whose prompt would exceed `max_prompt` tokens (that row starts the next session).
- Turn k's prompt = turn k-1's prompt + turn k-1's answer + row k's prompt (the new message);
  its output = row k's output. The first turn is its row as is. (Chat headers are left out of
  the counts: a few tokens a message.)
- Session starts: Poisson at `session_rate` per second. Within a session, turn k+1 arrives
  `answer_s` + a think time after turn k: the think time exponential with mean `think_mean_s`,
  `answer_s` the answer's time at `answer_s_per_token` (open loop, the simulator's arrivals are
  known in advance; the bench runs the sessions closed loop: bench/routing_sessions.py).
- Prefix identity: every token of a session belongs to one growing stream, so block k of any of
  its turns is the same block: its hash is (session, k) packed in one int (`blocks`), distinct
  across sessions. A turn has prompt // 32 whole blocks (fleet/sim/engine.py's reuse).
- Load: `session_rate_for` sets the session rate so that the turns' mean request rate is `load`
  of the deployment's capacity for the turns' sizes at full prefill (`scenario.capacity_rps`:
  the capacity without reuse, the one a strategy that ignores prefixes gets).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from fleet.sim.core import DeploymentSpec
from fleet.sim.engine import SimRequest
from fleet.sim.scenario import capacity_rps
from fleet.traces import load_trace

BLOCK_TOKENS = 32  # the engines' tokens per KV block (cost_model.EngineShape's default)
_SESSION_SHIFT = 20  # block k of session s: s << 20 | k (k < 2**20 blocks: 33 M tokens)


@dataclass(frozen=True, slots=True)
class Turn:
    new: int  # tokens of the new message (the trace row's prompt)
    prompt: int  # the whole prompt: history + the new message
    output: int  # tokens of the answer


@dataclass(frozen=True, slots=True)
class Session:
    index: int
    start: float  # seconds: the first turn's arrival
    turns: tuple[Turn, ...]
    think_s: tuple[float, ...]  # before each turn after the first (len(turns) - 1)


def group(
    rows: Sequence[tuple[int, int]],
    *,
    mean_turns: float = 4.0,
    max_turns: int = 16,
    max_prompt: int = 16_000,
    seed: int = 0,
) -> list[tuple[Turn, ...]]:
    """The rows (prompt, output) in order, grouped into sessions' turns (module doc)."""
    if mean_turns < 1.0:
        raise ValueError("mean_turns must be at least 1")
    rng = random.Random(seed)
    p = 1.0 / mean_turns  # geometric on 1, 2, ...: P(n) = (1 - p)^(n - 1) p, mean 1 / p
    out: list[tuple[Turn, ...]] = []
    i, n = 0, len(rows)
    while i < n:
        want = 1
        while want < max_turns and rng.random() >= p:
            want += 1
        turns: list[Turn] = []
        history = 0  # the previous prompt + its answer
        while i < n and len(turns) < want:
            new, output = max(1, rows[i][0]), max(1, rows[i][1])
            prompt = history + new
            if turns and prompt > max_prompt:
                break  # the row starts the next session
            turns.append(Turn(new, prompt, output))
            history = prompt + output
            i += 1
        out.append(tuple(turns))
    return out


def sizes(groups: Sequence[tuple[Turn, ...]]) -> list[tuple[int, int]]:
    """(prompt, output) of every turn: the mix the capacity is computed for."""
    return [(t.prompt, t.output) for turns in groups for t in turns]


def schedule(
    groups: Sequence[tuple[Turn, ...]],
    session_rate: float,
    *,
    think_mean_s: float = 5.0,
    seed: int = 0,
) -> list[Session]:
    """Start times (Poisson at `session_rate`) and think times (exponential) for the sessions."""
    if session_rate <= 0:
        raise ValueError("the session rate must be positive")
    rng = random.Random(seed + 1)
    t = 0.0
    out: list[Session] = []
    for k, turns in enumerate(groups):
        t += rng.expovariate(session_rate)
        thinks = tuple(
            rng.expovariate(1.0 / think_mean_s) if think_mean_s > 0 else 0.0
            for _ in range(len(turns) - 1)
        )
        out.append(Session(k, t, turns, thinks))
    return out


def session_rate_for(load: float, capacity_rps: float, groups: Sequence[tuple[Turn, ...]]) -> float:
    """Sessions per second for a mean request rate of `load` × `capacity_rps`."""
    turns = sum(len(g) for g in groups)
    if not groups or turns == 0:
        raise ValueError("no sessions")
    return load * capacity_rps * len(groups) / turns


def session_blocks(session: int, prompt: int) -> tuple[int, ...]:
    """The whole blocks of a prompt of `prompt` tokens of session `session` (module doc)."""
    base = session << _SESSION_SHIFT
    return tuple(range(base, base + prompt // BLOCK_TOKENS))


def sim_requests(
    sessions: Sequence[Session], *, answer_s_per_token: float = 0.02, deployment: int = 0
) -> list[SimRequest]:
    """The turns as the simulator's requests, in arrival order, numbered 0..n-1: turn k+1
    arrives the previous answer's `answer_s_per_token` × output plus its think time after turn
    k (open loop); max_tokens = the output (the answer runs to it, as the bench asks with
    ignore_eos)."""
    pending: list[tuple[float, int, int, Turn]] = []
    for s in sessions:
        at = s.start
        for k, turn in enumerate(s.turns):
            if k:
                at += s.turns[k - 1].output * answer_s_per_token + s.think_s[k - 1]
            pending.append((at, s.index, k, turn))
    pending.sort(key=lambda x: (x[0], x[1], x[2]))
    return [
        SimRequest(
            rid=i,
            arrival=at,
            prompt=turn.prompt,
            output=turn.output,
            max_tokens=turn.output,
            deployment=deployment,
            blocks=session_blocks(session, turn.prompt),
        )
        for i, (at, session, _, turn) in enumerate(pending)
    ]


def multi_turn(
    spec: DeploymentSpec,
    *,
    trace: str = "conv",
    offset: int = 0,
    count: int = 1500,
    load: float = 0.8,
    seed: int = 0,
    mean_turns: float = 4.0,
    think_mean_s: float = 5.0,
    answer_s_per_token: float = 0.02,
) -> list[SimRequest]:
    """The multi-turn workload for `spec`'s fleet: `count` rows of `trace` from `offset` grouped
    into sessions, started at the rate that offers `load` of the fleet's capacity for the
    turns' sizes (module doc)."""
    rows = [(r.prompt_tokens, r.output_tokens) for r in load_trace(trace)[offset : offset + count]]
    groups = group(rows, mean_turns=mean_turns, seed=seed)
    rate = session_rate_for(load, capacity_rps(spec, sizes(groups)), groups)
    sessions = schedule(groups, rate, think_mean_s=think_mean_s, seed=seed)
    return sim_requests(sessions, answer_s_per_token=answer_s_per_token)
