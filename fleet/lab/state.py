"""The lab-state file (`<workdir>/lab.json`) and what is read from it: by the lab itself and by
`fleetctl lab status|inject|down` in another process. It names the lab's processes (pid and start
time, so a reused pid never matches), its emulators and sentinel, and every server's BMC and
agent; mode 0600, since it holds the lab-only emulator password and each agent's local-API key.
In SSH mode (fleet/lab/ssh_hosts.py) a server's entry has an `ssh` block (address, port, host
key fingerprint, the running host's process) and its agent (installed by Ansible, not the lab's
child) is known by URL and key only.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet.lab import LabError
from fleet.lab.processes import ProcRef
from fleet.models import BmcProtocol

STATE_FILE = "lab.json"
STATE_VERSION = 1
READY_TIMEOUT_S = 0.5
BMC_READ_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """One server as the lab sees it now. `power` is what its EMULATOR reports ("on", "off",
    or "unknown" when it does not answer); `booting` means powered on, agent not started yet."""

    name: str
    rack: str
    protocol: str
    bmc: str
    power: str
    booting: bool
    agent_pid: int | None
    agent_url: str | None
    agent_ready: bool | None
    power_w: float
    error: str | None = None  # why no agent runs on a powered-on server (token, exit status)
    ssh: str | None = None  # SSH mode: the host's sshd, "127.0.0.1:port"


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    """Atomically, mode 0600 (it holds the lab's emulator password)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(state, out, indent=1)
    os.replace(tmp, path)


def load_state(workdir: Path | str) -> dict[str, Any]:
    """lab.json of a running lab in `workdir`; LabError when there is none."""
    path = Path(workdir) / STATE_FILE
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise LabError(
            f"no lab in {workdir} (no {path}): start one with `fleetctl lab up`"
        ) from None
    except ValueError:
        raise LabError(f"{path} is not a lab state file (not JSON)") from None
    if state.get("version") != STATE_VERSION:
        raise LabError(f"{path}: state file version {state.get('version')!r} not understood")
    return state


def lab_running(state: Mapping[str, Any]) -> bool:
    return _ref(state.get("lab")) is not None and _alive(state.get("lab"))


def recorded_processes(state: Mapping[str, Any]) -> list[tuple[str, ProcRef]]:
    """Every process lab.json names: the lab, its sentinel, emulators and agents."""
    found: list[tuple[str, ProcRef]] = []
    for what, value in (("lab", state.get("lab")), ("sentinel", state.get("sentinel"))):
        ref = _ref(value)
        if ref is not None:
            found.append((what, ref))
    for emulator in state.get("emulators", []):
        ref = _ref(emulator)
        if ref is not None:
            found.append((f"{emulator.get('kind')} {emulator.get('server', '')}".strip(), ref))
    for name, server in state.get("servers", {}).items():
        ref = _ref(server.get("agent"))
        if ref is not None:
            found.append((f"agent of {name}", ref))
        ssh = server.get("ssh")
        ref = _ref(ssh.get("host")) if isinstance(ssh, Mapping) else None
        if ref is not None:  # leads its group: unshare and the host's namespace
            found.append((f"host of {name}", ref))
    return found


def status_from_state(state: Mapping[str, Any]) -> list[ServerStatus]:
    """Live status of every server named in `state`: BMC reads and /readyz in parallel."""
    credentials = (str(state.get("username")), str(state.get("password")))
    servers = list(state.get("servers", {}).items())
    if not servers:
        return []
    with ThreadPoolExecutor(min(8, len(servers))) as pool:
        return list(pool.map(lambda item: _status_of(item[0], item[1], credentials), servers))


def _status_of(name: str, entry: Mapping[str, Any], credentials: tuple[str, str]) -> ServerStatus:
    agent = entry.get("agent")
    alive = agent is not None and _alive(agent)
    url = agent.get("url") if alive and agent else None
    ssh = entry.get("ssh")
    if isinstance(ssh, Mapping):  # the agent is the host's (Ansible's): up while the host is
        alive = False
        url = agent.get("url") if agent and _alive(ssh.get("host")) else None
    return ServerStatus(
        name=name,
        rack=str(entry.get("rack")),
        protocol=str(entry.get("protocol")),
        bmc=bmc_endpoint(entry),
        power=_emulator_power(entry, credentials),
        booting=bool(entry.get("booting")),
        agent_pid=int(agent["pid"]) if alive and agent else None,
        agent_url=url,
        agent_ready=_ready(url) if url else None,
        ssh=f"{ssh['address']}:{ssh['port']}" if isinstance(ssh, Mapping) else None,
        power_w=float(entry.get("power_w") or 0.0),
        error=entry.get("error"),
    )


def inject_fault(server: str, entry: Mapping[str, Any], fault: Mapping[str, Any]) -> dict[str, Any]:
    """POST one fault to the agent in `entry` (a server of lab.json); LabError if it cannot."""
    if not entry.get("on"):
        raise LabError(f"{server} is powered off: power it on first (no agent runs on it)")
    agent = entry.get("agent")
    if entry.get("booting") or agent is None:
        why = "still booting" if entry.get("booting") else entry.get("error") or "not started"
        raise LabError(f"{server}: its agent is not up ({why}); try again shortly")
    url = f"{agent['url']}/faults"
    headers = {"Content-Type": "application/json"}
    if agent.get("key"):  # /faults needs the agent's key (the lab gave it at start)
        headers["Authorization"] = f"Bearer {agent['key']}"
    request = urllib.request.Request(
        url, data=json.dumps(dict(fault)).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=BMC_READ_TIMEOUT_S) as resp:
            body: dict[str, Any] = json.loads(resp.read() or b"{}")
            return body
    except urllib.error.HTTPError as exc:
        raise LabError(f"{server}: the agent refused the fault: {_detail(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LabError(
            f"{server}: its agent at {agent['url']} does not answer ({reason})"
        ) from None


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return str(body.get("detail", body))
    except (ValueError, AttributeError, OSError):
        return f"HTTP {exc.code}"


def bmc_endpoint(entry: Mapping[str, Any]) -> str:
    if entry.get("protocol") == BmcProtocol.REDFISH.value:
        return f"{entry.get('url')}/redfish/v1/Systems/{entry.get('system_id')}"
    return f"ipmi://{entry.get('address')}:{entry.get('port')}"


def _emulator_power(entry: Mapping[str, Any], credentials: tuple[str, str]) -> str:
    """As the emulator says it: a Redfish GET of the system (which, like any read, lets sushy
    apply a pending change), or the ipmi_sim chassis_control program's power file."""
    if entry.get("protocol") == BmcProtocol.REDFISH.value:
        token = base64.b64encode(":".join(credentials).encode()).decode()
        request = urllib.request.Request(
            bmc_endpoint(entry),
            headers={"Authorization": f"Basic {token}", "Accept": "application/json"},
        )
        # Twice at most: one read can fail while the emulator is busy (seen once in CI right
        # after a fleet import had probed every system); one failure is not "unknown".
        for attempt in range(2):
            try:
                with urllib.request.urlopen(request, timeout=BMC_READ_TIMEOUT_S) as resp:
                    state = json.loads(resp.read()).get("PowerState")
                return {"On": "on", "Off": "off"}.get(str(state), "unknown")
            except (OSError, ValueError):
                if attempt:
                    return "unknown"
        return "unknown"
    directory = entry.get("chassis_dir")
    power = chassis_power(Path(directory)) if directory else None
    return "unknown" if power is None else "on" if power else "off"


def chassis_power(directory: Path | None) -> bool | None:
    if directory is None:
        return None
    try:
        text = (directory / "chassis.power").read_text().strip()
    except OSError:
        return None
    return {"1": True, "0": False}.get(text)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=READY_TIMEOUT_S) as resp:
            return int(resp.status) == 200
    except (OSError, ValueError):
        return False  # 503 (not ready) lands here too, as an HTTPError


def proc_record(pid: int) -> dict[str, int]:
    """`pid` as lab.json records a process (start -1: it has already exited)."""
    ref = ProcRef.of(pid)
    return asdict(ref) if ref is not None else {"pid": pid, "start": -1}


def _ref(value: Any) -> ProcRef | None:
    if isinstance(value, Mapping) and isinstance(value.get("pid"), int):
        return ProcRef(int(value["pid"]), int(value.get("start", -1)))
    return None


def _alive(value: Any) -> bool:
    ref = _ref(value)
    return ref is not None and ref.alive()
