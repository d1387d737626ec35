"""A STAND-IN for systemd's `systemctl` and `journalctl` on the virtual colo's SSH hosts.

THIS IS NOT SYSTEMD. A lab host (fleet/lab/ssh_hosts.py) is a mount + PID namespace with an
sshd in it, not a container or VM booting systemd as PID 1, so the tools an operator (and
Ansible's `ansible.builtin.systemd_service`) uses on a real server are played by this module:
small shims first on the host's PATH exec `python -m fleet.lab.standin_systemd ... systemctl
ARGS` (or `journalctl`, `reboot`). Nothing else on the machine is touched.

What it does, for `*.service` units in /etc/systemd/system (the host's own directory):
- [Service] ExecStart (absolute path + arguments, `${VAR}` / `$VAR` from the unit's environment;
  a `-`, `@`, `+`, `!` prefix is accepted), ExecStartPre (`-` ignores its failure),
  Environment=, EnvironmentFile= (KEY=VALUE lines, `#`/`;` comments, quotes stripped; a `-`
  prefix: a missing file is fine), WorkingDirectory= (`-` accepted), Restart= (no, always,
  on-success, on-failure, on-abnormal, on-abort) with RestartSec= (default 100 ms) and the start
  limit ([Unit] StartLimitBurst=5 within StartLimitIntervalSec=10 s by default, 0: no limit;
  then `failed`), TimeoutStopSec= (the lab's default is 15 s, not systemd's 90 s, and 90 s at
  most), KillMode= (control-group; mixed and process SIGTERM the main process only, and SIGKILL
  whatever is left after the timeout, as mixed does); [Install] WantedBy= for
  enable/disable (symlinks in `<target>.wants/`, as systemd makes them).
- Every other option, the hardening ones included (ProtectSystem, NoNewPrivileges, ...), is
  accepted and IGNORED; units run as root (User= is ignored too); every Type= is run like
  `simple`. Unit files are read at each start: `daemon-reload` is accepted and does nothing.
- Each started unit has a supervisor process (`supervise`): a child subreaper, so whatever the
  unit's processes start stays below it, the way a cgroup keeps it; stopping the unit SIGTERMs
  all of them and SIGKILLs what is left after the stop timeout. The unit's stdout/stderr go
  through a pipe into its journal file (one timestamped line each, bounded size), which
  `journalctl -u UNIT [-n N] [--since ...] [-b] [-o short|short-iso|cat]` prints.
- `systemctl show|status|is-active|is-enabled|is-failed|list-unit-files|list-units|start|stop|
  restart|try-restart|enable|disable|daemon-reload|daemon-reexec|reset-failed|reboot`, with
  systemd's exit codes (is-active 3 when not active, is-enabled 1 when disabled, ...).
- `systemctl reboot` (and `reboot`) writes the host's reboot-request file: the lab's controller
  takes the host down (units stopped, then every process of the namespace) and boots it again
  after the boot delay; the BMC stays on. `boot` (run by the host's init) starts the enabled
  units; `shutdown` stops every running unit.

Runtime state (one JSON file per unit) lives in /run/standin-systemd, a tmpfs of the host's
namespace, so it is gone after a reboot, like systemd's; the journal and the enablement
symlinks are on disk and survive it. Stdlib only: it starts for every command Ansible runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fnmatch
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

MODULE = "fleet.lab.standin_systemd"  # not __name__: that is __main__ when run with -m
UNITS_DIR = Path("/etc/systemd/system")
RUN_DIR = Path("/run/standin-systemd")
REBOOT_REQUEST = "reboot-request"
JOURNAL_DIR = "journal"
DEFAULT_TARGET = "multi-user.target"
START_WAIT_S = 10.0  # `systemctl start`: the supervisor reports the unit started or failed
DEFAULT_STOP_TIMEOUT_S = 15.0
MAX_STOP_TIMEOUT_S = 90.0
DEFAULT_RESTART_S = 0.1
MAX_RESTART_S = 60.0
PRE_TIMEOUT_S = 90.0  # one ExecStartPre
JOURNAL_MAX_BYTES = 16 << 20  # per unit; one rotated file is kept besides
JOURNAL_LINE_MAX = 16 << 10
POLL_S = 0.05
EXEC_FAILED = 203  # systemd's status when ExecStart cannot be executed

_PR_SET_CHILD_SUBREAPER = 36


class StandinError(Exception):
    """A command that cannot be done: printed as one line, with systemd's exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Paths:
    """Where this host's units, runtime state and journal are (see the module doc)."""

    host_dir: Path
    hostname: str = "localhost"
    units: Path = UNITS_DIR
    run: Path = RUN_DIR

    @property
    def journal(self) -> Path:
        return self.host_dir / JOURNAL_DIR

    @property
    def reboot_request(self) -> Path:
        return self.host_dir / REBOOT_REQUEST

    def base_args(self) -> list[str]:
        """The arguments that give another process of this module the same paths."""
        return [
            "--host-dir",
            str(self.host_dir),
            "--hostname",
            self.hostname,
            "--units",
            str(self.units),
            "--run",
            str(self.run),
        ]


# ---------------------------------------------------------------------------------------------
# Unit files


