"""The agent's weights cache (fleet_agent/weights/cache.py) and its stager, over file:// sources
with the real fetcher: layout, markers, atomic placement, resume, checksum failures, the budget
and LRU eviction that never touches what is in use or kept, restarts, and the stager thread."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet_agent.weights import fetch as fetching
from fleet_agent.weights.cache import MARKER, PARTIAL_DIR, Stopped, WeightsCache
from fleet_agent.weights.stager import Stager
from fleet_core.weights import engine_path, version_dir
from fleet_core.wire import ArtifactRef, ModelRef

KIB = 1024


def make_version(
    src: Path,
    model: str,
    version: str,
    files: dict[str, bytes],
    *,
    wrong: frozenset[str] = frozenset(),
) -> ModelRef:
    """Source files under src/<model>/<version>/ and the ModelRef naming them (file:// URIs).
    Names in `wrong` get a sha256 that is not their content's."""
    arts = []
    for name, data in files.items():
        path = src / model / version / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        sha = hashlib.sha256(data + (b"x" if name in wrong else b"")).hexdigest()
        arts.append(ArtifactRef(name=name, uri=path.as_uri(), sha256=sha, size_bytes=len(data)))
    return ModelRef(model=model, version=version, key=f"{model}@{version}", artifacts=arts)


def blob(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return tmp_path / "src"


def new_cache(tmp_path: Path, budget: int = 1 << 20, **kw: Any) -> WeightsCache:
    return WeightsCache(tmp_path / "cache", budget, chunk_bytes=64 * KIB, **kw)


def test_a_version_is_fetched_verified_and_placed(tmp_path: Path, src: Path) -> None:
    ref = make_version(
        src,
        "llama",
        "v1",
        {"config.json": b"{}", "shards/model-00001.safetensors": blob(200 * KIB)},
    )
    cache = new_cache(tmp_path)
    assert not cache.is_ready(ref)
    assert cache.ensure(ref) is True
    assert cache.is_ready(ref)
    edir = engine_path(cache.root, ref.key)
    assert cache.engine_dir(ref.key) == edir == cache.root / "llama" / "v1" / "llama"
    assert (edir / "shards/model-00001.safetensors").read_bytes() == blob(200 * KIB)
    marker = json.loads((version_dir(cache.root, ref.key) / MARKER).read_text())
    assert set(marker["files"]) == {"config.json", "shards/model-00001.safetensors"}
    assert marker["files"]["config.json"]["sha256"] == hashlib.sha256(b"{}").hexdigest()
    assert not (edir / MARKER).exists()  # the marker is beside the engine's directory
    assert (
        not any((cache.root / PARTIAL_DIR).rglob("*"))
        if (cache.root / PARTIAL_DIR).exists()
        else True
    )
    report = cache.report()
    [entry] = report.entries
    assert (entry.key, entry.state, entry.bytes, entry.total_bytes) == (
        "llama@v1",
        "ready",
        200 * KIB + 2,
        200 * KIB + 2,
    )
    assert entry.verified_at is not None and entry.error is None
    assert report.used_bytes == 200 * KIB + 2 and report.budget_bytes == 1 << 20
    assert report.free_bytes is not None and report.free_bytes > 0
    assert cache.counters.files_fetched == 2 and cache.counters.fetched_bytes == 200 * KIB + 2


def test_restart_keeps_ready_versions_and_their_last_use(tmp_path: Path, src: Path) -> None:
    ref = make_version(src, "m", "v1", {"w.bin": blob(10 * KIB)})
    cache = new_cache(tmp_path)
    cache.ensure(ref)
    cache.set_in_use([ref.key])
    used_at = cache.entry(ref.key).last_used_at  # type: ignore[union-attr]
    again = new_cache(tmp_path, fetcher=_never)
    assert again.is_ready(ref)
    entry = again.entry(ref.key)
    assert entry is not None and entry.state == "ready" and entry.last_used_at is not None
    assert used_at is not None and abs((entry.last_used_at - used_at).total_seconds()) < 2
    assert again.ensure(ref) is True  # nothing fetched (_never would raise)


def test_files_in_place_without_a_marker_are_hashed_again(tmp_path: Path, src: Path) -> None:
    """A crash after the renames but before the marker: the files are re-verified, not
    trusted and not fetched again; a corrupt one is fetched again."""
    ref = make_version(src, "m", "v1", {"a.bin": blob(8 * KIB), "b.bin": blob(8 * KIB, 7)})
    cache = new_cache(tmp_path)
    cache.ensure(ref)
    vdir = version_dir(cache.root, ref.key)
    (vdir / MARKER).unlink()
    edir = engine_path(cache.root, ref.key)
    data = bytearray((edir / "b.bin").read_bytes())
    data[100] ^= 0xFF
    (edir / "b.bin").write_bytes(bytes(data))
    calls: list[str] = []

    def counting(artifact: Any, dest: Path, **kw: Any) -> Any:
        calls.append(artifact.name)
        return fetching.fetch(artifact, dest, **kw)

    restarted = new_cache(tmp_path, fetcher=counting)
    assert not restarted.is_ready(ref)
    assert restarted.report().entries == []  # an unfinished version is bytes, not an entry
    assert restarted.used_bytes == 16 * KIB
    assert restarted.ensure(ref)
    assert calls == ["b.bin"]  # a.bin hashed and kept
    assert (edir / "b.bin").read_bytes() == blob(8 * KIB, 7)
    assert (vdir / MARKER).exists()


def test_a_flipped_byte_is_discarded_and_fetched_again(tmp_path: Path, src: Path) -> None:
    ref = make_version(src, "m", "v1", {"w.bin": blob(64 * KIB)})
    seen_partials: list[bool] = []

    def corrupt_once(artifact: Any, dest: Path, **kw: Any) -> Any:
        if not seen_partials:
            seen_partials.append(True)
            dest.write_bytes(b"garbage")  # what a corrupting middlebox left
            raise fetching.ChecksumMismatch(artifact.name, artifact.uri, "a" * 64, "b" * 64)
        seen_partials.append(dest.exists())  # the bad partial was deleted first
        return fetching.fetch(artifact, dest, **kw)

    cache = new_cache(tmp_path, fetcher=corrupt_once)
    assert cache.ensure(ref)
    assert seen_partials == [True, False]
    entry = cache.entry(ref.key)
    assert entry is not None and entry.state == "ready" and entry.checksum_failures == 1
    assert cache.report().entries[0].checksum_failures == 1
    assert cache.counters.checksum_failures == 1


def test_a_wrong_checksum_twice_fails_and_leaves_nothing(tmp_path: Path, src: Path) -> None:
    ref = make_version(
        src,
        "m",
        "v1",
        {"ok.bin": blob(4 * KIB), "w.bin": blob(4 * KIB)},
        wrong=frozenset({"w.bin"}),
    )
    cache = new_cache(tmp_path)
    assert cache.ensure(ref) is False
    entry = cache.report().entries[0]
    assert entry.state == "failed" and entry.checksum_failures == 2
    assert entry.error is not None and "w.bin" in entry.error and "sha256" in entry.error
    assert "\n" not in entry.error
    edir = engine_path(cache.root, ref.key)
    assert not (edir / "w.bin").exists()  # never visible to an engine
    assert not (version_dir(cache.root, ref.key) / MARKER).exists()
    assert not list((cache.root / PARTIAL_DIR).rglob("w.bin"))
    assert not cache.is_ready(ref)


def test_a_partial_file_resumes(tmp_path: Path, src: Path) -> None:
    data = blob(256 * KIB)
    ref = make_version(src, "m", "v1", {"w.bin": data})
    cache = new_cache(tmp_path)
    partial = cache.root / PARTIAL_DIR / "m" / "v1" / "w.bin"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[: 100 * KIB])
    cache.rescan()
    assert cache.used_bytes == 100 * KIB  # the partial counts against the budget
    assert cache.ensure(ref)
    entry = cache.entry(ref.key)
    assert entry is not None and entry.resumes == 1
    assert cache.counters.fetched_bytes == 156 * KIB  # only the rest came over
    assert (engine_path(cache.root, ref.key) / "w.bin").read_bytes() == data
    assert not partial.exists()


def test_lru_eviction_spares_in_use_and_kept_versions(tmp_path: Path, src: Path) -> None:
    size = 300 * KIB
    a = make_version(src, "m", "a", {"w.bin": blob(size, 1)})
    b = make_version(src, "m", "b", {"w.bin": blob(size, 2)})
    c = make_version(src, "m", "c", {"w.bin": blob(size, 3)})
    d = make_version(src, "m", "d", {"w.bin": blob(size, 4)})
    clock = _Clock()
    cache = new_cache(tmp_path, budget=2 * size + 10 * KIB, clock=clock)
    assert cache.ensure(a) and cache.ensure(b)
    clock.now += 10
    cache.set_in_use([a.key])  # a is older but an engine runs on it
    clock.now += 10
    cache.set_in_use([])
    cache.set_in_use([a.key])
    assert cache.ensure(c)  # b (not in use) goes, a stays
    assert cache.is_ready(a) and cache.is_ready(c) and not cache.is_ready(b)
    assert not version_dir(cache.root, b.key).exists()
    assert cache.counters.evictions == 1
    assert cache.used_bytes <= cache.budget_bytes
    # a in use and c kept: d cannot fit, and nothing is evicted for it.
    assert cache.ensure(d, keep=[c.key]) is False
    entry = cache.entry(d.key)
    assert entry is not None and entry.state == "failed"
    assert entry.error == (
        "m@d does not fit in the cache budget (needs 300.0 KiB, budget 610.0 KiB, pinned 600.0 KiB)"
    )
    assert cache.is_ready(a) and cache.is_ready(c)
    with pytest.raises(ValueError, match="in use"):
        cache.evict(a.key)
    # Once c is no longer kept, it is the one evicted for d.
    assert cache.ensure(d)
    assert cache.is_ready(a) and cache.is_ready(d) and not cache.is_ready(c)


def test_a_version_larger_than_the_budget_fails_clearly(tmp_path: Path, src: Path) -> None:
    ref = make_version(src, "m", "big", {"w.bin": blob(64 * KIB)})
    cache = new_cache(tmp_path, budget=32 * KIB, fetcher=_never)
    assert cache.ensure(ref) is False
    assert cache.report().entries[0].error == (
        "m@big does not fit in the cache budget (needs 64.0 KiB, budget 32.0 KiB, pinned 0 B)"
    )


def test_the_disk_free_space_is_checked_first(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = make_version(src, "m", "v1", {"w.bin": blob(64 * KIB)})
    cache = new_cache(tmp_path, fetcher=_never)
    monkeypatch.setattr(cache, "free_bytes", lambda: 10 * KIB)
    assert cache.ensure(ref) is False
    error = cache.report().entries[0].error or ""
    assert error.startswith("disk full: m@v1 needs 64.0 KiB more, 10.0 KiB free")


def test_a_full_disk_mid_fetch_fails_and_keeps_what_was_written(tmp_path: Path, src: Path) -> None:
    ref = make_version(src, "m", "v1", {"w.bin": blob(64 * KIB)})

    def disk_full(artifact: Any, dest: Path, **kw: Any) -> Any:
        dest.write_bytes(b"x" * 1000)
        raise fetching.DiskFull(artifact.name, artifact.uri, "no space left on device")

    cache = new_cache(tmp_path, fetcher=disk_full)
    assert cache.ensure(ref) is False
    entry = cache.report().entries[0]
    assert entry.state == "failed" and "no space left" in (entry.error or "")
    assert not (engine_path(cache.root, ref.key) / "w.bin").exists()
    assert cache.counters.fetch_failures == 1


def test_unreachable_and_unknown_sources_fail_with_one_line(tmp_path: Path, src: Path) -> None:
    ref = ModelRef(
        model="m",
        version="v1",
        key="m@v1",
        artifacts=[
            ArtifactRef(name="w.bin", uri="gopher://host/w.bin", sha256="0" * 64, size_bytes=1)
        ],
    )
    cache = new_cache(tmp_path)
    assert cache.ensure(ref) is False
    error = cache.report().entries[0].error or ""
    assert "w.bin" in error and "gopher" in error and "\n" not in error


@pytest.mark.parametrize(
    "uri",
    [
        "http://u:hunter2@127.0.0.1:99999/w.bin",
        "http://127.0.0.1:port/w.bin",
        "https://ho st/w.bin",
        "http://[::1/w.bin",
    ],
)
def test_a_malformed_url_fails_the_version_instead_of_hanging(tmp_path: Path, uri: str) -> None:
    """A port no fetcher can use raised a ValueError past the cache: the version stayed
    'fetching' with no error, and the fleet never heard of it."""
    ref = ModelRef(
        model="m",
        version="v1",
        key="m@v1",
        artifacts=[ArtifactRef(name="w.bin", uri=uri, sha256="0" * 64, size_bytes=1)],
    )
    cache = new_cache(tmp_path)
    for _ in range(2):  # and again: failed each time, never stuck
        assert cache.ensure(ref) is False
        [entry] = cache.report().entries
        error = entry.error or ""
        assert entry.state == "failed" and error.startswith("w.bin from http"), entry
        assert "unexpected" not in error and "hunter2" not in error and "\n" not in error


def test_an_unexpected_fetcher_error_fails_the_version_with_one_line(
    tmp_path: Path, src: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last resort: whatever a fetcher raises, the version fails with a line the fleet
    shows, and the trace is logged once (no message of the exception in the error: it may
    hold a URI with its credential)."""
    ref = make_version(src, "m", "v1", {"w.bin": b"weights"})

    def broken(*_: Any, **__: Any) -> Any:
        raise KeyError("https://u:hunter2@h/w.bin")

    cache = new_cache(tmp_path, fetcher=broken)
    with caplog.at_level("WARNING", logger="fleet_agent.weights"):
        assert cache.ensure(ref) is False
    [entry] = cache.report().entries
    assert (entry.state, entry.error) == ("failed", "m@v1: unexpected KeyError while fetching")
    traces = [r for r in caplog.records if r.exc_info is not None]
    assert len(traces) == 1 and traces[0].levelname == "WARNING"


def _files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink())


def test_a_name_outside_the_version_directory_is_refused_by_the_agent(
    tmp_path: Path, src: Path
) -> None:
    """The fleet refuses such names at creation; the agent does not count on it."""
    good = make_version(src, "m", "v1", {"w.bin": b"weights"})
    sources = _files_under(tmp_path)
    for name in ("../../escape.bin", "../../../../escape.bin", "/tmp/escape.bin", ".hidden"):
        ref = good.model_copy(
            update={"artifacts": [good.artifacts[0].model_copy(update={"name": name})]}
        )
        cache = new_cache(tmp_path)
        assert cache.ensure(ref) is False
        [entry] = cache.report().entries
        error = entry.error or ""
        assert entry.state == "failed" and error.startswith("m@v1: artifact name"), entry
        assert repr(name) in error and "\n" not in error
    assert _files_under(tmp_path) == sources  # nothing written anywhere
    assert not Path("/tmp/escape.bin").exists()


def test_a_name_through_a_symlink_out_of_the_cache_is_refused(tmp_path: Path, src: Path) -> None:
    """A plain name that a link left in the engine directory would carry elsewhere."""
    ref = make_version(src, "m", "v1", {"sub/w.bin": b"weights"})
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = new_cache(tmp_path)
    edir = engine_path(cache.root, ref.key)
    edir.mkdir(parents=True)
    (edir / "sub").symlink_to(outside)
    assert cache.ensure(ref) is False
    [entry] = cache.report().entries
    assert entry.state == "failed" and "resolves outside" in (entry.error or ""), entry
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(("model", "version"), [("..", "v1"), ("m", "../x"), ("m/x", "v1")])
def test_a_bad_model_or_version_name_is_refused_by_the_agent(
    tmp_path: Path, src: Path, model: str, version: str
) -> None:
    """Its key names no directory of the cache (nor one the report may carry): refused, no
    entry, nothing written."""
    good = make_version(src, "m", "v1", {"w.bin": b"weights"})
    ref = ModelRef.model_construct(
        model=model, version=version, key=f"{model}@{version}", artifacts=good.artifacts
    )
    sources = _files_under(tmp_path)
    cache = new_cache(tmp_path)
    assert cache.ensure(ref) is False
    assert cache.report().entries == [] and cache.counters.fetch_failures == 1
    assert _files_under(tmp_path) == sources


def test_a_stopped_fetch_keeps_its_partial(tmp_path: Path, src: Path) -> None:
    data = blob(512 * KIB)
    ref = make_version(src, "m", "v1", {"w.bin": data})
    stop = threading.Event()

    def slow(artifact: Any, dest: Path, **kw: Any) -> Any:
        inner = kw.pop("progress")

        def progress(n: int) -> None:
            inner(n)
            if n >= 128 * KIB:
                stop.set()

        return fetching.fetch(artifact, dest, progress=progress, **kw)

    cache = new_cache(tmp_path, fetcher=slow)
    with pytest.raises(Stopped):
        cache.ensure(ref, should_stop=stop.is_set)
    partial = cache.root / PARTIAL_DIR / "m" / "v1" / "w.bin"
    assert 0 < partial.stat().st_size < len(data)
    assert cache.report().entries == [] and cache.used_bytes == partial.stat().st_size
    assert cache.ensure(ref)  # resumes
    assert cache.entry(ref.key).resumes == 1  # type: ignore[union-attr]


def test_external_versions_need_nothing(tmp_path: Path) -> None:
    ref = ModelRef(model="m", version="legacy-abc", key="m@legacy-abc", external=True)
    cache = new_cache(tmp_path, fetcher=_never)
    assert cache.is_ready(ref) and cache.ensure(ref)
    assert cache.report().entries == []


def test_the_stager_fetches_in_order_and_stops_what_is_no_longer_wanted(
    tmp_path: Path, src: Path
) -> None:
    big = make_version(src, "m", "big", {"w.bin": blob(1 << 20)})
    small = make_version(src, "m", "small", {"w.bin": blob(16 * KIB)})
    gate = threading.Event()

    def gated(artifact: Any, dest: Path, **kw: Any) -> Any:
        inner = kw.pop("progress")

        def progress(n: int) -> None:
            inner(n)
            if n and artifact.uri.endswith("big/w.bin"):
                gate.wait(5.0)  # hold the big fetch until the test changed its mind

        return fetching.fetch(artifact, dest, progress=progress, **kw)

    cache = new_cache(tmp_path, budget=4 << 20, fetcher=gated)
    stager = Stager(cache, retry_s=0.2, retry_max_s=0.4)
    stager.start()
    try:
        stager.want([big, small])
        _wait(lambda: stager.current == big.key)
        _wait(lambda: _bytes(cache, big.key) > 0)  # the first chunk is in, the next waits
        assert cache.report().entries[0].state == "fetching"
        stager.want([small])  # the assignment changed: big no longer wanted
        gate.set()
        _wait(lambda: cache.is_ready(small))
        assert not cache.is_ready(big)
        partial = cache.root / PARTIAL_DIR / "m" / "big" / "w.bin"
        assert partial.exists() and 0 < partial.stat().st_size < 1 << 20
        stager.want([small, big])
        _wait(lambda: cache.is_ready(big))
        assert cache.entry(big.key).resumes == 1  # type: ignore[union-attr]
        assert stager.pending() == []
    finally:
        stager.close()
    assert stager._thread is None


def test_the_stager_retries_a_failed_version_later(tmp_path: Path, src: Path) -> None:
    ref = make_version(src, "m", "v1", {"w.bin": blob(4 * KIB)})
    (src / "m" / "v1" / "w.bin").rename(src / "away.bin")
    cache = new_cache(tmp_path)
    stager = Stager(cache, retry_s=0.2, retry_max_s=0.4)
    stager.start()
    try:
        stager.want([ref])
        _wait(lambda: any(e.state == "failed" for e in cache.report().entries))
        assert "retry_in_s" in stager.view()
        (src / "away.bin").rename(src / "m" / "v1" / "w.bin")
        _wait(lambda: cache.is_ready(ref))
    finally:
        stager.close()


# ---------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _bytes(cache: WeightsCache, key: str) -> int:
    entry = cache.entry(key)
    return entry.bytes if entry is not None else 0


def _never(*args: Any, **kw: Any) -> Any:
    raise AssertionError("nothing should be fetched")


def _wait(probe: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def test_fetched_files_are_fsynced_before_the_rename(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order that keeps a crash honest: the file's data, the rename, the directory."""
    ref = make_version(src, "m", "v1", {"w.bin": blob(4 * KIB)})
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(a: Any, b: Any) -> None:
        events.append(f"rename {Path(b).name}")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cache = new_cache(tmp_path)
    assert cache.ensure(ref)
    assert events[:3] == ["fsync-file", "rename w.bin", "fsync-dir"]
    assert events[-3:] == ["fsync-file", f"rename {MARKER}", "fsync-dir"]


def test_directories_not_laid_out_as_versions_are_left_alone(tmp_path: Path, src: Path) -> None:
    """A cache directory shared with something else (say, the agent's work dir): what does not
    look like <model>/<version>/<model>/ is neither counted nor evicted."""
    stranger = tmp_path / "cache" / "engines" / "chat"
    stranger.mkdir(parents=True)
    (stranger / "replica-0.log").write_bytes(b"x" * 4096)
    ref = make_version(src, "m", "v1", {"w.bin": blob(8 * KIB)})
    cache = new_cache(tmp_path, budget=8 * KIB)
    assert cache.used_bytes == 0
    assert cache.ensure(ref)
    assert (stranger / "replica-0.log").exists()


# ---------------------------------------------------------------------------------------------
# the daemon's use of the cache (a recording supervisor; the real one: tests/e2e/
# test_agent_weights.py)


class _Supervisor:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, Path | None]] = []
        self.deployment: str | None = None
        self.version: str | None = None
        self.ready = False

    def apply(
        self, assignment: dict[str, Any] | None, gpus: Any = None, *, model_dir: Path | None = None
    ) -> None:
        kind = (assignment or {}).get("kind", "none")
        if kind != "serve":
            self.deployment = self.version = None
            self.calls.append((None, None))
            return
        assert assignment is not None
        self.deployment = assignment["deployment"]
        self.version = (assignment.get("model") or {}).get("key")
        self.calls.append((self.version, model_dir))

    def replica_stats(self) -> list[dict[str, Any]]:
        return []


def _agent(tmp_path: Path, cache: WeightsCache, sup: _Supervisor) -> Any:
    from pydantic import SecretStr

    from fleet_agent.config import AgentSettings
    from fleet_agent.daemon import Agent
    from fleet_agent.fleet_client import FleetClient
    from fleet_agent.telemetry.simulated import SimulatedTelemetry

    settings = AgentSettings(
        server="gpu-1", token=SecretStr("t"), telemetry="simulated", work_dir=tmp_path / "w"
    )
    client = FleetClient("http://fleet.test", "t", 1.0)
    agent = Agent(
        settings,
        SimulatedTelemetry("H100", 2, seed=1),
        client,
        supervisor=sup,  # type: ignore[arg-type]
        cache=cache,
    )
    agent._observe()
    return agent


def _serve(ref: ModelRef, deployment: str = "chat", keep: tuple[str, ...] = ()) -> Any:
    from fleet_core.wire import Assignment

    return Assignment(
        kind="serve",
        deployment=deployment,
        model_uri="m",
        model=ref,
        engine_params={"tp_size": 1},
        gpus_per_replica=1,
        replicas=1,
        keep=list(keep),
    )


def test_the_daemon_serves_the_old_version_until_the_new_one_is_cached(
    tmp_path: Path, src: Path
) -> None:
    from fleet_core.wire import Assignment

    v1 = make_version(src, "m", "v1", {"w.bin": blob(4 * KIB, 1)})
    v2 = make_version(src, "m", "v2", {"w.bin": blob(4 * KIB, 2)})
    cache = new_cache(tmp_path)
    sup = _Supervisor()
    agent = _agent(tmp_path, cache, sup)
    stager = agent.stager

    agent.assignment = _serve(v1, keep=(v1.key,))
    agent._stage()
    agent._steer_engines()
    assert sup.calls == []  # nothing cached: no engine yet
    assert stager.pending() == [v1.key]
    assert stager.run_one(v1) is True
    agent._stage()
    agent._steer_engines()
    assert sup.calls == [(v1.key, cache.engine_dir(v1.key))]
    agent._stage()
    assert cache.in_use == {v1.key}

    # A rollout: v2 is fetched while v1 serves on; then the engines move to it.
    agent.assignment = _serve(v2, keep=(v1.key, v2.key))
    agent._stage()
    agent._steer_engines()
    assert sup.calls[-1] == (v1.key, cache.engine_dir(v1.key)) and len(sup.calls) == 1
    assert stager.run_one(v2) is True
    agent._steer_engines()
    assert sup.calls[-1] == (v2.key, cache.engine_dir(v2.key))
    agent._stage()
    assert cache.in_use == {v2.key}

    # Another deployment whose version is not cached: the engines of this one stop now.
    v3 = make_version(src, "m", "v3", {"w.bin": blob(4 * KIB, 3)})
    agent.assignment = _serve(v3, deployment="other")
    agent._steer_engines()
    assert sup.calls[-1:] == [(None, None)] and sup.deployment is None

    # Staging: the versions are wanted, no engine runs.
    agent.assignment = Assignment(kind="stage", stage=[v3], keep=[v3.key])
    agent._stage()
    agent._steer_engines()
    assert stager.pending() == [v3.key] and sup.deployment is None
    heartbeat = agent.heartbeat()
    assert heartbeat.cache is not None
    assert {e.key: e.state for e in heartbeat.cache.entries} == {v1.key: "ready", v2.key: "ready"}
    assert agent.state()["cache"]["stager"]["wanted"] == [v3.key]


def test_the_cache_budget_setting_takes_units(tmp_path: Path) -> None:
    from pydantic import SecretStr, ValidationError

    from fleet_agent.config import AgentSettings, parse_bytes

    assert parse_bytes("500GiB") == 500 << 30
    assert parse_bytes("2 TB") == 2 * 10**12
    assert parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes("1073741824") == 1 << 30
    for bad in ("", "GiB", "12 parsecs", "-1GiB", "nan"):
        with pytest.raises(ValueError, match="byte size"):
            parse_bytes(bad)
    settings = AgentSettings(
        server="gpu-1", token=SecretStr("t"), cache_bytes="4GiB", work_dir=tmp_path
    )
    assert settings.cache_bytes == 4 << 30 and settings.weights_dir() == tmp_path / "weights"
    with pytest.raises(ValidationError, match="byte size"):
        AgentSettings(server="gpu-1", token=SecretStr("t"), cache_bytes="lots")
