"""The scheduled-scaling calendar's REST API and `fleetctl schedule`, against a live service.

One uvicorn server per module per database (SQLite and Postgres); every test starts from empty
tables with fleet/data/inventory/demo.yaml imported. What is pinned here (docs/calendar.md):

- entries: add (201, `schedule.created`), list and show with the next window and the early
  start (`lead_s`: FLEET_BOOT_ESTIMATE_S until a boot of the GPU models the deployment would
  boot has been measured, then their slowest p90), remove (204, `schedule.deleted`);
- every rejected entry is a 4xx whose one-line detail names the problem, and writes nothing;
- viewers read and preview, operators write;
- the issue's acceptance: a Monday–Friday 09:00 entry in Europe/Berlin serves from Fri
  2027-03-26 08:00 UTC, Mon 2027-03-29 07:00 UTC, Fri 2027-10-29 07:00 UTC and Mon 2027-11-01
  08:00 UTC (09:00 local each), booting one lead earlier;
- `fleetctl schedule add|list|rm|preview`, tables and JSON; errors are one line and exit 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
import sqlalchemy as sa
from factories import walk_to
from live import YAML, Live, load_demo, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner, Result

from fleet import cli
from fleet.data import DEMO_INVENTORY
from fleet.lifecycle.states import ServerState
from fleet.models import Role, Server

API = "/api/v1"
URL = f"{API}/schedules"
DEMO = load_demo()
BERLIN = "Europe/Berlin"
WEEKDAYS_9 = "0 9 * * 1-5"
# llama-70b: H100 or H200, at most 24 replicas (fleet/data/inventory/demo.yaml).
DEPLOYMENT = "llama-70b"
MAX_REPLICAS = 24
ENTRY: dict[str, Any] = {
    "deployment": DEPLOYMENT,
    "cron": WEEKDAYS_9,
    "timezone": BERLIN,
    "min_replicas": 8,
    "duration_s": 9 * 3600,
    "note": "business hours",
}
# The issue's acceptance: (preview from, the two windows after it) in UTC.
ACCEPTANCE = [
    (
        "2027-03-25T12:00:00Z",
        [datetime(2027, 3, 26, 8, 0, tzinfo=UTC), datetime(2027, 3, 29, 7, 0, tzinfo=UTC)],
    ),
    (
        "2027-10-28T12:00:00Z",
        [datetime(2027, 10, 29, 7, 0, tzinfo=UTC), datetime(2027, 11, 1, 8, 0, tzinfo=UTC)],
    ),
]


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    # No boot margin: the leads below are the measured p90s themselves.
    with serve(engine, tmp_path_factory.mktemp("schedules"), boot_margin_pct=0.0) as server:
        yield server


@dataclass
class Api:
    live: Live
    admin: httpx.Client
    operator: httpx.Client
    viewer: httpx.Client
    anonymous: httpx.Client

    @property
    def default_lead_s(self) -> float:
        return self.live.settings.boot_estimate_s

    def events(self, **params: Any) -> list[dict[str, Any]]:
        page = ok(self.viewer.get(f"{API}/events", params={"limit": 1000, **params}))
        assert page["next"] is None
        rows: list[dict[str, Any]] = page["results"]
        return rows

    def entries(self, **params: Any) -> list[dict[str, Any]]:
        body = ok(self.viewer.get(URL, params=params))
        assert body["count"] == len(body["results"])
        rows: list[dict[str, Any]] = body["results"]
        return rows

    def add(self, client: httpx.Client | None = None, **changes: Any) -> dict[str, Any]:
        row: dict[str, Any] = ok((client or self.operator).post(URL, json=ENTRY | changes), 201)
        return row


@pytest.fixture
def api(live: Live, db: Engine) -> Iterator[Api]:
    client = live.client(live.token(Role.OPERATOR, name="importer"))
    response = client.post(
        f"{API}/inventory/import", content=DEMO_INVENTORY.read_bytes(), headers=YAML
    )
    assert response.status_code == 200, response.text
    yield Api(
        live=live,
        admin=live.client(live.token(Role.ADMIN, name="admin")),
        operator=live.client(live.token(Role.OPERATOR, name="operator")),
        viewer=live.client(live.token(Role.VIEWER, name="viewer")),
        anonymous=live.client(),
    )
    live.close_clients()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json() if response.content else None


def detail(response: httpx.Response, status: int) -> str:
    """The error detail of a `status` response, checked to be one line."""
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    text = response.json()["detail"]
    assert isinstance(text, str) and text and "\n" not in text, text
    return text


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def next_weekday_nine(after: datetime) -> datetime:
    """The first Monday–Friday 09:00 in Berlin after `after`, worked out with zoneinfo alone."""
    tz = ZoneInfo(BERLIN)
    day = after.astimezone(tz).date()
    while True:
        local = datetime.combine(day, time(9, 0), tzinfo=tz)
        if day.weekday() < 5 and local > after:
            return local.astimezone(UTC)
        day += timedelta(days=1)


def check_window(window: dict[str, Any], lead_s: float, duration_s: float | None) -> datetime:
    """A window's UTC and local fields agree, it boots `lead_s` early; returns its start."""
    start, boot_at, end = utc(window["start"]), utc(window["boot_at"]), utc(window["end"])
    assert utc(window["start_local"]) == start and utc(window["end_local"]) == end
    assert utc(window["boot_at_local"]) == boot_at
    assert start - boot_at == timedelta(seconds=lead_s)
    if duration_s is not None:
        assert end - start == timedelta(seconds=duration_s)
    assert end > start
    return start


