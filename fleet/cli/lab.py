"""`fleetctl lab`: the virtual colo (fleet/lab/colo.py), real BMC emulators and simulated
servers, for demos and tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli.common import (
    DEFAULT_URL,
    Api,
    CliError,
    Out,
    Output,
    Token,
    api_client,
    database_engine,
    handled,
    printable,
    show,
    typer_app,
)
from fleet.cli.inventory import print_report, send_inventory

lab_app = typer_app("The virtual colo: real BMC emulators, simulated GPU servers (demo, tests).")
LabDir = Annotated[Path, typer.Option("--dir", "-d", help="The lab's working directory.")]
LAB_DIR = Path("lab")
LAB_STOP_TIMEOUT_S = 30.0
LAB_COLUMNS = [
    ("name", "server"),
    ("protocol", "protocol"),
    ("bmc", "BMC endpoint"),
    ("power", "power"),
    ("agent_pid", "agent pid"),
    ("agent_ready", "ready"),
    ("power_w", "W"),
]
LAB_RACK_COLUMNS = [("rack", "rack"), ("servers", "servers #"), ("on", "on #"), ("power_w", "W")]


def lab_token_maker(engine: Any) -> Callable[[str], str]:
    """Agent tokens made in-process on the fleet's database (the usual FLEET_* settings), the
    way `fleetctl token create` makes them: a token needs its server imported first, so the
    lab asks for one when a server first boots. `engine` None: connect on the first call."""
    import threading

    from fleet.auth import create_token
    from fleet.db import session_scope
    from fleet.models import Role

    lock = threading.Lock()
    engines = [engine] if engine is not None else []

    def make(server: str) -> str:
        with lock:
            if not engines:
                engines.append(database_engine())
            with session_scope(engines[0]) as session:
                return create_token(
                    session, f"lab-agent-{server}", Role.AGENT, server, actor="fleetctl:lab"
                )

    return make


def _running_lab(lab_dir: Path) -> dict[str, Any]:
    from fleet.lab.state import lab_running, load_state

    state = load_state(lab_dir)
    if not lab_running(state):
        raise CliError(
            f"the lab in {lab_dir} is not running (pid {state['lab']['pid']} is gone): "
            f"`fleetctl lab down --dir {lab_dir}` cleans up what it left"
        )
    return state


@lab_app.command("up")
@handled
def lab_up(
    inventory: Annotated[Path, typer.Argument(help="Inventory YAML file.")],
    lab_dir: LabDir = LAB_DIR,
    fleet_url: Annotated[
        str,
        typer.Option("--fleet-url", envvar="FLEET_URL", help="The fleet agents report to."),
    ] = DEFAULT_URL,
    token: Token = None,
    boot_delay: Annotated[
        float | None,
        typer.Option("--boot-delay", help="Seconds from power-on to agent start [20]."),
    ] = None,
    do_import: Annotated[
        bool,
        typer.Option("--import/--no-import", help="Import the rewritten inventory into the fleet."),
    ] = True,
    no_power_reading: Annotated[
        list[str] | None,
        typer.Option(
            "--no-power-reading",
            help="A server whose BMC gives no power reading (repeatable): the fleet shows its "
            "agent-based estimate.",
        ),
    ] = None,
    power_feed: Annotated[
        float | None,
        typer.Option("--power-feed", help="Seconds between BMC power readings updates [5]."),
    ] = None,
    ssh: Annotated[
        bool,
        typer.Option(
            "--ssh",
            help="Every server's OS is an sshd (root, the lab's key) with a stand-in systemd, "
            "for Ansible to install the agent: the lab starts no agent itself. Needs root.",
        ),
    ] = False,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="Run every deployment of the inventory on this engine's stand-in (trtllm, "
            "vllm, sglang), its replica shape kept in that engine's option names [as written].",
        ),
    ] = None,
) -> None:
    """Run the virtual colo in the foreground until Ctrl-C or SIGTERM.

    Starts a BMC emulator per server (one sushy-emulator for all Redfish servers, one ipmi_sim
    per IPMI server), writes the inventory rewritten to point at them to DIR/inventory.yaml
    (lab-only BMC credentials) and imports it (--token: operator or admin). A server powered on
    through its BMC starts its agent (simulated GPUs) after the boot delay; agent tokens are
    created on the fleet's database (FLEET_DATABASE_URL, or the embedded default).

    --ssh: a server powered on boots an SSH host instead (docs/lab.md): the inventory gets each
    server's `ssh` block (127.0.0.1, its port, its pinned host key), DIR/ansible holds the
    Ansible inventory (fleet.yml, host_vars/, known_hosts), and the fleet's key is
    DIR/ssh/id_ed25519 (`fleetctl lab ssh-key` prints it before the lab is up).

    Every agent has every engine's stand-in (docs/lab.md): each deployment runs on the engine
    it names, so a mixed inventory is a mixed fleet; --engine moves them all onto one."""
    import signal
    import threading

    import yaml

    from fleet.inventory.schema import parse_inventory
    from fleet.lab.colo import DEFAULT_BOOT_DELAY_S, POWER_FEED_S, VirtualColo
    from fleet.lab.engines import inventory_on_engine
    from fleet.lab.ssh_hosts import check_ssh_mode
    from fleet.lab.state import lab_running, load_state

    if engine is None:
        inv = parse_inventory(inventory.read_bytes())
    else:
        try:
            moved = inventory_on_engine(yaml.safe_load(inventory.read_bytes()) or {}, engine)
        except (ValueError, yaml.YAMLError) as exc:
            raise CliError(f"--engine {engine}: {exc}") from None
        inv = parse_inventory(yaml.safe_dump(moved, sort_keys=False))
    if ssh:
        check_ssh_mode()
    api = api_client(fleet_url, token) if do_import else None
    # Importing needs the fleet's database for agent tokens too (not in SSH mode: Ansible mints
    # them through the API): fail before starting anything.
    engine = database_engine() if do_import and not ssh else None
    lab_dir.mkdir(parents=True, exist_ok=True)
    if (lab_dir / "lab.json").exists() and lab_running(load_state(lab_dir)):
        raise CliError(
            f"a lab is already running in {lab_dir}: `fleetctl lab down --dir {lab_dir}`"
        )
    colo = VirtualColo(
        inv,
        lab_dir,
        token_for=lab_token_maker(engine),
        fleet_url=fleet_url,
        boot_delay_s=DEFAULT_BOOT_DELAY_S if boot_delay is None else boot_delay,
        no_power_reading=no_power_reading or (),
        power_feed_s=POWER_FEED_S if power_feed is None else power_feed,
        ssh=ssh,
    )
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in signals}
    try:
        colo.up()
        _lab_publish(colo, lab_dir, api)
        while not stop.wait(1.0):
            pass
    finally:
        colo.down()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo(f"lab in {lab_dir} is down")


def _lab_publish(colo: Any, lab_dir: Path, api: Api | None) -> None:
    """Write DIR/inventory.yaml (0600: it holds the lab's BMC password) and import it."""
    import os

    path = lab_dir / "inventory.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(colo.rewritten_yaml())
    servers = colo.state()["servers"].values()
    redfish = sum(1 for s in servers if s["protocol"] == "redfish")
    typer.echo(
        f"lab up in {colo.up_seconds:.1f} s: {len(colo.servers)} servers ({redfish} Redfish on "
        f"one sushy-emulator, {len(colo.servers) - redfish} ipmi_sim), state in "
        f"{lab_dir / 'lab.json'}; Ctrl-C or `fleetctl lab down --dir {lab_dir}` stops it"
    )
    if colo.ssh:
        _lab_ssh_publish(colo, lab_dir)
    if api is None:
        typer.echo(f"wrote {path}: import it with `fleetctl inventory import {path}`")
        return
    print_report(send_inventory(api, path, "import", False), path)


def _lab_ssh_publish(colo: Any, lab_dir: Path) -> None:
    """What an operator needs to deploy to the lab's SSH hosts."""
    directory = lab_dir / "ansible"
    inventory = colo.write_ansible_inventory(directory)
    ports = sorted(colo.ssh_host(name).port for name in colo.servers)
    key = colo.ssh_key_file
    typer.echo(
        f"SSH hosts: {len(ports)} sshd on 127.0.0.1 (ports {ports[0]}-{ports[-1]}) once powered "
        f"on; root logs in with {key}\n"
        f"  the fleet's key:     export FLEET_SSH_KEY_FILE={key}   (for `fleetctl serve`)\n"
        f"  Ansible inventory:   {inventory} (+ host_vars/), host keys in "
        f"{directory / 'known_hosts'}\n"
        f"  e.g. ansible-playbook -i {directory} --private-key {key} -u root "
        "ansible/playbooks/deploy.yml   (docs/ansible.md)"
    )


@lab_app.command("ssh-key")
@handled
def lab_ssh_key(lab_dir: LabDir = LAB_DIR) -> None:
    """Print the path of the lab's SSH client key (DIR/ssh/id_ed25519, made now if need be):
    `export FLEET_SSH_KEY_FILE=$(fleetctl lab ssh-key)` before `fleetctl serve`."""
    from fleet.lab.ssh_hosts import ensure_client_key

    typer.echo(str(ensure_client_key(lab_dir)))


@lab_app.command("status")
@handled
def lab_status(lab_dir: LabDir = LAB_DIR, output: Out = Output.TABLE) -> None:
    """Every server of the running lab: BMC, power as its emulator reports it, agent, draw."""
    import dataclasses

    from fleet.lab.state import status_from_state

    rows = [dataclasses.asdict(s) for s in status_from_state(_running_lab(lab_dir))]
    racks: dict[str, dict[str, Any]] = {}
    for row in rows:
        rack = racks.setdefault(row["rack"], {"rack": row["rack"], "servers": 0, "on": 0})
        rack["servers"] += 1
        rack["on"] += row["power"] == "on"
        rack["power_w"] = rack.get("power_w", 0.0) + row["power_w"]
    if output is Output.JSON:
        show({"servers": rows, "racks": list(racks.values())}, output)
        return
    for row in rows:
        row["power"] += " (booting)" if row["booting"] else ""
    ssh = any(row["ssh"] for row in rows)  # SSH mode: each host's sshd
    columns = [*LAB_COLUMNS[:3], ("ssh", "SSH"), *LAB_COLUMNS[3:]] if ssh else LAB_COLUMNS
    show(rows, output, columns)
    show(list(racks.values()), output, LAB_RACK_COLUMNS)
    for row in rows:
        if row["error"]:
            typer.echo(printable(f"note: {row['name']}: {row['error']}", one_line=True), err=True)


@lab_app.command("inject")
@handled
def lab_inject(
    server: Annotated[str, typer.Argument(help="The server (its agent must be up).")],
    kind: Annotated[str, typer.Argument(help="xid, ecc_uncorrected, gpu_lost, clear, ...")],
    xid: Annotated[int | None, typer.Argument(help="The Xid number (kind xid).")] = None,
    gpu: Annotated[int | None, typer.Option("--gpu", help="GPU index [0; clear: all].")] = None,
    count: Annotated[int | None, typer.Option("--count", help="Errors/events [1].")] = None,
    lab_dir: LabDir = LAB_DIR,
) -> None:
    """Inject a fault into a server's simulated GPUs (through its agent's /faults)."""
    from fleet.lab.state import inject_fault
    from fleet_core.telemetry import FAULT_KINDS

    if kind not in FAULT_KINDS:
        raise CliError(f"unknown fault kind {kind!r}: one of {', '.join(FAULT_KINDS)}")
    fault: dict[str, Any] = {"kind": kind}
    for key, value in (("xid", xid), ("gpu", gpu), ("count", count)):
        if value is not None:
            fault[key] = value
    entry = _running_lab(lab_dir)["servers"].get(server)
    if entry is None:
        raise CliError(f"no server named {server!r} in the lab in {lab_dir}")
    inject_fault(server, entry, fault)
    where = f" on GPU {gpu}" if gpu is not None else ""
    typer.echo(f"{server}: injected {kind}{f' {xid}' if xid is not None else ''}{where}")


@lab_app.command("down")
@handled
def lab_down(lab_dir: LabDir = LAB_DIR) -> None:
    """Stop the lab in DIR (SIGTERM, bounded wait), then check that none of the processes its
    state file names is left; stragglers of a crashed lab are killed."""
    import contextlib
    import os
    import signal

    from fleet.lab.state import load_state, recorded_processes

    state = load_state(lab_dir)
    processes = recorded_processes(state)
    lab = next((ref for what, ref in processes if what == "lab"), None)
    if lab is not None and lab.alive():
        os.kill(lab.pid, signal.SIGTERM)
        if not _wait_gone([lab], LAB_STOP_TIMEOUT_S):
            os.kill(lab.pid, signal.SIGKILL)  # its sentinel and PDEATHSIG clean up after it
    refs = [ref for _, ref in processes]
    if not _wait_gone(refs, 10.0):
        for what, ref in processes:  # a crashed lab's leftovers: each leads its own group
            if ref.alive() and what != "lab":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(ref.pid, signal.SIGKILL)
        _wait_gone(refs, 5.0)
    left = [f"{what} (pid {ref.pid})" for what, ref in processes if ref.alive()]
    if left:
        raise CliError(f"still running after lab down: {', '.join(left)}")
    (lab_dir / "lab.json").unlink(missing_ok=True)
    typer.echo(f"lab in {lab_dir} stopped: none of its {len(processes)} processes is left")


def _wait_gone(refs: Sequence[Any], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while any(ref.alive() for ref in refs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True
