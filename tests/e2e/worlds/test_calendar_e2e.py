"""The scheduled-scaling calendar end to end, with real `fleetctl serve` processes whose
calendar ticks every CALENDAR_TICK_S (entries are 6-field crons: to the second, in UTC).

1. Once only, on Postgres: two services on one throwaway database. An entry's window fires
   exactly once (one `schedule.fired` Event, one ScalingDecision of rule "calendar") and sets
   its deployment's floor. The leader is SIGKILLed mid-window, the other takes over, the killed
   one comes back as a follower: still one firing, the floor still holds. Then an outage: both
   services die before two new entries' fire times; one starts again after the first entry's
   start has passed (its window still open) and the second's whole window has closed: the
   first fires once, late (its decision says so), and the second is `schedule.missed`.

2. Serving by T, in the virtual colo (the service on its embedded SQLite, two 2 × L40S IPMI
   servers, agents with stand-in engines, a lab boot delay of BOOT_DELAY_S). Both spares' boots
   are measured first (their p90 becomes the entry's lead P) and they return to the warm pool;
   then an entry at T: a spare's boot (its transition to booting) starts in
   [T − P − tick, T − P] and it serves by T (give or take the lab's jitter, LAB_JITTER_S).

`pytest -s` prints the figures.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from colo_world import (
    Api,
    World,
    colo_world,
    ipmi_inventory,
    parse_at,
    utc,
)
from factories import TEST_SECRET_KEY
from pg import migrated_database
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet import db
from fleet.auth import create_token
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    SERVING_SETTINGS,
    LoopMetrics,
    ServeProcess,
    wait_for,
)
from fleet.models import Deployment, Role, ScheduleEntry

CALENDAR_TICK_S = 0.5
# Scheduling noise on a loaded 2-core machine: a tick may start this late (and a boot's two
# clocks, the test's and the service's, are the same host's).
SLACK_S = 1.0
GPUS_PER_SERVER = 2


def cron_at(epoch: float) -> str:
    """A 6-field cron firing daily at that UTC second."""
    at = utc(epoch)
    return f"{at.second} {at.minute} {at.hour} * * *"


def deployment_body(name: str, *, max_replicas: int) -> dict[str, Any]:
    """Llama-3.1-70B on L40S, a replica on 2 GPUs, min_replicas 0: only the calendar raises
    it. SLAs of an hour: no signal ever scales anything here."""
    return {
        "name": name,
        "model_uri": "s3://models/llama-3.1-70b",
        "model_checksum": "sha256:1",
        "engine_params": {"backend": "pytorch", "tp_size": GPUS_PER_SERVER},
        "gpus_per_replica": GPUS_PER_SERVER,
        "gpu_models": ["L40S"],
        "min_replicas": 0,
        "max_replicas": max_replicas,
        "sla_p95_latency_ms": 3_600_000,
        "sla_ttft_ms": 3_600_000,
    }


def add_entry(api: Api, deployment: str, start: float, min_replicas: int, duration_s: int) -> int:
    body = {
        "deployment": deployment,
        "cron": cron_at(start),
        "timezone": "UTC",
        "min_replicas": min_replicas,
        "duration_s": duration_s,
        "note": "calendar e2e",
    }
    row = api("POST", "/schedules", json=body)
    assert parse_at(row["next"]["start"]) == start, row
    return int(row["id"])


def next_second(after_s: float) -> float:
    """A whole UTC second at least `after_s` from now."""
    return float(math.ceil(time.time() + after_s))


def fired(api: Api, entry: int) -> list[dict[str, Any]]:
    return api.events(subject_type="schedule", subject=str(entry), kind="schedule.fired")


def calendar_decisions(api: Api, deployment: str, entry: int) -> list[dict[str, Any]]:
    return [d for d in api.decisions(deployment, "calendar") if d["inputs"]["entry"] == entry]


# ---------------------------------------------------------------------------------------------
# 1. Two services on Postgres: once only, across a failover, a restart and an outage

DEPLOYMENT_A, DEPLOYMENT_B = "cal-a", "cal-b"
ESTIMATE_S = 1.0  # FLEET_BOOT_ESTIMATE_S: no server here, so every lead is this default


@pytest.fixture
def calendar_pg(pg_url: str) -> Iterator[Engine]:
    """A migrated throwaway database of this test's own (leadership is per database)."""
    with migrated_database("fleet_calendar", pg_url) as engine:
        yield engine


