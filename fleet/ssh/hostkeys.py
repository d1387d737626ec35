"""SSH host keys: the fingerprint OpenSSH prints, reading a server's key without logging in,
and the errors of an unknown or changed key. A key is trusted only if it equals the pin
(from the inventory, or recorded by `fleetctl servers ssh-trust`); nothing is learnt on the fly.
"""

from __future__ import annotations

import base64
import hashlib
import socket

import paramiko

from fleet.errors import FleetError


class SshError(FleetError):
    """One line naming the server: the SSH step that failed and why (never key material)."""

    # The fleet could not get an answer it needs from the server's OS (a gateway error).
    status_code = 502


class HostKeyUnknown(SshError):
    """No key is pinned for the server: refused until an operator pins one."""

    status_code = 409

    def __init__(self, server: str, offered: str) -> None:
        self.server, self.offered = server, offered
        super().__init__(
            f"server {server}: no pinned SSH host key (it offers {offered}): pin it in the "
            f"inventory or run `fleetctl servers ssh-trust {server}`"
        )


class HostKeyMismatch(SshError):
    """The server offers another key than the pinned one: refused (a reinstalled host, or
    someone in the middle); an admin pins the new one after checking."""

    status_code = 409

    def __init__(self, server: str, pinned: str, offered: str) -> None:
        self.server, self.pinned, self.offered = server, pinned, offered
        super().__init__(
            f"server {server}: SSH host key mismatch: pinned {pinned}, offered {offered}"
        )


def fingerprint(key: paramiko.PKey) -> str:
    """`SHA256:<base64, unpadded>` of the public key, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def known_hosts_line(address: str, port: int, key: paramiko.PKey) -> str:
    """An OpenSSH known_hosts line for `key` at address:port (`[addr]:port` unless 22)."""
    host = address if port == 22 else f"[{address}]:{port}"
    return f"{host} {key.get_name()} {key.get_base64()}"


def check(server: str, pinned: str | None, key: paramiko.PKey) -> str:
    """The offered key's fingerprint if it equals the pin; HostKeyUnknown / HostKeyMismatch."""
    offered = fingerprint(key)
    if pinned is None:
        raise HostKeyUnknown(server, offered)
    if offered != pinned:
        raise HostKeyMismatch(server, pinned, offered)
    return offered


def where(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def connect_socket(server: str, address: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to the server's sshd, or SshError naming the server and why."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout_s)
    except TimeoutError:
        raise SshError(
            f"server {server}: cannot reach SSH at {where(address, port)}: no answer within "
            f"{timeout_s:g} s"
        ) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise SshError(
            f"server {server}: cannot reach SSH at {where(address, port)}: {reason.lower()}"
        ) from None
    sock.settimeout(timeout_s)
    return sock


def start_transport(server: str, address: str, port: int, timeout_s: float) -> paramiko.Transport:
    """A transport through key exchange (the host key read, not yet checked; no login)."""
    sock = connect_socket(server, address, port, timeout_s)
    transport = paramiko.Transport(sock)
    transport.banner_timeout = timeout_s
    transport.handshake_timeout = timeout_s
    transport.auth_timeout = timeout_s
    problem = ""
    try:
        transport.start_client(timeout=timeout_s)
    except (paramiko.SSHException, OSError, EOFError) as exc:
        problem = one_line(exc)
    else:
        # start_client returns quietly when its timeout passes mid-handshake.
        if transport.host_key is None or not transport.is_active():
            problem = f"no answer within {timeout_s:g} s"
    if problem or transport.host_key is None:
        transport.close()
        raise SshError(
            f"server {server}: SSH handshake with {where(address, port)} failed: "
            f"{problem or 'no answer within ' + format(timeout_s, 'g') + ' s'}"
        )
    return transport


def scan(address: str, port: int, timeout_s: float, *, server: str | None = None) -> paramiko.PKey:
    """The host key the sshd at address:port offers (no login is attempted)."""
    transport = start_transport(server or where(address, port), address, port, timeout_s)
    try:
        return transport.get_remote_server_key()
    finally:
        transport.close()


def one_line(exc: BaseException | str) -> str:
    """An error's text on one line, bounded (for the one-line SshErrors)."""
    return " ".join(str(exc).split())[:300]
