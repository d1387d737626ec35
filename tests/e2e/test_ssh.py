"""SSH from the fleet against a real OpenSSH server (Debian's sshd, tests/sshd_peer.py): the
client (host key checked before login, timeouts, output caps, the graceful reboot request),
diagnostic bundles through the API and `fleetctl servers diagnose`, `ssh-trust`, and a
`known-hosts` file that OpenSSH's own client accepts with StrictHostKeyChecking=yes.

The acceptance lines: a bundle from a real sshd; an unknown host key, a wrong key and an
unreachable host each one line naming the server, within the timeout.
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from factories import add_rack, add_server, add_site
from live import Live, closed_port, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from sshd_peer import SshdPeer, keygen, sshd_peer
from typer.testing import CliRunner, Result

from fleet.cli import servers as servers_cli
from fleet.models import DiagnosticBundle, Event, Role, Server
from fleet.settings import Settings
from fleet.ssh.client import SshError, SshTarget, request_reboot, run
from fleet.ssh.diagnose import Collector, collect
from fleet.ssh.hostkeys import HostKeyMismatch, HostKeyUnknown, scan

API = "/api/v1"
CONNECT_S = 2.0
# An unknown key, a wrong key or an unreachable host: refused within the connect timeout
# (three bounded steps at most: TCP, key exchange, login) and some slack for a loaded runner.
REFUSED_WITHIN_S = 3 * CONNECT_S + 2.0
OTHER_PIN = "SHA256:" + "Q" * 43


@dataclass(frozen=True)
class Peers:
    good: SshdPeer  # accepts the fleet's key
    other: SshdPeer  # accepts another key only (the fleet's key is "wrong" there)
    fleet_key: Path


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peers]:
    root = tmp_path_factory.mktemp("sshd")
    fleet_key = keygen(root / "fleet_id_ed25519")
    stranger = keygen(root / "stranger_id_ed25519")
    with (
        sshd_peer(root / "good", client_key=fleet_key) as good,
        sshd_peer(root / "other", client_key=stranger) as other,
    ):
        yield Peers(good, other, fleet_key)


def _settings(peers: Peers, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "ssh_key_file": peers.fleet_key,
        "ssh_connect_timeout_s": CONNECT_S,
        "ssh_command_timeout_s": 10.0,
        **overrides,
    }
    return Settings(**values)


def _target(peer: SshdPeer, name: str = "gpu-1", pin: str | None = "peer") -> SshTarget:
    return SshTarget(name, peer.address, peer.port, peer.host_fingerprint if pin == "peer" else pin)


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP connections and never says anything (a hung host)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------------
# The client


def test_a_command_runs_when_the_host_key_is_the_pinned_one(
    peers: Peers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    result = run(_target(peers.good), _settings(peers), "echo out; echo err >&2; exit 7")
    assert (result.exit_status, result.stdout, result.stderr) == (7, b"out\n", b"err\n")
    assert not result.truncated and not result.timed_out
    # Nothing of the private key reaches the log, even at DEBUG (paramiko's included).
    body = peers.fleet_key.read_text().splitlines()[1:-1]
    assert caplog.records and not any(line in caplog.text for line in body)
    assert fingerprint_scanned(peers.good) == peers.good.host_fingerprint


def fingerprint_scanned(peer: SshdPeer) -> str:
    from fleet.ssh.hostkeys import fingerprint

    return fingerprint(scan(peer.address, peer.port, CONNECT_S))


def _logins(peer: SshdPeer) -> int:
    """Login attempts the sshd saw with any key (its VERBOSE log names each key offered)."""
    return len(
        re.findall(r"(Accepted|Failed|Postponed) publickey|userauth_pubkey", peer.log_text())
    )


def test_an_unknown_or_changed_host_key_is_refused_before_any_login(peers: Peers) -> None:
    before = _logins(peers.good)
    start = time.monotonic()
    with pytest.raises(HostKeyUnknown) as unknown:
        run(_target(peers.good, "gpu-new", pin=None), _settings(peers), "true")
    assert str(unknown.value).startswith("server gpu-new: no pinned SSH host key (it offers ")
    assert peers.good.host_fingerprint in str(unknown.value)
    with pytest.raises(HostKeyMismatch) as changed:
        run(_target(peers.good, "gpu-moved", pin=OTHER_PIN), _settings(peers), "true")
    assert str(changed.value) == (
        f"server gpu-moved: SSH host key mismatch: pinned {OTHER_PIN}, "
        f"offered {peers.good.host_fingerprint}"
    )
    assert time.monotonic() - start < 2 * REFUSED_WITHIN_S
    # The fleet's key was never offered to the unverified host.
    time.sleep(0.2)
    assert _logins(peers.good) == before


def test_a_wrong_key_is_refused_in_one_line_naming_the_server(peers: Peers) -> None:
    start = time.monotonic()
    with pytest.raises(SshError) as exc:
        run(_target(peers.other, "gpu-2"), _settings(peers), "true")
    assert time.monotonic() - start < REFUSED_WITHIN_S
    message = str(exc.value)
    assert message == (
        f"server gpu-2: SSH login as root at 127.0.0.1:{peers.other.port} refused: the "
        "fleet's key (FLEET_SSH_KEY_FILE) is not authorized there"
    )


def test_an_unreachable_host_fails_within_the_connect_timeout(
    peers: Peers, silent_listener: int
) -> None:
    port = closed_port()
    start = time.monotonic()
    with pytest.raises(SshError) as refused:
        run(SshTarget("gpu-3", "127.0.0.1", port, OTHER_PIN), _settings(peers), "true")
    assert str(refused.value) == (
        f"server gpu-3: cannot reach SSH at 127.0.0.1:{port}: connection refused"
    )
    with pytest.raises(SshError) as hung:
        run(SshTarget("gpu-4", "127.0.0.1", silent_listener, OTHER_PIN), _settings(peers), "true")
    assert time.monotonic() - start < REFUSED_WITHIN_S
    text = str(hung.value)
    assert text.startswith(f"server gpu-4: SSH handshake with 127.0.0.1:{silent_listener} failed")
    assert "\n" not in text


def test_a_command_past_its_timeout_is_cut(peers: Peers) -> None:
    start = time.monotonic()
    result = run(_target(peers.good), _settings(peers), "echo begun; sleep 30", timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + REFUSED_WITHIN_S
    assert result.timed_out and result.exit_status is None
    assert result.stdout == b"begun\n" and 1.0 <= result.seconds < 3.0


def test_a_huge_output_is_truncated_and_flagged(peers: Peers) -> None:
    result = run(
        _target(peers.good), _settings(peers), "head -c 5000000 /dev/zero", max_bytes=100_000
    )
    assert result.truncated and result.exit_status is None and not result.timed_out
    assert result.stdout == b"\0" * 100_000


def test_request_reboot_succeeds_on_exit_zero_or_a_dropped_connection(peers: Peers) -> None:
    settings = _settings(peers, ssh_command_timeout_s=5.0)
    target = _target(peers.good)
    request_reboot(target, settings, command="true")
    # The session's own sshd process killed: the connection drops as a reboot drops it.
    start = time.monotonic()
    request_reboot(target, settings, command="kill -9 $PPID; sleep 10")
    assert time.monotonic() - start < 5.0
    failing = "echo nope >&2; exit 3"
    with pytest.raises(SshError) as failed:
        request_reboot(target, settings, command=failing)
    assert str(failed.value) == f"server gpu-1: `{failing}` exited with status 3: nope"
    with pytest.raises(SshError, match=r"^server gpu-2: SSH login as root"):
        request_reboot(_target(peers.other, "gpu-2"), settings, command="true")


# ---------------------------------------------------------------------------------------------
# Bundles


def _members(content: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(content), mode="r:gz") as tar:
        out: dict[str, bytes] = {}
        for member in tar.getmembers():
            handle = tar.extractfile(member)
            assert handle is not None
            out[member.name.split("/", 1)[1]] = handle.read()
        return out


def test_a_bundle_holds_each_command_and_records_missing_tools(peers: Peers) -> None:
    collected = collect(_target(peers.good, "gpu-1"), _settings(peers))
    files = _members(collected.content)
    summary = json.loads(files["summary.json"])
    assert summary["server"] == "gpu-1" and summary["commands"] == collected.summary
    by_name = {c["name"]: c for c in collected.summary}
    assert list(by_name) == [
        "uname",
        "uptime",
        "driver-version",
        "xid",
        "agent-journal",
        "engine-logs",
        "nvidia-smi",
        "dcgmi-diag",
    ]
    assert files["uname.txt"].startswith(b"Linux ")
    assert by_name["uname"]["exit_status"] == 0
    # This machine has no NVIDIA driver, no DCGM and no agent logs: recorded, not errors.
    for name in ("nvidia-smi", "dcgmi-diag", "driver-version", "engine-logs"):
        assert by_name[name]["missing"] and by_name[name]["exit_status"] == 127, by_name[name]
        assert f"{name}.txt" not in files
    assert by_name["xid"]["exit_status"] == 0 and not by_name["xid"]["missing"]
    assert collected.missing >= 4 and not collected.truncated


def test_a_bundle_is_bounded_in_time(peers: Peers) -> None:
    settings = _settings(peers, ssh_command_timeout_s=1.0, diagnose_timeout_s=2.2)
    commands = [Collector(f"slow{i}", f"echo started {i}; sleep 37", "sleep") for i in range(3)]
    start = time.monotonic()
    collected = collect(_target(peers.good), settings, commands=commands)
    assert time.monotonic() - start < settings.diagnose_timeout_s + 1.0
    first, second, third = collected.summary
    for entry in (first, second):
        assert entry["timed_out"] and entry["exit_status"] is None, entry
    assert third["skipped"] == "out of time (diagnose_timeout_s 2.2 s)", third
    assert collected.truncated
    assert _members(collected.content)["slow0.txt"] == b"started 0\n"
    # The server's own `timeout` ends what we gave up on (no `sleep 37` left behind).
    deadline = time.monotonic() + 10
    while _sleepers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _sleepers()


def _sleepers() -> list[str]:
    found = subprocess.run(["pgrep", "-af", "sleep 37"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def test_a_bundle_is_bounded_in_size(peers: Peers) -> None:
    settings = _settings(peers, diagnose_max_output_bytes=50_000, diagnose_max_bundle_bytes=120_000)
    commands = [
        Collector("huge", "head -c 3000000 /dev/urandom", "head"),
        Collector("huge2", "head -c 3000000 /dev/urandom", "head"),
        Collector("huge3", "head -c 3000000 /dev/urandom", "head"),
        Collector("late", "echo late", "echo"),
    ]
    collected = collect(_target(peers.good), settings, commands=commands)
    by_name = {c["name"]: c for c in collected.summary}
    assert by_name["huge"]["truncated"] and by_name["huge"]["bytes"] == 50_000
    assert collected.truncated and len(collected.content) <= settings.diagnose_max_bundle_bytes
    # The bundle filled up: what did not fit says so rather than going missing silently.
    assert str(by_name["late"]["skipped"]).startswith("bundle full"), by_name["late"]
    assert len(_members(collected.content)["huge.txt"]) == 50_000


# ---------------------------------------------------------------------------------------------
# Through the service and fleetctl


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory, peers: Peers) -> Iterator[Live]:
    with serve(
        engine,
        tmp_path_factory.mktemp("ssh-service"),
        ssh_key_file=peers.fleet_key,
        ssh_connect_timeout_s=CONNECT_S,
        ssh_command_timeout_s=10.0,
        diagnose_timeout_s=30.0,
    ) as server:
        yield server


@pytest.fixture
def fleet(db: Engine, live: Live, peers: Peers) -> Iterator[dict[str, str]]:
    """Four servers: one whose pin matches its sshd, one with no pin, one at the sshd that
    refuses the fleet's key, one whose sshd is gone."""
    with Session(db, expire_on_commit=False) as session:
        rack = add_rack(session, add_site(session, "s1"), "r1")
        specs = {
            "good": (peers.good, peers.good.host_fingerprint),
            "nopin": (peers.good, None),
            "wrongkey": (peers.other, peers.other.host_fingerprint),
            "gone": (None, OTHER_PIN),
        }
        for i, (name, (peer, pin)) in enumerate(specs.items()):
            add_server(
                session,
                rack,
                name,
                u_position=1 + 8 * i,
                bmc_system_id=name,
                ssh_address="127.0.0.1",
                ssh_port=peer.port if peer else closed_port(),
                ssh_host_key=pin,
            )
        add_server(session, rack, "nossh", u_position=40, bmc_system_id="nossh")
    yield {name: name for name in specs}
    live.close_clients()


