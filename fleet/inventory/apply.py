"""Compare a validated inventory file with the database, then write the difference at once.

Every check that could fail runs before the first write, so a rejected file leaves the database
exactly as it was; an accepted one is applied in the caller's single transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ValidationError
from sqlmodel import Session, col, select

from fleet.catalog.refs import artifacts_of, is_external, set_deployment_version
from fleet.catalog.versions import (
    add_version,
    external_version,
    legacy_digest,
    same_content,
    version_problems,
)
from fleet.crypto import SecretBox
from fleet.errors import ForbiddenError, RulesBroken
from fleet.events import record_update
from fleet.inventory.gpu_models import BUILTIN
from fleet.inventory.schema import DeploymentIn, InventoryFile, ModelVersionIn, ServerIn, bounded
from fleet.inventory.servers import (
    NO_PASSWORD,
    BmcEndpoint,
    has_bmc_password,
    record_endpoint_change,
)
from fleet.lifecycle import transitions as lifecycle
from fleet.models import (
    Deployment,
    DeploymentCreate,
    Event,
    Gpu,
    GpuModelSpec,
    ModelVersion,
    ModelVersionCreate,
    PowerFeed,
    Rack,
    Server,
    ServerBase,
    ServerCreate,
    Site,
    utcnow,
)
from fleet.power.budget import Feed, ServerDraw, rack_power, side_watts
from fleet.power.racks import to_feed
from fleet.validation import messages_under
from fleet_core.engines import EngineName
from fleet_core.gcpause import collector_paused

Kind = Literal["gpu_model", "model_version", "site", "rack", "feed", "server", "deployment"]
KINDS: tuple[Kind, ...] = (
    "gpu_model",
    "model_version",
    "site",
    "rack",
    "feed",
    "server",
    "deployment",
)


class Change(BaseModel):
    action: Literal["create", "update"]
    kind: Kind
    name: str
    fields: list[str] = []


class ImportReport(BaseModel):
    dry_run: bool
    created: dict[str, int]
    updated: dict[str, int]
    unchanged: dict[str, int]
    changes: list[Change]
    warnings: list[str]

    @property
    def changed(self) -> bool:
        return bool(self.changes)


# ---------------------------------------------------------------------------------------------
# The plan: desired rows, with the place each came from


# A server's SSH fields: the block is optional in a file, and so is its host key.
_SSH_FIELDS = frozenset({"ssh_address", "ssh_port", "ssh_host_key"})


@dataclass
class _ServerRow:
    where: str
    spec: ServerCreate
    # Fields the file leaves out, which keep the fleet's values: the SSH block (or only its
    # host key, which `fleetctl servers ssh-trust` may have pinned) when the file has none.
    kept: frozenset[str] = frozenset()


@dataclass
class _Plan:
    gpu_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    sites: dict[str, dict[str, Any]] = field(default_factory=dict)
    racks: dict[str, dict[str, Any]] = field(default_factory=dict)  # includes "site"
    feeds: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    servers: dict[str, _ServerRow] = field(default_factory=dict)
    deployments: dict[str, DeploymentCreate] = field(default_factory=dict)
    # Model versions by "<model>@<version>" (fleet/catalog/), and every GPU model name the
    # import knows (built in, in the fleet, in the file): artifacts may be built for one.
    models: dict[str, ModelVersionCreate] = field(default_factory=dict)
    known_gpus: set[str] = field(default_factory=set)
    # Where each row came from in the file, for error messages.
    places: dict[tuple[str, str], str] = field(default_factory=dict)
    # Existing servers whose stored BMC password the import replaces ("set") or drops
    # ("dropped": its endpoint moves and the file gives none), and the credential changes
    # only an admin may make (place, server, fields).
    passwords: dict[str, str] = field(default_factory=dict)
    # Existing servers whose password in the file was not looked at (a caller who may not
    # change credentials: _password_change).
    ignored_passwords: list[str] = field(default_factory=list)
    credential_changes: list[tuple[str, str, list[str]]] = field(default_factory=list)


# A server's columns an import compares, as plain rows: ORM objects for 10,000 servers (their
# observations and JSON lists included) took most of a re-import (bench/inventory.py). Apply
# loads the objects of the servers it changes, and only those.
_SERVER_COLUMNS = ("id", "name", "rack_id", "bmc_password_encrypted", *ServerBase.model_fields)
StoredServer = sa.Row[Any]  # attributes named as Server's columns above


@dataclass
class _Existing:
    gpu_models: dict[str, GpuModelSpec]
    sites: dict[str, Site]
    racks: dict[str, Rack]
    feeds: dict[tuple[int, str], PowerFeed]
    servers: dict[str, StoredServer]
    deployments: dict[str, Deployment]
    # Model versions by "<model>@<version>", and each one's key by id.
    models: dict[str, ModelVersion] = field(default_factory=dict)
    version_keys: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, session: Session) -> _Existing:
        return cls(
            gpu_models={g.name: g for g in session.exec(select(GpuModelSpec))},
            sites={s.name: s for s in session.exec(select(Site))},
            racks={r.name: r for r in session.exec(select(Rack))},
            feeds={(f.rack_id, f.name): f for f in session.exec(select(PowerFeed))},
            servers={
                s.name: s
                for s in session.execute(sa.select(*(getattr(Server, c) for c in _SERVER_COLUMNS)))
            },
            deployments={d.name: d for d in session.exec(select(Deployment))},
            models={f"{v.model}@{v.version}": v for v in session.exec(select(ModelVersion))},
        )


def _server_spec(server: ServerIn, rack: str, where: str, errors: list[str]) -> ServerCreate | None:
    try:
        return ServerCreate(
            name=server.name,
            serial=server.serial,
            rack=rack,
            u_position=server.u,
            u_height=server.u_height,
            bmc_protocol=server.bmc.protocol,
            bmc_address=server.bmc.address,
            bmc_port=server.bmc.port,
            bmc_username=server.bmc.username,
            bmc_password=server.bmc.password,
            bmc_system_id=server.bmc.system_id,
            bmc_plain_http=server.bmc.plain_http,
            gpu_model=server.gpu.model,
            gpu_count=server.gpu.count,
            gpu_memory_mib=server.gpu.memory_mib or 0,
            idle_w=server.power.idle_w,
            standby_w=server.power.standby_w,
            max_w=server.power.max_w,
            pool=server.pool,
            # Without a block these are the defaults, and `kept` (below) leaves the fleet's.
            ssh_address=server.ssh.address if server.ssh else None,
            ssh_port=server.ssh.port if server.ssh else 22,
            ssh_host_key=server.ssh.host_key if server.ssh else None,
        )
    except ValidationError as exc:
        errors.extend(messages_under(where, exc))
        return None


def _deployment_spec(dep: DeploymentIn, where: str, errors: list[str]) -> DeploymentCreate | None:
    if (dep.model_version is None) == (dep.model is None):
        errors.append(
            f'{where}: give model_version ("<model>@<version>", under models: or in the '
            "fleet) or model: {uri, checksum} (weights delivered outside Fleet), one of the two"
        )
        return None
    if isinstance(dep.engine, dict):
        if dep.engine_params is not None:
            errors.append(
                f"{where}: engine is a name (trtllm, vllm, sglang) when engine_params is given"
            )
            return None
        engine: EngineName = "trtllm"
        params = dict(dep.engine)
    else:
        engine, params = dep.engine, dict(dep.engine_params or {})
    try:
        spec = DeploymentCreate(
            name=dep.name,
            model_version=dep.model_version,
            model_uri=dep.model.uri if dep.model else None,
            model_checksum=dep.model.checksum if dep.model else None,
            cached_spares=dep.cached_spares,
            engine=engine,
            engine_params=params,
            gpus_per_replica=dep.gpus_per_replica,
            gpu_models=list(dep.gpu_models),
            min_replicas=dep.replicas.min,
            max_replicas=dep.replicas.max,
            sla_p95_latency_ms=dep.sla.p95_latency_ms,
            sla_ttft_ms=dep.sla.ttft_ms,
            disruption_budget=dep.disruption_budget,
        )
    except ValidationError as exc:
        errors.extend(messages_under(where, exc))
        return None
    problems = spec.rule_problems()
    errors.extend(f"{where}: {problem}" for problem in problems)
    return None if problems else spec


def _version_spec(model: ModelVersionIn) -> ModelVersionCreate:
    return ModelVersionCreate.model_validate(model.model_dump())


def _collect(inv: InventoryFile, existing: _Existing, errors: list[str]) -> _Plan:
    plan = _Plan()
    first_seen: dict[tuple[str, str], str] = {}

    def unique(kind: str, name: str, where: str) -> bool:
        key = (kind, name)
        if key in first_seen:
            errors.append(
                f"{where}.name: duplicate {kind} name {name!r} (first at {first_seen[key]})"
            )
            return False
        first_seen[key] = where
        return True

    for i, g in enumerate(inv.gpu_models):
        where = f"gpu_models[{i}]"
        if g.name in BUILTIN:
            errors.append(f"{where}.name: {g.name!r} is a built-in GPU model; use another name")
        elif unique("GPU model", g.name, where):
            plan.gpu_models[g.name] = g.model_dump(exclude={"name"})

    def add_server(server: ServerIn, rack: str, where: str) -> None:
        if not unique("server", server.name, where):
            return
        spec = _server_spec(server, rack, where, errors)
        if spec is not None:
            kept = (
                _SSH_FIELDS
                if server.ssh is None
                else frozenset({"ssh_host_key"})
                if server.ssh.host_key is None
                else frozenset()
            )
            plan.servers[server.name] = _ServerRow(where, spec, kept)

    for si, site in enumerate(inv.sites):
        swhere = f"sites[{si}]"
        if unique("site", site.name, swhere):
            plan.sites[site.name] = {"description": site.description}
        for ri, rack in enumerate(site.racks):
            rwhere = f"{swhere}.racks[{ri}]"
            if unique("rack", rack.name, rwhere):
                plan.places[("rack", rack.name)] = rwhere
                plan.racks[rack.name] = {
                    "site": site.name,
                    "u_height": rack.u_height,
                    "status": rack.status,
                    "description": rack.description,
                    # Only what the file sets: left out, the fleet's mode and margin stay.
                    **rack.model_dump(include=set(_RACK_POWER_FIELDS), exclude_none=True),
                }
            for fi, feed in enumerate(rack.feeds):
                fwhere = f"{rwhere}.feeds[{fi}]"
                if (rack.name, feed.name) in plan.feeds:
                    errors.append(
                        f"{fwhere}.name: duplicate feed {feed.name!r} in rack {rack.name!r}"
                    )
                    continue
                plan.feeds[(rack.name, feed.name)] = feed.model_dump(exclude={"name"})
            for vi, server in enumerate(rack.servers):
                add_server(server, rack.name, f"{rwhere}.servers[{vi}]")

    for vi, racked in enumerate(inv.servers):
        where = f"servers[{vi}]"
        if racked.rack not in plan.racks and racked.rack not in existing.racks:
            errors.append(
                f"{where}.rack: unknown rack {racked.rack!r} (not in this file or the fleet)"
            )
            unique("server", racked.name, where)
            continue
        add_server(racked, racked.rack, where)

    for mi, model in enumerate(inv.models):
        where = f"models[{mi}]"
        key = f"{model.model}@{model.version}"
        if unique("model version", key, where):
            plan.models[key] = _version_spec(model)
            plan.places[("model_version", key)] = where

    for di, dep in enumerate(inv.deployments):
        where = f"deployments[{di}]"
        if unique("deployment", dep.name, where):
            spec = _deployment_spec(dep, where, errors)
            if spec is not None:
                plan.deployments[dep.name] = spec
                plan.places[("deployment", dep.name)] = where
    return plan


def _check(plan: _Plan, existing: _Existing, errors: list[str]) -> None:
    """Rules across rows: GPU specs, rack space, BMC endpoints, serials, passwords."""
    known_gpus = {
        **{n: s.memory_mib for n, s in BUILTIN.items()},
        **{n: g.memory_mib for n, g in existing.gpu_models.items()},
        **{n: int(g["memory_mib"]) for n, g in plan.gpu_models.items()},
    }
    known_help = ", ".join(sorted(known_gpus))

    def rack_height(rack: str) -> int:
        if rack in plan.racks:
            return int(plan.racks[rack]["u_height"])
        return existing.racks[rack].u_height

    rack_names = {r.id: n for n, r in existing.racks.items()}
    # Occupancy starts with the servers the file does not mention (they stay where they are).
    occupied: dict[str, list[tuple[int, int, str]]] = {}
    endpoints: dict[tuple[str, int, str | None], str] = {}
    serials: dict[str, str] = {}
    for name, srv in existing.servers.items():
        if name in plan.servers:
            continue
        rack = rack_names[srv.rack_id]
        top = srv.u_position + srv.u_height - 1
        if rack in plan.racks and top > plan.racks[rack]["u_height"]:
            errors.append(
                f"{plan.places[('rack', rack)]}.u_height: {plan.racks[rack]['u_height']} U "
                f"is too short for server {name!r} at U{srv.u_position}-U{top}"
            )
        occupied.setdefault(rack, []).append(
            (srv.u_position, srv.u_position + srv.u_height - 1, f"server {name!r}")
        )
        endpoints[(srv.bmc_address, srv.bmc_port, srv.bmc_system_id)] = f"server {name!r}"
        if srv.serial:
            serials[srv.serial] = f"server {name!r}"

    for name, row in plan.servers.items():
        spec, where = row.spec, row.where
        if spec.gpu_model not in known_gpus:
            errors.append(
                f"{where}.gpu.model: unknown GPU model {spec.gpu_model!r} "
                f"(known: {known_help}; define it under gpu_models)"
            )
        elif spec.gpu_memory_mib == 0:
            spec.gpu_memory_mib = known_gpus[spec.gpu_model]
        if not spec.standby_w <= spec.idle_w <= spec.max_w:
            errors.append(f"{where}.power: expected standby_w ≤ idle_w ≤ max_w")
        lo, hi = spec.u_position, spec.u_position + spec.u_height - 1
        height = rack_height(spec.rack)
        if hi > height:
            errors.append(f"{where}.u: U{lo}-U{hi} does not fit rack {spec.rack!r} ({height} U)")
        for olo, ohi, who in occupied.get(spec.rack, []):
            if lo <= ohi and olo <= hi:
                errors.append(
                    f"{where}.u: U{lo}-U{hi} in rack {spec.rack!r} overlaps {who} (U{olo}-U{ohi})"
                )
                break
        occupied.setdefault(spec.rack, []).append((lo, hi, f"{where} ({name!r})"))
        endpoint = (spec.bmc_address, spec.bmc_port, spec.bmc_system_id)
        if endpoint in endpoints:
            errors.append(
                f"{where}.bmc: {spec.bmc_address}:{spec.bmc_port}"
                f"{' system ' + spec.bmc_system_id if spec.bmc_system_id else ''} "
                f"is already the BMC of {endpoints[endpoint]}"
            )
        endpoints[endpoint] = f"{where} ({name!r})"
        if spec.serial:
            if spec.serial in serials:
                errors.append(
                    f"{where}.serial: {spec.serial!r} is already used by {serials[spec.serial]}"
                )
            serials[spec.serial] = f"{where} ({name!r})"
        if name not in existing.servers and spec.bmc_password is None:
            errors.append(f"{where}.bmc.password: required for a new server")

    for name, dep in plan.deployments.items():
        for model in dep.gpu_models:
            if model not in known_gpus:
                errors.append(
                    f"{plan.places[('deployment', name)]}.gpu_models: "
                    f"unknown GPU model {model!r} (known: {known_help})"
                )
    plan.known_gpus = set(known_gpus)


def _check_models(session: Session, plan: _Plan, existing: _Existing, errors: list[str]) -> None:
    """Model versions: their files (as `POST /models` checks them), immutability against the
    fleet's, and the version each deployment names."""
    existing.version_keys = {v.id: k for k, v in existing.models.items() if v.id is not None}
    for key, spec in plan.models.items():
        where = plan.places[("model_version", key)]
        errors.extend(version_problems(spec, plan.known_gpus, f"{where}."))
        row = existing.models.get(key)
        if row is not None and not same_content(session, row, spec):
            errors.append(
                f"{where}: model version {key} exists in the fleet with other files: versions "
                "are immutable, give these files a new version name"
            )
    for name, dep in plan.deployments.items():
        where = plan.places[("deployment", name)]
        if dep.model_version is not None and (
            dep.model_version not in plan.models and dep.model_version not in existing.models
        ):
            errors.append(
                f"{where}.model_version: no model version {dep.model_version!r} in this file "
                "(models:) or the fleet (fleetctl models list)"
            )
        dobj = existing.deployments.get(name)
        if (
            dobj is not None
            and dobj.canary_version_id is not None
            and _version_changes(session, dobj, dep, existing)
        ):
            errors.append(
                f"{where}: deployment {name} is rolling out a version: let it finish or roll "
                "it back before the file changes its version"
            )


