"""The REST API over a real uvicorn server, on SQLite and on Postgres (docs/api.md).

One server per module per database (`live`); each test starts from empty tables (`db`), gets
fresh tokens for every role (`api`) and, where it needs a fleet, imports
fleet/data/inventory/demo.yaml
through the API (`demo`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from factories import walk_to
from live import YAML, Live, fill_path, load_demo, operations, revoke_token, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.catalog.versions import legacy_model_name
from fleet.data import DEMO_INVENTORY
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import OPERATOR_TARGETS, ServerState, allowed_targets, draws_max_power
from fleet.models import PowerState, Role, Server
from fleet.power.budget import RackPower, ServerDraw, feed_watts, rack_power

PAGE_CAP = 20  # settings.max_page_size of this module's server: small, so capping shows
DEFAULT_PAGE = 10
API = "/api/v1"
AGENT_API = f"{API}/agent/"
DEMO = load_demo()
DEMO_YAML = DEMO_INVENTORY.read_bytes()
# Validating a file writes nothing, but its report tells whether a supplied BMC password equals
# the stored one: it needs the operator role like the writes do.
VALIDATE = ("POST", f"{API}/inventory/validate")
# Every server right after an import: enrolled, and no BMC read yet.
IMPORTED: tuple[ServerState, str] = (ServerState.ENROLLED, PowerState.UNKNOWN.value)
DEPLOYMENT: dict[str, Any] = {
    "name": "qwen-7b",
    "model_uri": "s3://fleet-models/qwen/Qwen2.5-7B-Instruct",
    "model_checksum": "sha256:0123",
    "engine_params": {"backend": "pytorch", "tp_size": 2, "pp_size": 1},
    "gpus_per_replica": 2,
    "gpu_models": ["H100", "H200"],
    "min_replicas": 1,
    "max_replicas": 4,
    "sla_p95_latency_ms": 2000,
    "sla_ttft_ms": 300,
    "disruption_budget": 1,
}


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir = tmp_path_factory.mktemp("api")
    with serve(engine, data_dir, max_page_size=PAGE_CAP, default_page_size=DEFAULT_PAGE) as server:
        yield server


@dataclass
class Api:
    live: Live
    admin: httpx.Client
    operator: httpx.Client
    viewer: httpx.Client
    anonymous: httpx.Client

    def agent(self, server: str) -> httpx.Client:
        return self.live.client(self.live.token(Role.AGENT, name="agent", server=server))

    def import_demo(self) -> dict[str, Any]:
        response = self.operator.post(f"{API}/inventory/import", content=DEMO_YAML, headers=YAML)
        assert response.status_code == 200, response.text
        report: dict[str, Any] = response.json()
        return report

    def all_rows(self, path: str, **params: Any) -> tuple[int, list[dict[str, Any]]]:
        """Every row of a paged list, following `next` links; returns (count, rows)."""
        page = ok(self.viewer.get(path, params={"limit": PAGE_CAP, **params}))
        count, rows = page["count"], list(page["results"])
        while page["next"]:
            page = ok(self.viewer.get(page["next"]))
            assert page["count"] == count
            rows.extend(page["results"])
        assert len(rows) == count
        return count, rows

    def events(self, **params: Any) -> list[dict[str, Any]]:
        return self.all_rows(f"{API}/events", **params)[1]


@pytest.fixture
def api(live: Live, db: Engine) -> Iterator[Api]:
    yield Api(
        live=live,
        admin=live.client(live.token(Role.ADMIN, name="admin")),
        operator=live.client(live.token(Role.OPERATOR, name="operator")),
        viewer=live.client(live.token(Role.VIEWER, name="viewer")),
        anonymous=live.client(),
    )
    live.close_clients()


@pytest.fixture
def demo(api: Api) -> Api:
    api.import_demo()
    return api


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json()


def detail(response: httpx.Response, status: int) -> str:
    """The error detail of a `status` response, checked to be one line."""
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    text = response.json()["detail"]
    assert isinstance(text, str) and text and "\n" not in text, text
    return text


def _demo_version(deployment: str) -> tuple[str, str]:
    """(model, version) of the external version an import makes for a demo deployment."""
    doc = yaml.safe_load(DEMO_YAML)
    model = next(d["model"] for d in doc["deployments"] if d["name"] == deployment)
    return legacy_model_name(model["uri"])[0], "legacy-" + hashlib.sha256(
        f"{model['uri']}\n{model['checksum']}".encode()
    ).hexdigest()[:12]


DEMO_LLAMA_VERSION = _demo_version("llama-8b")
ROUTER_REPORT = f"{API}/routing/report"  # a router's load report: the router role (or above)
# The client keys' hashes, for routers (or above): no viewer reads them.
ROUTER_GETS = {("GET", f"{API}/routing/callers")}
REAL_NAMES = {
    "servers": "fra1-r01-h100-01",
    "racks": "fra1-r01",
    "sites": "fra1",
    "deployments": "llama-8b",
    "autoscaler": "llama-8b",  # /autoscaler/{deployment}/decisions
    "schedules": "1",  # /schedules/{entry_id}: the entry `add_schedule` creates
    "tokens": "1",  # /tokens/{token_id}
    # /models/{model}/versions/{version}: the external version the import made for llama-8b's
    # model_uri and checksum (fleet/catalog/versions.py external_version).
    "models": DEMO_LLAMA_VERSION[0],
    "versions": DEMO_LLAMA_VERSION[1],
}
# A calendar entry (docs/calendar.md); a preview of one is a read, though it is a POST.
SCHEDULE: dict[str, Any] = {
    "deployment": "llama-8b",
    "cron": "0 9 * * 1-5",
    "timezone": "Europe/Berlin",
    "min_replicas": 4,
    "duration_s": 9 * 3600,
}
VIEWER_POSTS = {("POST", f"{API}/schedules/preview")}
# Tokens through the API are an admin's (docs/api.md "Agent tokens"); any token reads its own.
ADMIN_ONLY = {
    ("GET", f"{API}/tokens"),
    ("POST", f"{API}/tokens/agent"),
    ("DELETE", f"{API}/tokens/{{token_id}}"),
    ("POST", f"{API}/tokens/{{token_id}}/rotate"),
}
ANY_TOKEN = {("GET", f"{API}/tokens/self")}
# Pinning an SSH host key is a trust decision (docs/ansible.md).
ADMIN_ONLY |= {("POST", f"{API}/servers/{{name}}/ssh-trust")}
# Diagnostic bundles hold the servers' logs: an operator's to read.
OPERATOR_GETS = {
    ("GET", f"{API}/servers/{{name}}/diagnostics"),
    ("GET", f"{API}/diagnostics/{{bundle_id}}"),
}


def api_operations(live: Live) -> list[tuple[str, str]]:
    return [(m, p) for m, p in operations(live.app) if p.startswith(f"{API}/")]


def call(client: httpx.Client, method: str, template: str) -> httpx.Response:
    """`method` on `template` with real names, and a body of the right kind (maybe invalid)."""
    path = fill_path(template, REAL_NAMES, REAL_NAMES["servers"])
    if method == "GET":
        return client.get(path)
    if template.startswith(f"{API}/inventory/"):
        return client.request(method, path, content=DEMO_YAML, headers=YAML)
    if (method, template) in VIEWER_POSTS:
        return client.request(method, path, json=SCHEDULE)
    return client.request(method, path, json={})


def add_schedule(api: Api) -> dict[str, Any]:
    """The calendar entry REAL_NAMES["schedules"] names."""
    entry: dict[str, Any] = ok(api.operator.post(f"{API}/schedules", json=SCHEDULE), 201)
    assert str(entry["id"]) == REAL_NAMES["schedules"]
    return entry


# ---------------------------------------------------------------------------------------------
# Authentication


def test_every_api_route_needs_a_token(demo: Api) -> None:
    ops = api_operations(demo.live)
    assert len(ops) >= 15 and ("PATCH", f"{API}/servers/{{name}}") in ops
    bad = demo.live.client("flt_not-a-real-token")
    basic = demo.live.client()
    basic.headers["Authorization"] = "Basic YWRtaW46YWRtaW4="
    for method, template in ops:
        for client in (demo.anonymous, bad, basic):
            response = call(client, method, template)
            assert response.status_code == 401, f"{method} {template}: {response.text}"
            assert response.headers["www-authenticate"] == "Bearer"
            assert "token" in detail(response, 401)


def test_revoked_token_is_refused(demo: Api) -> None:
    token = demo.live.token(Role.ADMIN, name="soon-revoked")
    client = demo.live.client(token)
    assert client.get(f"{API}/servers").status_code == 200
    revoke_token(demo.live.engine, token)
    for method, template in api_operations(demo.live):
        assert call(client, method, template).status_code == 401, f"{method} {template}"


def test_probes_need_no_token(api: Api) -> None:
    assert ok(api.anonymous.get("/healthz")) == {"status": "ok"}
    ready = ok(api.anonymous.get("/readyz"))
    assert ready == {"status": "ready", "checks": {"database": "ok", "migrations": "ok"}}
    assert api.anonymous.get("/metrics").status_code == 200


def test_metrics_after_import(demo: Api) -> None:
    text = demo.anonymous.get("/metrics").text
    samples = _samples(text)
    h100_warm = sum(1 for s in DEMO.servers if s.gpu_model == "H100" and s.pool == "warm")
    # One series per site: summed over the sites.
    wanted = ('gpu_model="H100"', 'pool="warm"', 'state="enrolled"')
    counted = sum(
        v
        for k, v in samples.items()
        if k.startswith("fleet_servers{") and all(w in k for w in wanted)
    )
    assert h100_warm > 0 and counted == h100_warm
    total = sum(v for k, v in samples.items() if k.startswith("fleet_servers{"))
    assert total == len(DEMO.servers)
    for rack in DEMO.racks:
        power = _demo_power(rack.name)
        got = samples[f'fleet_rack_headroom_watts{{rack="{rack.name}"}}']
        assert math.isclose(got, power.headroom_w)
        assert math.isclose(
            samples[f'fleet_rack_budget_watts{{rack="{rack.name}"}}'], power.budget_w
        )
    assert "fleet_http_requests_total{" in text


def _samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels sorted}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, brace, labels = key.partition("{")
        if brace:
            pairs = sorted(labels.rstrip("}").split(","))
            key = f"{name}{{{','.join(pairs)}}}"
        out[key] = float(value)
    return out


# ---------------------------------------------------------------------------------------------
# Roles


def test_viewer_reads_but_cannot_write(demo: Api) -> None:
    entry = add_schedule(demo)
    refused: set[tuple[str, str]] = set()
    for method, template in api_operations(demo.live):
        response = call(demo.viewer, method, template)
        op = (method, template)
        read = method == "GET" or op in VIEWER_POSTS
        if read and op not in ADMIN_ONLY | OPERATOR_GETS | ROUTER_GETS:
            assert response.status_code == 200, f"{method} {template}: {response.text}"
        else:
            refused.add((method, template))
            text = detail(response, 403)
            needed = (
                "agent role"
                if template.startswith(AGENT_API)
                else "router role"
                if template == ROUTER_REPORT or op in ROUTER_GETS
                else "admin role"
                if op in ADMIN_ONLY
                else "operator role"
            )
            assert "viewer" in text and needed in text, text
    # import, validate, PATCH server, transition, POST and PATCH deployment
    assert len(refused) >= 6 and VALIDATE in refused
    # The operator may validate (and nothing is written by it either).
    validated = ok(demo.operator.post(VALIDATE[1], content=DEMO_YAML, headers=YAML))
    assert validated["dry_run"] is True and validated["changes"] == []
    # Nothing was written: still 56 enrolled servers and the demo's deployments.
    assert demo.all_rows(f"{API}/servers", state="enrolled")[0] == len(DEMO.servers)
    assert [d["name"] for d in demo.all_rows(f"{API}/deployments")[1]] == sorted(DEMO.deployments)
    assert ok(demo.viewer.get(f"{API}/schedules"))["results"] == [entry]


def test_agent_token_reaches_no_operator_or_viewer_endpoint(demo: Api) -> None:
    agent = demo.agent("fra1-r01-h100-01")
    for method, template in api_operations(demo.live):
        if template.startswith(AGENT_API):
            continue  # its own endpoints (tests/unit/test_agent_api.py)
        if (method, template) in ANY_TOKEN:
            assert call(agent, method, template).status_code == 200, template
            continue
        text = detail(call(agent, method, template), 403)
        assert "agent token cannot do this; it needs the " in text, text


def test_operator_and_admin_may_write(demo: Api) -> None:
    for client, server in ((demo.operator, "fra1-r01-h100-01"), (demo.admin, "fra1-r01-h100-02")):
        ok(client.patch(f"{API}/servers/{server}", json={"pool": "baseline"}))
        move = {"to": "maintenance", "reason": "reseat DIMMs"}
        moved = ok(client.post(f"{API}/servers/{server}/transition", json=move))
        assert moved["server"]["state"] == "maintenance"
        ok(client.post(VALIDATE[1], content=DEMO_YAML, headers=YAML))
    actors = {e["actor"] for e in demo.events(kind="server.transition")}
    assert actors == {"operator:operator", "admin:admin"}


# ---------------------------------------------------------------------------------------------
# Inventory import, paging and filters


def test_import_reports_what_it_created(api: Api) -> None:
    dry = ok(
        api.operator.post(f"{API}/inventory/import?dry_run=true", content=DEMO_YAML, headers=YAML)
    )
    assert dry["dry_run"] is True and dry["created"]["server"] == len(DEMO.servers)
    assert api.all_rows(f"{API}/servers")[0] == 0  # a dry run writes nothing

    report = api.import_demo()
    assert report["dry_run"] is False
    assert report["created"] == {
        "gpu_model": 0,
        "model_version": 0,
        "site": len(DEMO.sites),
        "rack": len(DEMO.racks),
        "feed": sum(len(r.feeds) for r in DEMO.racks),
        "server": len(DEMO.servers),
        "deployment": len(DEMO.deployments),
    }
    # The two racks that are oversubscribed on purpose, and only those.
    assert [w.split(":")[0] for w in report["warnings"]] == ["rack ams1-r02", "rack fra1-r01"]

    again = api.import_demo()
    assert again["changes"] == [] and not any(again["created"].values())
    assert sum(again["unchanged"].values()) == sum(report["created"].values())
    validated = ok(api.operator.post(VALIDATE[1], content=DEMO_YAML, headers=YAML))
    assert validated["dry_run"] is True and validated["changes"] == []
    assert "operator role" in detail(
        api.viewer.post(VALIDATE[1], content=DEMO_YAML, headers=YAML), 403
    )


def test_servers_paging(demo: Api) -> None:
    url = f"{API}/servers"
    first = ok(demo.viewer.get(url, params={"limit": 10}))
    assert set(first) == {"count", "next", "previous", "results"}
    assert first["count"] == len(DEMO.servers) and len(first["results"]) == 10
    assert first["previous"] is None and first["next"].startswith(demo.live.url)

    second = ok(demo.viewer.get(first["next"]))
    assert len(second["results"]) == 10 and second["previous"] is not None
    back = ok(demo.viewer.get(second["previous"]))
    assert back["results"] == first["results"]
    names = [s["name"] for s in first["results"] + second["results"]]
    assert names == sorted(names) and len(set(names)) == 20

    last = ok(demo.viewer.get(url, params={"limit": 10, "offset": 50}))
    assert len(last["results"]) == 6 and last["next"] is None

    capped = ok(demo.viewer.get(url, params={"limit": 500}))
    assert len(capped["results"]) == PAGE_CAP and "limit=20" in capped["next"]
    default = ok(demo.viewer.get(url))
    assert len(default["results"]) == DEFAULT_PAGE

    _, rows = demo.all_rows(url)
    assert sorted(r["name"] for r in rows) == sorted(s.name for s in DEMO.servers)
    assert all("password" not in key or key == "bmc_password_set" for r in rows for key in r)
    assert all(r["bmc_password_set"] is True for r in rows)

    for bad in ({"limit": 0}, {"offset": -1}, {"limit": "ten"}):
        assert "\n" not in detail(demo.viewer.get(url, params=bad), 422)


def test_racks_page_in_the_database_as_the_whole_list_would(demo: Api) -> None:
    """Racks are paged in SQL (only a page's power figures computed): every page, with and
    without a site filter, is the slice of the full list, and the count is the filter's."""
    url = f"{API}/racks"
    for site in (None, DEMO.sites[0]):
        params = {} if site is None else {"site": site}
        _, everything = demo.all_rows(url, **params)
        names = [r["name"] for r in everything]
        assert names == sorted(r.name for r in DEMO.racks if site in (None, r.site))
        for limit, offset in ((1, 0), (3, 2), (3, len(names) - 1), (5, len(names))):
            page = ok(demo.viewer.get(url, params={**params, "limit": limit, "offset": offset}))
            assert page["count"] == len(names)
            assert page["results"] == everything[offset : offset + limit]
            assert (page["next"] is None) == (offset + limit >= len(names))


def test_paging_bounds_are_422_not_500(demo: Api) -> None:
    """Found by fuzzing: an offset past a 64-bit integer used to reach SQLite (500)."""
    for path in ("servers", "events", "racks", "gpus"):
        for params in ({"offset": 10**30}, {"offset": -1}, {"limit": 0}, {"limit": "x"}):
            text = detail(demo.viewer.get(f"{API}/{path}", params=params), 422)
            assert text.startswith(("query.offset", "query.limit")), text
        far = ok(demo.viewer.get(f"{API}/{path}", params={"offset": 1_000_000_000}))
        assert far["results"] == [] and far["next"] is None


def test_openapi_documents_every_error_shape(demo: Api) -> None:
    """Clients generated from /openapi.json see the `{detail, errors}` body of every 4xx."""
    spec = ok(demo.anonymous.get("/openapi.json"))
    assert set(spec["components"]["schemas"]["ErrorBody"]["properties"]) == {"detail", "errors"}
    for path, path_item in spec["paths"].items():
        if not path.startswith(API):
            continue
        for method, operation in path_item.items():
            for status in ("400", "401", "403", "404", "409", "422"):
                body = operation["responses"][status]["content"]["application/json"]["schema"]
                assert body == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)


