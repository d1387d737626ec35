"""Real sources of model weights on 127.0.0.1 for the fetcher's tests, its benchmark and the
weights acceptance test (not a test module).

- `sparse_file(path, size)`: a model file of any size (multi-GB is fine) that costs almost no
  disk: a sparse file, zeros but for a few seeded random 64 KiB blocks (at the start, the end
  and evenly between), so a flipped byte or a shifted range changes its sha256. The digest is
  computed from the layout (zeros hashed from memory, not read back), ~1 s per GB.
- `nginx_peer(root, workdir, tls=False)`: Debian's nginx serving `root` (static files, Range
  requests, sendfile) on a free port; `peer.url(name)`. With `tls`, https with a new
  self-signed certificate for 127.0.0.1 (`peer.ca_file`: trust it, e.g. SSL_CERT_FILE).
- `moto_peer(workdir)`: moto's S3 API server (`python -m moto.server`, a subprocess) on a free
  port with SIGNATURE CHECKING ON: an IAM user and its access key are created first (moto
  enforces SigV4 after INITIAL_NO_AUTH_ACTION_COUNT requests), so a wrong key or a bad
  signature is refused as AWS would. `peer.create_bucket(b)`, `peer.upload(b, key, path)`
  (boto3: tests only, never the agent), `peer.s3_settings()`, `peer.agent_env()`.
  MOTO HOLDS EVERY OBJECT IN ITS PROCESS'S MEMORY, and a (multipart) upload reads the whole
  file: measured here, a 512 MiB object left moto at 0.6 GB resident, 1.6 GB at its peak
  during the upload, which took 20 s on a loaded 2-core machine (256 MiB: ~3-10 s). Keep S3
  files modest (256 MiB, 1 GiB at the very most); multi-GB files belong on nginx.
- `cutting_http_peer(root, cut_after=..., cuts=...)`: a tiny stdlib HTTP server (a thread)
  that drops the connection after `cut_after` body bytes for its first `cuts` answers and
  honours Range (or, with `honour_range=False`, answers 200 with the whole file like a
  server that ignores it). `peer.requests` lists what was asked.
- `flip_byte(path, offset)`: corrupt one byte in place (the served file then mismatches);
  `copy_prefix(source, dest, n)`: the first n bytes, holes kept (a partial download, made in
  no time even at several GB).

Every start waits a bounded time for the port; leaving a context stops what it started
(terminate, then kill) and waits for it.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from pydantic import SecretStr

from fleet_agent.weights.s3 import S3Settings

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
BLOCK = 64 << 10  # each random block of a sparse file
MARKS = 8  # random blocks between the first and the last
_ZEROS = bytes(8 << 20)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _listening(port):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not listening on {port}: {_tail(log)}")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


# ---- files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFile:
    """A generated model file: where it is, its size and sha256 (hex)."""

    path: Path
    size: int
    sha256: str

    @property
    def name(self) -> str:
        return self.path.name


def _blocks(size: int, seed: int) -> list[tuple[int, bytes]]:
    """(offset, bytes) of a sparse file's random blocks, in offset order, not overlapping."""
    rng = random.Random(f"weights-{seed}-{size}")
    if size <= 2 * BLOCK:
        return [(0, rng.randbytes(size))]
    offsets = {0, size - BLOCK}
    step = size // (MARKS + 1)
    offsets.update(min(i * step, size - 2 * BLOCK) for i in range(1, MARKS + 1))
    ordered, last_end = [], -1
    for offset in sorted(offsets):
        if offset >= last_end:
            ordered.append((offset, rng.randbytes(min(BLOCK, size - offset))))
            last_end = offset + BLOCK
    return ordered


def _marks(size: int, every: int, seed: int, taken: list[tuple[int, bytes]]) -> list[int]:
    """Offsets of 8-byte marks every `every` bytes that miss the random blocks."""
    spans = [(o, o + len(d)) for o, d in taken]
    return [
        o for o in range(0, size - 8, every) if not any(start - 8 < o < end for start, end in spans)
    ]