def _version_changes(
    session: Session, dobj: Deployment, dep: DeploymentCreate, existing: _Existing
) -> bool:
    """Whether importing `dep` changes the version the deployment serves."""
    current = existing.version_keys.get(dobj.model_version_id or 0)
    if dep.model_version is not None:
        return current != dep.model_version
    assert dep.model_uri is not None and dep.model_checksum is not None
    row = existing.models.get(current or "")
    external = row is not None and is_external(artifacts_of(session, row))
    same = (dobj.model_uri, dobj.model_checksum) == (
        dep.model_uri,
        legacy_digest(dep.model_checksum),
    )
    return not (external and same)


# ---------------------------------------------------------------------------------------------
# Diff and apply


# A deployment's fields that name its version: set through the catalog, not copied.
_VERSION_FIELDS = frozenset({"model_version", "model_uri", "model_checksum"})
# A rack's fields an import sets; the budget mode and margin only where the file gives them.
_RACK_POWER_FIELDS = ("budget_mode", "budget_margin")
_RACK_FIELDS = ("u_height", "status", "description", *_RACK_POWER_FIELDS)


def _diff(obj: Any, desired: dict[str, Any]) -> list[str]:
    return [k for k, v in desired.items() if getattr(obj, k) != v]


def _diff_row(row: StoredServer, desired: dict[str, Any]) -> list[str]:
    stored = row._mapping  # by key: a Row's attribute lookup costs 8× more, 10,000 times
    return [k for k, v in desired.items() if stored[k] != v]


