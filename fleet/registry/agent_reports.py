"""What agents tell the fleet (register, heartbeat) and what the fleet answers (the assignment).

An agent token acts for exactly one server; a report for any other server is refused (403).
Reports update observed fields (agent identity, last heartbeat, health verdict, per-GPU
health) and never the lifecycle state: the state machine's loops read these observations and
decide (docs/design.md). Each report is one transaction; a change of verdict, a registration
and a GPU count that disagrees with the inventory are Events, ordinary heartbeats are not.

The assignment names the model version the server serves (its own during a rollout, else its
deployment's: fleet.catalog.refs) with the files a server of its GPU model and TP size fetches,
any version to fetch ahead (`stage`, set by pre-staging), and the versions its cache must not
evict (`keep`). The cache each heartbeat reports replaces the previous one on the server row;
what changed in it is an Event once (a version verified, failed, resumed after a cut, or a file
that failed its checksum), never every beat.

The URLs an agent reports (its own, its replicas') are where routers send users' prompts and
the fleet its probe: each must name the address the report came from, or lie in one of the
configured networks (FLEET_AGENT_NETWORKS, for agents behind NAT or a proxy), so an agent
token cannot point traffic at another host. The agent's local-API key travels in the
registration and is stored encrypted (fleet.crypto.SecretBox), never shown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from typing import Any
from urllib.parse import urlsplit

from sqlmodel import Session, col, select

from fleet.auth import Principal
from fleet.catalog.refs import (
    key_for_id,
    model_ref_for,
    server_version_id,
    tp_size_of,
)
from fleet.control import wakeups
from fleet.crypto import SecretBox
from fleet.errors import ConflictError, FleetError, NotFoundError, ValidationFailed
from fleet.events import deployment_event, server_event
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, Gpu, ModelVersion, Role, Server, utcnow
from fleet.power.measure import drawn_fresh_s, record_estimate
from fleet.settings import get_settings
from fleet_core import wire
from fleet_core.wire import Assignment, CacheReport, GpuFound, GpuHealth, ModelRef

# The report models are the core's (fleet_core/wire.py), shared with the agent; the API's routes
# name them through this module.
from fleet_core.wire import Heartbeat as Heartbeat
from fleet_core.wire import Registration as Registration

Network = IPv4Network | IPv6Network
# Called inside a heartbeat's transaction, before it commits: what to call once it has
# (fleet/registry/heartbeat_ingest.py keeps the answer for the server's next steady report).
Capture = Callable[[Session, Server, wire.Reply], Callable[[], None] | None]


class Forbidden(FleetError):
    status_code = 403


class Reply(wire.Reply):
    """The answer as the fleet gives it: every field present (the agent reads it leniently)."""

    server: str
    state: ServerState
    heartbeat_interval_s: float
    expected_gpus: int


# States in which a server runs its deployment's engines (the assignment is sent when loading).
_SERVE_STATES = frozenset({ServerState.LOADING, ServerState.SERVING})
_DRAIN_STATES = frozenset({ServerState.DRAINING, ServerState.DRAINED})


def url_problem(url: str, peer: str | None, networks: Sequence[Network]) -> str | None:
    """Why an agent whose request came from `peer` may not report `url` (None: it may).

    Addresses only: a host name could resolve anywhere (and again differently later)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port out of range
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if parts.username is not None or parts.password is not None:
        return "no user name or password in the URL"
    if not parts.hostname:
        return "no host"
    address = _address(parts.hostname)
    if address is None:
        return f"host {parts.hostname!r} is a name: give the server's IP address"
    if peer is not None and address == _address(peer):
        return None
    if any(address in network for network in networks):
        return None
    return (
        f"host {address} is not the address this report came from ({peer or 'unknown'}) "
        "nor in FLEET_AGENT_NETWORKS"
    )


