"""The virtual colo end to end: a real `fleetctl serve` (embedded SQLite), real BMC EMULATORS
started by the lab (one sushy-emulator, one ipmi_sim per IPMI server) and real agents (`python
-m fleet_agent`, simulated GPUs) started when the fleet powers a server on through its BMC.

sushy applies a Reset 1-11 s late, so Redfish steps wait up to SETTLE_S. The lab itself runs
in-process (VirtualColo) for the main scenario, and as a `fleetctl lab up` child process for
the SIGKILL and `fleetctl lab down` cases. Every check that "nothing is left" scans /proc.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from factories import walk_to
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from typer.testing import CliRunner, Result

from fleet import cli, db
from fleet.cli.lab import lab_token_maker
from fleet.lab import LabError
from fleet.lab.colo import LAB_PASSWORD, VirtualColo
from fleet.lab.harness import FLEETCTL, ServeProcess
from fleet.lab.harness import wait_for as _wait_for
from fleet.lab.processes import ProcRef
from fleet.lab.state import load_state, recorded_processes
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Server

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

HEARTBEAT_S = 0.5
BOOT_DELAY_S = 0.5
SETTLE_S = 20.0  # sushy's 1-11 s, the boot delay, an agent's start on a busy machine
AGENT_ENV = {
    "FLEET_AGENT_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
    "FLEET_STANDIN_LOAD_S": "0.5",
    "FLEET_AGENT_BACKOFF_INITIAL_S": "0.2",
    "FLEET_AGENT_BACKOFF_MAX_S": "2",
    "FLEET_AGENT_REQUEST_TIMEOUT_S": "2",
}
KEPT_UUID = "5e7f1ee7-0000-4000-8000-00000000abcd"
IDLE_W, STANDBY_W = 1900.0, 90.0
# Once its agent answers, a server's modelled draw is its host part plus its 8 simulated GPUs'
# reported power (fleet/lab/colo.py): idle GPUs each within the H100's idle range, plus noise.
IDLE_SPREAD_W = 8 * (3.0 + 1.5)


# Redfish steps wait up to SETTLE_S unless told otherwise.
wait_for = partial(_wait_for, timeout=SETTLE_S)


def inventory(site: str, racks: dict[str, list[tuple[str, str]]]) -> str:
    """{rack: [(server, protocol)]} -> inventory YAML; BMC addresses are placeholders the lab
    rewrites. The first Redfish server keeps a valid system uuid; the others have none."""
    kept = False

    def server(u: int, name: str, protocol: str) -> dict[str, Any]:
        nonlocal kept
        bmc: dict[str, Any] = {"protocol": protocol, "address": "10.0.0.1", "port": 623}
        bmc |= {"username": "root", "password": "not-used-by-the-lab"}
        if protocol == "redfish" and not kept:
            bmc["system_id"], kept = KEPT_UUID, True
        return {
            "name": name,
            "u": u,
            "gpu": {"model": "H100", "count": 8},
            "power": {"idle_w": IDLE_W, "standby_w": STANDBY_W, "max_w": 10200},
            "bmc": bmc,
        }

    def feeds() -> list[dict[str, Any]]:
        return [
            {"name": f"{s.lower()}1", "side": s, "volts": 415, "amps": 63, "phase": "three"}
            for s in "AB"
        ]

    doc = {
        "sites": [
            {
                "name": site,
                "racks": [
                    {
                        "name": rack,
                        "feeds": feeds(),
                        "servers": [server(u, n, p) for u, (n, p) in enumerate(servers, 1)],
                    }
                    for rack, servers in racks.items()
                ],
            }
        ]
    }
    return yaml.safe_dump(doc, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# The fleet: `fleetctl serve` on its own embedded SQLite database


class Fleet(ServeProcess):
    """The service with its control loops off: the tests move the servers themselves."""

    def __init__(self, data_dir: Path) -> None:
        settings = {"FLEET_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "FLEET_RUN_LOOPS": "false"}
        super().__init__("serve", data_dir, settings)
        self.token = ""
        self.runner = CliRunner()

    def start_with_token(self) -> None:
        self.start(admin_token=True)
        self.token = self.admin_token()

    def fleetctl(self, *args: str) -> Result:
        env = {"FLEET_URL": self.url, "FLEET_TOKEN": self.token}
        return self.runner.invoke(cli.app, list(args), env=env)

    def ok(self, *args: str) -> str:
        result = self.fleetctl(*args)
        assert result.exit_code == 0, f"{args}: {result.stdout}{result.stderr}"
        return result.stdout

    def server(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.ok("servers", "show", name, "-o", "json"))
        return body

    def import_yaml(self, text: str) -> None:
        reply = httpx.post(
            f"{self.url}/api/v1/inventory/import",
            content=text.encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/yaml"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        fleet.start_with_token()
        yield fleet
    finally:
        fleet.stop()


# ---------------------------------------------------------------------------------------------
# What is left: /proc


def leftovers(workdir: Path, refs: list[ProcRef], dirs: list[str]) -> list[str]:
    """Live processes that are one of `refs`, run in `workdir` or name it (or one of `dirs`,
    the emulators' directories) on their command line."""
    marks = [str(workdir), *dirs]
    wanted = {(r.pid, r.start) for r in refs if r.pid != os.getpid()}  # an in-process lab
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        ref = ProcRef.of(pid)
        if ref is None or not ref.alive():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if (ref.pid, ref.start) in wanted or any(m in cmdline or cwd.startswith(m) for m in marks):
            found.append(f"{pid}: {cmdline.strip()} (in {cwd})")
    return found


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def lab_json(workdir: Path) -> dict[str, Any]:
    return load_state(workdir)


# ---------------------------------------------------------------------------------------------
# The main scenario, with the lab in this process


def test_power_on_through_the_fleet_boots_agents_that_register_and_report_faults(
    fleet: Fleet, tmp_path: Path
) -> None:
    rf, ipmi = (
        ["lab-rf-01", "lab-rf-02", "lab-rf-03"],
        ["lab-ipmi-01", "lab-ipmi-02", "lab-ipmi-03"],
    )
    text = inventory(
        "lab1",
        {
            "lab1-r01": [(rf[0], "redfish"), (ipmi[0], "ipmi"), (ipmi[1], "ipmi")],
            "lab1-r02": [(rf[1], "redfish"), (rf[2], "redfish"), (ipmi[2], "ipmi")],
        },
    )
    engine = db.make_engine(f"sqlite:///{fleet.data_dir / 'fleet.db'}")
    workdir = tmp_path / "lab"
    colo = VirtualColo(
        text,
        workdir,
        token_for=lab_token_maker(engine),
        fleet_url=fleet.url,
        boot_delay_s=BOOT_DELAY_S,
        agent_env=AGENT_ENV,
    )
    seen: list[ProcRef] = []
    dirs: list[str] = []
    try:
        with colo:
            assert colo.up_seconds is not None and colo.up_seconds < 15
            rewritten = colo.rewritten_inventory()
            bmcs = {
                s["name"]: s["bmc"] for r in rewritten["sites"][0]["racks"] for s in r["servers"]
            }
            sushy_port = bmcs[rf[0]]["port"]
            assert bmcs[rf[0]]["system_id"] == KEPT_UUID
            assert str(uuid.UUID(bmcs[rf[1]]["system_id"])) != KEPT_UUID
            assert {bmcs[n]["port"] for n in rf} == {sushy_port}  # one sushy for all
            assert len({bmcs[n]["port"] for n in ipmi}) == 3  # one ipmi_sim each
            assert all(b["password"] == LAB_PASSWORD for b in bmcs.values())
            fleet.import_yaml(colo.rewritten_yaml())

            assert {s.name: (s.power, s.agent_pid) for s in colo.status()} == {
                n: ("off", None) for n in rf + ipmi
            }
            assert colo.rack_power_w() == {"lab1-r01": 3 * STANDBY_W, "lab1-r02": 3 * STANDBY_W}
            with pytest.raises(LabError, match="powered off"):
                colo.inject(rf[0], {"kind": "xid", "xid": 79})
            state = lab_json(workdir)
            dirs = [s["chassis_dir"] for s in state["servers"].values() if s.get("chassis_dir")]
            seen += [ref for _, ref in recorded_processes(state)]

            # Power on through the fleet: agents start after the boot delay and register.
            a, b = rf[0], ipmi[0]
            fleet.ok("servers", "power", "on", a, b)
            for name in (a, b):
                wait_for(f"{name}'s agent to register", partial(_agent_version, fleet, name))
            assert fleet.server(a)["agent_registered_at"]
            pids = {n: colo.agent_pid(n) for n in (a, b)}
            seen += [ref for p in pids.values() if p and (ref := ProcRef.of(p))]

            rows = wait_for("lab status: both ready", lambda: _ready_rows(fleet, workdir, (a, b)))
            for name in (a, b):
                row = rows["servers"][name]
                assert (row["power"], row["agent_pid"]) == ("on", pids[name])
                assert abs(row["power_w"] - IDLE_W) <= IDLE_SPREAD_W
            assert (
                rows["servers"][rf[1]]["power"] == "off"
                and rows["servers"][rf[1]]["agent_pid"] is None
            )
            racks = {r["rack"]: r for r in rows["racks"]}
            assert abs(racks["lab1-r01"]["power_w"] - (2 * IDLE_W + STANDBY_W)) <= 2 * IDLE_SPREAD_W
            table = fleet.ok("lab", "status", "--dir", str(workdir))
            assert a in table and "BMC endpoint" in table and str(pids[a]) in table
            assert abs(colo.power_w(a) - IDLE_W) <= IDLE_SPREAD_W
            assert colo.power_w(rf[1]) == STANDBY_W

            # Assigned a deployment (provisioning's job; written to the database here): each
            # agent starts its stand-in engines (2 replicas of 4 GPUs) and is ready with them.
            assign(engine, "llama-8b", (a, b))
            for name in (a, b):
                replicas = wait_for(f"{name}'s engines ready", partial(_serving, fleet, name))
                assert [r["gpus"] for r in replicas] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            seen += [ref for _, ref in recorded_processes(lab_json(workdir))]

            # A fault through the lab reaches the fleet within a heartbeat (plus slack).
            out = fleet.ok("lab", "inject", a, "xid", "79", "--gpu", "3", "--dir", str(workdir))
            assert "injected xid 79 on GPU 3" in out
            # ... with the key the lab gave the agent (lab.json, 0600): without it, refused.
            agent_a = lab_json(workdir)["servers"][a]["agent"]
            assert (workdir / "lab.json").stat().st_mode & 0o777 == 0o600 and agent_a["key"]
            keyless = httpx.post(f"{agent_a['url']}/faults", json={"kind": "xid", "xid": 79})
            assert keyless.status_code == 401
            wait_for(
                "the fleet to see the fault",
                lambda: fleet.server(a)["health_verdict"] == "unhealthy",
                timeout=HEARTBEAT_S * 2 + 5,
            )
            bad = fleet.fleetctl("lab", "inject", a, "meteor", "--dir", str(workdir))
            assert bad.exit_code == 1 and "unknown fault kind" in bad.stderr
            off = fleet.fleetctl("lab", "inject", rf[2], "xid", "79", "--dir", str(workdir))
            assert off.exit_code == 1 and "powered off" in off.stderr
            assert len(off.stderr.strip().splitlines()) == 1

            # Powered on again while its boot is pending (behind Fleet's back): one boot.
            c = ipmi[1]
            colo.set_power_behind_our_back(c, True)
            colo.set_power_behind_our_back(c, True)
            wait_for(f"{c}'s agent", lambda: colo.agent_pid(c))
            assert (workdir / "servers" / c / "agent.log").read_text().count("boot done") == 1
            usage = colo.usage()
            assert usage.emulators.processes >= 4 and usage.agents.processes == 3
            assert usage.lab.rss_bytes > 0 and usage.agents.rss_bytes > 0

            # An IPMI power cycle: the old agent's group goes, a new agent boots.
            fleet.ok("servers", "power", "cycle", b)
            wait_for("the old agent of the cycled server to go", lambda: group_gone(pids[b] or 0))
            new = wait_for("a new agent after the cycle", lambda: colo.agent_pid(b))
            assert new != pids[b]
            seen += [ref for ref in [ProcRef.of(new)] if ref]

            # Power off through the fleet: the agents' process groups are gone.
            fleet.ok("servers", "power", "off", a, b)
            for pid in (pids[a], new):
                wait_for(f"agent group {pid} to stop", partial(group_gone, pid or 0))
            wait_for(
                "lab status: off",
                lambda: colo.agent_pid(a) is None and colo.power_w(a) == STANDBY_W,
            )
            seen += [ref for _, ref in recorded_processes(lab_json(workdir))]
    finally:
        colo.down()
        engine.dispose()
    colo.down()  # idempotent
    assert not (workdir / "lab.json").exists()
    with suppress(AssertionError):
        wait_for("nothing left", lambda: not leftovers(workdir, seen, dirs), timeout=5)
    assert not leftovers(workdir, seen, dirs)
    assert "agent on port" in (workdir / "servers" / rf[0] / "agent.log").read_text()


def assign(engine: Engine, deployment: str, servers: tuple[str, ...]) -> None:
    """What provisioning will do: a deployment, its servers moved to `loading`."""
    with Session(engine) as session:
        row = Deployment(
            name=deployment,
            model_uri="s3://models/llama-3.1-8b",
            model_checksum="sha256:1",
            engine_params={"backend": "pytorch", "tp_size": 4},
            gpus_per_replica=4,
            gpu_models=["H100"],
            max_replicas=4,
            sla_p95_latency_ms=2000,
            sla_ttft_ms=300,
        )
        session.add(row)
        session.commit()
        for name in servers:
            server = session.exec(select(Server).where(Server.name == name)).one()
            server.deployment_id = row.id
            session.add(server)
            session.commit()
            walk_to(session, server, ServerState.LOADING)


def _serving(fleet: Fleet, name: str) -> list[dict[str, Any]] | None:
    """The replicas the fleet last heard of, once the agent reports them all ready."""
    row = fleet.server(name)
    replicas: list[dict[str, Any]] = row["replicas"]
    if row["agent_ready"] and replicas and all(r["state"] == "ready" for r in replicas):
        return replicas
    return None


def _agent_version(fleet: Fleet, name: str) -> str | None:
    version: str | None = fleet.server(name)["agent_version"]
    return version


def _ready_rows(fleet: Fleet, workdir: Path, names: tuple[str, ...]) -> dict[str, Any] | None:
    body = json.loads(fleet.ok("lab", "status", "--dir", str(workdir), "-o", "json"))
    servers = {s["name"]: s for s in body["servers"]}
    if all(servers[n]["agent_ready"] for n in names):
        return {"servers": servers, "racks": body["racks"]}
    return None


# ---------------------------------------------------------------------------------------------
# `fleetctl lab up` as a child process: SIGKILLed, and stopped with `fleetctl lab down`


class LabProcess:
    """`fleetctl lab up` in its own session, on the fleet's database (for agent tokens)."""

    def __init__(self, fleet: Fleet, workdir: Path, text: str, *options: str) -> None:
        self.fleet = fleet
        self.workdir = workdir
        workdir.mkdir()
        path = workdir.parent / f"{workdir.name}-inventory.yaml"
        path.write_text(text)
        self.log = workdir.parent / f"{workdir.name}.log"
        env = fleet.env | {"FLEET_URL": fleet.url, "FLEET_TOKEN": fleet.token}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    *(str(FLEETCTL), "lab", "up", str(path), "--dir", str(workdir)),
                    *("--boot-delay", str(BOOT_DELAY_S), *options),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.state: dict[str, Any] = {}

    def wait_up(self) -> dict[str, Any]:
        def imported() -> bool:
            return "changed: created" in self.log.read_text()

        wait_for(f"the lab to import (log: {self.log})", imported, timeout=30)
        self.state = lab_json(self.workdir)
        return self.state

    def wait_agent(self, server: str) -> ProcRef:
        def agent() -> ProcRef | None:
            entry = lab_json(self.workdir)["servers"][server]["agent"]
            return ProcRef(entry["pid"], entry["start"]) if entry else None

        return wait_for(f"{server}'s agent in lab.json", agent)

    def kill_all(self) -> None:
        """Last resort in teardown: whatever the lab recorded, and the lab."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for _, ref in recorded_processes(self.state) if self.state else []:
            if ref.alive() and ref.pid != self.proc.pid:
                with suppress(ProcessLookupError):
                    os.killpg(ref.pid, signal.SIGKILL)


@pytest.fixture
def lab_process(fleet: Fleet, tmp_path: Path) -> Iterator[Callable[..., LabProcess]]:
    started: list[LabProcess] = []

    def start(site: str, *options: str) -> LabProcess:
        text = inventory(site, {f"{site}-r01": [(f"{site}-rf", "redfish"), (f"{site}-ip", "ipmi")]})
        lab = LabProcess(fleet, tmp_path / site, text, *options)
        started.append(lab)
        return lab

    yield start
    for lab in started:
        lab.kill_all()


def test_a_killed_lab_leaves_no_process_behind(
    fleet: Fleet, lab_process: Callable[..., LabProcess]
) -> None:
    lab = lab_process("crash")
    state = lab.wait_up()
    fleet.ok("servers", "power", "on", "crash-ip")
    agent = lab.wait_agent("crash-ip")
    refs = [ref for _, ref in recorded_processes(lab_json(lab.workdir))]
    assert agent in refs and len(refs) == 5  # lab, sentinel, sushy, ipmi_sim, agent
    dirs = [s["chassis_dir"] for s in state["servers"].values() if s.get("chassis_dir")]

    os.kill(lab.proc.pid, signal.SIGKILL)  # no down(), no atexit: PDEATHSIG and the sentinel
    lab.proc.wait(timeout=5)
    wait_for(
        "every process of the killed lab to go",
        lambda: not leftovers(lab.workdir, refs, dirs),
        timeout=10,
    )
    assert not any(Path(d).exists() for d in dirs)  # the emulators' directories too
    # `lab down` on a crashed lab: nothing to stop, and it says so.
    out = fleet.ok("lab", "down", "--dir", str(lab.workdir))
    assert "none of its 5 processes is left" in out


def test_lab_down_stops_the_lab_and_everything_it_started(
    fleet: Fleet, lab_process: Callable[..., LabProcess]
) -> None:
    lab = lab_process("down")
    state = lab.wait_up()
    fleet.ok("servers", "power", "on", "down-ip")
    lab.wait_agent("down-ip")
    refs = [ref for _, ref in recorded_processes(lab_json(lab.workdir))]
    dirs = [s["chassis_dir"] for s in state["servers"].values() if s.get("chassis_dir")]

    out = fleet.ok("lab", "down", "--dir", str(lab.workdir))
    assert "none of its 5 processes is left" in out
    assert lab.proc.wait(timeout=5) == 0
    assert "is down" in lab.log.read_text()
    assert not leftovers(lab.workdir, refs, dirs)
    gone = fleet.fleetctl("lab", "status", "--dir", str(lab.workdir))
    assert gone.exit_code == 1 and "no lab in" in gone.stderr


def test_lab_up_without_import_writes_the_inventory_for_the_operator(
    fleet: Fleet, lab_process: Callable[..., LabProcess]
) -> None:
    lab = lab_process("noimport", "--no-import")
    wait_for("the lab to write its inventory", lambda: "import it with" in lab.log.read_text())
    written = yaml.safe_load((lab.workdir / "inventory.yaml").read_text())
    assert oct((lab.workdir / "inventory.yaml").stat().st_mode & 0o777) == "0o600"
    bmcs = [s["bmc"] for s in written["sites"][0]["racks"][0]["servers"]]
    assert [b["protocol"] for b in bmcs] == ["redfish", "ipmi"]
    assert bmcs[0]["address"] == "http://127.0.0.1" and bmcs[0]["system_id"] == KEPT_UUID
    rows = json.loads(fleet.ok("lab", "status", "--dir", str(lab.workdir), "-o", "json"))
    assert [s["power"] for s in rows["servers"]] == ["off", "off"]
    lab.proc.send_signal(signal.SIGTERM)  # what Ctrl-C does too
    assert lab.proc.wait(timeout=20) == 0
    assert not (lab.workdir / "lab.json").exists()
