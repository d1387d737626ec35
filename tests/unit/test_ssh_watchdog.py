"""A host that freezes after the login must not hold the fleet (fleet/ssh/client.py's watchdog).

paramiko waits for the reply to `exec_command` without a timeout of its own; a provisioning tick
asking a frozen host to reboot would then never end. Here an in-process SSH server (paramiko's
own server side, on 127.0.0.1) logs the client in and never answers the exec request: both
`run` and `request_reboot` give up with one line naming the server, within their bound.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from fleet.settings import Settings
from fleet.ssh import client
from fleet.ssh.client import SshError, SshTarget
from fleet.ssh.hostkeys import fingerprint

BOUND_S = 0.5


class FrozenHost(paramiko.ServerInterface):  # type: ignore[misc]
    """Accepts the key, opens sessions, then sits on every exec request."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return int(paramiko.AUTH_SUCCESSFUL)

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return int(paramiko.OPEN_SUCCEEDED)

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        self.release.wait(30)  # frozen: the reply never comes while the test runs
        return False


@pytest.fixture
def frozen(tmp_path: Path) -> Iterator[tuple[SshTarget, Settings]]:
    host_key = paramiko.Ed25519Key.from_private_key_file(_keygen(tmp_path / "host"))
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()
    transports: list[paramiko.Transport] = []

    def serve() -> None:
        while not release.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(host_key)
            transport.start_server(server=FrozenHost(release))
            transports.append(transport)

    threading.Thread(target=serve, daemon=True).start()
    target = SshTarget("frozen-01", "127.0.0.1", listener.getsockname()[1], fingerprint(host_key))
    settings = Settings(
        ssh_key_file=_keygen(tmp_path / "client"),
        ssh_connect_timeout_s=5,
        ssh_command_timeout_s=BOUND_S,
    )
    try:
        yield target, settings
    finally:
        release.set()
        listener.close()
        for transport in transports:
            transport.close()


def _keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def test_a_command_on_a_frozen_host_ends_within_its_bound(
    frozen: tuple[SshTarget, Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, settings = frozen
    monkeypatch.setattr(client, "_WATCHDOG_GRACE_S", 0.5)
    began = time.monotonic()
    with pytest.raises(SshError) as caught:
        client.run(target, settings, "true")
    assert time.monotonic() - began < 10
    assert str(caught.value) == f"server frozen-01: no answer over SSH within {BOUND_S:g} s"


def test_a_reboot_asked_of_a_frozen_host_is_an_error_in_time(
    frozen: tuple[SshTarget, Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, settings = frozen
    monkeypatch.setattr(client, "_WATCHDOG_GRACE_S", 0.5)
    began = time.monotonic()
    with pytest.raises(SshError) as caught:
        client.request_reboot(target, settings, command="true")
    assert time.monotonic() - began < 10
    assert "frozen-01" in str(caught.value) and "no answer" in str(caught.value)