@dataclass
class Unit:
    name: str
    path: Path
    description: str = ""
    exec_start: list[str] = field(default_factory=list)
    exec_start_pre: list[tuple[list[str], bool]] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    environment_files: list[tuple[Path, bool]] = field(default_factory=list)  # (path, optional)
    working_directory: Path | None = None
    restart: str = "no"
    restart_s: float = DEFAULT_RESTART_S
    timeout_stop_s: float = DEFAULT_STOP_TIMEOUT_S
    kill_mode: str = "control-group"  # mixed/process: SIGTERM to the main process only first
    start_limit_burst: int = 5
    start_limit_interval_s: float = 10.0
    wanted_by: list[str] = field(default_factory=list)
    raw_exec_start: str = ""


def unit_name(name: str) -> str:
    """`fleet-agent` → `fleet-agent.service`; other suffixes are kept (and never found)."""
    if not name or "/" in name or name.startswith("."):
        raise StandinError(f"Invalid unit name {name!r}")
    return name if "." in name else f"{name}.service"


def _sections(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI: [Section], Key=Value (repeatable; an empty value resets the list),
    `#`/`;` comments, a trailing backslash continues the line."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1].strip(), {})
            continue
        if current is None or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if value:
            current.setdefault(key, []).append(value)
        else:
            current[key] = []
    return sections


def _seconds(value: str, default: float) -> float:
    """systemd time spans: `5`, `5s`, `100ms`, `1min 30s`, `2h`; `infinity` → the default."""
    total, seen = 0.0, False
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "": 1}
    for number, unit in re.findall(r"([\d.]+)\s*([a-z]*)", value.lower()):
        if unit not in units:
            return default
        try:
            total += float(number) * units[unit]
        except ValueError:
            return default
        seen = True
    return total if seen else default


def load_unit(paths: Paths, name: str) -> Unit | None:
    """The unit `name` from the units directory; None when there is no such file."""
    name = unit_name(name)
    path = paths.units / name
    if not name.endswith(".service") or not path.is_file():
        return None
    try:
        sections = _sections(path.read_text(errors="replace"))
    except OSError as exc:
        raise StandinError(f"Failed to read {path}: {exc.strerror}") from None
    unit_s, service, install = (sections.get(s, {}) for s in ("Unit", "Service", "Install"))

    def last(section: dict[str, list[str]], key: str, default: str = "") -> str:
        values = section.get(key) or [default]
        return values[-1]

    unit = Unit(name=name, path=path, description=last(unit_s, "Description", name))
    unit.raw_exec_start = last(service, "ExecStart")
    unit.exec_start = _command(unit.raw_exec_start)[0] if unit.raw_exec_start else []
    unit.exec_start_pre = [_command(v) for v in service.get("ExecStartPre", [])]
    for value in service.get("Environment", []):
        for word in shlex.split(value):
            key, sep, val = word.partition("=")
            if sep:
                unit.environment[key] = val
    for value in service.get("EnvironmentFile", []):
        optional = value.startswith("-")
        unit.environment_files.append((Path(value.lstrip("-")), optional))
    workdir = last(service, "WorkingDirectory").lstrip("-")
    if workdir:
        unit.working_directory = Path("/root") if workdir == "~" else Path(workdir)
    unit.restart = last(service, "Restart", "no")
    unit.restart_s = min(_seconds(last(service, "RestartSec", "100ms"), 0.1), MAX_RESTART_S)
    stop = last(service, "TimeoutStopSec") or last(service, "TimeoutSec")
    unit.timeout_stop_s = min(
        _seconds(stop, DEFAULT_STOP_TIMEOUT_S) if stop else DEFAULT_STOP_TIMEOUT_S,
        MAX_STOP_TIMEOUT_S,
    )
    unit.kill_mode = last(service, "KillMode", "control-group")
    with contextlib.suppress(ValueError):
        unit.start_limit_burst = int(last(unit_s, "StartLimitBurst", "5"))
    interval = last(unit_s, "StartLimitIntervalSec") or last(service, "StartLimitInterval")
    unit.start_limit_interval_s = _seconds(interval, 10.0) if interval else 10.0
    unit.wanted_by = [w for v in install.get("WantedBy", []) for w in v.split()]
    return unit


def _command(value: str) -> tuple[list[str], bool]:
    """An Exec*= line: its argv and whether its failure is ignored (`-`)."""
    prefix = re.match(r"^[-@+!:]*", value)
    flags = prefix.group(0) if prefix else ""
    argv = shlex.split(value[len(flags) :])
    return argv, "-" in flags


