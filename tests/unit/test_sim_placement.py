"""Racks, power and placement in the simulator (fleet/sim/racks.py): spares are chosen and
released by the production rules in fleet/provisioning/placement.py."""

from __future__ import annotations

import pytest

from fleet.data import SCENARIOS_DIR
from fleet.sim import racks as sim_racks
from fleet.sim.arrivals import Constant, FixedSizes, poisson
from fleet.sim.autoscale import AutoscaleSpec, BootTime
from fleet.sim.core import DeploymentSpec, Simulation
from fleet.sim.engine import SimRequest
from fleet.sim.racks import RackSpec
from fleet.sim.scenario import Scenario, load, run

# One H100 spare (tp 1): 1,275 W max, 90 W standby → a boot commits 1,185 W more.
MAX_W, STANDBY_W = sim_racks.SERVER_POWER["H100"]


def _requests(rps: float, duration_s: float) -> list[SimRequest]:
    got = poisson(Constant(rps), FixedSizes(400, 120), duration_s, 1)
    return [SimRequest(k, a.at, a.prompt, a.output, a.output) for k, a in enumerate(got)]


def _sim(racks: list[RackSpec], *, min_replicas: int, max_replicas: int = 10) -> Simulation:
    auto = AutoscaleSpec(
        min_replicas=min_replicas, max_replicas=max_replicas, boot=BootTime(60.0), interval_s=15.0
    )
    spec = DeploymentSpec("chat", "llama-3.1-8b", (("H100", 1),), max_batch_size=16, autoscale=auto)
    return Simulation([spec], racks=racks, seed=1)


def _booted_racks(sim: Simulation) -> list[str]:
    return [sim._servers[name].rack for name in sim._placed.values()]


def test_spares_and_rooms_follow_the_power_rule() -> None:
    rack = RackSpec("r1", budget_w=5000.0, spares=(("H100", 2),), other_w=1000.0)
    spares = sim_racks.spares([rack], gpus=1)
    assert [s.name for s in spares] == ["r1-H100-0", "r1-H100-1"]
    assert (spares[0].max_w, spares[0].standby_w) == (MAX_W, STANDBY_W)
    off = sim_racks.rooms([rack], spares, {})
    assert off["r1"].headroom_w == 5000 - 1000 - 2 * STANDBY_W
    one_on = sim_racks.rooms([rack], spares, {"r1-H100-0": True})
    assert one_on["r1"].headroom_w == 5000 - 1000 - MAX_W - STANDBY_W


def test_a_rack_out_of_power_boots_no_more_and_says_why() -> None:
    # r1's budget fits one boot (2,000 - 3 × 90 standby = 1,730 W ≥ 1,185, but not two);
    # r2 has room for both of its spares. Five replicas wanted, one serving: four to boot.
    racks = [
        RackSpec("r1", budget_w=2000.0, spares=(("H100", 3),)),
        RackSpec("r2", budget_w=20000.0, spares=(("H100", 2),)),
    ]
    sim = _sim(racks, min_replicas=5)
    result = sim.run(_requests(1.0, 120.0))
    assert sorted(_booted_racks(sim)) == ["r1", "r2", "r2"]
    first = result.exhaustions[0]
    assert first.short == 1
    assert any("rack r1" in why and "headroom" in why for why in first.reasons), first.reasons


def test_spares_spread_over_racks_and_prefer_the_cached_model() -> None:
    racks = [
        RackSpec("a", budget_w=50000.0, spares=(("H100", 3),)),
        RackSpec("b", budget_w=50000.0, spares=(("H100", 3),), cached=("llama-3.1-8b",)),
        RackSpec("c", budget_w=50000.0, spares=(("H100", 3),)),
    ]
    sim = _sim(racks, min_replicas=4)
    sim.run(_requests(1.0, 60.0))
    # the cached rack wins every pick (cache before spread), then nothing else is needed
    assert _booted_racks(sim) == ["b", "b", "b"]
    sim = _sim(racks[:1] + racks[2:], min_replicas=4)
    sim.run(_requests(1.0, 60.0))
    assert _booted_racks(sim) == ["a", "c", "a"]  # spread first, then by name


