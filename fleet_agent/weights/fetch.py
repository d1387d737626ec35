"""Fetch one model file into a partial path, resuming and verifying (docs/weights.md).

`fetch(artifact, dest, ...)` brings `artifact.uri` (file://, http(s)://, s3://) to `dest`, the
cache's PARTIAL path: the cache (cache.py) renames it into place only after this returns, so
a half-written or corrupt file is never where an engine looks.

- Resume: bytes already in `dest` are kept and streamed through sha256 first, then the rest
  is asked for from there (HTTP/S3 Range, a seek for file://), so the digest covers the whole
  file. A server that ignores Range (200, not 206) restarts the file from byte 0.
- Verify while streaming: sha256 and the size are checked on the bytes written; a mismatch
  raises ChecksumMismatch/SizeMismatch and leaves `dest` as it is (the caller deletes it).
- Retries, all bounded: a refused/unresolved/timed-out connection or a 5xx is retried with
  exponential backoff (`retries` times in a row); a body cut mid-way resumes from the bytes
  written (a try that made progress starts the count again; MAX_ATTEMPTS in all).
- Speed: 1 MiB reads into a few reused buffers; sha256 runs in a second thread on the buffer
  just written while the next is read (hashlib and the socket both release the GIL), so
  hashing hides behind the transfer where a core is free; no flush or fsync per chunk (the
  cache fsyncs once, at rename). 1 MiB, not 8: the buffer is still in the CPU's cache when
  it is hashed; measured beside `curl -o` on this 2-core machine (1 GiB from nginx, 4 runs
  each): 1 MiB 0.81-1.0x curl's time, 8 MiB 1.2-1.3x, at the same CPU seconds
  (bench/weights_fetch.py). Without hashing the loop costs 0.6x curl's CPU: sha256 (~0.8 CPU
  s per GB here, OpenSSL's speed on this CPU) is the whole difference.
- Errors: FetchError and its subclasses, one line naming the artifact and its URI without
  credentials or query string (`display_uri`); never a secret.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from fleet_agent.weights import fetch_http
from fleet_agent.weights.s3 import S3Settings, object_request, split_s3_uri

SCHEMES = ("file", "http", "https", "s3")
CHUNK = 1 << 20
MIN_CHUNK = 64 << 10
MAX_CHUNK = 256 << 20
# Buffers in flight between the reader and the hashing thread (memory: DEPTH × chunk).
DEPTH = 4
# Every try of one fetch, whatever made progress: the hard bound.
MAX_ATTEMPTS = 64
MAX_BACKOFF_S = 8.0
# A buffer not handed back by the hashing thread within this long is a bug, not a wait.
_HASH_STALL_S = 120.0
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ArtifactLike(Protocol):
    """What fetch reads of an artifact (fleet_core.wire.ArtifactRef has it)."""

    @property
    def name(self) -> str: ...
    @property
    def uri(self) -> str: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def size_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class FetchResult:
    """A verified fetch: `bytes` in the file now, `seconds` this call took, `resumed_from`
    the bytes that were already in `dest` and kept (0: fetched from the start),
    `transferred` the bytes that came over the source this call, `sha256` (hex) verified,
    `resumes` the tries within this call that went on from bytes already written (after a
    cut: each a Range request from there)."""

    bytes: int
    seconds: float
    resumed_from: int
    transferred: int
    sha256: str
    resumes: int = 0


class FetchError(Exception):
    """A fetch that did not produce a verified file. `str()` is one line: the artifact's
    name, its URI without credentials or query, and why."""

    resumes = 0  # cuts resumed within the call before it failed (a checksum found wrong)

    def __init__(self, name: str, uri: str, reason: str) -> None:
        self.name = name
        self.uri = display_uri(uri)
        self.reason = reason
        super().__init__(f"{name} from {self.uri}: {reason}")


class UnknownScheme(FetchError):
    """The URI's scheme is none of SCHEMES."""


class SourceUnreachable(FetchError):
    """No usable answer after the bounded retries: refused, unresolved, timed out, 5xx, TLS
    untrusted, or cut more often than allowed (the partial stays: a later fetch resumes)."""


