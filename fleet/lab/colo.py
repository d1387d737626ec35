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
  receiver here when a Reset is *requested* (`pending_power` with `apply_time`) and when it is
  applied (a new `power_state`). sushy applies a change only on the first read after its
  apply time, so the lab reads the system at that time: the real hardware would act then too.
- IPMI: the chassis_control program of each ipmi_sim writes `chassis.power` and appends to
  `chassis.log`; one watcher thread polls their stat() every `watch_interval_s` for all sims.
- Both: a bounded reconcile reads the emulators' truth every `reconcile_interval_s`.

Every change goes through ONE controller thread (power state, boot timers, agent processes), so
there are no races between a notice, a boot timer and a power-off. Agents are started from that
long-lived thread on purpose: PR_SET_PDEATHSIG fires when the *thread* that forked the child
exits, not only the process.

Cleanup when the lab process dies without running `down()` (SIGKILL, a crash):
- agents get PR_SET_PDEATHSIG=SIGKILL (Linux; set with prctl in the child before exec);
- a tiny sentinel process (stdlib only) holds a pipe from the lab: when the pipe closes, however
  the lab ended, it SIGTERMs, then SIGKILLs every process group the lab registered with it
  (emulators, agents and whatever an agent started in its group) and removes the emulators'
  temporary directories. The emulator classes take no preexec hook, hence the sentinel.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import functools
import heapq
import itertools
import json
import logging
import os
import queue
import random
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
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from fleet.errors import FleetError
from fleet.inventory.schema import InventoryFile, ServerIn, parse_inventory
from fleet.lab.ipmi_sim import IpmiSim
from fleet.lab.sushy import FakeSystem, SushyEmulator, free_port
from fleet.models import BmcProtocol

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
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
READY_TIMEOUT_S = 0.5
BMC_READ_TIMEOUT_S = 3.0
APPLY_MARGIN_S = 0.25  # sushy applies at int(apply_time) <= time.time(): read a little later
IPMI_START_WORKERS = 12
STATE_FILE = "lab.json"
STATE_VERSION = 1
MAX_NOTICE_BYTES = 1 << 20
AGENT_POLL_S = 1.0  # how often the controller looks for agents that exited on their own


class LabError(FleetError):
    """A lab operation that cannot be done; the message says what to do instead."""


# ---------------------------------------------------------------------------------------------
# Processes: identity, death with the parent, groups


_PR_SET_PDEATHSIG = 1
_prctl: Any = None
if sys.platform == "linux":  # resolved here: the child of fork() should only call it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int


# Engine ports come from below the kernel's ephemeral range (Linux: 32768-60999), so that no
# outgoing connection of another process can take one between our check and the engine's bind.
_BLOCK_RANGE = (20_000, 32_000)


def free_port_block(count: int, attempts: int = 200) -> int:
    """A base port with `count` free 127.0.0.1 TCP ports from it, outside the ephemeral range
    (a bounded random search)."""
    rng = random.Random()
    low, high = _BLOCK_RANGE
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise LabError(f"no block of {count} free ports on {HOST} in {low}-{high}")


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec_fn: SIGKILL this child when the thread that forked it exits (Linux only)."""
    if _prctl is None:
        return None

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0)
        if os.getppid() != parent:  # the lab died before prctl: nobody would kill us later
            os._exit(1)

    return preexec


@dataclass(frozen=True, slots=True)
class ProcRef:
    """A process by pid AND start time (clock ticks after boot), so a reused pid never matches."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcRef | None:
        stat = _proc_stat(pid)
        return None if stat is None else cls(pid, int(stat[19]))

    def alive(self) -> bool:
        stat = _proc_stat(self.pid)
        return stat is not None and int(stat[19]) == self.start and stat[0] not in ("Z", "X")


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on: index 2 pgid, 11-14 CPU ticks, 19 start."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exited(pid: int) -> bool:
    """Has child `pid` exited? Not reaped: while it is a zombie its pgid cannot be reused."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


_SENTINEL = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the lab's terminal is the lab's
groups = {}
for line in sys.stdin:  # until EOF: the lab closed the pipe, or died
    op, _, rest = line.rstrip("\n").partition(" ")
    pgid, _, path = rest.partition(" ")
    if op == "+":
        groups[int(pgid)] = path
    elif op == "-":
        groups.pop(int(pgid), None)
def alive(g):
    try:
        os.killpg(g, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
def send(sig):
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
send(signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[1])
while any(alive(g) for g in groups) and time.monotonic() < deadline:
    time.sleep(0.05)
send(signal.SIGKILL)
for path in groups.values():
    if path:
        shutil.rmtree(path, ignore_errors=True)
"""