def sparse_file(
    path: Path, size: int, *, seed: int = 0, mark_every: int | None = None
) -> WeightFile:
    """Write (or rewrite) `path` as a sparse file of `size` bytes; its sha256 from the layout.
    `mark_every`: also 8 random bytes every that many bytes, so that no block of that size
    is all zeros (the fetcher writes such blocks as holes; curl does not): a file that costs
    one page of disk per mark and that every downloader must write out in full."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blocks = _blocks(size, seed)
    if mark_every is not None:
        rng = random.Random(f"marks-{seed}-{size}")
        marks = [(o, rng.randbytes(8)) for o in _marks(size, mark_every, seed, blocks)]
        blocks = sorted(blocks + marks)
    with path.open("wb") as f:
        f.truncate(size)
        for offset, data in blocks:
            f.seek(offset)
            f.write(data)
    sha = hashlib.sha256()
    at = 0
    for offset, data in blocks:
        _hash_zeros(sha, offset - at)
        sha.update(data)
        at = offset + len(data)
    _hash_zeros(sha, size - at)
    return WeightFile(path=path, size=size, sha256=sha.hexdigest())


def _hash_zeros(sha: Any, count: int) -> None:
    view = memoryview(_ZEROS)
    while count > 0:
        n = min(count, len(_ZEROS))
        sha.update(view[:n])
        count -= n


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a file as it is on disk (reads it all)."""
    sha = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            sha.update(view[:n])
    return sha.hexdigest()


def copy_prefix(source: Path, dest: Path, count: int) -> None:
    """Write the first `count` bytes of `source` to `dest` keeping its holes (SEEK_DATA /
    SEEK_HOLE): a partial download of a multi-GB sparse file, made in no time."""
    with source.open("rb") as src, dest.open("wb") as out:
        out.truncate(count)
        fd = src.fileno()
        at = 0
        while at < count:
            try:
                data_at = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole from here on
                break
            if data_at >= count:
                break
            hole_at = min(os.lseek(fd, data_at, os.SEEK_HOLE), count)
            src.seek(data_at)
            out.seek(data_at)
            left = hole_at - data_at
            while left > 0:
                data = src.read(min(left, 8 << 20))
                if not data:
                    break
                out.write(data)
                left -= len(data)
            at = hole_at


def flip_byte(path: Path, offset: int = 0) -> None:
    """Invert one byte of `path` in place."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# ---- nginx ----------------------------------------------------------------------------------

NGINX_CONF = """\
{user}worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen {host}:{port}{ssl};
        {tls}root {root};
        location / {{ }}
    }}
}}
"""


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A new self-signed certificate for 127.0.0.1 (EC P-256, one day): (cert, key) files."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weights-peer")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


@dataclass(frozen=True)
class NginxPeer:
    """nginx serving `root` at `base_url`."""

    base_url: str
    port: int
    root: Path
    pid: int
    log: Path
    ca_file: Path | None = None  # with tls: the self-signed certificate to trust

    def url(self, name: str) -> str:
        """The http(s):// URL of `root/name`."""
        return f"{self.base_url}/{quote(name)}"


@contextmanager
def nginx_peer(root: Path, workdir: Path, *, tls: bool = False) -> Iterator[NginxPeer]:
    """nginx (one worker, its pid, logs and temp dirs under `workdir`) serving `root`."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
    tmp = workdir / "nginx"
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = tmp / "nginx.conf"
    # As root, workers would drop to nobody and could not read a test's private temp dir.
    user = "user root;\n" if os.geteuid() == 0 else ""
    cert = self_signed(tmp) if tls else None
    conf.write_text(
        NGINX_CONF.format(
            user=user,
            tmp=tmp,
            host=HOST,
            port=port,
            root=root.resolve(),
            ssl=" ssl" if cert else "",
            tls=f"ssl_certificate {cert[0]};\n        ssl_certificate_key {cert[1]};\n        "
            if cert
            else "",
        )
    )
    log = tmp / "nginx.log"
    with log.open("ab") as out:
        # -e: the early error log too (the compiled-in /var/log/nginx may not be writable).
        proc = subprocess.Popen(
            [binary, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_listening(port, proc, "nginx", tmp / "error.log")
        yield NginxPeer(
            base_url=f"{'https' if cert else 'http'}://{HOST}:{port}",
            port=port,
            root=root,
            pid=proc.pid,
            log=log,
            ca_file=cert[0] if cert else None,
        )
    finally:
        stop_process(proc)


# ---- moto (S3) ------------------------------------------------------------------------------

_ALLOW_ALL = (
    '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'
)
# The requests moto answers before it checks signatures: create_user, put_user_policy,
# create_access_key (below, in that order).
_SETUP_REQUESTS = 3


@dataclass
class MotoPeer:
    """moto's S3 at `endpoint_url`, with one IAM user's key pair that it checks."""

    endpoint_url: str
    port: int
    region: str
    access_key_id: str
    secret_access_key: str
    pid: int
    log: Path
    _client: Any = field(default=None, repr=False)

    def client(self) -> Any:
        """A boto3 S3 client signed with the peer's key (tests only)."""
        if self._client is None:
            import boto3  # type: ignore[import-untyped]

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                aws_access_key_id=self.access_key_id,
                aws_secret_access_key=self.secret_access_key,
            )
        return self._client

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload(self, bucket: str, key: str, path: Path) -> str:
        """Upload `path` as s3://bucket/key (multipart past 8 MiB); returns that URI."""
        self.client().upload_file(str(path), bucket, key)
        return f"s3://{bucket}/{key}"

    def s3_settings(self, *, secret: str | None = None) -> S3Settings:
        """The fetcher's settings for this peer (`secret`: another secret, to be refused)."""
        return S3Settings(
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=SecretStr(secret or self.secret_access_key),
        )

    def agent_env(self) -> dict[str, str]:
        """The agent's FLEET_AGENT_S3_* environment for this peer."""
        return {
            "FLEET_AGENT_S3_ENDPOINT_URL": self.endpoint_url,
            "FLEET_AGENT_S3_REGION": self.region,
            "FLEET_AGENT_S3_ACCESS_KEY_ID": self.access_key_id,
            "FLEET_AGENT_S3_SECRET_ACCESS_KEY": self.secret_access_key,
        }