def test_server_filters(demo: Api) -> None:
    fields = ("site", "rack", "pool", "gpu_model")
    cases: list[dict[str, str]] = [
        *(
            {field: value}
            for field in fields
            for value in sorted({getattr(s, field) for s in DEMO.servers})
        ),
        {"site": "ams1", "gpu_model": "L40S", "pool": "warm"},
        {"rack": "fra1-r01", "site": "ams1"},  # no rack fra1-r01 at ams1
        {"gpu_model": "B200"},
    ]
    for params in cases:
        expected = sorted(
            s.name for s in DEMO.servers if all(getattr(s, k) == v for k, v in params.items())
        )
        count, rows = demo.all_rows(f"{API}/servers", **params)
        assert count == len(expected), params
        assert sorted(r["name"] for r in rows) == expected, params
    assert demo.all_rows(f"{API}/servers", state="enrolled")[0] == len(DEMO.servers)
    assert demo.all_rows(f"{API}/servers", state="maintenance")[0] == 0

    ok(
        demo.operator.post(
            f"{API}/servers/ams1-r03-l40s-01/transition", json={"to": "maintenance", "reason": "t"}
        )
    )
    count, rows = demo.all_rows(f"{API}/servers", state="maintenance")
    assert count == 1 and rows[0]["name"] == "ams1-r03-l40s-01"
    assert demo.all_rows(f"{API}/servers", state="enrolled")[0] == len(DEMO.servers) - 1
    assert "state" in detail(demo.viewer.get(f"{API}/servers", params={"state": "asleep"}), 422)
    assert "pool" in detail(demo.viewer.get(f"{API}/servers", params={"pool": "hot"}), 422)


