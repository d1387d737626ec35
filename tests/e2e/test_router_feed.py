"""Routers feed the autoscaler: their waiting requests and client-side p95s (both databases).

- `aggregate` adds a router's waiting requests to the engines' queue and takes the worse p95;
- POST /api/v1/routing/report (router token) upserts one row per router and deployment that
  exists (made-up ones are ignored and counted), with sane figures only; the autoscaler reads
  the fresh ones;
- a real `fleetctl router run` reports to a live fleet service on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from factories import add_rack, add_server, add_site
from live import serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.autoscaler.service import History, autoscale_once
from fleet.autoscaler.signals import RouterLoad, aggregate
from fleet.lab.harness import FLEETCTL, free_port
from fleet.models import Deployment, Pool, Role, RouterReport, ScalingDecision, utcnow
from fleet.registry.routing_table import DeploymentLoad, LoadReport, record_report, router_loads
from fleet.settings import Settings

SERVER = {
    "gpu_count": 2,
    "replicas": [{"state": "ready", "queued": 2, "running": 4, "e2e_p95_s": 1.0}],
}


def test_router_waiting_joins_the_queue_and_the_worse_p95_counts() -> None:
    alone = aggregate([SERVER], 0.0)
    assert (alone.queue_per_gpu, alone.p95_latency_s) == (1.0, 1.0)
    fed = aggregate([SERVER], 0.0, RouterLoad(waiting=6, p95_s=3.5, ttft_p95_s=0.8))
    assert (fed.queue_per_gpu, fed.p95_latency_s, fed.ttft_p95_s) == (4.0, 3.5, 0.8)
    calm = aggregate([SERVER], 0.0, RouterLoad(waiting=0, p95_s=0.5))
    assert (calm.queue_per_gpu, calm.p95_latency_s) == (1.0, 1.0)
    # Engines that report no queue: the router's waiting still counts, over the serving GPUs.
    quiet = {"gpu_count": 2, "replicas": [{"state": "ready"}]}
    assert aggregate([quiet], 0.0, RouterLoad(waiting=4)).queue_per_gpu == 2.0
    # Nothing serving: no signal at all (scale-from-zero is not the router's to call).
    assert aggregate([], 0.0, RouterLoad(waiting=9)).queue_per_gpu is None


def llama(session: Session, name: str = "llama") -> Deployment:
    deployment = Deployment(
        name=name,
        model_uri="s3://m/llama-3.1-8b",
        model_checksum="sha256:1",
        gpus_per_replica=8,
        sla_p95_latency_ms=60_000,
        sla_ttft_ms=60_000,
    )
    session.add(deployment)
    session.commit()
    return deployment


def test_reports_upsert_per_router_and_stale_ones_are_ignored(session: Session) -> None:
    llama(session)
    now = utcnow()
    record_report(
        session,
        LoadReport(router="r1", deployments={"llama": DeploymentLoad(waiting=3, p95_s=1.0)}),
        now=now - timedelta(seconds=5),
    )
    record_report(
        session,
        LoadReport(router="r1", deployments={"llama": DeploymentLoad(waiting=4, p95_s=2.0)}),
        now=now,
    )
    record_report(
        session,
        LoadReport(router="r2", deployments={"llama": DeploymentLoad(waiting=1, p95_s=5.0)}),
        now=now - timedelta(minutes=2),
    )
    assert len(session.exec(select(RouterReport)).all()) == 2
    assert router_loads(session, now - timedelta(seconds=30)) == {
        "llama": RouterLoad(waiting=4, p95_s=2.0, ttft_p95_s=None)
    }
    assert router_loads(session, now - timedelta(minutes=5))["llama"].waiting == 5
    # An hour on, a report prunes the rows of routers that stopped reporting.
    record_report(session, LoadReport(router="r3", deployments={}), now=now + timedelta(hours=2))
    assert session.exec(select(RouterReport)).all() == []


def test_the_autoscaler_scales_up_on_what_waits_in_the_router(db: Engine, session: Session) -> None:
    rack = add_rack(session, add_site(session, "s1"), "r1")
    dep = Deployment(
        name="llama",
        model_uri="s3://m/llama-3.1-8b",
        model_checksum="sha256:1",
        gpus_per_replica=8,
        min_replicas=1,
        max_replicas=4,
        sla_p95_latency_ms=60_000,
        sla_ttft_ms=60_000,
        target_servers=1,
    )
    session.add(dep)
    session.commit()
    server = add_server(session, rack, "gpu0", "serving", bmc_system_id="gpu0", pool=Pool.WARM)
    server.deployment_id = dep.id
    session.add(server)
    session.commit()
    settings = Settings(
        autoscale_up_window_s=30.0, autoscale_queue_per_gpu=2.0, heartbeat_interval_s=5.0
    )
    history = History.new(600)
    start = utcnow()
    for step in range(0, 45, 15):
        at = start + timedelta(seconds=step)
        with Session(db) as s:
            row = s.exec(select(Deployment)).one()
            srv = s.exec(select(type(server))).one()
            srv.last_heartbeat_at = at
            srv.replicas = [{"state": "ready", "queued": 0, "running": 8}]
            s.add(srv)
            s.commit()
            # The engines are full and calm; 40 requests wait in the router: 5 per GPU, 2.5×
            # the target.
            record_report(
                s,
                LoadReport(router="r1", deployments={row.name: DeploymentLoad(waiting=40)}),
                now=at,
            )
        autoscale_once(db, settings, history, now=lambda at=at: at)  # type: ignore[misc]
    with Session(db) as s:
        decisions = s.exec(select(ScalingDecision)).all()
        assert "(queue_high)" in decisions[-1].reason, [d.reason for d in decisions]
        assert s.exec(select(Deployment)).one().target_servers > 1


def test_report_route_needs_a_router_token(db: Engine, session: Session, tmp_path: Path) -> None:
    llama(session)
    with serve(db, tmp_path) as live:
        body = {"router": "r1", "deployments": {"llama": {"waiting": 2, "p95_s": 0.4}}}
        viewer = live.client(live.token(Role.VIEWER, name="v"))
        refused = viewer.post("/api/v1/routing/report", json=body)
        assert refused.status_code == 403 and "needs the router role" in refused.json()["detail"]
        router = live.client(live.token(Role.ROUTER, name="rt"))
        recorded = router.post("/api/v1/routing/report", json=body).json()
        assert recorded == {"recorded": 1, "ignored": 0, "unknown": []}
        assert router.get("/api/v1/routing").status_code == 200  # it reads as a viewer does
        bad = router.post("/api/v1/routing/report", json={**body, "deployments": {"x": {}}})
        assert bad.status_code == 422 and "waiting" in bad.json()["detail"]
        assert router.post("/api/v1/servers/x/power", json={"action": "on"}).status_code == 403


def test_a_running_router_reports_its_load_to_the_fleet(
    db: Engine, session: Session, tmp_path: Path
) -> None:
    llama(session)
    with serve(db, tmp_path) as live:
        token = live.token(Role.ROUTER, name="router")
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env |= {
            "FLEET_ROUTER_FLEET_URL": live.url,
            "FLEET_ROUTER_TOKEN": token,
            "FLEET_ROUTER_REPORT_S": "0.2",
            # About load reports, not callers: explicitly unauthenticated.
            "FLEET_ROUTER_CLIENT_AUTH": "none",
        }
        table = tmp_path / "table.json"
        table.write_text(
            '{"results": [{"deployment": "llama", "models": ["llama"], "replicas": []}]}'
        )
        args = [str(FLEETCTL), "router", "run", "--table", str(table), "--port", str(port)]
        proc = subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            rows: list[RouterReport] = []
            while not rows and time.monotonic() < deadline:
                time.sleep(0.2)
                with Session(db) as s:
                    rows = list(s.exec(select(RouterReport)))
            assert rows, "no report arrived"
            assert rows[0].deployment == "llama" and rows[0].waiting == 0
            assert rows[0].arrived == 0  # nothing arrived yet: the demand counter says so
            # A request for the deployment (no replica: the router holds it) is demand, one
            # for a model nobody serves is not.
            base = f"http://127.0.0.1:{port}/v1/completions"
            assert httpx.post(base, json={"model": "nope", "prompt": "x"}).status_code == 404
            with pytest.raises(httpx.TimeoutException):
                httpx.post(base, json={"model": "llama", "prompt": "hi there"}, timeout=0.5)
            while rows[0].arrived != 1 and time.monotonic() < deadline + 10:
                time.sleep(0.2)
                with Session(db) as s:
                    rows = list(s.exec(select(RouterReport)))
            assert rows[0].arrived == 1 and (rows[0].arrived_tokens or 0) > 0
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)


def test_reports_for_deployments_that_do_not_exist_are_ignored_and_counted(
    session: Session,
) -> None:
    llama(session)
    made_up = {f"made-up-{i:04d}": DeploymentLoad(waiting=100_000) for i in range(1000 - 1)}
    report = LoadReport(router="r1", deployments={"llama": DeploymentLoad(waiting=3)} | made_up)
    outcome = record_report(session, report)
    assert (outcome.recorded, outcome.ignored) == (1, 999)
    assert outcome.unknown == [f"made-up-{i:04d}" for i in range(20)]  # the first few named
    rows = session.exec(select(RouterReport)).all()
    assert [(r.deployment, r.waiting) for r in rows] == [("llama", 3)]  # nothing else stored
    assert router_loads(session, utcnow() - timedelta(seconds=30)) == {
        "llama": RouterLoad(waiting=3, p95_s=None, ttft_p95_s=None)
    }
    # Reports under many router names do not add up past the bound.
    for i in range(3):
        flood = {"llama": DeploymentLoad(waiting=60_000)}
        record_report(session, LoadReport(router=f"fake-{i}", deployments=flood))
    assert router_loads(session, utcnow() - timedelta(seconds=30))["llama"].waiting == 100_000


def test_a_report_out_of_bounds_is_refused_naming_the_field(
    db: Engine, session: Session, tmp_path: Path
) -> None:
    llama(session)
    with serve(db, tmp_path) as live:
        router = live.client(live.token(Role.ROUTER, name="rt"))
        url = "/api/v1/routing/report"

        def report(load: object, **more: object) -> httpx.Response:
            return router.post(url, json={"router": "r1", "deployments": {"llama": load}, **more})

        for load, field in (
            ({"waiting": 10_000_000}, "waiting"),
            ({"waiting": -1}, "waiting"),
            ({"waiting": True}, "waiting"),
            ({"waiting": 1.5}, "waiting"),
            ({"waiting": 1, "p95_s": 1e9}, "p95_s"),
            ({"waiting": 1, "p95_s": True}, "p95_s"),
            ({"waiting": 1, "ttft_p95_s": 7200}, "ttft_p95_s"),
            ({"waiting": 1, "ttft_p95_s": -0.1}, "ttft_p95_s"),
            ({"waiting": 1, "arrived": -1}, "arrived"),
            ({"waiting": 1, "arrived": True}, "arrived"),
            ({"waiting": 1, "arrived": 1.5}, "arrived"),
            ({"waiting": 1, "arrived_tokens": 2**60}, "arrived_tokens"),
        ):
            reply = report(load)
            assert reply.status_code == 422 and field in reply.json()["detail"], (load, reply.text)
        # inf and NaN are not JSON, but Python's parser takes them: refused all the same.
        for text in ('{"waiting": 1, "p95_s": Infinity}', '{"waiting": 1, "p95_s": NaN}'):
            body = f'{{"router": "r1", "deployments": {{"llama": {text}}}}}'
            raw = router.post(url, content=body, headers={"Content-Type": "application/json"})
            assert raw.status_code == 422 and "p95_s" in raw.json()["detail"], text
        flood = {f"d{i}": {"waiting": 10_000_000} for i in range(10_000)}
        reply = router.post(url, json={"router": "r1", "deployments": flood})
        assert reply.status_code == 422 and "deployments" in reply.json()["detail"]
        assert report({"waiting": 512, "p95_s": 3599.5, "ttft_p95_s": 2}).status_code == 200
    with Session(db) as s:
        assert [(r.waiting, r.p95_s) for r in s.exec(select(RouterReport))] == [(512, 3599.5)]