def _read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def unit_environment(unit: Unit) -> dict[str, str]:
    """What the unit's processes get: a minimal base (systemd's), Environment=, the files."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "INVOCATION_ID": uuid.uuid4().hex,
    }
    env.update(unit.environment)
    for path, optional in unit.environment_files:
        try:
            env.update(_read_env_file(path))
        except OSError:
            if not optional:
                raise StandinError(f"{unit.name}: failed to load environment file {path}") from None
    return env


def _expand(argv: Sequence[str], env: dict[str, str]) -> list[str]:
    """systemd's ExecStart expansion: a word that is exactly `$VAR` splits into words;
    `${VAR}` inside a word is replaced."""
    out: list[str] = []
    for word in argv:
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            out.extend(env.get(bare.group(1), "").split())
            continue
        out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word))
    return out


# ---------------------------------------------------------------------------------------------
# Enablement (symlinks, as systemd makes them) and runtime state


def _wants_links(paths: Paths, name: str) -> list[Path]:
    if not paths.units.is_dir():
        return []
    return [
        d / name
        for d in sorted(paths.units.iterdir())
        if d.name.endswith((".wants", ".requires")) and (d / name).is_symlink()
    ]


def unit_file_state(paths: Paths, unit: Unit) -> str:
    if _wants_links(paths, unit.name):
        return "enabled"
    return "disabled" if unit.wanted_by else "static"


@dataclass
class Runtime:
    """A unit's runtime state, written by its supervisor."""

    active: str = "inactive"  # active, activating, deactivating, failed, inactive
    sub: str = "dead"  # running, auto-restart, stop-sigterm, dead, failed
    result: str = "success"
    supervisor: int = 0
    supervisor_start: int = 0
    main_pid: int = 0
    exec_main_status: int = 0
    n_restarts: int = 0
    invocation: str = ""
    active_enter: float = 0.0
    inactive_enter: float = 0.0
    changed: float = 0.0


def _state_file(paths: Paths, name: str) -> Path:
    return paths.run / f"{name}.json"


def read_runtime(paths: Paths, name: str) -> Runtime:
    try:
        data = json.loads(_state_file(paths, name).read_text())
        state = Runtime(**{k: v for k, v in data.items() if k in Runtime.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return Runtime()
    if state.active in ("active", "activating", "deactivating") and not _alive(
        state.supervisor, state.supervisor_start
    ):
        # The supervisor died without saying so (killed): systemd would call that a failure.
        state.active, state.sub, state.result, state.main_pid = "failed", "failed", "signal", 0
    return state


def write_runtime(paths: Paths, name: str, state: Runtime) -> None:
    paths.run.mkdir(parents=True, exist_ok=True)
    state.changed = time.time()
    target = _state_file(paths, name)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state.__dict__))
    os.replace(tmp, target)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> int:
    stat = _stat(pid)
    return int(stat[19]) if stat else 0


def _alive(pid: int, start: int = 0) -> bool:
    if pid <= 0:
        return False
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return not start or int(stat[19]) == start


