"""Issue 22's acceptance, end to end: the real playbooks of ansible/ run by `ansible-playbook`
over real SSH against the virtual colo's servers in SSH mode (each server's OS a Debian sshd in
its own mount + PID namespace, fleet/lab/ssh_hosts.py), in front of a real `fleetctl serve`.

One world for the module (starting it and installing three agents is the expensive part):

1. Three spares boot for a deployment (pinned at three servers, disruption budget 1). Their
   OS comes up but no agent runs: they stay `booting`. `ansible-inventory --graph` (the fleet
   inventory plugin) lists them by site, rack, pool, state, GPU model; `fleetctl servers
   known-hosts` writes the keys that match the fleet's pins.
2. `playbooks/deploy.yml` installs the agent from the project's wheel on all three; each agent
   registers (the servers leave `booting`, then serve); a second run changes nothing.
3. Remediation with SSH enabled: a fatal Xid on one server reboots it over SSH (no BMC power
   cycle); with its SSH port closed another falls back to the BMC power cycle. Both serve again.
4. `playbooks/upgrade.yml` to a new version: every server drained through the API before its
   agent was replaced (the event log shows it), never more than the budget out at once.
5. A deliberately broken version: the run stops after the first batch, saying why; the other
   two keep serving the previous version.
6. `fleetctl servers diagnose` over SSH returns a bundle from a lab host.

It lives in tests/e2e/ (its own unit of work) rather than worlds/: its waits are Ansible's,
minutes long, and nothing here is timed against the control loops' ticks.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from live import make_token
from typer.testing import CliRunner, Result

from fleet import cli, db
from fleet.lab import LabError
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    ServeProcess,
    lab_ssh_settings,
    start_lab,
    wait_for,
)
from fleet.lab.ssh_hosts import check_ssh_mode
from fleet.models import Role

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = ROOT / "ansible"
BIN = Path(sys.executable).parent
if os.environ.get("CI") == "true":
    check_ssh_mode()  # in CI every piece is required: a LabError fails the module
else:
    try:
        check_ssh_mode()
        if shutil.which("ipmi_sim") is None:
            raise LabError("ipmi_sim not installed")
    except LabError as exc:
        pytest.skip(f"the lab's SSH mode cannot run here: {exc}", allow_module_level=True)

DEPLOYMENT = "chat"
SERVERS = [f"ans1-r01-h100-0{i}" for i in (1, 2, 3)]
VERSION, NEW, BROKEN = "0.1.0", "0.1.0.post1", "0.1.0.post2"
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | {
    "FLEET_LOG_LEVEL": "WARNING",
    # The servers wait for Ansible in `booting`: minutes, not the harness's 40 s.
    "FLEET_BOOT_DEADLINE_S": "900",
    "FLEET_LOAD_DEADLINE_S": "120",
    "FLEET_PROBE_INTERVAL_S": "0",
    # Three servers: one fault is a third of the fleet, past the breaker's default 20 %. The
    # breaker never opens here (its own tests are test_provisioning*.py's): this module
    # remediates its servers one after another on purpose.
    "FLEET_BREAKER_SHARE": "1",
    # Remediation's graceful step, with a deadline the lab's reboot (0.5 s boot delay) meets.
    "FLEET_REMEDIATION_SSH_REBOOT": "true",
    "FLEET_SSH_REBOOT_DEADLINE_S": "60",
    "FLEET_SSH_CONNECT_TIMEOUT_S": "5",
}
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check"]
SETTLE_S = 240.0  # a whole fleet moving: boots, registrations, engines loading


def inventory() -> str:
    """Three DGX H100 behind IPMI (the lab rewrites the BMCs to its ipmi_sims and adds their
    `ssh` blocks), warm spares."""
    feeds = [
        {"name": f"{side.lower()}1", "side": side, "volts": 415, "amps": 63, "phase": "three"}
        for side in "AB"
    ]
    servers = [
        {
            "name": name,
            "u": 1 + 8 * i,
            "u_height": 8,
            "pool": "warm",
            "gpu": {"model": "H100", "count": 8},
            "power": {"idle_w": 1900, "standby_w": 90, "max_w": 10200},
            "bmc": {
                "protocol": "ipmi",
                "address": "10.0.0.1",
                "port": 623,
                "username": "admin",
                "password": "not-used-by-the-lab",
            },
        }
        for i, name in enumerate(SERVERS)
    ]
    racks = [{"name": "ans1-r01", "feeds": feeds, "servers": servers}]
    return yaml.safe_dump({"sites": [{"name": "ans1", "racks": racks}]}, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Wheels: the project's, and two more versions made from it


def rewheel(wheel: Path, out: Path, version: str, replace: Mapping[str, bytes] = {}) -> Path:
    """A copy of `wheel` that says it is `version` (its dist-info renamed, METADATA's Version,
    a RECORD with every file's hash), with the files in `replace` swapped in."""
    name, old = wheel.name.split("-")[:2]
    old_info, new_info = f"{name}-{old}.dist-info", f"{name}-{version}.dist-info"
    target = out / wheel.name.replace(f"-{old}-", f"-{version}-")
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            path = item.filename
            if path == f"{old_info}/RECORD":
                continue
            data = replace.get(path, src.read(item))
            if path.startswith(f"{old_info}/"):
                path = new_info + path[len(old_info) :]
                if path.endswith("/METADATA"):
                    data = re.sub(
                        rb"(?m)^Version: .*$", f"Version: {version}".encode(), data, count=1
                    )
            dst.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            records.append(f"{path},sha256={digest.decode()},{len(data)}")
        records.append(f"{new_info}/RECORD,,")
        dst.writestr(f"{new_info}/RECORD", "\n".join(records) + "\n")
    return target


@dataclass(frozen=True)
class Wheels:
    house: Path  # the dependencies (and the project's own wheel)
    current: Path
    new: Path
    broken: Path


def build_wheels(base: Path) -> Wheels:
    house, extra = base / "wheelhouse", base / "versions"
    extra.mkdir(parents=True)
    built = subprocess.run(
        [*PIP_WHEEL, str(ROOT), "-w", str(house)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [current] = house.glob(f"fleet-{VERSION}-*.whl")
    broken_main = (
        b'raise SystemExit("fleet-agent: broken on purpose (tests/e2e/test_ansible.py)")\n'
    )
    return Wheels(
        house,
        current,
        rewheel(current, extra, NEW),
        rewheel(current, extra, BROKEN, {"fleet_agent/__main__.py": broken_main}),
    )


# ---------------------------------------------------------------------------------------------
# The world


@dataclass
class World:
    service: ServeProcess
    colo: VirtualColo
    admin: str
    viewer: str
    wheels: Wheels
    inventory: Path  # the lab's Ansible inventory (fleet.yml beside host_vars/)
    known_hosts: Path
    runner: CliRunner = field(default_factory=CliRunner)

    def fleetctl(self, *args: str, token: str | None = None) -> Result:
        env = {"FLEET_URL": self.service.url, "FLEET_TOKEN": token or self.admin}
        return self.runner.invoke(cli.app, list(args), env=env)

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.admin}"}
        reply = httpx.request(
            method, f"{self.service.url}/api/v1{path}", headers=headers, timeout=30, **kwargs
        )
        assert reply.status_code < 400, f"{method} {path}: {reply.status_code} {reply.text}"
        return reply.json()

    def server(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api("GET", f"/servers/{name}")
        return result

    def states(self) -> dict[str, str]:
        return {n: self.server(n)["state"] for n in SERVERS}

    def why(self) -> str:
        rows = [self.server(n) for n in SERVERS]
        return "\n".join(
            f"{r['name']}: {r['state']} agent {r['agent_version']} {r['failed_reason'] or ''}"
            for r in rows
        )

    def serving(self, names: list[str] = SERVERS, timeout: float = SETTLE_S) -> None:
        wait_for(
            f"{', '.join(names)} serving",
            lambda: all(self.server(n)["state"] == "serving" for n in names),
            timeout,
            every=0.5,
            why=self.why,
        )

    def events(self, **params: str) -> list[dict[str, Any]]:
        """Every event matching `params`, oldest first."""
        found: list[dict[str, Any]] = []
        offset = 0
        while True:
            page = self.api("GET", "/events", params={**params, "limit": 1000, "offset": offset})
            found += page["results"]
            offset += len(page["results"])
            if not page["results"] or offset >= page["count"]:
                return sorted(found, key=lambda e: e["id"])

    def ansible(
        self, tool: str, *args: str, wheel: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "ANSIBLE_"))}
        env |= {
            "PATH": f"{BIN}:{env.get('PATH', '')}",
            "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "FLEET_URL": self.service.url,
            "FLEET_TOKEN": self.viewer,
            "FLEET_ADMIN_TOKEN": self.admin,
            "FLEET_KNOWN_HOSTS": str(self.known_hosts),
            "FLEET_AGENT_WHEELHOUSE": str(self.wheels.house),
            "FLEET_AGENT_WHEEL": str(wheel or self.wheels.current),
        }
        argv = [str(BIN / tool), "-i", str(self.inventory), *args]
        if tool == "ansible-playbook":
            argv += ["--private-key", str(self.colo.ssh_key_file)]
        return subprocess.run(
            argv, cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=900
        )


def recap(run: subprocess.CompletedProcess[str]) -> dict[str, dict[str, int]]:
    """PLAY RECAP: host -> {ok, changed, unreachable, failed, ...}."""
    hosts: dict[str, dict[str, int]] = {}
    for line in run.stdout.split("PLAY RECAP", 1)[-1].splitlines():
        found = re.match(r"^(\S+)\s+:\s+(.*)$", line.strip())
        if found:
            hosts[found[1]] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[2])}
    return hosts


