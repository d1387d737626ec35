"""The Ansible side (ansible/, docs/ansible.md): the `fleet` inventory plugin's pure half, its
HTTP half against a real fleet service, `ansible-inventory` itself with the plugin, and the
agent's systemd unit as `systemd-analyze verify` reads it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
import pytest
from live import YAML, Live, closed_port, serve
from repo_paths import ROOT
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.data import DEMO_INVENTORY
from fleet.models import Deployment, Rack, Role, Server

ANSIBLE = ROOT / "ansible"
PLUGIN_FILE = ANSIBLE / "plugins" / "inventory" / "fleet.py"
VENV_BIN = Path(sys.executable).parent
PAGE_CAP = 7  # the service's max_page_size here: the demo's servers take several pages
SUBPROCESS_TIMEOUT_S = 60


def _load_plugin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_ansible_inventory", PLUGIN_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


plugin = _load_plugin()


def _server(name: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name,
        "site": "fra1",
        "rack": "fra1-r01",
        "pool": "baseline",
        "state": "serving",
        "gpu_model": "H100",
        "gpu_count": 8,
        "bmc_protocol": "redfish",
        "bmc_address": "10.0.0.9",
        "bmc_port": 443,
        "bmc_username": "admin",
        "bmc_password_set": True,
        "agent_version": "0.1.0",
        "agent_url": "http://10.1.0.9:9410",
        "ssh_address": "10.1.0.9",
        "ssh_port": 2222,
        "ssh_host_key": "SHA256:" + "A" * 43,
        "health_verdict": "healthy",
        "deployment": "llama-3.1.70b",
    }
    row.update(fields)
    return row


# ---------------------------------------------------------------------------------------------
# API JSON -> groups and host variables


def test_groups_and_host_variables() -> None:
    found = plugin.build_inventory(
        [
            _server("h1"),
            _server("h2", rack="fra1-r02", state="drained", gpu_model="B200", deployment=None),
            _server("h3", ssh_address=None, pool="warm", state="warm", deployment=None),
        ],
        [{"name": "llama-3.1.70b", "disruption_budget": 2}],
    )
    assert found.groups == {
        "deployment_llama_3_1_70b": ["h1"],
        "gpu_b200": ["h2"],
        "gpu_h100": ["h1", "h3"],
        "no_ssh": ["h3"],
        "pool_baseline": ["h1", "h2"],
        "pool_warm": ["h3"],
        "rack_fra1_r01": ["h1", "h3"],
        "rack_fra1_r02": ["h2"],
        "site_fra1": ["h1", "h2", "h3"],
        "state_drained": ["h2"],
        "state_serving": ["h1"],
        "state_warm": ["h3"],
    }
    assert found.hostvars["h1"] == {
        "ansible_host": "10.1.0.9",
        "ansible_port": 2222,
        "fleet_server": "h1",
        "fleet_site": "fra1",
        "fleet_rack": "fra1-r01",
        "fleet_pool": "baseline",
        "fleet_state": "serving",
        "fleet_gpu_model": "H100",
        "fleet_gpu_count": 8,
        "fleet_bmc_protocol": "redfish",
        "fleet_deployment": "llama-3.1.70b",
        "fleet_disruption_budget": 2,
        "fleet_agent_version": "0.1.0",
        "fleet_ssh_host_key": "SHA256:" + "A" * 43,
        "fleet_health_verdict": "healthy",
    }
    # Listed without an SSH address, but nothing to connect to.
    assert "ansible_host" not in found.hostvars["h3"]
    assert found.hostvars["h2"]["fleet_disruption_budget"] is None


def test_no_credentials_or_bmc_endpoints_in_host_variables() -> None:
    found = plugin.build_inventory([_server("h1", bmc_password="hunter2")], [])
    values = json.dumps(found.hostvars)
    for secretish in ("hunter2", "10.0.0.9", '"admin"', "bmc_password_set", "agent_url"):
        assert secretish not in values


def test_group_names_are_sanitised() -> None:
    assert plugin.group_name("rack", "FRA1-r01.b") == "rack_fra1_r01_b"
    assert plugin.group_name("deployment", "llama 3/70b") == "deployment_llama_3_70b"


def test_default_ssh_port_and_an_empty_no_ssh_group() -> None:
    found = plugin.build_inventory([_server("h1", ssh_port=None)], [])
    assert found.hostvars["h1"]["ansible_port"] == 22
    assert found.groups["no_ssh"] == []  # always there: the playbooks' `all:!no_ssh` names it


# ---------------------------------------------------------------------------------------------
# HTTP against a real service


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir = tmp_path_factory.mktemp("ansible-inventory")
    with serve(engine, data_dir, max_page_size=PAGE_CAP) as server:
        yield server


@pytest.fixture
def demo(live: Live, db: Engine) -> Live:
    operator = live.client(live.token(Role.OPERATOR, name="operator"))
    answer = operator.post(
        "/api/v1/inventory/import", content=DEMO_INVENTORY.read_bytes(), headers=YAML
    )
    assert answer.status_code == 200, answer.text
    return live


def _conn(live: Live, token: str, **kw: Any) -> Any:
    return plugin.Connection(url=live.url, token=token, **kw)


def test_fetch_reads_every_page(demo: Live) -> None:
    viewer = demo.token(Role.VIEWER, name="viewer")
    found = plugin.fetch(_conn(demo, viewer), page_size=100)  # the service caps it at 7
    with Session(demo.engine) as session:
        names = sorted(s.name for s in session.exec(select(Server)))
    assert len(names) > PAGE_CAP
    assert sorted(found.hostvars) == names
    assert all(group.isidentifier() for group in found.groups)
    assert any(group.startswith("site_") for group in found.groups)
    assert "state_enrolled" in found.groups


def test_deployment_groups_from_the_live_api(demo: Live) -> None:
    """The API must say which deployment a server serves (ServerPublic.deployment)."""
    with Session(demo.engine) as session:
        deployment = session.exec(select(Deployment)).first()
        server = session.exec(select(Server).order_by(Server.name)).first()
        assert deployment is not None and server is not None
        server.deployment_id = deployment.id
        session.add(server)
        session.commit()
        name, dep, budget = server.name, deployment.name, deployment.disruption_budget
    found = plugin.fetch(_conn(demo, demo.token(Role.VIEWER)))
    assert found.hostvars[name]["fleet_deployment"] == dep, (
        "GET /api/v1/servers does not say which deployment a server serves"
    )
    assert found.hostvars[name]["fleet_disruption_budget"] == budget
    assert name in found.groups[plugin.group_name("deployment", dep)]


def test_refused_token_is_one_line_without_the_token(demo: Live) -> None:
    token = "flt_" + "x" * 40
    with pytest.raises(plugin.FleetApiError) as caught:
        plugin.fetch(_conn(demo, token))
    message = str(caught.value)
    assert "refused the token (401" in message and "FLEET_TOKEN" in message
    assert token not in message and "\n" not in message


def test_unreachable_fleet() -> None:
    port = closed_port()
    conn = plugin.Connection(url=f"http://127.0.0.1:{port}", token="flt_secret", timeout_s=2)
    with pytest.raises(plugin.FleetApiError) as caught:
        plugin.fetch(conn)
    assert f"cannot reach the fleet at http://127.0.0.1:{port}" in str(caught.value)
    assert "flt_secret" not in str(caught.value)


def test_silent_fleet_times_out() -> None:
    """A peer that accepts and never answers: the timeout bounds the wait."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        try:
            conn, _ = listener.accept()
            accepted.append(conn)
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        conn = plugin.Connection(url=f"http://127.0.0.1:{port}", token="t", timeout_s=0.5)
        with pytest.raises(plugin.FleetApiError, match=r"no answer within 0\.5 s"):
            plugin.fetch(conn)
    finally:
        listener.close()
        thread.join(5)
        for sock in accepted:
            sock.close()


