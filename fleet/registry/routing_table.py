"""The routing table: per deployment, the replicas a router may send to now.

A server receives traffic only when it is `serving`, its agent says ready and its heartbeat is
fresh (docs/design.md). The router (fleet/router/) reads this every few seconds and each listed
agent's /state every 250 ms; this table only says who exists, the agents say who is ready now.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import PurePosixPath
from typing import Annotated, Any
from urllib.parse import urlparse

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from sqlmodel import Session, col, select

from fleet.autoscaler.signals import RouterLoad
from fleet.lifecycle.states import ServerState
from fleet.models import (
    Deployment,
    Int,
    ModelVersion,
    Number,
    OptInt,
    OptNumber,
    RouterReport,
    RouterUsage,
    ScalingDecision,
    Server,
    utcnow,
)
from fleet.settings import Settings
from fleet_core.engines import spec as engine_spec
from fleet_core.weights import version_key


def served_name(model_uri: str) -> str:
    """The model name trtllm-serve answers to: its checkpoint directory's base name."""
    parsed = urlparse(model_uri)
    path = parsed.path if parsed.scheme else model_uri
    return PurePosixPath(path.rstrip("/")).name or parsed.netloc or model_uri


def routing_table(
    session: Session, settings: Settings, *, now: datetime | None = None
) -> list[dict[str, Any]]:
    fresh_after = (now or utcnow()) - timedelta(seconds=3 * settings.heartbeat_interval_s)
    serving = list(
        session.exec(
            select(Server)
            .where(Server.state == ServerState.SERVING)
            .where(col(Server.deployment_id).is_not(None))
            .order_by(col(Server.name))
        )
    )
    keys = {
        v.id: version_key(v.model, v.version)
        for v in session.exec(select(ModelVersion))  # tens: read them all
    }
    out = []
    for deployment in session.exec(select(Deployment).order_by(col(Deployment.name))):
        params = deployment.engine_params or {}
        engine = engine_spec(deployment.engine)
        stable = keys.get(deployment.model_version_id)
        canary = keys.get(deployment.canary_version_id)
        replicas = [
            {
                "server": server.name,
                "gpu_model": server.gpu_model,
                "agent_url": server.agent_url,
                "index": replica.get("index"),
                "url": replica.get("url"),
                "state": replica.get("state"),
                # What the replica runs (its agent says), else what its server is assigned: a
                # server a rollout just moved keeps answering as the version it still runs.
                "version": replica.get("version")
                or keys.get(server.model_version_id or deployment.model_version_id),
            }
            for server in serving
            if server.deployment_id == deployment.id
            and server.agent_ready
            and server.agent_url
            and server.last_heartbeat_at is not None
            and server.last_heartbeat_at >= fresh_after
            for replica in server.replicas or []
            if replica.get("url")
        ]
        off = deployment.max_replicas == 0 and not replicas
        out.append(
            {
                "deployment": deployment.name,
                "models": sorted({deployment.name, served_name(deployment.model_uri)}),
                "model_uri": deployment.model_uri,
                # The engine (the router adds its priority field to requests) and one
                # replica's shape, in engine-neutral terms.
                "engine": deployment.engine,
                # What the router adds to a request of each class so that the engine
                # schedules it by priority ({}: the engine has no such field, or the
                # deployment turned its priority scheduling off).
                "priority_fields": {
                    cls: engine.priority_fields(cls, params) for cls in ("interactive", "batch")
                },
                "tp_size": engine.parallelism(params)[0],
                "max_batch_size": engine.max_batch_size(params),
                "sla_p95_latency_ms": deployment.sla_p95_latency_ms,
                "sla_ttft_ms": deployment.sla_ttft_ms,
                "replicas": replicas,
                # For a deployment with no replica: how long a server takes to boot for it
                # (the Retry-After of a request that waited for one in vain).
                "cold_start_s": None
                if replicas or off
                else cold_start_s(session, deployment, settings),
                # Switched off (max replicas 0): nothing will boot for it, so a router
                # refuses its requests at once instead of holding them for a boot.
                "off": off,
                # The router splits requests by version (docs/router.md): `canary_weight` of
                # them to the canary's replicas, the rest to the stable version's.
                "versions": {
                    "stable": stable,
                    "canary": canary,
                    "canary_weight": deployment.canary_weight if canary else 0.0,
                },
            }
        )
    return out