def test_server_detail_and_gpus(demo: Api) -> None:
    for name in ("fra1-r01-h100-01", "ams1-r04-l40s-12"):
        spec = DEMO.server(name)
        server = ok(demo.viewer.get(f"{API}/servers/{name}"))
        assert (server["site"], server["rack"], server["gpu_model"]) == (
            spec.site,
            spec.rack,
            spec.gpu_model,
        )
        assert server["state"] == "enrolled" and server["bmc_password_set"] is True
        count, gpus = demo.all_rows(f"{API}/servers/{name}/gpus")
        assert count == spec.gpu_count == server["gpu_count"]
        assert [g["index"] for g in gpus] == list(range(spec.gpu_count))
        assert {(g["server"], g["model"]) for g in gpus} == {(name, spec.gpu_model)}
        assert demo.all_rows(f"{API}/gpus", server=name)[0] == spec.gpu_count
    assert demo.all_rows(f"{API}/gpus")[0] == sum(s.gpu_count for s in DEMO.servers)
    assert "nope" in detail(demo.viewer.get(f"{API}/servers/nope"), 404)
    assert "nope" in detail(demo.viewer.get(f"{API}/servers/nope/gpus"), 404)
    assert "nope" in detail(demo.viewer.get(f"{API}/gpus", params={"server": "nope"}), 404)


