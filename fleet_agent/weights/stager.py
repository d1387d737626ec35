"""The background worker that fills the weights cache with what the assignment names.

The daemon's tick calls `want()` with the versions the fleet's assignment names, in order (the
served one first, then the `stage` list) and the keys it must keep: cheap, never blocking. One
thread fetches one version at a time (its files one after the other, fleet_agent/weights/
cache.py): the first wanted version not ready and not waiting to retry. A fetch whose version is
no longer wanted stops at its next chunk (its partial files stay for a later resume); a failed
version is tried again after `retry_s`, doubling up to `retry_max_s`, while it is still wanted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from fleet_agent.weights.cache import Stopped, VersionIn, WeightsCache

log = logging.getLogger("fleet_agent.weights")


@dataclasses.dataclass
class _Retry:
    failures: int
    next_at: float


class Stager:
    def __init__(
        self,
        cache: WeightsCache,
        *,
        retry_s: float = 30.0,
        retry_max_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retry_s <= 0 or retry_max_s < retry_s:
            raise ValueError("retry_s must be > 0 and retry_max_s >= retry_s")
        self.cache = cache
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.clock = clock
        self._lock = threading.Lock()
        self._wanted: list[VersionIn] = []
        self._keep: frozenset[str] = frozenset()
        self._retry: dict[str, _Retry] = {}
        self._current: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -----------------------------------------------------------------------------------------
    # what the daemon calls

    def want(self, refs: Sequence[VersionIn], keep: Iterable[str] = ()) -> None:
        """The versions to hold, in order; fetched ones and external ones are skipped. `keep`:
        keys never to evict (the wanted ones are never evicted either)."""
        seen: set[str] = set()
        unique: list[VersionIn] = []
        for ref in refs:
            if not ref.external and ref.key not in seen:
                seen.add(ref.key)
                unique.append(ref)
        with self._lock:
            changed = [r.key for r in unique] != [r.key for r in self._wanted]
            self._wanted = unique
            self._keep = frozenset(keep) | frozenset(seen)
            for key in list(self._retry):
                if key not in seen:
                    del self._retry[key]  # asked again later: tried at once
        if changed:
            self._wake.set()

    @property
    def current(self) -> str | None:
        """The version being fetched now."""
        with self._lock:
            return self._current

    def pending(self) -> list[str]:
        """Wanted versions not ready yet (the one being fetched first)."""
        with self._lock:
            wanted = list(self._wanted)
        return [r.key for r in wanted if not self.cache.is_ready(r)]

    def view(self) -> dict[str, object]:
        with self._lock:
            now = self.clock()
            return {
                "current": self._current,
                "wanted": [r.key for r in self._wanted],
                "keep": sorted(self._keep),
                "retry_in_s": {
                    k: round(max(r.next_at - now, 0.0), 1) for k, r in self._retry.items()
                },
            }

    # -----------------------------------------------------------------------------------------
    # the thread

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="weights-stager", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread: a fetch in progress stops at its next chunk."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            ref, wait = self._next()
            if ref is None:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            try:
                self.run_one(ref)
            except Exception:  # one bad fetch must not end the stager
                log.exception("weights stager: fetching %s failed", ref.key)
                self._failed(ref.key)

    def _next(self) -> tuple[VersionIn | None, float]:
        """The first wanted version to fetch now, or how long to wait for one."""
        now = self.clock()
        with self._lock:
            wanted = list(self._wanted)
            retry = dict(self._retry)
        wait = 5.0
        for ref in wanted:
            if self.cache.is_ready(ref):
                continue
            held = retry.get(ref.key)
            if held is not None and held.next_at > now:
                wait = min(wait, held.next_at - now)
                continue
            return ref, 0.0
        return None, max(wait, 0.05)

    def run_one(self, ref: VersionIn) -> bool | None:
        """Fetch `ref` now (in the caller's thread). True: ready; False: failed (retried
        later); None: stopped (no longer wanted, or the stager closes)."""
        with self._lock:
            self._current = ref.key
            keep = self._keep

        def should_stop() -> bool:
            if self._stop.is_set():
                return True
            with self._lock:
                return all(r.key != ref.key for r in self._wanted)

        try:
            ok = self.cache.ensure(ref, keep=keep, should_stop=should_stop)
        except Stopped:
            log.info("weights %s: fetch stopped (no longer wanted); partial files kept", ref.key)
            return None
        finally:
            with self._lock:
                self._current = None
        if ok:
            with self._lock:
                self._retry.pop(ref.key, None)
        else:
            self._failed(ref.key)
        return ok

    def _failed(self, key: str) -> None:
        with self._lock:
            held = self._retry.get(key)
            failures = held.failures + 1 if held else 1
            delay = min(self.retry_s * 2 ** (failures - 1), self.retry_max_s)
            self._retry[key] = _Retry(failures, self.clock() + delay)
        log.warning("weights %s: trying again in %.0f s", key, delay)