def set_boot_times(engine: Engine, seconds: dict[str, float | None]) -> None:
    """What the provisioner records when a spare it booted starts serving."""
    with engine.begin() as conn:
        for name, value in seconds.items():
            moved = conn.execute(
                sa.update(Server).where(col(Server.name) == name).values(boot_to_ready_s=value)
            )
            assert moved.rowcount == 1, name


def servers_of(model: str) -> list[str]:
    return sorted(s.name for s in DEMO.servers if s.gpu_model == model)


# ---------------------------------------------------------------------------------------------
# Add, list, show, remove


def test_add_list_show_remove(api: Api) -> None:
    before = datetime.now(UTC)
    row = api.add()
    assert {k: row[k] for k in ENTRY} == ENTRY
    assert row["id"] == 1 and row["end_cron"] is None
    assert row["created_by"] == "operator:operator"
    assert (row["active"], row["active_until"]) == (False, None)
    assert (row["last_window_start"], row["last_fired_at"]) == (None, None)
    # No boot measured yet: the configured default, and it says so.
    assert row["lead_s"] == api.default_lead_s == 1200.0
    assert "never measured" in row["lead_basis"] and "default" in row["lead_basis"]
    start = check_window(row["next"], row["lead_s"], ENTRY["duration_s"])
    assert start == next_weekday_nine(before) or start == next_weekday_nine(datetime.now(UTC))
    local = datetime.fromisoformat(row["next"]["start_local"])
    assert (local.hour, local.minute, local.weekday() < 5) == (9, 0, True)
    assert local.utcoffset() in (timedelta(hours=1), timedelta(hours=2))

    [created] = api.events(subject_type="schedule")
    assert (created["kind"], created["subject"], created["actor"]) == (
        "schedule.created",
        "1",
        "operator:operator",
    )
    assert DEPLOYMENT in created["message"] and WEEKDAYS_9 in created["message"]
    assert created["details"] == {"deployment": DEPLOYMENT}

    # An end expression instead of a duration; whitespace in expressions is normalised.
    other = api.add(
        deployment="llama-8b", cron=" 0  9 * * 1-5 ", end_cron="0 18 * * 1-5", duration_s=None
    )
    assert (other["id"], other["cron"], other["end_cron"]) == (2, WEEKDAYS_9, "0 18 * * 1-5")
    end_local = datetime.fromisoformat(other["next"]["end_local"])
    start_local = datetime.fromisoformat(other["next"]["start_local"])
    assert (end_local.date(), end_local.hour, end_local.minute) == (start_local.date(), 18, 0)

    listed = api.entries()
    assert [e["id"] for e in listed] == [1, 2]
    assert ok(api.viewer.get(f"{URL}/1")) == listed[0]
    assert [e["id"] for e in api.entries(deployment=DEPLOYMENT)] == [1]
    assert [e["id"] for e in api.entries(deployment="llama-8b")] == [2]
    assert "ghost" in detail(api.viewer.get(URL, params={"deployment": "ghost"}), 404)

    assert ok(api.operator.delete(f"{URL}/1"), 204) is None
    assert "no calendar entry 1" in detail(api.viewer.get(f"{URL}/1"), 404)
    assert [e["id"] for e in api.entries()] == [2]
    deleted = api.events(subject_type="schedule", subject="1")[0]
    assert (deleted["kind"], deleted["actor"]) == ("schedule.deleted", "operator:operator")
    assert DEPLOYMENT in deleted["message"]
    assert "no calendar entry 1" in detail(api.operator.delete(f"{URL}/1"), 404)
    assert len(api.events(subject_type="schedule")) == 3  # created, created, deleted