def pg_settings(engine: Engine) -> dict[str, str]:
    return {
        "FLEET_DATABASE_URL": engine.url.render_as_string(hide_password=False),
        "FLEET_SECRET_KEY": TEST_SECRET_KEY.decode(),
        "FLEET_RUN_LOOPS": "true",
        "FLEET_CALENDAR_INTERVAL_S": str(CALENDAR_TICK_S),
        "FLEET_BOOT_ESTIMATE_S": str(ESTIMATE_S),
        # A SIGKILLed leader's lock goes with its connection: the other leads a tick later.
        "FLEET_LEADER_LEASE_S": "1",
        "FLEET_RECONCILE_INTERVAL_S": "1",
        "FLEET_PROVISION_INTERVAL_S": "1",
        "FLEET_AUTOSCALE_INTERVAL_S": "1",
        "FLEET_LOG_LEVEL": "INFO",
    }


def calendar_leader(services: list[ServeProcess]) -> ServeProcess:
    """The one running service that leads the calendar loop (and has ticked); never two."""

    def probe() -> ServeProcess | None:
        running = [s for s in services if s.running]
        sample = [(s, s.metrics("calendar")) for s in running]
        leading = [s for s, m in sample if m is not None and m.leader]
        assert len(leading) <= 1, f"two calendar leaders: {sample}"
        ticked = [s for s, m in sample if m is not None and m.leader and m.ticks > 0]
        return ticked[0] if ticked else None

    return wait_for(
        "one calendar leader", probe, 30, why=lambda: "\n".join(s.tail() for s in services)
    )


def deployment_row(engine: Engine, name: str) -> Deployment:
    with Session(engine) as session:
        return session.exec(select(Deployment).where(Deployment.name == name)).one()


def entry_row(engine: Engine, entry: int) -> ScheduleEntry:
    with Session(engine) as session:
        row = session.get(ScheduleEntry, entry)
        assert row is not None
        return row


