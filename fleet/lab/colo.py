"""The virtual colo: simulated GPU servers behind REAL BMC emulators, for the demo and e2e tests.

What is fake here is only the hardware. Each server of an inventory gets a real BMC emulator
(one sushy-emulator holding every Redfish server, one ipmi_sim per IPMI server, all on
127.0.0.1); Fleet drives them with its production drivers. The lab watches the emulators' power
buttons and plays the server behind them: when a server powers on, its node AGENT (the real
`python -m fleet_agent`, with the simulated GPU telemetry backend) starts after a boot delay in its
own process group and working directory; when it powers off, that process group is stopped.

    colo = VirtualColo(parse_inventory(text), "lab", fleet_url=url, token_for=make_agent_token)
    with colo:                                  # up(): emulators, notifier, watcher, controller
        yaml_text = colo.rewritten_yaml()       # the inventory, BMCs pointing at the emulators
        colo.status(); colo.inject("fra1-r01-h100-01", {"kind": "xid", "xid": 79, "gpu": 3})

How power changes are learnt:
- Redfish: every system has `external_notifier=True`, so sushy PUTs the system's JSON to a tiny
  receiver (fleet/lab/notices.py) when a Reset is *requested* (`pending_power` with
  `apply_time`) and when it is applied (a new `power_state`). sushy applies a change only on the
  first read after its apply time, so the lab reads the system at that time: the real hardware
  would act then too.
- IPMI: the chassis_control program of each ipmi_sim writes `chassis.power` and appends to
  `chassis.log`; one watcher thread polls their stat() every `watch_interval_s` for all sims.
- Both: a bounded reconcile reads the emulators' truth every `reconcile_interval_s`.

What the BMCs read as the servers' draw (the modelled draw): every `power_feed_s` a feeder thread
sets each emulated BMC's power reading (sushy: the lab's Power extension, fleet/lab/
sushy_power.py; ipmi_sim: its whole-system power sensor) to what the server would draw: off, its
standby_w; on, its host part (idle_w less its GPUs' idle draw, fleet_core/gpus.py) plus the sum
of its GPUs' power as its agent reports it (`agent_gpu_power_watts` on the agent's /metrics,
from the simulated telemetry, which follows the engines' work); on with no agent answer yet
(booting), its idle_w. A power change sets the new figure at once. Servers named in
`no_power_reading` get no reading at all (a BMC without power telemetry): the fleet must fall
back to the agent-based estimate for them.

Every change goes through ONE controller thread (power state, boot timers, agent processes), so
there are no races between a notice, a boot timer and a power-off. Agents are started from that
long-lived thread on purpose: PR_SET_PDEATHSIG fires when the *thread* that forked the child
exits, not only the process.

Cleanup when the lab process dies without running `down()` (SIGKILL, a crash): the agents die
with it (PR_SET_PDEATHSIG) and a sentinel process stops every process group it registered
(fleet/lab/processes.py). `workdir/lab.json` is written and read by fleet/lab/state.py.

SSH mode (`ssh=True`, `fleetctl lab up --ssh`): a powered-on server boots an SSH HOST instead
of the lab's agent (fleet/lab/ssh_hosts.py: its own mount + PID namespace, sshd on 127.0.0.1,
the STAND-IN systemd of fleet/lab/standin_systemd.py), so Ansible installs the agent as an
operator would. The host is one process group (unshare and the namespace's init) handled like an
agent's: started by the controller thread with PDEATHSIG, watched by the sentinel; a power-off
SIGKILLs it (a power cut: the namespace dies with its init), a reboot or `down()` SIGTERMs it
first (its init stops sshd and the units). `systemctl reboot` on a host leaves a request file
that the controller picks up every `watch_interval_s`: the host goes down and boots again after
the boot delay, the BMC on. The lab still models the draw from the agent's /metrics (at the port
it gives the agent in Ansible's host_vars, `write_ansible_inventory`) and `inject` still reaches
it with the lab's key, which host_vars hand to the agent.
"""

from __future__ import annotations

import atexit
import functools
import heapq
import itertools
import logging
import math
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid as uuid_mod
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet.inventory.schema import InventoryFile, ServerIn, parse_inventory
from fleet.lab import LabError
from fleet.lab.engines import standin_commands
from fleet.lab.ipmi_sim import IpmiSim
from fleet.lab.notices import NoticeServer
from fleet.lab.processes import (
    HOST,
    ProcRef,
    Sentinel,
    Usage,
    child_exited,
    die_with_parent,
    distinct_free_block,
    signal_group,
    usage_of,
)
from fleet.lab.ssh_hosts import (
    AUTHORIZED_KEYS,
    CLIENT_KEY,
    SshHost,
    check_ssh_mode,
    check_sshd_config,
    ensure_client_key,
)
from fleet.lab.state import (
    STATE_FILE,
    STATE_VERSION,
    ServerStatus,
    bmc_endpoint,
    chassis_power,
    inject_fault,
    proc_record,
    status_from_state,
    write_state,
)
from fleet.lab.sushy import FakeSystem, SushyEmulator
from fleet.models import BmcProtocol
from fleet_core.gpus import gpu_spec

log = logging.getLogger(__name__)

# LAB-ONLY credentials for the emulators the lab starts (never for real hardware). ipmi_sim
# takes passwords of at most 19 characters.
LAB_USERNAME = "admin"
LAB_PASSWORD = "lab-bmc-password"
# Real GPU servers take 10-15 minutes from power-on to OS ready (docs/hardware.md). The lab's
# default is 20 s: long enough that "booting" is visible in a demo and Fleet's boot handling is
# exercised, short enough to watch. Tests pass well under a second.
DEFAULT_BOOT_DELAY_S = 20.0
WATCH_INTERVAL_S = 0.2
RECONCILE_INTERVAL_S = 30.0
STOP_GRACE_S = 3.0
APPLY_MARGIN_S = 0.25  # sushy applies at int(apply_time) <= time.time(): read a little later
IPMI_START_WORKERS = 12
AGENT_POLL_S = 1.0  # how often the controller looks for agents that exited on their own
POWER_FEED_S = 5.0  # how often the BMCs' power readings follow the modelled draw
# Each server's weights cache (fleet_agent/weights/): servers/<name>/weights, kept across power
# cycles as a server's local disk is (a pre-staged spare keeps its weights), and this budget
# unless `cache_bytes` says otherwise: the lab's servers share one real disk.
LAB_CACHE_BYTES = 4 << 30
CACHE_DIR_NAME = "weights"
AGENT_METRICS_TIMEOUT_S = 1.0  # one agent's /metrics; a slower agent counts as booting
POWER_FEED_WORKERS = 16  # agents' /metrics read at once
# ipmi_sim's power sensor is one byte times a step: its range is max_w times this (a server
# past its nameplate stays visible), so the step is max_w * 1.25 / 255 (50 W for a DGX H100).
IPMI_POWER_RANGE = 1.25
IPMI_POWER_MAX_W = 255.0 * 1023  # the widest one IPMI sensor can show (M is 10 bits)
GPU_POWER_METRIC = "agent_gpu_power_watts"
# SSH mode: a host boots again only once its former life is gone (port free), checked this often,
# at most this many times (then it boots anyway, and says what went wrong if sshd cannot bind).
HOST_WAIT_S = 0.1
HOST_WAIT_ROUNDS = 100