def test_unknown_ids_and_deployments_are_404(api: Api) -> None:
    for path in (f"{URL}/99", f"{URL}/99/preview"):
        assert "no calendar entry 99" in detail(api.viewer.get(path), 404)
    assert "no calendar entry 99" in detail(api.operator.delete(f"{URL}/99"), 404)
    ghost = ENTRY | {"deployment": "ghost"}
    assert "no deployment named 'ghost'" in detail(api.operator.post(URL, json=ghost), 404)
    assert "ghost" in detail(api.viewer.post(f"{URL}/preview", json=ghost), 404)
    assert "path.entry_id" in detail(api.viewer.get(f"{URL}/one"), 422)
    assert api.entries() == [] and api.events(subject_type="schedule") == []


# ---------------------------------------------------------------------------------------------
# The lead: the measured p90 boot-to-ready of the spares an entry would boot


def test_lead_is_the_measured_p90_of_the_models_it_would_boot(api: Api) -> None:
    engine = api.live.engine
    entry = api.add()
    assert (entry["lead_s"], entry["lead_basis"]) == (1200.0, "H100 never measured: default")

    # Five H100 boots: their p90 is the slowest of them. H200 (also allowed) was never
    # measured, so the default still decides: the capacity must serve whichever model boots.
    h100 = servers_of("H100")
    set_boot_times(engine, dict(zip(h100, [900.0, 1000.0, 1100.0, 1020.0, 960.0], strict=False)))
    shown = ok(api.viewer.get(f"{URL}/{entry['id']}"))
    assert (shown["lead_s"], shown["lead_basis"]) == (1200.0, "H200 never measured: default")

    # Every H200 measured, faster: the slowest model's p90 is the lead.
    set_boot_times(engine, dict.fromkeys(servers_of("H200"), 600.0))
    shown = ok(api.viewer.get(f"{URL}/{entry['id']}"))
    assert (shown["lead_s"], shown["lead_basis"]) == (1100.0, "H100, 5 boots measured")
    check_window(shown["next"], 1100.0, ENTRY["duration_s"])
    for start, expected in ACCEPTANCE:
        preview = ok(api.viewer.get(f"{URL}/{entry['id']}/preview", params={"start": start}))
        assert (preview["lead_s"], preview["lead_basis"]) == (1100.0, "H100, 5 boots measured")
        boots = [utc(w["boot_at"]) for w in preview["results"][:2]]
        assert boots == [t - timedelta(seconds=1100) for t in expected]

    # A warm spare is what would boot: only its model counts.
    with Session(engine) as session:
        spare = session.exec(select(Server).where(col(Server.name) == "fra1-r03-h200-01")).one()
        walk_to(session, spare, ServerState.WARM)
    shown = ok(api.viewer.get(f"{URL}/{entry['id']}"))
    assert (shown["lead_s"], shown["lead_basis"]) == (600.0, "H200, 8 boots measured")

    # Another deployment's models: L40S was never measured.
    other = api.add(deployment="llama-8b", min_replicas=4)
    assert (other["lead_s"], other["lead_basis"]) == (600.0, "H200, 8 boots measured")
    set_boot_times(engine, {"fra1-r03-h200-01": None})
    assert ok(api.viewer.get(f"{URL}/{other['id']}"))["lead_basis"] == "H200, 7 boots measured"


# ---------------------------------------------------------------------------------------------
# Rejections: a 4xx naming the problem, and nothing written


