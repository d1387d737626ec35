"""A real OpenSSH server (Debian's /usr/sbin/sshd) on 127.0.0.1 for the SSH tests (not a test
module): its own config file, a generated Ed25519 host key, one authorized client key, a free
port; `-D -e` keeps it in the foreground with its log on stderr (kept in `log`). Root login by
key only, no PAM. Tests start it with `sshd_peer(directory)` in a fixture; leaving the context
stops it (and waits for it).
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
SSH_KEYGEN = Path("/usr/bin/ssh-keygen")
# sshd refuses to start without its privilege-separation directory (compiled in).
PRIVSEP_DIR = Path("/run/sshd")
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SshdPeer:
    """A running sshd: where it listens, its host key's fingerprint (as OpenSSH prints it), the
    client key it accepts, and its log file."""

    address: str
    port: int
    host_key_file: Path
    host_fingerprint: str
    client_key_file: Path
    authorized_keys: Path
    log: Path
    pid: int

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def keygen(path: Path, kind: str = "ed25519", passphrase: str = "") -> Path:
    """A new key pair at `path` (and `path`.pub) made by ssh-keygen; returns `path`."""
    path.unlink(missing_ok=True)
    path.with_suffix(path.suffix + ".pub").unlink(missing_ok=True)
    subprocess.run(
        [str(SSH_KEYGEN), "-q", "-t", kind, "-N", passphrase, "-C", "fleet-tests", "-f", str(path)],
        check=True,
        timeout=30,
    )
    return path


def public_line(key: Path) -> str:
    return key.with_suffix(key.suffix + ".pub").read_text().strip()


def fingerprint_of(key: Path) -> str:
    """`SHA256:…` of a key's public half, computed as OpenSSH does (no padding)."""
    blob = base64.b64decode(public_line(key).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.settimeout(2.0)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


@contextmanager
def sshd_peer(directory: Path, *, client_key: Path | None = None) -> Iterator[SshdPeer]:
    """Run sshd with its files under `directory` until the context ends. `client_key`: the
    private key whose public half is authorized (a new Ed25519 one by default)."""
    if os.geteuid() != 0:
        raise RuntimeError("the sshd peer runs as root (sshd drops to the login user itself)")
    directory.mkdir(parents=True, exist_ok=True)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    host_key = keygen(directory / "ssh_host_ed25519_key")
    client = client_key or keygen(directory / "id_ed25519")
    authorized = directory / "authorized_keys"
    authorized.write_text(public_line(client) + "\n")
    authorized.chmod(0o600)
    port = free_port()
    config = directory / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress 127.0.0.1:{port}",
                f"HostKey {host_key}",
                f"PidFile {directory / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                # The temp directory is not root-owned all the way up on every CI runner.
                "StrictModes no",
                "LogLevel VERBOSE",
                "MaxStartups 100",
                "Subsystem sftp internal-sftp",
                "",
            ]
        )
    )
    log = directory / "sshd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(port):
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited ({proc.returncode}): {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd not listening on {port}: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield SshdPeer(
            address="127.0.0.1",
            port=port,
            host_key_file=host_key,
            host_fingerprint=fingerprint_of(host_key),
            client_key_file=client,
            authorized_keys=authorized,
            log=log,
            pid=proc.pid,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
