"""Helpers for end-to-end tests that run real `fleetctl serve` processes, optionally with the
virtual colo (BMC emulators, agents with stand-in engines) in front of them.

Not a test module: test modules import it (`from colo_world import ...`, as they import
factories). Importing it starts nothing.

The processes themselves (`ServeProcess`, `RouterProcess`), `wait_for` and the fast-loop
settings are fleet/lab/harness.py's, which the benchmarks and the demo use too.

- `Api`: the REST API with a token.
- `colo_world()`: a service on its embedded SQLite database and a lab of IPMI servers, imported
  and verified (every server warm); everything stopped on the way out, agents first, and no
  process of the lab left behind (`down_and_check`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from typer.testing import CliRunner, Result

from fleet import cli, db
from fleet.cli.lab import lab_token_maker
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import ServeProcess, start_lab, wait_for
from fleet.lab.processes import ProcRef
from fleet.lab.state import recorded_processes


def parse_at(text: str) -> float:
    """An API timestamp (ISO 8601, UTC when it has no offset) as epoch seconds."""
    at = datetime.fromisoformat(text)
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


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
        colo = start_lab(
            service.url,
            api.token,
            inventory,
            base / "lab",
            token_for=lab_token_maker(engine),
            boot_delay_s=boot_delay_s,
            agent_env=agent_env,
        )
        stack.callback(down_and_check, colo)
        world = World(service, colo, api, database)
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
