"""The continuous-batching engine of the stand-in, one iteration at a time, without a clock.

`EngineCore.step()` does what one TensorRT-LLM executor iteration does and says how long it took
according to the cost model (fleet_core/cost_model.py) and what each GPU drew meanwhile
according to the power model (fleet_core/power_model.py); under a power limit (`power_limit_w`,
per GPU) the iteration takes the power model's capped time. It never sleeps and never reads the
wall clock, so the stand-in server (fleet_agent/engine/standin/) drives it in real time and a
discrete-event simulator can drive it in simulated time with the same code.

What it models, following trtllm-serve's defaults:

- Capacity scheduling is GUARANTEED_NO_EVICT (the policy `trtllm-serve` configures): a waiting
  request is admitted, first come first served, only when KV blocks for its prompt plus its
  max_tokens are free after the reservations of every running request, and while fewer than
  max_batch_size requests run. Nothing is ever evicted or paused.
- KV cache: blocks of `tokens_per_block` (32) tokens, as many as the cost model's capacity. A
  running request holds ceil(cached tokens / 32) blocks; its reservation is larger until it ends.
  Prompt blocks are hashed by prefix: a later prompt sharing whole leading blocks reuses them
  (TensorRT-LLM's `enable_block_reuse`, on by default) and skips their prefill; at least one prompt
  token is always computed. Reused blocks are counted, not shared (memory is charged twice).
- Each iteration (micro-batch) schedules every generation request for one token, then context
  requests first come first served while max_batch_size requests and max_num_tokens tokens allow.
  With chunked prefill a context request may take what is left of the token budget (in whole
  blocks unless it is its last chunk); without it a prompt must fit whole, and a prompt longer
  than max_num_tokens is refused when it arrives. The iteration that computes the last prompt
  token also produces the first output token.
- Tokens: a prompt has ceil(len(text) / 4) tokens (OpenAI's rule of thumb of 4 characters per
  token). One output token is one word from a fixed vocabulary, " word", drawn from a generator
  seeded by the prompt and the seed, so the text is the same for the same prompt and seed.
- Output length: the "natural" length the model would write before its end-of-sequence token is
  a hash of prompt and seed, log-uniform in 16..1024 (median 128), then capped by max_tokens
  (finish_reason "length" when capped, "stop" otherwise); `ignore_eos` makes it max_tokens
  exactly, as benchmark clients ask. A stop string ends the output at the token that completes
  it ("stop"; that token's text is cut before the stop string). Without max_tokens a request may
  write up to max_seq_len - prompt tokens and reserves KV for all of them, as in TensorRT-LLM.

What it models for the other engines (CoreConfig; the defaults above are trtllm-serve's):

- `policy="priority"`: the waiting request with the lowest (priority, arrival) is admitted next
  (vLLM's `--scheduling-policy priority`, SGLang's `--enable-priority-scheduling`; the stand-in's
  SGLang dialect negates SGLang's higher-first values). "fcfs" (default): arrival order.
- `kv_policy="preempt"` (vLLM V1's and SGLang's way; "reserve" is GUARANTEED_NO_EVICT above): a
  waiting request is admitted when blocks for its prompt (and its first output token) are free,
  and holds them; a running request takes a new block when its next token crosses a block
  boundary, and when none is free a running request is preempted — the newest under "fcfs",
  the one with the largest (priority, arrival) under "priority" (vLLM V1's Scheduler.schedule):
  its blocks are freed and it goes back to the head of the waiting queue. Resumed, it
  recomputes its prompt and the tokens it already wrote (vLLM V1 preempts by recompute), then
  goes on writing. No request is admitted in an iteration that preempted (as in vLLM V1).
  `num_preemptions` counts them all. Blocks are held for the whole prompt at admission (vLLM
  allocates per chunk).
- `priority_preemption_threshold` (SGLang's `--priority-scheduling-preemption-threshold`): a
  waiting request that cannot be admitted (no batch slot or blocks) preempts the running request
  with the largest (priority, arrival) when that one's priority is worse by more than the
  threshold. None (default): never.
- `kv_capacity_tokens` caps the KV pool (SGLang's `--max-total-tokens`).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet_core import cost_model, power_model
from fleet_core.cost_model import EngineShape

# The token rule is the core's (the router counts with it too); re-exported for the stand-in.
from fleet_core.tokens import CHARS_PER_TOKEN, count_tokens

FinishReason = Literal["stop", "length"]

NATURAL_MIN_TOKENS = 16
NATURAL_MAX_TOKENS = 1024

# Words for generated text: common English words, so that output reads like (meaningless) prose.
_WORDS = """the of and to in is that it for was on are as with his they at be this from have or by
    one had not but what all were when we there can an your which their said if do will each
    about how up out them then she many some so these would other into has more her two like him
    see time could no make than first been its who now people my made over did down only way
    find use may water long little very after words called just where most know get through back
    much before go good new write our used me man too any day same right look think also around
    another came come work three word must because does part even place well such here take why
    things help put years different away again off went old number great tell men say small
    every found still between name should home big give air line set own under read last never
    us left end along while might next sound below saw something thought both few those always
    looked show large often together asked house world going want school important until form
    food keep children feet land side without boy once animals life enough took sometimes four
    head above kind began almost live page got earth need far hand high year mother light parts
    country father let night following picture being study second eyes soon times story boys
    since white days ever paper hard near sentence better best across during today others sure
    means however leave behind system data model server power rack engine token cache"""
VOCABULARY: tuple[str, ...] = tuple(_WORDS.split())


def _digest(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.digest()


def natural_output_tokens(prompt: str, seed: str) -> int:
    """How many tokens the simulated model writes before its end-of-sequence token."""
    u = int.from_bytes(_digest("length", seed, prompt)[:8], "big") / 2**64
    span = NATURAL_MAX_TOKENS / NATURAL_MIN_TOKENS
    return min(NATURAL_MAX_TOKENS, int(NATURAL_MIN_TOKENS * span**u))


class RequestRejected(ValueError):
    """A request this engine can never run (too long for max_seq_len, the token budget or the KV
    cache). The server answers 400 with the message."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as the server hands it to the core."""

    request_id: str
    prompt: str
    prompt_tokens: int | None = None  # default: count_tokens(prompt)
    max_tokens: int | None = None  # default: up to max_seq_len - prompt tokens
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed, mixed with the engine's
    priority: int = 0  # lower runs first, under CoreConfig.policy "priority"


