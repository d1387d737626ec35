"""The demo's processes: the fleet service and the router as child processes, the virtual colo
(BMC emulators, agents, stand-in engines) run by this process; all stopped on exit. They are
started by fleet/lab/harness.py, as the tests and the benchmarks start theirs.

Every child leads its own process group, is SIGKILLed by the kernel if this process dies
(PR_SET_PDEATHSIG), and is stopped group-wide on the way out (SIGTERM, then SIGKILL after a
grace): a demo that ends, is interrupted or crashes leaves no process behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from sqlalchemy.engine import Engine

from fleet.lab.colo import VirtualColo
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    SERVING_SETTINGS,
    Child,
    RouterProcess,
    ServeProcess,
    create_client_key,
    wait_for,
)
from fleet.lab.harness import start_lab as start_colo

T = TypeVar("T")

# The service, shortened for a few minutes of demo (every setting said on screen).
SERVICE_SETTINGS = (
    FAST_SERVICE_SETTINGS
    | SERVING_SETTINGS
    | {
        "FLEET_HEARTBEAT_INTERVAL_S": "1",
        "FLEET_CALENDAR_INTERVAL_S": "1",
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
        "FLEET_ROUTER_REPORT_STALE_S": "10",
        # One fault in a handful of servers is more than the default 20 %: the breaker would
        # stop remediation (right for a real fleet, where that many at once means something
        # bigger).
        "FLEET_BREAKER_SHARE": "0.5",
        "FLEET_LOG_LEVEL": "WARNING",
    }
)
AGENT_SETTINGS = FAST_AGENT_SETTINGS | {
    "FLEET_AGENT_HEARTBEAT_INTERVAL_S": "1",
    "FLEET_AGENT_SAMPLE_INTERVAL_S": "0.5",
    "FLEET_AGENT_REQUEST_TIMEOUT_S": "3",
    "FLEET_AGENT_DRAIN_DEADLINE_S": "15",
    "FLEET_STANDIN_LOAD_S": "1",
    "FLEET_STANDIN_MODEL": "llama-3.1-70b",
}
ROUTER_SETTINGS = {
    # The default, said here: the demo's clients send a real client key (DEMO_TENANT's).
    "FLEET_ROUTER_CLIENT_AUTH": "keys",
    "FLEET_ROUTER_FLEET_POLL_S": "1",
    "FLEET_ROUTER_REPORT_S": "1",
    "FLEET_ROUTER_QUEUE_BOUND": "200",
    "FLEET_ROUTER_QUEUE_TIMEOUT_S": "60",
    "FLEET_ROUTER_LOG_LEVEL": "WARNING",
}
# The demo's clients: one tenant, one key (no limits), made through the API as `fleetctl tenants
# create` / `fleetctl keys create` make them; the key in DIR/client-key (0600), never printed.
DEMO_TENANT = "demo"
DEMO_KEY_NAME = "demo-load"
CLIENT_KEY_FILE = "client-key"
BOOT_DELAY_S = 3.0  # the lab's power-on to agent start (a real server: 10-15 min)
POWER_FEED_S = 1.0  # the BMCs' power readings follow the modelled draw this often (demo time)


class DemoError(RuntimeError):
    """Something the demo needs did not happen; the message says what."""


@dataclass
class World:
    """What the demo started; `close()` stops it all (idempotent)."""

    workdir: Path
    began: datetime = field(default_factory=lambda: datetime.now(UTC))
    service_url: str = ""
    router_url: str = ""
    admin_token: str = ""
    client_key: str = field(default="", repr=False)  # what the clients send (Bearer)
    children: list[Child] = field(default_factory=list)
    colo: VirtualColo | None = None
    engine: Engine | None = None
    _client: httpx.Client | None = None

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


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, every: float = 0.2) -> T:
    """harness.wait_for, a DemoError when it runs out; a probe's own DemoError (an API call
    refused while the fleet is busy) counts as a no."""

    def patient() -> T | None:
        with contextlib.suppress(DemoError):
            return probe()
        return None

    return wait_for(what, patient, timeout, every, error=DemoError)


def start_service(world: World) -> None:
    service = ServeProcess(
        "service",
        world.workdir / "fleet",
        SERVICE_SETTINGS,
        log=world.workdir / "service.log",
        die_with_us=True,
    )
    world.children.append(service)
    service.start(admin_token=True, error=DemoError)
    world.service_url = service.url
    world.admin_token = service.admin_token(error=DemoError)


def make_token(world: World, name: str, role: str, server: str | None = None) -> str:
    """A token made on the service's database the way `fleetctl token create` makes one."""
    from fleet.auth import create_token
    from fleet.db import make_engine, session_scope
    from fleet.models import Role

    if world.engine is None:
        world.engine = make_engine(f"sqlite:///{world.workdir / 'fleet' / 'fleet.db'}")
    with session_scope(world.engine) as session:
        return create_token(session, name, Role(role), server, actor="demo")


def start_lab(
    world: World, inventory: dict[str, Any], no_power_reading: Sequence[str] = ()
) -> None:
    def token_for(server: str) -> str:
        return make_token(world, f"demo-agent-{server}", "agent", server)

    world.colo = start_colo(
        world.service_url,
        world.admin_token,
        yaml.safe_dump(inventory, sort_keys=False),
        world.workdir / "lab",
        token_for=token_for,
        boot_delay_s=BOOT_DELAY_S,
        agent_env=AGENT_SETTINGS,
        # One BMC without power telemetry: the fleet shows that server's agent-based estimate.
        no_power_reading=no_power_reading,
        power_feed_s=POWER_FEED_S,
    )


def start_router(world: World) -> None:
    """The demo tenant's client key first (the router's first callers read holds it: it is
    ready only after that read), then the router, with a router token (it reads the keys)."""
    world.client_key = create_client_key(
        world.service_url,
        world.admin_token,
        world.workdir / CLIENT_KEY_FILE,
        tenant=DEMO_TENANT,
        name=DEMO_KEY_NAME,
        error=DemoError,
    )
    token = make_token(world, "demo-router", "router")
    settings = {"FLEET_ROUTER_FLEET_URL": world.service_url, "FLEET_ROUTER_TOKEN": token}
    router = RouterProcess(
        world.workdir / "router.log",
        ROUTER_SETTINGS | settings,
        name="router",
        die_with_us=True,
        error=DemoError,
    )
    world.children.append(router)
    world.router_url = router.url