# ---------------------------------------------------------------------------------------------
# One simulated server


@dataclass(eq=False)
class _Node:
    name: str
    rack: str
    spec: ServerIn
    workdir: Path
    system_id: str | None = None  # Redfish: the sushy system's uuid
    sim: IpmiSim | None = None  # IPMI: its own emulator
    on: bool = False  # what the lab believes the hardware is (the emulator's last word)
    generation: int = 0  # bumped by every power change: a stale boot timer does nothing
    boot_at: float | None = None  # monotonic time the agent starts; None when not booting
    agent: subprocess.Popen[bytes] | None = None
    agent_ref: ProcRef | None = None
    agent_url: str | None = None
    token: str | None = None
    # The agent's local-API key (FLEET_AGENT_API_KEY): the lab knows it to inject faults; the
    # fleet learns it from the agent's registration. One per server for the lab's life.
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    error: str | None = None
    bmc_power_reading: bool = True  # False: the BMC has no power reading (no_power_reading)
    drawn: tuple[int, float] | None = None  # (generation, watts) last modelled while on
    published_w: float | None = None  # what the BMC reads now (None: no reading)
    # A figure the BMC reads instead of the model (tests of a BMC gone wrong): (watts,) or None.
    override: tuple[float | None] | None = None
    # SSH mode: the server's OS (fleet/lab/ssh_hosts.py), its running namespace, and the ports
    # Ansible's host_vars give its agent (fixed for the lab's life).
    host: SshHost | None = None
    host_proc: subprocess.Popen[bytes] | None = None
    host_ref: ProcRef | None = None
    agent_port: int = 0
    engine_base_port: int = 0
    # Every port the lab handed this server (sshd, agent, engines): no other server gets them.
    ports: set[int] = field(default_factory=set)
    # The running agent's environment (its ports among it): a restart (restart_agent) starts
    # the same agent again, as systemd's Restart= would, so it finds its engines where they are.
    agent_env: dict[str, str] | None = None

    @property
    def redfish(self) -> bool:
        return self.spec.bmc.protocol is BmcProtocol.REDFISH

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())  # stable per server: same GPUs every boot

    @property
    def gpu_idle_w(self) -> float:
        """One GPU's idle draw (the middle of its observed range); 0 for a model the fleet does
        not know (then the whole idle_w counts as host)."""
        try:
            return gpu_spec(self.spec.gpu.model).idle_mid_w
        except ValueError:
            return 0.0

    @property
    def power_w(self) -> float:
        """The modelled draw now: standby_w when off; while on, the figure the feeder last
        modelled for this boot, else idle_w."""
        if not self.on:
            return float(self.spec.power.standby_w)
        if self.drawn is not None and self.drawn[0] == self.generation:
            return self.drawn[1]
        return float(self.spec.power.idle_w)


@dataclass(order=True)
class _Timer:
    due: float
    seq: int
    action: Callable[[], None] = field(compare=False)


@dataclass
class _Stopping:
    proc: subprocess.Popen[bytes]
    kill_at: float
    killed: bool = False
    node: str | None = None  # an SSH host's server: it boots again only once this is gone


# ---------------------------------------------------------------------------------------------
# The virtual colo