@dataclass(frozen=True)
class TokenOut:
    request_id: str
    index: int  # 0 for a request's first output token
    text: str


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float


@dataclass(frozen=True)
class IterationResult:
    iteration: int
    duration_s: float
    prefill: tuple[tuple[str, int], ...]  # (request id, prompt tokens computed this iteration)
    decoded: tuple[str, ...]  # requests in generation phase that produced one token
    tokens: tuple[TokenOut, ...]  # every output token of this iteration, first tokens included
    finished: tuple[Finished, ...]
    stats: dict[str, Any]  # one `/metrics` entry, TensorRT-LLM's field names
    power_w: float = 0.0  # per GPU of the group, during the iteration (power model)
    capped: bool = False  # the power limit slowed this iteration down
    preempted: tuple[str, ...] = ()  # requests preempted in this iteration (kv_policy "preempt")


@dataclass
class _Request:
    spec: GenerationRequest
    prompt_tokens: int
    max_new_tokens: int
    target_tokens: int
    natural: bool  # target is the natural length: the request ends with "stop", not "length"
    reserved_blocks: int
    block_hashes: list[bytes]
    rng: random.Random
    arrival_time: float
    computed: int = 0  # prompt tokens in the KV cache (computed or reused)
    cached_prompt_tokens: int = 0
    generated: int = 0
    text_tail: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    started: bool = False  # the prefix-reuse lookup has happened
    seq: int = 0  # arrival order: the tie-break after priority
    context_tokens: int = 0  # tokens to prefill: the prompt, plus what it wrote when preempted
    held_blocks: int = 0  # blocks it holds (kv_policy "preempt")
    preemptions: int = 0

    @property
    def in_generation(self) -> bool:
        return self.computed >= self.context_tokens

    @property
    def cached_tokens(self) -> int:
        # The output tokens recomputed after a preemption are part of `computed`.
        return self.computed + self.generated - (self.context_tokens - self.prompt_tokens)

    def key(self) -> tuple[int, int]:
        return (self.spec.priority, self.seq)


