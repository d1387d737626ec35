"""OpenIPMI's `ipmi_sim` as a child process: an IPMI BMC EMULATOR on 127.0.0.1.

`IpmiSim` is a stand-in for a server's BMC, used by the driver tests and later by the virtual
colo. It is not hardware and not part of the service: it speaks real IPMI (lanplus) on a free
UDP port of 127.0.0.1, with one admin user, and drives a `chassis_control` program (the template
`templates/chassis_control.sh`) that keeps the chassis power state in a file and appends every
call to a log (`<epoch> set power 0`). Each instance has its own temporary directory (config,
state, log), so several run at once.

ipmi_sim facts this relies on (Debian `openipmi` 2.0.x):
- it binds its UDP port with SO_REUSEADDR and does not fail when the port is held by another
  SO_REUSEADDR socket, so two emulators on one port would silently share it: ports are chosen
  by the kernel, reserved in-process, and checked after start in /proc/net/udp; where another
  process took the port in between without SO_REUSEADDR, it exits with "Unable to bind to LAN
  port: Address already in use": both count as a clash and the start retries on a fresh port;
- passwords longer than 19 characters are not accepted by its LAN config;
- it asks the chassis_control program for the power state on every read, and a
  `chassis power cycle` reaches the program as `set power 0` and, about 1 s later,
  `set power 1`; a soft shutdown arrives as `set shutdown 1`;
- it exits on SIGTERM; the chassis_control programs it forks share its process group;
- it has no DCMI (Get Power Reading answers "invalid command", 0xC1), so the server's draw is a
  whole-system power SENSOR (`set_power_watts`, templates/ipmi_sim-bmc.emu): a one-byte
  threshold sensor scaled by M watts a step, read from a file it polls; a presence bit, also
  polled from a file, disables it when the lab has no figure to give ("unavailable").
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from types import TracebackType

from fleet.bmc.base import BmcTarget, Timeouts
from fleet.models import BmcProtocol

HOST = "127.0.0.1"
_PASSWORD_RE = re.compile(r"^[A-Za-z0-9._~+=@%^,:/-]{1,19}$")
_USER_RE = re.compile(r"^[A-Za-z0-9._-]{1,16}$")

# The power sensor (templates/ipmi_sim-bmc.emu): one byte of reading, M watts a step.
POWER_SENSOR_NAME = "Total Power"
DEFAULT_POWER_MAX_W = 2550.0  # 10 W a step
POWER_POLL_MS = 200  # how often ipmi_sim reads the watts (a change shows within ~2 polls)

_reserved_lock = threading.Lock()
_reserved_ports: set[int] = set()
_live: set[IpmiSim] = set()


class IpmiSimError(RuntimeError):
    """The emulator did not start (or a helper command against it failed)."""


def _template(name: str) -> str:
    return (resources.files("fleet.lab") / "templates" / name).read_text(encoding="utf-8")


def _udp_sockets_on(port: int) -> int | None:
    """How many IPv4/IPv6 UDP sockets are bound to `port` (None where /proc is unavailable)."""
    count = 0
    seen_any_table = False
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen_any_table = True
        for line in lines:
            fields = line.split()
            if len(fields) > 1 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count if seen_any_table else None


def power_step_w(power_max_w: float) -> int:
    """The sensor's resolution M (watts a step) so that 255 steps reach `power_max_w`."""
    if not math.isfinite(power_max_w) or power_max_w <= 0:
        raise ValueError(f"power_max_w must be a positive number of watts, not {power_max_w}")
    step = max(1, math.ceil(power_max_w / 255))
    if step > 1023:  # M is 10 bits in the SDR
        raise ValueError(f"power_max_w {power_max_w:g} W is beyond one IPMI sensor's range")
    return step