def test_sites(demo: Api) -> None:
    count, sites = demo.all_rows(f"{API}/sites")
    assert count == len(DEMO.sites)
    for site in sites:
        racks = [r for r in DEMO.racks if r.site == site["name"]]
        assert site["rack_count"] == len(racks)
        assert site["server_count"] == sum(len(r.servers) for r in racks)
        assert ok(demo.viewer.get(f"{API}/sites/{site['name']}")) == site
    assert "atlantis" in detail(demo.viewer.get(f"{API}/sites/atlantis"), 404)


Moved = Mapping[str, tuple[ServerState, str]]


def _demo_power(rack: str, moved: Moved | None = None) -> RackPower:
    """What fleet.power.budget makes of `rack`: each server counted as
    fleet.lifecycle.states.draws_max_power
    says for its (state, power_state): IMPORTED unless `moved` says otherwise."""
    spec = DEMO.rack(rack)
    where = moved or {}
    draws = [
        ServerDraw(s.max_w, s.standby_w, on=draws_max_power(*where.get(s.name, IMPORTED)))
        for s in spec.servers
    ]
    return rack_power(spec.feeds, draws)


def _check_rack(row: dict[str, Any], moved: Moved | None = None) -> None:
    power = _demo_power(row["name"], moved)
    spec = DEMO.rack(row["name"])
    assert row["site"] == spec.site
    assert row["feeds"] == len(spec.feeds) and row["servers"] == len(spec.servers)
    assert row["budget_w"] == round(power.budget_w, 1)
    assert row["committed_w"] == round(power.committed_w, 1)
    assert row["headroom_w"] == round(power.headroom_w, 1)
    assert row["all_on_w"] == round(power.all_on_w, 1)


def _set_power_state(engine: Engine, name: str, power_state: PowerState) -> None:
    """What a BMC poll records (the lifecycle state is not touched)."""
    with engine.begin() as conn:
        moved = conn.execute(
            sa.update(Server).where(col(Server.name) == name).values(power_state=power_state)
        )
        assert moved.rowcount == 1