def _descendants(root: int) -> list[int]:
    """Every live process below `root` (from /proc, children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] not in ("Z", "X"):
                children.setdefault(int(stat[1]), []).append(int(entry))
    found: list[int] = []
    queue = [root]
    while queue and len(found) < 100_000:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# ---------------------------------------------------------------------------------------------
# The journal


def _journal_file(paths: Paths, name: str) -> Path:
    return paths.journal / f"{name}.log"


def journal_append(paths: Paths, name: str, ident: str, pid: int, message: str) -> None:
    """One line `<epoch> <ident>[<pid>]: <message>`; the file is rotated past its bound."""
    path = _journal_file(paths, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if path.stat().st_size > JOURNAL_MAX_BYTES:
            os.replace(path, path.with_suffix(".log.1"))
    line = message.replace("\r", "")[:JOURNAL_LINE_MAX]
    with path.open("a", encoding="utf-8", errors="replace") as out:
        out.write(f"{time.time():.6f} {ident}[{pid}]: {line}\n")


def _journal_lines(paths: Paths, name: str) -> list[tuple[float, str]]:
    lines: list[tuple[float, str]] = []
    path = _journal_file(paths, name)
    for part in (path.with_suffix(".log.1"), path):
        try:
            text = part.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for raw in text.splitlines():
            stamp, _, rest = raw.partition(" ")
            try:
                lines.append((float(stamp), rest))
            except ValueError:
                continue
    return lines


# ---------------------------------------------------------------------------------------------
# The supervisor: one process per started unit


class _Supervisor:
    def __init__(self, paths: Paths, name: str, invocation: str) -> None:
        self.paths, self.name = paths, name
        self.runtime = Runtime(
            active="activating",
            sub="start",
            supervisor=os.getpid(),
            supervisor_start=_start_ticks(os.getpid()),
            invocation=invocation,
        )
        self.stop_requested = False
        self.read_fd, self.write_fd = os.pipe()
        self.main: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []
        self.reader = threading.Thread(target=self._read_output, daemon=True)

    def log(self, message: str) -> None:
        journal_append(self.paths, self.name, "systemd", 1, message)

    def _read_output(self) -> None:
        with os.fdopen(self.read_fd, "rb", buffering=0) as src:
            buffer = b""
            while True:
                chunk = src.read(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                if len(buffer) > JOURNAL_LINE_MAX:
                    lines.append(buffer)
                    buffer = b""
                pid = self.main.pid if self.main is not None else 0
                ident = self.name.removesuffix(".service")
                for line in lines:
                    journal_append(self.paths, self.name, ident, pid, line.decode(errors="replace"))
            if buffer:
                journal_append(self.paths, self.name, self.name, 0, buffer.decode(errors="replace"))

    def run(self) -> int:
        if ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            self.log("could not become a child subreaper: stray processes go to the host's init")
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.reader.start()
        try:
            return self._loop()
        finally:
            os.close(self.write_fd)
            self.reader.join(2.0)

    def _on_term(self, *_: object) -> None:
        self.stop_requested = True

    def _save(self) -> None:
        write_runtime(self.paths, self.name, self.runtime)

    def _loop(self) -> int:
        while True:
            code = self._run_once()
            if self.stop_requested:
                self._finish("inactive", "dead", "success")
                return 0
            clean = code == 0
            unit = self._unit()
            restart = unit.restart if unit is not None else "no"
            wanted = {
                "always": True,
                "on-success": clean,
                "on-failure": not clean,
                "on-abnormal": code < 0,
                "on-abort": code < 0 and -code not in (signal.SIGTERM, signal.SIGHUP),
            }.get(restart, False)
            if not wanted:
                self._kill_rest(unit.timeout_stop_s if unit else DEFAULT_STOP_TIMEOUT_S)
                if clean:
                    self._finish("inactive", "dead", "success")
                    return 0
                self._finish("failed", "failed", "exit-code" if code > 0 else "signal")
                return 1
            assert unit is not None
            now = time.monotonic()
            recent = [t for t in self.starts if now - t < unit.start_limit_interval_s]
            if len(recent) >= unit.start_limit_burst:
                self.log(f"{self.name}: start request repeated too quickly.")
                self._kill_rest(unit.timeout_stop_s)
                self._finish("failed", "failed", "start-limit-hit")
                return 1
            self._kill_rest(unit.timeout_stop_s)  # the rest of the unit goes first, as systemd does
            self.runtime.active, self.runtime.sub, self.runtime.main_pid = (
                "activating",
                "auto-restart",
                0,
            )
            self._save()
            self.log(
                f"{self.name}: scheduled restart job, restart counter is at "
                f"{self.runtime.n_restarts + 1}."
            )
            deadline = time.monotonic() + unit.restart_s
            while time.monotonic() < deadline and not self.stop_requested:
                self._reap()
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if self.stop_requested:
                self._kill_rest(unit.timeout_stop_s)
                self._finish("inactive", "dead", "success")
                return 0
            self.runtime.n_restarts += 1

    def _unit(self) -> Unit | None:
        try:
            return load_unit(self.paths, self.name)
        except StandinError:
            return None

    def _run_once(self) -> int:
        """Start the unit's main process and wait for it: its exit code, or -signal."""
        self.starts.append(time.monotonic())
        unit = self._unit()
        if unit is None or not unit.exec_start:
            self.log(f"{self.name}: no ExecStart= (or the unit file is gone)")
            return EXEC_FAILED
        try:
            env = unit_environment(unit)
        except StandinError as exc:
            self.log(str(exc))
            return 1
        cwd = unit.working_directory if unit.working_directory else Path("/")
        for argv, ignore in unit.exec_start_pre:
            code = self._run_pre(_expand(argv, env), env, cwd)
            if code != 0 and not ignore:
                self.log(f"{self.name}: ExecStartPre {argv[0]} failed with status {code}")
                return code if code > 0 else 1
        argv = _expand(unit.exec_start, env)
        try:
            self.main = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=self.write_fd,
                stderr=self.write_fd,
                start_new_session=True,
            )
        except OSError as exc:
            self.log(f"{self.name}: failed to execute {argv[0] if argv else '?'}: {exc.strerror}")
            return EXEC_FAILED
        self.runtime.main_pid = self.main.pid
        self.runtime.active, self.runtime.sub = "active", "running"
        self.runtime.active_enter = time.time()
        self._save()
        self.log(f"Started {unit.description}.")
        while True:
            exited = self._reap()
            if exited is not None:
                return exited
            if self.stop_requested:
                self._stop(unit)
                return 0
            time.sleep(POLL_S)

    def _run_pre(self, argv: list[str], env: dict[str, str], cwd: Path) -> int:
        try:
            pre = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=self.write_fd,
                stderr=self.write_fd,
                start_new_session=True,
            )
        except OSError:
            return EXEC_FAILED
        deadline = time.monotonic() + PRE_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop_requested:
            done = os.waitpid(pre.pid, os.WNOHANG)
            if done[0]:
                pre.returncode = os.waitstatus_to_exitcode(done[1])
                return pre.returncode
            time.sleep(POLL_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pre.pid, signal.SIGKILL)
        os.waitpid(pre.pid, 0)
        pre.returncode = -signal.SIGKILL
        return 1

    def _reap(self) -> int | None:
        """Reap every exited child (orphans come to us: we are a subreaper); the main
        process's exit code (or -signal) once it has exited."""
        result = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if self.main is not None and pid == self.main.pid:
                self.main.returncode = code = os.waitstatus_to_exitcode(status)
                self.runtime.exec_main_status = code if code >= 0 else -code
                result = code
        return result

    def _stop(self, unit: Unit) -> None:
        """SIGTERM every process of the unit; SIGKILL what is left after the timeout."""
        self.runtime.active, self.runtime.sub = "deactivating", "stop-sigterm"
        self._save()
        self.log(f"Stopping {unit.description}...")
        self._kill_rest(unit.timeout_stop_s, main_only=unit.kill_mode in ("mixed", "process"))

    def _kill_rest(self, timeout_s: float, main_only: bool = False) -> None:
        """SIGTERM the unit's processes (KillMode=mixed/process: its main process only, which
        stops the rest itself), SIGKILL every one left after `timeout_s`."""
        main = self.main.pid if self.main is not None and self.main.returncode is None else 0
        _signal_all([main] if main_only and main else _descendants(os.getpid()), signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._reap()
            if not _descendants(os.getpid()):
                return
            time.sleep(POLL_S)
        left = _descendants(os.getpid())
        if left:
            self.log(f"{self.name}: still up {timeout_s:g} s after SIGTERM: killing {len(left)}")
        for _ in range(50):
            _signal_all(left, signal.SIGKILL)
            self._reap()
            left = _descendants(os.getpid())
            if not left:
                break
            time.sleep(POLL_S)

    def _finish(self, active: str, sub: str, result: str) -> None:
        self.runtime.active, self.runtime.sub, self.runtime.result = active, sub, result
        self.runtime.main_pid = 0
        self.runtime.inactive_enter = time.time()
        self._save()
        self.log(f"{self.name}: {'Failed' if active == 'failed' else 'Stopped'} ({result}).")


# ---------------------------------------------------------------------------------------------
# Operations


def _require(paths: Paths, name: str) -> Unit:
    unit = load_unit(paths, name)
    if unit is None:
        raise StandinError(f"Unit {unit_name(name)} not found.", 5)
    return unit


def start(paths: Paths, name: str) -> None:
    unit = _require(paths, name)
    state = read_runtime(paths, unit.name)
    if state.active in ("active", "activating"):
        return
    if not unit.exec_start:
        raise StandinError(f"Unit {unit.name} has no ExecStart= setting. Refusing.")
    invocation = uuid.uuid4().hex
    paths.run.mkdir(parents=True, exist_ok=True)
    subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            MODULE,
            *paths.base_args(),
            "supervise",
            unit.name,
            invocation,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        state = read_runtime(paths, unit.name)
        if state.invocation == invocation and state.sub != "start":
            if state.active == "failed":
                break
            return
        time.sleep(POLL_S)
    raise StandinError(
        f"Job for {unit.name} failed because the control process exited with error code.\n"
        f'See "systemctl status {unit.name}" and "journalctl -u {unit.name}" for details.'
    )


def stop(paths: Paths, name: str) -> None:
    unit = load_unit(paths, name)
    uname = unit_name(name)
    state = read_runtime(paths, uname)
    if not _alive(state.supervisor, state.supervisor_start):
        return
    timeout = (unit.timeout_stop_s if unit else DEFAULT_STOP_TIMEOUT_S) + 5
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.supervisor, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(state.supervisor, state.supervisor_start) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if _alive(state.supervisor, state.supervisor_start):
        _signal_all([*_descendants(state.supervisor), state.supervisor], signal.SIGKILL)
        state.active, state.sub, state.main_pid = "inactive", "dead", 0
        write_runtime(paths, uname, state)


def enable(paths: Paths, name: str, out: list[str]) -> None:
    unit = _require(paths, name)
    if not unit.wanted_by:
        out.append(
            f"The unit files have no installation config (WantedBy=, ...) for {unit.name}: "
            "they are not meant to be enabled."
        )
        return
    for target in unit.wanted_by:
        link = paths.units / f"{target}.wants" / unit.name
        if link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(unit.path)
        out.append(f"Created symlink {link} → {unit.path}.")


def disable(paths: Paths, name: str, out: list[str]) -> None:
    uname = unit_name(name)
    for link in _wants_links(paths, uname):
        link.unlink()
        out.append(f"Removed {link}.")


def all_units(paths: Paths) -> list[str]:
    if not paths.units.is_dir():
        return []
    return sorted(p.name for p in paths.units.glob("*.service") if p.is_file())


def boot(paths: Paths) -> list[str]:
    """What systemd does at boot for these units: start the enabled ones; their names."""
    paths.run.mkdir(parents=True, exist_ok=True)
    (paths.run / "boot").write_text(f"{time.time():.6f} {uuid.uuid4().hex}\n")
    started = []
    for name in all_units(paths):
        if _wants_links(paths, name):
            try:
                start(paths, name)
                started.append(name)
            except StandinError as exc:
                journal_append(paths, name, "systemd", 1, f"at boot: {exc}")
    return started


def shutdown(paths: Paths, timeout_s: float) -> None:
    """Stop every running unit at once (SIGTERM to their supervisors), bounded."""
    running = []
    for name in all_units(paths) + [p.stem for p in paths.run.glob("*.service.json")]:
        state = read_runtime(paths, name)
        if _alive(state.supervisor, state.supervisor_start):
            running.append(state)
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.supervisor, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
        _alive(s.supervisor, s.supervisor_start) for s in running
    ):
        time.sleep(POLL_S)


