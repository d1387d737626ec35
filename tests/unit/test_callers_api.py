"""Tenants and client keys through the API (/api/v1/tenants, /api/v1/client-keys,
fleet/api/routes/callers.py), the routers' view of them (GET /api/v1/routing/callers), the
usage exchange in the load report, and `fleetctl tenants` / `fleetctl keys`, against a real
service (uvicorn in a thread) on SQLite and Postgres. A key's value is in its create answer
only; its hash only in the routers' view; neither in a list, an event or a log record.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from live import Live, debug_logging, serve
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner, Result

from fleet import cli
from fleet.models import ClientKey, Event, Role, RouterUsage, Tenant, utcnow
from fleet.registry.routing_table import MAX_REPORTED_KEYS, LoadReport, sum_usage
from fleet.router.callers import parse_callers

API = "/api/v1"
STALE_S = 30.0
KEY_FIELDS = {
    "id",
    "name",
    "tenant",
    "requests_per_minute",
    "tokens_per_minute",
    "created_at",
    "revoked_at",
    "expires_at",
    "active",
}


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(
        engine, tmp_path_factory.mktemp("callers-api"), router_report_stale_s=STALE_S
    ) as server:
        yield server


@pytest.fixture
def operator(live: Live, db: Engine) -> Iterator[httpx.Client]:
    yield live.client(live.token(Role.OPERATOR, name="op"))
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


def tenant(client: httpx.Client, name: str, **body: Any) -> dict[str, Any]:
    created: dict[str, Any] = ok(client.post(f"{API}/tenants", json={"name": name, **body}), 201)
    return created


def key(client: httpx.Client, tenant: str, name: str = "bot", **body: Any) -> dict[str, Any]:
    created: dict[str, Any] = ok(
        client.post(f"{API}/client-keys", json={"tenant": tenant, "name": name, **body}), 201
    )
    return created


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Tenants


def test_tenants_create_list_update_delete(operator: httpx.Client) -> None:
    created = tenant(operator, "acme", concurrency_share=0.5)
    assert set(created) == {"id", "name", "concurrency_share", "created_at", "keys"}
    assert (created["name"], created["concurrency_share"], created["keys"]) == ("acme", 0.5, 0)
    assert tenant(operator, "beta")["concurrency_share"] == 1.0
    assert "already exists" in refused(operator.post(f"{API}/tenants", json={"name": "acme"}), 409)

    key(operator, "acme")
    listed = ok(operator.get(f"{API}/tenants"))
    assert [(t["name"], t["keys"]) for t in listed["results"]] == [("acme", 1), ("beta", 0)]
    assert listed["count"] == 2

    changed = ok(operator.patch(f"{API}/tenants/acme", json={"concurrency_share": 0.25}))
    assert (changed["concurrency_share"], changed["keys"]) == (0.25, 1)
    assert ok(operator.delete(f"{API}/tenants/beta"))["name"] == "beta"
    assert "no tenant named 'beta'" in refused(operator.delete(f"{API}/tenants/beta"), 404)
    assert "no tenant named 'ghost'" in refused(
        operator.patch(f"{API}/tenants/ghost", json={"concurrency_share": 0.5}), 404
    )


def test_tenant_input_is_checked_naming_the_field(operator: httpx.Client) -> None:
    for body in (
        {"name": "-starts-badly"},
        {"name": "x" * 64},
        {"name": "ok", "concurrency_share": 0},
        {"name": "ok", "concurrency_share": 1.5},
        {"name": "ok", "concurrency_share": True},
        {"name": "ok", "extra": 1},
    ):
        field = next(iter(set(body) - {"name"}), "name")
        assert field in refused(operator.post(f"{API}/tenants", json=body), 422), body
    tenant(operator, "ok")
    assert "must not be null" in refused(
        operator.patch(f"{API}/tenants/ok", json={"concurrency_share": None}), 422
    )


def test_a_tenant_with_active_keys_cannot_be_deleted(
    operator: httpx.Client, session: Session
) -> None:
    tenant(operator, "acme")
    first, second = key(operator, "acme", "one"), key(operator, "acme", "two")
    ok(operator.delete(f"{API}/client-keys/{first['id']}"))
    detail = refused(operator.delete(f"{API}/tenants/acme"), 409)
    assert "1 active key" in detail and "revoke" in detail
    ok(operator.delete(f"{API}/client-keys/{second['id']}"))
    ok(operator.delete(f"{API}/tenants/acme"))
    assert session.exec(select(ClientKey)).all() == []  # its revoked keys went with it
    assert session.exec(select(Tenant)).all() == []


# ---------------------------------------------------------------------------------------------
# Client keys


def test_create_shows_the_key_once_and_stores_only_its_hash(
    operator: httpx.Client, session: Session
) -> None:
    tenant(operator, "acme")
    created = key(operator, "acme", "ci-bot", requests_per_minute=600, tokens_per_minute=90_000)
    assert set(created) == KEY_FIELDS | {"key"}
    value = created["key"]
    assert value.startswith("fk_") and 40 <= len(value) <= 50
    assert (created["tenant"], created["active"], created["expires_at"]) == ("acme", True, None)
    assert (created["requests_per_minute"], created["tokens_per_minute"]) == (600, 90_000)
    row = session.exec(select(ClientKey)).one()
    assert row.key_hash == sha256(value) and value not in row.model_dump_json()

    listed = ok(operator.get(f"{API}/client-keys"))
    assert [set(r) for r in listed["results"]] == [KEY_FIELDS]
    assert value not in json.dumps(listed) and row.key_hash not in json.dumps(listed)
    assert key(operator, "acme")["key"] != value  # each key its own value


def test_create_refuses_unknown_tenants_and_bad_lifetimes(operator: httpx.Client) -> None:
    assert "no tenant named 'ghost'" in refused(
        operator.post(f"{API}/client-keys", json={"tenant": "ghost", "name": "x"}), 404
    )
    tenant(operator, "acme")
    body = {"tenant": "acme", "name": "x"}
    detail = refused(operator.post(f"{API}/client-keys", json={**body, "expires_in": "1y"}), 400)
    assert "90d" in detail
    refused(operator.post(f"{API}/client-keys", json={**body, "expires_in": "9999d"}), 400)
    for extra in (
        {"requests_per_minute": 0},
        {"requests_per_minute": 10_000_001},
        {"tokens_per_minute": 10_000_000_001},
        {"tokens_per_minute": "5"},
        {"name": ""},
        {"name": "x" * 101},
    ):
        field = next(iter(extra))
        assert field in refused(operator.post(f"{API}/client-keys", json={**body, **extra}), 422)
    # At the bounds: accepted (the columns hold them on both databases).
    top = key(operator, "acme", requests_per_minute=10_000_000, tokens_per_minute=10_000_000_000)
    assert top["tokens_per_minute"] == 10_000_000_000


def test_expiry_and_list_by_tenant(operator: httpx.Client, session: Session) -> None:
    tenant(operator, "acme")
    tenant(operator, "beta")
    expiring = key(operator, "acme", expires_in="12h")
    lifetime = datetime.fromisoformat(expiring["expires_at"]) - utcnow()
    assert timedelta(hours=11) < lifetime <= timedelta(hours=12)
    other = key(operator, "beta")
    beta = ok(operator.get(f"{API}/client-keys", params={"tenant": "beta"}))["results"]
    assert [r["id"] for r in beta] == [other["id"]]
    assert "no tenant named 'ghost'" in refused(
        operator.get(f"{API}/client-keys", params={"tenant": "ghost"}), 404
    )
    _expire(session, expiring["id"])
    [row] = ok(operator.get(f"{API}/client-keys", params={"tenant": "acme"}))["results"]
    assert row["active"] is False and row["revoked_at"] is None
    assert ok(operator.get(f"{API}/tenants"))["results"][0]["keys"] == 0
    ok(operator.delete(f"{API}/tenants/acme"))  # an expired key holds no tenant


def test_update_limits_and_revoke(operator: httpx.Client) -> None:
    tenant(operator, "acme")
    created = key(operator, "acme", requests_per_minute=60)
    path = f"{API}/client-keys/{created['id']}"
    changed = ok(operator.patch(path, json={"tokens_per_minute": 1000}))
    assert (changed["requests_per_minute"], changed["tokens_per_minute"]) == (60, 1000)
    lifted = ok(operator.patch(path, json={"requests_per_minute": None}))
    assert (lifted["requests_per_minute"], lifted["tokens_per_minute"]) == (None, 1000)
    assert "requests_per_minute" in refused(
        operator.patch(path, json={"requests_per_minute": 0}), 422
    )
    refused(operator.patch(path, json={"name": "renamed"}), 422)

    revoked = ok(operator.delete(path))
    assert revoked["active"] is False and revoked["revoked_at"] is not None
    assert ok(operator.delete(path))["revoked_at"] == revoked["revoked_at"]  # twice: no-op
    assert "revoked" in refused(operator.patch(path, json={"tokens_per_minute": 5}), 409)
    assert "no client key with id 999999" in refused(
        operator.delete(f"{API}/client-keys/999999"), 404
    )
    refused(operator.delete(f"{API}/client-keys/{2**31}"), 422)


def test_roles(live: Live, operator: httpx.Client) -> None:
    tenant(operator, "acme")
    created = key(operator, "acme")
    viewer = live.client(live.token(Role.VIEWER, name="v"))
    router = live.client(live.token(Role.ROUTER, name="r"))
    anonymous = live.client()
    for client in (viewer, router):
        ok(client.get(f"{API}/tenants"))
        ok(client.get(f"{API}/client-keys"))
        for method, path, body in (
            ("POST", f"{API}/tenants", {"name": "x"}),
            ("PATCH", f"{API}/tenants/acme", {"concurrency_share": 0.5}),
            ("DELETE", f"{API}/tenants/acme", None),
            ("POST", f"{API}/client-keys", {"tenant": "acme", "name": "x"}),
            ("PATCH", f"{API}/client-keys/{created['id']}", {"tokens_per_minute": 5}),
            ("DELETE", f"{API}/client-keys/{created['id']}", None),
        ):
            assert "operator" in refused(client.request(method, path, json=body), 403)
    # The routers' view holds the hashes: routers (and above), never viewers.
    refused(viewer.get(f"{API}/routing/callers"), 403)
    refused(anonymous.get(f"{API}/routing/callers"), 401)
    refused(anonymous.get(f"{API}/tenants"), 401)
    ok(router.get(f"{API}/routing/callers"))
    ok(operator.get(f"{API}/routing/callers"))


# ---------------------------------------------------------------------------------------------
# The routers' view and the usage exchange


def test_routing_callers_lists_active_keys_with_their_hashes(
    live: Live, operator: httpx.Client, session: Session
) -> None:
    tenant(operator, "acme", concurrency_share=0.5)
    tenant(operator, "beta")
    bot = key(operator, "acme", "ci-bot", requests_per_minute=600)
    other = key(operator, "beta", "web", tokens_per_minute=5000)
    revoked = key(operator, "acme", "old")
    expired = key(operator, "beta", "gone")
    ok(operator.delete(f"{API}/client-keys/{revoked['id']}"))
    _expire(session, expired["id"])
    router = live.client(live.token(Role.ROUTER, name="r"))
    table = ok(router.get(f"{API}/routing/callers"))
    assert table["tenants"] == [
        {"name": "acme", "concurrency_share": 0.5},
        {"name": "beta", "concurrency_share": 1.0},
    ]
    assert table["keys"] == [
        {
            "id": bot["id"],
            "hash": sha256(bot["key"]),
            "tenant": "acme",
            "name": "ci-bot",
            "requests_per_minute": 600,
            "tokens_per_minute": None,
        },
        {
            "id": other["id"],
            "hash": sha256(other["key"]),
            "tenant": "beta",
            "name": "web",
            "requests_per_minute": None,
            "tokens_per_minute": 5000,
        },
    ]
    # What a router makes of it (fleet/router/callers.py): the live keys authenticate, with
    # their tenant's share; the revoked and expired ones do not.
    callers = parse_callers(table)
    found = callers.authenticate(f"Bearer {bot['key']}")
    assert found is not None and (found.tenant, found.key_id) == ("acme", str(bot["id"]))
    assert callers.share("acme") == 0.5
    for gone in (revoked, expired):
        assert callers.authenticate(f"Bearer {gone['key']}") is None


def report(client: httpx.Client, router: str, **body: Any) -> httpx.Response:
    return client.post(f"{API}/routing/report", json={"router": router, "deployments": {}, **body})


def test_report_exchanges_usage_between_routers(live: Live, session: Session) -> None:
    client = live.client(live.token(Role.ROUTER, name="r"))
    # Without `callers`: the answer is as before, and nothing is stored.
    assert ok(report(client, "r0")) == {"recorded": 0, "ignored": 0, "unknown": []}
    assert session.exec(select(RouterUsage)).all() == []

    usage_a = {"1": {"requests": 10, "tokens": 500.5}, "2": {"requests": 1, "tokens": 0}}
    first = ok(report(client, "a", callers=usage_a, window_s=60))
    assert first["callers"] == {} and first["routers"] == 0  # no other router yet
    usage_b = {"1": {"requests": 4, "tokens": 100}, "3": {"requests": 2, "tokens": 20}}
    answer_b = ok(report(client, "b", callers=usage_b, window_s=60))
    assert answer_b["callers"] == usage_a | {"2": {"requests": 1.0, "tokens": 0.0}}
    # a sees b's, not its own; c sees a's and b's summed.
    assert ok(report(client, "a", callers=usage_a, window_s=60))["callers"] == usage_b
    answer_c = ok(report(client, "c", callers={}, window_s=60))
    assert answer_c["routers"] == 2  # a and b: the headroom's split three ways
    summed = answer_c["callers"]
    assert summed == {
        "1": {"requests": 14.0, "tokens": 600.5},
        "2": {"requests": 1.0, "tokens": 0.0},
        "3": {"requests": 2.0, "tokens": 20.0},
    }
    # A report over another window is scaled to the reporter's: c's 30 s sees half.
    halved = ok(report(client, "c", callers={}, window_s=30))["callers"]
    assert halved["1"] == {"requests": 7.0, "tokens": 300.25}

    # A router silent for longer than FLEET_ROUTER_REPORT_STALE_S no longer counts; one silent
    # for an hour is deleted.
    _age(session, "a", timedelta(seconds=STALE_S + 1))
    _age(session, "b", timedelta(hours=2))
    assert ok(report(client, "c", callers={}, window_s=60))["callers"] == {}
    routers = sorted(r.router for r in session.exec(select(RouterUsage)))
    assert routers == ["a", "c"]


def test_report_usage_is_bounded(live: Live) -> None:
    client = live.client(live.token(Role.ROUTER, name="r"))
    for callers, field in (
        ({"1": {"requests": -1, "tokens": 0}}, "requests"),
        ({"1": {"requests": 0, "tokens": 2e12}}, "tokens"),
        ({"1": {"requests": True, "tokens": 0}}, "requests"),
        ({"1": {"requests": 0}}, "tokens"),
        ({"key": {"requests": 0, "tokens": 0}}, "callers"),
        ({"0": {"requests": 0, "tokens": 0}}, "callers"),
    ):
        assert field in refused(report(client, "r", callers=callers), 422), callers
    assert "window_s" in refused(report(client, "r", callers={}, window_s=0.0001), 422)
    assert "window_s" in refused(report(client, "r", callers={}, window_s=3601), 422)
    many = {str(i): {"requests": 0, "tokens": 0} for i in range(1, MAX_REPORTED_KEYS + 2)}
    with pytest.raises(ValidationError, match="callers"):
        LoadReport.model_validate({"router": "r", "deployments": {}, "callers": many})


def test_sum_usage_scales_and_skips_what_does_not_parse() -> None:
    reports: list[tuple[dict[str, Any], float | None]] = [
        ({"5": {"requests": 6, "tokens": 60}}, 60.0),
        ({"5": {"requests": 2, "tokens": 20}, "7": {"bad": 1}}, 20.0),
        ({"10": {"requests": 1, "tokens": 1}}, None),
    ]
    summed = sum_usage(reports, 30.0)
    assert list(summed) == ["5", "10"]  # by key id, numerically
    assert summed["5"].model_dump() == {"requests": 6.0, "tokens": 60.0}
    assert summed["10"].model_dump() == {"requests": 1.0, "tokens": 1.0}
    assert sum_usage(reports, None)["5"].model_dump() == {"requests": 8.0, "tokens": 80.0}


def _age(session: Session, router: str, by: timedelta) -> None:
    row = session.exec(select(RouterUsage).where(RouterUsage.router == router)).one()
    row.at = utcnow() - by
    session.add(row)
    session.commit()


def _expire(session: Session, key_id: int) -> None:
    row = session.exec(select(ClientKey).where(ClientKey.id == key_id)).one()
    row.expires_at = utcnow() - timedelta(seconds=1)
    session.add(row)
    session.commit()


# ---------------------------------------------------------------------------------------------
# Events and logs


def test_events_name_keys_and_limits_never_values_or_hashes(
    live: Live, operator: httpx.Client, session: Session
) -> None:
    with debug_logging() as logs:
        tenant(operator, "acme", concurrency_share=0.5)
        ok(operator.patch(f"{API}/tenants/acme", json={"concurrency_share": 0.75}))
        created = key(operator, "acme", "ci-bot", requests_per_minute=600)
        ok(operator.patch(f"{API}/client-keys/{created['id']}", json={"tokens_per_minute": 9}))
        router = live.client(live.token(Role.ROUTER, name="r"))
        ok(router.get(f"{API}/routing/callers"))
        ok(operator.get(f"{API}/client-keys"))
        ok(operator.delete(f"{API}/client-keys/{created['id']}"))
        ok(operator.delete(f"{API}/tenants/acme"))
    events = session.exec(
        select(Event)
        .where(col(Event.subject_type).in_(["tenant", "client_key"]))
        .order_by(col(Event.id))
    ).all()
    assert [e.kind for e in events] == [
        "tenant.created",
        "tenant.updated",
        "client_key.created",
        "client_key.updated",
        "client_key.revoked",
        "tenant.deleted",
    ]
    created_event = events[2]
    assert created_event.actor == "operator:op" and created_event.subject == "ci-bot"
    assert created_event.details == {
        "tenant": "acme",
        "id": created["id"],
        "requests_per_minute": 600,
        "tokens_per_minute": None,
    }
    assert "600 requests/min" in created_event.message
    logged = "\n".join(logs.lines)
    assert "/api/v1/client-keys" in logged and "client_key" in logged  # access log and SQL seen
    secrets = (created["key"], sha256(created["key"]))
    for secret in secrets:
        assert secret not in logged
        assert all(secret not in e.model_dump_json() for e in events)


# ---------------------------------------------------------------------------------------------
# fleetctl tenants / keys


def fleetctl(live: Live, token: str, *args: str) -> Result:
    env = {"FLEET_URL": live.url, "FLEET_TOKEN": token}
    return CliRunner().invoke(cli.app, list(args), env=env)


def one_line_error(result: Result, *needles: str) -> None:
    assert result.exit_code == 1 and result.stdout == "", result.stdout
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_fleetctl_tenants_and_keys(live: Live, db: Engine) -> None:
    token = live.token(Role.OPERATOR, name="cli")

    def run(*args: str) -> Result:
        result = fleetctl(live, token, *args)
        assert result.exit_code == 0, result.stdout + result.stderr
        return result

    run("tenants", "create", "acme", "--share", "0.5")
    run("tenants", "create", "beta")
    one_line_error(fleetctl(live, token, "tenants", "create", "acme"), "already exists")
    run("tenants", "set", "acme", "--share", "0.25")
    tenants = json.loads(run("tenants", "list", "-o", "json").stdout)
    assert [(t["name"], t["concurrency_share"]) for t in tenants] == [
        ("acme", 0.25),
        ("beta", 1.0),
    ]
    assert "acme" in run("tenants", "list").stdout

    created = run("keys", "create", "--tenant", "acme", "--name", "ci", "--rpm", "600")
    value = created.stdout.strip()
    assert value.startswith("fk_") and "\n" not in value
    assert "acme" in created.stderr and "shown this once" in created.stderr
    assert value not in created.stderr
    as_json = json.loads(
        run(
            "keys", "create", "--tenant", "beta", "--name", "w", "--expires-in", "1d", "-o", "json"
        ).stdout
    )
    assert as_json["key"].startswith("fk_") and as_json["expires_at"] is not None
    listed = run("keys", "list", "-o", "json").stdout
    assert value not in listed and sha256(value) not in listed
    rows = json.loads(listed)
    ci = next(r for r in rows if r["name"] == "ci")
    assert ci["requests_per_minute"] == 600
    acme_rows = json.loads(run("keys", "list", "--tenant", "acme", "-o", "json").stdout)
    assert [r["name"] for r in acme_rows] == ["ci"]
    assert "ci" in run("keys", "list").stdout

    changed = json.loads(
        run("keys", "set", str(ci["id"]), "--rpm", "none", "--tpm", "1000", "-o", "json").stdout
    )
    assert (changed["requests_per_minute"], changed["tokens_per_minute"]) == (None, 1000)
    one_line_error(fleetctl(live, token, "keys", "set", str(ci["id"])), "--rpm")
    one_line_error(fleetctl(live, token, "keys", "set", str(ci["id"]), "--rpm", "0"), "--rpm")
    one_line_error(fleetctl(live, token, "keys", "set", str(ci["id"]), "--tpm", "lots"), "--tpm")
    one_line_error(
        fleetctl(
            live, token, "keys", "create", "--tenant", "acme", "--name", "x", "--expires-in", "1y"
        ),
        "--expires-in '1y'",
    )
    one_line_error(
        fleetctl(live, token, "keys", "create", "--tenant", "ghost", "--name", "x"),
        "no tenant named 'ghost'",
    )
    one_line_error(fleetctl(live, token, "tenants", "delete", "acme"), "active key")

    revoked = run("keys", "revoke", str(ci["id"]))
    assert f"revoked client key {ci['id']}" in revoked.stdout and "acme" in revoked.stdout
    assert "deleted tenant acme" in run("tenants", "delete", "acme").stdout
    one_line_error(fleetctl(live, token, "keys", "revoke", "999999"), "no client key")
    viewer = live.token(Role.VIEWER, name="v")
    one_line_error(fleetctl(live, viewer, "tenants", "create", "x"), "needs the operator role")
    assert fleetctl(live, viewer, "keys", "list").exit_code == 0
