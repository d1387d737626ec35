"""The agent's weights cache: model versions on local disk, verified, within a byte budget.

Layout (fleet_core/weights.py): a version's files live under
`<cache>/<model>/<version>/<model>/<name>` (`engine_path`: the checkpoint directory an engine
starts on), its marker `<cache>/<model>/<version>/.verified.json` beside that directory (never
inside it: the engine sees only its files), and files being fetched under
`<cache>/.partial/<model>/<version>/<name>`, never under engine_path. A file moves into place
by an atomic rename once its sha256 (and size) matched, after an fsync of the file and then of
the directory; the marker (every file's sha256, size and when it was verified) is written
last, the same way. A version is "ready" only with its marker: a crash at any point leaves
either a ready version or one that is fetched again (a file in place without a marker entry is
hashed again rather than trusted; partial files resume).

Budget: before a fetch the cache makes room by evicting, least recently used first, what is
not protected: leftovers of unfinished fetches, then ready versions. Protected: the versions
engines run on (`set_in_use`), the assignment's `keep` list, and the version being fetched. A
version that cannot fit even then fails with "does not fit in the cache budget (needs X,
budget Y, pinned Z)"; one that fits the budget but not the disk's free space fails as a full
disk. A checksum mismatch discards the partial file and fetches it once more; a second one
fails the version. Failures are one line naming the file and its URI without query string or
credentials (the fetcher's errors are already so).

Thread safety: one lock guards the entries; fetches and hashing run outside it (the stager's
thread, fleet_agent/weights/stager.py), and the daemon reads `report()` every heartbeat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from fleet_core.weights import (
    artifact_name_problem,
    engine_path,
    split_key,
    version_dir,
    version_key,
)
from fleet_core.wire import MAX_CACHE_ENTRIES, CachedVersion, CacheReport

log = logging.getLogger("fleet_agent.weights")

MARKER = ".verified.json"
LAST_USED = ".last-used"
PARTIAL_DIR = ".partial"
TRASH_PREFIX = ".trash-"
_HASH_CHUNK = 8 << 20
# last_used_at of a version in use is written to disk at most this often (LRU survives restarts).
_TOUCH_EVERY_S = 600.0

State = Literal["ready", "fetching", "failed", "incomplete"]


class ArtifactIn(Protocol):
    """One file of a version as the assignment names it (fleet_core.wire.ArtifactRef)."""

    @property
    def name(self) -> str: ...
    @property
    def uri(self) -> str: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def size_bytes(self) -> int | None: ...


class VersionIn(Protocol):
    """A version as the assignment names it (fleet_core.wire.ModelRef)."""

    @property
    def key(self) -> str: ...
    @property
    def external(self) -> bool: ...
    @property
    def artifacts(self) -> Sequence[Any]: ...


class Fetcher(Protocol):
    """fleet_agent.weights.fetch.fetch: the artifact's bytes into `dest` (the partial file),
    resumed from what `dest` holds, sha256 and size checked while streaming."""

    def __call__(
        self,
        artifact: Any,
        dest: Path,
        *,
        s3: Any,
        progress: Callable[[int], None] | None,
        chunk: int,
        timeout: float,
        should_stop: Callable[[], bool] | None,
    ) -> Any: ...


class Stopped(Exception):
    """The fetch was stopped (the version is no longer wanted, or the agent stops): the
    partial files stay for a later resume."""


@dataclasses.dataclass
class FileMark:
    sha256: str
    size_bytes: int
    verified_at: str  # ISO 8601, UTC


@dataclasses.dataclass
class Entry:
    key: str
    state: State
    bytes: int = 0  # on disk: files in place plus partial files
    total_bytes: int | None = None
    verified_at: datetime | None = None
    last_used_at: datetime | None = None
    error: str | None = None
    resumes: int = 0
    checksum_failures: int = 0
    files: dict[str, FileMark] = dataclasses.field(default_factory=dict)  # ready: the marker's
    fetching_file: str | None = None
    touched_at: float = 0.0  # monotonic time last_used_at was last written to disk

    def wire(self) -> CachedVersion:
        return CachedVersion(
            key=self.key,
            state="fetching" if self.state == "incomplete" else self.state,  # never reported
            bytes=self.bytes,
            total_bytes=self.total_bytes,
            verified_at=self.verified_at,
            last_used_at=self.last_used_at,
            error=self.error,
            resumes=self.resumes,
            checksum_failures=self.checksum_failures,
        )


@dataclasses.dataclass
class Counters:
    """Since the agent started (the agent's /metrics: agent_weights_*)."""

    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    files_fetched: int = 0
    checksum_failures: int = 0
    fetch_failures: int = 0
    resumes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


class WeightsCache:
    """The cache directory `root` holding at most `budget_bytes` of model files."""

    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        *,
        fetcher: Fetcher | None = None,
        s3: Any = None,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError("the cache budget must be >= 0 bytes")
        self.root = root.resolve()
        self.budget_bytes = budget_bytes
        self._fetcher = fetcher
        self.s3 = s3
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.clock = clock
        self.counters = Counters()
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._in_use: frozenset[str] = frozenset()
        self.root.mkdir(parents=True, exist_ok=True)
        self.rescan()

    # -----------------------------------------------------------------------------------------
    # paths

    def engine_dir(self, key: str) -> Path:
        """The checkpoint directory engines start on (only meaningful once `is_ready`)."""
        return engine_path(self.root, key)

    def _partial_dir(self, key: str) -> Path:
        model, version = split_key(key)
        return self.root / PARTIAL_DIR / model / version

    # -----------------------------------------------------------------------------------------
    # what is on disk

    def rescan(self) -> None:
        """Read the cache directory: versions with a marker whose files are all there at their
        size are ready; anything else on disk is an unfinished fetch (its bytes count)."""
        entries: dict[str, Entry] = {}
        for trash in self.root.glob(TRASH_PREFIX + "*"):  # an eviction cut short
            shutil.rmtree(trash, ignore_errors=True)
        for model_dir in _subdirs(self.root):
            for vdir in _subdirs(model_dir):
                try:
                    key = version_key(model_dir.name, vdir.name)
                    split_key(key)
                except ValueError:
                    continue
                if not (vdir / MARKER).exists() and not (vdir / model_dir.name).is_dir():
                    continue  # not laid out as a version: not the cache's to count or evict
                entries[key] = self._scan_version(key, vdir)
        partial_root = self.root / PARTIAL_DIR
        for model_dir in _subdirs(partial_root):
            for vdir in _subdirs(model_dir):
                try:
                    key = version_key(model_dir.name, vdir.name)
                    split_key(key)
                except ValueError:
                    continue
                entry = entries.setdefault(key, Entry(key, "incomplete"))
                entry.bytes += _tree_bytes(vdir)
        with self._lock:
            self._entries = entries
        ready = sum(1 for e in entries.values() if e.state == "ready")
        log.info(
            "weights cache %s: %d version(s) ready, %d unfinished, %s of %s used",
            self.root,
            ready,
            len(entries) - ready,
            _size(sum(e.bytes for e in entries.values())),
            _size(self.budget_bytes),
        )

    def _scan_version(self, key: str, vdir: Path) -> Entry:
        on_disk = _tree_bytes(vdir)
        marker = _read_marker(vdir / MARKER)
        edir = engine_path(self.root, key)
        if marker is not None:
            files, verified_at = marker
            intact = all(_file_size(edir / name) == mark.size_bytes for name, mark in files.items())
            if intact:
                return Entry(
                    key,
                    "ready",
                    bytes=on_disk,
                    total_bytes=sum(m.size_bytes for m in files.values()),
                    verified_at=verified_at,
                    last_used_at=_mtime(vdir / LAST_USED) or verified_at,
                    files=files,
                )
            log.warning("weights cache: %s lost files since it was verified: fetched again", key)
            with contextlib.suppress(OSError):
                (vdir / MARKER).unlink()
        return Entry(key, "incomplete", bytes=on_disk)

    def is_ready(self, ref: VersionIn) -> bool:
        """Every artifact of `ref` is in place and verified (external versions: always)."""
        if ref.external:
            return True
        with self._lock:
            entry = self._entries.get(ref.key)
            return entry is not None and entry.state == "ready" and _covers(entry, ref)

    def entry(self, key: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            return dataclasses.replace(entry) if entry is not None else None

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.bytes for e in self._entries.values())

    def free_bytes(self) -> int | None:
        """Free space of the cache's file system (for unprivileged users)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def report(self) -> CacheReport:
        """What the heartbeat carries: the budget, the bytes held, the file system's free
        space, and the versions (fetching and failed first, then most recently used)."""
        with self._lock:
            entries = list(self._entries.values())
            used = sum(e.bytes for e in entries)
        # An unfinished fetch nobody is running (stopped, or found at start) is bytes on disk,
        # not a version: it shows again as "fetching" when it is wanted.
        entries = [e for e in entries if e.state != "incomplete"]
        order = {"fetching": 0, "incomplete": 0, "failed": 1, "ready": 2}
        far_past = datetime.min.replace(tzinfo=UTC)
        entries.sort(
            key=lambda e: (order[e.state], -(e.last_used_at or far_past).timestamp(), e.key)
        )
        return CacheReport(
            budget_bytes=self.budget_bytes,
            used_bytes=used,
            free_bytes=self.free_bytes(),
            entries=[e.wire() for e in entries[:MAX_CACHE_ENTRIES]],
        )

    def states(self) -> tuple[tuple[str, str], ...]:
        """(key, state) of every entry: the daemon reports at once when this changes."""
        with self._lock:
            return tuple(sorted((e.key, e.state) for e in self._entries.values()))

    def view(self) -> dict[str, Any]:
        """/state: the report plus what is being fetched and the counters."""
        report = self.report().model_dump(mode="json")
        with self._lock:
            fetching = {e.key: e.fetching_file for e in self._entries.values() if e.fetching_file}
            in_use = sorted(self._in_use)
        return {
            "dir": str(self.root),
            **report,
            "in_use": in_use,
            "fetching_files": fetching,
            "counters": dataclasses.asdict(self.counters),
        }

    # -----------------------------------------------------------------------------------------
    # use

    def set_in_use(self, keys: Iterable[str]) -> None:
        """The versions engines run on now: never evicted, and most recently used."""
        now_wall = datetime.fromtimestamp(self.clock(), UTC)
        now = time.monotonic()
        keys = frozenset(keys)
        with self._lock:
            self._in_use = keys
            touch: list[tuple[str, Entry]] = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.state != "ready":
                    continue
                entry.last_used_at = now_wall
                if not entry.touched_at or now - entry.touched_at >= _TOUCH_EVERY_S:
                    entry.touched_at = now
                    touch.append((key, entry))
        for key, _ in touch:
            with contextlib.suppress(OSError):
                (version_dir(self.root, key) / LAST_USED).touch()

    @property
    def in_use(self) -> frozenset[str]:
        with self._lock:
            return self._in_use

    # -----------------------------------------------------------------------------------------
    # fetching

    def ensure(
        self,
        ref: VersionIn,
        *,
        keep: Iterable[str] = (),
        should_stop: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Fetch and verify every artifact of `ref` not yet in place. True: ready. False: it
        failed (the entry says why). Raises Stopped when `should_stop` said so."""
        if ref.external:
            return True
        key = ref.key
        try:
            split_key(key)
        except ValueError as exc:
            # No entry: the key is no directory of this cache, nor a key the report may carry.
            self.counters.fetch_failures += 1
            log.error("weights: refused a version: %s", exc)
            return False
        if self.is_ready(ref):
            return True
        arts = sorted(ref.artifacts, key=lambda a: a.name)
        total = sum(a.size_bytes or 0 for a in arts)
        with self._lock:
            entry = self._entries.setdefault(key, Entry(key, "incomplete"))
            entry.state, entry.error, entry.total_bytes = "fetching", None, total
        try:
            problem = _names_problem(self.root, key, arts)
            if problem is not None:
                raise _Failed(problem)
            self._make_room(key, arts, keep)
            self._fetch_all(entry, arts, should_stop)
        except Stopped:
            with self._lock:
                entry.state, entry.fetching_file = "incomplete", None
                entry.bytes = self._bytes_on_disk(key)
            raise
        except _Failed as exc:
            self.counters.fetch_failures += 1
            with self._lock:
                entry.state, entry.error, entry.fetching_file = "failed", exc.message, None
                entry.bytes = self._bytes_on_disk(key)
            log.error("weights %s failed: %s", key, exc.message)
            return False
        except Exception as exc:  # a fetcher's bug must fail the version, never leave it hanging
            self.counters.fetch_failures += 1
            message = f"{key}: unexpected {type(exc).__name__} while fetching"
            with self._lock:
                entry.state, entry.error, entry.fetching_file = "failed", message, None
                entry.bytes = self._bytes_on_disk(key)
            log.warning("weights %s failed: %s", key, message, exc_info=True)
            return False
        return True

    def _make_room(self, key: str, arts: Sequence[ArtifactIn], keep: Iterable[str]) -> None:
        need = self._bytes_to_come(key, arts)
        protected = set(keep) | set(self.in_use) | {key}
        with self._lock:
            held = {k: e.bytes for k, e in self._entries.items()}
            pinned = sum(b for k, b in held.items() if k in protected and k != key)
            mine = held.get(key, 0)
            evictable = sorted(
                (e for e in self._entries.values() if e.key not in protected and e.bytes),
                key=_eviction_order,
            )
        total = mine + need
        if pinned + total > self.budget_bytes:
            raise _Failed(
                f"{key} does not fit in the cache budget (needs {_size(total)}, budget"
                f" {_size(self.budget_bytes)}, pinned {_size(pinned)})"
            )
        used = sum(held.values())
        for victim in evictable:
            if used + need <= self.budget_bytes:
                break
            used -= self.evict(victim.key)
        free = self.free_bytes()
        if free is not None and need > free:
            raise _Failed(
                f"disk full: {key} needs {_size(need)} more, {_size(free)} free on the"
                f" cache's file system ({self.root})"
            )

    def _bytes_to_come(self, key: str, arts: Sequence[ArtifactIn]) -> int:
        """Bytes the fetch still has to write: what is not in place or in a partial file."""
        edir, pdir = engine_path(self.root, key), self._partial_dir(key)
        need = 0
        for a in arts:
            size = a.size_bytes or 0
            if _file_size(edir / a.name) == size:
                continue
            need += max(size - (_file_size(pdir / a.name) or 0), 0)
        return need

    def evict(self, key: str) -> int:
        """Remove a version (and its partial files) from disk: its directory is renamed away
        first, so it vanishes at once. Returns the bytes freed. Never one in use."""
        with self._lock:
            if key in self._in_use:
                raise ValueError(f"{key} is in use")
            entry = self._entries.pop(key, None)
        freed = entry.bytes if entry is not None else 0
        for path in (version_dir(self.root, key), self._partial_dir(key)):
            if not path.exists():
                continue
            trash = self.root / f"{TRASH_PREFIX}{uuid.uuid4().hex}"
            try:
                os.replace(path, trash)
            except OSError:
                trash = path
            shutil.rmtree(trash, ignore_errors=True)
        self.counters.evictions += 1
        self.counters.evicted_bytes += freed
        log.info("weights cache: evicted %s (%s)", key, _size(freed))
        return freed

    def _fetch_all(
        self, entry: Entry, arts: Sequence[ArtifactIn], should_stop: Callable[[], bool]
    ) -> None:
        key = entry.key
        edir, pdir = engine_path(self.root, key), self._partial_dir(key)
        files: dict[str, FileMark] = {}
        for a in arts:
            if should_stop():
                raise Stopped(key)
            if a.sha256 is None:
                raise _Failed(f"{a.name}: no sha256 to verify it against")
            final = edir / a.name
            size = _file_size(final)
            known = entry.files.get(a.name)
            if known is not None and known.sha256 == a.sha256 and known.size_bytes == size:
                files[a.name] = known  # verified before (the marker of an earlier set of files)
                continue
            if size is not None:
                # In place without a marker entry: trusted only once hashed again.
                if size == (a.size_bytes if a.size_bytes is not None else size) and (
                    _sha256_file(final, should_stop) == a.sha256
                ):
                    files[a.name] = FileMark(a.sha256, size, _iso_now(self.clock))
                    continue
                final.unlink()
            files[a.name] = self._fetch_one(entry, a, pdir / a.name, final, should_stop)
        verified_at = _iso_now(self.clock)
        marker = {
            "key": key,
            "verified_at": verified_at,
            "files": {n: dataclasses.asdict(m) for n, m in sorted(files.items())},
        }
        vdir = version_dir(self.root, key)
        _write_atomic(vdir / MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
        _remove_empty_dirs(pdir, self.root / PARTIAL_DIR)
        with self._lock:
            entry.state, entry.error, entry.fetching_file = "ready", None, None
            entry.files = files
            entry.verified_at = datetime.fromisoformat(verified_at)
            entry.last_used_at = entry.last_used_at or entry.verified_at
            entry.bytes = self._bytes_on_disk(key)
        log.info("weights %s ready: %d file(s), %s verified", key, len(files), _size(entry.bytes))

    def _fetch_one(
        self,
        entry: Entry,
        a: ArtifactIn,
        partial: Path,
        final: Path,
        should_stop: Callable[[], bool],
    ) -> FileMark:
        from fleet_agent.weights import fetch as fetching

        fetch = self._fetcher or fetching.fetch
        partial.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entry.fetching_file = a.name
            base = self._bytes_on_disk(entry.key) - (_file_size(partial) or 0)

        def progress(done: int) -> None:
            with self._lock:
                entry.bytes = base + done

        for attempt in (1, 2):
            started = time.monotonic()
            before = _file_size(partial) or 0
            try:
                result = fetch(
                    a,
                    partial,
                    s3=self.s3,
                    progress=progress,
                    chunk=self.chunk_bytes,
                    timeout=self.timeout_s,
                    should_stop=should_stop,
                )
            except fetching.ChecksumMismatch as exc:
                self._count_bytes(partial, before, started)
                partial.unlink(missing_ok=True)
                self.counters.checksum_failures += 1
                self.counters.resumes += exc.resumes
                with self._lock:
                    entry.checksum_failures += 1
                    entry.resumes += exc.resumes
                    entry.bytes = base
                if attempt == 2:
                    raise _Failed(f"{exc} (twice: the source itself is wrong)") from exc
                log.warning("weights %s: %s; discarded, fetching it again", entry.key, exc)
                continue
            except fetching.FetchError as exc:
                self._count_bytes(partial, before, started)
                if should_stop():
                    raise Stopped(entry.key) from exc
                if isinstance(exc, fetching.SizeMismatch):
                    partial.unlink(missing_ok=True)
                raise _Failed(_one_line(exc)) from exc
            except OSError as exc:  # the fetcher's own file handling: a clear line, no trace
                self._count_bytes(partial, before, started)
                raise _Failed(f"{a.name}: {exc.strerror or exc}") from exc
            if should_stop() and _file_size(partial) != a.size_bytes:
                self._count_bytes(partial, before, started)
                raise Stopped(entry.key)
            fetched = int(getattr(result, "bytes", 0) or 0)
            resumed = int(getattr(result, "resumed_from", 0) or 0)
            extra = int(getattr(result, "resumes", 0) or 0)  # cuts resumed within the call
            moved = getattr(result, "transferred", None)
            self.counters.fetched_bytes += int(moved) if moved is not None else fetched - resumed
            self.counters.fetch_seconds += float(getattr(result, "seconds", 0.0) or 0.0)
            self.counters.files_fetched += 1
            if resumed or extra:
                self.counters.resumes += (resumed > 0) + extra
                with self._lock:
                    entry.resumes += (resumed > 0) + extra
            size = _file_size(partial)
            if size is None or (a.size_bytes is not None and size != a.size_bytes):
                partial.unlink(missing_ok=True)
                raise _Failed(f"{a.name}: fetched {size} bytes, expected {a.size_bytes}")
            _fsync_file(partial)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, final)
            _fsync_dir(final.parent)
            assert a.sha256 is not None
            return FileMark(a.sha256, size, _iso_now(self.clock))
        raise AssertionError("unreachable")

    def _count_bytes(self, partial: Path, before: int, started: float) -> None:
        """A fetch that did not finish still moved bytes: they count in the figures."""
        self.counters.fetched_bytes += max((_file_size(partial) or 0) - before, 0)
        self.counters.fetch_seconds += time.monotonic() - started

    def _bytes_on_disk(self, key: str) -> int:
        return _tree_bytes(version_dir(self.root, key)) + _tree_bytes(self._partial_dir(key))


def _names_problem(root: Path, key: str, arts: Sequence[ArtifactIn]) -> str | None:
    """Why this version cannot be laid out in the cache (None: it can). The fleet checks the
    same names when a version is created; an agent does not trust that it did: a name must be
    a plain relative path, and must still land inside the engine directory once resolved (a
    symlink left in the cache must not carry a write elsewhere). `key` is checked already."""
    edir = engine_path(root, key)
    inside = edir.resolve()
    for a in arts:
        problem = artifact_name_problem(a.name)
        if problem is None and not (edir / a.name).resolve().is_relative_to(inside):
            problem = "resolves outside the version's directory"
        if problem is not None:
            return f"{key}: artifact name {a.name[:100]!r} {problem}"
    return None


class _Failed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message[:500]


# ---------------------------------------------------------------------------------------------
# helpers


def _covers(entry: Entry, ref: VersionIn) -> bool:
    """The marker holds every artifact of `ref` with the same sha256."""
    return all(
        (mark := entry.files.get(a.name)) is not None and mark.sha256 == a.sha256
        for a in ref.artifacts
    )


def _eviction_order(e: Entry) -> tuple[int, float]:
    """Unfinished fetches and failures first, then ready versions least recently used."""
    when = e.last_used_at or e.verified_at
    return (0 if e.state != "ready" else 1, when.timestamp() if when else 0.0)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _tree_bytes(path: Path) -> int:
    """Bytes of the model files under `path` (their size: sparse files count whole); the
    cache's own dot files (markers) are not model bytes."""
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            if name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _file_size(path: Path) -> int | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if path.is_file() else None


def _mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None


def _read_marker(path: Path) -> tuple[dict[str, FileMark], datetime] | None:
    try:
        data = json.loads(path.read_bytes())
        files = {
            str(name): FileMark(str(m["sha256"]), int(m["size_bytes"]), str(m["verified_at"]))
            for name, m in data["files"].items()
        }
        return files, datetime.fromisoformat(data["verified_at"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        log.warning("weights cache: unreadable marker %s: the version is verified again", path)
        return None


def _sha256_file(path: Path, should_stop: Callable[[], bool]) -> str | None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
            if should_stop():
                raise Stopped(str(path))
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_empty_dirs(path: Path, stop_at: Path) -> None:
    """Remove `path`'s empty directories, then its empty parents up to `stop_at`."""
    if path.is_dir():
        for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda t: -len(t[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
    parent = path.parent
    while parent != stop_at and stop_at in parent.parents:
        try:
            parent.rmdir()
        except OSError:
            break
        parent = parent.parent


def _iso_now(clock: Callable[[], float]) -> str:
    return datetime.fromtimestamp(clock(), UTC).isoformat()


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _size(n: int) -> str:
    """Bytes for people: "1.5 GiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