def test_scale_in_releases_from_the_tightest_rack_first() -> None:
    # Scale up to 4 on a spike, then down: the replicas in the rack with the least headroom
    # are drained first (choose_release), and their servers go back to that rack's spares.
    racks = [
        RackSpec("tight", budget_w=3000.0, spares=(("H100", 2),)),
        RackSpec("roomy", budget_w=40000.0, spares=(("H100", 2),)),
    ]
    sim = _sim(racks, min_replicas=1, max_replicas=5)
    dep = sim.deps[0]
    dep.target = 5  # as if the policy had asked for the peak: four boots
    sim._apply(dep)
    # the most headroom left first, then spread: roomy, tight, roomy, tight (tight fits two)
    assert _booted_racks(sim) == ["roomy", "tight", "roomy", "tight"]
    for url in list(dep.booting):
        sim.now = sim._ready_at[url]
        sim._ready(dep, url)
    assert dep.serving() == 5 and not sim._free
    dep.target = 3
    sim._apply(dep)  # idle replicas leave at once
    # released: the starting replica (outside the racks: the tightest), then one in "tight";
    # the tight rack's server is warm again, the unracked one is not a spare
    assert dep.serving() == 3 and "sim://chat/0-H100" not in dep.engines
    assert [x.rack for x in sim._free.values()] == ["tight"]
    assert sorted(_booted_racks(sim)) == ["roomy", "roomy", "tight"]
    assert sim.shared_warm == {"H100": 1}


def test_scenario_racks_load_and_refuse_both_pools(tmp_path: object) -> None:
    base = {
        "name": "racks",
        "deployments": [
            {
                "name": "chat",
                "replicas": {"H100": 1},
                "sla": {"latency_s": 20, "ttft_s": 2},
                "arrivals": {
                    "rate": {"rps": 1},
                    "duration_s": 60,
                    "sizes": {"prompt": 100, "output": 20},
                },
                "autoscale": {"min_replicas": 2, "boot_s": 30},
            }
        ],
        "racks": [{"name": "r1", "budget_w": 9000, "spares": {"H100": 2}}],
    }
    result, summary = run(Scenario.model_validate(base))
    assert summary.peak_replicas == 2 and not result.exhaustions
    with pytest.raises(ValueError, match="racks or as warm_pool"):
        Scenario.model_validate(base | {"warm_pool": {"H100": 1}})
    bad = base | {"racks": [{"name": "r1", "budget_w": 9000, "spares": {"H999": 2}}]}
    with pytest.raises(ValueError, match="H999"):
        Scenario.model_validate(bad)


def test_a_spare_with_the_model_cached_loads_faster() -> None:
    auto = AutoscaleSpec(
        min_replicas=3,
        max_replicas=3,
        boot=BootTime(60.0),
        load=BootTime(200.0),
        load_cached=BootTime(20.0),
    )
    spec = DeploymentSpec("chat", "llama-3.1-8b", (("H100", 1),), autoscale=auto)
    racks = [
        RackSpec("cold", budget_w=50000.0, spares=(("H100", 1),)),
        RackSpec("warm", budget_w=50000.0, spares=(("H100", 1),), cached=("llama-3.1-8b",)),
    ]
    sim = Simulation([spec], racks=racks)
    dep = sim.deps[0]
    dep.target = 3
    sim._apply(dep)
    ready = {sim._servers[sim._placed[u]].rack: t for u, t in sim._ready_at.items()}
    assert ready == {"warm": 80.0, "cold": 260.0}  # boot + the cached / uncached load
    assert auto.ready_p90_s == 260.0  # what the policy's look-ahead and the calendar's lead use


def test_the_racks_and_faults_example_loads() -> None:
    sc = load(SCENARIOS_DIR / "racks-faults.yaml")
    assert sc.shared_pool() == {"H100": 8} and not sc.warm_pool
    spec = sc.deployments[0].spec(faults=sc.faults)
    assert spec.faults is not None and spec.faults.xids_per_gpu_hour == 0.5
    assert [r.spec().cached for r in sc.racks] == [("llama-3.1-8b",), ()]
