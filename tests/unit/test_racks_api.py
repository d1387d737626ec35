"""Racks over the API and `fleetctl racks` against a real service (uvicorn in a thread), on
SQLite and Postgres: every rack answer carries drawn power, peak, p99, the override and the cap;
`PATCH /racks/{name}` sets the budget mode and margin and refuses nonsense naming the field;
`fleetctl racks` shows it all and `fleetctl racks set` calls the PATCH.

`fleetctl racks` lives in fleet/cli/racks.py; the tests mount its app on a bare Typer app, so
they hold whatever the top-level wiring (fleet/cli/__init__.py) does with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
import typer
from factories import add_rack, add_server, add_site, feed
from live import Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from typer.testing import CliRunner, Result

from fleet.cli import racks as racks_cli
from fleet.lifecycle.states import ServerState
from fleet.models import PowerSample, Rack, Role, Server, utcnow

API = "/api/v1"
NEW_FIELDS = {
    "budget_mode",
    "budget_margin",
    "drawn_w",
    "drawn_estimated_w",
    "peak_24h_w",
    "p99_7d_w",
    "budget_override_reason",
    "budget_override_by",
    "budget_override_at",
    "gpu_cap_pct",
}


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("racks")) as server:
        yield server


@pytest.fixture
def rack(db: Engine, live: Live) -> Iterator[str]:
    """Rack r1 (a 9,200 W budget) with two serving servers: one read by its BMC at 5 kW,
    one estimated by its agent at 2.5 kW; a day of history."""
    with Session(db, expire_on_commit=False) as session:
        feeds = [feed(side, volts=230, amps=50, phase="single") for side in "AB"]
        rack = add_rack(session, add_site(session, "s1"), "r1", feeds=feeds)
        now = utcnow()
        for i, (name, watts, source) in enumerate(
            (("r1-a", 5000.0, "bmc"), ("r1-b", 2500.0, "estimate"))
        ):
            server = add_server(
                session, rack, name, ServerState.SERVING, u_position=1 + 8 * i, bmc_system_id=name
            )
            server.drawn_w, server.drawn_source, server.drawn_at = watts, source, now
            session.add(server)
        for hour, watts in enumerate([6000.0] * 23 + [8100.0]):
            session.add(
                PowerSample(
                    kind="rack",
                    subject="r1",
                    bucket_start=now - timedelta(hours=24 - hour),
                    bucket_s=3600.0,
                    max_w=watts,
                    mean_w=watts - 500,
                    samples=60,
                )
            )
        session.commit()
    yield "r1"
    live.close_clients()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json()


def refused(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    text = response.json()["detail"]
    assert isinstance(text, str) and "\n" not in text, text
    return text


# ---------------------------------------------------------------------------------------------
# The API


def test_every_rack_answer_carries_drawn_power_history_and_the_override(
    live: Live, rack: str, db: Engine
) -> None:
    viewer = live.client(live.token(Role.VIEWER, name="viewer"))
    [listed] = ok(viewer.get(f"{API}/racks"))["results"]
    one = ok(viewer.get(f"{API}/racks/{rack}"))
    assert listed == one and set(one) >= NEW_FIELDS
    assert one["budget_mode"] == "nameplate" and one["budget_margin"] == 1.15
    assert one["drawn_w"] == 7500.0 and one["drawn_estimated_w"] == 2500.0
    assert one["peak_24h_w"] == 8100.0 and one["p99_7d_w"] == 8100.0
    assert one["budget_w"] == 9200.0 and one["committed_w"] == 2 * 10200.0
    assert one["gpu_cap_pct"] is None and one["budget_override_at"] is None
    # The server view (`fleetctl servers show`) carries each server's reading and its source.
    server = ok(viewer.get(f"{API}/servers/r1-b"))
    assert (server["drawn_w"], server["drawn_source"]) == (2500.0, "estimate")
    assert server["drawn_at"] is not None
    with Session(db) as session:
        row = session.exec(select(Rack).where(Rack.name == rack)).one()
        row.gpu_cap_pct = 80.0
        row.budget_override_reason = "planned test of the B feed"
        row.budget_override_by = "admin:bob"
        row.budget_override_at = utcnow()
        session.add(row)
        session.commit()
    one = ok(viewer.get(f"{API}/racks/{rack}"))
    assert one["gpu_cap_pct"] == 80.0 and one["budget_override_by"] == "admin:bob"
    assert one["budget_override_reason"] == "planned test of the B feed"


def test_patch_sets_mode_and_margin(live: Live, rack: str) -> None:
    operator = live.client(live.token(Role.OPERATOR, name="operator"))
    edit = {"budget_mode": "measured", "budget_margin": 1.2}
    changed = ok(operator.patch(f"{API}/racks/{rack}", json=edit))
    assert (changed["budget_mode"], changed["budget_margin"]) == ("measured", 1.2)
    assert ok(operator.get(f"{API}/racks/{rack}"))["budget_mode"] == "measured"
    events = ok(operator.get(f"{API}/events", params={"kind": "rack.updated"}))["results"]
    [event] = events
    assert event["subject"] == rack and event["actor"] == "operator:operator"
    assert event["details"]["fields"] == ["budget_mode", "budget_margin"]
    # Back to nameplate, the margin kept.
    back = ok(operator.patch(f"{API}/racks/{rack}", json={"budget_mode": "nameplate"}))
    assert (back["budget_mode"], back["budget_margin"]) == ("nameplate", 1.2)
    viewer = live.client(live.token(Role.VIEWER, name="viewer"))
    assert "operator role" in refused(viewer.patch(f"{API}/racks/{rack}", json=edit), 403)
    assert "ghost" in refused(operator.patch(f"{API}/racks/ghost", json=edit), 404)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"budget_mode": "auto"}', "body.budget_mode: must be one of 'nameplate' or 'measured'"),
        ('{"budget_mode": "MEASURED"}', "body.budget_mode: must be one of"),
        ('{"budget_mode": 5}', "body.budget_mode: must be one of"),
        ('{"budget_margin": "1.2"}', "body.budget_margin: must be a number"),
        ('{"budget_margin": NaN}', "body.budget_margin: must be a finite number"),
        ('{"budget_margin": Infinity}', "body.budget_margin: must be a finite number"),
        ('{"budget_margin": 0.5}', "body.budget_margin: must be ≥ 1.0"),
        ('{"budget_margin": 5}', "body.budget_margin: must be ≤ 2.0"),
        ('{"budget_margin": true}', "body.budget_margin: must be a number"),
        ('{"budget_margin": null}', "budget_margin: must not be null"),
        ('{"budget_w": 50000}', "body.budget_w: unknown field"),
    ],
)
def test_patch_refuses_nonsense_naming_the_field(
    live: Live, rack: str, body: str, message: str
) -> None:
    operator = live.client(live.token(Role.OPERATOR, name="operator"))
    headers = {"Content-Type": "application/json"}
    answer = operator.patch(f"{API}/racks/{rack}", content=body, headers=headers)
    assert message in refused(answer, 422)
    shown = ok(operator.get(f"{API}/racks/{rack}"))
    assert (shown["budget_mode"], shown["budget_margin"]) == ("nameplate", 1.15)  # unchanged


# ---------------------------------------------------------------------------------------------
# fleetctl racks


def fleetctl(live: Live, *args: str) -> Result:
    app = typer.Typer()
    app.add_typer(racks_cli.racks_app, name="racks")
    env = {"FLEET_URL": live.url, "FLEET_TOKEN": live.token(Role.OPERATOR, name="cli")}
    return CliRunner().invoke(app, list(args), env=env)


def table(text: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│")[1:-1]]
        if cells and cells[0]:
            rows[cells[0]] = cells
    return rows


def test_fleetctl_racks_shows_drawn_power_marks_estimates_and_the_override(
    live: Live, rack: str, db: Engine
) -> None:
    shown = fleetctl(live, "racks")
    assert shown.exit_code == 0, shown.stdout + shown.stderr
    rows = table(shown.stdout)
    assert rows["rack"] == [header for _, header in racks_cli.RACK_COLUMNS]
    columns = dict(zip(rows["rack"], rows[rack], strict=True))
    assert columns["mode"] == "nameplate"
    assert columns["budget W"] == "9,200" and columns["committed W"] == "20,400"
    assert columns["drawn W"] == "~7,500"  # part of it is the agent's estimate
    assert columns["peak 24h W"] == "8,100" and columns["p99 7d W"] == "8,100"
    assert columns["GPU cap"] == "-"
    assert "~: part of the drawn power is an agent-based estimate" in shown.stdout
    assert "budget override" not in shown.stdout

    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == "r1-b")).one()
        server.drawn_source = "bmc"  # now every watt is a BMC's reading
        row = session.exec(select(Rack).where(Rack.name == rack)).one()
        row.gpu_cap_pct = 70.0
        row.budget_override_reason = "feed B maintenance"
        row.budget_override_by = "admin:bob"
        row.budget_override_at = utcnow()
        session.add_all([server, row])
        session.commit()
    shown = fleetctl(live, "racks", "--site", "s1")
    assert shown.exit_code == 0, shown.stdout + shown.stderr
    columns = dict(zip(table(shown.stdout)["rack"], table(shown.stdout)[rack], strict=True))
    assert columns["drawn W"] == "7,500" and columns["GPU cap"] == "70 % TDP"
    [override] = [line for line in shown.stdout.splitlines() if "budget override" in line]
    assert override.startswith("r1: budget override by admin:bob since ")
    assert override.endswith(": feed B maintenance")
    assert "~:" not in shown.stdout

    as_json = fleetctl(live, "racks", "-o", "json")
    assert as_json.exit_code == 0, as_json.stderr
    [row_json] = json.loads(as_json.stdout)
    assert set(row_json) >= NEW_FIELDS and row_json["drawn_w"] == 7500.0


def test_fleetctl_racks_set_changes_the_mode(live: Live, rack: str) -> None:
    done = fleetctl(live, "racks", "set", rack, "--mode", "measured", "--margin", "1.2")
    assert done.exit_code == 0, done.stdout + done.stderr
    columns = dict(zip(table(done.stdout)["rack"], table(done.stdout)[rack], strict=True))
    assert columns["mode"] == "measured ×1.2"
    again = fleetctl(live, "racks", "set", rack, "--margin", "1.5")
    assert again.exit_code == 0, again.stderr
    assert "measured ×1.5" in again.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--mode", "auto"), "budget_mode: must be one of 'nameplate' or 'measured'"),
        (("--margin", "5"), "budget_margin: must be ≤ 2.0"),
        (("--margin", "0.5"), "budget_margin: must be ≥ 1.0"),
        (("--margin", "nan"), "margin: must be a finite number"),
        ((), "nothing to set: give --mode and/or --margin"),
    ],
)
def test_fleetctl_racks_set_refuses_in_one_line(
    live: Live, rack: str, args: tuple[str, ...], needle: str
) -> None:
    result = fleetctl(live, "racks", "set", rack, *args)
    assert result.exit_code != 0 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and needle in line, line


def test_fleetctl_racks_set_names_an_unknown_rack(live: Live, rack: str) -> None:
    result = fleetctl(live, "racks", "set", "ghost", "--mode", "measured")
    assert result.exit_code != 0
    [line] = result.stderr.splitlines()
    assert "no rack named 'ghost'" in line
