"""GPU faults in the simulator (fleet/sim/faults.py): the agent's fault policy judges each Xid,
the router retries what had not started, the fleet's escalation rule reboots or quarantines."""

from __future__ import annotations

import itertools
import math
import random

from fleet.sim import faults as flt
from fleet.sim.arrivals import Constant, FixedSizes, poisson
from fleet.sim.autoscale import AutoscaleSpec, BootTime
from fleet.sim.core import DeploymentSpec, RunResult, Simulation, summarize
from fleet.sim.engine import SimRequest
from fleet.sim.faults import FaultSpec
from fleet.sim.scenario import Scenario, run, table
from fleet_core.fault_policy import RepairAction, Verdict
from fleet_core.telemetry import Snapshot

HOUR = 3600.0


def _requests(rps: float, duration_s: float, seed: int = 3) -> list[SimRequest]:
    got = poisson(Constant(rps), FixedSizes(400, 120), duration_s, seed)
    return [SimRequest(k, a.at, a.prompt, a.output, a.output) for k, a in enumerate(got)]


def _run(
    faults: FaultSpec | None, *, engines: int = 2, hours: float = 2.0, rps: float = 2.0
) -> RunResult:
    # router_limit 48 over max batch 16: requests also queue inside the engines
    spec = DeploymentSpec(
        "d", "llama-3.1-8b", (("H100", engines),), max_batch_size=16, router_limit=48, faults=faults
    )
    return Simulation([spec], seed=5).run(_requests(rps, hours * HOUR))


def _accounted(result: RunResult) -> tuple[int, int, int]:
    done = sum(1 for r in result.requests if r.finish == r.finish)
    failed = sum(1 for r in result.requests if r.failed)
    stuck = len(result.requests) - done - failed
    return done, failed, stuck


def test_the_agents_policy_judges_each_xid() -> None:
    rng = random.Random(0)
    history: list[Snapshot] = []
    verdicts = []
    for k in range(4):  # Xid 94 (contained ECC) on a 1-GPU engine, a minute apart
        assessment, history = flt.judge(history, 94, 60.0 * k, 1, rng)
        verdicts.append((assessment.verdict, assessment.action))
    # three in the window are tolerated, the fourth means the memory is going: reboot
    assert verdicts[:3] == [(Verdict.HEALTHY, RepairAction.NONE)] * 3
    assert verdicts[3] == (Verdict.UNHEALTHY, RepairAction.REBOOT)
    # ...but not when the earlier ones left the 10-minute window
    assessment, _ = flt.judge(history[:3], 94, 60.0 * 2 + 601.0, 1, rng)
    assert assessment.verdict is Verdict.HEALTHY
    app, _ = flt.judge([], 13, 0.0, 8, rng)
    assert (app.verdict, app.action) == (Verdict.DEGRADED, RepairAction.RESTART_ENGINE)
    inspect, _ = flt.judge([], 64, 0.0, 8, rng)
    assert inspect.action is RepairAction.HARDWARE_INSPECTION
    assert flt.fault_code(inspect) == "xid_64"


def test_no_faults_and_a_zero_rate_give_the_same_run() -> None:
    a = _run(None, hours=0.2)
    b = _run(FaultSpec(xids_per_gpu_hour=0.0), hours=0.2)
    assert [(r.finish, r.first_token) for r in a.requests] == [
        (r.finish, r.first_token) for r in b.requests
    ]


def test_an_application_xid_restarts_the_engine_and_the_router_retries() -> None:
    spec = FaultSpec(xids_per_gpu_hour=12.0, mix=((13, 1.0),), restart_s=45.0)
    result = _run(spec, hours=0.5, rps=25.0)
    f = result.faults
    assert f is not None
    assert f.xids[13] >= 3 and f.restarts == f.xids[13]  # every one crashes its engine
    assert f.reboots == 0 and f.quarantined == 0
    done, failed, stuck = _accounted(result)
    assert stuck == 0 and failed == f.failed and failed + done == len(result.requests)
    assert f.retried > 0 and failed > 0  # queued ones went elsewhere, streaming ones were lost
    # a retried request finished, after its first engine went away
    retried = [r for r in result.requests if r.retries and not r.failed]
    assert retried and all(r.finish == r.finish for r in retried)