def output(run: subprocess.CompletedProcess[str]) -> str:
    return f"exit {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base: Path = tmp_path_factory.mktemp("ansible-e2e")
    wheels = build_wheels(base / "wheels")
    with ExitStack() as stack:
        service = ServeProcess("serve", base, SERVICE_SETTINGS | lab_ssh_settings(base / "lab"))
        stack.callback(service.stop)
        service.start(admin_token=True)
        admin = service.admin_token()
        engine = db.make_engine(f"sqlite:///{base / 'fleet.db'}")
        stack.callback(engine.dispose)
        viewer = make_token(engine, Role.VIEWER, name="inventory")
        colo = start_lab(
            service.url,
            admin,
            inventory(),
            base / "lab",
            token_for=lambda _: "never-asked-in-ssh-mode",
            boot_delay_s=0.5,
            agent_env=FAST_AGENT_SETTINGS,
            ssh=True,
        )
        stack.callback(colo.down)  # runs before service.stop: agents go first
        lab_inventory = colo.write_ansible_inventory(base / "ansible-inventory")
        yield World(service, colo, admin, viewer, wheels, lab_inventory, base / "fleet_known_hosts")


# ---------------------------------------------------------------------------------------------
# 1-2. Inventory, known hosts, deploy


@pytest.fixture(scope="module")
def deployed(world: World) -> World:
    created = world.fleetctl(
        *("deployments", "create", DEPLOYMENT, "--model-uri", "s3://models/chat-8b"),
        *("--checksum", "sha256:1", "--sla-p95-ms", "2000", "--sla-ttft-ms", "300"),
        *("--gpus-per-replica", "8", "--gpu-model", "H100", "--max", "3"),
        *("--disruption-budget", "1", "--engine", "backend=pytorch", "--engine", "tp_size=8"),
    )
    assert created.exit_code == 0, created.stdout + created.stderr
    verified = world.fleetctl("servers", "verify")  # first contact: off, warm spares
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    pinned = world.fleetctl("deployments", "scale", DEPLOYMENT, "--replicas", "3")
    assert pinned.exit_code == 0, pinned.stdout + pinned.stderr
    # Powered on, their OS up (sshd answers), no agent: booting until Ansible puts one there.
    wait_for(
        "three servers booting",
        lambda: set(world.states().values()) == {"booting"},
        60,
        why=world.why,
    )
    ports = [world.server(n)["ssh_port"] for n in SERVERS]
    wait_for("every lab host's sshd", lambda: all(_answers(p) for p in ports), 60)
    return world