REJECTED: list[tuple[str, dict[str, Any], int, tuple[str, ...]]] = [
    ("four-fields", {"cron": "0 9 * *"}, 400, ("'0 9 * *'", "expected 5 fields")),
    ("seven-fields", {"cron": "0 0 9 * * 1-5 2027"}, 400, ("expected 5 fields",)),
    ("hour-25", {"cron": "0 25 * * *"}, 400, ("'0 25 * * *'", "(25)", "maximum value (23)")),
    ("dow-8", {"cron": "0 9 * * 8"}, 400, ("day-of-week '8' is not a day", "0 and 7 Sunday")),
    ("dow-backwards", {"cron": "0 9 * * 5-1"}, 400, ("'5-1' runs backwards",)),
    ("bad-end-cron", {"end_cron": "0 18 * *", "duration_s": None}, 400, ("'0 18 * *'",)),
    ("never-fires", {"cron": "0 9 30 2 *"}, 400, ("never fires again",)),
    ("unknown-zone", {"timezone": "Mars/Olympus"}, 400, ("unknown time zone 'Mars/Olympus'",)),
    ("zone-path", {"timezone": "/etc/localtime"}, 400, ("unknown time zone",)),
    ("empty-zone", {"timezone": ""}, 422, ("body.timezone",)),
    ("both-ends", {"end_cron": "0 18 * * 1-5"}, 422, ("give exactly one end",)),
    ("no-end", {"duration_s": None}, 422, ("give exactly one end",)),
    ("zero-duration", {"duration_s": 0}, 422, ("body.duration_s",)),
    ("zero-replicas", {"min_replicas": 0}, 422, ("body.min_replicas",)),
    ("no-cron", {"cron": None}, 422, ("body.cron",)),
    ("unknown-field", {"replicas": 3}, 422, ("body.replicas: unknown field",)),
    (
        "above-max",
        {"min_replicas": MAX_REPLICAS + 1},
        400,
        (f"min_replicas {MAX_REPLICAS + 1} is above", f"max_replicas {MAX_REPLICAS}"),
    ),
]


@pytest.mark.parametrize(
    ("changes", "status", "needles"),
    [case[1:] for case in REJECTED],
    ids=[case[0] for case in REJECTED],
)
def test_rejected_entries_write_nothing(
    api: Api, changes: dict[str, Any], status: int, needles: tuple[str, ...]
) -> None:
    body = {k: v for k, v in (ENTRY | changes).items() if v is not None}
    for client in (api.operator, api.admin):
        text = detail(client.post(URL, json=body), status)
        assert all(n in text for n in needles), text
    assert api.entries() == []
    assert api.events(subject_type="schedule") == []
    # A preview checks the same (but for the maximum: nothing is added).
    if "min_replicas" not in changes:
        text = detail(api.viewer.post(f"{URL}/preview", json=body), status)
        assert all(n in text for n in needles), text
    # At the maximum is fine.
    assert api.add(min_replicas=MAX_REPLICAS)["min_replicas"] == MAX_REPLICAS


# ---------------------------------------------------------------------------------------------
# Roles


def test_viewers_read_and_preview_operators_write(api: Api) -> None:
    entry = api.add(client=api.admin)
    assert entry["created_by"] == "admin:admin"
    path = f"{URL}/{entry['id']}"
    ok(api.viewer.get(URL))
    ok(api.viewer.get(path))
    ok(api.viewer.get(f"{path}/preview"))
    ok(api.viewer.post(f"{URL}/preview", json=ENTRY))
    for response in (api.viewer.post(URL, json=ENTRY), api.viewer.delete(path)):
        text = detail(response, 403)
        assert "viewer" in text and "operator role" in text, text
    agent = api.live.client(api.live.token(Role.AGENT, name="agent", server="fra1-r01-h100-01"))
    for response in (agent.get(URL), agent.post(URL, json=ENTRY), agent.delete(path)):
        assert "agent token cannot do this" in detail(response, 403)
    for client in (api.anonymous, api.live.client("flt_not-a-real-token")):
        for response in (
            client.get(URL),
            client.get(path),
            client.get(f"{path}/preview"),
            client.post(f"{URL}/preview", json=ENTRY),
            client.post(URL, json=ENTRY),
            client.delete(path),
        ):
            assert "token" in detail(response, 401)
    assert [e["id"] for e in api.entries()] == [entry["id"]]  # none of them wrote anything
    assert [e["kind"] for e in api.events(subject_type="schedule")] == ["schedule.created"]
    ok(api.admin.delete(path), 204)
    assert api.entries() == []


# ---------------------------------------------------------------------------------------------
# Preview: the acceptance, in local time and UTC, across DST