def test_reset_xids_reboot_then_quarantine_by_the_escalation_rule() -> None:
    # Xid 79 (fell off the bus) every ~20 min per GPU, max 2 reboots for the same fault: each
    # server reboots twice and is quarantined the third time
    # (fleet.provisioning.escalation.escalate).
    spec = FaultSpec(xids_per_gpu_hour=3.0, mix=((79, 1.0),), drain_deadline_s=600.0)
    result = _run(spec, hours=6.0)
    f = result.faults
    assert f is not None
    assert f.quarantined == 2 and f.reboots == 4 and f.drains == 6
    # a long drain deadline lets every in-flight request finish; what came after the whole
    # fleet was quarantined waits with no replica (neither served nor failed)
    _done, failed, stuck = _accounted(result)
    assert failed == 0 and stuck > 0
    s = summarize(result)
    assert s.reboots == 4 and s.quarantined == 2 and s.xids == 6
    # the same seed gives the same faults, at the same times
    again = _run(spec, hours=6.0)
    assert again.faults == f
    assert [r.finish for r in again.requests if r.finish == r.finish] == [
        r.finish for r in result.requests if r.finish == r.finish
    ]
    # quarantined servers leave: their GPU-hours stop
    assert s.gpu_hours < 2 * result.span_s / HOUR


def test_a_drain_deadline_of_zero_loses_what_was_streaming() -> None:
    spec = FaultSpec(xids_per_gpu_hour=2.0, mix=((48, 1.0),), drain_deadline_s=0.0)
    result = _run(spec, engines=3)
    f = result.faults
    assert f is not None and f.drains >= 1
    assert f.failed > 0 and f.failed == sum(r.failed for r in result.requests)


def test_an_autoscaled_deployment_replaces_a_quarantined_server() -> None:
    # Xid 64 asks for hardware inspection: quarantine at once; the autoscaler's next tick
    # finds the deployment short of its target and boots a warm spare.
    auto = AutoscaleSpec(min_replicas=2, max_replicas=2, boot=BootTime(120.0), interval_s=15.0)
    spec = DeploymentSpec(
        "d",
        "llama-3.1-8b",
        (("H100", 2),),
        max_batch_size=16,
        autoscale=auto,
        faults=FaultSpec(xids_per_gpu_hour=1.0, mix=((64, 1.0),)),
    )
    sim = Simulation([spec], warm_pool=(("H100", 4),), seed=2)
    result = sim.run(_requests(2.0, 2 * HOUR))
    f = result.faults
    assert f is not None and (f.quarantined, f.reboots) == (5, 0)
    points = result.timeline
    boots = [q for p, q in itertools.pairwise(points) if q.booting > p.booting]
    # four quarantines were each replaced at the next tick by one of the four spares...
    assert [b.warm_left for b in boots] == [3, 2, 1, 0]
    assert len(result.engines) == 2 + 4
    # ...the fifth found the warm pool empty: exhaustion, one replica serving to the end
    assert result.exhaustions and result.exhaustions[0].at > boots[-1].at
    assert (points[-1].serving, points[-1].warm_left) == (1, 0)
    done, failed, stuck = _accounted(result)
    assert stuck == 0 and failed == 0 and done == len(result.requests)


def test_scenario_faults_and_table() -> None:
    sc = Scenario.model_validate(
        {
            "name": "faults",
            "seed": 1,
            "faults": {"xids_per_gpu_hour": 4.0, "mix": {13: 3, 79: 1}},
            "deployments": [
                {
                    "name": "d",
                    "replicas": {"H100": 3},
                    "max_batch_size": 16,
                    "sla": {"latency_s": 20, "ttft_s": 2},
                    "arrivals": {
                        "rate": {"rps": 3},
                        "duration_s": 3600,
                        "sizes": {"prompt": 400, "output": 120},
                    },
                }
            ],
        }
    )
    _result, s = run(sc)
    assert s.xids > 0 and s.engine_restarts > 0
    assert s.sla_attainment is not None and s.sla_attainment < 1.0  # lost requests miss
    text = table([("ect", s)])
    assert "xids" in text.splitlines()[0] and str(s.xids) in text.splitlines()[2]
    assert not math.isnan(s.latency_p95)