def test_two_services_fire_a_window_once_across_failover_restart_and_outage(
    calendar_pg: Engine, tmp_path: Path
) -> None:
    settings = pg_settings(calendar_pg)
    one = ServeProcess("one", tmp_path / "one", settings)
    two = ServeProcess("two", tmp_path / "two", settings)
    services = [one, two]

    def logs() -> str:
        return "\n".join(s.tail() for s in services)

    with db.session_scope(calendar_pg) as session:
        token = create_token(session, "calendar-e2e", Role.ADMIN, actor="tests")
    try:
        for service in services:
            service.spawn()
        for service in services:
            wait_for(f"{service.name} ready", service.ready, 60, why=service.tail)
        api = Api(one.url, token)
        leader = calendar_leader(services)
        [follower] = [s for s in services if s is not leader]
        for name in (DEPLOYMENT_A, DEPLOYMENT_B):
            api("POST", "/deployments", json=deployment_body(name, max_replicas=4))

        # -- The window fires once, one lead before T, and sets the floor.
        t1 = next_second(5)
        entry1 = add_entry(api, DEPLOYMENT_A, t1, min_replicas=2, duration_s=60)
        shown = api("GET", f"/schedules/{entry1}")
        assert shown["lead_s"] == ESTIMATE_S and "never measured" in shown["lead_basis"], shown
        assert parse_at(shown["next"]["boot_at"]) == t1 - ESTIMATE_S, shown
        [event] = wait_for(
            "entry 1 to fire", lambda: fired(api, entry1), t1 - time.time() + 5, why=logs
        )
        at = parse_at(event["at"])
        print(
            f"\nentry 1: T = {utc(t1):%H:%M:%S}, fired at T {at - t1:+.2f} s"
            f" (lead {ESTIMATE_S:g} s)"
        )
        assert t1 - ESTIMATE_S - CALENDAR_TICK_S <= at <= t1 - ESTIMATE_S + SLACK_S, at - t1
        [decision] = calendar_decisions(api, DEPLOYMENT_A, entry1)
        assert (decision["target_before"], decision["target_after"]) == (0, 1), decision
        inputs = decision["inputs"]
        assert inputs["lead_s"] == ESTIMATE_S and parse_at(inputs["window_start"]) == t1, inputs
        assert parse_at(inputs["window_end"]) == t1 + 60, inputs
        assert inputs["late_s"] <= CALENDAR_TICK_S + SLACK_S, inputs
        print(f"  decision: {decision['reason']}")
        # 8 GPUs per server assumed (no server yet): 4 replicas a server, a floor of one.
        row = deployment_row(calendar_pg, DEPLOYMENT_A)
        assert (row.floor_servers, row.target_servers) == (1, 1), row

        # -- SIGKILL the leader mid-window: the other takes over, the killed one comes back.
        killed_at = time.monotonic()
        leader.kill()
        assert calendar_leader(services) is follower
        print(f"  {follower.name} leads {time.monotonic() - killed_at:.2f} s after the SIGKILL")
        leader.start()
        after_restart = follower.metrics("calendar")
        assert after_restart is not None
        # Several of the new leader's ticks with the restarted one following.
        wait_for(
            "six more calendar ticks",
            lambda: (m := follower.metrics("calendar")) and m.ticks >= after_restart.ticks + 6,
            10,
            why=logs,
        )
        assert leader.metrics("calendar") == LoopMetrics(leader=False, ticks=0)
        assert time.time() < t1 + 60, "the failover outlasted the window: lengthen it"
        assert len(fired(api, entry1)) == 1
        assert len(calendar_decisions(api, DEPLOYMENT_A, entry1)) == 1
        row = deployment_row(calendar_pg, DEPLOYMENT_A)
        assert row.floor_servers == 1 and row.target_servers >= 1, row
        assert api("GET", f"/schedules/{entry1}")["active"] is True

        # -- An outage: both die before entries 2 and 3 fire. Entry 2's start passes while
        # none runs (its window still open at the restart); entry 3's whole window closes.
        t2 = next_second(5)
        entry2 = add_entry(api, DEPLOYMENT_B, t2, min_replicas=2, duration_s=60)
        entry3 = add_entry(api, DEPLOYMENT_B, t2, min_replicas=4, duration_s=2)
        for service in services:
            service.kill()
        down_at = time.time()
        assert down_at < t2 - ESTIMATE_S - CALENDAR_TICK_S, "too slow to stop before the firing"
        for entry in (entry2, entry3):
            assert entry_row(calendar_pg, entry).fired_for is None
        time.sleep(max(0.0, t2 + 3 - time.time()))  # entry 3's window [t2, t2 + 2] is over
        restart_at = time.time()
        one.start()
        print(f"  outage: {restart_at - down_at:.1f} s (entries 2 and 3 at T = {utc(t2):%H:%M:%S})")

        [late] = wait_for("entry 2 to fire, late", lambda: fired(api, entry2), 15, why=one.tail)
        assert parse_at(late["at"]) >= restart_at  # after the outage, not before it
        [decision] = calendar_decisions(api, DEPLOYMENT_B, entry2)
        late_s = decision["inputs"]["late_s"]
        print(f"  entry 2 fired {parse_at(late['at']) - t2:+.1f} s after T: {decision['reason']}")
        # Late by the outage: from the window's fire time (T − the restart's lead) on.
        assert late_s >= restart_at - (t2 - ESTIMATE_S), decision
        assert " late" in decision["reason"], decision["reason"]
        assert (decision["target_before"], decision["target_after"]) == (0, 1), decision

        [missed] = wait_for(
            "entry 3's schedule.missed",
            lambda: api.events(
                subject_type="schedule", subject=str(entry3), kind="schedule.missed"
            ),
            5,
            why=one.tail,
        )
        print(f"  entry 3: {missed['message']}")
        assert parse_at(missed["details"]["window_start"]) == t2, missed
        shown3 = api("GET", f"/schedules/{entry3}")
        assert parse_at(shown3["last_window_start"]) == t2 and shown3["last_fired_at"] is None

        # A few ticks more: nothing fires twice, entry 3 never fires, the floors hold.
        ticks = one.metrics("calendar")
        assert ticks is not None and ticks.leader
        wait_for(
            "six more calendar ticks",
            lambda: (m := one.metrics("calendar")) and m.ticks >= ticks.ticks + 6,
            10,
        )
        assert [len(fired(api, e)) for e in (entry1, entry2, entry3)] == [1, 1, 0]
        assert calendar_decisions(api, DEPLOYMENT_B, entry3) == []
        assert len(calendar_decisions(api, DEPLOYMENT_A, entry1)) == 1
        assert time.time() < t2 + 60, "the catch-up outlasted entry 2's window: lengthen it"
        for name in (DEPLOYMENT_A, DEPLOYMENT_B):
            row = deployment_row(calendar_pg, name)
            assert row.floor_servers == 1 and row.target_servers >= 1, row
    finally:
        for service in services:
            service.kill()