def power_sdr(step_w: int, sensor_number: int = 0x30, name: str = POWER_SENSOR_NAME) -> str:
    """The power sensor's Full Sensor Record (IPMI 2.0 table 43-1) as main_sdr_add's bytes:
    threshold sensor, units Watts, reading = M * raw (M = `step_w`), entity system chassis,
    scanning on at start. Checked against OpenIPMI's own compiler (`sdrcomp`) for M=50."""
    encoded = name.encode("ascii")
    if not 0 < len(encoded) <= 16:
        raise ValueError("an SDR id string is 1-16 characters")
    record = [
        0x00, 0x00,  # record id: ipmi_sim assigns it
        0x51, 0x01, 0x00,  # SDR version 1.5, type 01 (full sensor record), length (below)
        0x20, 0x00, sensor_number,  # owner: the BMC, LUN 0
        0x17, 0x01,  # entity: system chassis, instance 1
        0x45,  # initialisation: scanning, sensor type, default scanning on
        0x00,  # capabilities: none (no thresholds, no events)
        0x0B, 0x01,  # sensor type "other units-based", event/reading type: threshold
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  # event and threshold masks: none
        0x00, 0x06, 0x00,  # unsigned analog reading; base unit 6 = Watts; no modifier
        0x00,  # linear
        step_w & 0xFF, (step_w >> 8) << 6,  # M (10 bits), tolerance 0
        0x00, 0x01,  # B = 0, accuracy 1
        0x01, 0x00,  # direction input; R and B exponents 0
        0x00, 0x00, 0x00, 0x00,  # analog flags, nominal, normal max, normal min
        0xFF, 0x00,  # sensor maximum and minimum raw readings
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  # thresholds: none
        0x00, 0x00, 0x00, 0x00, 0x00,  # hysteresis, reserved, OEM
        0xC0 | len(encoded),  # id string: 8-bit ASCII
        *encoded,
    ]  # fmt: skip
    record[4] = len(record) - 5
    return " ".join(f"0x{byte:02x}" for byte in record)


def free_udp_port() -> int:
    """A UDP port of 127.0.0.1 that nothing is bound to now and that this process has not
    handed out before (ports are never handed out twice per process). Also what a test uses
    for "BMC down": a port with nothing listening."""
    with _reserved_lock:
        for _ in range(50):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.bind((HOST, 0))
                port = int(sock.getsockname()[1])
            if port not in _reserved_ports:
                _reserved_ports.add(port)
                return port
    raise IpmiSimError("no free UDP port on 127.0.0.1 after 50 tries")


