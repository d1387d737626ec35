"""One deployment's replicas in the router: choosing, waiting, and the exact in-flight books.

`acquire` asks the deployment's strategy for a replica and books the request on it (in-flight
count, prompt tokens, expected output); when none is available the request waits in the
bounded admission queue (interactive before batch) until a `release` or a view update frees
one. `release` closes the books and feeds what was learned (output length, throughput) back.

During a rollout the pool splits by model version (`set_versions`): `canary_weight` of the
requests go to the canary's replicas, the rest to the stable version's, by deterministic smooth
weighting (the canary's turn comes exactly once per 1/weight requests, not by chance), each
side's replica chosen by the strategy; when the chosen side has no available replica the other
takes the request. A replica on neither version (one a rollback is moving back) gets nothing.

Single-threaded: everything runs on the router's event loop, so no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.router.admission import AdmissionQueue, Priority
from fleet.router.estimates import OutputEstimate, Throughput
from fleet.router.priority import NONE, ClassFields
from fleet.router.strategy import (
    PREFILL_WEIGHT,
    Replica,
    Request,
    RoutingStrategy,
    credits_prefix,
)


class QueueFull(Exception):
    """Every replica is busy and the waiting room is full: 429."""


class NoReplica(Exception):
    """Nothing to send to (no replica, or none freed up in time): 503. `retry_after_s`: when
    to come back, where the pool knows better than the router's setting (a deployment at zero
    servers: its boot time)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(init=False)
class Ticket:
    """One request's booking on a replica, kept until release (the replica may have left the
    routing table by then: the books are closed on the object itself)."""

    replica: Replica
    request: Request
    started: float
    output_seen: int  # tokens streamed so far
    released: bool
    booked: int  # prompt tokens booked on the replica: those not expected in its prefix cache

    # Written out, not generated: the simulator's compiled build (fleet/sim/native.py) makes
    # one per request, and mypyc compiles only an __init__ it can see.
    def __init__(
        self,
        replica: Replica,
        request: Request,
        started: float,
        output_seen: int = 0,
        released: bool = False,
        booked: int = -1,  # -1: the whole prompt
    ) -> None:
        self.replica = replica
        self.request = request
        self.started = started
        self.output_seen = output_seen
        self.released = released
        self.booked = booked if booked >= 0 else request.prompt_tokens

    def streamed(self, tokens: int) -> None:
        """Tokens seen in the stream: the expected remainder shrinks as they arrive."""
        if tokens <= 0 or self.released:
            return
        before = max(0.0, self.request.expected_output - self.output_seen)
        self.output_seen += tokens
        after = max(0.0, self.request.expected_output - self.output_seen)
        self.replica.output_left = max(0.0, self.replica.output_left - (before - after))


@dataclass
class _Waiter:
    request: Request
    exclude: frozenset[str]
    future: asyncio.Future[Ticket]


