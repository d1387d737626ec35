"""Helpers for end-to-end tests that run real `fleetctl serve` processes, optionally with the
virtual colo (BMC emulators, agents with stand-in engines) in front of them.

Not a test module: test modules import it (`from colo_world import ...`, as they import
factories). Importing it starts nothing.

- `wait_for()`: poll until something holds, failing with what the fleet looked like.
- `ServeProcess`: one `fleetctl serve` in a process group of its own, with the settings given
  (the developer's FLEET_* environment is dropped); started, SIGKILLed, restarted, stopped; its
  /metrics read per control loop.
- `RouterProcess`: one `fleetctl router run`, likewise, until it is stopped.
- `Api`: the REST API with a token.
- `colo_world()`: a service on its embedded SQLite database and a lab of IPMI servers, imported
  and verified (every server warm); everything stopped on the way out, agents first, and no
  process of the lab left behind (`down_and_check`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from typer.testing import CliRunner, Result

from fleet import cli, db
from fleet.lab.colo import ProcRef, VirtualColo, recorded_processes
from fleet.lab.sushy import free_port

T = TypeVar("T")
FLEETCTL = Path(sys.executable).parent / "fleetctl"
START_TIMEOUT_S = 60.0  # `fleetctl serve` from exec to /readyz on a loaded 2-core machine


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    every: float = 0.1,
    why: Callable[[], str] | None = None,
    give_up: Callable[[], str | None] | None = None,
) -> T:
    """probe() every `every` s until it returns something truthy; fails after `timeout` s, or
    as soon as `give_up()` says why it never will, saying what `why()` says (the fleet's
    states, a log's tail). A probe that cannot reach a service (yet) counts as a no."""
    deadline = time.monotonic() + timeout
    while True:
        with suppress(httpx.HTTPError, OSError):
            value = probe()
            if value:
                return value
        hopeless = give_up() if give_up is not None else None
        if hopeless is not None or time.monotonic() >= deadline:
            pytest.fail(
                f"{hopeless or f'timed out after {timeout:g} s'} waiting for {what}\n"
                f"{why() if why else ''}"
            )
        time.sleep(every)


def parse_at(text: str) -> float:
    """An API timestamp (ISO 8601, UTC when it has no offset) as epoch seconds."""
    at = datetime.fromisoformat(text)
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


# ---------------------------------------------------------------------------------------------
# `fleetctl serve`


@dataclass(frozen=True)
class LoopMetrics:
    leader: bool
    ticks: int


class ServeProcess:
    """`fleetctl serve` with `settings` (FLEET_* variables) on a port of its own."""

    def __init__(self, name: str, data_dir: Path, settings: Mapping[str, str]) -> None:
        self.name = name
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / f"{name}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        self.env |= {"FLEET_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", **settings}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_from = 0  # where this run's lines start in the log

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, *, admin_token: bool = False, **settings: str) -> None:
        """Start it (the same port every time); `settings` override this run's FLEET_*."""
        assert not self.running, f"{self.name} is already running"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        args = [str(FLEETCTL), "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*args, "--admin-token"] if admin_token else args,
                env=self.env | settings,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            pytest.fail(f"{self.name} is not running (exit {code})\n{self.tail()}")
        return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200

    def start(self, *, admin_token: bool = False, **settings: str) -> None:
        """spawn(), then wait for /readyz."""
        self.spawn(admin_token=admin_token, **settings)
        wait_for(f"{self.name} to answer /readyz", self.ready, START_TIMEOUT_S, why=self.tail)

    def admin_token(self) -> str:
        """The token `--admin-token` printed in this run's log."""

        def printed() -> str | None:
            for line in self._run_log().splitlines():
                if line.startswith("admin token: "):
                    return line.split(": ", 1)[1].strip()
            return None

        return wait_for(f"{self.name}'s admin token", printed, 10, why=self.tail)

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

    def kill(self) -> None:
        """SIGKILL its process group (SIGCONT first, in case it is stopped): a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signum)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it takes over 15 s."""
        if self.proc is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def _run_log(self) -> str:
        try:
            with self.log.open("rb") as handle:
                handle.seek(self._log_from)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        text = self._run_log().splitlines()[-lines:]
        return f"{self.name} log:\n" + "\n".join(f"  {self.name}| {line}" for line in text)


# ---------------------------------------------------------------------------------------------
# `fleetctl router run`


class RouterProcess:
    """`fleetctl router run [args]` with `settings` (FLEET_* variables, the developer's dropped)
    on a port of its own, in a process group of its own, its output in `log`; ready (its
    /readyz answers) when the constructor returns."""

    def __init__(self, log: Path, settings: Mapping[str, str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env |= settings
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(FLEETCTL), "router", "run", *args, "--port", str(self.port)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(
            "the router",
            lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200,
            30,
            why=self.tail,
        )

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL if it takes over 15 s."""
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "router log:\n" + "\n".join(text)


@dataclass
class Api:
    """The REST API of a service, as the holder of `token`."""

    url: str
    token: str

    def __call__(self, method: str, path: str, **kwargs: Any) -> Any:
        reply = self.request(method, path, **kwargs)
        assert reply.status_code < 400, f"{method} {path}: {reply.status_code} {reply.text}"
        return reply.json() if reply.content else None

    def request(
        self, method: str, path: str, headers: Mapping[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        return httpx.request(
            method, f"{self.url}/api/v1{path}", headers=headers, timeout=30, **kwargs
        )

    def events(self, **params: Any) -> list[dict[str, Any]]:
        """Events matching `params` (subject_type, subject, kind, since), oldest first."""
        rows: list[dict[str, Any]] = self("GET", "/events", params={"limit": 1000, **params})[
            "results"
        ]
        return sorted(rows, key=lambda r: r["id"])

    def decisions(self, deployment: str, rule: str | None = None) -> list[dict[str, Any]]:
        """The deployment's scaling decisions (of `rule`, if given), oldest first."""
        path = f"/autoscaler/{deployment}/decisions"
        rows = self("GET", path, params={"limit": 1000})["results"]
        return sorted((r for r in rows if rule in (None, r["rule"])), key=lambda r: r["id"])


# ---------------------------------------------------------------------------------------------
# The virtual colo behind a service on its embedded SQLite database


def ipmi_inventory(site: str, rack: str, servers: Sequence[str], gpu_model: str, gpus: int) -> str:
    """One rack of `servers` (each `gpus` × `gpu_model`) behind IPMI (a power-off applies at
    once), with power for all of them."""
    feeds = [
        {"name": f"{side.lower()}1", "side": side, "volts": 415, "amps": 63, "phase": "three"}
        for side in "AB"
    ]
    rows = [
        {
            "name": name,
            "u": 1 + 2 * i,
            "u_height": 2,
            "gpu": {"model": gpu_model, "count": gpus},
            "power": {"idle_w": 700, "standby_w": 60, "max_w": 1500},
            "bmc": {
                "protocol": "ipmi",
                "address": "10.0.0.1",  # the lab rewrites it
                "port": 623,
                "username": "root",
                "password": "not-used-by-the-lab",
            },
        }
        for i, name in enumerate(servers)
    ]
    doc = {"sites": [{"name": site, "racks": [{"name": rack, "feeds": feeds, "servers": rows}]}]}
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass
class World:
    service: ServeProcess
    colo: VirtualColo
    api: Api
    database: Path  # the service's embedded SQLite file
    runner: CliRunner = field(default_factory=CliRunner)

    def fleetctl(self, *args: str) -> Result:
        env = {"FLEET_URL": self.service.url, "FLEET_TOKEN": self.api.token, "COLUMNS": "250"}
        return self.runner.invoke(cli.app, list(args), env=env)

    def servers(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.api("GET", "/servers", params={"limit": 1000})["results"]
        return rows

    def states(self) -> dict[str, str]:
        return {s["name"]: s["state"] for s in self.servers()}

    def why(self) -> str:
        try:
            states = ", ".join(f"{n}: {s}" for n, s in sorted(self.states().items()))
        except (httpx.HTTPError, AssertionError) as exc:
            states = repr(exc)
        return f"servers: {states}\n{self.service.tail()}"


@contextmanager
def colo_world(
    base: Path,
    inventory: str,
    settings: Mapping[str, str],
    *,
    boot_delay_s: float,
    agent_env: Mapping[str, str],
) -> Iterator[World]:
    """The service (embedded SQLite under `base`, `settings`), the lab of `inventory` and
    nothing else, every server warm; all stopped at the end, whatever happened: the lab first
    (its agents talk to the service), then the service."""
    with ExitStack() as stack:
        service = ServeProcess("serve", base, settings)
        stack.callback(service.stop)
        service.start(admin_token=True)
        api = Api(service.url, service.admin_token())
        database = base / "fleet.db"
        engine = db.make_engine(f"sqlite:///{database}")  # the agents' tokens are made here
        stack.callback(engine.dispose)
        colo = VirtualColo(
            inventory,
            base / "lab",
            token_for=cli._lab_token_maker(engine),
            fleet_url=service.url,
            boot_delay_s=boot_delay_s,
            agent_env=agent_env,
        )
        stack.callback(down_and_check, colo)
        colo.up()
        world = World(service, colo, api, database)
        reply = api.request(
            "POST",
            "/inventory/import",
            content=colo.rewritten_yaml().encode(),
            headers={"Content-Type": "application/yaml"},
        )
        assert reply.status_code == 200, reply.text
        # Verify every BMC (found off: warm). One the reconciler reads at that moment is busy:
        # verified again, a bounded few times.
        for _ in range(5):
            verified = world.fleetctl("servers", "verify", "-o", "json")
            if verified.exit_code == 0:
                break
            assert "another power action is in progress" in verified.stdout, verified.stdout
            time.sleep(0.5)
        assert verified.exit_code == 0, verified.stdout + verified.stderr
        wait_for(
            "every server warm", lambda: set(world.states().values()) == {"warm"}, 30, why=world.why
        )
        yield world


def down_and_check(colo: VirtualColo) -> None:
    """Stop the lab; every process it recorded (emulators, agents) must be gone."""
    refs: list[ProcRef] = []
    with suppress(Exception):
        refs = [ref for _, ref in recorded_processes(colo.state())]
    colo.down()
    deadline = time.monotonic() + 10
    left = [r for r in refs if r.pid != os.getpid() and r.alive()]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [r for r in left if r.alive()]
    assert not left, f"processes left after the lab went down: {left}"
