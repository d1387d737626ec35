"""Metrics end to end: a real Prometheus (Debian's `prometheus`) scrapes a small virtual colo
through the configuration `fleetctl prometheus-config` writes, and its HTTP API must show that

1. every series docs/metrics.md lists has data, from the job the document names, with the
   labels it names;
2. no series the processes expose is missing from the document;
3. every expression of the Grafana dashboard (docs/grafana/fleet.json) returns data.

The world: `fleetctl serve` (embedded SQLite, loops on, short intervals) and a lab of three
2 × L40S IPMI servers (tests/colo_world.py); a deployment; a `fleetctl router run` on the
fleet's routing table. Prometheus starts (scraping every second) before the spare boots, so
the boot and load histograms and the decisions see it happen; the configuration is written
again once the server serves, and Prometheus finds its agent without a reload (file-based
discovery). A few requests through the router give the router's series their data.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from colo_world import World, colo_world, ipmi_inventory
from repo_paths import ROOT

from fleet import db
from fleet.auth import create_token
from fleet.db import session_scope
from fleet.lab.harness import (
    FAST_AGENT_SETTINGS,
    FAST_SERVICE_SETTINGS,
    SERVING_SETTINGS,
    RouterProcess,
    free_port,
    wait_for,
)
from fleet.models import Role

PROMETHEUS = shutil.which("prometheus") or (
    "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
)
_missing = [
    tool
    for tool, found in (
        ("prometheus", PROMETHEUS),
        ("ipmi_sim", shutil.which("ipmi_sim")),
        ("ipmitool", shutil.which("ipmitool")),
    )
    if found is None
]
if _missing:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{', '.join(_missing)} required in CI", pytrace=False)
    pytest.skip(
        f"{', '.join(_missing)} not installed (Debian prometheus, openipmi, ipmitool)",
        allow_module_level=True,
    )

METRICS_DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "docs" / "grafana" / "fleet.json"

SITE, RACK = "prom", "prom-r01"
SERVERS = tuple(f"{RACK}-l40s-{i}" for i in range(1, 4))
DEPLOYMENT = "llama-70b"
# The harness's fast loops and agents (the drain and power-retry deadlines are no path here).
SERVICE_SETTINGS = FAST_SERVICE_SETTINGS | SERVING_SETTINGS
AGENT_ENV = FAST_AGENT_SETTINGS | {"FLEET_STANDIN_MODEL": "llama-3.1-70b"}
SCRAPE_S = 1
# Grafana's variables, as the test resolves them: every deployment, windows a short run fills.
VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "10m",
    "$deployment": ".*",
}
# Series Prometheus writes itself for every target.
SYNTHETIC = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}
# Labels the scrape adds: every target's, and those of the agents' targets file.
TARGET_LABELS = {
    "fleet": {"job", "instance"},
    "agent": {"job", "instance", "server", "rack", "site", "gpu_model"},
    "router": {"job", "instance"},
}


# ---------------------------------------------------------------------------------------------
# What the documents say


@dataclass(frozen=True)
class Documented:
    job: str
    name: str
    type: str  # gauge, counter, histogram
    labels: frozenset[str]
    created: bool  # ¹: prometheus_client also exposes <base>_created

    @property
    def sample(self) -> str:
        """The name a query for its data uses."""
        return f"{self.name}_count" if self.type == "histogram" else self.name

    def exposed(self) -> set[str]:
        """Every name Prometheus stores for it."""
        base = self.name.removesuffix("_total")
        names = {f"{self.name}{s}" for s in ("_bucket", "_sum", "_count")}
        if self.type != "histogram":
            names = {self.name}
        if self.created:
            names.add(f"{base}_created")
        return names


ROW = re.compile(r"^\|\s*(\w+)\s*\|\s*`(\w+)`\s*\|([^|]*)\|([^|]*)\|")


def documented() -> list[Documented]:
    """The rows of docs/metrics.md's table: | job | `series` | type | labels | meaning |."""
    rows = []
    for line in METRICS_DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        job, name, kind, labels = match.groups()
        rows.append(
            Documented(
                job=job,
                name=name,
                type=kind.split()[0],
                labels=frozenset(re.findall(r"`(\w+)`", labels)),
                created="¹" in kind,
            )
        )
    return rows


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' panels included."""
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append((str(panel.get("title")), str(target["expr"])))

    walk(json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"])
    return found


def resolve(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"an unresolved variable in {expr}"
    return expr


def test_the_documents_parse() -> None:
    rows = documented()
    assert len(rows) > 50 and {r.job for r in rows} == {"fleet", "agent", "router"}
    assert len({r.name for r in rows}) == len(rows), "a series listed twice"
    for row in rows:
        assert row.type in {"gauge", "counter", "histogram"}, row
        assert row.name.endswith("_total") == (row.type == "counter"), row
        assert row.name.startswith(f"{row.job}_"), row
    expressions = dashboard_expressions()
    assert len(expressions) > 30
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert 30 <= board["schemaVersion"] <= 45


# ---------------------------------------------------------------------------------------------
# The processes


class Prometheus:
    """Debian's prometheus on a free port, its TSDB in `base`."""

    def __init__(self, base: Path, config: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = base / "prometheus.log"
        args = [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={base / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        wait_for("prometheus to be ready", self.ready, 30, why=self.tail)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited ({self.proc.returncode})\n{self.tail()}")
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def api(self, path: str, **params: Any) -> Any:
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = reply.json()
        assert body.get("status") == "success", f"{path} {params}: {reply.text}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def up(self, job: str) -> list[dict[str, Any]] | None:
        """The job's targets if there are some and all are up, else None."""
        found = [t for t in self.targets() if t["labels"]["job"] == job]
        return found if found and all(t["health"] == "up" for t in found) else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "prometheus log:\n" + "\n".join(text)


class Router(RouterProcess):
    """`fleetctl router run` on the fleet's routing table (a router token)."""

    def __init__(self, base: Path, fleet_url: str, token: str) -> None:
        settings = {
            "FLEET_ROUTER_FLEET_URL": fleet_url,
            "FLEET_ROUTER_TOKEN": token,
            "FLEET_ROUTER_FLEET_POLL_S": "0.5",
            "FLEET_ROUTER_REPORT_S": "1",
            # About the scrape, not callers: explicitly unauthenticated (tenant "anonymous").
            "FLEET_ROUTER_CLIENT_AUTH": "none",
        }
        super().__init__(base / "router.log", settings)

    def ready_replicas(self) -> int:
        rows = httpx.get(f"{self.url}/state", timeout=5).json()["deployments"]
        return sum(
            1
            for row in rows
            if row.get("deployment") == DEPLOYMENT
            for replica in row.get("replicas", [])
            if replica.get("ready")
        )


def write_config(world: World, out: Path, router: Router) -> None:
    result = world.fleetctl(
        "prometheus-config",
        *("--out", str(out), "--router", router.url, "--scrape-interval", str(SCRAPE_S)),
    )
    assert result.exit_code == 0, result.stdout + result.stderr


def send_requests(router: Router, plain: int) -> None:
    """Plain and streamed completions: the router's counters, histograms and token count."""
    body = {"model": DEPLOYMENT, "prompt": "metrics, please", "max_tokens": 4}
    with httpx.Client(base_url=router.url, timeout=60) as client:
        for _ in range(plain):
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
            assert reply.status_code == 200
            assert any(line.startswith("data:") for line in reply.iter_lines())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("prometheus-e2e")
    inventory = ipmi_inventory(SITE, RACK, SERVERS, "L40S", 2)
    with colo_world(base, inventory, SERVICE_SETTINGS, boot_delay_s=0.5, agent_env=AGENT_ENV) as w:
        yield w


# ---------------------------------------------------------------------------------------------


def test_prometheus_scrapes_every_documented_series_and_the_dashboard_has_data(
    world: World, tmp_path: Path
) -> None:
    # A deployment, its spare booted by an operator below (the autopilot paused meanwhile, so
    # that the autoscaler's min rule does not boot one first).
    paused = world.fleetctl("autopilot", "pause", "--reason", "prometheus e2e: set-up")
    assert paused.exit_code == 0, paused.stdout + paused.stderr
    world.api(
        "POST",
        "/deployments",
        json={
            "name": DEPLOYMENT,
            "model_uri": "s3://models/llama-3.1-70b",
            "model_checksum": "sha256:1",
            "engine_params": {"backend": "pytorch", "tp_size": 2, "max_batch_size": 4},
            "gpus_per_replica": 2,
            "gpu_models": ["L40S"],
            "min_replicas": 1,
            "max_replicas": 2,
            "sla_p95_latency_ms": 60_000,
            "sla_ttft_ms": 10_000,
        },
    )
    engine = db.make_engine(f"sqlite:///{world.database}")
    try:
        with session_scope(engine) as session:
            token = create_token(session, "prometheus-e2e-router", Role.ROUTER)
    finally:
        engine.dispose()

    with ExitStack() as stack:
        router = Router(tmp_path, world.service.url, token)
        stack.callback(router.stop)
        out = tmp_path / "prometheus"
        write_config(world, out, router)
        assert json.loads((out / "targets" / "agents.json").read_text()) == []  # all off
        prometheus = Prometheus(tmp_path, out / "prometheus.yml")
        stack.callback(prometheus.stop)
        wait_for("the fleet target up", lambda: prometheus.up("fleet"), 30, why=prometheus.tail)
        wait_for("the router target up", lambda: prometheus.up("router"), 30, why=prometheus.tail)

        booted = world.fleetctl(
            *("spares", "boot", "--deployment", DEPLOYMENT, "--count", "1", "--wait", "0"),
        )
        assert booted.exit_code == 0, booted.stdout + booted.stderr
        resumed = world.fleetctl("autopilot", "resume", "--reason", "prometheus e2e: go")
        assert resumed.exit_code == 0, resumed.stdout + resumed.stderr
        wait_for(
            "a server serving", lambda: "serving" in world.states().values(), 90, why=world.why
        )

        # The agent joins the targets file; Prometheus follows it without a reload.
        write_config(world, out, router)
        [agent] = json.loads((out / "targets" / "agents.json").read_text())
        assert agent["labels"]["site"] == SITE and agent["labels"]["gpu_model"] == "L40S"
        wait_for("the agent target up", lambda: prometheus.up("agent"), 30, why=prometheus.tail)
        wait_for("the router to see a ready replica", router.ready_replicas, 30, why=router.tail)
        # The router's series are born with its first answer (their first sample already
        # counts it): scraped once before the rest, so that rate() sees the rest.
        send_requests(router, plain=1)
        time.sleep(3 * SCRAPE_S)
        send_requests(router, plain=3)
        time.sleep(4 * SCRAPE_S)  # the last answers scraped, rates over several samples

        rows = documented()
        _every_documented_series_has_data(prometheus, rows)
        _no_exposed_series_is_undocumented(prometheus, rows)
        _every_dashboard_expression_returns_data(prometheus)


def _every_documented_series_has_data(prometheus: Prometheus, rows: list[Documented]) -> None:
    missing, wrong_job, wrong_labels = [], [], []
    for row in rows:
        series = prometheus.api("series", **{"match[]": f'{{__name__="{row.sample}"}}'})
        fresh = prometheus.query(f'last_over_time({{__name__="{row.sample}"}}[1m])')
        if not series or not fresh:
            missing.append(row.name)
            continue
        jobs = {s["job"] for s in series}
        if jobs != {row.job}:
            wrong_job.append(f"{row.name}: jobs {sorted(jobs)}, documented {row.job}")
        ignored = TARGET_LABELS[row.job] | {"__name__"}
        seen: set[str] = set()
        for labels in series:
            seen |= set(labels) - ignored
        if seen != row.labels:
            wrong_labels.append(
                f"{row.name}: labels {sorted(seen)}, documented {sorted(row.labels)}"
            )
    assert not missing, f"documented series without data: {missing}"
    assert not wrong_job, "\n".join(wrong_job)
    assert not wrong_labels, "\n".join(wrong_labels)


def _no_exposed_series_is_undocumented(prometheus: Prometheus, rows: list[Documented]) -> None:
    known: set[str] = set()
    for row in rows:
        known |= row.exposed()
    names = set(prometheus.api("label/__name__/values")) - SYNTHETIC
    assert names, "Prometheus stored nothing"
    assert not names - known, f"exposed but not in docs/metrics.md: {sorted(names - known)}"


def _every_dashboard_expression_returns_data(prometheus: Prometheus) -> None:
    empty = []
    for title, expr in dashboard_expressions():
        result = prometheus.query(resolve(expr))
        values = [float(r["value"][1]) for r in result]
        if not any(not math.isnan(v) for v in values):
            empty.append(f"{title}: {expr} -> {values}")
    assert not empty, "dashboard expressions without data:\n" + "\n".join(empty)