@pytest.mark.parametrize(("start", "expected"), ACCEPTANCE, ids=["spring", "autumn"])
def test_acceptance_preview_across_dst(api: Api, start: str, expected: list[datetime]) -> None:
    entry = api.add()
    spec = {k: v for k, v in ENTRY.items() if k != "note"}
    adhoc = ok(api.viewer.post(f"{URL}/preview", params={"start": start, "count": 2}, json=spec))
    stored = ok(api.viewer.get(f"{URL}/{entry['id']}/preview", params={"start": start}))
    assert stored["count"] == len(stored["results"]) == 10  # the default count
    assert stored["results"][:2] == adhoc["results"]
    for body in (adhoc, stored):
        assert (body["deployment"], body["timezone"]) == (DEPLOYMENT, BERLIN)
        assert body["lead_s"] == api.default_lead_s
        starts = [check_window(w, body["lead_s"], ENTRY["duration_s"]) for w in body["results"]]
        assert starts[:2] == expected
        assert starts == sorted(starts)
        for window in body["results"]:
            local = datetime.fromisoformat(window["start_local"])
            assert (local.hour, local.minute, local.weekday() < 5) == (9, 0, True)
            assert local.utcoffset() == ZoneInfo(BERLIN).utcoffset(local.replace(tzinfo=None))
            assert datetime.fromisoformat(window["end_local"]).hour == 18
    # The four pinned instants: serving at 09:00 local, the offset changed over the weekend.
    first, second = (datetime.fromisoformat(w["start_local"]) for w in adhoc["results"])
    assert first.strftime("%a %H:%M") == "Fri 09:00" and second.strftime("%a %H:%M") == "Mon 09:00"
    assert first.utcoffset() != second.utcoffset()
    # A time without a zone is UTC; with one, it is converted.
    naive = ok(api.viewer.get(f"{URL}/{entry['id']}/preview", params={"start": start[:-1]}))
    assert naive["results"] == stored["results"]
    berlin = utc(start).astimezone(ZoneInfo(BERLIN)).isoformat()
    shifted = ok(api.viewer.get(f"{URL}/{entry['id']}/preview", params={"start": berlin}))
    assert shifted["results"] == stored["results"]
    # A preview writes nothing.
    assert [e["kind"] for e in api.events(subject_type="schedule")] == ["schedule.created"]


def test_preview_bounds(api: Api) -> None:
    entry = api.add()
    path = f"{URL}/{entry['id']}/preview"
    assert len(ok(api.viewer.get(path, params={"count": 500}))["results"]) == 500
    for params in ({"count": 0}, {"count": 501}, {"start": "tomorrow"}):
        assert "query." in detail(api.viewer.get(path, params=params), 422)
        assert "query." in detail(api.viewer.post(f"{URL}/preview", params=params, json=ENTRY), 422)
    # From now by default: the first window is the entry's next one.
    assert ok(api.viewer.get(path, params={"count": 1}))["results"] == [
        ok(api.viewer.get(f"{URL}/{entry['id']}"))["next"]
    ]


def _starts(api: Api, cron: str, start: str, count: int, timezone: str = BERLIN) -> list[str]:
    spec = ENTRY | {"cron": cron, "timezone": timezone}
    body = ok(api.viewer.post(f"{URL}/preview", params={"start": start, "count": count}, json=spec))
    return [w["start_local"] for w in body["results"]]


def test_cron_dialect_and_dst_rules(api: Api) -> None:
    """What docs/calendar.md promises about the dialect: cron's day-of-week numbers, dom OR
    dow, the spring-forward gap, the repeated hour."""
    # 0 and 7 are Sunday; "1-5" is Monday to Friday (not APScheduler's Tuesday to Saturday).
    sundays = _starts(api, "0 9 * * 0", "2027-03-01T00:00:00Z", 2)
    assert sundays == _starts(api, "0 9 * * 7", "2027-03-01T00:00:00Z", 2)
    assert sundays == _starts(api, "0 9 * * sun", "2027-03-01T00:00:00Z", 2)
    assert [datetime.fromisoformat(s).strftime("%a %d") for s in sundays] == ["Sun 07", "Sun 14"]
    weekdays = _starts(api, "0 9 * * 1-5", "2027-03-05T12:00:00Z", 5)  # from a Friday noon
    assert [datetime.fromisoformat(s).strftime("%a") for s in weekdays] == [
        "Mon",
        "Tue",
        "Wed",
        "Thu",
        "Fri",
    ]
    # Day of month and day of week both restricted: either matches (Monday 29th, Thursday 1st).
    assert _starts(api, "0 9 1 * 1", "2027-03-27T00:00:00Z", 3) == [
        "2027-03-29T09:00:00+02:00",
        "2027-04-01T09:00:00+02:00",
        "2027-04-05T09:00:00+02:00",
    ]
    # Six fields: a leading seconds field. Macros.
    assert _starts(api, "30 0 9 * * 1-5", "2027-03-05T12:00:00Z", 1) == [
        "2027-03-08T09:00:30+01:00"
    ]
    assert _starts(api, "@weekly", "2027-03-05T12:00:00Z", 1) == ["2027-03-07T00:00:00+01:00"]
    # Spring forward (Berlin, 2027-03-28 02:00 → 03:00): 02:30 does not exist that night and
    # fires right after the jump, at 03:30 CEST; the next night is 02:30 again.
    assert _starts(api, "30 2 * * *", "2027-03-27T12:00:00Z", 2) == [
        "2027-03-28T03:30:00+02:00",
        "2027-03-29T02:30:00+02:00",
    ]
    # Fall back (2027-10-31 03:00 → 02:00): a fixed-hour 02:30 fires once, the first time.
    assert _starts(api, "30 2 * * *", "2027-10-30T12:00:00Z", 2) == [
        "2027-10-31T02:30:00+02:00",
        "2027-11-01T02:30:00+01:00",
    ]
    # A wildcard hour keeps firing through the repeated hour.
    assert _starts(api, "*/30 * * * *", "2027-10-31T00:10:00Z", 4) == [
        "2027-10-31T02:30:00+02:00",
        "2027-10-31T02:00:00+01:00",
        "2027-10-31T02:30:00+01:00",
        "2027-10-31T03:00:00+01:00",
    ]


