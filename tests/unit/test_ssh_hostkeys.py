"""fleet/ssh without a server: fingerprints as OpenSSH prints them, known_hosts lines, the pin
check's errors, and the private key's loading errors (one line, nothing of the key in them or
in the log)."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import paramiko
import pytest
from pydantic import SecretStr
from sshd_peer import SSH_KEYGEN, keygen

from fleet.models import ServerBase
from fleet.settings import Settings
from fleet.ssh.client import SshError, load_key, target_for
from fleet.ssh.hostkeys import HostKeyMismatch, HostKeyUnknown, check, fingerprint, known_hosts_line
from fleet.validation import SSH_FINGERPRINT_PATTERN

PASSPHRASE = "a-passphrase-never-echoed-42"


def _settings(key: Path | None, passphrase: str | None = None) -> Settings:
    return Settings(
        ssh_key_file=key,
        ssh_key_passphrase=SecretStr(passphrase) if passphrase is not None else None,
    )


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_fingerprint_is_what_ssh_keygen_prints(tmp_path: Path, kind: str) -> None:
    key = keygen(tmp_path / f"id_{kind}", kind)
    printed = subprocess.run(
        [str(SSH_KEYGEN), "-lf", f"{key}.pub"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    loaded = paramiko.PKey.from_path(key)
    assert fingerprint(loaded) == printed
    assert re.fullmatch(SSH_FINGERPRINT_PATTERN, printed)
    public = (tmp_path / f"id_{kind}.pub").read_text().split()
    assert (
        known_hosts_line("127.0.0.1", 2222, loaded) == f"[127.0.0.1]:2222 {public[0]} {public[1]}"
    )
    assert known_hosts_line("h1.example", 22, loaded) == f"h1.example {public[0]} {public[1]}"


def test_the_pin_check_names_the_server_and_both_fingerprints(tmp_path: Path) -> None:
    key = paramiko.PKey.from_path(keygen(tmp_path / "host"))
    offered = fingerprint(key)
    other = "SHA256:" + "A" * 43
    assert check("gpu-1", offered, key) == offered
    with pytest.raises(HostKeyUnknown) as unknown:
        check("gpu-1", None, key)
    assert str(unknown.value) == (
        f"server gpu-1: no pinned SSH host key (it offers {offered}): pin it in the inventory "
        "or run `fleetctl servers ssh-trust gpu-1`"
    )
    with pytest.raises(HostKeyMismatch) as changed:
        check("gpu-1", other, key)
    assert str(changed.value) == (
        f"server gpu-1: SSH host key mismatch: pinned {other}, offered {offered}"
    )
    assert changed.value.status_code == 409


def test_a_server_without_an_ssh_address_has_no_target() -> None:
    server = ServerBase.model_construct(name="gpu-2", ssh_address=None, ssh_port=22)
    with pytest.raises(SshError, match=r"^server gpu-2: no SSH address"):
        target_for(server)
    server = ServerBase.model_construct(
        name="gpu-2", ssh_address="10.0.0.2", ssh_port=2200, ssh_host_key=None
    )
    target = target_for(server)
    assert (target.server, target.address, target.port, target.host_key) == (
        "gpu-2",
        "10.0.0.2",
        2200,
        None,
    )


def test_key_loading_errors_are_one_line_and_say_nothing_of_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    plain = keygen(tmp_path / "plain")
    locked = keygen(tmp_path / "locked", passphrase=PASSPHRASE)
    garbage = tmp_path / "garbage"
    garbage.write_text(
        "-----BEGIN OPENSSH PRIVATE KEY-----\nbm90IGEga2V5\n-----END OPENSSH PRIVATE KEY-----\n"
    )
    assert fingerprint(load_key(_settings(plain))) == fingerprint(paramiko.PKey.from_path(plain))
    assert load_key(_settings(locked, PASSPHRASE)) is not None
    cases = [
        (_settings(None), "no SSH key: set FLEET_SSH_KEY_FILE to the fleet's private key file"),
        (_settings(tmp_path / "absent"), f"FLEET_SSH_KEY_FILE {tmp_path / 'absent'}: no such file"),
        (_settings(tmp_path), f"FLEET_SSH_KEY_FILE {tmp_path}: a directory, not a key file"),
        (
            _settings(locked),
            f"FLEET_SSH_KEY_FILE {locked}: the key is encrypted: set FLEET_SSH_KEY_PASSPHRASE",
        ),
        (
            _settings(locked, "wrong-passphrase"),
            f"FLEET_SSH_KEY_FILE {locked}: cannot read the private key (a wrong "
            "FLEET_SSH_KEY_PASSPHRASE, or not an OpenSSH/PEM private key)",
        ),
        (
            _settings(garbage),
            f"FLEET_SSH_KEY_FILE {garbage}: cannot read the private key (not an OpenSSH/PEM "
            "private key)",
        ),
    ]
    secrets = [PASSPHRASE, "wrong-passphrase", plain.read_text().splitlines()[1], "bm90IGEga2V5"]
    for settings, message in cases:
        with pytest.raises(SshError) as exc:
            load_key(settings)
        assert str(exc.value) == message
        assert exc.value.__cause__ is None  # no parser message (it may quote the file)
    logged = caplog.text
    for secret in secrets:
        assert secret not in logged
