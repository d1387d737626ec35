"""A steady client load on a live `fleetctl serve`, recorded request by request (not a test
module): for chaos tests that break the service's database under it and then check every
answer it gave.

`ApiLoad(url, token)` runs, each in a thread of its own, over real HTTP on 127.0.0.1:
- readers: authenticated GETs, round the paths given, one after the other;
- writers: `POST /api/v1/tenants` with unique names (`<prefix>-w<i>-<n>`), each name retried
  after a 503's `Retry-After` (or 1 s after a connection cut without an answer, which only
  tests/chaos/test_postgres_restart.py tolerates, as a known bug) until it gets 201, or 409 on
  a retry (an earlier attempt that answered 503 had committed after all: the client learns
  it), or `retry_for_s` runs out (then it is `unresolved`, which a test fails on); a timeout
  is never retried: it is a hang;
- a prober: `/healthz` every 0.1 s, `/readyz` every 0.5 s.
Every request has the client timeout: one without an HTTP answer (a timeout, a refused or reset
connection) is recorded with status None. `stop()` ends them all within a bound: a writer
first finishes the name it is retrying (`stop(abandon=True)`, for a clean-up after a failure,
does not wait for that).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import httpx

API = "/api/v1"
API_CLIENTS = ("reader", "writer", "retry")


@dataclass(frozen=True)
class Answer:
    """One request as its client saw it (times: time.monotonic())."""

    who: str  # reader, writer, retry (a writer's same name again), healthz, readyz
    path: str
    started: float
    ended: float
    status: int | None  # None: no HTTP answer (a timeout, a refused or reset connection)
    retry_after: str | None = None
    detail: str = ""
    timed_out: bool = False  # no answer within the client's timeout: a hang

    @property
    def cut(self) -> bool:
        """No HTTP answer, but not for want of time: the connection refused, reset or closed."""
        return self.status is None and not self.timed_out

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class ApiLoad:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        prefix: str = "chaos",
        client_timeout_s: float = 10.0,
        retry_for_s: float = 40.0,
        pace_s: float = 0.05,
    ) -> None:
        self.url = url
        self.token = token
        self.prefix = prefix
        self.client_timeout_s = client_timeout_s
        self.retry_for_s = retry_for_s
        self.pace_s = pace_s
        self.acknowledged: dict[str, str] = {}  # name -> "201" or "201 after retry"
        self.ambiguous: list[str] = []  # a 503, then 409 on the retry: it had committed
        self.unresolved: list[str] = []  # retries ran out, or an answer no retry can change
        self.retried = 0  # writes whose first attempt was refused
        self._answers: list[Answer] = []
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the threads

    def start(self, readers: Sequence[Sequence[str]], writers: int, prober: bool = True) -> None:
        """`readers`: one thread per sequence of paths (under /api/v1) it cycles through."""
        targets: list[tuple[str, Callable[[], None]]] = [
            (f"reader-{i}", partial(self._reader, tuple(paths))) for i, paths in enumerate(readers)
        ]
        targets += [(f"writer-{i}", partial(self._writer, i)) for i in range(writers)]
        if prober:
            targets.append(("prober", self._prober))
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self, abandon: bool = False) -> list[str]:
        """Stop every thread, each waited for within a bound; the names of any still running.
        A writer finishes the name it is retrying first, unless `abandon` (a test that failed
        already: its clean-up need not wait out the retries)."""
        if abandon:
            self._abandon.set()
        self._stop.set()
        bound = self.retry_for_s + 2 * self.client_timeout_s
        for thread in self._threads:
            thread.join(timeout=bound)
        return [thread.name for thread in self._threads if thread.is_alive()]

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=self.client_timeout_s,
        )

    def _reader(self, paths: Sequence[str]) -> None:
        with self.client() as client:
            for path in itertools.cycle(paths):
                if self._stop.is_set():
                    return
                self._ask(client, "reader", "GET", f"{API}{path}")
                time.sleep(self.pace_s)

    def _writer(self, index: int) -> None:
        with self.client() as client:
            for n in itertools.count():
                if self._stop.is_set():
                    return
                self._create(client, f"{self.prefix}-w{index}-{n}")
                time.sleep(self.pace_s)

    def _create(self, client: httpx.Client, name: str) -> None:
        deadline = time.monotonic() + self.retry_for_s
        who = "writer"
        while True:
            answer = self._ask(client, who, "POST", f"{API}/tenants", json={"name": name})
            with self._guard:
                if answer.status == 201:
                    self.acknowledged[name] = "201" if who == "writer" else "201 after retry"
                    return
                if answer.status == 409 and who == "retry":
                    self.ambiguous.append(name)
                    return
                refused = answer.status == 503 or answer.cut
                if not refused or time.monotonic() > deadline or self._abandon.is_set():
                    self.unresolved.append(f"{name}: {answer.status} {answer.detail}")
                    return
                self.retried += who == "writer"
            who = "retry"
            self._abandon.wait(min(float(answer.retry_after or 1), 5.0))

    def _prober(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.client_timeout_s) as client:
            for tick in itertools.count():
                if self._stop.is_set():
                    return
                self._ask(client, "healthz", "GET", "/healthz")
                if tick % 5 == 0:
                    self._ask(client, "readyz", "GET", "/readyz")
                time.sleep(0.1)

    def _ask(
        self, client: httpx.Client, who: str, method: str, path: str, json: object = None
    ) -> Answer:
        started = time.monotonic()
        try:
            reply = client.request(method, path, json=json)
        except httpx.HTTPError as exc:
            timed_out = isinstance(exc, httpx.TimeoutException)
            answer = Answer(who, path, started, time.monotonic(), None, "", repr(exc), timed_out)
        else:
            detail = ""
            if reply.status_code >= 400:
                try:
                    detail = str(reply.json().get("detail", ""))
                except ValueError:
                    detail = reply.text[:200]
            answer = Answer(
                who,
                path,
                started,
                time.monotonic(),
                reply.status_code,
                reply.headers.get("Retry-After"),
                detail,
            )
        with self._guard:
            self._answers.append(answer)
        return answer

    # -- what they saw

    def answers(self, *who: str, since: float = 0.0, until: float = float("inf")) -> list[Answer]:
        """The answers of `who` (all clients if none given) to requests sent at or after
        `since` and answered by `until`."""
        with self._guard:
            answers = list(self._answers)
        return [
            a
            for a in answers
            if (not who or a.who in who) and a.started >= since and a.ended <= until
        ]

    def first(self, who: Sequence[str], status: int, since: float) -> Answer | None:
        """The first answer `status` to a request of `who` sent at or after `since`."""
        return next((a for a in self.answers(*who, since=since) if a.status == status), None)

    def acks(self) -> int:
        with self._guard:
            return len(self.acknowledged)

    def stored_tenants(self) -> tuple[set[str], dict[str, int]]:
        """What the service holds now: every tenant's name, and `tenant.created` events per
        subject (the events paged through)."""
        with self.client() as client:
            reply = client.get(f"{API}/tenants", timeout=30)
            assert reply.status_code == 200, reply.text
            names = {str(row["name"]) for row in reply.json()["results"]}
            events: dict[str, int] = {}
            for offset in itertools.count(0, 1000):
                reply = client.get(
                    f"{API}/events",
                    params={"kind": "tenant.created", "limit": 1000, "offset": offset},
                    timeout=30,
                )
                assert reply.status_code == 200, reply.text
                page = reply.json()["results"]
                for event in page:
                    events[event["subject"]] = events.get(event["subject"], 0) + 1
                if len(page) < 1000:
                    return names, events
        raise AssertionError("unreachable")  # itertools.count never ends

    def check_nothing_lost(self) -> set[str]:
        """Every acknowledged write exists, every write a 503 refused exists only if its retry
        said so (409), nothing else exists, and each tenant has exactly one `tenant.created`
        event (its transaction whole). The stored names."""
        assert not self.unresolved, f"writes never resolved: {self.unresolved[:5]}"
        stored, events = self.stored_tenants()
        expected = set(self.acknowledged) | set(self.ambiguous)
        assert stored == expected, (
            f"acknowledged or reported but missing: {sorted(expected - stored)[:10]}; "
            f"stored but never acknowledged: {sorted(stored - expected)[:10]}"
        )
        uneven = {
            name: events.get(name, 0)
            for name in stored | set(events)
            if events.get(name, 0) != 1 or name not in stored
        }
        assert not uneven, f"tenant.created events per tenant, where not exactly one: {uneven}"
        return stored
