"""The web console in a real browser: Debian's chromium, headless, driven by Playwright (no
browser download), against a running fleet (`fleetctl serve`) with a live virtual colo (IPMI
emulators, agents with stand-in engines).

- sign-in through the form; the racks page's figures are `fleetctl racks`'s;
- a spare booted through the lab changes colour on the racks page without a reload;
- a serving server's page shows each GPU's readings from its agent's heartbeats; an operator
  drains it from there, and the event shows in the live feed;
- a viewer sees no action control, and a form posted without the session's CSRF value is refused;
- a rack whose committed power passed its budget (an admin's override) is marked, and marked
  again once its server's agent reports a draw past the high-water mark;
- every page passes axe-core (vendored: tests/vendor/) with no critical violation;
- the racks page's weight and time to content, for this fleet, the demo inventory and a generated
  10,000-server one; screenshots of the main pages (FLEET_CONSOLE_SHOTS=DIR keeps them: the ones
  in docs/console/ were taken so).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from colo_world import World, colo_world
from factories import TEST_SECRET_KEY
from live import make_token, serve
from playwright import sync_api as playwright
from repo_paths import ROOT
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet.crypto import SecretBox
from fleet.data import DEMO_INVENTORY
from fleet.db import make_engine
from fleet.inventory.apply import import_inventory
from fleet.inventory.schema import InventoryFile, parse_inventory
from fleet.lab.harness import FAST_AGENT_SETTINGS, FAST_SERVICE_SETTINGS, SERVING_SETTINGS
from fleet.lab.harness import wait_for as _wait_for
from fleet.models import Role

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
for tool in ("ipmi_sim", "ipmitool"):
    if shutil.which(tool) is None or not Path(CHROMIUM).exists():
        if os.environ.get("CI") == "true":
            pytest.fail("ipmi_sim, ipmitool and chromium are required in CI", pytrace=False)
        pytest.skip("needs ipmi_sim, ipmitool and chromium (Debian)", allow_module_level=True)

AXE = ROOT / "tests" / "vendor" / "axe.min.js"
SITE = "cb"
RACK, HOT_RACK = "cb-r01", "cb-r02"
SERVERS = tuple(f"{RACK}-{i}" for i in range(1, 4))
HOT_SERVER = f"{HOT_RACK}-1"
DEPLOYMENT = "chat"
SETTINGS = FAST_SERVICE_SETTINGS | SERVING_SETTINGS
AGENT_ENV = FAST_AGENT_SETTINGS | {"FLEET_STANDIN_MODEL": "llama-3.1-8b"}


def inventory() -> str:
    def server(name: str, u: int, idle_w: int = 700) -> dict[str, Any]:
        return {
            "name": name,
            "u": u,
            "u_height": 2,
            "gpu": {"model": "L40S", "count": 2},
            "power": {"idle_w": idle_w, "standby_w": 60, "max_w": 1500},
            "bmc": {
                "protocol": "ipmi",
                "address": "10.0.0.1",
                "port": 623,
                "username": "root",
                "password": "not-used-by-the-lab",
            },
        }

    big = [
        {"name": f"{s.lower()}1", "side": s, "volts": 415, "amps": 63, "phase": "three"}
        for s in "AB"
    ]
    # 230 V × 6 A × 80 %: 1,104 W, less than one server at full power; its server idles at
    # 1,100 W (a hungry chassis), so once on it draws past the 90 % mark as well.
    tiny = [{"name": "a1", "side": "A", "volts": 230, "amps": 6, "phase": "single"}]
    racks = [
        {
            "name": RACK,
            "feeds": big,
            "servers": [server(n, 1 + 2 * i) for i, n in enumerate(SERVERS)],
        },
        {"name": HOT_RACK, "feeds": tiny, "servers": [server(HOT_SERVER, 1, idle_w=1_100)]},
    ]
    return yaml.safe_dump({"sites": [{"name": SITE, "racks": racks}]}, sort_keys=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("console")
    with colo_world(base, inventory(), SETTINGS, boot_delay_s=0.5, agent_env=AGENT_ENV) as w:
        yield w


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def token(world: World, role: str) -> str:
    """A new token of `role`, stored as `fleetctl token create` stores it."""
    engine = make_engine(f"sqlite:///{world.database}")
    try:
        return make_token(engine, Role(role), name=f"console-{role}")
    finally:
        engine.dispose()


def signed_in(chromium: Any, url: str, secret: str, **context: Any) -> Any:
    page = chromium.new_context(**context).new_page()
    page.goto(f"{url}/ui/login")
    page.fill("#token", secret)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/ui/racks")
    return page


def shots() -> Path:
    where = os.environ.get("FLEET_CONSOLE_SHOTS")
    path = Path(where) if where else Path(tempfile.gettempdir()) / "fleet-console-shots"
    path.mkdir(parents=True, exist_ok=True)
    return path


def no_critical_violations(chromium: Any, url: str, secret: str, paths: list[str]) -> None:
    """axe-core in each page (its script injected past the console's CSP, in a context of its
    own): no violation of critical impact."""
    page = signed_in(chromium, url, secret, bypass_csp=True)
    for path in paths:
        page.goto(f"{url}{path}")
        page.add_script_tag(path=str(AXE))
        result = page.evaluate("async () => await axe.run(document)")
        critical = [
            (v["id"], v["help"], [n["target"] for n in v["nodes"]][:3])
            for v in result["violations"]
            if v["impact"] == "critical"
        ]
        assert not critical, f"{path}: {critical}"
    page.context.close()


wait_for = _wait_for


def test_the_racks_page_matches_fleetctl_racks(world: World, chromium: Any) -> None:
    page = signed_in(chromium, world.service.url, token(world, "viewer"))
    shown = world.fleetctl("racks", "-o", "json")
    assert shown.exit_code == 0, shown.stdout
    racks = {r["name"]: r for r in json.loads(shown.stdout)}
    assert {c.get_attribute("data-rack") for c in page.query_selector_all("article.rack")} == set(
        racks
    )
    for name, rack in racks.items():
        card = page.locator(f"article[data-rack='{name}']")
        for field in ("budget_w", "committed_w", "headroom_w"):
            text = card.locator(f"dd[data-field='{field}']").inner_text()
            assert text == f"{rack[field]:,.0f} W", (name, field, text, rack[field])
        # Drawn power moves with every reading: the same figure within what a few seconds
        # between the two reads may change (none at all when neither has a reading).
        drawn = card.locator("dd[data-field='drawn_w']").inner_text()
        if rack["drawn_w"] is None:
            assert drawn == "–", (name, drawn)
        else:
            shown_w = float(drawn.removesuffix(" W").replace(",", ""))
            assert abs(shown_w - rack["drawn_w"]) <= max(0.1 * rack["drawn_w"], 100), drawn
    page.screenshot(path=str(shots() / "racks.png"), full_page=True)
    page.context.close()


def test_a_spare_booted_through_the_lab_changes_colour_without_a_reload(
    world: World, chromium: Any
) -> None:
    page = signed_in(chromium, world.service.url, token(world, "operator"))
    box = page.locator(f"li[data-server='{SERVERS[0]}']")
    assert "spare" in (box.get_attribute("class") or "")
    page.evaluate("window.__notReloaded = true")
    world.api(
        "POST",
        "/deployments",
        json={
            "name": DEPLOYMENT,
            "model_uri": "s3://models/llama-3.1-8b",
            "model_checksum": "sha256:1",
            "engine_params": {"backend": "pytorch", "tp_size": 2, "max_batch_size": 8},
            "gpus_per_replica": 2,
            "gpu_models": ["L40S"],
            "min_replicas": 1,
            "max_replicas": 1,
            "sla_p95_latency_ms": 3_600_000,
            "sla_ttft_ms": 3_600_000,
        },
    )
    started = time.monotonic()

    def changed() -> bool:
        classes = page.locator("li.box[data-server]").evaluate_all(
            "els => els.map(e => e.dataset.server + ' ' + e.className)"
        )
        return any("starting" in c or "serving" in c for c in classes)

    wait_for("a box turns from spare to starting or serving", changed, 30, why=world.why)
    took = time.monotonic() - started
    assert page.evaluate("window.__notReloaded") is True  # the same page: no reload
    assert took < 30
    page.context.close()


def serving_server(world: World) -> str:
    wait_for(
        "a server serving the deployment",
        lambda: "serving" in world.states().values(),
        90,
        why=world.why,
    )
    return next(n for n, s in world.states().items() if s == "serving")


def test_an_operator_drains_from_the_server_page_and_the_feed_shows_it(
    world: World, chromium: Any
) -> None:
    name = serving_server(world)
    secret = token(world, "operator")
    feed = signed_in(chromium, world.service.url, secret)
    feed.goto(f"{world.service.url}/ui/events")
    feed.wait_for_selector("#feed")
    time.sleep(1.5)  # the stream is open
    page = feed.context.new_page()
    page.goto(f"{world.service.url}/ui/servers/{name}")
    # Its agent's readings (simulated telemetry, through real heartbeats), GPU by GPU.
    for gpu in range(2):
        cells = page.locator(f"tr[data-gpu='{gpu}'] td.num").all_inner_texts()
        assert cells and " °C" in cells[0] and " W" in cells[1], cells
    page.screenshot(path=str(shots() / "server.png"), full_page=True)
    page.select_option("#action", "drain")
    page.fill("#reason", "console e2e: fans loud")
    page.check("input[name=confirm]")
    page.click("form.action button[type=submit]")
    page.wait_for_url(f"**/ui/servers/{name}?said=*")
    assert "Drain: done" in page.inner_text("p.said")
    feed.locator("#feed tr", has_text="console e2e: fans loud").first.wait_for(timeout=10_000)
    feed.screenshot(path=str(shots() / "events.png"), full_page=True)
    deployments = feed.context.new_page()
    deployments.goto(f"{world.service.url}/ui/deployments")
    deployments.screenshot(path=str(shots() / "deployments.png"), full_page=True)
    feed.context.close()


def test_a_viewer_sees_no_action_and_a_forged_post_is_refused(world: World, chromium: Any) -> None:
    page = signed_in(chromium, world.service.url, token(world, "viewer"))
    page.goto(f"{world.service.url}/ui/servers/{SERVERS[1]}")
    assert page.locator("form.action").count() == 0
    assert page.locator("select#action").count() == 0
    page.goto(f"{world.service.url}/ui/deployments")
    assert page.locator("form.action").count() == 0
    # A page of another origin posting a form: no SameSite=Strict cookie goes with it, and
    # without the session's CSRF value nothing is done even from this origin.
    forged = page.request.post(
        f"{world.service.url}/ui/servers/{SERVERS[1]}/action",
        form={"action": "maintenance", "reason": "x", "confirm": "yes"},
    )
    assert forged.status == 403
    assert world.states()[SERVERS[1]] != "maintenance"
    page.context.close()


def test_a_rack_past_its_budget_is_marked(world: World, chromium: Any) -> None:
    refused = world.api.request("POST", f"/servers/{HOT_SERVER}/power", json={"action": "on"})
    assert refused.status_code == 200 and refused.json()["ok"] is False  # the gate says no
    world.api(
        "POST",
        f"/servers/{HOT_SERVER}/power",
        json={"action": "on", "override_budget": True, "reason": "console e2e: over budget"},
    )
    page = signed_in(chromium, world.service.url, token(world, "viewer"))
    card = page.locator(f"article[data-rack='{HOT_RACK}']")
    card.locator(".badge.hot", has_text="committed past its budget").wait_for(timeout=10_000)
    assert "hot" in (card.get_attribute("class") or "")
    # Its agent's heartbeats put its draw (the estimate: GPU power plus the chassis) past the
    # high-water mark too: the open page says so without a reload.
    card.locator(".badge.hot", has_text="drawing").wait_for(timeout=30_000)
    racks = json.loads(world.fleetctl("racks", "-o", "json").stdout)
    [hot] = [r for r in racks if r["name"] == HOT_RACK]
    assert hot["drawn_w"] >= 0.9 * hot["budget_w"]
    assert "hot" in (card.locator("rect.drawn").get_attribute("class") or "")
    assert "hot" not in (page.locator(f"article[data-rack='{RACK}']").get_attribute("class") or "")
    page.goto(f"{world.service.url}/ui/racks/{HOT_RACK}")
    page.screenshot(path=str(shots() / "rack.png"), full_page=True)
    page.context.close()


def test_every_page_passes_axe_core(world: World, chromium: Any) -> None:
    secret = token(world, "operator")
    paths = [
        "/ui/racks",
        f"/ui/racks/{RACK}",
        "/ui/servers",
        f"/ui/servers/{SERVERS[0]}",
        "/ui/deployments",
        "/ui/events",
    ]
    no_critical_violations(chromium, world.service.url, secret, paths)
    # And the sign-in page, before any session.
    page = chromium.new_context(bypass_csp=True).new_page()
    page.goto(f"{world.service.url}/ui/login")
    page.add_script_tag(path=str(AXE))
    result = page.evaluate("async () => await axe.run(document)")
    assert not [v["id"] for v in result["violations"] if v["impact"] == "critical"]
    page.screenshot(path=str(shots() / "login.png"))
    page.context.close()


# ---------------------------------------------------------------------------------------------
# page weight and time: the demo inventory and 10,000 servers (no lab: the pages only read)


def page_figures(chromium: Any, url: str, secret: str, path: str) -> dict[str, float]:
    """Time to content (navigation start → the first rack card drawn) and bytes transferred
    (the document, its script and style), the mean of 3 loads after a warm-up."""
    page = signed_in(chromium, url, secret)
    sizes: dict[str, int] = {}
    page.on("response", lambda r: sizes.__setitem__(r.url, len(r.body())))
    times = []
    for _ in range(4):
        sizes.clear()
        page.goto(f"{url}{path}", wait_until="domcontentloaded")
        page.wait_for_selector("article.rack")
        took = page.evaluate(
            "performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd"
        )
        times.append(float(took))
    page.context.close()
    return {"ms": sum(times[1:]) / 3, "bytes": float(sum(sizes.values()))}


def generated(servers: int) -> InventoryFile:
    spec = importlib.util.spec_from_file_location(
        "gen_inventory", ROOT / "bench" / "gen_inventory.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_inventory"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return InventoryFile.model_validate(module.generate(servers, seed=0))


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
@pytest.mark.parametrize("which", ["demo", "10000"])
def test_the_racks_page_weight_and_time(
    which: str, db: Engine, chromium: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = parse_inventory(DEMO_INVENTORY.read_text()) if which == "demo" else generated(10_000)
    with Session(db) as session:
        import_inventory(session, inv, SecretBox(TEST_SECRET_KEY), "test")
        session.commit()
    with serve(db, tmp_path) as live:
        secret = live.token(Role.VIEWER, name="weigh")
        figures = page_figures(chromium, live.url, secret, "/ui/racks")
        first = sorted(r.name for s in inv.sites for r in s.racks)[0]
        rack = page_figures(chromium, live.url, secret, f"/ui/racks/{first}")
        page = signed_in(chromium, live.url, secret)
        page.goto(f"{live.url}/ui/servers")
        rows = page.locator("table.list tbody tr").count()
        page.context.close()
    assert rows == 50  # one page of the list, whatever the fleet's size
    with capsys.disabled():
        print(
            f"\nconsole racks page, {which}: time to content {figures['ms']:.0f} ms, "
            f"{figures['bytes'] / 1024:.0f} KiB; one rack's page {rack['ms']:.0f} ms, "
            f"{rack['bytes'] / 1024:.0f} KiB"
        )
