"""The virtual colo in SSH mode (fleet/lab/ssh_hosts.py, fleet/lab/standin_systemd.py): each
server's OS is a real Debian sshd in its own mount + PID namespace, started when the server
powers on at its (real) BMC emulator, with the lab's STAND-IN systemctl/journalctl.

Through real SSH (paramiko, pinned host key, the lab's client key): a unit is installed, enabled
and started; `systemctl reboot` takes the host down and up with the enabled unit running again;
a power-off leaves no process of the host. The real agent runs as a unit and the lab still feeds
the BMC's power reading from it and injects faults through it. Ansible's own
`ansible.builtin.systemd_service` module runs against the stand-in, and is idempotent.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import paramiko
import pytest
import yaml

from fleet.inventory.schema import parse_inventory
from fleet.lab import LabError
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import free_port, lab_ssh_settings
from fleet.lab.harness import wait_for as _wait_for
from fleet.lab.processes import ProcRef
from fleet.lab.ssh_hosts import check_ssh_mode, fingerprint_of_public
from fleet.lab.state import load_state

ANSIBLE = Path(sys.executable).parent / "ansible"
if os.environ.get("CI") == "true":
    check_ssh_mode()  # in CI the SSH mode's pieces are required: a LabError fails the module
else:
    try:
        check_ssh_mode()
        if shutil.which("ipmi_sim") is None:
            raise LabError("ipmi_sim not installed")
    except LabError as exc:
        pytest.skip(f"the lab's SSH mode cannot run here: {exc}", allow_module_level=True)

A, B = "ssh-ipmi-01", "ssh-ipmi-02"
GPUS, IDLE_W = 8, 1900.0
wait_for = partial(_wait_for, timeout=30.0)
UNIT = """[Unit]
Description=Demo of the lab's stand-in systemd
[Service]
Environment="GREETING=hello from the unit"
ExecStart=/bin/sh -c 'echo "$GREETING"; exec sleep 1000'
Restart=on-failure
ProtectSystem=strict
NoNewPrivileges=yes
[Install]
WantedBy=multi-user.target
"""


def inventory() -> str:
    def server(u: int, name: str) -> dict[str, object]:
        return {
            "name": name,
            "u": u,
            "gpu": {"model": "H100", "count": GPUS},
            "power": {"idle_w": IDLE_W, "standby_w": 90, "max_w": 10200},
            "bmc": {
                "protocol": "ipmi",
                "address": "10.0.0.1",
                "port": 623,
                "username": "root",
                "password": "not-used-by-the-lab",
            },
        }

    feeds = [
        {"name": f"{s.lower()}1", "side": s, "volts": 415, "amps": 63, "phase": "three"}
        for s in "AB"
    ]
    doc = {
        "sites": [
            {
                "name": "ssh1",
                "racks": [
                    {"name": "ssh1-r01", "feeds": feeds, "servers": [server(1, A), server(2, B)]}
                ],
            }
        ]
    }
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture
def colo(tmp_path: Path) -> Iterator[VirtualColo]:
    lab = VirtualColo(
        inventory(),
        tmp_path / "lab",
        token_for=lambda _: "never-asked-in-ssh-mode",
        fleet_url=f"http://127.0.0.1:{free_port()}",  # nothing there: the agent keeps retrying
        boot_delay_s=0.5,
        power_feed_s=0.3,
        ssh=True,
        agent_env={"FLEET_AGENT_SAMPLE_INTERVAL_S": "0.3", "FLEET_AGENT_BACKOFF_MAX_S": "2"},
    )
    with lab:
        yield lab


class Shell:
    """root@host over real SSH: the lab's client key, the host key pinned to the inventory's."""

    def __init__(self, colo: VirtualColo, server: str) -> None:
        ssh = colo.rewritten_inventory()["sites"][0]["racks"][0]["servers"]
        block = next(s["ssh"] for s in ssh if s["name"] == server)
        self.client = paramiko.SSHClient()
        host = colo.ssh_host(server)
        kind, blob = host.public_key_line().split()[:2]
        key = paramiko.PKey.from_type_string(kind, base64.b64decode(blob))
        assert block["host_key"] == fingerprint_of_public(host.public_key_line())
        assert block["host_key"] == key.fingerprint  # paramiko agrees: "SHA256:..."
        self.client.get_host_keys().add(
            f"[{block['address']}]:{block['port']}", key.get_name(), key
        )
        self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        self.client.connect(
            block["address"],
            port=block["port"],
            username="root",
            key_filename=str(colo.ssh_key_file),
            look_for_keys=False,
            allow_agent=False,
            timeout=5,
            banner_timeout=5,
            auth_timeout=5,
        )

    def run(self, command: str, timeout: float = 30) -> tuple[int, str]:
        _, out, err = self.client.exec_command(command, timeout=timeout)
        text = out.read().decode() + err.read().decode()
        return out.channel.recv_exit_status(), text

    def put(self, path: str, text: str) -> None:
        with self.client.open_sftp() as sftp:
            sftp.putfo(io.BytesIO(text.encode()), path)

    def close(self) -> None:
        self.client.close()


def shell(colo: VirtualColo, server: str) -> Shell:
    """A shell once the host answers SSH (its boot delay, then sshd)."""

    def connect() -> Shell | None:
        try:
            return Shell(colo, server)
        except (paramiko.SSHException, OSError, EOFError):
            return None

    return wait_for(f"{server} to answer SSH", connect)


def namespace_pids(host_pid: int) -> list[ProcRef]:
    """Every process of a host (below its unshare), by pid and start time."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ref = ProcRef.of(int(entry))
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if ref is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, queue = [], [host_pid]
    while queue:
        pid = queue.pop()
        ref = ProcRef.of(pid)
        if ref is not None:
            found.append(ref)
        queue += children.get(pid, [])
    return found


