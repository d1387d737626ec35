"""The demo's processes: the fleet service and the router as child processes, the virtual colo
(BMC emulators, agents, stand-in engines) run by this process; all stopped on exit.

Every child leads its own process group, is SIGKILLed by the kernel if this process dies
(PR_SET_PDEATHSIG), and is stopped group-wide on the way out (SIGTERM, then SIGKILL after a
grace): a demo that ends, is interrupted or crashes leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from sqlalchemy.engine import Engine

from fleet.lab.colo import VirtualColo, die_with_parent
from fleet.lab.sushy import free_port

FLEETCTL = Path(sys.executable).parent / "fleetctl"
STOP_GRACE_S = 10.0

# The service, shortened for a few minutes of demo (every setting said on screen).
SERVICE_SETTINGS = {
    "FLEET_RUN_LOOPS": "true",
    "FLEET_HEARTBEAT_INTERVAL_S": "1",
    "FLEET_RECONCILE_INTERVAL_S": "2",
    "FLEET_PROVISION_INTERVAL_S": "0.5",
    "FLEET_CALENDAR_INTERVAL_S": "1",
    "FLEET_AUTOSCALE_INTERVAL_S": "1",
    "FLEET_AUTOSCALE_QUEUE_PER_GPU": "1",
    "FLEET_AUTOSCALE_UP_WINDOW_S": "6",
    "FLEET_AUTOSCALE_DOWN_WINDOW_S": "12",
    "FLEET_AUTOSCALE_COOLDOWN_DOWN_S": "3",
    "FLEET_BOOT_ESTIMATE_S": "20",
    "FLEET_BOOT_DEADLINE_S": "90",
    "FLEET_LOAD_DEADLINE_S": "60",
    "FLEET_DRAIN_DEADLINE_S": "20",
    "FLEET_POWER_RETRY_AFTER_S": "20",
    "FLEET_POWER_SETTLE_S": "20",
    "FLEET_POWER_ON_RACK_DELAY_S": "0.1",
    "FLEET_LEADER_LEASE_S": "5",
    "FLEET_PROBE_INTERVAL_S": "0",
    "FLEET_ROUTER_REPORT_STALE_S": "10",
    # One fault in a handful of servers is more than the default 20 %: the breaker would stop
    # remediation (right for a real fleet, where that many at once means something bigger).
    "FLEET_BREAKER_SHARE": "0.5",
    "FLEET_LOG_LEVEL": "WARNING",
}
AGENT_SETTINGS = {
    "FLEET_AGENT_HEARTBEAT_INTERVAL_S": "1",
    "FLEET_AGENT_SAMPLE_INTERVAL_S": "0.5",
    "FLEET_AGENT_BACKOFF_INITIAL_S": "0.2",
    "FLEET_AGENT_BACKOFF_MAX_S": "2",
    "FLEET_AGENT_REQUEST_TIMEOUT_S": "3",
    "FLEET_AGENT_DRAIN_DEADLINE_S": "15",
    "FLEET_STANDIN_LOAD_S": "1",
    "FLEET_STANDIN_MODEL": "llama-3.1-70b",
}
ROUTER_SETTINGS = {
    "FLEET_ROUTER_FLEET_POLL_S": "1",
    "FLEET_ROUTER_REPORT_S": "1",
    "FLEET_ROUTER_QUEUE_BOUND": "200",
    "FLEET_ROUTER_QUEUE_TIMEOUT_S": "60",
    "FLEET_ROUTER_LOG_LEVEL": "WARNING",
}
BOOT_DELAY_S = 3.0  # the lab's power-on to agent start (a real server: 10-15 min)


class DemoError(RuntimeError):
    """Something the demo needs did not happen; the message says what."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_GRACE_S)
        # The group too: whatever the child started itself.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