class SourceRefused(FetchError):
    """The source answered no: HTTP 4xx, S3 NoSuchKey/AccessDenied/..., no such local file,
    or s3:// without S3 settings. Retrying will not help. `status`: the HTTP status (0 when
    none), `code`: the S3 error code when given."""

    def __init__(
        self, name: str, uri: str, reason: str, status: int = 0, code: str | None = None
    ) -> None:
        super().__init__(name, uri, reason)
        self.status = status
        self.code = code


class ChecksumMismatch(FetchError):
    """The bytes' sha256 is not the artifact's: the partial in `dest` is bad (delete it)."""

    def __init__(self, name: str, uri: str, expected: str, actual: str) -> None:
        super().__init__(
            name, uri, f"sha256 mismatch (expected {expected[:12]}…, got {actual[:12]}…)"
        )
        self.expected = expected
        self.actual = actual


class SizeMismatch(FetchError):
    """The source has (or gave) a different number of bytes than the artifact says."""

    def __init__(self, name: str, uri: str, expected: int, actual: int, what: str) -> None:
        super().__init__(name, uri, f"size mismatch: expected {expected} bytes, {what} {actual}")
        self.expected = expected
        self.actual = actual


class DiskFull(FetchError):
    """No space left for the file (ENOSPC/EDQUOT, or too little free before starting)."""


class FetchStopped(FetchError):
    """`should_stop` said stop: the partial stays, a later fetch resumes it."""


def display_uri(uri: str) -> str:
    """`uri` fit for a message: scheme, host, port and path; no user, password, query or
    fragment (a presigned URL's signature lives in its query)."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # a bracket left open ("http://[::1/w"): the scheme is all that is safe
        return uri.split(":", 1)[0][:16] + ":…"
    # What follows the last "@" is host and port: no credential, even where the port is bad.
    netloc = parts.netloc.rpartition("@")[2][:100]
    shown = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else parts.path
    return shown[:300]


def fetch(
    artifact: ArtifactLike,
    dest: Path,
    *,
    s3: S3Settings | None = None,
    progress: Callable[[int], None] | None = None,
    chunk: int = CHUNK,
    timeout: float = 30.0,
    should_stop: Callable[[], bool] | None = None,
    retries: int = 4,
    backoff_s: float = 0.5,
) -> FetchResult:
    """Fetch `artifact` into `dest` (the partial path), resuming what `dest` holds, and
    verify it. `progress(n)` is called with the bytes in `dest` so far (resumed ones
    included) after each chunk; `timeout` bounds connecting and each read (seconds);
    `should_stop()` is asked between chunks and backoffs (True → FetchStopped); `retries`:
    consecutive failed tries allowed before giving up, `backoff_s` the first wait (doubling,
    at most MAX_BACKOFF_S). Raises FetchError's subclasses; `dest` is never renamed here."""
    name, uri = artifact.name, artifact.uri
    expected_sha = artifact.sha256
    expected_size = artifact.size_bytes
    try:
        scheme = urlsplit(uri).scheme.lower() if "://" in uri else ""
    except ValueError as exc:  # "http://[::1/w": refused like any source that cannot be asked
        raise SourceRefused(name, uri, f"not a usable URI ({exc})") from None
    if scheme not in SCHEMES:
        raise UnknownScheme(
            name, uri, f"unknown scheme {scheme or '(none)'!r} (accepted: {', '.join(SCHEMES)})"
        )
    if expected_sha is None or not _SHA256.match(expected_sha):
        raise FetchError(name, uri, "no sha256 to verify against (64 lowercase hex digits)")
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be {MIN_CHUNK}..{MAX_CHUNK} bytes")
    stop = should_stop or (lambda: False)
    started = time.monotonic()
    open_body = _opener(scheme, name, uri, s3, timeout)
    try:
        fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _local_error(name, uri, exc, "cannot open the partial file") from None
    try:
        sink = _Sink(fd, name, uri, chunk, progress)
        try:
            have = os.fstat(fd).st_size
            if expected_size is not None and have > expected_size:
                have = 0  # longer than the file can be: not a prefix of it
            sink.adopt(have, stop)
            resumed_from = sink.written
            if expected_size is not None:
                _check_space(dest, expected_size - sink.written, name, uri)
            transferred, resumes = _transfer(
                open_body, sink, name, uri, expected_size, stop, retries, backoff_s
            )
            actual_sha = sink.finish()
        finally:
            sink.close()
    finally:
        os.close(fd)
    wrong: FetchError | None = None
    if expected_size is not None and sink.written != expected_size:
        wrong = SizeMismatch(name, uri, expected_size, sink.written, "got")
    elif actual_sha != expected_sha:
        wrong = ChecksumMismatch(name, uri, expected_sha, actual_sha)
    if wrong is not None:
        wrong.resumes = resumes + (resumed_from > 0)
        raise wrong
    return FetchResult(
        bytes=sink.written,
        seconds=time.monotonic() - started,
        resumed_from=resumed_from if sink.kept_prefix else 0,
        transferred=transferred,
        sha256=actual_sha,
        resumes=resumes,
    )


