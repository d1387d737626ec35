"""A rollout end to end through a real router: the fleet service (its API and routing table,
on SQLite and Postgres), a real `fleetctl router run` polling it and posting its load reports,
and the rollout's tick (`rollout_once`, driven by the test as the leader's loop would).

The four servers' agents and engines are TEST DOUBLES on the test's event loop: each server's
agent /state and one replica that answers 200 on llama@v1 and HTTP 500 to every other request
on llama@v2 (the "bad version"); an agent "restarts" on the version the fleet assigns it (its
`model_version_id`) at the test's next step, and its heartbeat is written into the server row
as the registry would. Clients send requests throughout.

What is pinned (the issue's acceptance, in miniature): the rollout to the bad version is rolled
back automatically at the canary step, with fewer failed requests than the canary's share of
the requests sent meanwhile; a `deployment.rollback` Event carries the figures; the router's
metrics count requests by version; after the rollback no request reaches the canary.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from factories import add_rack, add_server, add_site
from live import Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.lab.harness import RouterProcess, free_port
from fleet.models import Deployment, Event, ModelVersion, Role, Server, utcnow
from fleet.rollout.service import rollout_once

V1, V2 = "llama@v1", "llama@v2"
SERVERS = 4
CANARY = 0.1
# A server moved to another version restarts its engine: its agent says "starting" (not
# ready) for at least this long, and until the router has read that twice (its agent polls
# come every 0.25 s, later on a loaded machine), while the old engine answers what it was
# sent. Only then does the replica answer as the new version, so every answer is counted
# under the version the router saw.
RESTART_S = 0.6
RESTART_POLLS = 2


class Servers:
    """Per server: an agent /state and one replica, on one event loop in a thread."""

    def __init__(self, bad: bool = True) -> None:
        self.bad = bad
        self.agent_ports = [free_port() for _ in range(SERVERS)]
        self.replica_ports = [free_port() for _ in range(SERVERS)]
        self.version = [V1] * SERVERS  # what each server's replica answers as now
        # Per server, while its engine restarts: (the version it restarts on, since when,
        # the agent's polls answered before)
        self.restarting: list[tuple[str, float, int] | None] = [None] * SERVERS
        self.polls = [0] * SERVERS  # the agent's /state answers so far
        self.answered: dict[str, int] = {V1: 0, V2: 0}
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.replica_ports[i]}"

    def replicas(self, i: int) -> list[dict[str, Any]]:
        pending = self.restarting[i]
        state, version = ("starting", pending[0]) if pending else ("ready", self.version[i])
        return [{"index": 0, "url": self.replica_url(i), "state": state, "version": version}]

    def assign(self, i: int, version: str) -> None:
        """What the agent does with its server's assigned version: restart the engine on it
        (RESTART_S and RESTART_POLLS, not ready meanwhile), then serve it."""
        pending, now = self.restarting[i], time.monotonic()
        if version == self.version[i]:
            self.restarting[i] = None
        elif pending is None or pending[0] != version:
            self.restarting[i] = (version, now, self.polls[i])
        elif now - pending[1] >= RESTART_S and self.polls[i] - pending[2] > RESTART_POLLS:
            self.version[i], self.restarting[i] = version, None

    async def _state(self, i: int, _: web.Request) -> web.Response:
        self.polls[i] += 1
        return web.json_response({"ready": True, "draining": False, "replicas": self.replicas(i)})

    async def _completion(self, i: int, request: web.Request) -> web.Response:
        await request.read()
        version = self.version[i]
        self.answered[version] += 1
        if self.bad and version == V2 and self.answered[version] % 2 == 0:
            error = {"object": "error", "message": "bad version", "type": "InternalServerError"}
            return web.json_response({**error, "code": 500}, status=500)
        return web.json_response(
            {
                "id": "c",
                "object": "text_completion",
                "created": 0,
                "model": "llama",
                "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runners = []
        for i in range(SERVERS):
            agent = web.Application()
            agent.router.add_get("/state", partial(self._state, i))
            replica = web.Application()
            replica.router.add_post("/v1/completions", partial(self._completion, i))
            runners += [(web.AppRunner(agent), self.agent_ports[i])]
            runners += [(web.AppRunner(replica), self.replica_ports[i])]
        for runner, port in runners:
            self._loop.run_until_complete(runner.setup())
            self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        self._started.set()
        self._loop.run_forever()
        for runner, _ in runners:
            self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> Servers:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fleet(
    db: Engine, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Live, Servers]]:
    bad = getattr(request, "param", True)
    with (
        Servers(bad) as servers,
        serve(db, tmp_path / "svc", router_report_stale_s=30.0) as live,
    ):
        with Session(db) as session:
            rack = add_rack(session, add_site(session, "s1"), "r1")
            v1, v2 = (
                ModelVersion(model="llama", version=v, digest=f"sha256:{v}", created_by="t")
                for v in ("v1", "v2")
            )
            session.add_all([v1, v2])
            session.commit()
            dep = Deployment(
                name="llama",
                model_uri="llama",
                model_checksum="sha256:v1",
                sla_p95_latency_ms=2000,
                sla_ttft_ms=500,
                model_version_id=v1.id,
            )
            session.add(dep)
            session.commit()
            for i in range(SERVERS):
                server = add_server(
                    session, rack, f"gpu{i}", "serving", u_position=1 + 8 * i, bmc_system_id=str(i)
                )
                server.deployment_id = dep.id
                server.agent_url = f"http://127.0.0.1:{servers.agent_ports[i]}"
                session.add(server)
            session.commit()
        heartbeat(db, servers)
        yield live, servers
        live.close_clients()


def heartbeat(db: Engine, servers: Servers) -> None:
    """Each agent restarts on its assigned version (if it changed: `Servers.assign`) and
    reports, as the registry would store its heartbeat."""
    with Session(db) as session:
        keys = {v.id: f"{v.model}@{v.version}" for v in session.exec(select(ModelVersion))}
        dep = session.exec(select(Deployment)).one()
        for server in session.exec(select(Server).order_by(col(Server.name))):
            i = int(server.name[3:])
            servers.assign(i, keys[server.model_version_id or dep.model_version_id])
            server.agent_ready = True
            server.last_heartbeat_at = utcnow()
            server.replicas = servers.replicas(i)
            session.add(server)
        session.commit()


class Load:
    """One client sending requests back to back until stopped; status codes kept in order."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": "llama", "prompt": "hi", "max_tokens": 1}
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set() and len(self.codes) < 20_000:
                self.codes.append(client.post(f"{self.url}/v1/completions", json=body).status_code)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(15)