@dataclass
class World:
    """What the demo started; `close()` stops it all (idempotent)."""

    workdir: Path
    began: datetime = field(default_factory=lambda: datetime.now(UTC))
    service_url: str = ""
    router_url: str = ""
    admin_token: str = ""
    children: list[Child] = field(default_factory=list)
    colo: VirtualColo | None = None
    engine: Engine | None = None
    _client: httpx.Client | None = None

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                args,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._client is None:
            self._client = httpx.Client(
                base_url=f"{self.service_url}/api/v1",
                headers={"Authorization": f"Bearer {self.admin_token}"},
                timeout=30,
            )
        reply = self._client.request(method, path, **kwargs)
        if reply.status_code >= 400:
            raise DemoError(f"{method} {path}: HTTP {reply.status_code}: {reply.text[:300]}")
        return reply.json() if reply.content else None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for child in reversed(self.children):
            if child.name == "router":
                child.stop()
        if self.colo is not None:
            self.colo.down()  # agents drain and stop; emulators stop
            self.colo = None
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None


def _env(settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return env | {"PYTHONUNBUFFERED": "1", **settings}


def wait_until(what: str, probe: Any, timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, DemoError):
            value = probe()
            if value:
                return value
        if time.monotonic() >= deadline:
            raise DemoError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def start_service(world: World) -> None:
    port = free_port()
    world.service_url = f"http://127.0.0.1:{port}"
    env = _env(SERVICE_SETTINGS | {"FLEET_DATA_DIR": str(world.workdir / "fleet")})
    args = [str(FLEETCTL), "serve", "--host", "127.0.0.1", "--port", str(port), "--admin-token"]
    child = world.spawn("service", args, env)

    def token() -> str | None:
        if not child.alive():
            raise DemoError(f"the fleet service exited:\n{child.tail()}")
        for line in child.log.read_text(errors="replace").splitlines():
            if line.startswith("admin token: "):
                return line.split(": ", 1)[1].strip()
        return None

    world.admin_token = wait_until("the fleet service's admin token", token, 60)
    wait_until(
        "the fleet service",
        lambda: httpx.get(f"{world.service_url}/readyz", timeout=2).status_code == 200,
        60,
    )


def make_token(world: World, name: str, role: str, server: str | None = None) -> str:
    """A token made on the service's database the way `fleetctl token create` makes one."""
    from fleet.auth import create_token
    from fleet.db import make_engine, session_scope
    from fleet.models import Role

    if world.engine is None:
        world.engine = make_engine(f"sqlite:///{world.workdir / 'fleet' / 'fleet.db'}")
    with session_scope(world.engine) as session:
        return create_token(session, name, Role(role), server, actor="demo")


def start_lab(world: World, inventory: dict[str, Any]) -> None:
    def token_for(server: str) -> str:
        return make_token(world, f"demo-agent-{server}", "agent", server)

    world.colo = VirtualColo(
        yaml.safe_dump(inventory, sort_keys=False),
        world.workdir / "lab",
        token_for=token_for,
        fleet_url=world.service_url,
        boot_delay_s=BOOT_DELAY_S,
        agent_env=AGENT_SETTINGS,
    )
    world.colo.up()
    rewritten = world.colo.rewritten_yaml().encode()
    world.api(
        "POST", "/inventory/import", content=rewritten, headers={"Content-Type": "application/yaml"}
    )


def start_router(world: World) -> None:
    token = make_token(world, "demo-router", "router")
    port = free_port()
    world.router_url = f"http://127.0.0.1:{port}"
    env = _env(
        ROUTER_SETTINGS | {"FLEET_ROUTER_FLEET_URL": world.service_url, "FLEET_ROUTER_TOKEN": token}
    )
    child = world.spawn("router", [str(FLEETCTL), "router", "run", "--port", str(port)], env)

    def ready() -> bool:
        if not child.alive():
            raise DemoError(f"the router exited:\n{child.tail()}")
        return httpx.get(f"{world.router_url}/readyz", timeout=2).status_code == 200

    wait_until("the router", ready, 30)