def fleetctl(live: Live, role: Role, *args: str) -> Result:
    app = typer.Typer()
    app.add_typer(servers_cli.servers_app, name="servers")
    env = {"FLEET_URL": live.url, "FLEET_TOKEN": live.token(role, name=f"cli-{role.value}")}
    return CliRunner().invoke(app, list(args), env=env)


def test_fleetctl_diagnose_one_line_per_server(
    live: Live, fleet: dict[str, str], db: Engine, tmp_path: Path
) -> None:
    start = time.monotonic()
    result = fleetctl(
        live,
        Role.OPERATOR,
        "servers",
        "diagnose",
        "good",
        "nopin",
        "wrongkey",
        "gone",
        "nossh",
        "-o",
        str(tmp_path),
    )
    assert time.monotonic() - start < 30.0
    assert result.exit_code == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 5, lines
    good, nopin, wrongkey, gone, nossh = lines
    match = re.fullmatch(
        r"good: bundle (\d+), [\d.]+ KiB, 8 commands \((\d) missing\) -> (.+)", good
    )
    assert match, good
    assert nopin.startswith("nopin: error: no pinned SSH host key (it offers SHA256:")
    assert wrongkey.startswith("wrongkey: error: SSH login as root at 127.0.0.1:")
    assert wrongkey.endswith(
        "refused: the fleet's key (FLEET_SSH_KEY_FILE) is not authorized there"
    )
    assert gone.startswith("gone: error: cannot reach SSH at 127.0.0.1:")
    assert nossh.startswith("nossh: error: no SSH address")
    assert result.stderr.strip() == "error: 4 of 5 servers failed"
    bundle_id = int(match[1])
    downloaded = Path(match[3]).read_bytes()
    assert _members(downloaded)["uname.txt"].startswith(b"Linux ")
    with Session(db) as session:
        row = session.get(DiagnosticBundle, bundle_id)
        assert (
            row is not None and row.content == downloaded and row.created_by.startswith("operator:")
        )
        kinds = session.exec(
            select(Event.subject, Event.kind).where(col(Event.kind).startswith("server.diagnos"))
        ).all()
    assert sorted(kinds) == sorted(
        [
            ("good", "server.diagnosed"),
            ("nopin", "server.diagnose_failed"),
            ("wrongkey", "server.diagnose_failed"),
            ("gone", "server.diagnose_failed"),
            ("nossh", "server.diagnose_failed"),
        ]
    )
    listed = fleetctl(live, Role.OPERATOR, "servers", "diagnostics", "good", "--output", "json")
    assert listed.exit_code == 0, listed.stderr
    [entry] = json.loads(listed.stdout)
    assert entry["id"] == bundle_id and "content" not in entry
    out = tmp_path / "again.tar.gz"
    got = fleetctl(
        live, Role.OPERATOR, "servers", "diagnostics-get", str(bundle_id), "-o", str(out)
    )
    assert got.exit_code == 0, got.stderr
    assert out.read_bytes() == downloaded


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json()