class _Sentinel:
    """The process that cleans up after the lab when the lab dies (see the module doc)."""

    def __init__(self, grace: float) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _SENTINEL, str(grace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # it must outlive the lab, and a terminal's signals
        )
        self.ref = ProcRef.of(self._proc.pid)

    def watch(self, pgid: int, cleanup_dir: Path | None = None) -> None:
        self._send(f"+ {pgid} {cleanup_dir or ''}")

    def forget(self, pgid: int) -> None:
        self._send(f"- {pgid}")

    def _send(self, line: str) -> None:
        with self._lock:
            stdin = self._proc.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(line.encode() + b"\n")
                stdin.flush()
            except BrokenPipeError:
                log.warning("lab sentinel is gone: processes may outlive a crash of the lab")

    def close(self, timeout: float) -> None:
        """Close the pipe (the sentinel stops what is still registered) and reap it."""
        with self._lock:
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                with contextlib.suppress(BrokenPipeError):
                    self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)


# ---------------------------------------------------------------------------------------------
# Public records


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


@dataclass(frozen=True, slots=True)
class ProcUsage:
    processes: int = 0
    cpu_s: float = 0.0  # user + system, including reaped children of these processes
    rss_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    """The lab's own cost (its process and sentinel), its emulators' and its agents'."""

    lab: ProcUsage
    emulators: ProcUsage
    agents: ProcUsage

    @property
    def total(self) -> ProcUsage:
        parts = (self.lab, self.emulators, self.agents)
        return ProcUsage(
            sum(p.processes for p in parts),
            sum(p.cpu_s for p in parts),
            sum(p.rss_bytes for p in parts),
        )


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

    @property
    def redfish(self) -> bool:
        return self.spec.bmc.protocol is BmcProtocol.REDFISH

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())  # stable per server: same GPUs every boot

    @property
    def power_w(self) -> float:
        return self.spec.power.idle_w if self.on else self.spec.power.standby_w


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


# ---------------------------------------------------------------------------------------------
# The Redfish notice receiver


class _NoticeHandler(BaseHTTPRequestHandler):
    server: _NoticeServer

    def do_PUT(self) -> None:  # sushy sends every notice as a PUT of the system's JSON
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_NOTICE_BYTES:
            self.send_error(413 if length else 411)
            return
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            self.send_error(400, "not JSON")
            return
        if isinstance(body, dict):
            self.server.on_notice(body)
        self.send_response(204)
        self.end_headers()

    do_POST = do_PUT

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("notice receiver: " + format, *args)


class _NoticeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, on_notice: Callable[[dict[str, Any]], None]) -> None:
        super().__init__((HOST, 0), _NoticeHandler)
        self.on_notice = on_notice

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}/notify"


# ---------------------------------------------------------------------------------------------
# The virtual colo


def _servers_of(inventory: InventoryFile) -> Iterator[tuple[str, ServerIn]]:
    for site in inventory.sites:
        for rack in site.racks:
            for server in rack.servers:
                yield rack.name, server
    for racked in inventory.servers:
        yield racked.rack, racked


