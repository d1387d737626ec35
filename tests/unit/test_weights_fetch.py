"""The weights fetcher without network peers: file:// sources (resume, verification, stop),
the URI shown in errors, S3 settings and SigV4 signing (AWS's published example)."""

from __future__ import annotations

import datetime as dt
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import pytest
from pydantic import SecretStr
from weights_peers import flip_byte, sparse_file

from fleet_agent.weights.fetch import (
    ChecksumMismatch,
    FetchError,
    FetchStopped,
    SizeMismatch,
    SourceRefused,
    SourceUnreachable,
    UnknownScheme,
    display_uri,
    fetch,
)
from fleet_agent.weights.s3 import S3Settings, object_request, sign_v4, split_s3_uri
from fleet_core.wire import ArtifactRef

SIZE = 5 * (1 << 20) + 123  # not a multiple of any chunk


@pytest.fixture
def source(tmp_path: Path) -> tuple[ArtifactRef, Path]:
    made = sparse_file(tmp_path / "src" / "model.safetensors", SIZE, seed=3)
    ref = ArtifactRef(
        name="model.safetensors",
        uri=made.path.as_uri(),
        sha256=made.sha256,
        size_bytes=made.size,
    )
    return ref, made.path


def test_file_fetch_verifies_and_reports_progress(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, path = source
    dest = tmp_path / "partial"
    seen: list[int] = []
    result = fetch(ref, dest, chunk=1 << 20, progress=seen.append)
    assert dest.read_bytes() == path.read_bytes()
    assert (result.bytes, result.resumed_from, result.transferred) == (SIZE, 0, SIZE)
    assert result.sha256 == ref.sha256
    assert seen[0] == 0 and seen[-1] == SIZE and seen == sorted(seen) and len(seen) >= 6


def test_resume_hashes_the_kept_prefix(source: tuple[ArtifactRef, Path], tmp_path: Path) -> None:
    ref, path = source
    dest = tmp_path / "partial"
    dest.write_bytes(path.read_bytes()[:3_000_001])
    result = fetch(ref, dest, chunk=1 << 20)
    assert (result.resumed_from, result.transferred) == (3_000_001, SIZE - 3_000_001)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == ref.sha256


def test_a_bad_kept_prefix_is_caught(source: tuple[ArtifactRef, Path], tmp_path: Path) -> None:
    """The digest covers the bytes that were already there: a corrupt partial cannot pass."""
    ref, path = source
    dest = tmp_path / "partial"
    dest.write_bytes(path.read_bytes()[:1000])
    flip_byte(dest, 10)
    with pytest.raises(ChecksumMismatch) as caught:
        fetch(ref, dest)
    assert caught.value.expected == ref.sha256
    assert dest.stat().st_size == SIZE  # left for the caller to delete


def test_a_complete_partial_needs_no_transfer(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, path = source
    dest = tmp_path / "partial"
    dest.write_bytes(path.read_bytes())
    result = fetch(ref, dest)
    assert (result.resumed_from, result.transferred) == (SIZE, 0)


def test_a_partial_longer_than_the_file_starts_over(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, path = source
    dest = tmp_path / "partial"
    dest.write_bytes(path.read_bytes() + b"junk")
    result = fetch(ref, dest)
    assert (result.resumed_from, result.transferred) == (0, SIZE)
    assert dest.stat().st_size == SIZE


def test_a_flipped_byte_at_the_source_is_a_checksum_mismatch(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, path = source
    flip_byte(path, SIZE - 1)
    with pytest.raises(ChecksumMismatch, match=r"^model\.safetensors from file://.*sha256"):
        fetch(ref, tmp_path / "partial")


def test_size_mismatch_is_named_before_reading(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, _ = source
    dest = tmp_path / "partial"
    with pytest.raises(SizeMismatch) as caught:
        fetch(ref.model_copy(update={"size_bytes": SIZE + 1}), dest)
    assert (caught.value.expected, caught.value.actual) == (SIZE + 1, SIZE)
    assert dest.stat().st_size == 0


def test_missing_file_unknown_scheme_and_no_digest(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, _ = source
    dest = tmp_path / "partial"
    with pytest.raises(SourceRefused, match="no such file"):
        fetch(ref.model_copy(update={"uri": "file:///nonexistent/x"}), dest)
    with pytest.raises(UnknownScheme, match=r"unknown scheme 'ftp' \(accepted: file, http"):
        fetch(ref.model_copy(update={"uri": "ftp://host/x"}), dest)
    with pytest.raises(UnknownScheme, match="'\\(none\\)'"):
        fetch(ref.model_copy(update={"uri": "/plain/path"}), dest)
    with pytest.raises(FetchError, match="no sha256"):
        fetch(ref.model_copy(update={"sha256": None}), dest)
    with pytest.raises(SourceRefused, match="no S3 endpoint configured"):
        fetch(ref.model_copy(update={"uri": "s3://bucket/key"}), dest)


def test_should_stop_keeps_the_partial_for_a_resume(
    source: tuple[ArtifactRef, Path], tmp_path: Path
) -> None:
    ref, path = source
    dest = tmp_path / "partial"
    calls = {"n": 0}

    def stop_after_two_chunks() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    with pytest.raises(FetchStopped):
        fetch(ref, dest, chunk=1 << 20, should_stop=stop_after_two_chunks)
    kept = dest.stat().st_size
    assert 0 < kept < SIZE and dest.read_bytes() == path.read_bytes()[:kept]
    result = fetch(ref, dest, chunk=1 << 20)
    assert result.resumed_from == kept and result.bytes == SIZE


def test_unreachable_is_retried_then_named_without_credentials(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ref = ArtifactRef(
        name="w.bin",
        uri=f"http://user:hunter2@127.0.0.1:{port}/m/w.bin?X-Amz-Signature=abc#frag",
        sha256="0" * 64,
        size_bytes=10,
    )
    with pytest.raises(SourceUnreachable) as caught:
        fetch(ref, tmp_path / "p", retries=2, backoff_s=0.01, timeout=2)
    text = str(caught.value)
    assert text.startswith(f"w.bin from http://127.0.0.1:{port}/m/w.bin: connection refused")
    assert "gave up after 3 tries" in text
    assert "hunter2" not in text and "Signature" not in text and "\n" not in text


def test_display_uri() -> None:
    assert display_uri("https://u:p@h.example:8443/a/b?sig=1#x") == "https://h.example:8443/a/b"
    assert display_uri("s3://bucket/some/key") == "s3://bucket/some/key"
    assert display_uri("file:///models/x") == "file:///models/x"
    assert display_uri("http://[bad") == "http:…"
    # A bad port still shows where it points; the credential before it never.
    assert display_uri("http://u:hunter2@h:99999/w?sig=1") == "http://h:99999/w"


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("http://u:hunter2@127.0.0.1:99999/w.bin", "port is not a port number"),
        ("http://127.0.0.1:http/w.bin", "port is not a port number"),
        ("http://127.0.0.1:0/w.bin", "port is not a port number"),
        ("https://ho st/w.bin", "unusable URL (InvalidURL)"),
        ("http://[::1/w.bin", "not a usable URI"),
    ],
)
def test_a_malformed_url_is_a_refused_source_at_once(tmp_path: Path, uri: str, reason: str) -> None:
    """Not a ValueError past the fetcher (the cache left the version 'fetching' for ever), and
    not a retry: no try can make such a URL usable."""
    ref = ArtifactRef(name="w.bin", uri=uri, sha256="0" * 64, size_bytes=10)
    with pytest.raises(SourceRefused) as caught:
        fetch(ref, tmp_path / "p", retries=3, backoff_s=5.0, timeout=2)  # a retry would show
    text = str(caught.value)
    assert text.startswith("w.bin from ") and reason in text, text
    assert "hunter2" not in text and "\n" not in text


class _Redirector(http.server.BaseHTTPRequestHandler):
    """Answers every GET with a 302 to the Location the test sets on the server."""

    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.server.location)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("location", "reason"),
    [
        ("http://127.0.0.1:99999/elsewhere", "port is not a port number"),
        ("http://[::1/elsewhere", "cannot be parsed"),
        ("ftp://127.0.0.1/elsewhere", "does not follow"),
    ],
)
def test_a_redirect_to_a_malformed_url_is_refused(
    tmp_path: Path, location: str, reason: str
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirector)
    server.location = location  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        port = server.server_address[1]
        ref = ArtifactRef(
            name="w.bin", uri=f"http://127.0.0.1:{port}/w.bin", sha256="0" * 64, size_bytes=10
        )
        with pytest.raises(SourceRefused) as caught:
            fetch(ref, tmp_path / "p", retries=1, backoff_s=0.01, timeout=2)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    text = str(caught.value)
    assert text.startswith(f"w.bin from http://127.0.0.1:{port}/w.bin: ") and reason in text, text
    assert caught.value.status in (0, 302)


def test_sigv4_matches_awss_published_get_object_example() -> None:
    """docs.aws.amazon.com, "Signature Calculations for the Authorization Header", GET Object."""
    headers = sign_v4(
        method="GET",
        host="examplebucket.s3.amazonaws.com",
        path="/test.txt",
        query="",
        headers={"Range": "bytes=0-9"},
        payload_sha256="e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        access_key_id="AKIAIOSFODNN7EXAMPLE",
        secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        region="us-east-1",
        service="s3",
        now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC),
    )
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )


def test_object_request_addressing_and_encoding() -> None:
    settings = S3Settings(
        endpoint_url="http://127.0.0.1:9000",
        access_key_id="AKID",
        secret_access_key=SecretStr("s3cr3t-value"),
    )
    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    path_style = object_request(settings, "s3://weights/llama 3/model+1.bin", now=now)
    assert path_style.url == "http://127.0.0.1:9000/weights/llama%203/model%2B1.bin"
    assert path_style.headers["x-amz-date"] == "20260102T030405Z"
    assert (
        "Credential=AKID/20260102/us-east-1/s3/aws4_request"
        in (path_style.headers["Authorization"])
    )
    virtual = object_request(
        settings.model_copy(update={"path_style": False}), "s3://weights/a/b", now=now
    )
    assert virtual.url == "http://weights.127.0.0.1:9000/a/b"
    anonymous = object_request(S3Settings(endpoint_url="http://h:1"), "s3://b/k")
    assert "Authorization" not in anonymous.headers
    assert "s3cr3t-value" not in repr(settings) + str(settings)
    with pytest.raises(ValueError):
        split_s3_uri("s3://bucket-only")


def test_s3_settings_from_env_falls_back_to_aws_names() -> None:
    assert S3Settings.from_env({}) is None
    settings = S3Settings.from_env(
        {
            "AWS_ENDPOINT_URL": "http://aws-fallback:1",
            "FLEET_AGENT_S3_ENDPOINT_URL": "http://minio:9000",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_ACCESS_KEY_ID": "AKID",
            "FLEET_AGENT_S3_SECRET_ACCESS_KEY": "sekret",
            "FLEET_AGENT_S3_PATH_STYLE": "false",
        }
    )
    assert settings is not None
    assert settings.endpoint_url == "http://minio:9000"
    assert (settings.region, settings.access_key_id, settings.path_style) == (
        "eu-west-1",
        "AKID",
        False,
    )
    assert settings.secret_access_key is not None
    assert settings.secret_access_key.get_secret_value() == "sekret"