@contextmanager
def moto_peer(workdir: Path, *, region: str = "us-east-1") -> Iterator[MotoPeer]:
    """moto's server (a subprocess, logs under `workdir`) with signature checking on."""
    import boto3

    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "moto.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_SETUP_REQUESTS)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    try:
        wait_listening(port, proc, "moto", log)
        endpoint = f"http://{HOST}:{port}"
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="fleet-agent")
        iam.put_user_policy(UserName="fleet-agent", PolicyName="all", PolicyDocument=_ALLOW_ALL)
        key = iam.create_access_key(UserName="fleet-agent")["AccessKey"]
        yield MotoPeer(
            endpoint_url=endpoint,
            port=port,
            region=region,
            access_key_id=key["AccessKeyId"],
            secret_access_key=key["SecretAccessKey"],
            pid=proc.pid,
            log=log,
        )
    finally:
        stop_process(proc)


# ---- a server that cuts ---------------------------------------------------------------------

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class CuttingPeer:
    """The cutting server at `base_url`; `requests`: (path, Range header or None, status,
    body bytes sent) per answer, in order."""

    base_url: str
    port: int
    requests: list[tuple[str, str | None, int, int]] = field(default_factory=list)

    def url(self, name: str) -> str:
        return f"{self.base_url}/{quote(name)}"


@contextmanager
def cutting_http_peer(
    root: Path, *, cut_after: int, cuts: int = 1, honour_range: bool = True
) -> Iterator[CuttingPeer]:
    """Serve `root`; the first `cuts` answers are cut (RST) after `cut_after` body bytes."""
    lock = threading.Lock()
    state = {"cut": 0}
    port = free_port()
    peer = CuttingPeer(base_url=f"http://{HOST}:{port}", port=port)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def do_GET(self) -> None:
            path = root / unquote(self.path.split("?", 1)[0].lstrip("/"))
            asked = self.headers.get("Range")
            if not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with lock:
                    peer.requests.append((self.path, asked, 404, 0))
                return
            size = path.stat().st_size
            start, end = 0, size
            match = _RANGE.match(asked or "") if honour_range else None
            status = 200
            if match:
                start = int(match.group(1))
                end = min(int(match.group(2)) + 1, size) if match.group(2) else size
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    with lock:
                        peer.requests.append((self.path, asked, 416, 0))
                    return
                status = 206
            with lock:
                cut = state["cut"] < cuts
                state["cut"] += cut
            self.send_response(status)
            self.send_header("Content-Length", str(end - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Accept-Ranges", "bytes" if honour_range else "none")
            self.end_headers()
            sent = 0
            limit = min(end - start, cut_after) if cut else end - start
            with path.open("rb") as f, suppress(OSError):
                f.seek(start)
                while sent < limit:
                    data = f.read(min(1 << 20, limit - sent))
                    if not data:
                        break
                    self.wfile.write(data)
                    sent += len(data)
                self.wfile.flush()
            with lock:
                peer.requests.append((self.path, asked, status, sent))
            if cut:
                # An abrupt reset, as a dropped link looks: SO_LINGER 0 then close.
                with suppress(OSError):
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                self.close_connection = True

    server = ThreadingHTTPServer((HOST, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield peer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=STOP_TIMEOUT_S)