def _valid_uuid(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return str(uuid_mod.UUID(value))
    except ValueError:
        return None


class VirtualColo:
    """Real BMC emulators for every server of `inventory`, and an agent per powered-on server.

    `token_for(server)` returns an agent token for that server (called when its first boot
    completes, so the server may be imported into the fleet after `up()`); `agent_env` is added
    to every agent's environment (e.g. the stand-in engine's command). Files: `workdir/lab.json`
    (the state other `fleetctl lab` commands read) and `workdir/servers/<name>/` (agent.log,
    faults.json). `up()` / `down()` or a `with` block; `down()` is idempotent and also runs at
    interpreter exit.
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
    ) -> None:
        if not isinstance(inventory, InventoryFile):
            inventory = parse_inventory(inventory)
        if boot_delay_s < 0 or stop_grace_s < 0 or watch_interval_s <= 0:
            raise ValueError("boot_delay_s and stop_grace_s must be >= 0, watch_interval_s > 0")
        self.inventory = inventory
        self.workdir = Path(workdir).resolve()
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
        self._by_uuid = {n.system_id: n for n in self._nodes.values() if n.system_id}
        self._sushy: SushyEmulator | None = None
        self._notices: _NoticeServer | None = None
        self._sentinel: _Sentinel | None = None
        self._emulators: list[dict[str, Any]] = []  # kind, pid, start (+ url or server)
        self._emulators_lock = threading.Lock()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._stopping: list[_Stopping] = []
        self._controller: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
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
            self._sentinel = _Sentinel(self.stop_grace_s)
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
        except BaseException:
            self.down()
            raise
        self.up_seconds = time.monotonic() - began
        self._write_state()
        log.info("lab up: %d servers in %.1f s", len(self._nodes), self.up_seconds)
        return self

    def _start_emulators(self) -> None:
        redfish = [n for n in self._nodes.values() if n.redfish]
        ipmi = [n for n in self._nodes.values() if not n.redfish]
        if redfish:
            self._notices = _NoticeServer(self._on_notice)
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
            node.sim = IpmiSim(LAB_PASSWORD, username=LAB_USERNAME, ready_timeout=30.0)
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
            self._emulators.append({**about, **_ref_dict(pid)})

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
        while not self._closing:
            now = time.monotonic()
            wake = min(next_reconcile, next_poll)
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
            if on:
                node.boot_at = time.monotonic() + self.boot_delay_s
                generation = node.generation
                self._after(self.boot_delay_s, lambda: self._boot(node, generation))
            else:
                node.boot_at = None
                self._stop_agent(node)
        log.info("%s: power %s", node.name, "on" if on else "off")
        self._write_state()

    def _boot(self, node: _Node, generation: int) -> None:
        if self._closing or node.generation != generation or not node.on:
            return  # powered off (or cycled) since this boot began
        with self._state_lock:
            node.boot_at = None
            try:
                self._start_agent(node)
            except Exception as exc:
                node.error = f"agent not started: {exc}"
                log.error("%s: %s", node.name, node.error)
        self._write_state()

    def _start_agent(self, node: _Node) -> None:
        if node.token is None:
            node.token = self._token_for(node.name)
        port = free_port()
        env = self._agent_env(node, node.token, port)
        log_path = node.workdir / "agent.log"
        with log_path.open("ab") as out:
            out.write(f"--- lab: power-on boot done {_now()}, agent on port {port}\n".encode())
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
            # Engines: the STAND-IN (no GPUs here), one port per possible replica.
            FLEET_AGENT_ENGINE_COMMAND=f"{sys.executable} -m fleet_agent.engine.standin",
            FLEET_AGENT_ENGINE_BASE_PORT=str(free_port_block(max(node.spec.gpu.count, 1))),
            FLEET_AGENT_WORK_DIR=str(node.workdir / "agent"),
            FLEET_STANDIN_GPU=node.spec.gpu.model,
        )
        env.update(self.agent_env)
        env["FLEET_AGENT_API_KEY"] = node.api_key  # the key `inject` presents: not overridable
        return env

    def _stop_agent(self, node: _Node) -> None:
        """SIGTERM the agent's group now; `_reap_stopping` SIGKILLs it after the grace."""
        proc = node.agent
        node.agent, node.agent_ref, node.agent_url = None, None, None
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        self._stopping.append(_Stopping(proc, time.monotonic() + self.stop_grace_s))

    def _reap_stopping(self) -> None:
        now = time.monotonic()
        for stopping in list(self._stopping):
            pid = stopping.proc.pid
            if _exited(pid):
                _signal_group(pid, signal.SIGKILL)  # anything it left in its group
                stopping.proc.wait(timeout=5)
                self._stopping.remove(stopping)
                if self._sentinel is not None:
                    self._sentinel.forget(pid)
            elif now >= stopping.kill_at and not stopping.killed:
                log.info(
                    "agent pid %d still up %g s after SIGTERM: SIGKILL", pid, self.stop_grace_s
                )
                _signal_group(pid, signal.SIGKILL)
                stopping.killed = True

    def _poll_agents(self) -> None:
        """An agent that exited by itself (bad settings, a crash) is reaped and reported; the
        lab does not restart it (a power cycle does)."""
        changed = False
        with self._state_lock:
            for node in self._nodes.values():
                proc = node.agent
                if proc is None or not _exited(proc.pid):
                    continue
                _signal_group(proc.pid, signal.SIGKILL)
                code = proc.wait(timeout=5)
                if self._sentinel is not None:
                    self._sentinel.forget(proc.pid)
                node.agent, node.agent_ref, node.agent_url = None, None, None
                node.error = f"agent exited with status {code} (see {node.workdir}/agent.log)"
                log.warning("%s: %s", node.name, node.error)
                changed = True
        if changed:
            self._write_state()

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
                    power = _chassis_power(node.sim.dir)
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
                power = _chassis_power(directory)
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
        """What the server draws now: standby_w when off, idle_w when on (booting or up)."""
        return self._node(server).power_w

    def rack_power_w(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for node in self._nodes.values():
            totals[node.rack] = totals.get(node.rack, 0.0) + node.power_w
        return totals

    def agent_pid(self, server: str) -> int | None:
        proc = self._node(server).agent
        return proc.pid if proc is not None else None

    def bmc_endpoint(self, server: str) -> str:
        return _endpoint(self._server_state(self._node(server)))

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
            "lab": _ref_dict(os.getpid()),
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
            agents |= {s.proc.pid for s in self._stopping}
        return _usage(lab, emulators, agents)

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
        for site in data.get("sites", []):
            for rack in site.get("racks", []):
                for server in rack.get("servers", []):
                    server["bmc"] = bmcs[server["name"]]
        for server in data.get("servers", []):
            server["bmc"] = bmcs[server["name"]]
        return data

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


# ---------------------------------------------------------------------------------------------
# Reading the lab from its state (this process or `fleetctl lab ...` in another)


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
    return ServerStatus(
        name=name,
        rack=str(entry.get("rack")),
        protocol=str(entry.get("protocol")),
        bmc=_endpoint(entry),
        power=_emulator_power(entry, credentials),
        booting=bool(entry.get("booting")),
        agent_pid=int(agent["pid"]) if alive and agent else None,
        agent_url=url,
        agent_ready=_ready(url) if url else None,
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


def _endpoint(entry: Mapping[str, Any]) -> str:
    if entry.get("protocol") == BmcProtocol.REDFISH.value:
        return f"{entry.get('url')}/redfish/v1/Systems/{entry.get('system_id')}"
    return f"ipmi://{entry.get('address')}:{entry.get('port')}"


def _emulator_power(entry: Mapping[str, Any], credentials: tuple[str, str]) -> str:
    """As the emulator says it: a Redfish GET of the system (which, like any read, lets sushy
    apply a pending change), or the ipmi_sim chassis_control program's power file."""
    if entry.get("protocol") == BmcProtocol.REDFISH.value:
        token = base64.b64encode(":".join(credentials).encode()).decode()
        request = urllib.request.Request(
            _endpoint(entry),
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
    power = _chassis_power(Path(directory)) if directory else None
    return "unknown" if power is None else "on" if power else "off"


def _chassis_power(directory: Path | None) -> bool | None:
    if directory is None:
        return None
    try:
        text = (directory / "chassis.power").read_text().strip()
    except OSError:
        return None
    return {"1": True, "0": False}.get(text)


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


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=READY_TIMEOUT_S) as resp:
            return int(resp.status) == 200
    except (OSError, ValueError):
        return False  # 503 (not ready) lands here too, as an HTTPError


def _ref_dict(pid: int) -> dict[str, int]:
    ref = ProcRef.of(pid)
    return asdict(ref) if ref is not None else {"pid": pid, "start": -1}


def _ref(value: Any) -> ProcRef | None:
    if isinstance(value, Mapping) and isinstance(value.get("pid"), int):
        return ProcRef(int(value["pid"]), int(value.get("start", -1)))
    return None


def _alive(value: Any) -> bool:
    ref = _ref(value)
    return ref is not None and ref.alive()


def _usage(lab: set[int], emulators: set[int], agents: set[int]) -> Usage:
    """Sum /proc figures: `lab` by pid, emulators and agents by process group."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, list[float]] = {k: [0, 0.0, 0] for k in ("lab", "emulators", "agents")}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _proc_stat(pid)
        if stat is None:
            continue
        pgid = int(stat[2])
        kind = (
            "lab"
            if pid in lab
            else "emulators"
            if pgid in emulators
            else "agents"
            if pgid in agents
            else None
        )
        if kind is None:
            continue
        ticks = sum(int(v) for v in stat[11:15])  # utime stime cutime cstime
        totals[kind][0] += 1
        totals[kind][1] += ticks / tick
        totals[kind][2] += _rss_bytes(pid)
    parts = {k: ProcUsage(int(v[0]), float(v[1]), int(v[2])) for k, v in totals.items()}
    return Usage(parts["lab"], parts["emulators"], parts["agents"])


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
