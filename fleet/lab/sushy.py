"""sushy-tools' `sushy-emulator` as a child process: a Redfish BMC EMULATOR on 127.0.0.1.

This is a stand-in for real BMC hardware, used by the driver tests and by the virtual colo. It
speaks real Redfish over HTTP(S) with basic auth (no SessionService), serving N fake
ComputerSystems from the emulator's "fake" driver. It runs through the lab's wrapper,
fleet/lab/sushy_power.py (`python -m fleet.lab.sushy_power`): sushy-tools' own app, plus a chassis
per system whose Power resource serves the watts `set_power_watts` gives (sushy-tools has no
Power resource). Quirks worth knowing (see the emulator's source,
`sushy_tools/emulator/resources/systems/fakedriver.py`):

- a Reset answers 204 at once but the new PowerState appears only 1-11 s later, applied on the
  first read of the system after its apply time (there is no "PoweringOn" state);
- a Reset that arrives while another is pending may be dropped;
- each emulator gets its own state directory here (the default one is shared machine-wide), and
  a bcrypt hash at cost 5 (the emulator checks it on every request).

    with SushyEmulator([FakeSystem.new("gpu-node-01"), FakeSystem.new("gpu-node-02", "On")]) as bmc:
        bmc.url, bmc.port, bmc.systems       # http://127.0.0.1:PORT, PORT, [uuid, uuid]

The emulator runs in its own process group; `stop()` (also run by the context manager, by
garbage collection and at interpreter exit) sends SIGTERM to the group, SIGKILL after a grace
period, and always reaps it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid as uuid_mod
import weakref
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any

import bcrypt

from fleet.models import PowerState

TEMPLATE = "templates/sushy-emulator.conf"
START_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
BCRYPT_COST = 5  # the emulator checks the hash on every request: 1.8 ms at 5, 237 ms at 12

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# werkzeug's access log: 127.0.0.1 - - [30/Nov/2026 05:59:58] "POST /path HTTP/1.1" 204 -
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) ')


@dataclass(frozen=True, slots=True)
class FakeSystem:
    """One emulated ComputerSystem: its Redfish id is `uuid` (the name redirects to it)."""

    uuid: str
    name: str
    power_state: str = "Off"  # as the emulator spells it: "On" or "Off"
    external_notifier: bool = False  # PUT changes to the emulator's notification_url
    mac: str | None = None

    @classmethod
    def new(cls, name: str, power_state: str = "Off", **kwargs: Any) -> FakeSystem:
        return cls(uuid=str(uuid_mod.uuid4()), name=name, power_state=power_state, **kwargs)


def fake_systems(
    count: int, *, prefix: str = "gpu-node", power_state: str = "Off"
) -> list[FakeSystem]:
    """`count` systems named PREFIX-01, PREFIX-02, ... all in `power_state`."""
    return [FakeSystem.new(f"{prefix}-{i:02d}", power_state) for i in range(1, count + 1)]


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One line of the emulator's access log."""

    method: str
    path: str
    status: int


class SushyEmulatorError(RuntimeError):
    """The emulator did not start (the message carries the tail of its log)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _emulator_command() -> list[str]:
    # sushy-tools' emulator with the lab's power extension (fleet/lab/sushy_power.py); it takes
    # sushy-emulator's own arguments.
    return [sys.executable, "-m", "fleet.lab.sushy_power"]


def _terminate(
    proc: subprocess.Popen[bytes], grace: float, log: IO[bytes], workdir: str | None
) -> None:
    """Stop the emulator's whole process group and reap it; remove its temporary directory."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        else:
            # The leader is gone; anything left in its group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        log.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