def refused(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    text = response.json()["detail"]
    assert isinstance(text, str) and "\n" not in text, text
    return text


def test_the_api_checks_roles_and_input_and_serves_gzip(live: Live, fleet: dict[str, str]) -> None:
    viewer = live.client(live.token(Role.VIEWER, name="viewer"))
    operator = live.client(live.token(Role.OPERATOR, name="operator"))
    admin = live.client(live.token(Role.ADMIN, name="admin"))
    body = {"servers": ["good"]}
    assert "operator" in refused(viewer.post(f"{API}/diagnostics", json=body), 403)
    answer = ok(operator.post(f"{API}/diagnostics", json=body))
    [result] = answer["results"]
    assert answer["failed"] == 0 and result["ok"] and result["error"] is None
    bundle_id = result["bundle_id"]
    download = operator.get(f"{API}/diagnostics/{bundle_id}")
    assert download.status_code == 200
    assert download.headers["content-type"] == "application/gzip"
    assert 'filename="good-diagnostics-' in download.headers["content-disposition"]
    assert len(download.content) == result["size_bytes"]
    listed = ok(operator.get(f"{API}/servers/good/diagnostics"))
    assert listed["count"] == 1 and listed["results"][0]["id"] == bundle_id
    for path in (f"/diagnostics/{bundle_id}", "/servers/good/diagnostics"):
        assert "operator" in refused(viewer.get(API + path), 403)
    assert "admin" in refused(operator.post(f"{API}/servers/nopin/ssh-trust"), 403)
    # Bad input: 4xx naming the problem, nothing contacted.
    assert "'ghost'" in refused(
        operator.post(f"{API}/diagnostics", json={"servers": ["good", "ghost"]}), 404
    )
    refused(operator.post(f"{API}/diagnostics", json={"servers": []}), 422)
    refused(operator.post(f"{API}/diagnostics", json={"servers": ["Bad Name!"]}), 422)
    refused(operator.post(f"{API}/diagnostics", json={"server": ["good"]}), 422)
    assert "no diagnostic bundle 999999" in refused(operator.get(f"{API}/diagnostics/999999"), 404)
    refused(operator.get(f"{API}/diagnostics/abc"), 422)
    assert "'ghost'" in refused(operator.get(f"{API}/servers/ghost/diagnostics"), 404)
    assert "'ghost'" in refused(admin.post(f"{API}/servers/ghost/ssh-trust"), 404)
    assert "no SSH address" in refused(admin.post(f"{API}/servers/nossh/ssh-trust"), 409)


def test_ssh_trust_pins_on_first_contact_and_refuses_another_key(
    live: Live, fleet: dict[str, str], db: Engine, peers: Peers
) -> None:
    first = fleetctl(live, Role.ADMIN, "servers", "ssh-trust", "nopin")
    assert first.exit_code == 0, first.stdout + first.stderr
    assert first.stdout.strip() == f"nopin: pinned {peers.good.host_fingerprint}"
    again = fleetctl(live, Role.ADMIN, "servers", "ssh-trust", "nopin")
    assert again.stdout.strip() == first.stdout.strip()
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == "nopin")).one()
        assert server.ssh_host_key == peers.good.host_fingerprint
        [event] = session.exec(select(Event).where(Event.kind == "server.ssh_trusted")).all()
        assert event.subject == "nopin" and peers.good.host_fingerprint in event.message
        # Another key now: the pinned one stays, the refusal names both.
        server.ssh_port = peers.other.port
        session.add(server)
        session.commit()
    moved = fleetctl(live, Role.ADMIN, "servers", "ssh-trust", "nopin", "gone")
    assert moved.exit_code == 1
    mismatch, gone = moved.stdout.strip().splitlines()
    assert mismatch == (
        f"nopin: error: SSH host key mismatch: pinned {peers.good.host_fingerprint}, "
        f"offered {peers.other.host_fingerprint}"
    )
    assert gone.startswith("gone: error: cannot reach SSH at 127.0.0.1:")
    viewer = fleetctl(live, Role.OPERATOR, "servers", "ssh-trust", "good")
    assert viewer.exit_code == 1 and "admin" in viewer.stderr + viewer.stdout


