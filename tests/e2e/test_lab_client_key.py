"""The lab's client key (fleet/lab/harness.py `create_client_key`: what `fleetctl demo`'s clients
send), on SQLite and Postgres: a tenant and a key made through a live fleet's API, the key
kept in a 0600 file; a real `fleetctl router run` on that fleet (a router token, client auth
left at its default, keys) serves a request that carries it and refuses one without it.
"""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import httpx
import pytest
from live import serve
from sqlalchemy.engine import Engine

from fleet.lab.harness import RouterProcess, create_client_key
from fleet.models import Role


def test_a_lab_key_is_made_through_the_api_and_kept_in_a_private_file(
    db: Engine, tmp_path: Path
) -> None:
    with serve(db, tmp_path) as live:
        operator = live.token(Role.OPERATOR, name="op")
        first = create_client_key(live.url, operator, tmp_path / "k1", tenant="lab", name="load")
        # A second run keeps the tenant (its POST answers 409) and adds a key.
        second = create_client_key(live.url, operator, tmp_path / "k2", tenant="lab", name="more")
        assert first.startswith("fk_") and second.startswith("fk_") and first != second
        for path, key in ((tmp_path / "k1", first), (tmp_path / "k2", second)):
            assert path.read_text() == key + "\n"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        keys = live.client(operator).get("/api/v1/client-keys", params={"tenant": "lab"}).json()
        assert [(k["name"], k["active"]) for k in keys["results"]] == [
            ("load", True),
            ("more", True),
        ]
        router = live.client(live.token(Role.ROUTER, name="rt"))
        callers = router.get("/api/v1/routing/callers").json()
        hashes = {k["hash"] for k in callers["keys"] if k["tenant"] == "lab"}
        assert hashes == {hashlib.sha256(k.encode()).hexdigest() for k in (first, second)}

        # Refused (a viewer may not create): the call and the reason, and no file.
        viewer = live.token(Role.VIEWER, name="v")
        with pytest.raises(RuntimeError, match=r"POST /tenants: HTTP 403"):
            create_client_key(live.url, viewer, tmp_path / "k3", tenant="lab2", name="x")
        assert not (tmp_path / "k3").exists()


def test_the_router_on_the_fleet_takes_the_lab_key_and_refuses_none(
    db: Engine, tmp_path: Path
) -> None:
    with serve(db, tmp_path) as live:
        key = create_client_key(
            live.url, live.token(Role.OPERATOR, name="op"), tmp_path / "key", tenant="lab", name="c"
        )
        settings = {
            "FLEET_ROUTER_FLEET_URL": live.url,
            "FLEET_ROUTER_TOKEN": live.token(Role.ROUTER, name="rt"),
            "FLEET_ROUTER_FLEET_POLL_S": "0.2",
            "FLEET_ROUTER_REPORT_S": "0",
        }  # no FLEET_ROUTER_CLIENT_AUTH: keys, the default
        router = RouterProcess(tmp_path / "router.log", settings)
        try:
            body = {"model": "nothing-deployed", "prompt": "hi", "max_tokens": 1}
            url = f"{router.url}/v1/completions"
            bare = httpx.post(url, json=body, timeout=10)
            assert bare.status_code == 401, bare.text
            assert bare.json()["error"]["type"] == "authentication_error"
            wrong = {"Authorization": "Bearer fk_not-a-key"}
            assert httpx.post(url, json=body, headers=wrong, timeout=10).status_code == 401
            # With the key, past authentication to routing: no such model here.
            good = {"Authorization": f"Bearer {key}"}
            served = httpx.post(url, json=body, headers=good, timeout=10)
            assert served.status_code == 404, served.text
            assert "is not served here" in served.json()["error"]["message"]
            assert key not in router.run_log()
        finally:
            router.stop()