def test_racks_budget_committed_headroom(demo: Api) -> None:
    count, racks = demo.all_rows(f"{API}/racks")
    assert count == len(DEMO.racks)
    for row in racks:
        _check_rack(row)
        # Right after an import no BMC has been read: every server counts at its maximum.
        assert row["committed_w"] == row["all_on_w"] > 0
    # The demo's own worked numbers: 2 × 415 V 32 A 3φ per side, four DGX at 10.2 kW.
    r01 = ok(demo.viewer.get(f"{API}/racks/fra1-r01"))
    assert (r01["budget_w"], r01["all_on_w"]) == (36802.6, 40800.0)  # oversubscribed on purpose
    assert r01["headroom_w"] < 0  # every server counted on: over budget
    assert ok(demo.viewer.get(f"{API}/racks/ams1-r04"))["budget_w"] == 34776.0

    # The lifecycle reaches warm only once the BMC reported the server off: standby draw.
    moved: dict[str, tuple[ServerState, str]] = {}
    warm = DEMO.server("fra1-r01-h100-01")
    with Session(demo.live.engine) as session:
        event = lifecycle.transition(session, warm.name, ServerState.WARM, "tests", "spare")
        assert event is not None and event.from_state == "enrolled"
    moved[warm.name] = (ServerState.WARM, PowerState.UNKNOWN.value)
    after = ok(demo.viewer.get(f"{API}/racks/fra1-r01"))
    _check_rack(after, moved)
    assert after["committed_w"] == r01["committed_w"] - (warm.max_w - warm.standby_w)
    assert math.isclose(after["headroom_w"], r01["headroom_w"] + warm.max_w - warm.standby_w)
    assert after["headroom_w"] > 0
    for row in demo.all_rows(f"{API}/racks")[1]:  # the other racks did not move
        _check_rack(row, moved)

    # Maintenance (an operator move) says nothing about power: still counted at its maximum.
    held = "fra1-r01-h100-02"
    ok(
        demo.operator.post(
            f"{API}/servers/{held}/transition", json={"to": "maintenance", "reason": "t"}
        )
    )
    moved[held] = (ServerState.MAINTENANCE, PowerState.UNKNOWN.value)
    assert ok(demo.viewer.get(f"{API}/racks/fra1-r01"))["committed_w"] == after["committed_w"]
    _check_rack(ok(demo.viewer.get(f"{API}/racks/fra1-r01")), moved)

    # A BMC reading decides for a server that is not powered in the lifecycle: off is standby…
    off = DEMO.server("fra1-r01-h100-03")
    _set_power_state(demo.live.engine, off.name, PowerState.OFF)
    moved[off.name] = (ServerState.ENROLLED, PowerState.OFF.value)
    read_off = ok(demo.viewer.get(f"{API}/racks/fra1-r01"))
    _check_rack(read_off, moved)
    assert read_off["committed_w"] == after["committed_w"] - (off.max_w - off.standby_w)
    # …and on is the maximum, even for a warm server.
    _set_power_state(demo.live.engine, warm.name, PowerState.ON)
    moved[warm.name] = (ServerState.WARM, PowerState.ON.value)
    read_on = ok(demo.viewer.get(f"{API}/racks/fra1-r01"))
    _check_rack(read_on, moved)
    assert read_on["committed_w"] == read_off["committed_w"] + (warm.max_w - warm.standby_w)
    # On its way up a server counts at its maximum, whatever the last reading said.
    with Session(demo.live.engine) as session:
        assert lifecycle.transition(session, off.name, ServerState.BOOTING, "tests", "go")
    moved[off.name] = (ServerState.BOOTING, PowerState.OFF.value)
    booting = ok(demo.viewer.get(f"{API}/racks/fra1-r01"))
    _check_rack(booting, moved)
    assert booting["committed_w"] == booting["all_on_w"] == r01["committed_w"]

    ams = demo.all_rows(f"{API}/racks", site="ams1")[1]
    assert sorted(r["name"] for r in ams) == sorted(r.name for r in DEMO.racks if r.site == "ams1")
    assert "nope" in detail(demo.viewer.get(f"{API}/racks/nope"), 404)


def test_feeds_usable_watts(demo: Api) -> None:
    count, feeds = demo.all_rows(f"{API}/feeds")
    assert count == sum(len(r.feeds) for r in DEMO.racks)
    for rack in DEMO.racks:
        rows = [f for f in feeds if f["rack"] == rack.name]
        assert sorted(f["name"] for f in rows) == sorted(rack.feed_names)
        by_name = dict(zip(rack.feed_names, rack.feeds, strict=True))
        for row in rows:
            assert row["usable_w"] == round(feed_watts(by_name[row["name"]]), 1)
    only = demo.all_rows(f"{API}/feeds", rack="ams1-r04")[1]
    assert [(f["name"], f["usable_w"]) for f in only] == [
        (n, 11592.0) for n in ("a1", "a2", "a3", "b1", "b2", "b3")
    ]
    assert {f["usable_w"] for f in demo.all_rows(f"{API}/feeds", rack="fra1-r01")[1]} == {18401.3}


def test_events_filters(demo: Api) -> None:
    name = "fra1-r02-h100-01"
    enrolled = demo.events(subject=name)
    assert [(e["kind"], e["to_state"]) for e in enrolled] == [("server.enrolled", "enrolled")]
    assert len(demo.events(kind="server.enrolled")) == len(DEMO.servers)
    assert len(demo.events(kind="inventory")) == 1
    assert len(demo.events(subject_type="token")) == 3
    assert demo.events(kind="serv") == []  # a prefix matches whole dotted parts only

    since = datetime.now(UTC)
    ok(
        demo.operator.post(
            f"{API}/servers/{name}/transition", json={"to": "maintenance", "reason": "fans"}
        )
    )
    ok(
        demo.operator.post(
            f"{API}/servers/{name}/transition", json={"to": "enrolled", "reason": "fixed"}
        )
    )
    recent = demo.events(since=since.isoformat())
    assert [(e["subject"], e["from_state"], e["to_state"]) for e in recent] == [
        (name, "maintenance", "enrolled"),  # newest first
        (name, "enrolled", "maintenance"),
    ]
    assert recent[0]["id"] > recent[1]["id"]
    assert len(demo.events(kind="server", subject=name)) == 3
    assert len(demo.events(until=since.isoformat())) == len(demo.events()) - 2
    # A time without a zone is UTC.
    naive = since.replace(tzinfo=None).isoformat()
    assert "+" not in naive and not naive.endswith("Z")
    assert demo.events(since=naive) == recent
    assert len(demo.events(until=naive)) == len(demo.events()) - 2
    assert demo.events(since="2020-01-01T00:00:00") == demo.events()
    assert demo.events(until="2020-01-01T00:00:00") == []
    assert "since" in detail(demo.viewer.get(f"{API}/events", params={"since": "yesterday"}), 422)


