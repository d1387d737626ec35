"""The weights fetcher against real peers on 127.0.0.1 (tests/weights_peers.py): nginx serving
multi-GB sparse files (Range requests past 2 GiB), moto's S3 server checking SigV4, a stdlib
server that cuts connections or ignores Range, and a full disk (an 8 MiB tmpfs).

Every peer is stopped at teardown; every retry loop in the fetcher is bounded (MAX_ATTEMPTS).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from weights_peers import (
    MotoPeer,
    NginxPeer,
    WeightFile,
    copy_prefix,
    cutting_http_peer,
    flip_byte,
    moto_peer,
    nginx_peer,
    sha256_file,
    sparse_file,
)

from fleet_agent.weights import fetch as fetch_module
from fleet_agent.weights.fetch import (
    ChecksumMismatch,
    DiskFull,
    SizeMismatch,
    SourceRefused,
    SourceUnreachable,
    fetch,
)
from fleet_core.wire import ArtifactRef

GIB = 1 << 30
MIB = 1 << 20
BIG = 2 * GIB + 3 * MIB + 7  # past 2^31: Range offsets and sizes beyond a 32-bit int


def ref(made: WeightFile, uri: str, **update: object) -> ArtifactRef:
    base = ArtifactRef(name=made.name, uri=uri, sha256=made.sha256, size_bytes=made.size)
    return base.model_copy(update=update)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NginxPeer, Path]]:
    root = tmp_path_factory.mktemp("nginx-root")
    with nginx_peer(root, tmp_path_factory.mktemp("nginx-work")) as peer:
        yield peer, root


@pytest.fixture(scope="module")
def big(served: tuple[NginxPeer, Path]) -> WeightFile:
    return sparse_file(served[1] / "model-00001-of-00002.safetensors", BIG, seed=1)


def test_nginx_multi_gb_file_fetched_and_verified(
    served: tuple[NginxPeer, Path], big: WeightFile, tmp_path: Path
) -> None:
    peer, _ = served
    dest = tmp_path / "partial"
    result = fetch(ref(big, peer.url(big.name)), dest)
    assert (result.bytes, result.resumed_from, result.transferred) == (BIG, 0, BIG)
    assert dest.stat().st_size == BIG


def test_nginx_resume_past_2_gib(
    served: tuple[NginxPeer, Path], big: WeightFile, tmp_path: Path
) -> None:
    """A partial of 2 GiB + 1 MiB: only the rest comes over (a 206), and the digest still
    covers the whole file (the kept bytes are hashed first)."""
    peer, _ = served
    dest = tmp_path / "partial"
    kept = 2 * GIB + MIB
    copy_prefix(big.path, dest, kept)
    result = fetch(ref(big, peer.url(big.name)), dest)
    assert (result.resumed_from, result.transferred) == (kept, BIG - kept)
    # Size unknown and the partial already whole: nginx answers 416 with the size; done.
    again = fetch(ref(big, peer.url(big.name), size_bytes=None), dest)
    assert (again.resumed_from, again.transferred, again.bytes) == (BIG, 0, BIG)


def test_nginx_flipped_byte_and_missing_file(
    served: tuple[NginxPeer, Path], tmp_path: Path
) -> None:
    peer, root = served
    made = sparse_file(root / "flipped.bin", 48 * MIB, seed=2)
    flip_byte(made.path, 30 * MIB)  # served bytes no longer match the recorded digest
    dest = tmp_path / "partial"
    with pytest.raises(ChecksumMismatch) as caught:
        fetch(ref(made, peer.url(made.name)), dest)
    assert caught.value.actual == sha256_file(made.path) != made.sha256
    assert str(caught.value).startswith(f"flipped.bin from {peer.url('flipped.bin')}: sha256")
    with pytest.raises(SourceRefused) as refused:
        fetch(ref(made, peer.url("absent.bin")), tmp_path / "other")
    assert refused.value.status == 404 and "HTTP 404" in str(refused.value)


def test_nginx_size_on_record_differs(served: tuple[NginxPeer, Path], tmp_path: Path) -> None:
    peer, root = served
    made = sparse_file(root / "sized.bin", 3 * MIB, seed=4)
    with pytest.raises(SizeMismatch, match="expected 4194304 bytes, the source has 3145728"):
        fetch(ref(made, peer.url(made.name), size_bytes=4 * MIB), tmp_path / "p")


def test_https_verified_against_the_trusted_certificate_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = sparse_file(tmp_path / "root" / "tls.bin", 6 * MIB + 1, seed=10)
    with nginx_peer(tmp_path / "root", tmp_path / "work", tls=True) as peer:
        assert peer.base_url.startswith("https://") and peer.ca_file is not None
        with pytest.raises(SourceUnreachable, match=r"^tls\.bin from https://.*TLS: "):
            fetch(ref(made, peer.url(made.name)), tmp_path / "untrusted")
        monkeypatch.setenv("SSL_CERT_FILE", str(peer.ca_file))  # as an operator's CA bundle
        dest = tmp_path / "partial"
        copy_prefix(made.path, dest, 2 * MIB)
        result = fetch(ref(made, peer.url(made.name)), dest)
    assert (result.resumed_from, result.bytes) == (2 * MIB, made.size)


def test_cut_mid_stream_resumes_from_the_bytes_written(tmp_path: Path) -> None:
    made = sparse_file(tmp_path / "root" / "cut.bin", 32 * MIB + 5, seed=5)
    with cutting_http_peer(tmp_path / "root", cut_after=5 * MIB, cuts=3) as peer:
        result = fetch(ref(made, peer.url(made.name)), tmp_path / "partial", chunk=MIB)
    assert (result.transferred, result.resumes) == (made.size, 3)
    # Each retry asks from the bytes written (a cut loses what the kernel had not handed
    # over yet, so a little less than the server sent), never from 0 again.
    starts = [int(r[1].removeprefix("bytes=").rstrip("-")) if r[1] else 0 for r in peer.requests]
    assert [r[2] for r in peer.requests] == [200, 206, 206, 206]
    assert starts[0] == 0 and all(b > a for a, b in itertools.pairwise(starts))
    assert all(starts[i] <= 5 * MIB * i for i in range(4))
    assert sum(r[3] for r in peer.requests) < made.size + 3 * 5 * MIB


def test_a_server_ignoring_range_restarts_from_zero(tmp_path: Path) -> None:
    made = sparse_file(tmp_path / "root" / "norange.bin", 12 * MIB, seed=6)
    dest = tmp_path / "partial"
    copy_prefix(made.path, dest, 7 * MIB)
    with cutting_http_peer(tmp_path / "root", cut_after=0, cuts=0, honour_range=False) as peer:
        result = fetch(ref(made, peer.url(made.name)), dest)
    assert (result.resumed_from, result.transferred) == (0, made.size)
    assert peer.requests[0][1:3] == ("bytes=7340032-", 200)
    assert sha256_file(dest) == made.sha256


def test_cuts_without_end_are_bounded(tmp_path: Path) -> None:
    """Every answer cut after 1 MiB: some tries keep a little, some nothing (a reset drops
    what the kernel still held); either bound ends it: `retries` tries in a row without
    progress, or MAX_ATTEMPTS in all. The partial keeps what arrived, for a later resume."""
    made = sparse_file(tmp_path / "root" / "flaky.bin", 80 * MIB, seed=7)
    dest = tmp_path / "partial"
    with (
        cutting_http_peer(tmp_path / "root", cut_after=MIB, cuts=10_000) as peer,
        pytest.raises(SourceUnreachable) as caught,
    ):
        fetch(ref(made, peer.url(made.name)), dest, chunk=MIB, backoff_s=0.01)
    found = re.search(r"\((\d+) bytes kept; gave up after (\d+) tries\)$", str(caught.value))
    assert found is not None, str(caught.value)
    kept, tries = int(found.group(1)), int(found.group(2))
    assert tries == len(peer.requests) <= fetch_module.MAX_ATTEMPTS
    # What arrived is on disk, and no more: whether any try kept bytes is the kernel's (a
    # reset may drop all it held, every time; a CI run saw 0 kept), so 0 is a valid outcome.
    assert 0 <= kept == dest.stat().st_size < made.size


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoPeer]:
    with moto_peer(tmp_path_factory.mktemp("moto")) as peer:
        peer.create_bucket("weights")
        yield peer


def test_s3_fetch_resume_and_refusals(moto: MotoPeer, tmp_path: Path) -> None:
    """256 MiB through moto's S3 API with SigV4 checked: whole, resumed by Range, and the
    refusals (bad secret, missing key) named with their S3 codes and no secret."""
    made = sparse_file(tmp_path / "s3src" / "model.safetensors", 256 * MIB + 11, seed=8)
    uri = moto.upload("weights", "llama/v1/model.safetensors", made.path)
    settings = moto.s3_settings()
    dest = tmp_path / "partial"
    whole = fetch(ref(made, uri), dest, s3=settings)
    assert (whole.bytes, whole.transferred) == (made.size, made.size)
    dest.unlink()
    copy_prefix(made.path, dest, 100 * MIB + 3)
    resumed = fetch(ref(made, uri), dest, s3=settings)
    assert (resumed.resumed_from, resumed.transferred) == (
        100 * MIB + 3,
        made.size - resumed.resumed_from,
    )
    bad_secret = "not-the-secret-0123456789"
    with pytest.raises(SourceRefused) as refused:
        fetch(ref(made, uri), tmp_path / "p2", s3=moto.s3_settings(secret=bad_secret))
    assert (refused.value.status, refused.value.code) == (403, "SignatureDoesNotMatch")
    assert bad_secret not in str(refused.value) and moto.secret_access_key not in str(refused.value)
    with pytest.raises(SourceRefused) as missing:
        fetch(ref(made, "s3://weights/llama/v2/absent"), tmp_path / "p3", s3=settings)
    assert (missing.value.status, missing.value.code) == (404, "NoSuchKey")
    assert str(missing.value) == (
        "model.safetensors from s3://weights/llama/v2/absent: refused (HTTP 404 NoSuchKey)"
    )


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (needs root to mount: CI and this workplace run as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_disk(tiny_disk: Path, tmp_path: Path) -> None:
    # Random bytes, not a sparse file: the fetcher writes zero blocks as holes, which a full
    # disk would still hold.
    source = tmp_path / "src" / "big.bin"
    source.parent.mkdir()
    data = random.Random(9).randbytes(16 * MIB)
    source.write_bytes(data)
    made = WeightFile(path=source, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    dest = tiny_disk / "partial"
    # Size known: refused before a byte is written.
    with pytest.raises(DiskFull, match=r"needs 16777216 more bytes, \d+ free"):
        fetch(ref(made, made.path.as_uri()), dest)
    assert dest.stat().st_size == 0
    # Size unknown: ENOSPC at a write; the partial is cut back to the bytes written whole.
    with pytest.raises(DiskFull, match="no space left on the cache's disk"):
        fetch(ref(made, made.path.as_uri(), size_bytes=None), dest, chunk=MIB)
    kept = dest.stat().st_size
    assert 0 < kept <= 8 * MIB and kept % MIB == 0