# ---------------------------------------------------------------------------------------------
# 2. The virtual colo: the boot starts one lead before T and the capacity serves by T

SITE, RACK = "cal", "cal-r01"
SERVERS = (f"{RACK}-l40s-1", f"{RACK}-l40s-2")
DEPLOYMENT = "cal-colo"
# The lab boots a powered-on server in BOOT_DELAY_S (then its agent starts): the longest part
# of a boot, so that boot to serving takes about the same time each time.
BOOT_DELAY_S = 4.0
# The harness's fast loops and agents, with this test's calendar tick and a provisioner tick of
# 0.2 s (the lead's precision).
COLO_SETTINGS = (
    FAST_SERVICE_SETTINGS
    | SERVING_SETTINGS
    | {"FLEET_CALENDAR_INTERVAL_S": str(CALENDAR_TICK_S), "FLEET_PROVISION_INTERVAL_S": "0.2"}
)
AGENT_ENV = FAST_AGENT_SETTINGS | {"FLEET_STANDIN_MODEL": "llama-3.1-70b"}
SERVE_TIMEOUT_S = 60.0  # a spare from warm to serving, on a busy 2-core machine
# A lab boot lasts its p90 give or take a few tenths of a second (provisioner ticks of 0.2 s,
# Python start-up of the agent and the engine): the boot starts up to a tick before T − P, and
# the capacity serves by T give or take that much.
LAB_JITTER_S = 0.5


@pytest.fixture
def colo(tmp_path: Path) -> Iterator[World]:
    if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
        pytest.skip("ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)")
    inventory = ipmi_inventory(SITE, RACK, SERVERS, "L40S", GPUS_PER_SERVER)
    with colo_world(
        tmp_path, inventory, COLO_SETTINGS, boot_delay_s=BOOT_DELAY_S, agent_env=AGENT_ENV
    ) as world:
        yield world


def transitions(world: World, to_state: str, since: float) -> dict[str, float]:
    """Per server: when it last moved to `to_state` at or after `since` (epoch seconds)."""
    rows = world.api.events(
        subject_type="server", kind="server.transition", since=utc(since).isoformat()
    )
    return {r["subject"]: parse_at(r["at"]) for r in rows if r["to_state"] == to_state}


