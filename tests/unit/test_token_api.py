"""Agent tokens through the API (/api/v1/tokens, fleet/api/routes/tokens.py) and `fleetctl
agent-tokens`, against a real service (uvicorn in a thread) on SQLite and Postgres: one live
token per server, lists without values or hashes, revoke, and rotation with an overlap in which
both tokens work.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import add_rack, add_server, add_site
from live import Live, debug_logging, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner, Result

from fleet import cli
from fleet.auth import MAX_LIFETIME, hash_token
from fleet.models import ApiToken, Event, Role, utcnow

API = "/api/v1/tokens"
SERVERS = ("gpu-a", "gpu-b")
OVERLAP_S = 3600.0
LIFETIME_S = 30 * 86_400.0
INFO_FIELDS = {
    "id",
    "name",
    "role",
    "server",
    "created_at",
    "expires_at",
    "expired",
    "revoked_at",
    "replaced_by",
}
MINTED_FIELDS = {"id", "name", "role", "server", "expires_at", "token"}


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    settings = {"agent_token_overlap_s": OVERLAP_S, "agent_token_lifetime_s": LIFETIME_S}
    with serve(engine, tmp_path_factory.mktemp("token-api"), **settings) as server:
        yield server


@pytest.fixture
def servers(db: Engine, session: Session) -> tuple[str, ...]:
    rack = add_rack(session, add_site(session, "lab"), "r1")
    for i, name in enumerate(SERVERS):
        add_server(session, rack, name, u_position=1 + 8 * i, bmc_port=8000 + i)
    session.commit()
    return SERVERS


@pytest.fixture
def admin(live: Live, servers: tuple[str, ...]) -> Iterator[httpx.Client]:
    yield live.client(live.token(Role.ADMIN, name="admin"))
    live.close_clients()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json()


def refused(response: httpx.Response, status: int) -> str:
    """The one-line detail of a `status` answer."""
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    text = response.json()["detail"]
    assert isinstance(text, str) and text and "\n" not in text, text
    return text


def mint(admin: httpx.Client, server: str, **body: Any) -> dict[str, Any]:
    minted: dict[str, Any] = ok(admin.post(f"{API}/agent", json={"server": server, **body}), 201)
    return minted


def tokens(admin: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = ok(admin.get(API, params=params))["results"]
    return rows


def works(live: Live, token: str) -> bool:
    """Whether the service takes `token` (its own info answers 200; 401 otherwise)."""
    status = live.client(token).get(f"{API}/self").status_code
    assert status in (200, 401), status
    return status == 200


def token_events(session: Session) -> list[Event]:
    query = select(Event).where(Event.subject_type == "token").order_by(col(Event.id))
    return list(session.exec(query))


# ---------------------------------------------------------------------------------------------
# Mint


def test_mint_returns_the_token_once_and_it_works_for_its_server_only(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    minted = mint(admin, "gpu-a")
    assert minted.keys() == MINTED_FIELDS
    assert (minted["name"], minted["role"], minted["server"]) == ("agent-gpu-a", "agent", "gpu-a")
    assert minted["token"].startswith("flt_")
    lifetime = datetime.fromisoformat(minted["expires_at"]) - utcnow()
    assert timedelta(seconds=LIFETIME_S - 60) < lifetime <= timedelta(seconds=LIFETIME_S)
    agent = live.client(minted["token"])
    own = ok(agent.get(f"{API}/self"))
    assert own.keys() == INFO_FIELDS
    assert (own["id"], own["server"], own["expired"], own["replaced_by"]) == (
        minted["id"],
        "gpu-a",
        False,
        None,
    )
    # An agent token reaches the agent endpoints for its server, nothing an admin may do.
    assert "needs the admin role" in refused(agent.get(API), 403)
    assert "needs the admin role" in refused(agent.post(f"{API}/agent", json={"server": "x"}), 403)
    # Only the hash is stored; no event carries the value or the hash.
    row = session.exec(select(ApiToken).where(ApiToken.id == minted["id"])).one()
    assert row.token_hash == hash_token(minted["token"]) and row.server_id is not None
    [created] = token_events(session)[-1:]
    assert created.kind == "token.created" and created.actor == "admin:admin"
    assert created.details["id"] == minted["id"] and created.details["server"] == "gpu-a"
    text = json.dumps([created.message, created.details])
    assert minted["token"] not in text and row.token_hash not in text


def test_mint_takes_a_lifetime_within_bounds(admin: httpx.Client) -> None:
    minted = mint(admin, "gpu-a", expires_in_s=3600)
    lifetime = datetime.fromisoformat(minted["expires_at"]) - utcnow()
    assert timedelta(minutes=59) < lifetime <= timedelta(hours=1)
    longest = MAX_LIFETIME.total_seconds()
    minted = mint(admin, "gpu-b", expires_in_s=longest)
    assert datetime.fromisoformat(minted["expires_at"]) - utcnow() > MAX_LIFETIME - timedelta(
        minutes=1
    )


def test_one_live_token_per_server(live: Live, admin: httpx.Client) -> None:
    first = mint(admin, "gpu-a")
    text = refused(admin.post(f"{API}/agent", json={"server": "gpu-a"}), 409)
    assert f"id {first['id']}" in text and "rotate" in text and "revoke" in text, text
    assert first["token"] not in text
    mint(admin, "gpu-b")  # another server has its own
    # Revoked, the server may have a new one.
    ok(admin.delete(f"{API}/{first['id']}"))
    second = mint(admin, "gpu-a")
    assert works(live, second["token"]) and not works(live, first["token"])


def test_a_token_made_on_the_database_counts_as_the_servers_live_one(
    live: Live, admin: httpx.Client
) -> None:
    live.token(Role.AGENT, name="bootstrap", server="gpu-a")  # `fleetctl token create`
    [row] = tokens(admin, server="gpu-a", live="true")
    text = refused(admin.post(f"{API}/agent", json={"server": "gpu-a"}), 409)
    assert f"id {row['id']}" in text


def test_an_expired_token_leaves_room_for_a_new_one(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    old = mint(admin, "gpu-a")
    _expire(session, old["id"])
    assert not works(live, old["token"])
    new = mint(admin, "gpu-a")
    assert works(live, new["token"])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "body.server"),
        ({"server": ""}, "body.server"),
        ({"server": "gpu-a", "expires_in_s": 0}, "body.expires_in_s"),
        ({"server": "gpu-a", "expires_in_s": -5}, "body.expires_in_s"),
        ({"server": "gpu-a", "expires_in_s": MAX_LIFETIME.total_seconds() + 1}, "expires_in_s"),
        ({"server": "gpu-a", "expires_in_s": "90d"}, "body.expires_in_s"),
        ({"server": "gpu-a", "expires_in_s": True}, "body.expires_in_s"),
        ({"server": "gpu-a", "role": "admin"}, "body.role"),
        ({"server": 7}, "body.server"),
    ],
)
def test_mint_refuses_bad_input_naming_the_field(
    admin: httpx.Client, session: Session, body: dict[str, Any], needle: str
) -> None:
    assert needle in refused(admin.post(f"{API}/agent", json=body), 422)
    assert session.exec(select(ApiToken).where(ApiToken.role == Role.AGENT)).all() == []


def test_unknown_server_or_token_is_404(admin: httpx.Client) -> None:
    assert "no server named 'ghost'" in refused(
        admin.post(f"{API}/agent", json={"server": "ghost"}), 404
    )
    assert "ghost" in refused(admin.get(API, params={"server": "ghost"}), 404)
    assert "no token with id 999" in refused(admin.delete(f"{API}/999"), 404)
    assert "no token with id 999" in refused(admin.post(f"{API}/999/rotate"), 404)
    # An id out of the column's range: 422, not a database error. Not a number at all: no
    # such route (404), so that /tokens/agent and /tokens/self are never taken for ids.
    for bad in ("0", str(2**31), str(2**70)):
        assert admin.delete(f"{API}/{bad}").status_code == 422, bad
        assert admin.post(f"{API}/{bad}/rotate").status_code == 422, bad
    assert admin.delete(f"{API}/abc").status_code == 404
    assert admin.post(f"{API}/abc/rotate").status_code == 404


# ---------------------------------------------------------------------------------------------
# List, self, revoke


def test_list_filters_by_server_role_and_liveness_and_never_shows_a_value(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    a = mint(admin, "gpu-a")
    b = mint(admin, "gpu-b")
    rotated = ok(admin.post(f"{API}/{b['id']}/rotate"), 201)
    ok(admin.delete(f"{API}/{a['id']}"))
    c = mint(admin, "gpu-a")
    everything = tokens(admin)
    assert all(row.keys() == INFO_FIELDS for row in everything)
    body = admin.get(API).text
    hashes = [t.token_hash for t in session.exec(select(ApiToken))]
    for secret in (a["token"], b["token"], rotated["token"], c["token"], *hashes):
        assert secret not in body
    ids = [row["id"] for row in everything]
    assert ids == sorted(ids)
    agents = [a["id"], b["id"], rotated["id"], c["id"]]
    assert [row["id"] for row in tokens(admin, role="agent")] == agents
    assert [row["role"] for row in tokens(admin, role="admin")] == ["admin"]
    assert [row["id"] for row in tokens(admin, server="gpu-b")] == [b["id"], rotated["id"]]
    assert [row["id"] for row in tokens(admin, server="gpu-a")] == [a["id"], c["id"]]
    # Live: neither revoked (a), expired, nor replaced (b, still working in its overlap).
    assert [row["id"] for row in tokens(admin, role="agent", live="true")] == [
        rotated["id"],
        c["id"],
    ]
    not_live = tokens(admin, role="agent", live="false")
    assert [row["id"] for row in not_live] == [a["id"], b["id"]]
    assert not_live[0]["revoked_at"] is not None and not_live[0]["replaced_by"] is None
    assert (not_live[1]["revoked_at"], not_live[1]["replaced_by"]) == (None, rotated["id"])
    assert works(live, b["token"])
    # The admin's own token is live and in the unfiltered list.
    assert "admin" in {row["role"] for row in tokens(admin, live="true")}
    # Paged like every list.
    page = ok(admin.get(API, params={"limit": 1}))
    assert page["count"] == len(everything) and len(page["results"]) == 1 and page["next"]
    assert "query.live" in refused(admin.get(API, params={"live": "maybe"}), 422)
    assert "query.role" in refused(admin.get(API, params={"role": "root"}), 422)


def test_self_answers_every_role_its_own_token(live: Live, servers: tuple[str, ...]) -> None:
    for role in (Role.ADMIN, Role.OPERATOR, Role.ROUTER, Role.VIEWER):
        token = live.token(role, name=f"me-{role.value}")
        own = ok(live.client(token).get(f"{API}/self"))
        assert (own["name"], own["role"], own["server"]) == (f"me-{role.value}", role.value, None)
    assert live.client().get(f"{API}/self").status_code == 401
    assert live.client("flt_nope").get(f"{API}/self").status_code == 401
    live.close_clients()


def test_revoke_is_401_from_then_on_and_idempotent(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    minted = mint(admin, "gpu-a")
    assert works(live, minted["token"])
    revoked = ok(admin.delete(f"{API}/{minted['id']}"))
    assert revoked.keys() == INFO_FIELDS and revoked["revoked_at"] is not None
    assert not works(live, minted["token"])
    again = ok(admin.delete(f"{API}/{minted['id']}"))
    assert again["revoked_at"] == revoked["revoked_at"]
    kinds = [e.kind for e in token_events(session)]
    assert kinds.count("token.revoked") == 1
    [event] = [e for e in token_events(session) if e.kind == "token.revoked"]
    assert event.actor == "admin:admin" and event.details == {"id": minted["id"]}
    # Any token may be revoked through the API, an admin's too.
    viewer = live.token(Role.VIEWER, name="leaving")
    [row] = tokens(admin, role="viewer")
    ok(admin.delete(f"{API}/{row['id']}"))
    assert not works(live, viewer)


def test_viewers_and_operators_may_not_touch_tokens(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    minted = mint(admin, "gpu-a")
    for role in (Role.VIEWER, Role.OPERATOR, Role.ROUTER):
        client = live.client(live.token(role, name=role.value))
        for response in (
            client.get(API),
            client.post(f"{API}/agent", json={"server": "gpu-b"}),
            client.delete(f"{API}/{minted['id']}"),
            client.post(f"{API}/{minted['id']}/rotate"),
        ):
            text = refused(response, 403)
            assert role.value in text and "needs the admin role" in text, text
    assert works(live, minted["token"])
    assert [row["server"] for row in tokens(admin, role="agent")] == ["gpu-a"]
    # An anonymous caller learns nothing either.
    assert live.client().get(API).status_code == 401


# ---------------------------------------------------------------------------------------------
# Rotate


def test_rotate_overlaps_then_the_old_token_stops(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    old = mint(admin, "gpu-a")
    new = ok(admin.post(f"{API}/{old['id']}/rotate"), 201)
    assert new.keys() == MINTED_FIELDS
    assert (new["server"], new["name"], new["role"]) == ("gpu-a", "agent-gpu-a", "agent")
    assert new["id"] != old["id"] and new["token"] != old["token"]
    # Both work during the overlap; the old one is shortened to it, and names its successor.
    assert works(live, old["token"]) and works(live, new["token"])
    shown = ok(live.client(old["token"]).get(f"{API}/self"))
    assert shown["replaced_by"] == new["id"] and not shown["expired"]
    old_until = datetime.fromisoformat(shown["expires_at"]) - utcnow()
    assert timedelta(seconds=OVERLAP_S - 60) < old_until <= timedelta(seconds=OVERLAP_S)
    new_lifetime = datetime.fromisoformat(new["expires_at"]) - utcnow()
    assert new_lifetime > timedelta(seconds=LIFETIME_S - 60)
    [event] = [e for e in token_events(session) if e.kind == "token.rotated"]
    assert event.actor == "admin:admin"
    assert event.details["replaced_by"] == new["id"] and event.details["server"] == "gpu-a"
    assert old["token"] not in event.message and new["token"] not in json.dumps(event.details)
    # Past the overlap (as if the hour had gone by), the old token is refused.
    _expire(session, old["id"])
    assert not works(live, old["token"]) and works(live, new["token"])


def test_rotating_keeps_an_earlier_expiry(live: Live, admin: httpx.Client) -> None:
    old = mint(admin, "gpu-a", expires_in_s=600)  # sooner than the overlap's hour
    ok(admin.post(f"{API}/{old['id']}/rotate"), 201)
    shown = ok(live.client(old["token"]).get(f"{API}/self"))
    assert shown["expires_at"] == old["expires_at"]


def test_rotate_refuses_replaced_revoked_expired_and_other_tokens(
    live: Live, admin: httpx.Client, session: Session
) -> None:
    old = mint(admin, "gpu-a")
    new = ok(admin.post(f"{API}/{old['id']}/rotate"), 201)
    text = refused(admin.post(f"{API}/{old['id']}/rotate"), 409)
    assert "already rotated" in text and str(new["id"]) in text, text
    ok(admin.delete(f"{API}/{new['id']}"))
    assert "revoked" in refused(admin.post(f"{API}/{new['id']}/rotate"), 409)
    gone = mint(admin, "gpu-b")
    _expire(session, gone["id"])
    assert "expired" in refused(admin.post(f"{API}/{gone['id']}/rotate"), 409)
    live.token(Role.VIEWER, name="person")
    [viewer] = tokens(admin, role="viewer")
    text = refused(admin.post(f"{API}/{viewer['id']}/rotate"), 409)
    assert "viewer token" in text and "rotate applies to agent tokens" in text, text
    # Nothing was issued by the refusals.
    assert len(tokens(admin, role="agent")) == 3


def test_with_no_overlap_the_old_token_stops_at_once(
    db: Engine, session: Session, tmp_path: Path
) -> None:
    rack = add_rack(session, add_site(session, "lab"), "r1")
    add_server(session, rack, "gpu-a")
    with serve(db, tmp_path, agent_token_overlap_s=0.0) as live:
        admin = live.client(live.token(Role.ADMIN, name="admin"))
        old = mint(admin, "gpu-a")
        new = ok(admin.post(f"{API}/{old['id']}/rotate"), 201)
        assert not works(live, old["token"]) and works(live, new["token"])


def test_nothing_logged_carries_a_token(live: Live, admin: httpx.Client, session: Session) -> None:
    """Every logger at DEBUG (SQL included): neither a value nor a hash in any record."""
    with debug_logging() as logs:
        old = mint(admin, "gpu-a")
        new = ok(admin.post(f"{API}/{old['id']}/rotate"), 201)
        refused(admin.post(f"{API}/agent", json={"server": "gpu-a"}), 409)
        assert works(live, old["token"])
        ok(admin.delete(f"{API}/{new['id']}"))
    logged = "\n".join(logs.lines)
    assert "/api/v1/tokens" in logged and "api_token" in logged  # access log and SQL were seen
    hashes = [t.token_hash for t in session.exec(select(ApiToken))]
    for secret in (old["token"], new["token"], *hashes):
        assert secret not in logged


def _expire(session: Session, token_id: int) -> None:
    row = session.exec(select(ApiToken).where(ApiToken.id == token_id)).one()
    row.expires_at = utcnow() - timedelta(seconds=1)
    session.add(row)
    session.commit()


# ---------------------------------------------------------------------------------------------
# fleetctl agent-tokens (the top-level app: the group is registered there)


def fleetctl(live: Live, token: str, *args: str) -> Result:
    env = {"FLEET_URL": live.url, "FLEET_TOKEN": token}
    return CliRunner().invoke(cli.app, ["agent-tokens", *args], env=env)


def test_fleetctl_agent_tokens_mint_list_rotate_revoke(live: Live, admin: httpx.Client) -> None:
    token = live.token(Role.ADMIN, name="cli")
    minted = fleetctl(live, token, "mint", "gpu-a", "--expires-in", "12h")
    assert minted.exit_code == 0, minted.stdout + minted.stderr
    value = minted.stdout.strip()
    assert value.startswith("flt_") and "\n" not in value
    assert "gpu-a" in minted.stderr and value not in minted.stderr
    assert works(live, value)
    [row] = json.loads(fleetctl(live, token, "list", "--server", "gpu-a", "-o", "json").stdout)
    lifetime = datetime.fromisoformat(row["expires_at"]) - utcnow()
    assert timedelta(hours=11) < lifetime <= timedelta(hours=12)
    again = fleetctl(live, token, "mint", "gpu-a")
    assert again.exit_code == 1 and again.stdout == ""
    assert again.stderr.startswith("error: ") and len(again.stderr.splitlines()) == 1
    assert f"id {row['id']}" in again.stderr and "rotate" in again.stderr

    rotated = fleetctl(live, token, "rotate", str(row["id"]), "-o", "json")
    assert rotated.exit_code == 0, rotated.stdout + rotated.stderr
    new = json.loads(rotated.stdout)
    assert works(live, value) and works(live, new["token"])
    table = fleetctl(live, token, "list")
    assert table.exit_code == 0 and "replaced by" in table.stdout
    assert value not in table.stdout and new["token"] not in table.stdout
    live_rows = json.loads(fleetctl(live, token, "list", "--live", "-o", "json").stdout)
    assert [r["id"] for r in live_rows] == [new["id"]]

    revoked = fleetctl(live, token, "revoke", str(new["id"]))
    assert revoked.exit_code == 0 and f"revoked token {new['id']}" in revoked.stdout
    assert not works(live, new["token"])
    bad = fleetctl(live, token, "mint", "gpu-b", "--expires-in", "1y")
    assert bad.exit_code == 1 and "--expires-in '1y'" in bad.stderr
    viewer = fleetctl(live, live.token(Role.VIEWER, name="v"), "list")
    assert viewer.exit_code == 1 and "needs the admin role" in viewer.stderr
    unknown = fleetctl(live, token, "mint", "ghost")
    assert unknown.exit_code == 1 and "no server named 'ghost'" in unknown.stderr
