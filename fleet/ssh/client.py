"""Commands on a server's OS over SSH (paramiko), as `settings.ssh_user` with the fleet's key.

The server's host key is checked against its pin right after the key exchange, before any
login is attempted: an unverified host never sees even the public half of our key. Every step
is bounded (connect, handshake, login: `ssh_connect_timeout_s`; a command: its timeout), and
every failure is one line naming the server. Nothing about the private key (its contents,
passphrase) is logged or put in a message; its path may be.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import paramiko

from fleet.models import ServerBase
from fleet.settings import Settings
from fleet.ssh.hostkeys import SshError, check, one_line, start_transport, where

__all__ = [
    "CommandResult",
    "SshError",
    "SshTarget",
    "connect",
    "load_key",
    "request_reboot",
    "run",
    "run_on",
    "target_for",
]

# How long one wait for output may last before the loop looks at the clock again.
_POLL_S = 0.05
_CHUNK = 64 * 1024
# The watchdog closes a connection this long after a command's own bound has passed.
_WATCHDOG_GRACE_S = 5.0
# Keepalives on an open connection: a host that vanishes shows as a dead transport.
_KEEPALIVE_S = 15


@dataclass(frozen=True, slots=True)
class SshTarget:
    """Where a server's OS answers SSH, and the host key pinned for it (None: none yet)."""

    server: str
    address: str
    port: int = 22
    host_key: str | None = None


def target_for(server: ServerBase) -> SshTarget:
    """The SSH target of a server (a Server row or its public view); SshError if it has no
    SSH address."""
    if not server.ssh_address:
        raise SshError(
            f"server {server.name}: no SSH address: set ssh.address in the inventory or "
            f"`PATCH /servers/{server.name}` ssh_address"
        )
    return SshTarget(server.name, server.ssh_address, server.ssh_port, server.ssh_host_key)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What one command did: its exit status (None: it did not finish: timed out, cut, or
    the connection dropped), its output (at most max_bytes of stdout and stderr together),
    whether that output was cut, and whether it ran past its timeout."""

    exit_status: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    seconds: float


def load_key(settings: Settings) -> paramiko.PKey:
    """The fleet's private key (settings.ssh_key_file, with its passphrase if any), or an
    SshError of one line that says what to fix. Never says anything of the key itself."""
    path = settings.ssh_key_file
    if path is None:
        raise SshError("no SSH key: set FLEET_SSH_KEY_FILE to the fleet's private key file")
    passphrase = settings.ssh_key_passphrase
    secret = passphrase.get_secret_value() if passphrase is not None else None
    name = f"FLEET_SSH_KEY_FILE {path}"
    try:
        # bytes, whatever its annotation says (cryptography checks).
        return paramiko.PKey.from_path(path, password=secret.encode() if secret else None)
    except FileNotFoundError:
        raise SshError(f"{name}: no such file") from None
    except PermissionError:
        raise SshError(f"{name}: not readable by the service (permission denied)") from None
    except IsADirectoryError:
        raise SshError(f"{name}: a directory, not a key file") from None
    except (paramiko.PasswordRequiredException, TypeError):
        # cryptography says TypeError for an encrypted OpenSSH key loaded without a password.
        if secret:
            raise SshError(f"{name}: cannot read the private key") from None
        raise SshError(f"{name}: the key is encrypted: set FLEET_SSH_KEY_PASSPHRASE") from None
    except (paramiko.SSHException, ValueError, UnicodeDecodeError):
        # No detail: a parser's message may quote part of the file.
        what = "a wrong FLEET_SSH_KEY_PASSPHRASE, or " if secret else ""
        raise SshError(
            f"{name}: cannot read the private key ({what}not an OpenSSH/PEM private key)"
        ) from None
    except OSError as exc:
        raise SshError(f"{name}: {(exc.strerror or type(exc).__name__).lower()}") from None


def connect(
    target: SshTarget, settings: Settings, key: paramiko.PKey | None = None
) -> paramiko.Transport:
    """A transport logged in to the target, its host key checked against the pin first.
    `key`: the fleet's key when the caller loaded it already (load_key)."""
    key = key or load_key(settings)
    timeout_s = settings.ssh_connect_timeout_s
    transport = start_transport(target.server, target.address, target.port, timeout_s)
    transport.set_keepalive(_KEEPALIVE_S)
    try:
        check(target.server, target.host_key, transport.get_remote_server_key())
        transport.auth_publickey(settings.ssh_user, key)
    except paramiko.AuthenticationException:
        transport.close()
        raise SshError(
            f"server {target.server}: SSH login as {settings.ssh_user} at "
            f"{where(target.address, target.port)} refused: the fleet's key "
            "(FLEET_SSH_KEY_FILE) is not authorized there"
        ) from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        transport.close()
        raise SshError(
            f"server {target.server}: SSH login at {where(target.address, target.port)} "
            f"failed: {one_line(exc) or 'no answer within ' + format(timeout_s, 'g') + ' s'}"
        ) from None
    except BaseException:
        transport.close()
        raise
    return transport


def run_on(
    transport: paramiko.Transport,
    target: SshTarget,
    command: str,
    timeout_s: float,
    max_bytes: int,
) -> CommandResult:
    """Run `command` on a logged-in transport: at most `timeout_s` seconds and `max_bytes` of
    output (stdout and stderr together). Past either, the channel is closed (sshd then closes
    the command's pipes) and the result says so."""
    start = time.monotonic()
    deadline = start + timeout_s
    with _watchdog(transport, timeout_s) as fired:
        try:
            return _run_channel(transport, target, command, timeout_s, max_bytes, start, deadline)
        except SshError:
            if fired.is_set():
                raise SshError(
                    f"server {target.server}: no answer over SSH within {timeout_s:g} s"
                ) from None
            raise