def test_the_colo_boots_one_lead_before_the_window_and_serves_by_its_start(
    colo: World,
) -> None:
    world = colo
    world.api("POST", "/deployments", json=deployment_body(DEPLOYMENT, max_replicas=2))

    # -- Measure boots: the operator boots both spares (target 0 → 2); each records its
    # boot-to-ready time, and the lead is their p90 (of two: the slower).
    measured_from = time.time() - 1
    booted = world.fleetctl(
        *("spares", "boot", "--deployment", DEPLOYMENT, "--count", "2", "--wait", "0"),
        *("-o", "json"),
    )
    assert booted.exit_code == 0, booted.stdout + booted.stderr
    assert sorted(r["server"] for r in json.loads(booted.stdout)) == sorted(SERVERS)
    wait_for(
        "both spares serving",
        lambda: set(world.states().values()) == {"serving"},
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    boots = {s["name"]: s["boot_to_ready_s"] for s in world.servers()}
    print(f"\nmeasured boot to ready: {boots}")
    assert all(boots.values()), boots
    assert transitions(world, "booting", measured_from).keys() == set(SERVERS)

    # -- Back to the warm pool: pinned at 0 the provisioner drains them and powers them off;
    # then automatic again (min_replicas 0, no load: the target stays 0).
    pinned = world.fleetctl("deployments", "scale", DEPLOYMENT, "--replicas", "0")
    assert pinned.exit_code == 0, pinned.stdout + pinned.stderr
    wait_for(
        "both warm again",
        lambda: set(world.states().values()) == {"warm"},
        SERVE_TIMEOUT_S,
        why=world.why,
    )
    auto = world.fleetctl("deployments", "scale", DEPLOYMENT, "--auto")
    assert auto.exit_code == 0, auto.stdout + auto.stderr

    # -- The entry: T a lead and ten seconds away, one replica (one server) for two minutes.
    lead = world.api(
        "POST",
        "/schedules/preview",
        json={"deployment": DEPLOYMENT, "cron": "* * * * *", "min_replicas": 1, "duration_s": 60},
    )
    p = float(lead["lead_s"])
    # The lead is the boot of the spare placement would take, at the p90 of its GPU model's
    # boots in its cache state (weights delivered outside Fleet: never cached), plus the
    # default margin of 10 %.
    bases = {f"{s}: L40S, version not cached: p90 + 10 % of 2 uncached boots" for s in SERVERS}
    assert p == pytest.approx(max(boots.values()) * 1.1) and lead["lead_basis"] in bases, lead
    t = next_second(p + 10)
    created = time.time()
    entry = add_entry(world.api, DEPLOYMENT, t, min_replicas=1, duration_s=120)
    print(f"entry {entry}: T = {utc(t):%H:%M:%S} ({t - created:.1f} s away), lead {p:g} s")

    [event] = wait_for(
        "the entry to fire", lambda: fired(world.api, entry), t - time.time() + 5, why=world.why
    )
    [decision] = calendar_decisions(world.api, DEPLOYMENT, entry)
    print(f"  fired at T {parse_at(event['at']) - t:+.2f} s: {decision['reason']}")
    assert decision["inputs"]["lead_s"] == p, decision
    assert (decision["target_before"], decision["target_after"]) == (0, 1), decision

    def one_serving() -> dict[str, float] | None:
        serving = transitions(world, "serving", created)
        return serving if len(serving) == 1 else None

    serving = wait_for("one server serving", one_serving, t - time.time() + SERVE_TIMEOUT_S)
    booting = transitions(world, "booting", created)
    assert booting.keys() == serving.keys(), (booting, serving)
    [(name, boot_at)] = booting.items()
    serving_at = serving[name]
    print(
        f"  {name}: booting at T {boot_at - t:+.2f} s (T − P = {-p:+.2f} s, window "
        f"[{-p - CALENDAR_TICK_S:+.2f}, {-p:+.2f}]), serving at T {serving_at - t:+.2f} s "
        f"(boot to ready {serving_at - boot_at:.2f} s against P = {p:.2f} s)"
    )
    for row in world.api.events(
        subject=name, kind="server.transition", since=utc(created).isoformat()
    ):
        print(f"    T {parse_at(row['at']) - t:+.2f} s  {row['from_state']} → {row['to_state']}")
    assert t - p - CALENDAR_TICK_S - SLACK_S <= boot_at <= t - p + SLACK_S, boot_at - t
    assert serving_at <= t + LAB_JITTER_S, f"serving {serving_at - t:.2f} s after T"
    # Only the floor's one server: the other spare stayed warm.
    assert sorted(world.states().values()) == ["serving", "warm"], world.states()