def test_known_hosts_file_works_with_openssh_strict_checking(
    live: Live, fleet: dict[str, str], peers: Peers, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    made = fleetctl(live, Role.VIEWER, "servers", "known-hosts", "good", "-o", str(known))
    assert made.exit_code == 0, made.stdout + made.stderr
    assert known.read_text().startswith(f"[127.0.0.1]:{peers.good.port} ssh-ed25519 ")

    def ssh(known_hosts: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "ssh",
                "-F",
                "/dev/null",
                "-o",
                f"UserKnownHostsFile={known_hosts}",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                f"ConnectTimeout={int(CONNECT_S) + 1}",
                "-i",
                str(peers.fleet_key),
                "-p",
                str(peers.good.port),
                "root@127.0.0.1",
                "echo through",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )

    answer = ssh(known)
    assert (answer.returncode, answer.stdout) == (0, "through\n"), answer.stderr
    # The check is real: with an empty file the same command is refused.
    empty = tmp_path / "empty"
    empty.write_text("")
    assert ssh(empty).returncode == 255
    # Every server with SSH: the unverifiable ones are named, the rest still written.
    everyone = fleetctl(live, Role.VIEWER, "servers", "known-hosts", "-o", str(known))
    assert everyone.exit_code == 1
    lines = everyone.stdout.strip().splitlines()
    assert sorted(line.split(":")[0] for line in lines[:-1]) == ["gone", "nopin"]
    assert lines[-1] == f"2 host keys -> {known}"
    assert len(known.read_text().splitlines()) == 2  # good, and wrongkey's (its pin matches)