def _server_fields(spec: ServerCreate, rack_id: int | None, kept: frozenset[str]) -> dict[str, Any]:
    fields = spec.model_dump(exclude={"rack", "bmc_password", "name", *kept})
    fields["rack_id"] = rack_id
    return fields


def _password_change(
    srv: StoredServer, spec: ServerCreate, box: SecretBox, *, compare: bool
) -> str | None:
    """What an import does to an existing server's stored BMC password: "set" (the file gives
    another one), "dropped" (its BMC endpoint moves and the file gives none: the password goes
    only to the BMC it was given for), "ignored" (see below) or None (kept).

    Only a caller who may change credentials (`compare`: admins) learns whether a password
    in the file equals the stored one: for anyone else an answer that differed by it would be
    an oracle for guessing the stored password. Their file's password is ignored where the
    endpoint stays and one is stored (re-importing a file that carries passwords still works),
    and is a change of credentials otherwise."""
    given = spec.bmc_password

    def moved() -> bool:  # asked only where it decides (10,000 servers, twice each)
        return BmcEndpoint.of(spec).moved_from(BmcEndpoint.of(srv))

    if given is not None:
        if not compare:  # whether one is stored is no secret (bmc_password_set)
            return "set" if not has_bmc_password(srv) or moved() else "ignored"
        if has_bmc_password(srv) and (
            box.decrypt(srv.bmc_password_encrypted) == given.get_secret_value()
        ):
            return None
        return "set"
    if has_bmc_password(srv) and moved():
        return "dropped"
    return None