def _answers(port: int) -> bool:
    """sshd's banner on 127.0.0.1:`port`."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        return conn.recv(8).startswith(b"SSH-")


def test_the_dynamic_inventory_groups_the_fleet(deployed: World) -> None:
    run = deployed.ansible("ansible-inventory", "--graph")
    assert run.returncode == 0, output(run)
    graph = run.stdout
    for group in ("site_ans1", "rack_ans1_r01", "pool_warm", "state_booting", "gpu_h100"):
        assert f"@{group}:" in graph, graph
        for name in SERVERS:
            assert name in graph.split(f"@{group}:", 1)[1], graph
    host = deployed.ansible("ansible-inventory", "--host", SERVERS[0])
    assert host.returncode == 0, output(host)
    hostvars = json.loads(host.stdout)
    block = deployed.server(SERVERS[0])
    assert hostvars["ansible_host"] == block["ssh_address"] == "127.0.0.1"
    assert hostvars["ansible_port"] == block["ssh_port"]
    assert hostvars["fleet_ssh_host_key"] == block["ssh_host_key"]
    assert (hostvars["fleet_gpu_model"], hostvars["fleet_gpu_count"]) == ("H100", 8)
    assert hostvars["fleet_bmc_protocol"] == "ipmi"
    text = json.dumps(hostvars)
    assert "password" not in text and deployed.admin not in text and deployed.viewer not in text


def test_known_hosts_holds_the_pinned_keys(deployed: World) -> None:
    result = deployed.fleetctl("servers", "known-hosts", "-o", str(deployed.known_hosts))
    assert result.exit_code == 0, result.stdout + result.stderr
    lines = deployed.known_hosts.read_text().splitlines()
    assert len([line for line in lines if line.startswith("[127.0.0.1]:")]) == len(SERVERS)


def test_deploy_installs_the_agents_and_a_second_run_changes_nothing(deployed: World) -> None:
    if not deployed.known_hosts.exists():
        test_known_hosts_holds_the_pinned_keys(deployed)
    first = deployed.ansible("ansible-playbook", "playbooks/deploy.yml")
    assert first.returncode == 0, output(first)
    hosts = recap(first)
    assert sorted(hosts) == SERVERS and all(h["failed"] == 0 for h in hosts.values()), output(first)
    assert all(h["changed"] > 0 for h in hosts.values()), output(first)
    for name in SERVERS:  # each agent registered: its server left booting
        server = deployed.server(name)
        assert server["agent_registered_at"] is not None and server["agent_version"] == VERSION
    deployed.serving()
    again = deployed.ansible("ansible-playbook", "playbooks/deploy.yml")
    assert again.returncode == 0, output(again)
    assert all(h["changed"] == 0 and h["failed"] == 0 for h in recap(again).values()), output(again)
    graph = deployed.ansible("ansible-inventory", "--graph", "deployment_chat")
    assert all(name in graph.stdout for name in SERVERS), output(graph)
    tokens = deployed.api("GET", "/tokens", params={"role": "agent", "live": "true"})["results"]
    assert sorted(t["server"] for t in tokens) == SERVERS  # one live token each, kept on rerun


def test_deploy_refuses_to_restart_a_serving_agent(deployed: World) -> None:
    deployed.serving()
    run = deployed.ansible("ansible-playbook", "playbooks/deploy.yml", wheel=deployed.wheels.new)
    assert run.returncode != 0, output(run)
    assert f"is serving: installing {NEW} restarts its agent" in run.stdout, output(run)
    rows = [deployed.server(n) for n in SERVERS]
    assert all(r["state"] == "serving" and r["agent_version"] == VERSION for r in rows)


def test_rotating_tokens_restarts_no_agent(deployed: World) -> None:
    deployed.serving()
    before = {n: deployed.server(n)["agent_registered_at"] for n in SERVERS}
    old = deployed.api("GET", "/tokens", params={"role": "agent", "live": "true"})["results"]
    run = deployed.ansible("ansible-playbook", "playbooks/rotate_tokens.yml")
    assert run.returncode == 0, output(run)
    new = deployed.api("GET", "/tokens", params={"role": "agent", "live": "true"})["results"]
    assert sorted(t["server"] for t in new) == SERVERS
    assert not {t["id"] for t in new} & {t["id"] for t in old}  # every one replaced
    for token in old:  # the old ones end now: the agents must already use the new ones
        deployed.api("DELETE", f"/tokens/{token['id']}")
    heard = {n: deployed.server(n)["last_heartbeat_at"] for n in SERVERS}
    wait_for(
        "heartbeats with the new tokens",
        lambda: all(deployed.server(n)["last_heartbeat_at"] > heard[n] for n in SERVERS),
        30,
        why=deployed.why,
    )
    assert {n: deployed.server(n)["agent_registered_at"] for n in SERVERS} == before
    deployed.serving()


# ---------------------------------------------------------------------------------------------
# 3. Remediation over SSH, and its fallback to the BMC


def _remediated(world: World, name: str, since: int) -> list[str]:
    world.colo.inject(name, {"kind": "xid", "xid": 79, "gpu": 3})
    wait_for(
        f"{name} out of serving",
        lambda: world.server(name)["state"] != "serving",
        60,
        why=lambda: f"{world.why()}\nautopilot: {world.api('GET', '/autopilot')}",
    )
    world.serving([name])
    return [
        e["kind"]
        for e in world.events(subject_type="server", subject=name)
        if (e["id"] > since and e["kind"] in {"server.ssh_reboot", "server.reboot_fallback"})
        or (e["id"] > since and e["kind"] == "server.power" and "cycle" in e["message"])
    ]


def _last_event_id(world: World) -> int:
    page = world.api("GET", "/events", params={"limit": 1})
    return int(page["results"][0]["id"]) if page["results"] else 0


def test_remediation_reboots_over_ssh_when_the_host_answers(deployed: World) -> None:
    deployed.serving()
    name = SERVERS[0]
    since = _last_event_id(deployed)
    kinds = _remediated(deployed, name, since)
    assert kinds == ["server.ssh_reboot"], kinds  # no BMC power cycle


def test_remediation_falls_back_to_the_bmc_when_ssh_does_not_answer(deployed: World) -> None:
    deployed.serving()
    name = SERVERS[1]
    port = deployed.server(name)["ssh_port"]
    deployed.api("PATCH", f"/servers/{name}", json={"ssh_port": 1})  # nothing listens there
    try:
        since = _last_event_id(deployed)
        kinds = _remediated(deployed, name, since)
    finally:
        deployed.api("PATCH", f"/servers/{name}", json={"ssh_port": port})
    assert kinds[0] == "server.reboot_fallback" and len(kinds) == 2, kinds
    fallback = next(
        e
        for e in deployed.events(subject_type="server", subject=name, kind="server.reboot_fallback")
        if e["id"] > since
    )
    assert name in fallback["message"] and ":1" in fallback["message"], fallback


# ---------------------------------------------------------------------------------------------
# 4-5. Rolling upgrade, and a broken version


def _timeline(world: World, since: int) -> list[dict[str, Any]]:
    return [e for e in world.events(subject_type="server") if e["id"] > since]


def test_the_rolling_upgrade_drains_each_server_before_replacing_its_agent(
    deployed: World,
) -> None:
    deployed.serving()
    since = _last_event_id(deployed)
    run = deployed.ansible(
        "ansible-playbook",
        "playbooks/upgrade.yml",
        *("-e", f"fleet_deployment={DEPLOYMENT}", "-e", "fleet_upgrade_delay_s=1"),
        wheel=deployed.wheels.new,
    )
    assert run.returncode == 0, output(run)
    assert all(deployed.server(n)["agent_version"] == NEW for n in SERVERS), deployed.why()
    deployed.serving()
    events = _timeline(deployed, since)
    out: set[str] = set()
    most_out = 0
    drained: set[str] = set()
    for event in events:
        name = event["subject"]
        if event["to_state"]:
            if event["to_state"] == "serving":
                out.discard(name)
            else:
                out.add(name)
            most_out = max(most_out, len(out))
            if event["to_state"] == "draining":
                assert event["actor"].startswith("admin:"), event  # through the API
            if event["to_state"] == "drained":
                drained.add(name)
        if event["kind"] == "server.agent_registered":
            assert event["details"]["agent_version"] == NEW, event
            assert name in drained, f"{name}'s agent replaced before it was drained: {event}"
    assert most_out <= 1, "more servers out at once than the disruption budget (1)"
    assert drained == set(SERVERS)


def test_a_broken_version_stops_the_upgrade_after_the_first_batch(deployed: World) -> None:
    deployed.serving()
    run = deployed.ansible(
        "ansible-playbook",
        "playbooks/upgrade.yml",
        *("-e", f"fleet_deployment={DEPLOYMENT}", "-e", "fleet_upgrade_delay_s=1"),
        *("-e", "fleet_agent_register_retries=15", "-e", "fleet_agent_register_delay_s=1"),
        wheel=deployed.wheels.broken,
    )
    assert run.returncode != 0, output(run)
    [stopped] = set(re.findall(r"stopped at server (\S+):", run.stdout))
    assert stopped in SERVERS, output(run)
    rest = [n for n in SERVERS if n != stopped]
    rows = {n: deployed.server(n) for n in SERVERS}
    assert all(rows[n]["state"] == "serving" and rows[n]["agent_version"] == NEW for n in rest)
    assert rows[stopped]["state"] != "serving", rows[stopped]


# ---------------------------------------------------------------------------------------------
# 6. Diagnostics over SSH from a lab host


def test_diagnose_returns_a_bundle_from_a_lab_host(deployed: World, tmp_path: Path) -> None:
    name = SERVERS[2]
    result = deployed.fleetctl("servers", "diagnose", name, "-o", str(tmp_path))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert re.match(rf"^{name}: bundle \d+, ", result.stdout), result.stdout
    [bundle] = tmp_path.glob("*.tar.gz")
    with tarfile.open(bundle) as tar:
        files = {Path(m.name).name: m for m in tar.getmembers()}
        member = tar.extractfile(files["summary.json"])
        assert member is not None
        summary = json.loads(member.read())
        journal = tar.extractfile(files["agent-journal.txt"])
        assert journal is not None
        # The stand-in journal of the agent's unit (its registration is logged there).
        assert b"fleet" in journal.read().lower()
    assert (
        summary["server"] == name and summary["host_key"] == deployed.server(name)["ssh_host_key"]
    )
    ran = {c["name"]: c for c in summary["commands"]}
    assert ran["uname"]["exit_status"] == 0 and ran["nvidia-smi"]["missing"], ran