# ---------------------------------------------------------------------------------------------
# Transitions


def test_legal_transition_writes_one_event(demo: Api) -> None:
    name = "fra1-r03-h200-01"
    before = len(demo.events(subject=name))
    result = ok(
        demo.operator.post(
            f"{API}/servers/{name}/transition", json={"to": "maintenance", "reason": "psu swap"}
        )
    )
    assert result["server"]["state"] == "maintenance"
    event = result["event"]
    assert (event["from_state"], event["to_state"], event["kind"]) == (
        "enrolled",
        "maintenance",
        "server.transition",
    )
    assert event["actor"] == "operator:operator" and event["message"] == "psu swap"
    assert len(demo.events(subject=name)) == before + 1
    # The same move again is a no-op: 200, no event.
    again = ok(
        demo.operator.post(
            f"{API}/servers/{name}/transition", json={"to": "maintenance", "reason": "x"}
        )
    )
    assert again["event"] is None and len(demo.events(subject=name)) == before + 1
    # Release: back to enrolled, one more event.
    released = ok(
        demo.operator.post(
            f"{API}/servers/{name}/transition", json={"to": "enrolled", "reason": "done"}
        )
    )
    assert released["server"]["state"] == "enrolled"
    assert (released["event"]["from_state"], released["event"]["to_state"]) == (
        "maintenance",
        "enrolled",
    )
    assert len(demo.events(subject=name)) == before + 2


def test_illegal_transition_is_409_and_changes_nothing(demo: Api) -> None:
    url = f"{API}/servers/{{}}/transition"
    name = "fra1-r03-h200-02"
    retired = "fra1-r03-h200-03"
    ok(demo.operator.post(url.format(retired), json={"to": "retired", "reason": "eol"}))
    cases = [
        # draining is an operator move, but only from serving
        (name, ServerState.ENROLLED, ServerState.DRAINING),
        # retired is terminal
        (retired, ServerState.RETIRED, ServerState.MAINTENANCE),
        (retired, ServerState.RETIRED, ServerState.ENROLLED),
    ]
    for server, current, target in cases:
        assert target in OPERATOR_TARGETS and target not in allowed_targets(current)
        server_before = ok(demo.viewer.get(f"{API}/servers/{server}"))
        assert server_before["state"] == current.value
        events_before = demo.events()
        response = demo.operator.post(
            url.format(server), json={"to": target.value, "reason": "skip ahead"}
        )
        text = detail(response, 409)
        allowed = ", ".join(s.value for s in allowed_targets(current)) or "none (terminal)"
        expected = (
            f"from {current.value} to {target.value} (allowed from {current.value}: {allowed})"
        )
        assert expected in text, text
        assert ok(demo.viewer.get(f"{API}/servers/{server}")) == server_before
        assert demo.events() == events_before


def _walk(engine: Engine, name: str, target: ServerState) -> list[ServerState]:
    """Move `name` to `target` in the database, the only legal way (tests/factories.py)."""
    with Session(engine) as session:
        server = session.exec(select(Server).where(col(Server.name) == name)).one()
        return walk_to(session, server, target)


def test_fleet_only_targets_are_422_and_change_nothing(demo: Api) -> None:
    """Moves that record what a BMC or agent reported are the fleet's own: 422 for every one,
    even where the lifecycle allows it from the server's state (enrolled → warm or booting,
    warm → booting)."""
    fleet_only = [s for s in ServerState if s not in OPERATOR_TARGETS]
    assert {ServerState.BOOTING, ServerState.WARM, ServerState.SERVING} <= set(fleet_only)
    enrolled, warm = "fra1-r02-h100-03", "fra1-r02-h100-04"
    assert _walk(demo.live.engine, warm, ServerState.WARM) == [ServerState.WARM]
    legal_refused = 0
    for name in (enrolled, warm):
        server_before = ok(demo.viewer.get(f"{API}/servers/{name}"))
        events_before = demo.events()
        current = ServerState(server_before["state"])
        for target in fleet_only:
            if target == current:
                continue
            legal_refused += target in allowed_targets(current)
            for client in (demo.operator, demo.admin):
                response = client.post(
                    f"{API}/servers/{name}/transition",
                    json={"to": target.value, "reason": "by hand"},
                )
                text = detail(response, 422)
                assert text.startswith(f"{target.value} is reached by the fleet itself"), text
                assert all(s.value in text for s in OPERATOR_TARGETS), text
        assert ok(demo.viewer.get(f"{API}/servers/{name}")) == server_before
        assert demo.events() == events_before
    assert legal_refused == 3  # enrolled → warm, enrolled → booting, warm → booting


def test_draining_a_serving_server_is_an_operator_move(demo: Api) -> None:
    name = "fra1-r03-h200-04"
    path = _walk(demo.live.engine, name, ServerState.SERVING)
    assert path[-1] == ServerState.SERVING and ServerState.BOOTING in path
    url = f"{API}/servers/{name}/transition"
    drained = ok(demo.operator.post(url, json={"to": "draining", "reason": "rebalance"}))
    assert drained["server"]["state"] == "draining"
    assert (drained["event"]["from_state"], drained["event"]["to_state"]) == (
        "serving",
        "draining",
    )
    # draining → drained is legal, but it records that the replicas are gone: the fleet's call.
    assert ServerState.DRAINED in allowed_targets(ServerState.DRAINING)
    assert "reached by the fleet itself" in detail(
        demo.operator.post(url, json={"to": "drained", "reason": "x"}), 422
    )
    assert ok(demo.viewer.get(f"{API}/servers/{name}"))["state"] == "draining"


def test_transition_errors(demo: Api) -> None:
    url = f"{API}/servers/{{}}/transition"
    move = {"to": "maintenance", "reason": "fans"}
    assert "ghost" in detail(demo.operator.post(url.format("ghost"), json=move), 404)
    invalid = detail(
        demo.operator.post(url.format("fra1-r01-h100-01"), json={"to": "flying", "reason": "x"}),
        422,
    )
    assert invalid.startswith("body.to: must be one of") and "flying" not in invalid
    assert "body.reason: required" in detail(
        demo.operator.post(url.format("fra1-r01-h100-01"), json={"to": "maintenance"}), 422
    )
    assert "body.reason" in detail(
        demo.operator.post(
            url.format("fra1-r01-h100-01"), json={"to": "maintenance", "reason": ""}
        ),
        422,
    )
    assert ok(demo.viewer.get(f"{API}/servers/fra1-r01-h100-01"))["state"] == "enrolled"