def cold_start_s(session: Session, deployment: Deployment, settings: Settings) -> float:
    """The boot-to-ready the autoscaler last reckoned with for the deployment (its latest
    decision's `boot_p90_s`: the spare placement would boot next), else the configured
    estimate (FLEET_BOOT_ESTIMATE_S)."""
    inputs = session.exec(
        select(ScalingDecision.inputs)
        .where(ScalingDecision.deployment == deployment.name)
        .order_by(col(ScalingDecision.id).desc())
        .limit(1)
    ).first()
    value = (inputs or {}).get("boot_p90_s")
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return settings.boot_estimate_s


# ---------------------------------------------------------------------------------------------
# Routers' load reports (the autoscaler's view of what waits in front of the engines)

# Sane figures for one router and deployment: a router's waiting room holds 512 by default
# (FLEET_ROUTER_QUEUE_BOUND), and no request runs for an hour (its timeout is 15 minutes).
MAX_WAITING = 100_000
MAX_LATENCY_S = 3600.0
# Entries per report: a router reports the deployments of the routing table, tens in a fleet.
MAX_REPORTED_DEPLOYMENTS = 1000
MAX_IGNORED_SHOWN = 20


# Versions per deployment in one report: a deployment serves one, or two during a rollout (a
# few more while a router's counters still hold versions rolled out earlier).
MAX_REPORTED_VERSIONS = 8
MAX_COUNT = 2**53  # a counter past this is no honest figure (and JSON's exact integer bound)


class VersionLoad(BaseModel):
    """One model version's figures in a router: `requests` answered by a replica of it and
    `errors` among them (5xx or no answer) since the router started (counters: the fleet
    takes differences over a rollout's window), the p95s of the last minute."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    requests: Int = Field(ge=0, le=MAX_COUNT, strict=False)
    errors: Int = Field(ge=0, le=MAX_COUNT, strict=False)
    p95_s: float | None = Field(default=None, ge=0, le=MAX_LATENCY_S)
    ttft_p95_s: float | None = Field(default=None, ge=0, le=MAX_LATENCY_S)


class DeploymentLoad(BaseModel):
    # strict: true is not 1 request waiting, and a p95 is a number (never inf or NaN).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    # 2.0 is 2 (JSON has one number type, and the schema says integer); true is no integer.
    waiting: Int = Field(ge=0, le=MAX_WAITING, strict=False)
    p95_s: float | None = Field(default=None, ge=0, le=MAX_LATENCY_S)
    ttft_p95_s: float | None = Field(default=None, ge=0, le=MAX_LATENCY_S)
    versions: dict[Annotated[str, StringConstraints(min_length=1, max_length=130)], VersionLoad] = (
        Field(default_factory=dict, max_length=MAX_REPORTED_VERSIONS)
    )
    # Requests (and their prompt + expected output tokens) that arrived since the router
    # started, refused ones included: counters whose differences are the demand history
    # (fleet/autoscaler/demand.py). Optional: an older router sends none.
    arrived: OptInt = Field(default=None, ge=0, le=MAX_COUNT, strict=False)
    arrived_tokens: OptInt = Field(default=None, ge=0, le=MAX_COUNT, strict=False)


# Client keys in one report's usage (a router reports the keys it admitted in its window) and
# the largest figure: far beyond any key's limit (fleet/models.py MAX_KEY_TPM per minute).
MAX_REPORTED_KEYS = 100_000
MAX_USAGE = 1e12
MIN_WINDOW_S = 0.001
MAX_WINDOW_S = 3600.0
KeyIdText = Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,9}$")]


class KeyUsage(BaseModel):
    """What a router admitted for one client key over its trailing rate window."""

    model_config = ConfigDict(extra="forbid")

    # JSON numbers only (true is no request), finite.
    requests: Number = Field(ge=0, le=MAX_USAGE)
    tokens: Number = Field(ge=0, le=MAX_USAGE)


def _key_ids_only(schema: dict[str, Any]) -> None:
    """pydantic states a patterned key as `patternProperties`, which lets any other key
    through; the model refuses them, and so does the schema (`propertyNames`)."""
    for option in schema["properties"]["callers"]["anyOf"]:
        patterns = option.pop("patternProperties", None)
        if patterns:
            [(pattern, value)] = patterns.items()
            option["propertyNames"] = {"pattern": pattern}
            option["additionalProperties"] = value


class LoadReport(BaseModel):
    """POST /api/v1/routing/report: one router's view, every deployment it routes, and
    (optionally) its usage per client key for the other routers' rate limits."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_key_ids_only)

    router: str = Field(min_length=1, max_length=100)
    deployments: dict[
        Annotated[str, StringConstraints(min_length=1, max_length=63)], DeploymentLoad
    ] = Field(max_length=MAX_REPORTED_DEPLOYMENTS)
    # "<key id>" → its usage over the router's `window_s`; absent: the router keeps no keys
    # (CLIENT_AUTH=none) and neither stores nor receives usage.
    callers: dict[KeyIdText, KeyUsage] | None = Field(default=None, max_length=MAX_REPORTED_KEYS)
    # From a millisecond: figures are scaled by the ratio of two windows, which stays finite.
    window_s: OptNumber = Field(default=None, ge=MIN_WINDOW_S, le=MAX_WINDOW_S)


