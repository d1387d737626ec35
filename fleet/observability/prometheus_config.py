"""A Prometheus scrape configuration for the fleet, with file-based discovery (`fleetctl
prometheus-config`, docs/metrics.md).

One directory holds:

- `prometheus.yml`: three jobs, `fleet` (the service processes), `agent` (one per GPU server)
  and `router`, each reading its targets from a file (`file_sd_configs`);
- `targets/fleet.json`, `targets/agents.json`, `targets/routers.json`: the targets, in
  Prometheus's file_sd JSON.

Prometheus watches the target files and applies a change without a reload, so regenerating
them (after an inventory import, from a timer) is all it takes to follow the fleet; the files
are replaced atomically, never seen half-written. The agents' addresses are the URLs they
registered with (`agent_url`), labelled with their server, rack, site and GPU model. A server
the fleet knows to be off (a warm spare, a retired server, or one whose BMC says off) is left
out: its agent is not running, and a target that is down by design would only hide the ones
that are down by accident.

Pure: rows and URLs in, file contents out; `write` puts them on disk.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

# job name -> its targets file, relative to the configuration file
TARGET_FILES = {
    "fleet": "targets/fleet.json",
    "agent": "targets/agents.json",
    "router": "targets/routers.json",
}
CONFIG_FILE = "prometheus.yml"
# States in which the fleet knows a server is off or gone: no agent to scrape.
OFF_STATES = frozenset({"warm", "retired"})
MAX_SCRAPE_TIMEOUT_S = 10.0


class InvalidConfig(ValueError):
    """A URL or interval Prometheus could not use; the message says which."""


def duration(seconds: float) -> str:
    """Seconds as a Prometheus duration: 15 → "15s", 0.5 → "500ms"."""
    if seconds <= 0:
        raise InvalidConfig(f"a scrape interval must be positive, not {seconds:g} s")
    millis = round(seconds * 1000)
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def target_group(url: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One file_sd target group for the service at `url` (its /metrics under the URL's path)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise InvalidConfig(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return {
        "targets": [f"{host}:{port}"],
        "labels": {
            "__scheme__": parts.scheme,
            "__metrics_path__": parts.path.rstrip("/") + "/metrics",
            **(labels or {}),
        },
    }


def agent_groups(servers: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A group per server whose agent registered and is not known to be off: rows of
    GET /api/v1/servers (name, site, rack, gpu_model, state, power_state, agent_url)."""
    groups = []
    for server in sorted(servers, key=lambda s: str(s["name"])):
        url = server.get("agent_url")
        if not url or server.get("state") in OFF_STATES or server.get("power_state") == "off":
            continue
        labels = {
            "server": str(server["name"]),
            "rack": str(server.get("rack") or ""),
            "site": str(server.get("site") or ""),
            "gpu_model": str(server.get("gpu_model") or ""),
        }
        groups.append(target_group(str(url), labels))
    return groups


def scrape_config(scrape_interval_s: float = 15.0, refresh_s: float = 30.0) -> dict[str, Any]:
    """prometheus.yml: one job per kind of process, each discovering its targets from a file
    (paths relative to the configuration file, as Prometheus resolves them)."""
    interval = duration(scrape_interval_s)
    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": duration(min(scrape_interval_s, MAX_SCRAPE_TIMEOUT_S)),
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {
                "job_name": job,
                "file_sd_configs": [{"files": [path], "refresh_interval": duration(refresh_s)}],
            }
            for job, path in TARGET_FILES.items()
        ],
    }


def build(
    *,
    services: Sequence[str],
    servers: Iterable[Mapping[str, Any]],
    routers: Sequence[str] = (),
    scrape_interval_s: float = 15.0,
) -> dict[str, str]:
    """Every file of the configuration: relative path → content."""
    header = (
        "# Written by `fleetctl prometheus-config` (fleet/observability/prometheus_config.py):\n"
        "# the targets are in targets/*.json, re-read by Prometheus whenever the command writes\n"
        "# them again.\n"
    )
    config = yaml.safe_dump(scrape_config(scrape_interval_s), sort_keys=False)
    groups = {
        "fleet": [target_group(url) for url in dict.fromkeys(services)],
        "agent": agent_groups(servers),
        "router": [target_group(url) for url in dict.fromkeys(routers)],
    }
    files = {CONFIG_FILE: header + config}
    for job, path in TARGET_FILES.items():
        files[path] = json.dumps(groups[job], indent=2) + "\n"
    return files


def write(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """Write each file atomically (a temporary file renamed over the old one); the paths."""
    written = []
    for relative, text in files.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.chmod(tmp, 0o644)  # Prometheus often runs as a user of its own
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(path)
    return written