# ---------------------------------------------------------------------------------------------
# Server edits


def test_patch_server_records_fields_not_values(demo: Api) -> None:
    name = "ams1-r01-h200-01"
    edit = {"pool": "warm", "bmc_port": 8443, "bmc_password": "rotated-Secret-1"}
    server = ok(demo.admin.patch(f"{API}/servers/{name}", json=edit))  # credentials: admin
    assert (server["pool"], server["bmc_port"], server["bmc_password_set"]) == ("warm", 8443, True)
    [event] = demo.events(subject=name, kind="server.updated")
    assert sorted(event["details"]["fields"]) == ["bmc_password", "bmc_port", "pool"]
    assert "rotated-Secret-1" not in str(event)
    # Nothing to change: no event.
    ok(demo.operator.patch(f"{API}/servers/{name}", json={"pool": "warm"}))
    assert len(demo.events(subject=name, kind="server.updated")) == 1
    assert "ghost" in detail(
        demo.operator.patch(f"{API}/servers/ghost", json={"pool": "warm"}), 404
    )
    # The state is not an editable field.
    text = detail(demo.operator.patch(f"{API}/servers/{name}", json={"state": "serving"}), 422)
    assert text == "body.state: unknown field"


def _reads_still_work(demo: Api, name: str) -> None:
    """The lists, the server and the export still answer (no null reached a NOT NULL column)."""
    assert demo.all_rows(f"{API}/servers")[0] == len(DEMO.servers)
    ok(demo.viewer.get(f"{API}/servers/{name}"))
    export = demo.operator.get(f"{API}/inventory/export")
    assert export.status_code == 200 and name in export.text, export.text[:200]


@pytest.mark.parametrize(
    "field", ["pool", "bmc_address", "bmc_port", "bmc_username", "bmc_password"]
)
def test_patch_server_null_is_422_and_changes_nothing(demo: Api, field: str) -> None:
    name = "ams1-r01-h200-02"
    url = f"{API}/servers/{name}"
    before = ok(demo.viewer.get(url))
    text = detail(demo.operator.patch(url, json={field: None}), 422)
    assert field in text and "must not be null" in text, text
    # Together with a valid field: the whole edit is refused.
    text = detail(demo.operator.patch(url, json={"pool": "warm", field: None}), 422)
    assert "must not be null" in text, text
    assert ok(demo.viewer.get(url)) == before
    assert demo.events(kind="server.updated") == []
    _reads_still_work(demo, name)


def test_patch_server_bmc_system_id_may_be_null(demo: Api) -> None:
    name = "ams1-r01-h200-03"
    url = f"{API}/servers/{name}"
    assert ok(demo.viewer.get(url))["bmc_system_id"]
    server = ok(demo.operator.patch(url, json={"bmc_system_id": None}))
    assert server["bmc_system_id"] is None
    assert ok(demo.viewer.get(url)) == server
    [event] = demo.events(subject=name, kind="server.updated")
    # Another system behind the BMC: the stored password is dropped (tests/e2e/test_credentials.py).
    assert event["details"]["fields"] == ["bmc_system_id", "bmc_password"]
    assert server["bmc_password_set"] is False
    _reads_still_work(demo, name)


BMC_FIELDS = ("bmc_address", "bmc_port", "bmc_system_id")


@pytest.mark.parametrize(
    ("name", "other", "fields"),
    [
        # Redfish: the same emulator, another server's system id.
        ("fra1-r01-h100-02", "fra1-r01-h100-01", ("bmc_system_id",)),
        # IPMI: another server's port on the same address.
        ("fra1-r04-l40s-02", "fra1-r04-l40s-01", ("bmc_port",)),
        # Redfish onto an IPMI endpoint: port and a null system id together.
        ("fra1-r01-h100-03", "fra1-r04-l40s-03", ("bmc_port", "bmc_system_id")),
    ],
    ids=["system-id", "port", "port-and-null-system-id"],
)
def test_patch_server_onto_another_servers_bmc_is_409(
    demo: Api, name: str, other: str, fields: tuple[str, ...]
) -> None:
    url = f"{API}/servers/{name}"
    before = ok(demo.viewer.get(url))
    theirs = ok(demo.viewer.get(f"{API}/servers/{other}"))
    assert before["bmc_address"] == theirs["bmc_address"]
    assert [f for f in BMC_FIELDS if before[f] != theirs[f]] == list(fields)
    edit = {f: theirs[f] for f in fields}
    text = detail(demo.operator.patch(url, json={**edit, "pool": "warm"}), 409)
    assert f"is already the BMC of server {other!r}" in text, text
    assert ok(demo.viewer.get(url)) == before  # not even the pool
    assert ok(demo.viewer.get(f"{API}/servers/{other}")) == theirs
    assert demo.events(kind="server.updated") == []
    # Its own endpoint, sent again, is no conflict.
    ok(demo.operator.patch(url, json={f: before[f] for f in BMC_FIELDS}))


def test_validation_errors_never_echo_the_input(demo: Api) -> None:
    secret = "Hunter2-never-echo-7f3a"
    url = f"{API}/servers/fra1-r01-h100-01"
    bodies: list[Any] = [
        {"bmc_port": "x", "bmc_password": secret},
        {"bmc_port": secret, "bmc_password": secret},
        {"bmc_password": [secret]},
        {"bmc_password": {"value": secret}},
        {"password": secret},
        {"bmc_address": secret * 20, "bmc_password": secret},
        {"pool": secret, "bmc_password": secret},
    ]
    for body in bodies:
        response = demo.operator.patch(url, json=body)
        assert response.status_code == 422, body
        assert secret not in response.text, response.text
        assert "\n" not in response.json()["detail"]
    # Not even JSON: the decoder's complaint, not the text.
    raw = demo.operator.patch(
        url,
        content=f'{{"bmc_password": "{secret}", '.encode(),
        headers={"Content-Type": "application/json"},
    )
    assert raw.status_code == 422 and secret not in raw.text
    # A deployment named after the secret, or transitioning "to" it: rejected without an echo.
    too_long = {**DEPLOYMENT, "name": secret * 4}
    response = demo.operator.post(f"{API}/deployments", json=too_long)
    assert response.status_code == 422 and secret not in response.text
    response = demo.operator.post(f"{url}/transition", json={"to": secret, "reason": secret})
    assert response.status_code == 422 and secret not in response.text
    # The password was never changed by any of those.
    assert demo.events(kind="server.updated") == []


