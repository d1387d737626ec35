"""The inference-quality probe: a known prompt to every serving replica, answers compared.

A GPU can go on computing while it computes wrong (silent data corruption, a bad engine
build, a corrupted weights file). Each serving server's agent runs the probe prompt on its
ready replicas with greedy decoding (`POST {agent_url}/probe`); the first answer recorded for a
model version (keyed by the digest of the version the server serves) is its reference
(`probe_reference`), and a replica that answers otherwise marks its server degraded and drains
it, for a person to look at (it is not power cycled: a reboot does not fix a wrong answer).
The fleet talks to agents, never to engines. The agent's /probe needs its key, which the agent
sent at registration and the fleet keeps encrypted (`Server.agent_api_key_encrypted`).

During a rollout (fleet/rollout/) the canary's servers are probed by the rollout, once per step,
not here: their answers are held to the canary version's own reference, and the first one is
recorded only if a second round answers the same (greedy decoding is deterministic: a version
whose answers wander is wrong before any reference exists). A canary that mismatches is not
drained — the version is at fault, not the server — but its `server.probe_mismatch` Event
(details: version, canary) fails the rollout's step, which moves the server back.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.errors import FleetError
from fleet.events import server_event
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import (
    Deployment,
    ModelVersion,
    ProbeReference,
    Server,
    Verdict,
    utcnow,
)
from fleet.settings import Settings
from fleet.tls import client_context

log = logging.getLogger(__name__)
ACTOR = "quality-probe"

# (agent URL, probe body, the agent's key or None for an agent that sent none) -> its answer
AskAgent = Callable[[str, dict[str, Any], str | None], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    server: str
    ok: bool
    detail: str
    canary: bool = False  # a canary server (a mismatch fails the rollout; nothing drained)


def ask_agent_http(
    agent_url: str, body: dict[str, Any], key: str | None, *, tls: ssl.SSLContext | None = None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = httpx.post(
        f"{agent_url.rstrip('/')}/probe",
        json=body,
        headers=headers,
        timeout=60.0,
        trust_env=False,
        verify=tls if tls is not None else True,
    )
    reply.raise_for_status()
    answer: dict[str, Any] = reply.json()
    return answer


def agent_tls(settings: Settings) -> ssl.SSLContext:
    """How the fleet calls agents over https: their certificates verified against
    FLEET_TLS_CA_BUNDLE (else the system's CAs), presenting the fleet's client certificate
    (FLEET_TLS_CLIENT_CERT) to agents that require one."""
    return client_context(settings.tls_ca_bundle, settings.tls_client_cert, settings.tls_client_key)


def http_asker(settings: Settings) -> AskAgent:
    """`ask_agent_http` with the settings' TLS: what the probe uses unless given another."""
    tls = agent_tls(settings)

    def ask(agent_url: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        return ask_agent_http(agent_url, body, key, tls=tls)

    return ask


def probe_due(engine: Engine, settings: Settings) -> list[str]:
    """Serving servers whose last probe is older than the interval (a rollout's canary
    servers excepted: the rollout probes them, fleet/rollout/service.py)."""
    if settings.probe_interval_s <= 0:
        return []
    before = utcnow() - timedelta(seconds=settings.probe_interval_s)
    with Session(engine) as session:
        canaries = {
            d.id: d.canary_version_id
            for d in session.exec(
                select(Deployment).where(col(Deployment.canary_version_id).is_not(None))
            )
        }
        rows = session.exec(
            select(
                Server.name, Server.probed_at, Server.deployment_id, Server.model_version_id
            ).where(
                Server.state == ServerState.SERVING,
                col(Server.agent_url).is_not(None),
                col(Server.deployment_id).is_not(None),
            )
        )
        return [
            name
            for name, at, deployment_id, version_id in rows
            if (at is None or at < before)
            and (version_id is None or canaries.get(deployment_id) != version_id)
        ]


def _moving(server: Server, key: str | None) -> bool:
    """Whether some replica still runs another version than the one the server is assigned
    (a rollout moved it; its answers would be held to the wrong reference)."""
    if key is None:
        return False
    return any(
        isinstance(r.get("version"), str) and r.get("version") != key for r in server.replicas
    )


def probe_server(
    engine: Engine,
    settings: Settings,
    name: str,
    ask: AskAgent | None = None,
    *,
    box: SecretBox,
) -> ProbeOutcome:
    """Probe one server's replicas through its agent (`ask`: over http(s), `http_asker`)."""
    with Session(engine, expire_on_commit=False) as session:
        server = session.exec(select(Server).where(Server.name == name)).one()
        deployment = session.get(Deployment, server.deployment_id)
        url = server.agent_url
        sealed = server.agent_api_key_encrypted
        version_id = server.model_version_id or (
            deployment.model_version_id if deployment is not None else None
        )
        version = session.get(ModelVersion, version_id) if version_id is not None else None
        key = f"{version.model}@{version.version}" if version is not None else None
        moving = _moving(server, key)
        server.probed_at = utcnow()
        session.add(server)
        session.commit()
    if deployment is None or url is None:
        return ProbeOutcome(name, True, "nothing to probe")
    canary = version_id is not None and version_id == deployment.canary_version_id
    if moving:
        return ProbeOutcome(name, True, f"replicas still moving to {key}", canary)
    # The reference is the version's (its digest); a deployment without versions: its checksum.
    checksum = version.digest if version is not None else deployment.model_checksum
    body = {"prompt": settings.probe_prompt, "max_tokens": settings.probe_max_tokens}
    try:
        agent_key = box.decrypt(sealed) if sealed else None
    except ValueError as exc:  # another FLEET_SECRET_KEY: the agent's next registration fixes it
        return ProbeOutcome(name, True, f"agent key unreadable: {exc}")
    try:
        answers = (ask or http_asker(settings))(url, body, agent_key).get("answers", [])
    except FleetError as exc:  # FLEET_TLS_* files that do not load (serve checks them at start)
        log.warning("quality probe: %s", exc)
        return ProbeOutcome(name, True, f"cannot call the agent: {exc}")
    except (httpx.HTTPError, ValueError) as exc:
        # An agent that cannot answer is the heartbeat's business, not a quality verdict.
        return ProbeOutcome(name, True, f"agent did not answer the probe: {exc}")
    texts = [a.get("text") for a in answers if a.get("error") is None]
    if not texts:
        return ProbeOutcome(name, True, "no ready replica answered", canary)
    with Session(engine) as session:
        reference = session.exec(
            select(ProbeReference).where(
                ProbeReference.deployment_id == deployment.id,
                ProbeReference.model_checksum == checksum,
            )
        ).first()
        if reference is None and canary:
            # No reference for the canary yet: a second round first (see the module doc).
            try:
                again = (ask or http_asker(settings))(url, body, agent_key).get("answers", [])
            except (FleetError, httpx.HTTPError, ValueError) as exc:
                return ProbeOutcome(name, True, f"agent did not answer the probe: {exc}", canary)
            answers = answers + [a for a in again if a.get("error") is None]
        if reference is None:
            assert deployment.id is not None
            session.add(
                ProbeReference(
                    deployment_id=deployment.id,
                    model_checksum=checksum,
                    prompt=settings.probe_prompt,
                    answer=str(texts[0]),
                    recorded_from=name,
                )
            )
            session.add(
                server_event(
                    name,
                    ACTOR,
                    "server.probe_recorded",
                    f"reference answer recorded for {deployment.name}"
                    + (f" ({key})" if key else ""),
                    {"deployment": deployment.name, "version": key, "canary": canary},
                )
            )
            session.commit()
            reference_text = str(texts[0])
        else:
            reference_text = reference.answer
        wrong = [a for a in answers if a.get("error") is None and a.get("text") != reference_text]
        if not wrong:
            return ProbeOutcome(name, True, f"{len(texts)} replica(s) match the reference", canary)
        if canary:
            detail = (
                f"inference-quality probe: canary {key} on replica(s) "
                f"{', '.join(sorted({str(a.get('replica')) for a in wrong}))} answered "
                f"differently from its reference; the rollout of {deployment.name} fails"
            )
            session.add(
                server_event(
                    name,
                    ACTOR,
                    "server.probe_mismatch",
                    detail,
                    {"deployment": deployment.name, "version": key, "canary": True},
                )
            )
            session.commit()
            log.error("%s: %s", name, detail)
            return ProbeOutcome(name, False, detail, canary)
        detail = (
            f"inference-quality probe: replica(s) {', '.join(str(a['replica']) for a in wrong)} "
            f"answered differently from {deployment.name}'s reference; drained for a person"
        )
        server = session.exec(select(Server).where(Server.name == name)).one()
        server.health_verdict = Verdict.DEGRADED
        server.last_fault = "probe_mismatch"
        server.drain_reason = "probe"
        server.drain_started_at = utcnow()
        session.add(server)
        session.add(
            server_event(
                name,
                ACTOR,
                "server.probe_mismatch",
                detail,
                {"deployment": deployment.name, "version": key, "canary": False},
            )
        )
        lifecycle.transition(session, server, ServerState.DRAINING, ACTOR, detail, commit=False)
        session.commit()
        log.error("%s: %s", name, detail)
        return ProbeOutcome(name, False, detail)