def _address(host: str) -> IPv4Address | IPv6Address | None:
    try:
        address = ip_address(host)
    except ValueError:
        return None
    # A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d.
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def check_urls(
    urls: Sequence[tuple[str, str | None]], peer: str | None, networks: Sequence[Network]
) -> None:
    """(field, url) pairs: ValidationFailed (422) naming each field whose URL is refused."""
    errors = [
        f"{field}: {problem}"
        for field, url in urls
        if url is not None and (problem := url_problem(url, peer, networks)) is not None
    ]
    if errors:
        raise ValidationFailed(errors)


def _own_server(session: Session, principal: Principal, name: str) -> Server:
    """The server this agent token acts for; any other is a 403 (and an unknown one a 404
    only for the agent whose server it would be, so tokens cannot probe names)."""
    if principal.role is not Role.AGENT or principal.server_id is None:
        raise Forbidden("only an agent token (fleetctl token create --role agent) may report")
    server = session.exec(select(Server).where(Server.name == name)).first()
    if server is None or server.id != principal.server_id:
        mine = session.get(Server, principal.server_id)
        if mine is None:
            raise NotFoundError("the server this agent token was issued for no longer exists")
        raise Forbidden(
            f"this agent token acts for server {mine.name!r}, not {name!r}: "
            "each agent reports only for its own server"
        )
    return server


def assignment_for(session: Session, server: Server) -> Assignment:
    keep = _keep(session, server)
    if server.state in _DRAIN_STATES:
        return Assignment(kind="drain", keep=keep)
    deployment = session.get(Deployment, server.deployment_id) if server.deployment_id else None
    if deployment is None or server.state not in _SERVE_STATES:
        # A spare powered on to pre-stage a version (fleet/provisioning/staging.py): fetch it,
        # start nothing.
        staging = _stage_ref(session, server, deployment)
        if staging is not None:
            return Assignment(kind="stage", stage=[staging], keep=keep)
        return Assignment(kind="none", keep=keep)
    tp_size = tp_size_of(deployment)
    version = _version(session, server_version_id(server, deployment))
    model = model_ref_for(session, version, server.gpu_model, tp_size) if version else None
    uri, checksum = deployment.model_uri, deployment.model_checksum
    if version is not None and version.id != deployment.model_version_id and model is not None:
        # A canary server: the identity of the version it serves, as the deployment's would be.
        checksum = version.digest
        uri = model.artifacts[0].uri if model.external and model.artifacts else version.model
    stage: list[ModelRef] = []
    ahead = _stage_ref(session, server, deployment)
    if ahead is not None and (model is None or ahead.key != model.key):
        stage.append(ahead)
    return Assignment(
        kind="serve",
        deployment=deployment.name,
        model_uri=uri,
        model_checksum=checksum,
        model=model,
        engine=deployment.engine,
        engine_params=dict(deployment.engine_params),
        gpus_per_replica=deployment.gpus_per_replica,
        replicas=server.gpu_count // deployment.gpus_per_replica,
        stage=stage,
        keep=keep,
    )


def _version(session: Session, version_id: int | None) -> ModelVersion | None:
    return session.get(ModelVersion, version_id) if version_id is not None else None


def _stage_ref(session: Session, server: Server, deployment: Deployment | None) -> ModelRef | None:
    """The version pre-staging asked this server to fetch (`stage_version_id`), with the files
    for its GPU model and the TP size of a deployment that serves it."""
    version = _version(session, server.stage_version_id)
    if version is None:
        return None
    if deployment is None or version.id not in (
        deployment.model_version_id,
        deployment.canary_version_id,
    ):
        deployment = session.exec(
            select(Deployment)
            .where(
                (col(Deployment.model_version_id) == version.id)
                | (col(Deployment.canary_version_id) == version.id)
            )
            .order_by(col(Deployment.id))
        ).first()
    tp_size = tp_size_of(deployment) if deployment is not None else 1
    ref = model_ref_for(session, version, server.gpu_model, tp_size)
    return None if ref.external else ref


