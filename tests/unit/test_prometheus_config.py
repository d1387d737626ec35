"""`fleetctl prometheus-config`'s files (fleet/observability/prometheus_config.py): pure, no
Prometheus needed
(promtool checks them where Debian's prometheus package is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.observability.prometheus_config import (
    CONFIG_FILE,
    TARGET_FILES,
    InvalidConfig,
    agent_groups,
    build,
    duration,
    target_group,
    write,
)


def server(name: str, **fields: Any) -> dict[str, Any]:
    """A row of GET /api/v1/servers, as much of it as the configuration reads."""
    row = {
        "name": name,
        "site": "fra1",
        "rack": "fra1-r01",
        "gpu_model": "H100",
        "state": "serving",
        "power_state": "on",
        "agent_url": f"http://10.0.0.{len(name)}:9410",
    }
    return row | fields


def test_durations() -> None:
    assert duration(15) == "15s" and duration(1.0) == "1s" and duration(0.5) == "500ms"
    with pytest.raises(InvalidConfig):
        duration(0)


@pytest.mark.parametrize(
    ("url", "target", "scheme", "path"),
    [
        ("http://10.0.0.5:9410", "10.0.0.5:9410", "http", "/metrics"),
        ("https://fleet.example.com", "fleet.example.com:443", "https", "/metrics"),
        ("http://fleet.example.com/", "fleet.example.com:80", "http", "/metrics"),
        ("http://proxy:8080/fleet/", "proxy:8080", "http", "/fleet/metrics"),
        ("http://[fd00::5]:9410", "[fd00::5]:9410", "http", "/metrics"),
    ],
)
def test_a_target_from_a_url(url: str, target: str, scheme: str, path: str) -> None:
    group = target_group(url, {"server": "s1"})
    assert group == {
        "targets": [target],
        "labels": {"__scheme__": scheme, "__metrics_path__": path, "server": "s1"},
    }


@pytest.mark.parametrize("url", ["10.0.0.5:9410", "ftp://x", "http://", ""])
def test_a_url_prometheus_could_not_scrape_is_refused(url: str) -> None:
    with pytest.raises(InvalidConfig, match="not an http"):
        target_group(url)


def test_agents_of_servers_that_may_run_one_labelled_with_their_place() -> None:
    rows = [
        server("b-serving"),
        server("a-loading", state="loading", gpu_model="L40S"),
        server("never-registered", agent_url=None),
        server("warm-spare", state="warm", power_state="off"),
        server("retired", state="retired", power_state="unknown"),
        server("off-by-bmc", state="failed", power_state="off"),
        server("failed-but-on", state="failed"),
    ]
    groups = agent_groups(rows)
    assert [g["labels"]["server"] for g in groups] == ["a-loading", "b-serving", "failed-but-on"]
    assert groups[0]["labels"] == {
        "__scheme__": "http",
        "__metrics_path__": "/metrics",
        "server": "a-loading",
        "rack": "fra1-r01",
        "site": "fra1",
        "gpu_model": "L40S",
    }


def test_the_configuration_reads_its_targets_from_files() -> None:
    files = build(
        services=["http://127.0.0.1:8080", "http://127.0.0.1:8080"],  # once only
        servers=[server("s1")],
        routers=["http://127.0.0.1:8000"],
        scrape_interval_s=30,
    )
    assert set(files) == {CONFIG_FILE, *TARGET_FILES.values()}
    config = yaml.safe_load(files[CONFIG_FILE])
    assert config["global"]["scrape_interval"] == "30s"
    assert config["global"]["scrape_timeout"] == "10s"  # never over the interval
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"fleet", "agent", "router"}
    for job, path in TARGET_FILES.items():
        [sd] = jobs[job]["file_sd_configs"]
        assert sd["files"] == [path]
    assert json.loads(files[TARGET_FILES["fleet"]]) == [target_group("http://127.0.0.1:8080")]
    assert json.loads(files[TARGET_FILES["router"]]) == [target_group("http://127.0.0.1:8000")]
    [agent] = json.loads(files[TARGET_FILES["agent"]])
    assert agent["targets"] == ["10.0.0.2:9410"] and agent["labels"]["server"] == "s1"
    fast = build(services=["http://f"], servers=[], scrape_interval_s=1)
    assert yaml.safe_load(fast[CONFIG_FILE])["global"]["scrape_timeout"] == "1s"
    assert json.loads(build(services=["http://f"], servers=[])[TARGET_FILES["router"]]) == []


def test_files_are_replaced_whole(tmp_path: Path) -> None:
    first = build(services=["http://f:1"], servers=[server("s1")])
    written = write(tmp_path, first)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(first)
    second = build(services=["http://f:1"], servers=[server("s1"), server("s22")])
    write(tmp_path, second)
    agents = json.loads((tmp_path / TARGET_FILES["agent"]).read_text())
    assert [g["labels"]["server"] for g in agents] == ["s1", "s22"]
    leftovers = [p.name for p in tmp_path.rglob(".*")]
    assert leftovers == [], "temporary files left behind"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus)")
def test_promtool_accepts_the_configuration(tmp_path: Path) -> None:
    files = build(
        services=["http://127.0.0.1:8080"],
        servers=[server("s1")],
        routers=["http://127.0.0.1:8000"],
        scrape_interval_s=1,
    )
    write(tmp_path, files)
    checked = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / CONFIG_FILE)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