def _warnings(plan: _Plan, existing: _Existing) -> list[str]:
    """Racks whose servers could exceed the budget with every one at max draw."""
    rack_names = {r.id: n for n, r in existing.racks.items()}
    feeds: dict[str, dict[str, Feed]] = {}
    for (rack_id, fname), f in existing.feeds.items():
        feeds.setdefault(rack_names[rack_id], {})[fname] = to_feed(f)
    for (rack, fname), spec in plan.feeds.items():
        feeds.setdefault(rack, {})[fname] = Feed(
            spec["side"], spec["volts"], spec["amps"], spec["phase"], spec["max_utilisation_pct"]
        )
    draws: dict[str, list[ServerDraw]] = {}
    for srv in existing.servers.values():
        if srv.name not in plan.servers:
            draws.setdefault(rack_names[srv.rack_id], []).append(
                ServerDraw(srv.max_w, srv.standby_w, on=False)
            )
    for row in plan.servers.values():
        draws.setdefault(row.spec.rack, []).append(
            ServerDraw(row.spec.max_w, row.spec.standby_w, on=False)
        )
    out: list[str] = []
    for rack in sorted(set(plan.racks) | {row.spec.rack for row in plan.servers.values()}):
        rack_feeds = feeds.get(rack, {}).values()
        power = rack_power(rack_feeds, draws.get(rack, []))
        if power.oversubscribed_w > 0:
            sides = side_watts(rack_feeds)
            side_text = ", ".join(f"{k} {v:,.0f} W" for k, v in sorted(sides.items()))
            out.append(
                f"rack {rack}: {len(draws.get(rack, []))} servers at max draw need "
                f"{power.all_on_w:,.0f} W, budget {power.budget_w:,.0f} W "
                f"({side_text or 'no feeds'}): oversubscribed by {power.oversubscribed_w:,.0f} W"
            )
    return out


