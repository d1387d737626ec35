"""The fleet's own processes, started for the tests, the benchmarks and the demo.

- `ServeProcess`: one `fleetctl serve`; `RouterProcess`: one `fleetctl router run`. Each is a
  child in a process group of its own with the settings given (the caller's FLEET_* environment
  dropped), its output in a log file; started, SIGKILLed (a crash), restarted on the same port,
  stopped group-wide (SIGTERM, then SIGKILL after a grace).
- `start_lab()`: the virtual colo in front of a service, its inventory imported; with
  `ssh=True` its servers are SSH hosts (fleet/lab/ssh_hosts.py), and `lab_ssh_settings(workdir)`
  gives the service the lab's client key (FLEET_SSH_KEY_FILE) before the lab is up.
- `FAST_SERVICE_SETTINGS`, `SERVING_SETTINGS`, `FAST_AGENT_SETTINGS`: the control loops and the
  agents shortened so that a world settles in seconds instead of minutes; one set, which each
  caller overrides only where its scenario is about that setting.
- `create_client_key()`: a tenant and a client key through the fleet's API, for a router that
  requires keys (the default); the key in a 0600 file.
- `wait_for()` and `free_port()`: the polling and the port every caller needs.

Nothing here is imported by the service itself (an import contract says so): it is the lab's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

from fleet.lab.colo import POWER_FEED_S, VirtualColo
from fleet.lab.processes import die_with_parent
from fleet.lab.ssh_hosts import ensure_client_key
from fleet.lab.sushy import free_port

T = TypeVar("T")
FLEETCTL = Path(sys.executable).parent / "fleetctl"
START_TIMEOUT_S = 60.0  # a child from exec to /readyz on a loaded 2-core machine
STOP_GRACE_S = 15.0  # SIGTERM to exit: a clean shutdown drains its requests first

# The control loops, shortened: a tick every 0.5-2 s, deadlines that the lab's delays (sushy
# applies a Reset 1-11 s late, then the boot delay, the agent's start, the engines' load) fit in
# with room to spare on a busy machine, heartbeats every 0.5 s.
FAST_SERVICE_SETTINGS: dict[str, str] = {
    "FLEET_RUN_LOOPS": "true",
    "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
    "FLEET_RECONCILE_INTERVAL_S": "2",
    "FLEET_PROVISION_INTERVAL_S": "0.5",
    "FLEET_LEADER_LEASE_S": "5",
    "FLEET_BOOT_DEADLINE_S": "40",
    "FLEET_LOAD_DEADLINE_S": "40",
    "FLEET_DRAIN_DEADLINE_S": "30",
    "FLEET_POWER_RETRY_AFTER_S": "15",
    "FLEET_POWER_SETTLE_S": "15",
    "FLEET_POWER_ON_RACK_DELAY_S": "0.1",
    # Measured draw in buckets of 5 s (production: 300 s), the cap valve every second.
    "FLEET_POWER_BUCKET_S": "5",
    "FLEET_POWER_VALVE_INTERVAL_S": "1",
    "FLEET_LOG_LEVEL": "INFO",
}
# A world that serves traffic: the autoscaler ticks every second, and the quality probe (it
# would queue behind the traffic; it is no scenario's business) is off.
SERVING_SETTINGS: dict[str, str] = {
    "FLEET_AUTOSCALE_INTERVAL_S": "1",
    "FLEET_PROBE_INTERVAL_S": "0",
}
# The lab's agents: heartbeats every 0.5 s, samples every 0.2 s, stand-in engines that load in
# 0.5 s (plus the time their weights take to read), a fleet that does not answer retried
# within 2 s, a failed weights fetch tried again after 2 s.
FAST_AGENT_SETTINGS: dict[str, str] = {
    "FLEET_AGENT_HEARTBEAT_INTERVAL_S": "0.5",
    "FLEET_AGENT_SAMPLE_INTERVAL_S": "0.2",
    "FLEET_STANDIN_LOAD_S": "0.5",
    "FLEET_AGENT_FETCH_RETRY_S": "2",
    "FLEET_AGENT_BACKOFF_INITIAL_S": "0.2",
    "FLEET_AGENT_BACKOFF_MAX_S": "2",
    "FLEET_AGENT_REQUEST_TIMEOUT_S": "2",
    "FLEET_AGENT_DRAIN_DEADLINE_S": "20",
}


class ChildExited(RuntimeError):
    """A child that was to answer has exited."""


class WaitTimeout(AssertionError):
    """A wait that ran out, or was given up. An AssertionError: in a test, the world not doing
    what was awaited is a failed expectation (callers outside tests pass `error=`)."""


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    every: float = 0.1,
    why: Callable[[], str] | None = None,
    give_up: Callable[[], str | None] | None = None,
    error: Callable[[str], Exception] = WaitTimeout,
) -> T:
    """probe() every `every` s until it returns something truthy; raises `error` after `timeout`
    s, or as soon as `give_up()` says why it never will, saying what `why()` says (the fleet's
    states, a log's tail). A probe that cannot reach a service (yet) counts as a no."""
    deadline = time.monotonic() + timeout
    while True:
        with suppress(httpx.HTTPError, OSError):
            value = probe()
            if value:
                return value
        hopeless = give_up() if give_up is not None else None
        if hopeless is not None or time.monotonic() >= deadline:
            message = f"{hopeless or f'timed out after {timeout:g} s'} waiting for {what}"
            raise error(f"{message}\n{why()}" if why is not None else message)
        time.sleep(every)


def child_env(settings: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its FLEET_* variables, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return env | {"PYTHONUNBUFFERED": "1", **settings}


class Child:
    """`fleetctl ARGS` in a process group of its own, its output appended to `log`."""

    def __init__(self, name: str, log: Path, *, die_with_us: bool = False) -> None:
        self.name = name
        self.log = log
        self._proc: subprocess.Popen[bytes] | None = None
        # Between a start and its stop/kill: only then does a signal go to its process group
        # (once reaped, its pid may be another process's).
        self._started = False
        # PR_SET_PDEATHSIG: the kernel SIGKILLs the child if the thread that started it dies
        # (the demo's main thread); not for tests, which may start children from any thread.
        self._die_with_us = die_with_us
        self._log_from = 0  # where this run's lines start in the log

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The process of the latest start."""
        assert self._proc is not None, f"{self.name} was never started"
        return self._proc

    @property
    def running(self) -> bool:
        return self._started and self.proc.poll() is None

    def exited(self) -> str | None:
        """Why it will never answer (it exited), or None while it runs."""
        if self.running:
            return None
        code = None if self._proc is None else self._proc.returncode
        return f"{self.name} is not running (exit {code})"

    def launch(self, args: Sequence[str], env: Mapping[str, str]) -> None:
        """Start `fleetctl ARGS` with exactly `env` (see child_env)."""
        assert not self.running, f"{self.name} is already running"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(FLEETCTL), *args],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()) if self._die_with_us else None,
            )
        self._started = True

    def kill(self) -> None:
        """SIGKILL its process group (SIGCONT first, in case it is stopped): a crash."""
        if not self._started:
            return
        self._started = False
        if self.proc.poll() is None:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signum)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM its process group (a clean shutdown), then SIGKILL to the group (whatever
        the child started itself) after STOP_GRACE_S at most."""
        if not self._started:
            return
        self._started = False
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_GRACE_S)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def run_log(self) -> str:
        """What this run (since the last start) wrote."""
        try:
            with self.log.open("rb") as handle:
                handle.seek(self._log_from)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        text = self.run_log().splitlines()[-lines:]
        return f"{self.name} log:\n" + "\n".join(f"  {self.name}| {line}" for line in text)


@dataclass(frozen=True)
class LoopMetrics:
    leader: bool
    ticks: int


class ServeProcess(Child):
    """`fleetctl serve` with `settings` (FLEET_* variables) on 127.0.0.1 and a port of its own
    (the same one across restarts), its data in `data_dir`, its log `data_dir/<name>.log`."""

    def __init__(
        self,
        name: str,
        data_dir: Path,
        settings: Mapping[str, str],
        *,
        log: Path | None = None,
        die_with_us: bool = False,
    ) -> None:
        super().__init__(name, log or data_dir / f"{name}.log", die_with_us=die_with_us)
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = child_env({"FLEET_DATA_DIR": str(data_dir), **settings})

    def spawn(self, *args: str, admin_token: bool = False, **settings: str) -> None:
        """Start it; `args` go to `fleetctl serve`, `settings` override this run's FLEET_*."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = ["serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.launch([*argv, "--admin-token"] if admin_token else argv, self.env | settings)

    def ready(self) -> bool:
        """/readyz answers 200; ChildExited once it has exited (it never will)."""
        if (exited := self.exited()) is not None:
            raise ChildExited(f"{exited}\n{self.tail()}")
        return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200

    def start(
        self,
        *args: str,
        admin_token: bool = False,
        error: Callable[[str], Exception] = WaitTimeout,
        **settings: str,
    ) -> None:
        """spawn(), then wait for /readyz (and for the admin token, when asked for one)."""
        self.spawn(*args, admin_token=admin_token, **settings)
        wait_for(
            f"{self.name} to answer /readyz",
            self.ready,
            START_TIMEOUT_S,
            why=self.tail,
            give_up=self.exited,
            error=error,
        )
        if admin_token:
            self.admin_token(error=error)

    def admin_token(self, error: Callable[[str], Exception] = WaitTimeout) -> str:
        """The token `--admin-token` printed in this run's log."""

        def printed() -> str | None:
            found = re.search(r"^admin token: (\S+)$", self.run_log(), re.M)
            return found[1] if found else None

        return wait_for(f"{self.name}'s admin token", printed, 10, why=self.tail, error=error)

    def metrics(self, loop: str) -> LoopMetrics | None:
        """This process's view of control loop `loop`; None while it does not answer."""
        try:
            reply = httpx.get(f"{self.url}/metrics", timeout=2)
        except httpx.HTTPError:
            return None
        if reply.status_code != 200:
            return None
        leader = re.search(rf'^fleet_loop_leader\{{loop="{loop}"\}} (\S+)$', reply.text, re.M)
        ticks = re.search(rf'^fleet_loop_ticks_total\{{loop="{loop}"\}} (\S+)$', reply.text, re.M)
        assert leader and ticks, f"no metrics for loop {loop!r} in:\n{reply.text}"
        return LoopMetrics(float(leader[1]) == 1.0, int(float(ticks[1])))


class RouterProcess(Child):
    """`fleetctl router run [args]` with `settings` (FLEET_* variables) on a port of its own;
    ready (its /readyz answers) when the constructor returns."""

    def __init__(
        self,
        log: Path,
        settings: Mapping[str, str],
        *args: str,
        name: str = "router",
        timeout: float = 30.0,
        die_with_us: bool = False,
        error: Callable[[str], Exception] = WaitTimeout,
    ) -> None:
        super().__init__(name, log, die_with_us=die_with_us)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.launch(["router", "run", *args, "--port", str(self.port)], child_env(settings))
        wait_for(
            f"the {name}",
            lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200,
            timeout,
            why=self.tail,
            give_up=self.exited,
            error=error,
        )


def start_lab(
    service_url: str,
    admin_token: str,
    inventory: str,
    workdir: Path,
    *,
    token_for: Callable[[str], str],
    boot_delay_s: float,
    agent_env: Mapping[str, str],
    no_power_reading: Iterable[str] = (),
    power_feed_s: float = POWER_FEED_S,
    ssh: bool = False,
) -> VirtualColo:
    """The virtual colo of `inventory` (YAML) under `workdir`, up, its servers imported into
    the service (their BMC addresses rewritten to the lab's emulators). The caller takes it
    down (`colo.down()`), agents before the service they talk to. `no_power_reading` names
    servers whose BMC gives no power reading; `power_feed_s` is how often the BMCs' readings
    follow the modelled draw (fleet/lab/colo.py). `ssh`: every server's OS is an SSH host
    instead of the lab's agent, its `ssh` block (address, port, pinned host key) imported too;
    start the service with `lab_ssh_settings(workdir)` so that it holds the lab's key."""
    colo = VirtualColo(
        inventory,
        workdir,
        token_for=token_for,
        fleet_url=service_url,
        boot_delay_s=boot_delay_s,
        agent_env=dict(agent_env),
        no_power_reading=no_power_reading,
        power_feed_s=power_feed_s,
        ssh=ssh,
    )
    try:
        colo.up()
        reply = httpx.post(
            f"{service_url}/api/v1/inventory/import",
            content=colo.rewritten_yaml().encode(),
            headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/yaml"},
            timeout=60,
        )
        if reply.status_code != 200:
            raise RuntimeError(f"inventory import: HTTP {reply.status_code}: {reply.text[:300]}")
    except BaseException:
        colo.down()
        raise
    return colo


def create_client_key(
    service_url: str,
    token: str,
    path: Path,
    *,
    tenant: str,
    name: str,
    timeout: float = 30.0,
    error: Callable[[str], Exception] = RuntimeError,
) -> str:
    """A client key for the routers (docs/router.md, "Callers"), made through the fleet's API
    with the calls `fleetctl tenants create` and `fleetctl keys create` make (`token`: operator
    or admin): the tenant (kept if it exists), then a key for it, unlimited. The key is written
    to `path`, mode 0600 (the only copy: the fleet keeps its hash), and returned; callers print
    the path, never the key. A refusal raises `error` saying which call and why."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"{service_url}/api/v1", headers=headers, timeout=timeout) as api:
        reply = api.post("/tenants", json={"name": tenant})
        if reply.status_code not in (201, 409):  # 409: made by an earlier run, kept
            raise error(f"POST /tenants: HTTP {reply.status_code}: {reply.text[:300]}")
        reply = api.post("/client-keys", json={"tenant": tenant, "name": name})
        if reply.status_code != 201:
            raise error(f"POST /client-keys: HTTP {reply.status_code}: {reply.text[:300]}")
        key = str(reply.json()["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover keeps its mode: made anew, 0600 from the start
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    os.replace(tmp, path)
    return key


def lab_ssh_settings(workdir: Path) -> dict[str, str]:
    """The service's settings for a lab in SSH mode under `workdir`: the lab's client key
    (made now if need be, the same one `start_lab(..., ssh=True)` authorizes on every host), so
    the service can start before the lab: `ServeProcess(..., {**settings, **lab_ssh_settings(w)})`.
    """
    return {"FLEET_SSH_KEY_FILE": str(ensure_client_key(workdir))}


__all__ = [
    "FAST_AGENT_SETTINGS",
    "FAST_SERVICE_SETTINGS",
    "FLEETCTL",
    "SERVING_SETTINGS",
    "Child",
    "ChildExited",
    "LoopMetrics",
    "RouterProcess",
    "ServeProcess",
    "WaitTimeout",
    "child_env",
    "create_client_key",
    "free_port",
    "lab_ssh_settings",
    "start_lab",
    "wait_for",
]
