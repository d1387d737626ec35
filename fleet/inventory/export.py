"""The database written back out as an inventory file (without any BMC password)."""

from __future__ import annotations

from typing import Any

import yaml
from sqlmodel import Session, col, select

from fleet.models import (
    ArtifactFormat,
    Deployment,
    GpuModelSpec,
    ModelArtifact,
    ModelVersion,
    PowerFeed,
    Rack,
    Server,
    Site,
)


def export_inventory(session: Session) -> dict[str, Any]:
    racks_by_site: dict[int, list[Rack]] = {}
    for rack in session.exec(select(Rack).order_by(Rack.name)):
        racks_by_site.setdefault(rack.site_id, []).append(rack)
    feeds_by_rack: dict[int, list[PowerFeed]] = {}
    for feed in session.exec(select(PowerFeed).order_by(PowerFeed.name)):
        feeds_by_rack.setdefault(feed.rack_id, []).append(feed)
    servers_by_rack: dict[int, list[Server]] = {}
    for srv in session.exec(select(Server).order_by(col(Server.u_position), col(Server.name))):
        servers_by_rack.setdefault(srv.rack_id, []).append(srv)

    doc: dict[str, Any] = {}
    specs = list(session.exec(select(GpuModelSpec).order_by(GpuModelSpec.name)))
    if specs:
        doc["gpu_models"] = [g.model_dump(exclude={"id"}) for g in specs]
    versions, external = _versions(session)
    if versions:
        doc["models"] = versions
    doc["sites"] = [
        {
            "name": site.name,
            "description": site.description,
            "racks": [
                {
                    "name": rack.name,
                    "u_height": rack.u_height,
                    "status": str(rack.status),
                    "description": rack.description,
                    "budget_mode": str(rack.budget_mode),
                    "budget_margin": rack.budget_margin,
                    "feeds": [_feed(f) for f in feeds_by_rack.get(rack.id or -1, [])],
                    "servers": [_server(s) for s in servers_by_rack.get(rack.id or -1, [])],
                }
                for rack in racks_by_site.get(site.id or -1, [])
            ],
        }
        for site in session.exec(select(Site).order_by(Site.name))
    ]
    keys = {v.id: f"{v.model}@{v.version}" for v in session.exec(select(ModelVersion)) if v.id}
    doc["deployments"] = [
        _deployment(d, keys, external)
        for d in session.exec(select(Deployment).order_by(Deployment.name))
    ]
    return doc


def dump_yaml(doc: dict[str, Any]) -> str:
    header = "# Fleet inventory export. BMC passwords are never exported: re-import keeps them.\n"
    return header + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)


def _feed(f: PowerFeed) -> dict[str, Any]:
    return {
        "name": f.name,
        "side": str(f.side),
        "volts": f.volts,
        "amps": f.amps,
        "phase": str(f.phase),
        "max_utilisation_pct": f.max_utilisation_pct,
    }


def _server(s: Server) -> dict[str, Any]:
    bmc: dict[str, Any] = {
        "protocol": str(s.bmc_protocol),
        "address": s.bmc_address,
        "port": s.bmc_port,
        "username": s.bmc_username,
    }
    if s.bmc_system_id is not None:
        bmc["system_id"] = s.bmc_system_id
    if s.bmc_plain_http:
        bmc["plain_http"] = True
    out: dict[str, Any] = {"name": s.name}
    if s.serial is not None:
        out["serial"] = s.serial
    out.update(
        {
            "u": s.u_position,
            "u_height": s.u_height,
            "bmc": bmc,
            "gpu": {"model": s.gpu_model, "count": s.gpu_count, "memory_mib": s.gpu_memory_mib},
            "power": {"idle_w": s.idle_w, "standby_w": s.standby_w, "max_w": s.max_w},
            "pool": str(s.pool),
        }
    )
    if s.ssh_address is not None:
        ssh: dict[str, Any] = {"address": s.ssh_address, "port": s.ssh_port}
        if s.ssh_host_key is not None:
            ssh["host_key"] = s.ssh_host_key
        out["ssh"] = ssh
    return out


def _versions(session: Session) -> tuple[list[dict[str, Any]], set[int]]:
    """The catalog's versions with their files, and the ids of the external ones: those are
    written as their deployments' `model: {uri, checksum}` (re-imported, the same one)."""
    files: dict[int, list[ModelArtifact]] = {}
    for a in session.exec(
        select(ModelArtifact).order_by(col(ModelArtifact.name), col(ModelArtifact.id))
    ):
        files.setdefault(a.version_id, []).append(a)
    out: list[dict[str, Any]] = []
    external: set[int] = set()
    for v in session.exec(
        select(ModelVersion).order_by(col(ModelVersion.model), col(ModelVersion.created_at))
    ):
        artifacts = files.get(v.id or -1, [])
        if any(a.format is ArtifactFormat.EXTERNAL for a in artifacts):
            external.add(v.id or -1)
            continue
        entry: dict[str, Any] = {"model": v.model, "version": v.version}
        if v.description:
            entry["description"] = v.description
        entry["artifacts"] = [_artifact(a) for a in artifacts]
        out.append(entry)
    return out, external


def _artifact(a: ModelArtifact) -> dict[str, Any]:
    out: dict[str, Any] = {"name": a.name, "uri": a.uri}
    for key in ("sha256", "size_bytes", "gpu_model", "tp_size"):
        if (value := getattr(a, key)) is not None:
            out[key] = value
    out["format"] = str(a.format)
    return out


def _deployment(d: Deployment, keys: dict[int, str], external: set[int]) -> dict[str, Any]:
    if d.model_version_id is not None and d.model_version_id not in external:
        model: dict[str, Any] = {"model_version": keys[d.model_version_id]}
    else:
        model = {"model": {"uri": d.model_uri, "checksum": d.model_checksum}}
    return {
        "name": d.name,
        **model,
        "engine": d.engine,
        "engine_params": dict(d.engine_params),
        "gpus_per_replica": d.gpus_per_replica,
        "gpu_models": list(d.gpu_models),
        "replicas": {"min": d.min_replicas, "max": d.max_replicas},
        "sla": {"p95_latency_ms": d.sla_p95_latency_ms, "ttft_ms": d.sla_ttft_ms},
        "disruption_budget": d.disruption_budget,
        "cached_spares": d.cached_spares,
    }