def test_midnight_after_spring_forward_is_not_skipped(api: Api) -> None:
    """APScheduler 3.11's zone-aware CronTrigger computes the next 00:xx firing a day late from
    before the jump on a spring-forward day (agronholm/apscheduler#529): fleet/calendar/cron.py
    searches wall-clock times instead. Where the jump is at midnight (America/Santiago,
    2027-09-05 00:00 → 01:00) the gap-day firing happens right after the jump."""
    assert _starts(api, "@daily", "2027-03-27T12:00:00Z", 3) == [
        "2027-03-28T00:00:00+01:00",
        "2027-03-29T00:00:00+02:00",
        "2027-03-30T00:00:00+02:00",
    ]
    assert _starts(api, "0 0 * * 1", "2027-03-20T00:00:00Z", 3) == [
        "2027-03-22T00:00:00+01:00",
        "2027-03-29T00:00:00+02:00",
        "2027-04-05T00:00:00+02:00",
    ]
    assert _starts(api, "@daily", "2027-09-03T12:00:00Z", 3, "America/Santiago") == [
        "2027-09-04T00:00:00-04:00",
        "2027-09-05T01:00:00-03:00",
        "2027-09-06T00:00:00-03:00",
    ]


# ---------------------------------------------------------------------------------------------
# fleetctl schedule


@dataclass
class Fleetctl:
    live: Live
    token: str
    runner: CliRunner

    def __call__(self, *args: str, token: str | None = None) -> Result:
        env = {"FLEET_URL": self.live.url, "FLEET_TOKEN": token or self.token}
        return self.runner.invoke(cli.app, ["schedule", *args], env=env)

    def ok(self, *args: str) -> Result:
        result = self(*args)
        assert result.exit_code == 0, f"{args}: {result.stdout}{result.stderr}{result.exception!r}"
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "-o", "json").stdout)


@pytest.fixture
def fleetctl(api: Api) -> Fleetctl:
    return Fleetctl(api.live, api.live.token(Role.OPERATOR, name="cli"), CliRunner())


def one_line_error(result: Result, *needles: str) -> str:
    """The command failed with exit code 1 and exactly one line on stderr naming every needle."""
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def local_cell(text: str) -> str:
    """How fleetctl's tables show a local time: 'Fri 2027-03-26 09:00 +01:00'."""
    at = datetime.fromisoformat(text)
    offset = at.strftime("%z")
    return at.strftime("%a %Y-%m-%d %H:%M ") + f"{offset[:3]}:{offset[3:]}"


