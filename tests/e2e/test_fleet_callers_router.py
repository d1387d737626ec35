"""The fleet's client keys reach a real router: `fleetctl router run` against the live service
(uvicorn in a thread, SQLite and Postgres) reads GET /api/v1/routing/callers with its router
token, authenticates requests by the keys an operator created through the API, stops taking a
key within a poll of its revocation, and reports its usage per key, which the fleet stores.

(The routers' side with a stand-in engine, rates and shares: tests/e2e/test_router_callers.py.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
from live import serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.lab.harness import RouterProcess, wait_for
from fleet.models import Role, RouterUsage

API = "/api/v1"


def status(router: RouterProcess, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "llama", "prompt": "hello", "max_tokens": 2}
    return httpx.post(
        f"{router.url}/v1/completions", json=body, headers=headers, timeout=10
    ).status_code


def usage_rows(db: Engine) -> list[RouterUsage]:
    with Session(db) as session:
        return list(session.exec(select(RouterUsage)))


def test_a_router_authenticates_with_the_fleets_keys(db: Engine, tmp_path: Path) -> None:
    with serve(db, tmp_path) as live:
        operator = live.client(live.token(Role.OPERATOR, name="op"))
        assert operator.post(f"{API}/tenants", json={"name": "acme"}).status_code == 201
        created = operator.post(f"{API}/client-keys", json={"tenant": "acme", "name": "ci"})
        assert created.status_code == 201, created.text
        key = created.json()["key"]
        settings = {
            "FLEET_ROUTER_FLEET_URL": live.url,
            "FLEET_ROUTER_TOKEN": live.token(Role.ROUTER, name="router"),
            "FLEET_ROUTER_FLEET_POLL_S": "0.3",
            "FLEET_ROUTER_REPORT_S": "0.2",
        }
        router = RouterProcess(tmp_path / "router.log", settings)
        try:
            # No key or an unknown one: 401; the fleet's key passes authentication (the fleet
            # has no deployment named llama: the router says so, not 401).
            assert status(router, None) == 401
            assert status(router, "fk_" + "x" * 43) == 401
            assert status(router, key) == 404
            # Its reports carry its usage per key: stored, one row for the router.
            [row] = wait_for("the router's usage row", lambda: usage_rows(db) or None, 10)
            assert row.window_s is not None
            revoked = operator.delete(f"{API}/client-keys/{created.json()['id']}")
            assert revoked.status_code == 200
            wait_for("the revocation to reach the router", lambda: status(router, key) == 401, 10)
        finally:
            router.stop()