SchedulingPolicy = Literal["fcfs", "priority"]
KvPolicy = Literal["reserve", "preempt"]


@dataclass(frozen=True)
class CoreConfig:
    shape: EngineShape
    max_seq_len: int | None = None  # default: the model's context, at most the KV capacity
    enable_chunked_prefill: bool = False  # trtllm-serve's default
    enable_block_reuse: bool = True  # TensorRT-LLM's default
    seed: int = 0
    policy: SchedulingPolicy = "fcfs"
    kv_policy: KvPolicy = "reserve"  # GUARANTEED_NO_EVICT, trtllm-serve's
    priority_preemption_threshold: int | None = None  # SGLang's; None: waiting never preempts
    kv_capacity_tokens: int | None = None  # cap on the KV pool (default: the cost model's)


class _WaitingQueue:
    """Waiting requests: arrival order ("fcfs", a preempted request goes back to the head) or
    a heap on (priority, arrival) ("priority", as vLLM's PriorityRequestQueue)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fifo: deque[_Request] = deque()
        self._heap: list[tuple[tuple[int, int], _Request]] = []

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __bool__(self) -> bool:
        return len(self) > 0

    def append(self, r: _Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (r.key(), r))
        else:
            self._fifo.append(r)

    def prepend(self, r: _Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (r.key(), r))
        else:
            self._fifo.appendleft(r)

    def peek(self) -> _Request:
        return self._heap[0][1] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> _Request:
        return heapq.heappop(self._heap)[1] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request_id: str) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[1].spec.request_id != request_id]
            heapq.heapify(self._heap)
        else:
            self._fifo = deque(r for r in self._fifo if r.spec.request_id != request_id)


@dataclass
class _KvCounters:
    alloc_total: int = 0
    alloc_new: int = 0
    reused: int = 0
    missed: int = 0
    prompt_blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


def _timestamp(epoch_s: float) -> str:
    # TensorRT-LLM's iteration stats carry local time as "MM-DD-YYYY HH:MM:SS".
    return time.strftime("%m-%d-%Y %H:%M:%S", time.localtime(epoch_s))


class EngineCore:
    """Waiting queue, running set and KV block pool of one engine; `step()` runs one iteration.

    `clock` gives the time at which `add_request` and `step` are called (seconds; the stand-in
    passes time.time); without one the core keeps its own simulated clock, which starts at 0 and
    advances by each iteration's duration.
    """

    def __init__(self, config: CoreConfig, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.shape = config.shape
        self.max_blocks = cost_model.kv_capacity_blocks(self.shape)
        if config.kv_capacity_tokens is not None:
            cap = config.kv_capacity_tokens // self.shape.tokens_per_block
            self.max_blocks = min(self.max_blocks, cap)
        if self.max_blocks < 1:
            raise ValueError(
                f"{self.shape.model.name} at {self.shape.precision} does not fit "
                f"{self.shape.gpus} × {self.shape.gpu.name} with room for a KV cache"
            )
        capacity = self.max_blocks * self.shape.tokens_per_block
        self.max_seq_len = config.max_seq_len or min(
            self.shape.model.max_position_embeddings, capacity
        )
        self._clock = clock
        self._sim_time = 0.0
        self._waiting = _WaitingQueue(config.policy)
        self._active: dict[str, _Request] = {}  # admitted, in admission order
        self._ids: set[str] = set()  # waiting or active
        self._iteration = 0
        self._kv = _KvCounters()
        self._arrivals = itertools.count()
        self.num_preemptions = 0  # cumulative (kv_policy "preempt", priority preemption)
        self._held = 0  # blocks held by active requests (kv_policy "preempt"), kept as they move
        self._gpu_mem = cost_model.gpu_memory_used_bytes(self.shape)
        # The per-GPU power limit the GPUs enforce (None: their default, the TDP); the stand-in
        # sets it from the simulated driver's state.
        self.power_limit_w: float | None = None

    # --- state ----------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock() if self._clock is not None else self._sim_time

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def used_blocks(self) -> int:
        """Blocks in use: filled ones ("reserve"), held ones ("preempt")."""
        if self.config.kv_policy == "preempt":
            return self._held
        return sum(self._blocks(r.cached_tokens) for r in self._active.values())

    @property
    def reserved_blocks(self) -> int:
        return sum(r.reserved_blocks for r in self._active.values())

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt blocks found in the prefix cache ÷ blocks looked up, since the start."""
        lookups = self._kv.reused + self._kv.missed
        return self._kv.reused / lookups if lookups else 0.0

    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.shape.tokens_per_block)

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, spec: GenerationRequest) -> None:
        """Queue a request; raises RequestRejected if it could never run here."""
        if spec.request_id in self._ids:
            raise ValueError(f"duplicate request id {spec.request_id!r}")
        prompt_tokens = spec.prompt_tokens or count_tokens(spec.prompt)
        if spec.max_tokens is not None and spec.max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        max_new = (
            spec.max_tokens if spec.max_tokens is not None else self.max_seq_len - prompt_tokens
        )
        if prompt_tokens + max_new > self.max_seq_len or max_new < 1:
            raise RequestRejected(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_new}) exceeds "
                f"max_seq_len ({self.max_seq_len})"
            )
        if not self.config.enable_chunked_prefill and prompt_tokens > self.shape.max_num_tokens:
            raise RequestRejected(
                f"prompt ({prompt_tokens} tokens) exceeds max_num_tokens "
                f"({self.shape.max_num_tokens}) and chunked prefill is off"
            )
        reserved = self._blocks(prompt_tokens + max_new)
        if reserved > self.max_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {reserved} KV blocks; the cache has {self.max_blocks}"
            )
        seed = f"{self.config.seed}/{spec.seed}"
        natural = natural_output_tokens(spec.prompt, seed)
        if spec.ignore_eos or natural > max_new:
            target, is_natural = max_new, False
        else:
            target, is_natural = natural, True
        rng = random.Random(int.from_bytes(_digest("text", seed, spec.prompt), "big"))
        self._ids.add(spec.request_id)
        self._waiting.append(
            _Request(
                spec=spec,
                prompt_tokens=prompt_tokens,
                max_new_tokens=max_new,
                target_tokens=target,
                natural=is_natural,
                reserved_blocks=reserved,
                block_hashes=self._prompt_block_hashes(spec.prompt, prompt_tokens),
                rng=rng,
                arrival_time=self.now(),
                seq=next(self._arrivals),
                context_tokens=prompt_tokens,
            )
        )

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone); its blocks are free at once. False if unknown."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        active = self._active.pop(request_id, None)
        if active is None:
            self._waiting.remove(request_id)
        else:
            self._held -= active.held_blocks
        return True

    def _prompt_block_hashes(self, prompt: str, prompt_tokens: int) -> list[bytes]:
        if not self.config.enable_block_reuse:
            return []
        per_block = self.shape.tokens_per_block * CHARS_PER_TOKEN
        hashes: list[bytes] = []
        previous = b""
        for k in range(prompt_tokens // self.shape.tokens_per_block):
            previous = hashlib.blake2b(
                previous + prompt[k * per_block : (k + 1) * per_block].encode(), digest_size=16
            ).digest()
            hashes.append(previous)
        return hashes

    # --- one iteration ----------------------------------------------------------------------

    def step(self) -> IterationResult:
        """Admit, schedule and run one iteration. Call only while has_work()."""
        start = self.now()
        preempted: list[str] = []
        if self.config.kv_policy == "preempt":
            self._grow_running(preempted)
            # vLLM V1 admits nothing in a step that preempted.
            new_active = 0 if preempted else self._admit(preempted)
        else:
            new_active = self._admit(preempted)
        bs = self.shape.max_batch_size
        budget = self.shape.max_num_tokens

        decoding = [r for r in self._active.values() if r.in_generation][:bs]
        budget -= len(decoding)
        slots = bs - len(decoding)
        context: list[tuple[_Request, int]] = []
        for r in self._active.values():
            if r.in_generation:
                continue
            if slots <= 0 or budget <= 0:
                break
            if not r.started:
                self._lookup_prefix(r)
            chunk = self._context_chunk(r, budget)
            if chunk <= 0 and not decoding and not context:
                # Alone and still too long for the token budget: only a preempted request,
                # whose recompute (prompt + what it wrote) outgrew max_num_tokens, gets here
                # (a new prompt that long is refused on arrival). It runs whole, as vLLM needs
                # max_num_batched_tokens ≥ max_model_len without chunked prefill.
                chunk = r.context_tokens - r.computed
            if chunk <= 0:
                break
            context.append((r, chunk))
            budget -= chunk
            slots -= 1
            if r.first_scheduled_time is None:
                r.first_scheduled_time = start

        if not decoding and not context:
            raise RuntimeError("step() called with nothing schedulable; check has_work()")

        ctx_tokens = sum(chunk for _, chunk in context)
        kv_read = sum(r.cached_tokens for r in decoding) + sum(
            r.computed + chunk for r, chunk in context
        )
        split = cost_model.iteration_split(self.shape, len(decoding), ctx_tokens, kv_read)
        duration, power_w = power_model.capped_split(self.shape.gpu, split, self.power_limit_w)
        capped = duration > split.total_s
        end = start + duration
        if self._clock is None:
            self._sim_time = end

        tokens: list[TokenOut] = []
        finished: list[Finished] = []
        for r in decoding:
            self._emit(r, end, tokens, finished)
        for r, chunk in context:
            before = self._blocks(r.computed)
            r.computed += chunk
            self._allocate(self._blocks(r.computed) - before)
            self._remember_blocks(r)
            if r.in_generation:
                self._emit(r, end, tokens, finished)

        self._iteration += 1
        for f in finished:
            self._held -= self._active.pop(f.request_id).held_blocks
            self._ids.discard(f.request_id)
        stats = self._stats(
            start=start,
            duration=duration,
            active=len(self._active) + len(finished),
            new_active=new_active,
            completed=len(finished),
            scheduled=len(decoding) + len(context),
            context_requests=len(context),
            gen_requests=len(decoding),
            ctx_tokens=ctx_tokens,
            paused=len(preempted),
        )
        return IterationResult(
            iteration=self._iteration,
            duration_s=duration,
            prefill=tuple((r.spec.request_id, chunk) for r, chunk in context),
            decoded=tuple(r.spec.request_id for r in decoding),
            tokens=tuple(tokens),
            finished=tuple(finished),
            stats=stats,
            power_w=power_w,
            capped=capped,
            preempted=tuple(preempted),
        )

    def _allocate(self, blocks: int) -> None:
        self._kv.alloc_total += blocks
        self._kv.alloc_new += blocks

    def _admit(self, preempted: list[str]) -> int:
        preempt = self.config.kv_policy == "preempt"
        reserved = self.used_blocks if preempt else self.reserved_blocks
        admitted = 0
        for _ in range(len(self._waiting) + len(self._active) + 1):
            if not self._waiting:
                break
            head = self._waiting.peek()
            # Its prompt and the slot of its first output token (vLLM allocates that one at the
            # next step; here it is held from admission, so a prompt never strands a token).
            need = self._blocks(head.context_tokens + 1) if preempt else head.reserved_blocks
            if len(self._active) >= self.shape.max_batch_size or reserved + need > self.max_blocks:
                victim = self._priority_victim(head)
                if victim is None:
                    break  # nobody overtakes the head of the queue
                reserved -= victim.held_blocks if preempt else victim.reserved_blocks
                self._preempt(victim, preempted)
                continue
            self._waiting.pop()
            self._active[head.spec.request_id] = head
            if preempt:
                head.held_blocks = need
                self._held += need
            reserved += need
            admitted += 1
        return admitted

    def _priority_victim(self, head: _Request) -> _Request | None:
        """The running request a waiting one may preempt (SGLang's priority preemption)."""
        threshold = self.config.priority_preemption_threshold
        if threshold is None or self.config.policy != "priority" or not self._active:
            return None
        victim = max(self._active.values(), key=_Request.key)
        return victim if victim.spec.priority - head.spec.priority > threshold else None

    def _grow_running(self, preempted: list[str]) -> None:
        """kv_policy "preempt": every running request in generation takes the block its next
        token needs; when none is free, preempt (vLLM V1) until it fits or it is itself the
        victim."""
        for r in list(self._active.values()):
            if r.spec.request_id not in self._active or not r.in_generation:
                continue
            self._hold_next_token(r, preempted)

    def _hold_next_token(self, r: _Request, preempted: list[str]) -> None:
        need = self._blocks(r.cached_tokens + 1) - r.held_blocks
        for _ in range(len(self._active) + 1):
            if need <= 0:
                return
            if self.max_blocks - self._held >= need:
                r.held_blocks += need
                self._held += need
                return
            victim = self._newest_victim()
            self._preempt(victim, preempted)
            if victim is r:
                return

    def _newest_victim(self) -> _Request:
        if self.config.policy == "priority":
            return max(self._active.values(), key=_Request.key)
        return next(reversed(self._active.values()))

    def _preempt(self, r: _Request, preempted: list[str]) -> None:
        """Free its blocks and send it back to the head of the waiting queue; it recomputes
        its prompt and what it wrote when admitted again."""
        del self._active[r.spec.request_id]
        self._held -= r.held_blocks
        r.held_blocks = 0
        r.context_tokens = r.prompt_tokens + r.generated
        r.computed = 0
        r.started = False
        r.preemptions += 1
        self.num_preemptions += 1
        self._waiting.prepend(r)
        preempted.append(r.spec.request_id)

    def _lookup_prefix(self, r: _Request) -> None:
        r.started = True
        if not r.block_hashes:
            return
        cache = self._kv.prompt_blocks
        hit = 0
        for h in r.block_hashes:
            if h not in cache:
                break
            cache.move_to_end(h)
            hit += 1
        # Always compute at least the last prompt token (it yields the first output token).
        hit = min(hit, (r.prompt_tokens - 1) // self.shape.tokens_per_block)
        self._kv.reused += hit
        self._kv.missed += len(r.block_hashes) - hit
        self._kv.alloc_total += hit
        r.computed = hit * self.shape.tokens_per_block
        if not r.preemptions:
            r.cached_prompt_tokens = r.computed

    def _remember_blocks(self, r: _Request) -> None:
        cache = self._kv.prompt_blocks
        full = min(len(r.block_hashes), r.computed // self.shape.tokens_per_block)
        for h in r.block_hashes[:full]:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.max_blocks:
            cache.popitem(last=False)

    def _context_chunk(self, r: _Request, budget: int) -> int:
        remaining = r.context_tokens - r.computed
        if remaining <= budget:
            return remaining
        if not self.config.enable_chunked_prefill:
            return 0
        per_block = self.shape.tokens_per_block
        aligned = (budget // per_block) * per_block  # chunks end on block boundaries
        return aligned if aligned > 0 else budget

    def _emit(
        self, r: _Request, at: float, tokens: list[TokenOut], finished: list[Finished]
    ) -> None:
        before = self._blocks(r.cached_tokens)
        word = " " + VOCABULARY[r.rng.randrange(len(VOCABULARY))]
        index = r.generated
        r.generated += 1
        self._allocate(self._blocks(r.cached_tokens) - before)
        if r.first_token_time is None:
            r.first_token_time = at
        reason: FinishReason | None = None
        text = word
        if r.spec.stop:
            tail = r.text_tail + word
            cut = _stop_at(tail, r.spec.stop)
            if cut is not None:
                keep = cut - len(r.text_tail)
                text = word[: max(0, keep)]
                reason = "stop"
            r.text_tail = tail[-(max(len(s) for s in r.spec.stop) + 1) :]
        if reason is None and r.generated >= r.target_tokens:
            reason = "stop" if r.natural else "length"
        tokens.append(TokenOut(r.spec.request_id, index, text))
        if reason is not None:
            finished.append(
                Finished(
                    request_id=r.spec.request_id,
                    finish_reason=reason,
                    prompt_tokens=r.prompt_tokens,
                    completion_tokens=r.generated,
                    cached_prompt_tokens=r.cached_prompt_tokens,
                    arrival_time=r.arrival_time,
                    first_scheduled_time=(
                        r.arrival_time if r.first_scheduled_time is None else r.first_scheduled_time
                    ),
                    first_token_time=r.first_token_time,
                    finish_time=at,
                )
            )

    def _stats(
        self,
        *,
        start: float,
        duration: float,
        active: int,
        new_active: int,
        completed: int,
        scheduled: int,
        context_requests: int,
        gen_requests: int,
        ctx_tokens: int,
        paused: int,
    ) -> dict[str, Any]:
        used = self.used_blocks
        kv = self._kv
        lookups = kv.reused + kv.missed
        return {
            "iter": self._iteration,
            "iterLatencyMS": duration * 1e3,
            "timestamp": _timestamp(start + duration),
            "newActiveRequestsQueueLatencyMS": 0.0,
            "numNewActiveRequests": new_active,
            "numActiveRequests": active,
            "numQueuedRequests": len(self._waiting),
            "numCompletedRequests": completed,
            "maxNumActiveRequests": self.shape.max_batch_size,
            "maxBatchSizeStatic": self.shape.max_batch_size,
            "maxBatchSizeRuntime": self.shape.max_batch_size,
            "maxNumTokensStatic": self.shape.max_num_tokens,
            "maxNumTokensRuntime": self.shape.max_num_tokens,
            "gpuMemUsage": self._gpu_mem,
            "cpuMemUsage": 0,  # not reported by the PyTorch backend
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": self.max_blocks,
                "freeNumBlocks": self.max_blocks - used,
                "usedNumBlocks": used,
                "tokensPerBlock": self.shape.tokens_per_block,
                "allocTotalBlocks": kv.alloc_total,
                "allocNewBlocks": kv.alloc_new,
                "reusedBlocks": kv.reused,
                "missedBlocks": kv.missed,
                "cacheHitRate": kv.reused / lookups if lookups else 0.0,
            },
            "inflightBatchingStats": {
                "numScheduledRequests": scheduled,
                "numContextRequests": context_requests,
                "numGenRequests": gen_requests,
                "numPausedRequests": paused,  # 0 under GUARANTEED_NO_EVICT
                "numCtxTokens": ctx_tokens,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 1.0 if gen_requests else 0.0,
            },
        }


def _stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