def start_router(live: Live, tmp_path: Path) -> RouterProcess:
    settings = {
        "FLEET_ROUTER_FLEET_URL": live.url,
        "FLEET_ROUTER_TOKEN": live.token(Role.ROUTER, name="router"),
        "FLEET_ROUTER_FLEET_POLL_S": "0.2",
        "FLEET_ROUTER_REPORT_S": "0.3",
        # About rollouts, not callers: explicitly unauthenticated.
        "FLEET_ROUTER_CLIENT_AUTH": "none",
    }
    return RouterProcess(tmp_path / "router.log", settings)


def test_a_bad_version_is_rolled_back_at_the_canary_step_through_a_real_router(
    fleet: tuple[Live, Servers], tmp_path: Path
) -> None:
    live, servers = fleet
    router = start_router(live, tmp_path)
    box = SecretBox(live.settings.resolve_secret_key())
    cfg = live.settings.model_copy(update={"probe_interval_s": 0.0, "rollout_min_requests": 20})
    try:
        operator = live.client(live.token(Role.OPERATOR, name="op"))
        with Load(router.url) as load:
            time.sleep(1.0)  # the stable version alone first
            body = {"version": "v2", "canary": f"{CANARY:.0%}", "step_s": 60}
            assert operator.post("/api/v1/deployments/llama/rollout", json=body).status_code == 202
            window_opened: int | None = None  # requests sent when the routers got the weight
            rolled_back_at: int | None = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and rolled_back_at is None:
                rollout_once(live.engine, cfg, box)
                heartbeat(live.engine, servers)
                with Session(live.engine) as session:
                    dep = session.exec(select(Deployment)).one()
                    if window_opened is None and dep.canary_weight > 0:
                        window_opened = len(load.codes)
                    if dep.rollout.get("status") == "rolled_back":
                        rolled_back_at = len(load.codes)
                time.sleep(0.3)
            assert rolled_back_at is not None, router.tail()
            after = len(load.codes)
            time.sleep(2.0)  # the routers take the rollback: nothing more to the canary
            canary_then = servers.answered[V2]
            time.sleep(1.0)
            assert servers.answered[V2] == canary_then
        assert window_opened is not None
        failed = load.codes.count(500)
        window = len(load.codes) - window_opened
        # The acceptance: fewer failed requests than the canary's share of the window.
        assert 0 < failed < CANARY * window, (failed, window)
        assert set(load.codes) <= {200, 500}
        with Session(live.engine) as session:
            [event] = session.exec(select(Event).where(Event.kind == "deployment.rollback")).all()
            assert event.details["automatic"] is True and event.details["step"] == 1
            figures = event.details["figures"]
            assert figures["canary"]["errors"] > 0 and figures["canary"]["requests"] >= 20
            assert figures["stable"]["errors"] == 0
            assert "error rate" in event.message
            dep = session.exec(select(Deployment)).one()
            assert (dep.canary_version_id, dep.canary_weight) == (None, 0.0)
            assert {s.model_version_id for s in session.exec(select(Server))} == {None}
        metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
        by_version = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("router_requests_total{")
        }
        failed_by_version = {
            labels: n for labels, n in by_version.items() if 'code="500"' in labels and n
        }
        # Every failure counted under the version of the replica that answered: the canary's.
        assert sum(failed_by_version.values()) == failed
        wrong = [labels for labels in failed_by_version if 'version="llama@v2"' not in labels]
        assert not wrong, wrong
        print(
            f"\nrollout rolled back after {rolled_back_at - (window_opened or 0)} requests in the "
            f"window ({after} sent in all by then): {failed} failed of {window} "
            f"({failed / window:.1%}; canary share {CANARY:.0%})"
        )
    finally:
        router.stop()