class IpmiSim:
    """One ipmi_sim EMULATOR process (a stand-in for a server's BMC) on 127.0.0.1:`port`.

    Use as a context manager, or call `start()` and, always, `stop()`. `stop()` is idempotent;
    any instance still running when the interpreter exits is stopped by an atexit hook.
    """

    def __init__(
        self,
        password: str,
        *,
        username: str = "admin",
        powered_on: bool = False,
        soft_off_powers_down: bool = True,
        ready_timeout: float = 10.0,
        power_max_w: float = DEFAULT_POWER_MAX_W,
        ipmi_sim: str = "ipmi_sim",
        ipmitool: str = "ipmitool",
    ) -> None:
        if not _PASSWORD_RE.fullmatch(password):
            raise ValueError(
                "ipmi_sim password: 1-19 characters of letters, digits and ._~+=@%^,:/-"
            )
        if not _USER_RE.fullmatch(username):
            raise ValueError("ipmi_sim username: 1-16 characters of letters, digits and ._-")
        self.username = username
        self.password = password
        self.powered_on = powered_on
        self.soft_off_powers_down = soft_off_powers_down
        self.ready_timeout = ready_timeout
        # The power sensor's range and resolution: M = ceil(power_max_w / 255) W a step.
        self.power_step_w = power_step_w(power_max_w)
        self.power_max_w = 255.0 * self.power_step_w
        self._power_watts: float | None = None
        self._ipmi_sim = ipmi_sim
        self._ipmitool = ipmitool
        self.port = 0
        self.dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    # -----------------------------------------------------------------------------------------
    # lifecycle

    def __enter__(self) -> IpmiSim:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> IpmiSim:
        """Start the emulator and wait (bounded by `ready_timeout`) until ipmitool gets an
        answer. Retries on a fresh port when the port turns out to be shared."""
        if self._proc is not None:
            raise IpmiSimError("ipmi_sim already started")
        for binary in (self._ipmi_sim, self._ipmitool):
            if shutil.which(binary) is None:
                raise IpmiSimError(f"{binary} not found (Debian packages openipmi, ipmitool)")
        last = "not started"
        for _ in range(attempts):
            try:
                self._start_once()
                return self
            except _PortClash as clash:
                last = str(clash)
                self.stop()
            except BaseException:
                self.stop()
                raise
        raise IpmiSimError(f"ipmi_sim did not get a port of its own: {last}")

    def _start_once(self) -> None:
        self.port = free_udp_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fleet-ipmi_sim-"))
        state_dir = self.dir / "state"
        state_dir.mkdir()
        base = str(self.dir)
        if '"' in base or " " in base:
            raise IpmiSimError(f"temporary directory {base!r} cannot go into ipmi_sim's config")
        fill = {
            "@PORT@": str(self.port),
            "@STATE_DIR@": base,
            "@USER@": self.username,
            "@PASSWORD@": self.password,
            "@SOFT_OFF@": "1" if self.soft_off_powers_down else "0",
            "@POWER_M@": str(self.power_step_w),
            # One product per sensor scale (pyghmi's SDR cache key; see the template).
            "@PRODUCT_ID@": f"0x{0xF000 + self.power_step_w:04x}",
            "@POWER_SDR@": power_sdr(self.power_step_w),
            "@POLL_MS@": str(POWER_POLL_MS),
        }
        for name, target in (
            ("ipmi_sim-lan.conf", "lan.conf"),
            ("ipmi_sim-bmc.emu", "bmc.emu"),
            ("chassis_control.sh", "chassis_control.sh"),
        ):
            text = _template(name)
            for key, value in fill.items():
                text = text.replace(key, value)
            (self.dir / target).write_text(text, encoding="utf-8")
        (self.dir / "chassis_control.sh").chmod(0o755)
        (self.dir / "chassis.power").write_text("1\n" if self.powered_on else "0\n")
        (self.dir / "chassis.log").touch()
        self._write_power_files(self._power_watts)
        output = (self.dir / "ipmi_sim.out").open("wb")
        try:
            self._proc = subprocess.Popen(
                [
                    self._ipmi_sim,
                    "-c",
                    str(self.dir / "lan.conf"),
                    "-f",
                    str(self.dir / "bmc.emu"),
                    "-s",
                    str(state_dir),
                    "-n",
                ],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,  # its own process group: stop() kills the group
            )
        finally:
            output.close()
        _live.add(self)
        self._wait_ready()
        sockets = _udp_sockets_on(self.port)
        if sockets is not None and sockets != 1:
            raise _PortClash(f"{sockets} sockets bound to UDP port {self.port}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last = ""
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                tail = self._output_tail()
                # A port the kernel handed us free can be bound by another process (a client's
                # ephemeral UDP socket, without SO_REUSEADDR) before ipmi_sim binds it.
                error = _PortClash if "Address already in use" in tail else IpmiSimError
                raise error(
                    f"ipmi_sim exited with status {self._proc.returncode} before answering "
                    f"on UDP port {self.port}: {tail}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise IpmiSimError(
                    f"ipmi_sim did not answer on UDP port {self.port} within "
                    f"{self.ready_timeout:g} s: {last or self._output_tail()}"
                )
            try:
                self._ipmitool_run("chassis", "power", "status", timeout=min(2.0, remaining))
                return
            except IpmiSimError as exc:
                last = str(exc)
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM the emulator's process group, SIGKILL after `grace` s; always reaped.
        Removes its temporary directory. Safe to call more than once."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None:
                _stop_group(proc, grace)
            # The port stays reserved in this process: a client's cached IPMI session for the
            # old emulator must never meet a new one on the same port.
            _live.discard(self)
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -----------------------------------------------------------------------------------------
    # what tests (and the virtual colo) look at

    def bmc_target(self, server: str, timeouts: Timeouts | None = None) -> BmcTarget:
        """A BmcTarget for this emulator, as the service would build it for a server."""
        return BmcTarget(
            server=server,
            protocol=BmcProtocol.IPMI,
            address=HOST,
            port=self.port,
            username=self.username,
            password=self.password,
            timeouts=timeouts or Timeouts(),
        )

    def log_lines(self) -> list[str]:
        """The chassis_control log, one call a line: `<epoch> set power 0`."""
        path = self._path("chassis.log")
        try:
            return path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []

    def log_calls(self) -> list[str]:
        """`log_lines()` without the epoch: `set power 0`, `set power 1`, ..."""
        return [line.split(" ", 1)[1] if " " in line else line for line in self.log_lines()]

    def chassis_power(self) -> bool:
        """The power state the chassis_control program holds (the ground truth)."""
        try:
            return self._path("chassis.power").read_text().strip() == "1"
        except FileNotFoundError:
            return False

    def set_power_behind_our_back(self, on: bool) -> None:
        """Change the power state with ipmitool, as an operator would outside Fleet."""
        self._ipmitool_run("chassis", "power", "on" if on else "off")

    def set_power_watts(self, watts: float | None) -> None:
        """What the BMC's power sensor reads from now on (within ~2 polls, POWER_POLL_MS):
        `watts` rounded to the sensor's step, or None for "no reading" (the sensor reads as
        unavailable). Kept across a restart of the emulator. ValueError for a figure the one-
        byte sensor cannot show: negative, not finite, or above `power_max_w`."""
        if watts is not None and not (math.isfinite(watts) and 0 <= watts <= self.power_max_w):
            raise ValueError(
                f"the power sensor shows 0-{self.power_max_w:g} W, not {watts!r} "
                "(give IpmiSim a larger power_max_w)"
            )
        with self._lock:
            self._power_watts = watts
            if self.dir is not None:
                self._write_power_files(watts)

    def power_watts(self) -> float | None:
        """The figure last given to `set_power_watts` (None: no reading)."""
        return self._power_watts

    def _write_power_files(self, watts: float | None) -> None:
        # Each file replaced whole (ipmi_sim may read at any moment); the figure before the
        # presence bit, so a reading never shows a stale figure as new.
        assert self.dir is not None
        if watts is not None:
            _replace(self.dir / "power.watts", f"{round(watts)}\n")
        elif not (self.dir / "power.watts").exists():
            _replace(self.dir / "power.watts", "0\n")
        _replace(self.dir / "power.present", "1\n" if watts is not None else "0\n")

    def ipmitool(self, *args: str, timeout: float = 5.0) -> str:
        """Run ipmitool (lanplus, cipher suite 3) against this emulator; its stdout."""
        return self._ipmitool_run(*args, timeout=timeout)

    # -----------------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        if self.dir is None:
            raise IpmiSimError("ipmi_sim is not running")
        return self.dir / name

    def _ipmitool_run(self, *args: str, timeout: float = 5.0) -> str:
        # -C 3: without it ipmitool first tries cipher suite 17 and each call takes ~10 s.
        # -N/-R: ipmitool's own per-try timeout and retries, kept inside `timeout`.
        cmd = [
            self._ipmitool,
            "-I",
            "lanplus",
            "-H",
            HOST,
            "-p",
            str(self.port),
            "-U",
            self.username,
            "-E",  # password from $IPMI_PASSWORD: not on the command line
            "-C",
            "3",
            "-N",
            "1",
            "-R",
            "1",
            *args,
        ]
        env = {**os.environ, "IPMI_PASSWORD": self.password}
        try:
            done = subprocess.run(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise IpmiSimError(f"ipmitool {' '.join(args)}: no answer in {timeout:g} s") from exc
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else f"exit status {done.returncode}"
            raise IpmiSimError(f"ipmitool {' '.join(args)}: {last}")
        return done.stdout.decode(errors="replace")

    def _output_tail(self) -> str:
        try:
            text = self._path("ipmi_sim.out").read_text(errors="replace").strip()
        except (FileNotFoundError, IpmiSimError):
            return "(no output)"
        return " | ".join(text.splitlines()[-5:]) or "(no output)"

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"IpmiSim(127.0.0.1:{self.port}, {state})"


def _replace(path: Path, text: str) -> None:
    """Write `path` whole: a reader sees the old content or the new, never a part."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` s for child `pid` to exit WITHOUT reaping it: while it is a zombie
    its PID (and so its process group id) cannot be reused, so killpg stays safe."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the group, SIGKILL it after `grace` s, SIGKILL any member left (chassis_control
    programs share the group) while the leader is still unreaped, then reap the leader."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    if not _exited(proc.pid, grace):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _exited(proc.pid, 10.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class _PortClash(IpmiSimError):
    pass


@atexit.register
def _stop_all() -> None:
    for sim in list(_live):
        sim.stop(grace=1.0)