def _keep(session: Session, server: Server) -> list[str]:
    """Keys the server's cache must not evict: the versions its deployment serves and rolls
    out, the one it serves itself, and the one it is staging."""
    ids: list[int | None] = [server.model_version_id, server.stage_version_id]
    if server.deployment_id is not None:
        deployment = session.get(Deployment, server.deployment_id)
        if deployment is not None:
            ids += [deployment.model_version_id, deployment.canary_version_id]
    keys = {key_for_id(session, i) for i in ids if i is not None}
    if server.stage_version_id is not None:
        # A spare staging one version keeps those it holds for other deployments' cached
        # spares: it fails "does not fit" (and is not picked for that version again for a
        # while) rather than evicting them, which would have another spare staged for them,
        # round after round.
        staged_for = session.exec(
            select(Deployment.model_version_id).where(Deployment.cached_spares > 0)
        )
        goals = {key_for_id(session, i) for i in staged_for if i is not None}
        held = {
            e.get("key")
            for e in server.cache_entries or []
            if isinstance(e, dict) and e.get("state") == "ready"
        }
        keys |= goals & held
    return sorted(k for k in keys if k is not None)


# A booting server whose agent reports is about to be moved to loading by the provisioner (woken
# by the registration: fleet/control/wakeups.py), and its assignment with it: the agent is asked
# back this soon, so that it learns the assignment then rather than one interval later.
SETTLING_INTERVAL_S = 0.5


def _reply(
    session: Session, server: Server, interval_s: float, refused: list[str] | None = None
) -> Reply:
    if server.state is ServerState.BOOTING:
        interval_s = min(interval_s, SETTLING_INTERVAL_S)
    return Reply(
        server=server.name,
        state=server.state,
        heartbeat_interval_s=interval_s,
        expected_gpus=server.gpu_count,
        assignment=assignment_for(session, server),
        refused_urls=refused or [],
        # The cap valve's per-GPU limit (fleet/power/valve.py); None: the GPUs' default (and
        # so is a non-positive figure, which the wire refuses: never a failed heartbeat).
        gpu_power_limit_w=limit if (limit := server.gpu_power_limit_w) and limit > 0 else None,
    )


def _event(server: Server, actor: str, kind: str, message: str, **details: Any) -> Event:
    return server_event(server.name, actor, kind, message, details)


def register(
    session: Session,
    principal: Principal,
    report: Registration,
    interval_s: float,
    *,
    box: SecretBox,
    peer: str | None,
    networks: Sequence[Network] = (),
) -> Reply:
    server = _own_server(session, principal, report.server)
    check_urls([("agent_url", report.agent_url)], peer, networks)
    now = utcnow()
    server.agent_version = report.agent_version
    server.agent_url = report.agent_url
    key = report.agent_api_key
    server.agent_api_key_encrypted = box.encrypt(key.get_secret_value()) if key else None
    server.agent_registered_at = now
    server.last_heartbeat_at = now
    session.add(server)
    _record_gpus_found(session, server, report.gpus, principal.actor)
    wakeups.request(session)  # a booting server's agent is up: it moves on to loading
    session.add(
        _event(
            server,
            principal.actor,
            "server.agent_registered",
            f"agent {report.agent_version} registered ({report.telemetry} telemetry, "
            f"{len(report.gpus)} GPUs, driver {report.driver_version or 'unknown'})",
            agent_version=report.agent_version,
            telemetry=report.telemetry,
            gpus=len(report.gpus),
        )
    )
    session.commit()
    return _reply(session, server, interval_s)


