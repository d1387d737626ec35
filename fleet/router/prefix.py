"""KV-prefix reuse as the router sees it: a prompt's leading blocks hashed, an index per replica.

Engines keep the KV cache of prompt blocks they computed and reuse it when a later prompt
begins with the same blocks (TensorRT-LLM's block reuse, vLLM's prefix caching, SGLang's radix
cache): a follow-up turn of a conversation, which resends the whole history, then computes only
its new tail. The router cannot see an engine's cache, so it keeps its own picture of it:

- `text_blocks` / `token_blocks`: the prompt cut into blocks of `BLOCK_TOKENS` tokens (of text:
  `BLOCK_TOKENS` × 4 characters, the stand-in's tokenizer; fleet_agent/engine/core.py hashes the
  same boundaries), each block's hash chained to the one before it, so that block k's hash
  names the whole prefix up to it. Only whole blocks count; at most `MAX_BLOCKS`.
- `PrefixIndex`: per replica, the block hashes of the requests the router booked there, least
  recently used dropped beyond `capacity` (set to the engine's KV capacity in blocks, which
  bounds the engine's own cache). `cached(blocks, prompt)` is how many of a request's prompt
  tokens the replica should find cached: its leading blocks in the index, times the block size,
  at least one prompt token left to compute (as engines do: the last one yields the first output
  token).
- The engine's word: an index can promise what the engine no longer holds (evicted under memory
  pressure, block reuse off, another tokenizer). The index keeps the share of looked-up blocks it
  promised for the requests it booked (decayed per booking, ~ the last `1 / (1 - DECAY)`), and the
  agent reports the engine's measured prefix-cache hit rate (`engine_rate`). When the engine hits
  less than the index promised, every credit is scaled by `engine_rate / promised` (the `trust`,
  0..1); 0 from an engine that reuses nothing. Before `MIN_PROMISED` blocks were looked up, or
  without an engine figure, the index is trusted.

Pure: no I/O, no clock. The router's proxy computes a request's blocks once (`request_blocks`);
the strategy (strategy.py, `prefix_aware`) asks each candidate replica's index.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fleet.router.tokens import rendered_chat
from fleet_core import cost_model

BLOCK_TOKENS = 32  # tokens per KV block (TensorRT-LLM's default tokens_per_block; the cost model's)
CHARS_PER_TOKEN = 4  # the stand-in's tokenizer (fleet_core/tokens.py)
MAX_BLOCKS = 4096  # leading blocks hashed at most (131,072 tokens: the longest context served)
DEFAULT_CAPACITY = 32_768  # blocks, for a replica whose KV capacity is not known (~1 M tokens)
DECAY = 0.99  # per booking: the promised share is over about the last 100 requests
MIN_PROMISED = 256.0  # blocks looked up (decayed) before the engine's rate is weighed against it
# What a cached prompt token takes off a request's estimate on that replica, in prefill
# weights (strategy.py, `prefix_aware`): 1 is the prefill it skips, the rest a bonus priced at
# the fastest candidate's throughput. Measured on the multi-turn workload (docs/router.md,
# "Prefix-aware routing"), 1 keeps only half the follow-up turns on their cache, while 3 keeps
# most (TTFT p95 0.35-0.42 × ECT's over ten seeds, latency p95 0.92-1.00 ×). The bonus is
# bounded: the cached replica keeps the turn while its estimate is at most 2 × 0.15 work units
# per cached token above another's (a 7,000-token history: 0.37 s at an H200's 5,636 a second).
PREFIX_CREDIT = 3.0


def _chain(previous: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(previous + data, digest_size=8).digest()


def text_blocks(text: str, block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hashes of the whole blocks of `text` (ceil(len / 4) tokens, `block_tokens`
    a block, as the stand-in counts and cuts them)."""
    tokens = -(-len(text) // CHARS_PER_TOKEN)
    n = min(tokens // block_tokens, MAX_BLOCKS)
    width = block_tokens * CHARS_PER_TOKEN
    out: list[int] = []
    previous = b""
    for k in range(n):
        previous = _chain(previous, text[k * width : (k + 1) * width].encode())
        out.append(int.from_bytes(previous, "big"))
    return tuple(out)


def token_blocks(ids: list[int], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hashes of the whole blocks of a token-id prompt."""
    n = min(len(ids) // block_tokens, MAX_BLOCKS)
    out: list[int] = []
    previous = b""
    for k in range(n):
        chunk = ",".join(str(t) for t in ids[k * block_tokens : (k + 1) * block_tokens])
        previous = _chain(previous, chunk.encode())
        out.append(int.from_bytes(previous, "big"))
    return tuple(out)


def request_blocks(body: dict[str, Any], chat: bool) -> tuple[int, ...]:
    """The leading-block hashes of an OpenAI request body's prompt: chat messages rendered as
    the stand-in renders them (and fleet/router/tokens.py counts them), a text prompt as is, a
    token-id prompt by its ids. A batch of prompts (a list of strings) has none: it is not one
    prefix."""
    if chat:
        return text_blocks(rendered_chat(body))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return text_blocks(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return token_blocks(prompt)
    return ()


class PrefixIndex:
    """One replica's prefix blocks as the router booked them (an LRU of block hashes)."""

    # Written out, not a dataclass: the simulator's compiled build (fleet/sim/native.py) makes
    # one per replica and calls it for every candidate of every prefix-aware choice.
    def __init__(self, capacity: int = DEFAULT_CAPACITY, block_tokens: int = BLOCK_TOKENS) -> None:
        self.capacity = capacity if capacity > 0 else 1
        self.block_tokens = block_tokens
        self.blocks: dict[int, None] = {}  # insertion order = recency (oldest first)
        self.promised = 0.0  # decayed: blocks the index found for the requests booked
        self.looked_up = 0.0  # decayed: blocks of the requests booked
        self.engine_rate: float | None = None  # the engine's prefix-cache hit rate (its agent)

    def __len__(self) -> int:
        return len(self.blocks)

    def leading(self, blocks: tuple[int, ...]) -> int:
        """How many of `blocks`, from the first, the index holds."""
        held = self.blocks
        n = 0
        for h in blocks:
            if h not in held:
                break
            n += 1
        return n

    def trust(self) -> float:
        """The share of the index's promise the engine keeps (module doc), 0..1."""
        rate = self.engine_rate
        if rate is None or self.looked_up < MIN_PROMISED or self.promised <= 0.0:
            return 1.0
        share = self.promised / self.looked_up
        t = rate / share
        return 0.0 if t < 0.0 else (1.0 if t > 1.0 else t)

    def cached(self, blocks: tuple[int, ...], prompt_tokens: int) -> float:
        """Prompt tokens of a request with these leading blocks that the replica should find in
        its KV cache, discounted by `trust`; at least one token is left to compute."""
        if not blocks:
            return 0.0
        n = self.leading(blocks)
        if n == 0:
            return 0.0
        top = (prompt_tokens - 1) // self.block_tokens
        tokens = (n if n < top else top) * self.block_tokens
        return tokens * self.trust() if tokens > 0 else 0.0

    def insert(self, blocks: tuple[int, ...], prompt_tokens: int) -> None:
        """A request with these blocks was booked here: count what the index promised for it,
        then hold its blocks as the most recent (the engine computes and keeps them), dropping
        the least recently used beyond `capacity`."""
        if not blocks:
            return
        top = (prompt_tokens - 1) // self.block_tokens
        hit = self.leading(blocks)
        self.promised = self.promised * DECAY + (hit if hit < top else top)
        self.looked_up = self.looked_up * DECAY + len(blocks)
        held = self.blocks
        for h in blocks:
            if h in held:
                del held[h]  # move to the end: the most recent
            held[h] = None
        excess = len(held) - self.capacity
        if excess > 0:
            oldest = iter(held)
            drop = [next(oldest) for _ in range(excess)]  # the first `excess`: the oldest
            for h in drop:
                del held[h]

    def view(self) -> dict[str, Any]:
        """For the router's /state."""
        looked = self.looked_up
        return {
            "blocks": len(self.blocks),
            "capacity": self.capacity,
            "promised_hit_rate": round(self.promised / looked, 4) if looked > 0 else None,
            "engine_hit_rate": self.engine_rate,
            "trust": round(self.trust(), 4),
        }


def index_capacity(gpu_model: str, model: str, *, tp_size: int = 1) -> int:
    """The KV capacity in blocks that the engine cost model gives `model` on `gpu_model` (an
    engine's prefix cache holds no more); `DEFAULT_CAPACITY` for hardware it does not know."""
    try:
        shape = cost_model.EngineShape(
            gpu=cost_model.gpu_spec(gpu_model),
            model=cost_model.guess_model(model),
            tp_size=max(1, tp_size),
        )
        blocks = cost_model.kv_capacity_blocks(shape)
    except ValueError:
        return DEFAULT_CAPACITY
    return blocks if blocks > 0 else DEFAULT_CAPACITY