class ReportOutcome(BaseModel):
    """What a report did: rows written, and the deployments it named that the fleet does not
    have (ignored: nothing stored for them; the first MAX_IGNORED_SHOWN named). With `callers`
    in the report: the other routers' usage per key summed, and how many other routers share
    the exchange (both left out otherwise)."""

    recorded: int
    ignored: int = 0
    unknown: list[str] = Field(default_factory=list)
    callers: dict[str, KeyUsage] | None = None
    routers: int | None = None


def record_report(
    session: Session,
    report: LoadReport,
    *,
    now: datetime | None = None,
    stale_s: float = Settings.model_fields["router_report_stale_s"].default,
) -> ReportOutcome:
    """Upsert the router's row per deployment that exists (one transaction).

    Deployments the fleet does not have are ignored and counted, not refused: a router's table
    lags the fleet by a poll (a deployment just deleted) or comes from a file, and refusing the
    whole report would blind the autoscaler to that router's real queues. Ignoring stores
    nothing for a made-up name, so at most one row per router and existing deployment.
    The client-key usage exchange: `_exchange_usage` (rows fresher than `stale_s` count)."""
    at = now or utcnow()
    named = set(report.deployments)
    existing: set[str] = set(session.exec(select(Deployment.name)))  # tens: read them all
    known = named & existing
    rows = {
        r.deployment: r
        for r in session.exec(select(RouterReport).where(RouterReport.router == report.router))
    }
    for deployment, load in report.deployments.items():
        if deployment not in known:
            continue
        row = rows.get(deployment) or RouterReport(router=report.router, deployment=deployment)
        row.at, row.waiting = at, load.waiting
        row.p95_s, row.ttft_p95_s = load.p95_s, load.ttft_p95_s
        row.versions = {key: v.model_dump() for key, v in load.versions.items()}
        row.arrived, row.arrived_tokens = load.arrived, load.arrived_tokens
        session.add(row)
    # A restarted router reports under a new name: its old rows go after an hour.
    session.execute(sa.delete(RouterReport).where(col(RouterReport.at) < at - timedelta(hours=1)))
    others, peers = None, None
    if report.callers is not None:
        others, peers = _exchange_usage(session, report, at, at - timedelta(seconds=stale_s))
    session.commit()
    unknown = sorted(named - known)
    return ReportOutcome(
        recorded=len(known),
        ignored=len(unknown),
        unknown=unknown[:MAX_IGNORED_SHOWN],
        callers=others,
        routers=peers,
    )