# Any constant: the advisory lock that serialises inventory imports across service replicas.
_IMPORT_LOCK = 0x466C656574  # "Fleet"


def _one_import_at_a_time(session: Session) -> None:
    """Hold the import lock until the caller's transaction ends, so that two imports cannot
    both pass the checks (free U, unique names) against the same snapshot."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _IMPORT_LOCK})
    else:
        # SQLite: any write statement takes the database's write lock until commit or rollback.
        conn.execute(sa.text("UPDATE site SET id = id WHERE 0 = 1"))


def plan(
    session: Session, inv: InventoryFile, box: SecretBox, *, credentials_allowed: bool = True
) -> tuple[ImportReport, _Plan, _Existing]:
    """Validate `inv` against the fleet and compute what an import would change (no writes)."""
    _one_import_at_a_time(session)
    existing = _Existing.load(session)
    errors: list[str] = []
    desired = _collect(inv, existing, errors)
    _check(desired, existing, errors)
    _check_models(session, desired, existing, errors)
    if errors:
        raise RulesBroken(bounded(errors), total=len(errors))

    changes: list[Change] = []
    created = dict.fromkeys(KINDS, 0)
    updated = dict.fromkeys(KINDS, 0)
    unchanged = dict.fromkeys(KINDS, 0)

    def record(kind: Kind, name: str, obj: Any, fields: list[str]) -> None:
        if obj is None:
            changes.append(Change(action="create", kind=kind, name=name))
            created[kind] += 1
        elif fields:
            changes.append(Change(action="update", kind=kind, name=name, fields=fields))
            updated[kind] += 1
        else:
            unchanged[kind] += 1

    for name, g in desired.gpu_models.items():
        gobj = existing.gpu_models.get(name)
        record("gpu_model", name, gobj, _diff(gobj, g) if gobj else [])
    for key, spec in desired.models.items():
        vobj = existing.models.get(key)
        record(
            "model_version",
            key,
            vobj,
            ["description"] if vobj and vobj.description != spec.description else [],
        )
    for name, s in desired.sites.items():
        siteobj = existing.sites.get(name)
        record("site", name, siteobj, _diff(siteobj, s) if siteobj else [])
    site_ids = {n: s.id for n, s in existing.sites.items()}
    for name, r in desired.racks.items():
        robj = existing.racks.get(name)
        fields: list[str] = []
        if robj is not None:
            fields = _diff(robj, {k: r[k] for k in _RACK_FIELDS if k in r})
            if site_ids.get(r["site"]) != robj.site_id:
                fields.append("site")
        record("rack", name, robj, fields)
    rack_ids = {n: r.id for n, r in existing.racks.items()}
    for (rack, fname), f in desired.feeds.items():
        rid = rack_ids.get(rack)
        fobj = existing.feeds.get((rid, fname)) if rid is not None else None
        record("feed", f"{rack}/{fname}", fobj, _diff(fobj, f) if fobj else [])
    for name, row in desired.servers.items():
        sobj = existing.servers.get(name)
        fields = []
        if sobj is not None:
            fields = _diff_row(
                sobj, _server_fields(row.spec, rack_ids.get(row.spec.rack), row.kept)
            )
            fields = ["rack" if f == "rack_id" else f for f in fields]
            password = _password_change(sobj, row.spec, box, compare=credentials_allowed)
            if password == "ignored":
                desired.ignored_passwords.append(name)
            elif password is not None:
                fields.append("bmc_password")
                desired.passwords[name] = password
            credentials = [
                f for f in fields if f == "bmc_username" or (f, password) == ("bmc_password", "set")
            ]
            # Replacing (or dropping) a pinned SSH host key is a trust decision as well.
            if "ssh_host_key" in fields and sobj.ssh_host_key is not None:
                credentials.append("ssh_host_key")
            if credentials:
                desired.credential_changes.append((row.where, name, credentials))
        record("server", name, sobj, fields)
    for name, d in desired.deployments.items():
        dobj = existing.deployments.get(name)
        fields = []
        if dobj is not None:
            fields = _diff(dobj, d.model_dump(exclude={"name", *_VERSION_FIELDS}))
            if _version_changes(session, dobj, d, existing):
                fields.append("model_version")
        record("deployment", name, dobj, fields)

    dropped = sorted(n for n, p in desired.passwords.items() if p == "dropped")
    report = ImportReport(
        dry_run=True,
        created=created,
        updated=updated,
        unchanged=unchanged,
        changes=changes,
        warnings=_warnings(desired, existing)
        + [
            f"server {n}: its BMC endpoint changes and the file gives no password: the stored "
            "one is dropped and BMC actions on it fail until an admin sets one"
            for n in dropped
        ]
        + [
            f"server {n}: bmc.password ignored (only admins change BMC credentials); the "
            "stored one is kept"
            for n in desired.ignored_passwords
        ],
    )
    return report, desired, existing


def apply_plan(
    session: Session,
    report: ImportReport,
    desired: _Plan,
    existing: _Existing,
    box: SecretBox,
    actor: str,
) -> None:
    """Write `desired` (already validated by `plan`) into the session; the caller commits."""
    with session.no_autoflush:
        _apply(session, report, desired, existing, box, actor)


def _apply(
    session: Session,
    report: ImportReport,
    desired: _Plan,
    existing: _Existing,
    box: SecretBox,
    actor: str,
) -> None:
    now = utcnow()
    changed_fields = {(c.kind, c.name): c.fields for c in report.changes}
    touched = changed_fields.keys()

    for name, g in desired.gpu_models.items():
        if ("gpu_model", name) in touched:
            gobj = existing.gpu_models.get(name) or GpuModelSpec(name=name, **g)
            for k, v in g.items():
                setattr(gobj, k, v)
            session.add(gobj)

    versions = dict(existing.models)
    for key, spec in desired.models.items():
        if ("model_version", key) not in touched:
            continue
        vobj = versions.get(key)
        if vobj is None:
            versions[key] = add_version(session, spec, actor, known_gpus=desired.known_gpus)
        else:
            vobj.description = spec.description
            session.add(vobj)

    sites = dict(existing.sites)
    for name, s in desired.sites.items():
        if ("site", name) in touched:
            site = sites.get(name) or Site(name=name)
            site.description, site.updated_at = s["description"], now
            session.add(site)
            sites[name] = site
    session.flush()

    racks = dict(existing.racks)
    for name, r in desired.racks.items():
        if ("rack", name) in touched:
            site_id = sites[r["site"]].id
            assert site_id is not None
            rack = racks.get(name) or Rack(name=name, site_id=site_id)
            rack.site_id, rack.u_height, rack.status = site_id, r["u_height"], r["status"]
            rack.description, rack.updated_at = r["description"], now
            for k in _RACK_POWER_FIELDS:
                if k in r:
                    setattr(rack, k, r[k])
            session.add(rack)
            racks[name] = rack
    session.flush()

    new_feeds: list[dict[str, Any]] = []
    for (rack_name, fname), f in desired.feeds.items():
        if ("feed", f"{rack_name}/{fname}") in touched:
            rid = racks[rack_name].id
            assert rid is not None
            feed = existing.feeds.get((rid, fname))
            if feed is None:  # a batch below, as rows (see lifecycle.enroll_many)
                new_feeds.append({"name": fname, "rack_id": rid, **f})
                continue
            for k, v in f.items():
                setattr(feed, k, v)
            session.add(feed)
    if new_feeds:
        session.execute(sa.insert(PowerFeed.__table__), new_feeds)  # type: ignore[attr-defined]

    changing = _load_servers(
        session,
        [s.id for n, s in existing.servers.items() if ("server", n) in touched],
    )
    new_servers: list[dict[str, Any]] = []
    for name, row in desired.servers.items():
        if ("server", name) not in touched:
            continue
        srv = changing.get(name)
        if srv is None:
            assert row.spec.bmc_password is not None  # checked in plan()
            # Every column the file can set, in every row (the batch insert needs one shape):
            # a new server has no fleet values to keep.
            new_servers.append(
                {
                    **_server_fields(row.spec, racks[row.spec.rack].id, frozenset()),
                    "name": name,
                    "bmc_password_encrypted": box.encrypt(row.spec.bmc_password.get_secret_value()),
                }
            )
            continue
        values = _server_fields(row.spec, racks[row.spec.rack].id, row.kept)
        changed = changed_fields[("server", name)]
        before = BmcEndpoint.of(srv)
        for k, v in values.items():
            setattr(srv, k, v)
        after = BmcEndpoint.of(srv)
        password = desired.passwords.get(name)
        if password == "set" and row.spec.bmc_password is not None:
            srv.bmc_password_encrypted = box.encrypt(row.spec.bmc_password.get_secret_value())
        elif password == "dropped":
            srv.bmc_password_encrypted = NO_PASSWORD
        message = "updated from an inventory file"
        if after.moved_from(before):
            kept = "kept" if has_bmc_password(srv) else "none"
            outcome = {"set": "replaced", "dropped": "dropped"}.get(password or "", kept)
            record_endpoint_change(
                session, srv, changed, actor, message, (before, after), outcome, now
            )
        else:
            record_update(session, srv, "server", name, changed, actor, message, now)
        if {"gpu_model", "gpu_count", "gpu_memory_mib"} & set(changed):
            _reconcile_gpus(session, srv)
    session.flush()
    ids = lifecycle.enroll_many(session, new_servers, actor, "imported from an inventory file")
    _insert_gpus(session, [(ids[row["name"]], row) for row in new_servers])

    for name, dspec in desired.deployments.items():
        if ("deployment", name) not in touched:
            continue
        if dspec.model_version is not None:
            version = versions[dspec.model_version]
        else:
            assert dspec.model_uri is not None and dspec.model_checksum is not None
            version = external_version(session, dspec.model_uri, dspec.model_checksum, actor)
        values = dspec.model_dump(exclude={"name", *_VERSION_FIELDS})
        dep = existing.deployments.get(name) or Deployment(
            name=name, model_uri=version.model, model_checksum=version.digest, **values
        )
        for k, v in values.items():
            setattr(dep, k, v)
        if dep.model_version_id != version.id:
            set_deployment_version(session, dep, version)
        dep.updated_at = now
        session.add(dep)

    if report.changes:
        session.add(
            Event(
                at=now,
                subject_type="inventory",
                subject="inventory",
                actor=actor,
                kind="inventory.imported",
                message=", ".join(
                    f"{k} +{report.created[k]} ~{report.updated[k]}"
                    for k in KINDS
                    if report.created[k] or report.updated[k]
                ),
                details={"created": report.created, "updated": report.updated},
            )
        )
    session.flush()


def _load_servers(session: Session, ids: list[int]) -> dict[str, Server]:
    """The Server objects with these ids by name, a bounded IN list at a time."""
    out: dict[str, Server] = {}
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        out.update(
            (s.name, s) for s in session.exec(select(Server).where(col(Server.id).in_(chunk)))
        )
    return out


def _insert_gpus(session: Session, servers: Iterable[tuple[int, dict[str, Any]]]) -> None:
    """One Gpu row per index of each new server (its id, its columns)."""
    rows = [
        {
            "server_id": server_id,
            "index": i,
            "model": s["gpu_model"],
            "memory_mib": s["gpu_memory_mib"],
            "health": "unknown",
            "uuid": None,
        }
        for server_id, s in servers
        for i in range(s["gpu_count"])
    ]
    if rows:
        session.execute(sa.insert(Gpu.__table__), rows)  # type: ignore[attr-defined]


def _reconcile_gpus(session: Session, server: Server) -> None:
    """Keep one Gpu row per index below gpu_count, matching the server's model and memory."""
    gpus = {g.index: g for g in session.exec(select(Gpu).where(Gpu.server_id == server.id))}
    for index, gpu in gpus.items():
        if index >= server.gpu_count:
            session.delete(gpu)
        elif (gpu.model, gpu.memory_mib) != (server.gpu_model, server.gpu_memory_mib):
            gpu.model, gpu.memory_mib = server.gpu_model, server.gpu_memory_mib
            session.add(gpu)
    for index in range(server.gpu_count):
        if index not in gpus:
            assert server.id is not None
            session.add(
                Gpu(
                    server_id=server.id,
                    index=index,
                    model=server.gpu_model,
                    memory_mib=server.gpu_memory_mib,
                )
            )