def _servers_of(inventory: InventoryFile) -> Iterator[tuple[str, ServerIn]]:
    for site in inventory.sites:
        for rack in site.racks:
            for server in rack.servers:
                yield rack.name, server
    for racked in inventory.servers:
        yield racked.rack, racked


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:`port` (bound with SO_REUSEADDR, as sshd binds)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _valid_uuid(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return str(uuid_mod.UUID(value))
    except ValueError:
        return None


def modelled_draw_w(
    *,
    on: bool,
    standby_w: float,
    idle_w: float,
    gpu_count: int,
    gpu_idle_w: float,
    gpu_power_w: float | None,
) -> float:
    """What a lab server draws: off, its standby; on with its agent's summed GPU power, the
    host part (idle_w less its GPUs' idle draw, never below 0) plus that GPU power; on without
    one (booting, or the agent does not answer), its idle_w."""
    if not on:
        return float(standby_w)
    if gpu_power_w is None:
        return float(idle_w)
    host_w = max(0.0, float(idle_w) - gpu_count * float(gpu_idle_w))
    return host_w + float(gpu_power_w)


def gpu_power_from_metrics(text: str) -> float | None:
    """The sum of `agent_gpu_power_watts` over an agent's GPUs, from its /metrics text; None
    when it reports none (no snapshot yet, or every GPU lost)."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        if family.name != GPU_POWER_METRIC:
            continue
        for sample in family.samples:
            if sample.name == GPU_POWER_METRIC and math.isfinite(sample.value):
                total += sample.value
                seen = True
    return total if seen else None


def _agent_gpu_power_w(url: str, timeout: float) -> float | None:
    """An agent's summed GPU power from its open /metrics; None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
            text = resp.read(4 << 20).decode(errors="replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    try:
        return gpu_power_from_metrics(text)
    except ValueError:  # not the exposition format
        return None


class VirtualColo:
    """Real BMC emulators for every server of `inventory`, and an agent per powered-on server.

    `token_for(server)` returns an agent token for that server (called when its first boot
    completes, so the server may be imported into the fleet after `up()`); `agent_env` is added
    to every agent's environment (e.g. the stand-in engine's command). Files: `workdir/lab.json`
    (the state other `fleetctl lab` commands read) and `workdir/servers/<name>/` (agent.log,
    faults.json). `up()` / `down()` or a `with` block; `down()` is idempotent and also runs at
    interpreter exit.

    `power_feed_s` is how often the BMCs' power readings follow the modelled draw (module doc);
    `no_power_reading` names servers whose BMC gives no power reading at all. `cache_bytes`:
    the budget of every server's weights cache (one figure, or per server name, the others
    LAB_CACHE_BYTES); the cache lives in `workdir/servers/<name>/weights` and survives power
    cycles. s3:// weights: the lab's own FLEET_AGENT_S3_* settings reach every agent. `ssh`:
    SSH mode (module doc; root only): `token_for` is then never called, Ansible mints the
    agents' tokens.
    """

    def __init__(
        self,
        inventory: InventoryFile | str | bytes,
        workdir: Path | str,
        *,
        token_for: Callable[[str], str],
        fleet_url: str = "http://127.0.0.1:8080",
        boot_delay_s: float = DEFAULT_BOOT_DELAY_S,
        agent_env: Mapping[str, str] | None = None,
        stop_grace_s: float = STOP_GRACE_S,
        watch_interval_s: float = WATCH_INTERVAL_S,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
        state_file: Path | str | None = STATE_FILE,
        power_feed_s: float = POWER_FEED_S,
        no_power_reading: Iterable[str] = (),
        ssh: bool = False,
        cache_bytes: int | Mapping[str, int] = LAB_CACHE_BYTES,
    ) -> None:
        if not isinstance(inventory, InventoryFile):
            inventory = parse_inventory(inventory)
        if boot_delay_s < 0 or stop_grace_s < 0 or watch_interval_s <= 0:
            raise ValueError("boot_delay_s and stop_grace_s must be >= 0, watch_interval_s > 0")
        if not (math.isfinite(power_feed_s) and power_feed_s > 0):
            raise ValueError("power_feed_s must be > 0")
        self.inventory = inventory
        self.workdir = Path(workdir).resolve()
        self.ssh = ssh
        self.fleet_url = fleet_url
        self.boot_delay_s = boot_delay_s
        self.agent_env = dict(agent_env or {})
        self.stop_grace_s = stop_grace_s
        self.watch_interval_s = watch_interval_s
        self.reconcile_interval_s = reconcile_interval_s
        self.state_path = None if state_file is None else self.workdir / state_file
        self.up_seconds: float | None = None
        self._token_for = token_for
        self._nodes = self._plan(inventory)
        self.power_feed_s = power_feed_s
        unknown = sorted(set(no_power_reading) - set(self._nodes))
        if unknown:
            raise ValueError(f"no_power_reading names servers not in the inventory: {unknown}")
        for name in no_power_reading:
            self._nodes[name].bmc_power_reading = False
        budgets = cache_bytes if isinstance(cache_bytes, Mapping) else {}
        unknown = sorted(set(budgets) - set(self._nodes))
        if unknown:
            raise ValueError(f"cache_bytes names servers not in the inventory: {unknown}")
        default = LAB_CACHE_BYTES if isinstance(cache_bytes, Mapping) else cache_bytes
        if any(b < 0 for b in (default, *budgets.values())):
            raise ValueError("cache_bytes must be >= 0")
        self._cache_bytes = {name: budgets.get(name, default) for name in self._nodes}
        self._by_uuid = {n.system_id: n for n in self._nodes.values() if n.system_id}
        self._sushy: SushyEmulator | None = None
        self._notices: NoticeServer | None = None
        self._sentinel: Sentinel | None = None
        self._emulators: list[dict[str, Any]] = []  # kind, pid, start (+ url or server)
        self._emulators_lock = threading.Lock()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._stopping: list[_Stopping] = []
        self._controller: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._feeder: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._closing = False
        self._state_lock = threading.Lock()  # the nodes' fields: controller writes, others read
        self._write_lock = threading.Lock()  # lab.json: one writer at a time
        self._life_lock = threading.Lock()
        self._started = False
        self._down = False

    def _plan(self, inventory: InventoryFile) -> dict[str, _Node]:
        nodes: dict[str, _Node] = {}
        used: set[str] = set()
        for rack, spec in _servers_of(inventory):
            if spec.name in nodes:
                raise ValueError(f"server {spec.name!r} is listed twice in the inventory")
            node = _Node(spec.name, rack, spec, self.workdir / "servers" / spec.name)
            if node.redfish:
                # Keep the inventory's system id where it can be a sushy uuid; else a new one,
                # which rewritten_inventory() and lab.json record.
                system_id = _valid_uuid(spec.bmc.system_id)
                if system_id is None or system_id in used:
                    system_id = str(uuid_mod.uuid4())
                used.add(system_id)
                node.system_id = system_id
            nodes[spec.name] = node
        return nodes

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> VirtualColo:
        return self.up()

    def __exit__(self, *_: object) -> None:
        self.down()

    def up(self) -> VirtualColo:
        """Start the emulators (concurrently), the notice receiver, the watcher and the
        controller. Every server starts powered off. On failure everything started is stopped."""
        with self._life_lock:
            if self._started:
                raise RuntimeError("the lab is already up (a VirtualColo starts once)")
            self._started = True
        began = time.monotonic()
        atexit.register(self.down)
        try:
            for node in self._nodes.values():
                node.workdir.mkdir(parents=True, exist_ok=True)
            if self.ssh:
                self._prepare_hosts()
            self._sentinel = Sentinel(self.stop_grace_s)
            self._start_emulators()
            self._controller = threading.Thread(
                target=self._run_controller, name="lab-controller", daemon=True
            )
            self._controller.start()
            if any(not n.redfish for n in self._nodes.values()):
                self._watcher = threading.Thread(
                    target=self._watch_chassis, name="lab-ipmi-watcher", daemon=True
                )
                self._watcher.start()
            self._feeder = threading.Thread(
                target=self._feed_power, name="lab-power-feeder", daemon=True
            )
            self._feeder.start()
        except BaseException:
            self.down()
            raise
        self.up_seconds = time.monotonic() - began
        self._write_state()
        log.info("lab up: %d servers in %.1f s", len(self._nodes), self.up_seconds)
        return self

    def _prepare_hosts(self) -> None:
        """SSH mode: the client key, and every server's host (keys, sshd config, shims) with
        its sshd port and its agent's ports, distinct and fixed for the lab's life."""
        check_ssh_mode()
        ensure_client_key(self.workdir)
        for node in self._nodes.values():
            node.host = SshHost(
                node.name,
                self.workdir / "hosts" / node.name,
                self._claim_ports(node, 1),
                self.workdir / AUTHORIZED_KEYS,
                self.stop_grace_s,
            )
            node.host.prepare()
            node.agent_port = self._claim_ports(node, 1)
            node.engine_base_port = self._claim_ports(node, max(node.spec.gpu.count, 1))
        first = next(iter(self._nodes.values()), None)
        if first is not None and first.host is not None:
            check_sshd_config(first.host)  # every host's config is alike: one check

    def _start_emulators(self) -> None:
        redfish = [n for n in self._nodes.values() if n.redfish]
        ipmi = [n for n in self._nodes.values() if not n.redfish]
        if redfish:
            self._notices = NoticeServer(self._on_notice)
            threading.Thread(
                target=self._notices.serve_forever,
                kwargs={"poll_interval": 0.5},  # only shutdown() waits on it
                name="lab-notices",
                daemon=True,
            ).start()
            systems = [
                FakeSystem(uuid=n.system_id or "", name=n.name, external_notifier=True)
                for n in redfish
            ]
            self._sushy = SushyEmulator(
                systems,
                username=LAB_USERNAME,
                password=LAB_PASSWORD,
                notification_url=self._notices.url,
                start_timeout=30.0,
            )
        for node in ipmi:
            node.sim = IpmiSim(
                LAB_PASSWORD,
                username=LAB_USERNAME,
                ready_timeout=30.0,
                power_max_w=min(float(node.spec.power.max_w) * IPMI_POWER_RANGE, IPMI_POWER_MAX_W),
            )
        with self._state_lock:  # every server starts off: its BMC reads its standby draw
            for node in self._nodes.values():
                self._publish_power(node, None)
        # ipmi_sim takes about a second to answer; sushy about as long: all at once.
        workers = max(1, min(IPMI_START_WORKERS, len(ipmi) + 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="lab-start") as pool:
            futures = [pool.submit(self._start_sushy)] if self._sushy else []
            futures += [pool.submit(self._start_sim, node) for node in ipmi]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if isinstance(first, RuntimeError):  # IpmiSimError, SushyEmulatorError: say so plainly
            raise LabError(f"a BMC emulator did not start: {first}") from first
        if first is not None:
            raise first

    def _start_sushy(self) -> None:
        sushy = self._sushy
        assert sushy is not None
        sushy.start()
        self._started_emulator(sushy.pid, sushy.workdir, kind="sushy", url=sushy.url)

    def _start_sim(self, node: _Node) -> None:
        sim = node.sim
        assert sim is not None
        sim.start()
        self._started_emulator(sim.pid, sim.dir, kind="ipmi_sim", server=node.name)

    def _started_emulator(self, pid: int | None, directory: Path | None, **about: str) -> None:
        if pid is None:
            return
        if self._sentinel is not None:
            self._sentinel.watch(pid, directory)
        with self._emulators_lock:
            self._emulators.append({**about, **proc_record(pid)})

    def down(self) -> None:
        """Stop agents (their process groups), emulators, receiver, watcher; idempotent."""
        with self._life_lock:
            if self._down or not self._started:
                self._down = True
                return
            self._down = True
        atexit.unregister(self.down)
        self._watch_stop.set()
        controller = self._controller
        if controller is not None and controller.is_alive():
            # The agents' forking thread stops them, so PDEATHSIG does not SIGKILL them first.
            self._commands.put(self._shutdown)
            controller.join(self.stop_grace_s + 15)
        if controller is None or controller.is_alive():
            self._shutdown()
        if self._watcher is not None:
            self._watcher.join(5)
        if self._feeder is not None:
            self._feeder.join(AGENT_METRICS_TIMEOUT_S + 5)
        self._stop_emulators()
        if self._notices is not None:
            self._notices.shutdown()
            self._notices.server_close()
        if self._sentinel is not None:
            self._sentinel.close(self.stop_grace_s + 5)
        if self.state_path is not None:
            with self._write_lock:
                self.state_path.unlink(missing_ok=True)
        log.info("lab down")

    def _shutdown(self) -> None:
        self._closing = True
        with self._state_lock:
            for node in self._nodes.values():
                node.boot_at = None
                self._stop_agent(node)
                self._stop_host(node, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s + 5
        while self._stopping and time.monotonic() < deadline:
            self._reap_stopping()
            time.sleep(0.02)

    def _stop_emulators(self) -> None:
        stoppers: list[Callable[[], None]] = [n.sim.stop for n in self._nodes.values() if n.sim]
        if self._sushy is not None:
            stoppers.append(self._sushy.stop)
        if not stoppers:
            return
        with ThreadPoolExecutor(min(IPMI_START_WORKERS, len(stoppers))) as pool:
            for future in [pool.submit(stop) for stop in stoppers]:
                if future.exception() is not None:
                    log.warning("stopping an emulator: %s", future.exception())
        if self._sentinel is not None:  # stopped and reaped: their pgids may be reused
            for pid in self._emulator_pids():
                self._sentinel.forget(pid)

    def _emulator_pids(self) -> set[int]:
        with self._emulators_lock:
            return {int(e["pid"]) for e in self._emulators}

    # -- the controller: the only writer of power state, boot timers and agents -----------------

    def _run_controller(self) -> None:
        next_reconcile = time.monotonic() + self.reconcile_interval_s
        next_poll = time.monotonic() + AGENT_POLL_S
        next_reboots = time.monotonic() + self.watch_interval_s if self.ssh else math.inf
        while not self._closing:
            now = time.monotonic()
            wake = min(next_reconcile, next_poll, next_reboots)
            if self._timers:
                wake = min(wake, self._timers[0].due)
            if self._stopping:
                wake = min(wake, now + 0.05)
            try:
                command: Callable[[], None] | None = self._commands.get(
                    timeout=max(0.0, wake - now)
                )
            except queue.Empty:
                command = None
            if command is not None:
                self._safely(command)
            now = time.monotonic()
            while self._timers and self._timers[0].due <= now and not self._closing:
                self._safely(heapq.heappop(self._timers).action)
            if self._stopping:
                self._safely(self._reap_stopping)
            if now >= next_poll:
                self._safely(self._poll_agents)
                next_poll = now + AGENT_POLL_S
            if now >= next_reboots and not self._closing:
                self._safely(self._poll_reboots)
                next_reboots = now + self.watch_interval_s
            if now >= next_reconcile and not self._closing:
                self._safely(self._reconcile)
                next_reconcile = time.monotonic() + self.reconcile_interval_s

    def _safely(self, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            log.exception("lab controller: %s failed", getattr(action, "__name__", action))

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, _Timer(time.monotonic() + delay, next(self._seq), action))

    def _set_power(self, node: _Node, on: bool) -> None:
        if on == node.on:
            return  # a power-on while booting (or running) changes nothing
        with self._state_lock:
            node.on = on
            node.generation += 1
            self._publish_power(node, None)  # standby, or idle while it boots
            if on:
                node.boot_at = time.monotonic() + self.boot_delay_s
                generation = node.generation
                self._after(self.boot_delay_s, lambda: self._boot(node, generation))
            else:
                node.boot_at = None
                self._stop_agent(node)
                self._stop_host(node, signal.SIGKILL)  # a power cut: the whole namespace
        log.info("%s: power %s", node.name, "on" if on else "off")
        self._write_state()

    def _boot(self, node: _Node, generation: int, waited: int = 0) -> None:
        if self._closing or node.generation != generation or not node.on:
            return  # powered off (or cycled) since this boot began
        if node.host is not None and waited < HOST_WAIT_ROUNDS and not self._host_gone(node):
            # The host's previous life (a reboot's graceful stop) is still ending: its sshd
            # holds the port. Bounded: the stop is SIGKILLed after the grace.
            self._after(HOST_WAIT_S, lambda: self._boot(node, generation, waited + 1))
            return
        with self._state_lock:
            node.boot_at = None
            try:
                if node.host is not None:
                    self._start_host(node)
                else:
                    self._start_agent(node)
            except Exception as exc:
                node.error = f"{'host' if node.host else 'agent'} not started: {exc}"
                log.error("%s: %s", node.name, node.error)
        self._write_state()

    def _host_gone(self, node: _Node) -> bool:
        if any(s.node == node.name for s in self._stopping):
            return False
        return node.host is None or port_free(node.host.port)

    def _start_host(self, node: _Node) -> None:
        """SSH mode: boot the server's OS (fleet/lab/ssh_hosts.py): its namespace's init starts
        the enabled units (the agent, once Ansible installed it), then sshd."""
        host = node.host
        assert host is not None
        host.reboot_request.unlink(missing_ok=True)  # one from a former life is not for this one
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        with host.console.open("ab") as out:
            out.write(
                f"--- lab: power-on boot done {_now()}, sshd on {HOST}:{host.port}\n".encode()
            )
            out.flush()
            proc = subprocess.Popen(
                host.command(),
                cwd=host.dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: unshare and the namespace's init
                preexec_fn=die_with_parent(os.getpid()),
            )
        if self._sentinel is not None:
            self._sentinel.watch(proc.pid)
        node.host_proc, node.host_ref = proc, ProcRef.of(proc.pid)
        node.agent_url = f"http://{HOST}:{node.agent_port}"  # once Ansible has installed it
        node.error = None
        log.info("%s: host pid %d, sshd on %s:%d", node.name, proc.pid, HOST, host.port)

    def _stop_host(self, node: _Node, sig: int) -> None:
        """SIGTERM: the host's init stops sshd and the units (a reboot, the lab going down);
        SIGKILL: a power cut. Either way the namespace ends with its init; `_reap_stopping`
        SIGKILLs it after the grace."""
        proc = node.host_proc
        node.host_proc, node.host_ref = None, None
        if node.host is not None:
            node.agent_url = None
        if proc is None:
            return
        signal_group(proc.pid, sig)
        self._stopping.append(
            _Stopping(
                proc,
                time.monotonic() + self.stop_grace_s,
                killed=sig == signal.SIGKILL,
                node=node.name,
            )
        )

    def _poll_reboots(self) -> None:
        """`systemctl reboot` on a host left a request file: reboot that host."""
        for node in self._nodes.values():
            host = node.host
            if host is None or node.host_proc is None or not host.reboot_request.exists():
                continue
            host.reboot_request.unlink(missing_ok=True)
            self._reboot_host(node)

    def _reboot_host(self, node: _Node) -> None:
        """Down (graceful), then up after the boot delay; the BMC stays on."""
        with self._state_lock:
            node.generation += 1
            self._stop_host(node, signal.SIGTERM)
            self._publish_power(node, None)
            node.boot_at = time.monotonic() + self.boot_delay_s
            generation = node.generation
            self._after(self.boot_delay_s, lambda: self._boot(node, generation))
        log.info("%s: rebooting (systemctl reboot on the host)", node.name)
        self._write_state()

    def _start_agent(self, node: _Node, env: dict[str, str] | None = None) -> None:
        if node.token is None:
            node.token = self._token_for(node.name)
        started = "restarted" if env is not None else "power-on boot done"
        if env is None:
            node.ports.clear()  # this boot's agent and engines draw their own
            env = self._agent_env(node, node.token, self._claim_ports(node, 1))
        port = int(env["FLEET_AGENT_LISTEN_PORT"])
        node.agent_env = env
        log_path = node.workdir / "agent.log"
        with log_path.open("ab") as out:
            out.write(f"--- lab: {started} {_now()}, agent on port {port}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleet_agent"],
                cwd=node.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: power-off stops all of it
                preexec_fn=die_with_parent(os.getpid()),
            )
        if self._sentinel is not None:
            self._sentinel.watch(proc.pid)
        node.agent, node.agent_ref = proc, ProcRef.of(proc.pid)
        node.agent_url = f"http://{HOST}:{port}"
        node.error = None
        log.info("%s: agent pid %d at %s", node.name, proc.pid, node.agent_url)

    def _claim_ports(self, node: _Node, count: int) -> int:
        """A base of `count` free ports for `node`, apart from every port the lab handed out:
        servers booting at once must not draw the same ones (a free check sees only what is
        bound, and an engine binds seconds after its agent starts). Under `_state_lock`, or in
        up() before the controller runs."""
        taken = set().union(*(n.ports for n in self._nodes.values()))
        base = distinct_free_block(count, taken)
        node.ports.update(range(base, base + count))
        return base

    def _agent_env(self, node: _Node, token: str, port: int) -> dict[str, str]:
        # The lab's own FLEET_* settings (its database, say) are not the agent's business.
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(
            PYTHONUNBUFFERED="1",
            FLEET_AGENT_SERVER=node.name,
            FLEET_AGENT_TOKEN=token,
            FLEET_AGENT_FLEET_URL=self.fleet_url,
            FLEET_AGENT_LISTEN_HOST=HOST,
            FLEET_AGENT_LISTEN_PORT=str(port),
            FLEET_AGENT_TELEMETRY="simulated",
            FLEET_AGENT_SIM_GPU_MODEL=node.spec.gpu.model,
            FLEET_AGENT_SIM_GPUS=str(node.spec.gpu.count),
            FLEET_AGENT_SIM_FAULT_FILE=str(node.workdir / "faults.json"),
            FLEET_AGENT_SIM_SEED=str(node.seed),
            # Engines: the STAND-IN of each engine (below; no GPUs here), one port per
            # possible replica.
            FLEET_AGENT_ENGINE_BASE_PORT=str(self._claim_ports(node, max(node.spec.gpu.count, 1))),
            FLEET_AGENT_WORK_DIR=str(node.workdir / "agent"),
            FLEET_STANDIN_GPU=node.spec.gpu.model,
        )
        env.update(standin_commands())  # a deployment's engine picks one (fleet/lab/engines.py)
        env.update(self._weights_env(node))
        env.update(self.agent_env)
        env["FLEET_AGENT_API_KEY"] = node.api_key  # the key `inject` presents: not overridable
        return env

    def _weights_env(self, node: _Node) -> dict[str, str]:
        """The server's weights cache (its own directory and budget) and the lab's S3 settings
        (FLEET_AGENT_S3_*: the endpoint and credentials of the lab's object store)."""
        env = {
            "FLEET_AGENT_CACHE_DIR": str(node.workdir / CACHE_DIR_NAME),
            "FLEET_AGENT_CACHE_BYTES": str(self._cache_bytes[node.name]),
        }
        env.update({k: v for k, v in os.environ.items() if k.startswith("FLEET_AGENT_S3_")})
        return env

    def cache_dir(self, server: str) -> Path:
        """Where `server`'s agent keeps its weights cache."""
        return self._node(server).workdir / CACHE_DIR_NAME

    def restart_agent(self, server: str, sig: signal.Signals = signal.SIGKILL) -> int:
        """Kill `server`'s agent (its process group: SIGKILL, a crash) and start it again at
        once with the same settings; the engines it started run in sessions of their own and
        are left running, for the new agent to adopt. Returns the new agent's pid."""
        with self._state_lock:
            node = self._node(server)
            proc, env = node.agent, node.agent_env
            if proc is None or env is None:
                raise ValueError(f"{server}: no agent running")
            signal_group(proc.pid, sig)
            proc.wait(timeout=30)
            if self._sentinel is not None:
                self._sentinel.forget(proc.pid)
            node.agent, node.agent_ref, node.agent_url = None, None, None
            self._start_agent(node, env)
            assert node.agent is not None
            pid = node.agent.pid
        self._write_state()
        return pid

    def _stop_agent(self, node: _Node) -> None:
        """SIGTERM the agent's group now; `_reap_stopping` SIGKILLs it after the grace."""
        proc = node.agent
        node.agent, node.agent_ref, node.agent_url = None, None, None
        node.agent_env = None
        if proc is None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        self._stopping.append(_Stopping(proc, time.monotonic() + self.stop_grace_s))

    def _reap_stopping(self) -> None:
        now = time.monotonic()
        for stopping in list(self._stopping):
            pid = stopping.proc.pid
            if child_exited(pid):
                signal_group(pid, signal.SIGKILL)  # anything it left in its group
                stopping.proc.wait(timeout=5)
                self._stopping.remove(stopping)
                if self._sentinel is not None:
                    self._sentinel.forget(pid)
            elif now >= stopping.kill_at and not stopping.killed:
                log.info(
                    "agent pid %d still up %g s after SIGTERM: SIGKILL", pid, self.stop_grace_s
                )
                signal_group(pid, signal.SIGKILL)
                stopping.killed = True

    def _poll_agents(self) -> None:
        """An agent that exited by itself (bad settings, a crash) is reaped and reported; the
        lab does not restart it (a power cycle does)."""
        changed = False
        with self._state_lock:
            for node in self._nodes.values():
                proc = node.agent
                if proc is None or not child_exited(proc.pid):
                    continue
                signal_group(proc.pid, signal.SIGKILL)
                code = proc.wait(timeout=5)
                if self._sentinel is not None:
                    self._sentinel.forget(proc.pid)
                node.agent, node.agent_ref, node.agent_url = None, None, None
                node.error = f"agent exited with status {code} (see {node.workdir}/agent.log)"
                log.warning("%s: %s", node.name, node.error)
                changed = True
            for node in self._nodes.values():
                host_proc = node.host_proc
                if host_proc is None or node.host is None or not child_exited(host_proc.pid):
                    continue
                signal_group(host_proc.pid, signal.SIGKILL)
                code = host_proc.wait(timeout=5)
                if self._sentinel is not None:
                    self._sentinel.forget(host_proc.pid)
                node.host_proc, node.host_ref, node.agent_url = None, None, None
                node.error = f"host exited with status {code} (see {node.host.console})"
                log.warning("%s: %s", node.name, node.error)
                changed = True
        if changed:
            self._write_state()

    # -- the modelled draw, fed to the BMCs ----------------------------------------------------

    def _feed_power(self) -> None:
        """Thread: every `power_feed_s`, each server's modelled draw to its BMC. Bounded: one
        round reads the agents' /metrics POWER_FEED_WORKERS at a time, each within
        AGENT_METRICS_TIMEOUT_S."""
        pool = ThreadPoolExecutor(POWER_FEED_WORKERS, thread_name_prefix="lab-power")
        try:
            while not self._watch_stop.wait(self.power_feed_s):
                try:
                    self._feed_once(pool)
                except Exception:
                    log.exception("lab power feeder: a round failed")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _feed_once(self, pool: ThreadPoolExecutor) -> None:
        with self._state_lock:
            plan = [
                (
                    node,
                    node.generation,
                    node.agent_url
                    if node.agent is not None or node.host_proc is not None
                    else None,
                )
                for node in self._nodes.values()
                if node.on
            ]
        timeout = min(AGENT_METRICS_TIMEOUT_S, self.power_feed_s)
        futures = {
            node.name: pool.submit(_agent_gpu_power_w, url, timeout)
            for node, _, url in plan
            if url is not None
        }
        changed = False
        for node, generation, _ in plan:
            future = futures.get(node.name)
            gpu_w = future.result() if future is not None else None
            if self._watch_stop.is_set():
                return
            with self._state_lock:
                if node.generation != generation:
                    continue  # powered off or cycled since: that change published its figure
                before = node.power_w
                self._publish_power(node, gpu_w)
                changed = changed or node.power_w != before
        if changed:
            self._write_state()

    def _publish_power(self, node: _Node, gpu_power_w: float | None) -> None:
        """Model the node's draw now and set it as its BMC's reading (unless the node's BMC has
        none). Called with _state_lock held: a feeder round and a power change never publish
        out of order."""
        watts = modelled_draw_w(
            on=node.on,
            standby_w=node.spec.power.standby_w,
            idle_w=node.spec.power.idle_w,
            gpu_count=node.spec.gpu.count,
            gpu_idle_w=node.gpu_idle_w,
            gpu_power_w=gpu_power_w,
        )
        node.drawn = (node.generation, watts) if node.on else None
        reading = watts if node.bmc_power_reading else None
        if node.override is not None:
            reading = node.override[0]
        if reading == node.published_w:
            return
        try:
            if node.sim is not None:
                if reading is not None:
                    reading = min(reading, node.sim.power_max_w)
                node.sim.set_power_watts(reading)
            elif self._sushy is not None and node.system_id is not None:
                self._sushy.set_power_watts(node.system_id, reading)
            else:
                return
        except (OSError, ValueError) as exc:
            log.warning("%s: could not set its BMC's power reading: %s", node.name, exc)
            return
        node.published_w = reading

    # -- learning power changes --------------------------------------------------------------

    def _on_notice(self, body: dict[str, Any]) -> None:
        """A sushy notice (receiver thread): hand it to the controller."""
        node = self._by_uuid.get(str(body.get("uuid")))
        if node is not None:
            self._commands.put(lambda: self._apply_notice(node, body))

    def _apply_notice(self, node: _Node, body: dict[str, Any]) -> None:
        state = body.get("power_state")
        if state in ("On", "Off"):
            self._set_power(node, state == "On")
        pending = body.get("pending_power")
        if isinstance(pending, dict) and isinstance(pending.get("apply_time"), int | float):
            # sushy applies the change on the first read after apply_time: read then.
            delay = max(0.0, float(pending["apply_time"]) - time.time()) + APPLY_MARGIN_S
            self._after(delay, lambda: self._read_redfish(node))

    def _read_redfish(self, node: _Node) -> None:
        if self._sushy is None or node.system_id is None or self._closing:
            return
        state = self._sushy.read_power_state(node.system_id)
        if state in ("On", "Off"):
            self._set_power(node, state == "On")

    def _reconcile(self) -> None:
        """Read every emulator's truth. Bounded: the Redfish servers share one emulator, so
        the first failed read skips the others until the next round."""
        sushy_answers = True
        for node in self._nodes.values():
            if self._closing:
                return
            try:
                if node.redfish and sushy_answers:
                    self._read_redfish(node)
                elif node.sim is not None:
                    power = chassis_power(node.sim.dir)
                    if power is not None:
                        self._set_power(node, power)
            except (OSError, RuntimeError) as exc:
                sushy_answers = sushy_answers and not node.redfish
                log.warning("%s: reconcile could not read its BMC: %s", node.name, exc)

    def _watch_chassis(self) -> None:
        """One thread for every ipmi_sim: stat() their chassis files, report what changed."""
        nodes = [n for n in self._nodes.values() if n.sim is not None]
        seen: dict[str, tuple[int, int, int]] = {}
        offsets: dict[str, int] = {}
        while not self._watch_stop.wait(self.watch_interval_s):
            for node in nodes:
                directory = node.sim.dir if node.sim is not None else None
                if directory is None:
                    continue
                try:
                    power_stat = os.stat(directory / "chassis.power")
                    log_size = os.stat(directory / "chassis.log").st_size
                except OSError:
                    continue
                key = (power_stat.st_mtime_ns, power_stat.st_size, log_size)
                if seen.get(node.name) == key:
                    continue
                power = chassis_power(directory)
                if power is None:  # caught mid-write: look again next time
                    continue
                seen[node.name] = key
                calls, offsets[node.name] = _new_lines(
                    directory / "chassis.log", offsets.get(node.name, 0)
                )
                self._commands.put(functools.partial(self._apply_chassis, node, calls, power))

    def _apply_chassis(self, node: _Node, calls: list[str], power: bool) -> None:
        """Replay chassis_control calls in order (a reset between two polls is not lost),
        then settle on the power file's truth."""
        for call in calls:
            words = call.split()[1:]  # "<epoch> set power 1"
            if words == ["set", "power", "1"]:
                self._set_power(node, True)
            elif words == ["set", "power", "0"]:
                self._set_power(node, False)
            elif words == ["set", "reset", "1"] and node.on:  # a warm reset: the OS reboots
                self._set_power(node, False)
                self._set_power(node, True)
        self._set_power(node, power)

    # -- what the lab shows --------------------------------------------------------------------

    @property
    def servers(self) -> list[str]:
        return list(self._nodes)

    def _node(self, server: str) -> _Node:
        try:
            return self._nodes[server]
        except KeyError:
            raise LabError(f"no server named {server!r} in the lab") from None

    def power_w(self, server: str) -> float:
        """What the server draws now, as the lab models it: standby_w when off; when on, the
        host part plus its GPUs' reported power (idle_w while booting). Its BMC reads this,
        unless the server is one of `no_power_reading`."""
        with self._state_lock:
            return self._node(server).power_w

    def bmc_power_w(self, server: str) -> float | None:
        """What the server's BMC reads as its draw now (None: no reading)."""
        with self._state_lock:
            return self._node(server).published_w

    def override_bmc_power(self, server: str, watts: float | None) -> None:
        """Make the server's BMC read `watts` (None: no reading) instead of the modelled draw,
        until `clear_bmc_power_override`: a BMC gone wrong, for tests of what the fleet believes.
        Redfish serves any number as given (negative, NaN, absurd); ipmi_sim's one-byte sensor
        only 0 to its range (LabError otherwise)."""
        node = self._node(server)
        sim = node.sim
        if sim is not None and watts is not None and not 0 <= watts <= sim.power_max_w:
            raise LabError(
                f"{server}: an IPMI power sensor shows 0-{sim.power_max_w:g} W, not {watts!r}"
            )
        with self._state_lock:
            node.override = (watts,)
            self._publish_power(node, self._gpu_power_of(node))

    def clear_bmc_power_override(self, server: str) -> None:
        """Back to the modelled draw (from the next feeder round; idle or standby at once)."""
        node = self._node(server)
        with self._state_lock:
            node.override = None
            self._publish_power(node, self._gpu_power_of(node))

    @staticmethod
    def _gpu_power_of(node: _Node) -> float | None:
        """The GPU power behind the node's last modelled draw (None: none known)."""
        if not node.on or node.drawn is None or node.drawn[0] != node.generation:
            return None
        host_w = max(0.0, node.spec.power.idle_w - node.spec.gpu.count * node.gpu_idle_w)
        return node.drawn[1] - host_w

    def rack_power_w(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for node in self._nodes.values():
            totals[node.rack] = totals.get(node.rack, 0.0) + node.power_w
        return totals

    def agent_pid(self, server: str) -> int | None:
        proc = self._node(server).agent
        return proc.pid if proc is not None else None

    def agent_log_tail(self, server: str, needle: str = "", lines: int = 5) -> str:
        """The last `lines` lines of the server's agent log holding `needle`, joined with " | "
        ("" when there is no log): what a test prints when an engine never became ready."""
        try:
            text = (self._node(server).workdir / "agent.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join([line for line in text.splitlines() if needle in line][-lines:])

    def host_pid(self, server: str) -> int | None:
        """SSH mode: the pid of the server's running host (its `unshare`, the namespace's
        parent; the group of both); None while off or booting."""
        proc = self._node(server).host_proc
        return proc.pid if proc is not None else None

    def ssh_host(self, server: str) -> SshHost:
        """SSH mode: the server's host (port, host key and fingerprint, directories)."""
        host = self._node(server).host
        if host is None:
            raise LabError("the lab is not in SSH mode (or not up): no SSH hosts")
        return host

    @property
    def ssh_key_file(self) -> Path:
        """SSH mode: the lab's client private key (0600), authorized for root on every host:
        the fleet's FLEET_SSH_KEY_FILE and Ansible's --private-key."""
        return self.workdir / CLIENT_KEY

    def bmc_endpoint(self, server: str) -> str:
        return bmc_endpoint(self._server_state(self._node(server)))

    def power_ons(self, server: str) -> int:
        """Power commands the server's emulator applied to turn it on: Redfish Resets in
        sushy's log (for a server found off, each Reset is a power-on), `set power 1` in an
        IPMI server's chassis log. What a test counts to show a boot was sent exactly once."""
        entry = self.state()["servers"][server]
        if entry["protocol"] == "redfish":
            assert self._sushy is not None
            return len(self._sushy.resets(entry["system_id"]))
        lines = (Path(entry["chassis_dir"]) / "chassis.log").read_text().splitlines()
        return sum(1 for line in lines if line.split()[1:] == ["set", "power", "1"])

    def state(self) -> dict[str, Any]:
        """What lab.json holds: enough for `fleetctl lab status|inject|down` in another process
        (the lab's pid, its emulators and sentinel, every server's BMC and agent)."""
        with self._emulators_lock:
            emulators = [dict(e) for e in self._emulators]
        sentinel = self._sentinel.ref if self._sentinel is not None else None
        with self._state_lock:
            servers = {n.name: self._server_state(n) for n in self._nodes.values()}
        return {
            "version": STATE_VERSION,
            "lab": proc_record(os.getpid()),
            "workdir": str(self.workdir),
            "fleet_url": self.fleet_url,
            "boot_delay_s": self.boot_delay_s,
            "username": LAB_USERNAME,
            "password": LAB_PASSWORD,  # lab-only emulator credentials; the file is 0600
            "sentinel": asdict(sentinel) if sentinel is not None else None,
            "emulators": emulators,
            "servers": servers,
        }

    def _server_state(self, node: _Node) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "rack": node.rack,
            "protocol": node.spec.bmc.protocol.value,
            "address": HOST,
            "on": node.on,
            "booting": node.boot_at is not None,
            "power_w": node.power_w,
            "bmc_power_w": node.published_w,
            "agent": None,
            "error": node.error,
            "workdir": str(node.workdir),
        }
        if node.redfish:
            entry["port"] = self._sushy.port if self._sushy is not None else None
            entry["url"] = self._sushy.url if self._sushy is not None else None
            entry["system_id"] = node.system_id
        else:
            entry["port"] = node.sim.port if node.sim is not None else None
            entry["chassis_dir"] = str(node.sim.dir) if node.sim and node.sim.dir else None
        if node.agent_ref is not None:
            # The key lets `fleetctl lab inject` (another process) reach /faults: lab.json is 0600.
            entry["agent"] = {**asdict(node.agent_ref), "url": node.agent_url, "key": node.api_key}
        if node.host is not None:
            entry["ssh"] = {
                "address": HOST,
                "port": node.host.port,
                "host_key": node.host.fingerprint,
                "host": asdict(node.host_ref) if node.host_ref is not None else None,
                "dir": str(node.host.dir),
            }
            if node.host_ref is not None:
                # Ansible installs this agent (host_vars): no pid of the lab's, same key.
                entry["agent"] = {"url": node.agent_url, "key": node.api_key}
        return entry

    def _write_state(self) -> None:
        if self.state_path is None:
            return
        with self._write_lock:
            if not self._down:
                write_state(self.state_path, self.state())

    def status(self) -> list[ServerStatus]:
        """Every server: its emulator's power state (read now), agent, readiness, draw."""
        return status_from_state(self.state())

    def usage(self) -> Usage:
        """CPU seconds and RSS of the lab (this process and its sentinel), of its emulators'
        process groups and of its agents' process groups, from /proc."""
        lab = {os.getpid()}
        if self._sentinel is not None and self._sentinel.ref is not None:
            lab.add(self._sentinel.ref.pid)
        emulators = self._emulator_pids()
        with self._state_lock:
            agents = {n.agent.pid for n in self._nodes.values() if n.agent is not None}
            agents |= {n.host_proc.pid for n in self._nodes.values() if n.host_proc is not None}
            agents |= {s.proc.pid for s in self._stopping}
        return usage_of(lab, emulators, agents)

    def set_power_behind_our_back(self, server: str, on: bool) -> None:
        """Press the server's power button at its emulator, as an operator with another tool
        would (not through Fleet). Redfish changes land 1-11 s later, like every sushy Reset."""
        node = self._node(server)
        if node.sim is not None:
            node.sim.set_power_behind_our_back(on)
        elif self._sushy is not None and node.system_id is not None:
            self._sushy.set_power_behind_our_back(node.system_id, "on" if on else "off")
        else:
            raise LabError(f"{server}: the lab is not up")

    def inject(self, server: str, fault: Mapping[str, Any]) -> dict[str, Any]:
        """POST `fault` (fleet_agent.telemetry.simulated.Fault.from_dict's shape, e.g. {"kind":
        "xid", "xid": 79, "gpu": 3}) to the server's agent; LabError when it cannot."""
        node = self._node(server)
        with self._state_lock:
            entry = self._server_state(node)
        return inject_fault(server, entry, fault)

    def rewritten_inventory(self) -> dict[str, Any]:
        """The inventory with every BMC pointing at its emulator, with the LAB credentials
        (plain data, passwords included: import it, keep it out of version control)."""
        if not self._started or self._down:
            raise LabError("the lab is not up: the emulators' ports are known once it is")
        data = self.inventory.model_dump(mode="json", exclude_none=True)
        bmcs = {name: self._bmc_of(node) for name, node in self._nodes.items()}
        ssh = {
            name: {"address": HOST, "port": node.host.port, "host_key": node.host.fingerprint}
            for name, node in self._nodes.items()
            if node.host is not None
        }
        servers = [
            s
            for site in data.get("sites", [])
            for r in site.get("racks", [])
            for s in r.get("servers", [])
        ]
        for server in servers + data.get("servers", []):
            server["bmc"] = bmcs[server["name"]]
            if server["name"] in ssh:
                server["ssh"] = ssh[server["name"]]  # the host key pinned from the inventory
        return data

    def write_ansible_inventory(self, directory: Path | str) -> Path:
        """SSH mode: what Ansible needs to deploy the agent to the lab's hosts as an operator
        would. Writes `directory/fleet.yml` (the fleet's dynamic inventory: `plugin: fleet`,
        URL and token from FLEET_URL / FLEET_TOKEN), `directory/host_vars/<server>.yml` (the
        agent's port, simulated telemetry, its environment: the lab's simulated GPUs, local-API
        key and stand-in engines; 0600, as it holds that key) and `directory/known_hosts` (every
        host's key, `[127.0.0.1]:port`). Returns the fleet.yml path; `-i DIRECTORY` or `-i
        DIRECTORY/fleet.yml` both read the host_vars."""
        if not self.ssh or not self._started or self._down:
            raise LabError("write_ansible_inventory needs a lab up in SSH mode (--ssh)")
        directory = Path(directory)
        host_vars = directory / "host_vars"
        host_vars.mkdir(parents=True, exist_ok=True)
        host_vars.chmod(0o700)
        inventory = directory / "fleet.yml"
        inventory.write_text(
            "# The fleet's dynamic inventory (ansible/plugins/inventory/fleet.py): FLEET_URL and\n"
            "# FLEET_TOKEN (a viewer token) come from the environment.\nplugin: fleet\n"
        )
        lines = []
        for node in self._nodes.values():
            assert node.host is not None
            values = {
                "fleet_agent_listen_port": node.agent_port,
                "fleet_agent_telemetry": "simulated",
                "fleet_agent_python": "/usr/bin/python3",
                "fleet_agent_env": self._host_agent_env(node),
            }
            path = host_vars / f"{node.name}.yml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(
                    "# Written by the lab (fleet/lab/colo.py): this server's simulated GPUs.\n"
                )
                yaml.dump(values, out, Dumper=_NoAliases, sort_keys=False)
            lines.append(node.host.known_hosts_line())
        (directory / "known_hosts").write_text("\n".join(lines) + "\n")
        return inventory

    def _host_agent_env(self, node: _Node) -> dict[str, str]:
        """The agent's environment on an SSH host, beyond what the role writes itself (server,
        token, fleet URL, port, telemetry, work dir): what the lab gives its own agents."""
        env = {
            "PYTHONUNBUFFERED": "1",
            "FLEET_AGENT_SIM_GPU_MODEL": node.spec.gpu.model,
            "FLEET_AGENT_SIM_GPUS": str(node.spec.gpu.count),
            "FLEET_AGENT_SIM_FAULT_FILE": str(node.workdir / "faults.json"),
            "FLEET_AGENT_SIM_SEED": str(node.seed),
            **standin_commands(),
            "FLEET_AGENT_ENGINE_BASE_PORT": str(node.engine_base_port),
            "FLEET_STANDIN_GPU": node.spec.gpu.model,
        }
        env.update(self._weights_env(node))
        env.update(self.agent_env)
        env["FLEET_AGENT_API_KEY"] = node.api_key  # the key `inject` presents: not overridable
        return env

    def rewritten_yaml(self) -> str:
        return yaml.dump(
            self.rewritten_inventory(), Dumper=_NoAliases, sort_keys=False, allow_unicode=True
        )

    def _bmc_of(self, node: _Node) -> dict[str, Any]:
        if node.redfish:
            port = self._sushy.port if self._sushy is not None else 0
            bmc = {"protocol": "redfish", "address": f"http://{HOST}", "port": port}
            # sushy-tools speaks plain HTTP on loopback: the opt-in the fleet asks for.
            bmc["system_id"], bmc["plain_http"] = node.system_id, True
        else:
            port = node.sim.port if node.sim is not None else 0
            bmc = {"protocol": "ipmi", "address": HOST, "port": port}
        return {**bmc, "username": LAB_USERNAME, "password": LAB_PASSWORD}


class _NoAliases(yaml.SafeDumper):
    """The importer refuses YAML aliases: never write one."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to `path` since `offset`, and the new offset."""
    try:
        with path.open("rb") as src:
            src.seek(offset)
            data = src.read(1 << 20)
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace").splitlines(), offset + end


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