# ---------------------------------------------------------------------------------------------
# Deployments


def test_create_deployment(demo: Api) -> None:
    created = ok(demo.operator.post(f"{API}/deployments", json=DEPLOYMENT), 201)
    assert {k: created[k] for k in DEPLOYMENT} == DEPLOYMENT
    assert ok(demo.viewer.get(f"{API}/deployments/qwen-7b")) == created
    [event] = demo.events(subject="qwen-7b")
    assert (event["kind"], event["actor"]) == ("deployment.created", "operator:operator")
    names = [d["name"] for d in demo.all_rows(f"{API}/deployments")[1]]
    assert names == sorted([*DEMO.deployments, "qwen-7b"])
    assert "ghost" in detail(demo.viewer.get(f"{API}/deployments/ghost"), 404)


def test_deployment_rejections(demo: Api) -> None:
    url = f"{API}/deployments"
    ok(demo.operator.post(url, json=DEPLOYMENT), 201)
    assert "already exists" in detail(demo.operator.post(url, json=DEPLOYMENT), 409)
    demo_dup = {**DEPLOYMENT, "name": DEMO.deployments[0]}
    assert "already exists" in detail(demo.operator.post(url, json=demo_dup), 409)

    # Rules across fields, which the schema cannot state: 400 (422 is for what it states).
    min_max = {**DEPLOYMENT, "name": "a", "min_replicas": 5, "max_replicas": 2}
    assert "min_replicas (5) exceeds max_replicas (2)" in detail(
        demo.operator.post(url, json=min_max), 400
    )
    parallel = {**DEPLOYMENT, "name": "b", "engine_params": {"tp_size": 2, "pp_size": 2}}
    assert "tp_size × pp_size" in detail(demo.operator.post(url, json=parallel), 400)
    unknown = {**DEPLOYMENT, "name": "c", "gpu_models": ["H100", "TPUv5"]}
    text = detail(demo.operator.post(url, json=unknown), 400)
    assert "TPUv5" in text and "known: H100, H200, L40S" in text
    missing = {k: v for k, v in DEPLOYMENT.items() if k != "sla_ttft_ms"}
    assert detail(demo.operator.post(url, json={**missing, "name": "d"}), 422) == (
        "body.sla_ttft_ms: required"
    )
    names = {d["name"] for d in demo.all_rows(url)[1]}
    assert names == {*DEMO.deployments, "qwen-7b"}  # none of the rejected ones


def test_deployment_name_must_be_a_name(demo: Api) -> None:
    for name in ("bad name", "a/b", "-leading-dash", "ünïcode"):
        text = detail(
            demo.operator.post(f"{API}/deployments", json={**DEPLOYMENT, "name": name}), 422
        )
        assert text.startswith("body.name: not a valid name")


def test_update_deployment(demo: Api) -> None:
    url = f"{API}/deployments/llama-8b"
    before = ok(demo.viewer.get(url))
    updated = ok(demo.operator.patch(url, json={"max_replicas": 60, "sla_ttft_ms": 400}))
    assert (updated["max_replicas"], updated["sla_ttft_ms"]) == (60, 400)
    assert updated["updated_at"] > before["updated_at"]
    [event] = demo.events(kind="deployment.updated")
    assert event["subject"] == "llama-8b" and event["actor"] == "operator:operator"
    assert sorted(event["details"]["fields"]) == ["max_replicas", "sla_ttft_ms"]
    assert "TPUv5" in detail(demo.operator.patch(url, json={"gpu_models": ["TPUv5"]}), 400)
    assert "ghost" in detail(
        demo.operator.patch(f"{API}/deployments/ghost", json={"max_replicas": 2}), 404
    )
    assert detail(demo.operator.patch(url, json={"name": "x"}), 422) == "body.name: unknown field"
    assert ok(demo.viewer.get(url)) == updated  # the rejected edits changed nothing


@pytest.mark.parametrize(
    "field",
    [
        "model_uri",
        "model_checksum",
        "engine_params",
        "gpus_per_replica",
        "gpu_models",
        "min_replicas",
        "max_replicas",
        "sla_p95_latency_ms",
        "sla_ttft_ms",
        "disruption_budget",
    ],
)
def test_update_deployment_null_is_422(demo: Api, field: str) -> None:
    url = f"{API}/deployments/llama-8b"
    before = ok(demo.viewer.get(url))
    text = detail(demo.operator.patch(url, json={field: None}), 422)
    assert field in text and "must not be null" in text, text
    assert ok(demo.viewer.get(url)) == before
    assert demo.events(kind="deployment.updated") == []
    assert len(demo.all_rows(f"{API}/deployments")[1]) == len(DEMO.deployments)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"min_replicas": 100}, "min_replicas (100) exceeds max_replicas (40)"),
        ({"gpus_per_replica": 4}, "tp_size × pp_size"),
    ],
    ids=["min-over-max", "parallelism"],
)
def test_update_deployment_cross_field_rules(demo: Api, edit: dict[str, Any], message: str) -> None:
    """An edit that breaks a rule across fields (which no schema states) is a 400 naming the
    rule, not a server error."""
    url = f"{API}/deployments/llama-8b"
    before = ok(demo.viewer.get(url))
    assert message in detail(demo.operator.patch(url, json=edit), 400)
    assert ok(demo.viewer.get(url)) == before
    assert demo.events(kind="deployment.updated") == []