def check_credentials(desired: _Plan, allowed: bool) -> None:
    """ForbiddenError when the plan changes existing servers' BMC credentials (a username, or
    a password other than the stored one) or a pinned SSH host key, and the caller may not:
    only admins may."""
    if allowed or not desired.credential_changes:
        return
    shown = [
        f"{where} ({name}): {', '.join(fields)}"
        for where, name, fields in desired.credential_changes[:5]
    ]
    more = len(desired.credential_changes) - len(shown)
    raise ForbiddenError(
        "changing the BMC credentials or pinned SSH host keys of existing servers needs the "
        "admin role: "
        + "; ".join(shown)
        + (f"; and {more} more" if more > 0 else "")
        + " (leave a password out to keep the stored one)"
    )


def import_inventory(
    session: Session,
    inv: InventoryFile,
    box: SecretBox,
    actor: str,
    *,
    dry_run: bool = False,
    credentials_allowed: bool = True,
) -> ImportReport:
    """Validate and (unless dry_run) apply `inv`; the caller's transaction commits or rolls back.
    A file that changes existing servers' BMC credentials needs `credentials_allowed` (admins),
    dry run or not."""
    # Millions of short-lived objects and no cycles: fleet_core/gcpause.py.
    with collector_paused():
        report, desired, existing = plan(session, inv, box, credentials_allowed=credentials_allowed)
        check_credentials(desired, credentials_allowed)
        if not dry_run:
            apply_plan(session, report, desired, existing, box, actor)
            report = report.model_copy(update={"dry_run": False})
    return report