def _stamp(epoch: float) -> str:
    if not epoch:
        return ""
    return datetime.fromtimestamp(epoch, UTC).strftime("%a %Y-%m-%d %H:%M:%S UTC")


def show(paths: Paths, name: str) -> dict[str, str]:
    """The properties `systemctl show` prints (what ansible's systemd_service reads)."""
    uname = unit_name(name)
    unit = load_unit(paths, uname)
    state = read_runtime(paths, uname)
    props = {
        "Type": "simple",
        "Restart": unit.restart if unit else "no",
        "MainPID": str(state.main_pid),
        "ExecMainPID": str(state.main_pid),
        "ExecMainStatus": str(state.exec_main_status),
        "NRestarts": str(state.n_restarts),
        "Result": state.result,
        "Id": uname,
        "Names": uname,
        "Description": unit.description if unit else uname,
        "LoadState": "loaded" if unit else "not-found",
        "ActiveState": state.active,
        "SubState": state.sub,
        "FragmentPath": str(unit.path) if unit else "",
        "UnitFileState": unit_file_state(paths, unit) if unit else "",
        "UnitFilePreset": "enabled" if unit else "",
        "InvocationID": state.invocation,
        "ActiveEnterTimestamp": _stamp(state.active_enter),
        "InactiveEnterTimestamp": _stamp(state.inactive_enter),
        "StateChangeTimestamp": _stamp(state.changed),
        "CanStart": "yes" if unit else "no",
        "CanStop": "yes" if unit else "no",
        "CanReload": "no",
        "NeedDaemonReload": "no",
        "WantedBy": " ".join(unit.wanted_by) if unit else "",
        "WorkingDirectory": str(unit.working_directory or "") if unit else "",
        "EnvironmentFiles": " ".join(
            f"{p} (ignore_errors={'yes' if o else 'no'})" for p, o in unit.environment_files
        )
        if unit
        else "",
        "ExecStart": (
            f"{{ path={unit.exec_start[0]} ; argv[]={' '.join(unit.exec_start)} ; "
            f"ignore_errors=no ; start_time=[{_stamp(state.active_enter)}] ; "
            f"pid={state.main_pid} ; "
            f"code={'(null)' if state.main_pid else 'exited'} ; status={state.exec_main_status} }}"
            if unit and unit.exec_start
            else ""
        ),
    }
    if unit is None:
        props["LoadError"] = f'org.freedesktop.systemd1.NoSuchUnit "Unit {uname} not found."'
    return props