@dataclass
class DeploymentPool:
    name: str
    strategy: RoutingStrategy
    queue: AdmissionQueue[_Waiter]
    models: frozenset[str] = frozenset()
    replicas: dict[str, Replica] = field(default_factory=dict)
    throughput: dict[str, Throughput] = field(default_factory=dict)
    estimate: OutputEstimate = field(default_factory=OutputEstimate)
    prefill_weight: float = PREFILL_WEIGHT
    clock: Callable[[], float] = time.monotonic
    failures: dict[str, int] = field(default_factory=dict)  # in a row, per replica URL
    eject_after: int = 3
    eject_s: float = 10.0
    # Model versions (a rollout): "" when not known (a static table, the simulator)
    stable: str = ""
    canary: str = ""
    canary_weight: float = 0.0
    mixed: bool = False  # replicas of more than the stable version: choose by version
    credit: float = 0.0  # the smooth weighting's running balance
    engine: str = "trtllm"  # the routing table's "engine" (absent: trtllm)
    # What each class adds to a request's body for the deployment's engine (priority.py)
    priorities: dict[Priority, ClassFields] = field(
        default_factory=lambda: {"interactive": NONE, "batch": NONE}
    )
    # Seconds a server takes to boot for it (the routing table's `cold_start_s`): the
    # Retry-After of a request that waited in vain while the deployment had no replica.
    cold_start_s: float | None = None
    # Switched off (max replicas 0, no replica left): nothing will boot, so nothing waits.
    off: bool = False

    # -- versions -------------------------------------------------------------------------

    def set_versions(self, stable: str, canary: str, canary_weight: float) -> None:
        self.stable, self.canary = stable, canary
        self.canary_weight = min(1.0, max(0.0, canary_weight)) if canary else 0.0
        self.refresh_versions()

    def refresh_versions(self) -> None:
        """Whether choosing must look at versions (kept off the hot path when every replica
        runs the stable version); call after replicas' versions change."""
        stable = self.stable
        self.mixed = bool(self.canary) or any(
            r.version and r.version != stable for r in self.replicas.values()
        )

    def _side(self, replica: Replica) -> int:
        """0: the stable version's (or one of no known version), 1: the canary's, -1: neither."""
        version = replica.version
        if not version or version == self.stable or not self.stable:
            return 0
        return 1 if version == self.canary else -1

    def _choose_by_version(self, candidates: list[Replica], request: Request) -> Replica | None:
        stable = [r for r in candidates if self._side(r) == 0]
        # A canary at weight 0 (servers still moving, or rolled back) takes nothing, not even
        # what the stable side cannot: it has not been judged.
        canary = [r for r in candidates if self._side(r) == 1] if self.canary_weight > 0 else []
        if not stable and not canary:
            # Only replicas of another version: the deployment was switched outright (no
            # canary) and its servers still serve the old version until the new one is in
            # their cache. Serving them beats refusing every request meanwhile; where any
            # replica of the stable or canary version exists (a rollback), they get nothing.
            return self.strategy.choose(candidates, request, self.clock())
        first, second = stable, canary
        if canary:
            self.credit += self.canary_weight
            if self.credit >= 0.5:
                self.credit -= 1.0
                first, second = canary, stable
        now = self.clock()
        chosen = self.strategy.choose(first, request, now) if first else None
        if chosen is None and second:
            chosen = self.strategy.choose(second, request, now)
        return chosen

    # -- choosing -------------------------------------------------------------------------

    def _choose(self, request: Request, exclude: frozenset[str]) -> Replica | None:
        if exclude:
            candidates = [r for url, r in self.replicas.items() if url not in exclude]
        else:
            candidates = list(self.replicas.values())
        if self.mixed:
            return self._choose_by_version(candidates, request)
        return self.strategy.choose(candidates, request, self.clock())

    def _book(self, replica: Replica, request: Request) -> Ticket:
        now = self.clock()
        replica.inflight += 1
        prompt = request.prompt_tokens
        if request.blocks:  # the engine will hold its prompt's blocks (prefix.py)
            if credits_prefix(self.strategy):  # its prefill work: the tokens not cached there
                prompt -= int(replica.prefix.cached(request.blocks, prompt))
            replica.prefix.insert(request.blocks, request.prompt_tokens)
        replica.prompt_inflight += prompt
        replica.output_left += request.expected_output
        meter = self.throughput.get(replica.url)
        if meter is not None:
            meter.started(now)
        return Ticket(replica, request, now, booked=prompt)

    async def acquire(
        self,
        request: Request,
        priority: Priority,
        *,
        exclude: frozenset[str] = frozenset(),
        timeout: float,
    ) -> Ticket:
        # Every replica failed this request, or the deployment is switched off: nothing to
        # wait for. A deployment with no replica at all (scaled to zero, or every server
        # gone) is waited for like a busy one: the waiting requests are the demand the router
        # reports, on which the autoscaler boots a server for it at once
        # (fleet/autoscaler/policy.py, "activate").
        if exclude and not any(url not in exclude for url in self.replicas):
            raise NoReplica(f"deployment {self.name!r} has no replica to send to")
        if self.off and not self.replicas:
            raise NoReplica(
                f"deployment {self.name!r} is switched off (max replicas 0): nothing will "
                "serve it until an operator raises its maximum"
            )
        # Waiters first: a new request never overtakes one already waiting for the same class.
        if not len(self.queue):
            replica = self._choose(request, exclude)
            if replica is not None:
                return self._book(replica, request)
        waiter = _Waiter(request, exclude, asyncio.get_running_loop().create_future())
        if not self.queue.push(waiter, priority):
            raise QueueFull(
                f"deployment {self.name!r}: every replica is busy and {self.queue.bound} "
                "requests are waiting"
            )
        self.pump()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            if self.queue.remove(waiter):
                if not self.replicas:
                    cold = self.cold_start_s
                    boot = f": a server takes ~{cold:.0f} s to boot for it" if cold else ""
                    raise NoReplica(
                        f"deployment {self.name!r} has no server serving it (scaled to zero?) "
                        f"and none came within {timeout:g} s{boot}",
                        retry_after_s=cold,
                    ) from None
                raise NoReplica(
                    f"deployment {self.name!r}: no replica freed up within {timeout:g} s"
                ) from None
            # Admitted at the very moment it timed out: take the booking.
            return waiter.future.result()
        except asyncio.CancelledError:  # the client went away while waiting
            if not self.queue.remove(waiter) and waiter.future.done():
                self.release(waiter.future.result(), output_tokens=0, ok=False, failed=False)
            raise

    def pump(self) -> None:
        """Admit waiters, best first, while replicas are available. A retry that excludes the
        replicas that failed it may be passed over by the waiters behind it; a waiter free to
        go anywhere that finds nothing means nothing is free for anyone."""
        for waiter in self.queue.ordered():
            if waiter.future.done():  # cancelled meanwhile
                self.queue.remove(waiter)
                continue
            replica = self._choose(waiter.request, waiter.exclude)
            if replica is None:
                if not waiter.exclude:
                    return
                continue
            self.queue.remove(waiter)
            waiter.future.set_result(self._book(replica, waiter.request))

    # -- closing the books ----------------------------------------------------------------

    def release(self, ticket: Ticket, *, output_tokens: int, ok: bool, failed: bool) -> None:
        """The request is over: `ok` with `output_tokens` written (0: not known), or not;
        `failed` when the replica itself failed it (connect error or 503 before any byte)."""
        if ticket.released:
            return
        ticket.released = True
        replica, request = ticket.replica, ticket.request
        now = self.clock()
        # max(0, ·) each, spelled out (this runs for every request)
        inflight = replica.inflight - 1
        replica.inflight = inflight if inflight > 0 else 0
        prompt = replica.prompt_inflight - ticket.booked
        replica.prompt_inflight = prompt if prompt > 0 else 0
        left = request.expected_output - ticket.output_seen
        left = left if left > 0.0 else 0.0
        output_left = replica.output_left - left
        replica.output_left = output_left if output_left > 0.0 else 0.0
        meter = self.throughput.get(replica.url)
        if meter is not None:
            work = ticket.booked * self.prefill_weight + output_tokens if ok else 0.0
            meter.finished(now, work)
            replica.capacity = meter.value
        if ok and output_tokens > 0:
            self.estimate.observe(output_tokens)
        if failed:
            count = self.failures.get(replica.url, 0) + 1
            self.failures[replica.url] = count
            if count >= self.eject_after:
                replica.ejected_until = now + self.eject_s
                self.failures[replica.url] = 0
        elif ok:
            self.failures.pop(replica.url, None)
        self.pump()