def _record_gpus_found(session: Session, server: Server, found: list[GpuFound], actor: str) -> None:
    rows = {g.index: g for g in session.exec(select(Gpu).where(Gpu.server_id == server.id))}
    uuids = [g.uuid for g in found if g.uuid]
    if len(set(uuids)) != len(uuids):
        raise FleetError("gpus: two GPUs report the same uuid")
    if uuids:
        elsewhere = session.exec(
            select(Gpu.uuid, Server.name)
            .join(Server, col(Server.id) == Gpu.server_id)
            .where(col(Gpu.uuid).in_(uuids), Gpu.server_id != server.id)
        ).first()
        if elsewhere is not None:
            raise ConflictError(
                f"GPU {elsewhere[0]} is recorded on server {elsewhere[1]!r}: "
                "if it was moved, re-import that server's inventory first"
            )
    for gpu in found:
        row = rows.get(gpu.index)
        if row is not None and gpu.uuid and row.uuid != gpu.uuid:
            row.uuid = gpu.uuid
            session.add(row)
    if len(found) != server.gpu_count:
        session.add(
            _event(
                server,
                actor,
                "server.gpu_inventory_mismatch",
                f"the agent found {len(found)} GPUs; the inventory says {server.gpu_count}",
                found=len(found),
                expected=server.gpu_count,
            )
        )


def heartbeat(
    session: Session,
    principal: Principal,
    report: Heartbeat,
    interval_s: float,
    *,
    peer: str | None,
    networks: Sequence[Network] = (),
    drawn_fresh: float | None = None,
    capture: Capture | None = None,
) -> Reply:
    """`drawn_fresh`: seconds a BMC's draw reading stays fresh, during which the agent's
    estimate does not replace it (default: fleet/power/measure.drawn_fresh_s of the settings).
    `capture`: see Capture; the answer is computed inside the transaction for it."""
    server = _own_server(session, principal, report.server)
    # A replica URL off the rule is dropped (the replica gets no traffic), not the heartbeat:
    # refusing the whole report would hide the GPUs' health and, after the silence deadline,
    # power cycle a server whose only fault is its agent's engine_host setting.
    refused: list[str] = []
    replicas = [r.model_dump(mode="json") for r in report.replicas]
    for i, replica in enumerate(replicas):
        url = replica.get("url")
        if url is not None and (problem := url_problem(url, peer, networks)) is not None:
            refused.append(f"replicas[{i}].url: {problem}")
            replica["url"] = None
    previous = (server.health_verdict, server.health_action)
    decided_on = _decided_on(server)
    now = utcnow()
    server.last_heartbeat_at = now
    server.health_verdict = report.verdict
    server.health_action = report.action
    server.health_reasons = [r.model_dump(mode="json") for r in report.reasons]
    server.agent_ready = report.ready
    server.agent_draining = report.draining
    server.replicas = replicas
    server.gpu_telemetry = gpu_readings(report.gpus)
    # The agent's estimate of the draw where the BMC gives none (fleet/power/measure.py): on
    # the row this report writes anyway, so it costs no extra write.
    fresh_s = drawn_fresh if drawn_fresh is not None else drawn_fresh_s(get_settings())
    gpu_watts = [None if gpu.lost else gpu.power_w for gpu in report.gpus]
    record_estimate(session, server, gpu_watts, now, fresh_s)
    if report.cache is not None:
        _record_cache(session, server, report.cache, principal.actor, now)
    session.add(server)
    rows = {g.index: g for g in session.exec(select(Gpu).where(Gpu.server_id == server.id))}
    for gpu in report.gpus:
        row = rows.get(gpu.index)
        health = GpuHealth.UNHEALTHY if gpu.lost else gpu.health
        if row is not None and row.health != health:
            row.health = health
            session.add(row)
    if _decided_on(server) != decided_on:
        wakeups.request(session)
    if previous != (report.verdict, report.action):
        reasons = "; ".join(r.message for r in report.reasons) or "no faults"
        session.add(
            _event(
                server,
                principal.actor,
                "server.health",
                f"{report.verdict.value} (action: {report.action}): {reasons}"[:1000],
                verdict=report.verdict.value,
                action=report.action,
                was=previous[0].value if previous[0] else None,
                reasons=[r.code for r in report.reasons],
            )
        )
    reply = _reply(session, server, interval_s, refused)
    kept = capture(session, server, reply) if capture is not None else None
    session.commit()
    if kept is not None:
        kept()
    return reply