def status_text(paths: Paths, name: str) -> tuple[str, int]:
    props = show(paths, name)
    uname = props["Id"]
    if props["LoadState"] == "not-found":
        return f"Unit {uname} could not be found.", 4
    active = props["ActiveState"]
    since = props["ActiveEnterTimestamp"] if active == "active" else props["StateChangeTimestamp"]
    lines = [
        f"{'●' if active == 'active' else '○'} {uname} - {props['Description']}",
        f"     Loaded: loaded ({props['FragmentPath']}; {props['UnitFileState']}; "
        "preset: enabled)  [stand-in systemd]",
        f"     Active: {active} ({props['SubState']}) since {since}",
    ]
    if props["MainPID"] != "0":
        lines.append(f"   Main PID: {props['MainPID']}")
    lines.append("")
    lines += [
        _render(t, rest, paths.hostname, "short") for t, rest in _journal_lines(paths, uname)[-10:]
    ]
    return "\n".join(lines), 0 if active == "active" else 3


def _render(epoch: float, rest: str, host: str, fmt: str) -> str:
    when = datetime.fromtimestamp(epoch, UTC)
    if fmt == "cat":
        return rest.split(": ", 1)[1] if ": " in rest else rest
    if fmt == "short-iso":
        return f"{when.strftime('%Y-%m-%dT%H:%M:%S%z')} {host} {rest}"
    return f"{when.strftime('%b %d %H:%M:%S')} {host} {rest}"


def parse_since(value: str, now: datetime | None = None) -> float:
    """journalctl's --since: `YYYY-MM-DD [HH:MM[:SS]]`, `HH:MM[:SS]` (today), `today`,
    `yesterday`, `now`, `-30min`/`-2h`/`-90s`, `N min ago` (UTC)."""
    now = now or datetime.now(UTC)
    text = value.strip().lower()
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    named = {"now": now, "today": midnight, "yesterday": midnight - timedelta(days=1)}
    if text in named:
        return named[text].timestamp()
    relative = re.fullmatch(r"-?\s*(\d+(?:\.\d+)?)\s*([a-z]*)(?:\s+ago)?", text)
    if relative and (text.startswith("-") or text.endswith("ago")):
        return (now - timedelta(seconds=_seconds(relative[1] + relative[2], 0.0))).timestamp()
    for fmt in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y-%m-%dT%H:%M:%S"):
        with contextlib.suppress(ValueError):
            return (
                datetime.strptime(text.upper() if "T" in fmt else text, fmt)
                .replace(tzinfo=UTC)
                .timestamp()
            )
    for fmt in ("%H:%M:%S", "%H:%M"):
        with contextlib.suppress(ValueError):
            clock = datetime.strptime(text, fmt)
            return midnight.replace(
                hour=clock.hour, minute=clock.minute, second=clock.second
            ).timestamp()
    raise StandinError(f"Failed to parse timestamp: {value}")


# ---------------------------------------------------------------------------------------------
# The command lines


def _split_options(args: Sequence[str], with_value: Set[str]) -> tuple[list[str], dict[str, str]]:
    """Positional words and options (`--x=v`, `--x v`, `-p v`, flags → "")."""
    words: list[str] = []
    options: dict[str, str] = {}
    items = list(args)
    i = 0
    while i < len(items):
        item = items[i]
        i += 1
        if item == "--":
            words += items[i:]
            break
        if item.startswith("--"):
            key, sep, value = item.partition("=")
            if not sep and key in with_value and i < len(items):
                value, i = items[i], i + 1
            options[key] = value
        elif item.startswith("-") and len(item) > 1 and not item[1].isdigit():
            key = item[:2]
            value = item[2:]
            if not value and key in with_value and i < len(items):
                value, i = items[i], i + 1
            elif value and key not in with_value:  # bundled flags: -lq
                for flag in item[1:]:
                    options[f"-{flag}"] = ""
                continue
            options[key] = value
        else:
            words.append(item)
    return words, options