# ---- sources --------------------------------------------------------------------------------

OpenBody = Callable[[int], "_Readable"]


class _Readable(Protocol):
    start: int
    length: int | None
    total: int | None

    def readinto(self, buffer: memoryview) -> int: ...
    def close(self) -> None: ...


class _Complete(Exception):
    """The source says there is nothing past the bytes we hold (416 with their total)."""


def _opener(scheme: str, name: str, uri: str, s3: S3Settings | None, timeout: float) -> OpenBody:
    if scheme == "file":
        return _file_opener(name, uri)
    if scheme == "s3":
        if s3 is None:
            raise SourceRefused(name, uri, "no S3 endpoint configured (FLEET_AGENT_S3_*)")
        try:
            split_s3_uri(uri)
        except ValueError as exc:
            raise SourceRefused(name, uri, str(exc)) from None
        settings = s3

        def s3_request(offset: int) -> tuple[str, dict[str, str]]:
            extra = {"Range": f"bytes={offset}-"} if offset > 0 else {}
            request = object_request(settings, uri, extra)
            return request.url, request.headers

        return lambda offset: fetch_http.get(s3_request, offset, timeout, follow_redirects=False)
    return lambda offset: fetch_http.get(lambda _: (uri, {}), offset, timeout)


@dataclass
class _FileBody:
    start: int
    length: int | None
    total: int | None
    fd: int

    def readinto(self, buffer: memoryview) -> int:
        return os.readv(self.fd, [buffer])

    def close(self) -> None:
        os.close(self.fd)


def _file_opener(name: str, uri: str) -> OpenBody:
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise SourceRefused(name, uri, "file:// URIs name a local absolute path")
    path = unquote(parts.path)

    def open_file(offset: int) -> _Readable:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SourceRefused(name, uri, "no such file") from None
        except PermissionError:
            raise SourceRefused(name, uri, "permission denied") from None
        except OSError as exc:
            raise _local_error(name, uri, exc, "cannot open the source") from None
        size = os.fstat(fd).st_size
        start = offset if offset <= size else 0
        os.lseek(fd, start, os.SEEK_SET)
        os.posix_fadvise(fd, start, 0, os.POSIX_FADV_SEQUENTIAL)
        return _FileBody(start=start, length=size - start, total=size, fd=fd)

    return open_file


# ---- the transfer loop ----------------------------------------------------------------------


def _transfer(
    open_body: OpenBody,
    sink: _Sink,
    name: str,
    uri: str,
    expected_size: int | None,
    stop: Callable[[], bool],
    retries: int,
    backoff_s: float,
) -> tuple[int, int]:
    """Read the source into `sink` until complete, trying again (bounded) on transient
    failures. Returns the bytes transferred and the tries that resumed written bytes."""
    transferred = 0
    resumes = 0
    failures = 0  # in a row, without progress
    last_error = ""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        if expected_size is not None and sink.written == expected_size:
            return transferred, resumes
        if stop():
            raise FetchStopped(name, uri, f"stopped at {sink.written} bytes")
        before = sink.written
        resumes += attempt > 1 and before > 0
        try:
            got = _one_try(open_body, sink, name, uri, expected_size, stop)
            return transferred + got, resumes
        except _Complete:
            return transferred, resumes
        except _Transient as exc:
            transferred += exc.transferred
            last_error = exc.reason
        except fetch_http.Untrusted as exc:
            raise SourceUnreachable(name, uri, f"TLS: {exc}") from None
        failures = 1 if sink.written > before else failures + 1
        if failures > retries:
            break
        if sink.written == before:  # no progress: back off before asking again
            _sleep(min(backoff_s * 2 ** (failures - 1), MAX_BACKOFF_S), stop, name, uri, sink)
        if attempt == MAX_ATTEMPTS:
            break
    raise SourceUnreachable(
        name, uri, f"{last_error} ({sink.written} bytes kept; gave up after {attempt} tries)"
    )