@pytest.mark.parametrize("fleet", [False], indirect=True, ids=["good"])
def test_a_good_version_is_rolled_out_through_a_real_router(
    fleet: tuple[Live, Servers], tmp_path: Path
) -> None:
    live, servers = fleet
    router = start_router(live, tmp_path)
    box = SecretBox(live.settings.resolve_secret_key())
    cfg = live.settings.model_copy(update={"probe_interval_s": 0.0, "rollout_min_requests": 20})
    try:
        operator = live.client(live.token(Role.OPERATOR, name="op"))
        with Load(router.url) as load:
            body = {"version": "v2", "canary": "10%", "steps": ["50%"], "step_s": 2}
            assert operator.post("/api/v1/deployments/llama/rollout", json=body).status_code == 202
            deadline = time.monotonic() + 90
            status = None
            while time.monotonic() < deadline and status not in ("complete", "rolled_back"):
                rollout_once(live.engine, cfg, box)
                heartbeat(live.engine, servers)
                with Session(live.engine) as session:
                    status = session.exec(select(Deployment)).one().rollout.get("status")
                time.sleep(0.3)
            assert status == "complete", router.tail()
            time.sleep(1.0)  # the routers take the new stable version
            before = servers.answered[V1]
            time.sleep(1.0)
            assert servers.answered[V1] == before  # nothing runs v1 any more
        assert set(load.codes) == {200}
        with Session(live.engine) as session:
            [event] = session.exec(
                select(Event).where(Event.kind == "deployment.rollout_complete")
            ).all()
            assert [step["weight"] for step in event.details["steps"]] == [0.1, 0.5]
            dep = session.exec(select(Deployment)).one()
            assert (dep.model_checksum, dep.canary_version_id) == ("sha256:v2", None)
        view = httpx.get(f"{router.url}/state", timeout=5).json()["deployments"][0]
        assert view["versions"]["stable"] == V2
    finally:
        router.stop()