def gpu_readings(gpus: Sequence[wire.GpuStatus]) -> list[dict[str, Any]]:
    """A heartbeat's GPU measurements as the server row keeps them (`Server.gpu_telemetry`):
    each GPU's reading without its uuid and verdict (the GPU rows hold those), unread fields
    left out."""
    return [g.model_dump(mode="json", exclude=_NOT_READINGS, exclude_none=True) for g in gpus]


_NOT_READINGS = set(wire.GpuStatus.model_fields) - set(wire.GpuReading.model_fields)


def _decided_on(server: Server) -> tuple[object, ...]:
    """What of a heartbeat the provisioner's next step depends on: readiness (loading →
    serving), draining, the verdict and its action (remediation), the replicas' states. A
    change wakes it (fleet/control/wakeups.py); the same report again does not."""
    states = tuple(r.get("state") for r in server.replicas)
    return (
        server.agent_ready,
        server.agent_draining,
        server.health_verdict,
        server.health_action,
        states,
    )


def _record_cache(
    session: Session, server: Server, cache: CacheReport, actor: str, now: Any
) -> None:
    """Store the agent's cache report on the server row, and an Event for each change worth
    one: a version newly verified or failed (a failure also on each deployment serving or
    rolling out that version: the operator looks there), a fetch resumed after a cut, a file
    whose checksum did not match. Counters that fall (the agent restarted) are no event."""
    before = {e.get("key"): e for e in server.cache_entries or () if isinstance(e, dict)}
    entries = [e.model_dump(mode="json") for e in cache.entries]
    for entry in cache.entries:
        was = before.get(entry.key) or {}
        resumes = int(was.get("resumes") or 0)
        if entry.resumes > resumes:
            session.add(
                _event(
                    server,
                    actor,
                    "server.weights_resumed",
                    f"{entry.key}: a fetch resumed after a cut ({entry.resumes} resume(s) "
                    "since the agent started)",
                    version=entry.key,
                    resumes=entry.resumes,
                )
            )
        failures = int(was.get("checksum_failures") or 0)
        if entry.checksum_failures > failures:
            session.add(
                _event(
                    server,
                    actor,
                    "server.weights_checksum_mismatch",
                    f"{entry.key}: a file failed its sha256 check, was discarded and fetched "
                    f"again ({entry.checksum_failures} since the agent started)",
                    version=entry.key,
                    checksum_failures=entry.checksum_failures,
                )
            )
        state = was.get("state")
        if entry.state == "failed" and (state != "failed" or was.get("error") != entry.error):
            error = entry.error or "no reason given"
            session.add(
                _event(
                    server,
                    actor,
                    "server.weights_failed",
                    f"{entry.key}: {error}"[:1000],
                    version=entry.key,
                    error=error,
                )
            )
            for deployment in _deployments_of(session, entry.key):
                session.add(
                    deployment_event(
                        deployment,
                        now,
                        actor,
                        "deployment.weights_failed",
                        f"server {server.name}: {entry.key}: {error}"[:1000],
                        {"server": server.name, "version": entry.key, "error": error},
                    )
                )
        elif entry.state == "ready" and state != "ready":
            session.add(
                _event(
                    server,
                    actor,
                    "server.weights_ready",
                    f"{entry.key} verified in the cache ({entry.bytes:,} bytes)",
                    version=entry.key,
                    bytes=entry.bytes,
                )
            )
    server.cache_entries = entries
    server.cache_budget_bytes = cache.budget_bytes
    server.cache_used_bytes = cache.used_bytes
    server.cache_free_bytes = cache.free_bytes
    server.cache_reported_at = now


def _deployments_of(session: Session, key: str) -> list[str]:
    """Names of the deployments serving or rolling out version `key`."""
    model, _, version = key.partition("@")
    row = session.exec(
        select(ModelVersion).where(ModelVersion.model == model, ModelVersion.version == version)
    ).first()
    if row is None:
        return []
    return list(
        session.exec(
            select(Deployment.name)
            .where(
                (col(Deployment.model_version_id) == row.id)
                | (col(Deployment.canary_version_id) == row.id)
            )
            .order_by(col(Deployment.name))
        )
    )