def table_rows(text: str) -> list[list[str]]:
    """A rich table's rows (header included), each a list of its cells."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│")[1:-1]]
        if cells and any(cells):
            rows.append(cells)
    return rows


ADD = ("add", DEPLOYMENT, "--min-replicas", "8", "--cron", WEEKDAYS_9, "--tz", BERLIN)


def test_cli_add_list_preview_rm(api: Api, fleetctl: Fleetctl) -> None:
    added = fleetctl.json(*ADD, "--for", "9h", "--note", "business hours")
    assert {k: added[k] for k in ENTRY} == ENTRY
    until = fleetctl.json(*ADD, "--until", "0 18 * * 1-5")
    assert (until["end_cron"], until["duration_s"]) == ("0 18 * * 1-5", None)
    assert until["created_by"] == "operator:cli"

    listed = fleetctl.json("list")
    assert [e["id"] for e in listed] == [added["id"], until["id"]]
    assert listed == api.entries()
    assert fleetctl.json("list", "--deployment", "llama-8b") == []
    rows = table_rows(fleetctl.ok("list").stdout)
    header, first, second = rows
    assert header == [
        "id",
        "deployment",
        "cron",
        "time zone",
        "ends",
        "min replicas",
        "state",
        "next (local)",
        "boots (local)",
        "note",
    ]
    assert first == [
        str(added["id"]),
        DEPLOYMENT,
        WEEKDAYS_9,
        BERLIN,
        "+32400 s",
        "8",
        "waiting",
        local_cell(added["next"]["start_local"]),
        local_cell(added["next"]["boot_at_local"]),
        "business hours",
    ]
    assert second[4] == "0 18 * * 1-5"

    # Preview by id and ad hoc: the acceptance, local and UTC side by side, with the lead.
    by_id = fleetctl.ok("preview", str(added["id"]), "--from", "2027-03-25T12:00:00Z", "-n", "2")
    adhoc = fleetctl.ok(
        "preview",
        "--deployment",
        DEPLOYMENT,
        "--cron",
        WEEKDAYS_9,
        "--tz",
        BERLIN,
        "--for",
        "9h",
        "--from",
        "2027-03-25T12:00:00Z",
        "--count",
        "2",
    )
    assert by_id.stdout == adhoc.stdout
    assert "Europe/Berlin: boots start 1200 s early (H100 never measured: default)" in " ".join(
        by_id.stdout.split()
    )
    assert table_rows(by_id.stdout) == [
        ["serving from (local)", "UTC", "boots (local)", "boots (UTC)", "until (local)"],
        [
            "Fri 2027-03-26 09:00 +01:00",
            "Fri 2027-03-26 08:00:00",
            "Fri 2027-03-26 08:40 +01:00",
            "Fri 2027-03-26 07:40:00",
            "Fri 2027-03-26 18:00 +01:00",
        ],
        [
            "Mon 2027-03-29 09:00 +02:00",
            "Mon 2027-03-29 07:00:00",
            "Mon 2027-03-29 08:40 +02:00",
            "Mon 2027-03-29 06:40:00",
            "Mon 2027-03-29 18:00 +02:00",
        ],
    ]
    autumn = fleetctl.json("preview", str(added["id"]), "--from", "2027-10-28T12:00:00Z", "-n", "2")
    assert [utc(w["start"]) for w in autumn["results"]] == ACCEPTANCE[1][1]
    assert autumn["lead_s"] == 1200.0 and autumn["count"] == 2
    until_spec = ("--cron", WEEKDAYS_9, "--tz", BERLIN, "--until", "0 18 * * 1-5")
    adhoc_json = fleetctl.json(*ADHOC, *until_spec, "--from", "2027-10-28T12:00:00Z", "-n", "2")
    assert [w["start"] for w in adhoc_json["results"]] == [w["start"] for w in autumn["results"]]

    # Previews wrote nothing.
    kinds = [e["kind"] for e in api.events(subject_type="schedule")]
    assert kinds == ["schedule.created", "schedule.created"]


def test_cli_rm(api: Api, fleetctl: Fleetctl) -> None:
    """FAILS (a bug in fleet/cli/ `Api.request`, met through DELETE /schedules/{id}): the 204 answer
    has no body but says `content-type: application/json`, and the client decodes it: the entry
    is removed, yet fleetctl prints "error: Expecting value: line 1 column 1 (char 0)" and
    exits 1."""
    first, second = fleetctl.json(*ADD, "--for", "9h"), fleetctl.json(*ADD, "--for", "1h")
    result = fleetctl("rm", str(first["id"]))
    assert [e["id"] for e in api.entries()] == [second["id"]]  # the service did remove it
    assert (result.exit_code, result.stderr) == (0, ""), (result.stdout, result.stderr)
    assert result.stdout == f"entry {first['id']} removed\n"
    one_line_error(fleetctl("rm", str(first["id"])), f"no calendar entry {first['id']}")
    kinds = [e["kind"] for e in api.events(subject_type="schedule")]
    assert kinds == ["schedule.deleted", "schedule.created", "schedule.created"]


def test_cli_add_table_output(api: Api, fleetctl: Fleetctl) -> None:
    """FAILS (a bug in fleet/cli/ `schedule_add`): the table output reads `next['boot_local']`, a
    key the API does not send (`boot_at_local`), so a successful add ends in a KeyError
    traceback and exit code 1 after the entry was created."""
    result = fleetctl(*ADD, "--for", "9h")
    [entry] = api.entries()  # the service did add it
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    nxt = datetime.fromisoformat(entry["next"]["start_local"])
    assert result.stdout.startswith(f"entry {entry['id']} for {DEPLOYMENT}; next serving from ")
    assert nxt.strftime("%a %Y-%m-%d 09:00") in result.stdout
    assert "(H100 never measured: default)" in result.stdout


ADHOC = ("preview", "--deployment", DEPLOYMENT)
CLI_ERRORS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("for-9x", (*ADD, "--for", "9x"), ("--for '9x'", "9h, 1h30m")),
    ("for-0", (*ADD, "--for", "0"), ("--for '0'", "positive")),
    ("no-end", ADD, ("--until CRON or --for DURATION",)),
    ("both-ends", (*ADD, "--for", "9h", "--until", "0 18 * * *"), ("--until CRON or --for",)),
    ("no-cron", ("add", DEPLOYMENT, "--min-replicas", "8", "--for", "9h"), ("--cron",)),
    ("unknown-zone", (*ADD[:-1], "Mars/Olympus", "--for", "9h"), ("time zone 'Mars/Olympus'",)),
    ("hour-25", ("add", DEPLOYMENT, "--min-replicas", "8", "--cron", "0 25 * * *", "--for", "1h"),
     ("'0 25 * * *'", "(25)")),
    ("above-max", ("add", DEPLOYMENT, "--min-replicas", "25", "--cron", WEEKDAYS_9, "--for", "1h"),
     ("max_replicas 24",)),
    ("unknown-deployment", ("add", "ghost", "--min-replicas", "1", "--cron", WEEKDAYS_9,
     "--for", "1h"), ("no deployment named 'ghost'",)),
    ("preview-nothing", ("preview", "--cron", WEEKDAYS_9, "--for", "1h"), ("entry's id",)),
    ("preview-id-and-spec", ("preview", "1", "--deployment", DEPLOYMENT), ("entry's id",)),
    ("preview-no-cron", (*ADHOC, "--for", "1h"), ("--cron",)),
    ("preview-dow-8", (*ADHOC, "--cron", "0 9 * * 8", "--for", "1h"), ("day-of-week '8'",)),
    ("preview-bad-from", (*ADHOC, "--cron", WEEKDAYS_9, "--for", "1h", "--from", "tomorrow"),
     ("query.start",)),
    ("preview-unknown-id", ("preview", "42"), ("no calendar entry 42",)),
    ("rm-unknown-id", ("rm", "42"), ("no calendar entry 42",)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needles"), [c[1:] for c in CLI_ERRORS], ids=[c[0] for c in CLI_ERRORS]
)
def test_cli_errors_are_one_line(
    api: Api, fleetctl: Fleetctl, args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    one_line_error(fleetctl(*args), *needles)
    assert api.entries() == [] and api.events(subject_type="schedule") == []


def test_cli_viewer_lists_and_previews_but_cannot_add(api: Api, fleetctl: Fleetctl) -> None:
    entry = fleetctl.json(*ADD, "--for", "9h")
    viewer = api.live.token(Role.VIEWER, name="cli-viewer")
    assert "waiting" in fleetctl("list", token=viewer).stdout
    assert fleetctl("preview", str(entry["id"]), token=viewer).exit_code == 0
    needle = "a viewer token cannot do this; it needs the operator role"
    one_line_error(fleetctl(*ADD, "--for", "9h", token=viewer), needle)
    one_line_error(fleetctl("rm", str(entry["id"]), token=viewer), needle)
    assert [e["id"] for e in api.entries()] == [entry["id"]]


def test_dates_are_what_the_issue_says() -> None:
    """The acceptance instants, from the calendar alone: 09:00 Berlin, CET then CEST."""
    tz = ZoneInfo(BERLIN)
    for day, expected in zip(
        (date(2027, 3, 26), date(2027, 3, 29), date(2027, 10, 29), date(2027, 11, 1)),
        [t for _, pair in ACCEPTANCE for t in pair],
        strict=True,
    ):
        assert datetime.combine(day, time(9, 0), tzinfo=tz).astimezone(UTC) == expected