SYSTEMCTL_FLAGS = {
    "-l",
    "--full",
    "--no-pager",
    "--no-legend",
    "-q",
    "--quiet",
    "--now",
    "--no-block",
    "--force",
    "-f",
    "--value",
    "--system",
    "-a",
    "--all",
    "--plain",
    "--no-ask-password",
    "--type",
    "-t",
    "--state",
    "-p",
    "--property",
    "--lines",
    "-n",
    "--output",
    "-o",
}


def systemctl(paths: Paths, args: Sequence[str]) -> int:
    words, options = _split_options(
        args, {"-p", "--property", "-t", "--type", "--state", "-n", "--lines", "-o", "--output"}
    )
    for option in options:
        if option in ("--user", "--global"):
            raise StandinError(f"{option}: the lab's stand-in systemctl runs system units only")
        if option not in SYSTEMCTL_FLAGS:
            raise StandinError(f"systemctl: unrecognized option '{option}' (stand-in systemd)")
    quiet = "-q" in options or "--quiet" in options
    if not words:
        words = ["list-units"]
    verb, names = words[0], words[1:]
    out: list[str] = []
    code = 0
    if verb in ("daemon-reload", "daemon-reexec"):
        pass
    elif verb == "show":
        wanted = [
            p for v in (options.get("-p"), options.get("--property")) if v for p in v.split(",")
        ]
        for i, name in enumerate(names or []):
            props = show(paths, name)
            if i:
                out.append("")
            for key, value in props.items():
                if wanted and key not in wanted:
                    continue
                out.append(value if "--value" in options else f"{key}={value}")
    elif verb in ("is-active", "is-failed"):
        want = {"is-active": ("active", "reloading"), "is-failed": ("failed",)}[verb]
        code = 3 if verb == "is-active" else 1
        for name in names:
            state = read_runtime(paths, unit_name(name))
            out.append(state.active)
            if state.active in want:
                code = 0
    elif verb == "is-enabled":
        code = 1
        for name in names:
            unit = load_unit(paths, name)
            if unit is None:
                raise StandinError(
                    f"Failed to get unit file state for {unit_name(name)}: No such file or "
                    "directory",
                    1,
                )
            file_state = unit_file_state(paths, unit)
            out.append(file_state)
            if file_state in ("enabled", "static"):
                code = 0
    elif verb in ("start", "stop", "restart", "try-restart", "reload-or-restart"):
        if not names:
            raise StandinError(f"Too few arguments: systemctl {verb} UNIT...")
        for name in names:
            if verb == "try-restart" and read_runtime(paths, unit_name(name)).active != "active":
                continue
            if verb != "start":
                if verb != "stop":
                    _require(paths, name)
                stop(paths, name)
            if verb != "stop":
                start(paths, name)
    elif verb in ("reload", "mask", "unmask", "kill", "edit", "set-property", "link"):
        raise StandinError(f"systemctl {verb}: not supported by the lab's stand-in systemd")
    elif verb in ("enable", "disable"):
        for name in names:
            (enable if verb == "enable" else disable)(paths, name, out)
            if "--now" in options:
                (start if verb == "enable" else stop)(paths, name)
        sys.stderr.write("".join(f"{line}\n" for line in out))
        out = []
    elif verb == "reset-failed":
        for name in names or all_units(paths):
            state = read_runtime(paths, unit_name(name))
            if state.active == "failed":
                write_runtime(paths, unit_name(name), Runtime())
    elif verb == "status":
        texts = [status_text(paths, name) for name in names]
        out += [t for t, _ in texts]
        code = max((c for _, c in texts), default=0)
    elif verb == "list-unit-files":
        pattern = names[0] if names else "*"
        rows = []
        for name in all_units(paths):
            if fnmatch.fnmatch(name, pattern):
                unit = load_unit(paths, name)
                if unit is not None:
                    rows.append((name, unit_file_state(paths, unit)))
        if "--no-legend" not in options:
            out.append(f"{'UNIT FILE':<40} {'STATE':<9} PRESET")
        out += [f"{n:<40} {s:<9} enabled" for n, s in rows]
        if "--no-legend" not in options:
            out += ["", f"{len(rows)} unit files listed."]
        code = 0 if rows else 1
    elif verb == "list-units":
        for name in all_units(paths):
            state = read_runtime(paths, name)
            if state.active != "inactive" or "--all" in options or "-a" in options:
                unit = load_unit(paths, name)
                desc = unit.description if unit else name
                out.append(f"{name:<40} loaded {state.active:<10} {state.sub:<12} {desc}")
    elif verb in ("reboot", "poweroff", "halt"):
        if verb != "reboot":
            raise StandinError(
                f"systemctl {verb}: the lab's stand-in only reboots; power off through the BMC"
            )
        request_reboot(paths)
    else:
        raise StandinError(f"Unknown command verb '{verb}' (stand-in systemd).")
    if out and not (quiet and verb in ("is-active", "is-enabled", "is-failed")):
        print("\n".join(out))
    return code


