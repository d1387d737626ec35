"""Rollouts through the REST API and `fleetctl deployments rollout|rollback|rollout-status`,
against a live service on SQLite and Postgres: viewers read, operators start and roll back,
refusals are one-line 4xx answers, the routing table carries the split."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from factories import add_rack, add_server, add_site
from live import Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from typer.testing import CliRunner

from fleet import cli
from fleet.crypto import SecretBox
from fleet.models import Deployment, Event, ModelVersion, Role, Server, utcnow
from fleet.rollout.service import rollout_once

API = "/api/v1/deployments"


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("rollouts")) as server:
        yield server


@pytest.fixture
def fleet(live: Live, db: Engine) -> Iterator[Live]:
    """llama on llama@v1 (v2 waiting), two serving servers whose agents report v1."""
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
        for i in range(2):
            server = add_server(
                session, rack, f"gpu{i}", "serving", u_position=1 + 8 * i, bmc_system_id=f"{i}"
            )
            server.deployment_id = dep.id
            server.agent_url = f"http://127.0.0.1:{9410 + i}"
            server.agent_ready = True
            server.last_heartbeat_at = utcnow()
            server.replicas = [
                {
                    "index": 0,
                    "url": f"http://127.0.0.1:{8100 + i}",
                    "state": "ready",
                    "version": "llama@v1",
                }
            ]
            session.add(server)
        session.commit()
    yield live
    live.close_clients()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def detail(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    text = response.json()["detail"]
    assert isinstance(text, str) and "\n" not in text
    return text


def test_operators_start_and_roll_back_viewers_read(fleet: Live) -> None:
    operator = fleet.client(fleet.token(Role.OPERATOR, name="op"))
    viewer = fleet.client(fleet.token(Role.VIEWER, name="v"))
    body = {"version": "v2", "canary": "10%", "steps": ["50%"], "step_s": 30}
    assert viewer.post(f"{API}/llama/rollout", json=body).status_code == 403
    started = ok(operator.post(f"{API}/llama/rollout", json=body), 202)
    assert (started["model_version"], started["canary_version"]) == ("llama@v1", "llama@v2")
    assert started["rollout"]["steps"] == [0.1, 0.5]
    assert {s["server"]: s["version"] for s in started["servers"]} == {
        "gpu0": "llama@v1",
        "gpu1": "llama@v1",
    }
    assert "already rolling out" in detail(operator.post(f"{API}/llama/rollout", json=body), 409)
    # The leader's tick moves one server; the routing table shows the split.
    rollout_once(fleet.engine, fleet.settings, SecretBox(fleet.settings.resolve_secret_key()))
    status = ok(viewer.get(f"{API}/llama/rollout"))
    assert sorted(s["version"] for s in status["servers"]) == ["llama@v1", "llama@v2"]
    router = fleet.client(fleet.token(Role.ROUTER, name="r"))
    [row] = ok(router.get("/api/v1/routing"))["results"]
    assert row["versions"] == {"stable": "llama@v1", "canary": "llama@v2", "canary_weight": 0.0}
    # The moved server still runs v1 until its agent restarts it: the table says so.
    assert {r["version"] for r in row["replicas"]} == {"llama@v1"}
    back = ok(operator.post(f"{API}/llama/rollback", json={"reason": "not today"}))
    assert back["canary_version"] is None and back["rollout"]["status"] == "rolled_back"
    assert {s["version"] for s in back["servers"]} == {"llama@v1"}
    with Session(fleet.engine) as session:
        [event] = session.exec(select(Event).where(Event.kind == "deployment.rollback")).all()
        assert event.actor == "operator:op" and "not today" in event.message
    assert "no rollout" in detail(operator.post(f"{API}/llama/rollback"), 409)


def test_refusals_say_what_to_fix(fleet: Live) -> None:
    operator = fleet.client(fleet.token(Role.OPERATOR, name="op"))
    cases = [
        ({"version": "v9"}, 404, "no model version 'v9'"),
        ({"version": "v1"}, 409, "already serves llama@v1"),
        ({"version": "v2", "canary": "150%"}, 400, "rollout plan: share 150%"),
        ({"version": "v2", "canary": "50%", "steps": ["10%"]}, 400, "steps must increase"),
    ]
    for body, status, text in cases:
        assert text in detail(operator.post(f"{API}/llama/rollout", json=body), status)
    assert operator.post(f"{API}/llama/rollout", json={}).status_code == 422
    assert "no deployment" in detail(operator.post(f"{API}/nope/rollout", json=cases[0][0]), 404)
    assert "no deployment" in detail(operator.get(f"{API}/nope/rollout"), 404)
    with Session(fleet.engine) as session:
        assert session.exec(select(Deployment)).one().canary_version_id is None


def test_fleetctl_rollout_status_and_rollback(fleet: Live) -> None:
    runner = CliRunner()
    env = {"FLEET_URL": fleet.url, "FLEET_TOKEN": fleet.token(Role.OPERATOR, name="cli")}

    def fleetctl(*args: str) -> Any:
        return runner.invoke(cli.app, ["deployments", *args], env=env)

    started = fleetctl(
        "rollout", "llama", "--version", "llama@v2", "--canary", "5%", "--step-s", "9"
    )
    assert started.exit_code == 0, started.output
    assert "llama@v1 → llama@v2" in started.output and "5.0%" in started.output
    shown = fleetctl("rollout-status", "llama")
    assert shown.exit_code == 0 and "running" in shown.output and "gpu0" in shown.output
    as_json = json.loads(fleetctl("rollout-status", "llama", "-o", "json").output)
    assert as_json["rollout"]["step_s"] == 9
    again = fleetctl("rollout", "llama", "--version", "v2")
    assert again.exit_code == 1 and "already rolling out" in again.output
    back = fleetctl("rollback", "llama", "--reason", "demo")
    assert back.exit_code == 0 and "rolled_back" in back.output
    with Session(fleet.engine) as session:
        assert {s.model_version_id for s in session.exec(select(Server))} == {None}
