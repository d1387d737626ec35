"""`fleetctl demo`, the README's main job, end to end: it runs to its summary, the fleet's
event log tells the story, and nothing it started is left in the process table.

The run is shorter than the default (90 s of traffic on five servers; the default is 120 s on
six) but it is the same command with the same script: spares boot with their reasons, the
calendar fires, the spike scales up, a fatal Xid drains a server that is power cycled (or
quarantined and replaced), and servers return to the warm pool. The pure parts (the fleet,
the traffic) are checked on their own below.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from fleet.data import DEMO_INVENTORY
from fleet.demo import plan
from fleet.demo.run import MARKER
from fleet.lab.harness import FLEETCTL
from fleet.traces import load_trace


def leftovers(workdir: Path) -> list[str]:
    """Processes whose environment carries the demo's marker for `workdir`."""
    needle = f"{MARKER}={workdir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(f"{entry.name}: {cmdline.decode(errors='replace')[:200]}")
    return found


def test_the_demo_runs_to_its_summary_and_leaves_nothing_behind(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    args = [str(FLEETCTL), "demo", "--no-live", "--duration", "90", "--servers", "5"]
    run = subprocess.run(
        [*args, "--dir", str(workdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,  # 90 s of traffic, up to 150 s of wind-down, start-up and summary
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "summary" in out and "requests " in out and "SLA " in out, out[-3000:]
    assert (workdir / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert leftovers(workdir.resolve()) == []

    db = sqlite3.connect(workdir / "fleet" / "fleet.db")
    rows = db.execute(
        "select subject, from_state, to_state, message from event "
        "where kind = 'server.transition' order by id"
    ).fetchall()
    kinds = [k for (k,) in db.execute("select kind from event order by id")]
    # Measured draw moved with the traffic: the rack's buckets (the BMCs' readings, 5 s each)
    # differ by more than noise, and the server whose BMC has no reading was metered through
    # its agent's estimate, labelled so.
    rack_peaks = [w for (w,) in db.execute("select max_w from power_sample where kind = 'rack'")]
    estimated = db.execute(
        "select count(*) from power_sample where kind = 'server' and estimated"
    ).fetchone()[0]
    db.close()
    assert len(rack_peaks) >= 5, rack_peaks
    assert max(rack_peaks) > 1.2 * min(rack_peaks), rack_peaks
    assert estimated > 0
    assert "rack draw    measured by the fleet from" in out, out[-3000:]
    moves = [(frm, to) for _, frm, to, _ in rows]
    boots = [m for _, frm, to, m in rows if to == "booting" and frm == "warm"]
    assert len(boots) >= 3 and all("spare chosen by placement" in m for m in boots), boots
    assert "schedule.fired" in kinds and "deployment.scaled" in kinds
    faulted = [s for s, _, to, m in rows if to == "draining" and "remediation" in m]
    assert faulted, "no server was drained for the injected fault"
    after_fault = [(frm, to) for s, frm, to, _ in rows if s == faulted[0]]
    assert ("drained", "booting") in after_fault or ("drained", "quarantined") in after_fault
    assert ("powering_off", "warm") in moves, "no server went back to the warm pool"


def test_the_demo_fleet_is_a_slice_of_the_demo_colo() -> None:
    full = yaml.safe_load(DEMO_INVENTORY.read_text())
    inventory = plan.demo_inventory(full, 3)
    [site] = inventory["sites"]
    [rack] = site["racks"]
    assert rack["name"] == plan.RACK and len(rack["servers"]) == 3
    assert {s["pool"] for s in rack["servers"]} == {"warm"}
    assert {s["bmc"]["protocol"] for s in rack["servers"]} == {"redfish"}
    with pytest.raises(ValueError, match="--servers must be between 2 and 12"):
        plan.demo_inventory(full, 13)


def test_the_traffic_follows_the_timeline_and_is_the_same_for_a_seed() -> None:
    timeline = plan.Timeline(100.0)
    trace = load_trace("conv")
    first = plan.arrivals(trace, timeline, 2.0, seed=7)
    assert first == plan.arrivals(trace, timeline, 2.0, seed=7)
    assert first != plan.arrivals(trace, timeline, 2.0, seed=8)

    def rate(lo: float, hi: float) -> float:
        return sum(1 for a in first if lo <= a.at_s < hi) / (hi - lo)

    # The trace's own ups and downs stay in (it is real traffic): the factors are on top.
    base, spike, fall = rate(0, 35), rate(35, 55), rate(55, 100)
    assert 1.2 < base < 2.8, base
    assert 2.0 < spike / base < 6.0, (spike, base)
    assert 0.05 < fall / base < 0.5, (fall, base)
    assert all(a.output_tokens <= 24 and a.prompt_tokens <= 1024 for a in first)
    assert [a.at_s for a in first] == sorted(a.at_s for a in first)


def test_the_live_view_and_the_log_line_render_a_sample() -> None:
    from rich.console import Console

    from fleet.demo.view import Sample, line, render

    sample = Sample(
        t=42.0,
        phase="spike ×3",
        states={"warm": 2, "booting": 1, "serving": 3},
        target=4,
        serving=3,
        on_the_way=1,
        floor=4,
        queue_per_gpu=1.5,
        engine_p95_s=8.0,
        router_waiting=7,
        offered_rps=6.2,
        client_p95_s=11.0,
        done=120,
        failed=0,
        power_w=9800.0,
        gpus_on=16,
        racks=[
            {
                "name": "ams1-r03",
                "budget_w": 36803.0,
                "committed_w": 12000.0,
                "headroom_w": 24803.0,
                "drawn_w": 5230.0,
                "drawn_estimated_w": 1200.0,
                "peak_24h_w": 6100.0,
                "gpu_cap_pct": None,
            }
        ],
        events=[
            {"at": "2027-01-01T09:00:01+00:00", "subject": "llama-70b", "message": "target 3 → 4"}
        ],
        decision="queue 1.5/GPU > 1/GPU for 6 s: +1",
    )
    console = Console(record=True, width=160)
    console.print(render(sample, 10.0, "Fleet demo"))
    text = console.export_text()
    for expected in ("booting", "serving", "ams1-r03", "24.8", "target 3 → 4", "11.0", "~5.23"):
        assert expected in text, expected
    assert "t=   42s spike ×3" in line(sample) and "waiting=7" in line(sample)
    assert "drawn=~5.23kW" in line(sample)


def test_the_watch_ends_once_the_fleet_rests_on_its_floors() -> None:
    """The demo stops watching as soon as nothing moves and the fleet serves its deployments'
    floors (before, it compared with 2 where the demo's three deployments rest on 3, so every
    run watched the whole 150 s wind-down)."""
    from fleet.demo.run import _settled
    from fleet.demo.view import Sample

    def sample(states: dict[str, int], target: int, serving: int) -> Sample:
        return Sample(
            t=200.0,
            phase="wind-down",
            states=states,
            target=target,
            serving=serving,
            on_the_way=0,
            floor=0,
            queue_per_gpu=0.0,
            engine_p95_s=None,
            router_waiting=0,
            offered_rps=0.0,
            client_p95_s=None,
            done=300,
            failed=0,
            power_w=1800.0,
            gpus_on=12,
        )

    assert _settled(sample({"serving": 3, "warm": 2}, 3, 3), floors=3)
    assert not _settled(sample({"serving": 3, "powering_off": 1, "warm": 1}, 3, 3), floors=3)
    assert not _settled(sample({"serving": 4, "warm": 1}, 4, 4), floors=3)
    assert not _settled(sample({"serving": 3, "booting": 1, "warm": 1}, 4, 3), floors=3)