def test_units_reboot_and_power_off_over_ssh(colo: VirtualColo) -> None:
    assert oct(colo.ssh_key_file.stat().st_mode & 0o777) == "0o600"
    colo.set_power_behind_our_back(A, True)  # ipmitool at A's BMC emulator
    sh = shell(colo, A)
    try:
        code, text = sh.run("systemctl is-active demo")
        assert (code, text.strip()) == (3, "inactive")
        assert (
            sh.run("readlink -f $(command -v systemctl)")[1].strip() == "/usr/local/sbin/systemctl"
        )
        sh.put("/etc/systemd/system/demo.service", UNIT)
        # The unit file landed in A's own directory, not the machine's /etc/systemd/system.
        assert (colo.ssh_host(A).dir / "units" / "demo.service").read_text() == UNIT
        assert not Path("/etc/systemd/system/demo.service").exists()
        for command in ("systemctl daemon-reload", "systemctl enable demo", "systemctl start demo"):
            code, text = sh.run(command)
            assert code == 0, f"{command}: {text}"
        assert sh.run("systemctl is-active demo") == (0, "active\n")
        assert sh.run("systemctl is-enabled demo") == (0, "enabled\n")
        code, text = sh.run("systemctl show demo")
        props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        assert props["LoadState"] == "loaded" and props["SubState"] == "running"
        assert props["UnitFileState"] == "enabled" and int(props["MainPID"]) > 1
        wait_for(
            "the unit's output in its journal",
            lambda: "hello from the unit" in sh.run("journalctl -u demo --no-pager -n 20")[1],
        )
        # Restart=on-failure: the unit's process killed, the stand-in starts it again.
        assert sh.run(f"kill -9 {props['MainPID']}")[0] == 0
        wait_for(
            "the unit to be restarted",
            lambda: (
                sh.run("systemctl show demo -p NRestarts,ActiveState")[1]
                == "NRestarts=1\nActiveState=active\n"
            ),
        )
        assert sh.run("systemctl is-active nosuch")[0] == 3
        assert "LoadState=not-found" in sh.run("systemctl show nosuch")[1]

        # systemctl reboot: down, then up after the boot delay, the BMC on; the enabled unit
        # runs again, and nothing of the host's former life is left.
        first = colo.host_pid(A)
        assert first is not None
        before = namespace_pids(first)
        assert len(before) >= 4  # unshare, init, sshd, the unit's supervisor and process...
        sh.run("systemctl reboot", timeout=10)
    finally:
        sh.close()
    wait_for("A to reboot", lambda: colo.host_pid(A) not in (None, first))
    wait_for("A's former processes to be gone", lambda: not any(r.alive() for r in before))
    assert load_state(colo.workdir)["servers"][A]["on"] is True
    sh = shell(colo, A)
    try:
        wait_for(
            "the enabled unit to start at boot", lambda: sh.run("systemctl is-active demo")[0] == 0
        )
        journal = sh.run("journalctl -u demo --no-pager")[1]
        assert journal.count("hello from the unit") == 3  # start, restart, boot: kept on disk
        assert sh.run("journalctl -u demo -b -o cat")[1].count("hello from the unit") == 1
        code, text = sh.run("systemctl stop demo && systemctl is-active demo")
        assert (code, text.strip()) == (3, "inactive")
        assert sh.run("systemctl start demo")[0] == 0
    finally:
        sh.close()

    # Power off at the BMC: the host and every process in it are gone.
    running = colo.host_pid(A)
    assert running is not None
    procs = namespace_pids(running)
    colo.set_power_behind_our_back(A, False)
    wait_for("A's host to stop", lambda: colo.host_pid(A) is None)
    wait_for("every process of A to be gone", lambda: not any(r.alive() for r in procs), timeout=10)
    assert colo.status()[0].power == "off"