# ---------------------------------------------------------------------------------------------
# ansible-inventory with the plugin, as an operator runs it


def _ansible_inventory(
    inventory: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ANSIBLE_", "FLEET_"))
    }
    environ.update(env, ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"))
    environ["ANSIBLE_LOCAL_TEMP"] = str(inventory.parent / "tmp")
    environ["ANSIBLE_HOME"] = str(inventory.parent / "home")
    return subprocess.run(
        [str(VENV_BIN / "ansible-inventory"), "-i", str(inventory), *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=environ,
        cwd=inventory.parent,
    )


def _rack_name(session: Session, server: Server) -> str:
    rack = session.get(Rack, server.rack_id)
    assert rack is not None
    return rack.name


def test_ansible_inventory_graph(demo: Live, tmp_path: Path) -> None:
    inventory = tmp_path / "fleet.yml"
    shutil.copy(ANSIBLE / "inventory" / "fleet.yml", inventory)
    env = {"FLEET_URL": demo.url, "FLEET_TOKEN": demo.token(Role.VIEWER)}
    graph = _ansible_inventory(inventory, env, "--graph")
    assert graph.returncode == 0, graph.stderr
    with Session(demo.engine) as session:
        server = session.exec(select(Server).order_by(Server.name)).first()
        assert server is not None
        server_rack = _rack_name(session, server)
    assert "@site_" in graph.stdout and "@rack_" in graph.stdout and "@gpu_" in graph.stdout
    assert "@state_enrolled:" in graph.stdout and "@no_ssh:" in graph.stdout
    assert server.name in graph.stdout

    listed = _ansible_inventory(inventory, env, "--host", server.name)
    assert listed.returncode == 0, listed.stderr
    hostvars = json.loads(listed.stdout)
    assert hostvars["fleet_rack"] == server_rack
    assert hostvars["fleet_gpu_count"] == server.gpu_count
    assert not any("bmc_user" in key or "password" in key for key in hostvars)


def test_ansible_inventory_bad_token_fails_in_one_line(demo: Live, tmp_path: Path) -> None:
    inventory = tmp_path / "fleet.yml"
    inventory.write_text("plugin: fleet\n")
    token = "flt_" + "y" * 40
    result = _ansible_inventory(inventory, {"FLEET_URL": demo.url, "FLEET_TOKEN": token}, "--list")
    assert result.returncode != 0
    assert "fleet inventory: the fleet at" in result.stderr and "refused the token" in result.stderr
    assert token not in result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# The agent's systemd unit


def test_unit_verifies(tmp_path: Path) -> None:
    root = tmp_path / "opt"
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").symlink_to(sys.executable)
    template = (
        ANSIBLE / "roles" / "fleet_agent" / "templates" / "fleet-agent.service.j2"
    ).read_text()
    unit = jinja2.Template(template, undefined=jinja2.StrictUndefined).render(
        fleet_agent_server="fra1-r01-h100-01",
        fleet_agent_config_dir=str(tmp_path / "etc"),
        fleet_agent_state_dir=str(tmp_path / "state"),
        fleet_agent_log_dir=str(tmp_path / "log"),
        fleet_agent_root=str(root),
    )
    path = tmp_path / "fleet-agent.service"
    path.write_text(unit)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr  # unknown keys are only warned about
    for hardening in ("ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes"):
        assert hardening in unit
    # The agent reads Xids from /dev/kmsg and the GPUs from /dev/nvidia*.
    for blocker in ("ProtectKernelLogs=yes", "PrivateDevices=yes", "DevicePolicy=closed"):
        assert blocker not in unit