def _run_channel(
    transport: paramiko.Transport,
    target: SshTarget,
    command: str,
    timeout_s: float,
    max_bytes: int,
    start: float,
    deadline: float,
) -> CommandResult:
    try:
        channel = transport.open_session(timeout=max(0.1, timeout_s))
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise SshError(
            f"server {target.server}: cannot open an SSH session: {one_line(exc)}"
        ) from None
    out, err = bytearray(), bytearray()
    truncated = timed_out = False
    try:
        channel.exec_command(command)
        fd = channel.fileno()  # readable when stdout or stderr data arrives
        while True:
            for ready, recv, buf in (
                (channel.recv_ready, channel.recv, out),
                (channel.recv_stderr_ready, channel.recv_stderr, err),
            ):
                while ready() and not truncated:
                    buf += recv(_CHUNK)
                    if len(out) + len(err) > max_bytes:
                        truncated = True
            if truncated:
                break
            if channel.exit_status_ready() and not (
                channel.recv_ready() or channel.recv_stderr_ready()
            ):
                break
            if channel.closed or not transport.is_active():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if channel.eof_received:
                # The pipe stays readable after EOF: wait on the exit status instead.
                channel.status_event.wait(min(_POLL_S, left))
            else:
                select.select([fd], [], [], min(_POLL_S, left))
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise SshError(f"server {target.server}: SSH command failed: {one_line(exc)}") from None
    finally:
        status = channel.exit_status if channel.exit_status_ready() else None
        channel.close()
    if truncated:
        # Keep what fits: stdout first (the command's answer), then stderr.
        keep_out = min(len(out), max_bytes)
        del out[keep_out:]
        del err[max_bytes - keep_out :]
    return CommandResult(
        exit_status=None if truncated or timed_out or status in (None, -1) else status,
        stdout=bytes(out),
        stderr=bytes(err),
        truncated=truncated,
        timed_out=timed_out,
        seconds=round(time.monotonic() - start, 3),
    )


def run(
    target: SshTarget,
    settings: Settings,
    command: str,
    *,
    timeout_s: float | None = None,
    max_bytes: int | None = None,
) -> CommandResult:
    """Connect, run one command (settings.ssh_command_timeout_s and
    settings.diagnose_max_output_bytes unless given), disconnect."""
    transport = connect(target, settings)
    try:
        return run_on(
            transport,
            target,
            command,
            settings.ssh_command_timeout_s if timeout_s is None else timeout_s,
            settings.diagnose_max_output_bytes if max_bytes is None else max_bytes,
        )
    finally:
        transport.close()


REBOOT_COMMAND = "systemctl reboot"


def request_reboot(target: SshTarget, settings: Settings, command: str = REBOOT_COMMAND) -> None:
    """Ask the server's OS to reboot (`systemctl reboot`). Done when the command exits 0, or
    when the connection drops after it was sent (the host went down under us); SshError when
    the host cannot be reached or logged in to, the command fails, or nothing happens within
    settings.ssh_command_timeout_s. `command`: for tests (never reboot the test machine)."""
    transport = connect(target, settings)
    timeout_s = settings.ssh_command_timeout_s
    with _watchdog(transport, timeout_s) as fired:
        try:
            _reboot_on(transport, target, command, timeout_s)
        except SshError:
            if fired.is_set():
                raise SshError(
                    f"server {target.server}: `{command}` got no answer within {timeout_s:g} s"
                ) from None
            raise


@contextmanager
def _watchdog(transport: paramiko.Transport, timeout_s: float) -> Iterator[threading.Event]:
    """Close the transport `timeout_s` (plus a grace) after entry: paramiko waits without a
    timeout for some answers (the reply to exec_command), so a host that freezes after the
    login would otherwise hold the caller, a provisioning tick included, forever. The event
    says whether it fired."""
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        transport.close()

    timer = threading.Timer(timeout_s + _WATCHDOG_GRACE_S, expire)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


def _reboot_on(
    transport: paramiko.Transport, target: SshTarget, command: str, timeout_s: float
) -> None:
    try:
        try:
            channel = transport.open_session(timeout=timeout_s)
            channel.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SshError(
                f"server {target.server}: could not send `{command}` over SSH: {one_line(exc)}"
            ) from None
        # Sent: from here a dropped connection is the reboot taking the host down.
        deadline = time.monotonic() + timeout_s
        try:
            while not channel.status_event.wait(min(_POLL_S * 4, timeout_s)):
                if channel.closed or not transport.is_active():
                    return
                if time.monotonic() > deadline:
                    raise SshError(
                        f"server {target.server}: `{command}` did not finish within {timeout_s:g} s"
                    )
            status = channel.exit_status
            if status in (0, -1):  # -1: the channel closed without a status
                return
            stderr = channel.recv_stderr(4096) if channel.recv_stderr_ready() else b""
            detail = one_line(stderr.decode(errors="replace"))
            raise SshError(
                f"server {target.server}: `{command}` exited with status {status}"
                + (f": {detail}" if detail else "")
            )
        except (paramiko.SSHException, OSError, EOFError):
            return
    finally:
        transport.close()