def request_reboot(paths: Paths) -> None:
    """Ask the lab to reboot this host: it stops the units, then the host, and boots again."""
    paths.reboot_request.write_text(f"{time.time():.6f}\n")
    journal_append(paths, "systemd-logind.service", "systemd-logind", 1, "System is rebooting.")


# journalctl's options that take a value (the rest are flags).
_JOURNAL_VALUE_OPTIONS = frozenset(
    {"-u", "--unit", "-n", "--lines", "-S", "--since", "-U", "--until", "-o", "--output"}
    | {"-p", "--priority", "-t", "--identifier"}
)


def journalctl(paths: Paths, args: Sequence[str]) -> int:
    args = list(args)
    for i, item in enumerate(args[:-1]):  # `-b [ID|±N]`: the stand-in knows this boot only
        if item in ("-b", "--boot") and re.fullmatch(r"-?\d+|[0-9a-f]{32}", args[i + 1]):
            del args[i + 1]
            break
    words, options = _split_options(args, _JOURNAL_VALUE_OPTIONS)
    units = [unit_name(v) for k, v in _all_options(args, ("-u", "--unit")) if v]
    known = _JOURNAL_VALUE_OPTIONS | {
        "--no-pager",
        "-q",
        "--quiet",
        "-b",
        "--boot",
        "-k",
        "--dmesg",
        "-x",
        "--catalog",
        "-e",
        "--pager-end",
        "--utc",
        "-a",
        "--all",
        "-l",
        "--full",
        "--no-hostname",
        "-r",
        "--reverse",
        "--no-tail",
    }
    for option in options:
        if option not in known:
            raise StandinError(f"journalctl: unrecognized option '{option}' (stand-in journald)")
    if words:
        raise StandinError("journalctl: matches other than -u UNIT are not supported (stand-in)")
    fmt = options.get("-o") or options.get("--output") or "short"
    if fmt not in ("short", "short-iso", "cat", "short-precise"):
        raise StandinError(f"journalctl: output mode {fmt!r} not supported by the stand-in")
    if "-k" in options or "--dmesg" in options:
        lines: list[tuple[float, str]] = []  # no kernel here: the lab's GPUs are simulated
    else:
        names = units or sorted(p.name.removesuffix(".log") for p in paths.journal.glob("*.log"))
        lines = sorted(line for name in names for line in _journal_lines(paths, name))
    since = options.get("-S") or options.get("--since")
    if since:
        cut = parse_since(since)
        lines = [line for line in lines if line[0] >= cut]
    until = options.get("-U") or options.get("--until")
    if until:
        cut = parse_since(until)
        lines = [line for line in lines if line[0] <= cut]
    if "-b" in options or "--boot" in options:
        with contextlib.suppress(OSError, ValueError, IndexError):
            booted = float((paths.run / "boot").read_text().split()[0])
            lines = [line for line in lines if line[0] >= booted]
    count = options.get("-n") or options.get("--lines")
    if count is None and ("-e" in options or "--pager-end" in options):
        count = "1000"
    if count not in (None, "", "all", "+0"):
        try:
            lines = lines[-int(str(count)) :] if int(str(count)) > 0 else []
        except ValueError:
            raise StandinError(f"journalctl: failed to parse lines '{count}'") from None
    if "-r" in options or "--reverse" in options:
        lines.reverse()
    if not lines:
        if "-q" not in options and "--quiet" not in options:
            print("-- No entries --")
        return 0
    sys.stdout.write("".join(f"{_render(t, r, paths.hostname, fmt)}\n" for t, r in lines))
    return 0


def _all_options(args: Sequence[str], keys: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """Every occurrence of a repeatable option (journalctl -u A -u B)."""
    items = list(args)
    for i, item in enumerate(items):
        for key in keys:
            if item == key and i + 1 < len(items):
                yield key, items[i + 1]
            elif item.startswith(f"{key}=") and key.startswith("--"):
                yield key, item.split("=", 1)[1]
            elif not key.startswith("--") and item.startswith(key) and len(item) > len(key):
                yield key, item[len(key) :]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="standin-systemd", add_help=False)
    parser.add_argument("--host-dir", type=Path, required=True)
    parser.add_argument("--hostname", default="localhost")
    parser.add_argument("--units", type=Path, default=UNITS_DIR)
    parser.add_argument("--run", type=Path, default=RUN_DIR)
    parser.add_argument("program")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    paths = Paths(ns.host_dir, ns.hostname, ns.units, ns.run)
    try:
        if ns.program == "systemctl":
            return systemctl(paths, ns.args)
        if ns.program == "journalctl":
            return journalctl(paths, ns.args)
        if ns.program == "reboot":
            request_reboot(paths)
            return 0
        if ns.program == "boot":
            boot(paths)
            return 0
        if ns.program == "shutdown":
            shutdown(paths, float(ns.args[0]) if ns.args else DEFAULT_STOP_TIMEOUT_S)
            return 0
        if ns.program == "supervise":
            return _Supervisor(paths, unit_name(ns.args[0]), ns.args[1]).run()
        raise StandinError(f"unknown program {ns.program!r}")
    except StandinError as exc:
        sys.stderr.write(f"{exc}\n")
        return exc.code
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