class SushyEmulator:
    """A running sushy-emulator (the EMULATOR, not hardware) on a free 127.0.0.1 port.

    `systems` are the fake ComputerSystems it serves; `username`/`password` the one account in
    its htpasswd file. Pass `tls_cert`/`tls_key` (PEM paths) to serve HTTPS, and
    `notification_url` for systems created with `external_notifier=True`.
    """

    def __init__(
        self,
        systems: list[FakeSystem],
        *,
        username: str = "admin",
        password: str = "password",
        tls_cert: str | None = None,
        tls_key: str | None = None,
        notification_url: str | None = None,
        start_timeout: float = START_TIMEOUT_S,
        stop_grace: float = STOP_GRACE_S,
    ) -> None:
        if not systems:
            raise ValueError("an emulator needs at least one system")
        if len({s.uuid for s in systems}) != len(systems):
            raise ValueError("system uuids must be unique")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.fake_systems = list(systems)
        self.username = username
        self.password = password
        self.tls_cert = tls_cert
        self.tls_key = tls_key
        self.notification_url = notification_url
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.port = 0
        self.workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._watts: dict[str, float] = {}  # system uuid -> what its Power resource serves

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def systems(self) -> list[str]:
        """The systems' uuids (their Redfish ids), in the order given."""
        return [s.uuid for s in self.fake_systems]

    @property
    def log_path(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("the emulator has not been started")
        return self.workdir / "emulator.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> SushyEmulator:
        if self._proc is not None:
            raise RuntimeError("the emulator is already started")
        workdir = Path(tempfile.mkdtemp(prefix="fleet-sushy-"))
        try:
            self._write_auth_file(workdir)
            (workdir / "power").mkdir()
            for system, watts in self._watts.items():
                _replace(watts_file(workdir / "power", system), _watts_text(watts))
            # The port is free when picked but another process may take it before the emulator
            # binds it: then the emulator exits at once, and we try another port.
            for attempt in range(3):
                if self._spawn(workdir, free_port(), last=attempt == 2):
                    return self
        except BaseException:
            self.stop()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """SIGTERM the emulator's process group, SIGKILL after `stop_grace`; always reaped."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> SushyEmulator:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _write_auth_file(self, workdir: Path) -> None:
        digest = bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
        path = workdir / "htpasswd"
        path.write_text(f"{self.username}:{digest}\n")
        path.chmod(0o600)

    def _config_text(self, workdir: Path, port: int) -> str:
        systems = []
        for i, s in enumerate(self.fake_systems, start=1):
            mac = s.mac or ":".join(["52:54:00", *(f"{b:02x}" for b in i.to_bytes(3, "big"))])
            systems.append(
                {
                    "uuid": s.uuid,
                    "name": s.name,
                    "power_state": s.power_state,
                    "external_notifier": s.external_notifier,
                    "nics": [{"mac": mac}],
                }
            )
        values = {
            "@PORT@": repr(port),
            "@AUTH_FILE@": repr(str(workdir / "htpasswd")),
            "@STATE_DIR@": repr(str(workdir / "state")),
            "@SYSTEMS@": repr(systems),
            "@NOTIFICATION_URL@": repr(self.notification_url),
            "@SSL_CERT@": repr(self.tls_cert),
            "@SSL_KEY@": repr(self.tls_key),
            "@POWER_DIR@": repr(str(workdir / "power")),
        }
        text = resources.files("fleet.lab").joinpath(TEMPLATE).read_text()
        for key, value in values.items():
            text = text.replace(key, value)
        if re.search(r"@[A-Z_]+@", re.sub(r"#.*", "", text)):
            raise RuntimeError(f"unfilled placeholder in {TEMPLATE}")
        return text

    def _spawn(self, workdir: Path, port: int, *, last: bool) -> bool:
        """Start the emulator on `port`; True once it answers, False if the port was taken."""
        config = workdir / "sushy-emulator.conf"
        config.write_text(self._config_text(workdir, port))
        self.workdir = workdir
        self.port = port
        log = (workdir / "emulator.log").open("wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("SUSHY_EMULATOR_CONFIG", None)
        try:
            proc = subprocess.Popen(
                [*_emulator_command(), "--config", str(config)],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() kills all of it
            )
        except BaseException:
            log.close()
            raise
        self._proc = proc
        # The temporary directory goes with the process (at stop, collection or exit).
        self._finalizer = weakref.finalize(
            self, _terminate, proc, self.stop_grace, log, str(workdir)
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                text = self.log_text()
                # Detach without removing the directory: the caller retries in it.
                self._finalizer.detach()
                self._finalizer = None
                self._proc = None
                log.close()
                if "Address already in use" in text and not last:
                    return False
                raise SushyEmulatorError(
                    f"sushy-emulator exited with status {proc.returncode}: {_tail(text)}"
                )
            if self._answers():
                return True
            time.sleep(0.05)
        raise SushyEmulatorError(
            f"sushy-emulator did not answer on {self.url} within {self.start_timeout:g} s: "
            f"{_tail(self.log_text())}"
        )

    def _answers(self) -> bool:
        try:
            with self._open("GET", "/redfish/v1/", auth=False, timeout=0.5) as resp:
                return int(resp.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    # -- the access log ----------------------------------------------------------------------

    def log_text(self) -> str:
        """Everything the emulator wrote so far (stdout and stderr), colour codes removed."""
        try:
            return _ANSI.sub("", self.log_path.read_text(errors="replace"))
        except FileNotFoundError:
            return ""

    def requests(self) -> list[LoggedRequest]:
        """Every request the emulator logged so far, in order. werkzeug logs a request before
        it sends the answer, so a request the client has seen answered is always in here."""
        found = []
        for line in self.log_text().splitlines():
            match = _ACCESS.search(line)
            if match:
                found.append(LoggedRequest(match["method"], match["path"], int(match["status"])))
        return found

    def resets(self, system: str) -> list[LoggedRequest]:
        """The ComputerSystem.Reset POSTs logged for `system` (uuid)."""
        path = f"/redfish/v1/Systems/{system}/Actions/ComputerSystem.Reset"
        return [r for r in self.requests() if r.method == "POST" and r.path == path]

    # -- the modelled draw (the lab's power extension) --------------------------------------

    def set_power_watts(self, system: str, watts: float | None) -> None:
        """What `system`'s (uuid) chassis Power resource reports from the next request on:
        `PowerConsumedWatts` = `watts` exactly as given (nonsense included: the lab may play a
        BMC that answers negative or absurd figures), or None for no Power resource at all.
        Kept across a restart of the emulator."""
        if system not in self.systems:
            raise ValueError(f"no system {system!r} in this emulator")
        if watts is not None and (isinstance(watts, bool) or not isinstance(watts, int | float)):
            raise TypeError(f"watts must be a number or None, not {watts!r}")
        if watts is None:
            self._watts.pop(system, None)
        else:
            self._watts[system] = float(watts)
        if self.workdir is None or not self.running():
            return  # written when it starts
        path = watts_file(self.workdir / "power", system)
        if watts is None:
            path.unlink(missing_ok=True)
        else:
            _replace(path, _watts_text(float(watts)))

    def power_watts(self, system: str) -> float | None:
        """The figure last given to `set_power_watts` for `system` (None: no reading)."""
        return self._watts.get(system)

    # -- direct Redfish calls (the lab acting behind Fleet's back) -------------------------

    def read_power_state(self, system: str) -> str:
        """The system's PowerState as the emulator reports it ("On"/"Off"); reading applies a
        pending change whose time has come."""
        with self._open("GET", f"/redfish/v1/Systems/{system}") as resp:
            body: dict[str, Any] = json.loads(resp.read())
        return str(body.get("PowerState"))

    def set_power_behind_our_back(self, system: str, state: PowerState | str) -> None:
        """Send a Reset straight to the emulator, as an operator with another tool would:
        "on" sends On, "off" ForceOff, anything else is sent as the ResetType itself. Like
        every Reset here, it lands 1-11 s later."""
        value = str(state)
        reset = {"on": "On", "off": "ForceOff"}.get(value.lower(), value)
        body = json.dumps({"ResetType": reset}).encode()
        path = f"/redfish/v1/Systems/{system}/Actions/ComputerSystem.Reset"
        with self._open("POST", path, body=body) as resp:
            if int(resp.status) not in (200, 202, 204):
                raise RuntimeError(f"Reset {reset} on {system}: HTTP {resp.status}")

    def _open(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        auth: bool = True,
        timeout: float = 10.0,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if auth:
            token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        request = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
        context = None
        if self.scheme == "https":
            # Our own emulator with its test certificate: the lab does not verify itself.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return urllib.request.urlopen(request, timeout=timeout, context=context)


def watts_file(power_dir: Path, system: str) -> Path:
    """Where the emulator's power extension reads `system`'s watts (fleet.lab.sushy_power's
    watts_file; not imported from there, which would load sushy-tools' whole app here)."""
    return power_dir / f"{system}.watts"


def _watts_text(watts: float) -> str:
    return f"{watts!r}\n"  # repr: exact, and "nan"/"inf" stay what they are


def _replace(path: Path, text: str) -> None:
    """Write `path` whole: the emulator reads the old content or the new, never a part."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _tail(text: str, lines: int = 15) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"
