"""The inference-quality probe: a known prompt to every serving replica, answers compared.

A GPU can go on computing while it computes wrong (silent data corruption, a bad engine
build, a corrupted weights file). Each serving server's agent runs the probe prompt on its
ready replicas with greedy decoding (`POST {agent_url}/probe`); the first answer recorded for a
deployment's model checksum is its reference (`probe_reference`), and a replica that answers
otherwise marks its server degraded and drains it, for a person to look at (it is not power
cycled: a reboot does not fix a wrong answer). The fleet talks to agents, never to engines.
The agent's /probe needs its key, which the agent sent at registration and the fleet keeps
encrypted (`Server.agent_api_key_encrypted`).
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
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import Deployment, Event, ProbeReference, Server, Verdict, utcnow
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
    """Serving servers whose last probe is older than the interval."""
    if settings.probe_interval_s <= 0:
        return []
    before = utcnow() - timedelta(seconds=settings.probe_interval_s)
    with Session(engine) as session:
        rows = session.exec(
            select(Server.name, Server.probed_at).where(
                Server.state == ServerState.SERVING,
                col(Server.agent_url).is_not(None),
                col(Server.deployment_id).is_not(None),
            )
        )
        return [name for name, at in rows if at is None or at < before]


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
        server.probed_at = utcnow()
        session.add(server)
        session.commit()
    if deployment is None or url is None:
        return ProbeOutcome(name, True, "nothing to probe")
    body = {"prompt": settings.probe_prompt, "max_tokens": settings.probe_max_tokens}
    try:
        key = box.decrypt(sealed) if sealed else None
    except ValueError as exc:  # another FLEET_SECRET_KEY: the agent's next registration fixes it
        return ProbeOutcome(name, True, f"agent key unreadable: {exc}")
    try:
        answers = (ask or http_asker(settings))(url, body, key).get("answers", [])
    except FleetError as exc:  # FLEET_TLS_* files that do not load (serve checks them at start)
        log.warning("quality probe: %s", exc)
        return ProbeOutcome(name, True, f"cannot call the agent: {exc}")
    except (httpx.HTTPError, ValueError) as exc:
        # An agent that cannot answer is the heartbeat's business, not a quality verdict.
        return ProbeOutcome(name, True, f"agent did not answer the probe: {exc}")
    texts = [a.get("text") for a in answers if a.get("error") is None]
    if not texts:
        return ProbeOutcome(name, True, "no ready replica answered")
    with Session(engine) as session:
        reference = session.exec(
            select(ProbeReference).where(
                ProbeReference.deployment_id == deployment.id,
                ProbeReference.model_checksum == deployment.model_checksum,
            )
        ).first()
        if reference is None:
            assert deployment.id is not None
            session.add(
                ProbeReference(
                    deployment_id=deployment.id,
                    model_checksum=deployment.model_checksum,
                    prompt=settings.probe_prompt,
                    answer=str(texts[0]),
                    recorded_from=name,
                )
            )
            session.add(
                _event(
                    name,
                    "server.probe_recorded",
                    f"reference answer recorded for {deployment.name}",
                )
            )
            session.commit()
            reference_text = str(texts[0])
        else:
            reference_text = reference.answer
        wrong = [a for a in answers if a.get("error") is None and a.get("text") != reference_text]
        if not wrong:
            return ProbeOutcome(name, True, f"{len(texts)} replica(s) match the reference")
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
        session.add(_event(name, "server.probe_mismatch", detail))
        lifecycle.transition(session, server, ServerState.DRAINING, ACTOR, detail, commit=False)
        session.commit()
        log.error("%s: %s", name, detail)
        return ProbeOutcome(name, False, detail)


def _event(server: str, kind: str, message: str) -> Event:
    return Event(
        at=utcnow(),
        subject_type="server",
        subject=server,
        actor=ACTOR,
        kind=kind,
        message=message,
    )
