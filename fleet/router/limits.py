"""Per-key rate limits and per-tenant concurrency shares: pure bookkeeping, no I/O.

A key's requests-per-minute and tokens-per-minute are enforced over a sliding window of
`window_s` seconds: the key may use `limit × window_s / 60` of each in any window (at least one
request). Each key's window is a ring of `BUCKETS` buckets, so a request costs O(1) amortised
and a key's memory is bounded whatever its rate. A bucket's figures count until the whole
bucket has left the window: the window errs on the strict side by at most window_s / BUCKETS.

Several routers share a key's limit through the fleet: each sends what it admitted per key over
its window (`usage`) in its load report and gets the others' sums back (`set_others`), which
count against the key here until the next answer. The others' figures are a report behind: if
each router took all the headroom it knew of, then whenever the window freed on both at once
(every window, once two routers had filled one together) both would take it, and the key would
get twice its allowance window after window. So until the next answer a router also keeps to
its part of the allowance, as of the answer: its own use then, plus an even part of the headroom
then (the allowance less everyone's use, split among the routers the fleet counted), less its
part of any overshoot (in proportion to its use). Parts follow use, so a router whose clients
send more keeps more, and the headroom goes to whoever asks first after the next answer.
Together the routers may pass the limit by what they admit in one report interval while the
fleet has not yet counted them all (docs/router.md, "Callers").

Tokens are the prompt's tokens plus the expected output at admission, settled to the prompt plus
the actual output when the request ends (`settle`). A request is admitted while the key's tokens
in the window are under the allowance (the request's own size is not checked against it, so one
large request is never refused forever); requests are admitted only with room for one more.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

BUCKETS = 60  # per window
MIN_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class KeyLimits:
    """What a key may do: None is unlimited."""

    key_id: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Refusal:
    """Over a limit: which one (the message names the limit, never the key) and when to retry."""

    message: str
    retry_after_s: int


class _Bucket:
    __slots__ = ("requests", "start", "tokens")

    def __init__(self, start: float) -> None:
        self.start = start
        self.requests = 0.0
        self.tokens = 0.0


class KeyWindow:
    """One key's admitted requests and tokens over the trailing window, in buckets."""

    __slots__ = ("buckets", "requests", "tokens", "width", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.width = window_s / BUCKETS
        self.buckets: deque[_Bucket] = deque()
        self.requests = 0.0  # the sums over `buckets`
        self.tokens = 0.0

    def expire(self, now: float) -> None:
        """Drop the buckets whose whole span has left the window."""
        buckets, horizon = self.buckets, now - self.window_s - self.width
        while buckets and buckets[0].start <= horizon:
            gone = buckets.popleft()
            self.requests -= gone.requests
            self.tokens -= gone.tokens
        if not buckets:  # no drift from float sums
            self.requests = self.tokens = 0.0

    def add(self, now: float, requests: float, tokens: float) -> None:
        buckets = self.buckets
        if not buckets or now >= buckets[-1].start + self.width:
            self.expire(now)  # a new bucket: the old ones go, so at most BUCKETS + 2 remain
            start = math.floor(now / self.width) * self.width
            buckets.append(_Bucket(start))
        last = buckets[-1]
        last.requests += requests
        last.tokens += tokens
        self.requests += requests
        self.tokens += tokens

    def freed_by(self, now: float) -> list[tuple[float, float, float]]:
        """(seconds from now, requests, tokens) each bucket frees as it leaves the window."""
        return [
            (max(0.0, b.start + self.width + self.window_s - now), b.requests, b.tokens)
            for b in self.buckets
        ]


class RateLimiter:
    """Every key's window on this router, plus the other routers' usage from the fleet."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.windows: dict[str, KeyWindow] = {}
        self.others: dict[str, tuple[float, float]] = {}  # key id -> (requests, tokens)
        self.others_at = -math.inf  # when the others' figures came
        # key id -> this router's own (requests, tokens) in the window when they came
        self.own_at_answer: dict[str, tuple[float, float]] = {}
        self.peers = 0  # the other routers sharing the fleet's exchange, as it last counted

    def allowance(self, per_minute: int) -> float:
        return max(1.0, per_minute * self.window_s / 60.0)

    def check(self, key: KeyLimits, now: float) -> Refusal | None:
        """None when `key` may send one more request now, else why not and when to retry."""
        if not key.limited:
            return None
        window = self.windows.get(key.key_id)
        if window is not None:
            window.expire(now)
        own_r = window.requests if window is not None else 0.0
        own_t = window.tokens if window is not None else 0.0
        other_r, other_t = self.others_from(key.key_id, now)
        rpm, tpm = key.requests_per_minute, key.tokens_per_minute
        if rpm is not None:
            allowed = self.allowance(rpm)
            part = self._part(allowed, key.key_id, 0, other_r, now)
            excess = max(own_r + other_r + 1.0 - allowed, own_r + 1.0 - part)
            if excess > 1e-9:
                return Refusal(
                    f"over this key's limit of {rpm} requests per minute",
                    self._retry_after(window, other_r, excess, 1, now),
                )
        if tpm is not None:
            allowed = self.allowance(tpm)
            used = own_t + other_t
            part = self._part(allowed, key.key_id, 1, other_t, now)
            if used >= allowed or own_t >= part:
                excess = max(used - allowed, own_t - part) + 1e-6
                return Refusal(
                    f"over this key's limit of {tpm} tokens per minute",
                    self._retry_after(window, other_t, excess, 2, now),
                )
        return None

    def admit(self, key: KeyLimits, now: float, tokens: float) -> None:
        """Count an admitted request with its expected tokens (only keys with a limit)."""
        if not key.limited:
            return
        window = self.windows.get(key.key_id)
        if window is None:
            window = self.windows[key.key_id] = KeyWindow(self.window_s)
        window.add(now, 1.0, tokens)

    def settle(self, key: KeyLimits, now: float, tokens: float) -> None:
        """The request ended: `tokens` more (or fewer, if negative) than counted at admission.
        Counted in the current bucket; never below zero in the window's sum."""
        window = self.windows.get(key.key_id) if key.limited else None
        if window is None or tokens == 0:
            return
        window.expire(now)
        window.add(now, 0.0, max(tokens, -window.tokens))

    def others_from(self, key_id: str, now: float) -> tuple[float, float]:
        """The other routers' usage of a key; forgotten once a whole window old (the fleet
        has not answered since)."""
        if now - self.others_at > self.window_s:
            return 0.0, 0.0
        return self.others.get(key_id, (0.0, 0.0))

    def set_others(
        self, others: dict[str, tuple[float, float]], now: float, peers: int | None = None
    ) -> None:
        """The fleet's answer: the other routers' usage per key, and how many other routers
        share the exchange (None from a fleet that does not say: as many as use a key)."""
        self.others, self.others_at = others, now
        self.own_at_answer = self.usage(now)
        self.peers = peers if peers is not None else (1 if others else 0)

    def _part(self, allowed: float, key_id: str, field: int, others: float, now: float) -> float:
        """This router's part of a key's allowance (requests: field 0, tokens: 1) until the
        fleet's next answer (the module doc); the whole allowance while the others are unknown
        or a window old."""
        if now - self.others_at > self.window_s or self.peers <= 0:
            return allowed
        mine = self.own_at_answer.get(key_id, (0.0, 0.0))[field]
        spare = allowed - mine - others
        if spare >= 0:
            even = spare / (self.peers + 1)
            # A last whole request would go unused if every part came to less than one: it
            # goes to the router with the most use (both, on a tie: one over, bounded)
            return mine + (min(spare, 1.0) if even < 1.0 and mine >= others else even)
        return mine + spare * mine / (mine + others)  # the overshoot, by use (mine+others > 0)

    def usage(self, now: float) -> dict[str, tuple[float, float]]:
        """(requests, tokens) each key was admitted here over the window; idle keys dropped."""
        out: dict[str, tuple[float, float]] = {}
        for key_id, window in list(self.windows.items()):
            window.expire(now)
            if not window.buckets:
                del self.windows[key_id]
                continue
            out[key_id] = (window.requests, max(0.0, window.tokens))
        return out

    def forget(self, keep: set[str]) -> None:
        """Drop the windows of keys no longer listed (revoked, deleted)."""
        for key_id in [k for k in self.windows if k not in keep]:
            del self.windows[key_id]

    def _retry_after(
        self, window: KeyWindow | None, others: float, excess: float, field: int, now: float
    ) -> int:
        """Seconds until enough of the window frees: this router's buckets leave at known
        times; the others' usage is taken to free evenly over the window."""
        freed = 0.0
        rate = others / self.window_s  # the others' usage leaving per second
        at = 0.0
        for after, requests, tokens in window.freed_by(now) if window is not None else []:
            if rate > 0 and freed + rate * min(after, self.window_s) >= excess:
                needed = (excess - freed) / rate
                return _whole(max(at, needed))
            freed += requests if field == 1 else tokens
            at = after
            if freed + rate * min(after, self.window_s) >= excess:
                return _whole(after)
        if rate > 0:
            return _whole(min(self.window_s, max(at, (excess - freed) / rate)))
        return _whole(self.window_s)


def _whole(seconds: float) -> int:
    return max(MIN_RETRY_AFTER_S, math.ceil(seconds))


def share_slots(share: float, slots: int) -> int:
    """The requests a tenant may hold in a contended deployment: max(1, ceil(share × slots))."""
    return max(1, math.ceil(share * slots))


def over_share(held: int, share: float, slots: int, contended: bool) -> bool:
    """Whether a tenant already holding `held` requests (in flight + waiting) in a deployment
    must be turned away rather than wait. Only while the deployment is contended; a share of
    1 (the default) never caps."""
    if not contended or share >= 1.0:
        return False
    return held >= share_slots(share, slots)