def _exchange_usage(
    session: Session, report: LoadReport, at: datetime, fresh_after: datetime
) -> tuple[dict[str, KeyUsage], int]:
    """Store the router's usage per key (one row per router) and answer the other routers'
    usage reported since `fresh_after`, summed per key, and how many they are (each router
    splits a key's headroom with them: fleet/router/limits.py). A figure over another window is
    scaled to the reporter's (a router that said no window is taken at the reporter's)."""
    assert report.callers is not None
    # As with the load rows, an hour-old row goes; the rest are one per live router: read
    # them all.
    session.execute(sa.delete(RouterUsage).where(col(RouterUsage.at) < at - timedelta(hours=1)))
    rows = session.exec(select(RouterUsage)).all()
    mine = next((r for r in rows if r.router == report.router), None)
    mine = mine or RouterUsage(router=report.router)
    mine.at, mine.window_s = at, report.window_s
    mine.callers = {key: usage.model_dump() for key, usage in report.callers.items()}
    session.add(mine)
    others = [row for row in rows if row.router != report.router and row.at >= fresh_after]
    usage = sum_usage([(row.callers or {}, row.window_s) for row in others], report.window_s)
    return usage, len(others)


def sum_usage(
    reports: list[tuple[dict[str, Any], float | None]], window_s: float | None
) -> dict[str, KeyUsage]:
    """Per key, the figures of `reports` (usage by key, the window it covers) added up, each
    scaled to `window_s`; an entry that no longer parses (another release's) is left out."""
    out: dict[str, list[float]] = {}
    for callers, window in reports:
        scale = window_s / window if window_s and window else 1.0
        for key, value in callers.items():
            try:
                usage = KeyUsage.model_validate(value)
            except ValueError:
                continue
            total = out.setdefault(key, [0.0, 0.0])
            total[0] += usage.requests * scale
            total[1] += usage.tokens * scale
    return {
        key: KeyUsage(requests=min(r, MAX_USAGE), tokens=min(t, MAX_USAGE))
        # By key id: decimal text, so shorter is smaller.
        for key, (r, t) in sorted(out.items(), key=lambda item: (len(item[0]), item[0]))
    }


def router_loads(session: Session, fresh_after: datetime) -> dict[str, RouterLoad]:
    """Per deployment, over the routers that reported since `fresh_after`: the waiting summed
    (at most MAX_WAITING: reports under many router names do not add up without end), the
    worst p95s."""
    out: dict[str, RouterLoad] = {}
    for row in session.exec(select(RouterReport).where(RouterReport.at >= fresh_after)):
        seen = out.get(row.deployment, RouterLoad())
        out[row.deployment] = RouterLoad(
            waiting=min(seen.waiting + row.waiting, MAX_WAITING),
            p95_s=_max(seen.p95_s, row.p95_s),
            ttft_p95_s=_max(seen.ttft_p95_s, row.ttft_p95_s),
        )
    return out


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def version_loads(
    session: Session, deployment: str, fresh_after: datetime
) -> dict[str, dict[str, VersionLoad]]:
    """Per router that reported since `fresh_after`: its figures per version for `deployment`
    (a rollout's analysis: fleet/rollout/service.py). A row that no longer parses (written by
    another release) is left out."""
    out: dict[str, dict[str, VersionLoad]] = {}
    rows = session.exec(
        select(RouterReport).where(
            RouterReport.deployment == deployment, RouterReport.at >= fresh_after
        )
    )
    for row in rows:
        figures: dict[str, VersionLoad] = {}
        for key, value in (row.versions or {}).items():
            try:
                figures[key] = VersionLoad.model_validate(value)
            except ValueError:
                continue
        out[row.router] = figures
    return out