def test_the_agent_as_a_unit_feeds_power_and_takes_faults(
    colo: VirtualColo, tmp_path: Path
) -> None:
    inventory_file = colo.write_ansible_inventory(tmp_path / "ansible")
    assert yaml.safe_load(inventory_file.read_text()) == {"plugin": "fleet"}
    host_vars = yaml.safe_load((tmp_path / "ansible" / "host_vars" / f"{B}.yml").read_text())
    assert oct((tmp_path / "ansible" / "host_vars" / f"{B}.yml").stat().st_mode & 0o777) == "0o600"
    env = host_vars["fleet_agent_env"]
    assert host_vars["fleet_agent_telemetry"] == "simulated"
    assert env["FLEET_AGENT_SIM_GPUS"] == str(GPUS) and env["FLEET_AGENT_API_KEY"]
    keygen = subprocess.run(
        ["ssh-keygen", "-lf", str(tmp_path / "ansible" / "known_hosts")],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    pins = {
        s["name"]: s["ssh"]["host_key"]
        for s in colo.rewritten_inventory()["sites"][0]["racks"][0]["servers"]
    }
    assert sorted(line.split()[1] for line in keygen.stdout.splitlines()) == sorted(pins.values())
    # The rewritten inventory imports as it is: each server's ssh block pins its host key.
    parsed = {s.name: s for s in parse_inventory(colo.rewritten_yaml()).sites[0].racks[0].servers}
    block = parsed[B].ssh
    assert block is not None and block.host_key == pins[B]
    assert (block.address, block.port) == ("127.0.0.1", colo.ssh_host(B).port)

    # What the fleet_agent role does, by hand: the settings file and the unit.
    settings = {
        **env,
        "FLEET_AGENT_SERVER": B,
        "FLEET_AGENT_TOKEN": "not-checked-nothing-listens",
        "FLEET_AGENT_FLEET_URL": colo.fleet_url,
        "FLEET_AGENT_LISTEN_PORT": str(host_vars["fleet_agent_listen_port"]),
        "FLEET_AGENT_TELEMETRY": "simulated",
        "FLEET_AGENT_WORK_DIR": "/var/lib/fleet-agent",
        "FLEET_AGENT_KERNEL_LOG": "false",
    }
    unit = (
        "[Unit]\nDescription=Fleet node agent\n[Service]\n"
        "EnvironmentFile=/etc/fleet-agent/agent.env\nWorkingDirectory=/var/lib/fleet-agent\n"
        f"ExecStart={sys.executable} -m fleet_agent\nRestart=on-failure\nRestartSec=1\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    colo.set_power_behind_our_back(B, True)
    sh = shell(colo, B)
    try:
        sh.put("/etc/fleet-agent/agent.env", "".join(f"{k}={v}\n" for k, v in settings.items()))
        sh.put("/etc/systemd/system/fleet-agent.service", unit)
        code, text = sh.run("systemctl enable --now fleet-agent")
        assert code == 0, text
        wait_for("B's agent to answer", lambda: colo.status()[1].agent_ready)
        wait_for("B's draw from its agent", lambda: colo.power_w(B) != IDLE_W)
        reply = colo.inject(B, {"kind": "xid", "xid": 79, "gpu": 3})
        assert reply  # the agent took the fault with the lab's key
        state = load_state(colo.workdir)["servers"][B]
        assert state["ssh"]["host_key"] == pins[B] and state["agent"]["url"].endswith(
            f":{host_vars['fleet_agent_listen_port']}"
        )
        # The agent's engine work lands in B's own /var/lib/fleet-agent.
        assert (colo.ssh_host(B).dir / "lib").is_dir()
        assert "Fleet node agent" in sh.run("systemctl status fleet-agent")[1]
    finally:
        sh.close()


def test_ansible_systemd_service_module_against_the_stand_in(
    colo: VirtualColo, tmp_path: Path
) -> None:
    colo.set_power_behind_our_back(A, True)
    sh = shell(colo, A)
    try:
        sh.put("/etc/systemd/system/demo.service", UNIT)
    finally:
        sh.close()
    host = colo.ssh_host(A)
    known = tmp_path / "known_hosts"
    known.write_text(host.known_hosts_line() + "\n")

    def ansible(args: str) -> dict[str, object]:
        done = subprocess.run(
            [
                str(ANSIBLE),
                "-i",
                "127.0.0.1,",
                "all",
                "-o",  # one line: "HOST | CHANGED => {json}"
                "-m",
                "ansible.builtin.systemd_service",
                "-a",
                args,
                "-u",
                "root",
                "--private-key",
                str(colo.ssh_key_file),
                "-e",
                f"ansible_port={host.port}",
                "-e",
                "ansible_python_interpreter=/usr/bin/python3",
                "-e",
                f"ansible_ssh_common_args='-o UserKnownHostsFile={known} "
                "-o StrictHostKeyChecking=yes'",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={
                **os.environ,
                "ANSIBLE_HOST_KEY_CHECKING": "True",
                "ANSIBLE_NOCOLOR": "1",
            },
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("127.0.0.1 |"))
        result: dict[str, object] = json.loads(line.split("=>", 1)[1])
        return result

    first = ansible("name=demo state=started enabled=true daemon_reload=true")
    assert first["changed"] is True and first["enabled"] is True
    second = ansible("name=demo state=started enabled=true")
    assert second["changed"] is False
    assert ansible("name=demo state=stopped")["changed"] is True
    assert ansible("name=demo state=stopped")["changed"] is False
    sh = shell(colo, A)
    try:
        assert sh.run("systemctl is-active demo")[0] == 3
        assert sh.run("systemctl is-enabled demo") == (0, "enabled\n")
    finally:
        sh.close()


def test_fleetctl_lab_up_ssh(tmp_path: Path) -> None:
    lab_dir = tmp_path / "lab"
    fleetctl = str(Path(sys.executable).parent / "fleetctl")
    key = subprocess.run(
        [fleetctl, "lab", "ssh-key", "--dir", str(lab_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    # The service can hold the key before the lab is up; the lab keeps that key.
    assert lab_ssh_settings(lab_dir) == {"FLEET_SSH_KEY_FILE": key}
    (tmp_path / "inventory.yaml").write_text(inventory())
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [
                fleetctl,
                "lab",
                "up",
                str(tmp_path / "inventory.yaml"),
                "--dir",
                str(lab_dir),
                "--ssh",
                "--no-import",
                "--boot-delay",
                "0.3",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for("lab up --ssh", lambda: "wrote" in log.read_text(), timeout=60)
        text = log.read_text()
        assert f"export FLEET_SSH_KEY_FILE={key}" in text and "Ansible inventory:" in text
        assert (lab_dir / "ansible" / "fleet.yml").is_file()
        written = yaml.safe_load((lab_dir / "inventory.yaml").read_text())
        servers = written["sites"][0]["racks"][0]["servers"]
        assert all(s["ssh"]["host_key"].startswith("SHA256:") for s in servers)
        status = subprocess.run(
            [fleetctl, "lab", "status", "--dir", str(lab_dir), "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        rows = json.loads(status.stdout)["servers"]
        assert {r["ssh"] for r in rows} == {f"127.0.0.1:{s['ssh']['port']}" for s in servers}
        down = subprocess.run(
            [fleetctl, "lab", "down", "--dir", str(lab_dir)],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert down.returncode == 0, down.stdout + down.stderr
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        up.wait(timeout=30)