class _Transient(Exception):
    def __init__(self, reason: str, transferred: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transferred = transferred


def _one_try(
    open_body: OpenBody,
    sink: _Sink,
    name: str,
    uri: str,
    expected_size: int | None,
    stop: Callable[[], bool],
) -> int:
    try:
        body = open_body(sink.written)
    except fetch_http.Unreachable as exc:
        raise _Transient(str(exc), 0) from None
    except fetch_http.RangeNotSatisfiable as exc:
        if exc.total is not None and exc.total == sink.written and sink.written > 0:
            raise _Complete() from None
        sink.restart()  # our prefix is not a prefix of theirs: from byte 0
        raise _Transient("range not satisfiable: restarting from byte 0", 0) from None
    except fetch_http.Status as exc:
        if exc.retryable:
            raise _Transient(f"HTTP {exc.status}", 0) from None
        reason = exc.reason or (f"refused (HTTP {exc.status}{' ' + exc.code if exc.code else ''})")
        raise SourceRefused(name, uri, reason, exc.status, exc.code) from None
    received = 0
    try:
        if expected_size is not None and body.total is not None and body.total != expected_size:
            raise SizeMismatch(name, uri, expected_size, body.total, "the source has")
        if body.start != sink.written:
            sink.restart()  # a server that ignored Range: it sends the file from byte 0
            if body.start != 0:  # another range than asked: ask again, from byte 0
                raise _Transient("the source answered another range: starting over", 0)
        end = None if body.length is None else sink.written + body.length
        while end is None or sink.written < end:
            if stop():
                raise FetchStopped(name, uri, f"stopped at {sink.written} bytes")
            buffer = sink.buffer()
            want = len(buffer) if end is None else min(len(buffer), end - sink.written)
            if expected_size is not None:
                # Never write past the size the artifact has; one byte more proves it longer.
                want = min(want, expected_size - sink.written + 1)
            try:
                n = body.readinto(memoryview(buffer)[:want])
            except fetch_http.Cut as exc:
                sink.give_back(buffer)
                raise _Transient(str(exc), received) from None
            except OSError as exc:  # file:// read
                sink.give_back(buffer)
                raise _local_error(name, uri, exc, "cannot read the source") from None
            if n == 0:
                sink.give_back(buffer)
                if end is not None:
                    raise _Transient("body cut short", received)
                break
            if expected_size is not None and sink.written + n > expected_size:
                sink.give_back(buffer)
                raise SizeMismatch(name, uri, expected_size, sink.written + n, "got at least")
            sink.write(buffer, n)
            received += n
        return received
    finally:
        body.close()


def _sleep(seconds: float, stop: Callable[[], bool], name: str, uri: str, sink: _Sink) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if stop():
            raise FetchStopped(name, uri, f"stopped at {sink.written} bytes")
        time.sleep(min(left, 0.1))


def _check_space(dest: Path, needed: int, name: str, uri: str) -> None:
    if needed <= 0:
        return
    try:
        st = os.statvfs(dest.parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise DiskFull(name, uri, f"no space: needs {needed} more bytes, {free} free")


def _local_error(name: str, uri: str, exc: OSError, what: str) -> FetchError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(name, uri, "no space left on the cache's disk")
    return FetchError(name, uri, f"{what}: {(exc.strerror or type(exc).__name__).lower()}")


# ---- the sink: write + hash ------------------------------------------------------------------


_ZEROS: dict[int, bytes] = {}


def _all_zero(buffer: bytearray, n: int) -> bool:
    """Whether the first n bytes are zeros (a memcmp against a zero block of that length)."""
    zeros = _ZEROS.get(n)
    if zeros is None:
        zeros = _ZEROS.setdefault(n, bytes(n)) if len(_ZEROS) < 8 else bytes(n)
    return (buffer if n == len(buffer) else buffer[:n]) == zeros


class _Sink:
    """The partial file and its running sha256. Buffers go reader → write here → hashing
    thread → back to the pool; the pool's DEPTH bounds memory and how far hashing may lag."""

    def __init__(
        self, fd: int, name: str, uri: str, chunk: int, progress: Callable[[int], None] | None
    ) -> None:
        self.fd = fd
        self.name = name
        self.uri = uri
        self.written = 0
        self.kept_prefix = True
        self._progress = progress
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(DEPTH):
            self._free.put(bytearray(chunk))
        self._hasher = _HashThread(self._free)

    def buffer(self) -> bytearray:
        try:
            return self._free.get(timeout=_HASH_STALL_S)
        except queue.Empty:
            raise FetchError(self.name, self.uri, "hashing stalled") from None

    def give_back(self, buffer: bytearray) -> None:
        self._free.put(buffer)

    def adopt(self, have: int, stop: Callable[[], bool]) -> None:
        """Keep the first `have` bytes already in the file: hash them (the digest covers the
        whole file), drop anything after."""
        os.ftruncate(self.fd, have)
        if have:
            os.posix_fadvise(self.fd, 0, have, os.POSIX_FADV_SEQUENTIAL)
        os.lseek(self.fd, 0, os.SEEK_SET)
        while self.written < have:
            if stop():
                raise FetchStopped(self.name, self.uri, "stopped while checking the partial")
            buffer = self.buffer()
            view = memoryview(buffer)[: min(len(buffer), have - self.written)]
            n = os.readv(self.fd, [view])
            if n == 0:
                self.give_back(buffer)
                break
            self._hasher.submit(buffer, n)
            self.written += n
        os.ftruncate(self.fd, self.written)
        os.lseek(self.fd, self.written, os.SEEK_SET)
        if self._progress is not None:
            self._progress(self.written)

    def restart(self) -> None:
        """From byte 0 again: empty the file, a fresh digest."""
        self._hasher.close()
        self._hasher = _HashThread(self._free)
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.written = 0
        self.kept_prefix = False

    def write(self, buffer: bytearray, n: int) -> None:
        view = memoryview(buffer)[:n]
        done = 0
        try:
            if _all_zero(buffer, n):
                # A hole, as `cp --sparse` leaves: the same bytes to every reader, no disk
                # written (model files hardly have zero runs; generated test files do).
                os.ftruncate(self.fd, self.written + n)
                os.lseek(self.fd, self.written + n, os.SEEK_SET)
                done = n
            while done < n:
                done += os.write(self.fd, view[done:])
        except OSError as exc:
            # What did land is a clean prefix: truncate to it so a resume starts right.
            self.give_back(buffer)
            os.ftruncate(self.fd, self.written)
            raise _local_error(self.name, self.uri, exc, "cannot write the partial") from None
        self._hasher.submit(buffer, n)
        self.written += n
        if self._progress is not None:
            self._progress(self.written)

    def finish(self) -> str:
        return self._hasher.close()

    def close(self) -> None:
        self._hasher.close()


class _HashThread:
    """sha256 over buffers in order, in its own thread; each buffer goes back to `free`."""

    def __init__(self, free: queue.Queue[bytearray]) -> None:
        self._free = free
        self._todo: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self._sha = hashlib.sha256()
        self._digest: str | None = None
        self._thread = threading.Thread(target=self._run, name="weights-sha256", daemon=True)
        self._thread.start()

    def submit(self, buffer: bytearray, n: int) -> None:
        self._todo.put((buffer, n))

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            buffer, n = item
            self._sha.update(memoryview(buffer)[:n])
            self._free.put(buffer)

    def close(self) -> str:
        """Wait for the buffers submitted so far; the hex digest of all of them."""
        if self._digest is None:
            self._todo.put(None)
            self._thread.join()
            self._digest = self._sha.hexdigest()
        return self._digest
