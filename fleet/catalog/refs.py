"""What a server's assignment says about model versions, and which version a server or a
deployment serves (docs/weights.md).

Placement, pre-staging (fleet/provisioning/) and rollouts (fleet/rollout/) read the version a
server serves and what its agent's cache holds through these functions; the registry
(fleet/registry/agent_reports.py) turns versions into the `ModelRef`s of the assignment. A
deployment's `model_uri` and `model_checksum` follow its version: `set_deployment_version` is
the one place that changes them together.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, col, select

from fleet.models import ArtifactFormat, Deployment, ModelArtifact, ModelVersion, Server, utcnow
from fleet_core.engines import spec as engine_spec
from fleet_core.weights import for_server, version_key
from fleet_core.wire import ArtifactRef, ModelRef


def key_of(version: ModelVersion) -> str:
    """The version's one name on the wire and in the cache: "<model>@<version>"."""
    return version_key(version.model, version.version)


def artifacts_of(session: Session, version: ModelVersion) -> list[ModelArtifact]:
    return list(
        session.exec(
            select(ModelArtifact)
            .where(ModelArtifact.version_id == version.id)
            .order_by(col(ModelArtifact.name), col(ModelArtifact.id))
        )
    )


def is_external(artifacts: list[ModelArtifact]) -> bool:
    """Weights delivered outside Fleet (a deployment from before model versions, or created
    with a bare model_uri and checksum): nothing to fetch or verify."""
    return any(a.format is ArtifactFormat.EXTERNAL for a in artifacts)


def version_by_key(session: Session, key: str) -> ModelVersion | None:
    """The version named "<model>@<version>" (None: no such version, or not a key)."""
    model, sep, version = key.partition("@")
    if not sep:
        return None
    return session.exec(
        select(ModelVersion).where(ModelVersion.model == model, ModelVersion.version == version)
    ).first()


def key_for_id(session: Session, version_id: int | None) -> str | None:
    if version_id is None:
        return None
    version = session.get(ModelVersion, version_id)
    return key_of(version) if version is not None else None


def tp_size_of(deployment: Deployment) -> int:
    """The tensor-parallel size its engines run at (which engine files a server fetches)."""
    return engine_spec(deployment.engine).parallelism(deployment.engine_params)[0]


def model_ref_for(
    session: Session, version: ModelVersion, gpu_model: str, tp_size: int
) -> ModelRef:
    """The version as an agent on a `gpu_model` server running at `tp_size` fetches it: only
    the files built for no GPU model in particular or for this one (fleet_core.weights)."""
    artifacts = artifacts_of(session, version)
    external = is_external(artifacts)
    chosen = artifacts if external else for_server(artifacts, gpu_model, tp_size)
    return ModelRef(
        model=version.model,
        version=version.version,
        key=key_of(version),
        external=external,
        artifacts=[
            ArtifactRef(
                name=a.name,
                uri=a.uri,
                sha256=a.sha256,
                size_bytes=a.size_bytes,
                format=a.format.value,
            )
            for a in chosen
        ],
    )


def server_version_id(server: Server, deployment: Deployment | None) -> int | None:
    """The version `server` serves: its own (a rollout moved it to the canary), else its
    deployment's current one (None: neither)."""
    if server.model_version_id is not None:
        return server.model_version_id
    return deployment.model_version_id if deployment is not None else None


def serving_key(
    session: Session, server: Server, deployment: Deployment | None = None
) -> str | None:
    """ "<model>@<version>" of the version `server` serves (its deployment's when not given is
    looked up from `server.deployment_id`); None when it serves none."""
    if deployment is None and server.deployment_id is not None:
        deployment = session.get(Deployment, server.deployment_id)
    return key_for_id(session, server_version_id(server, deployment))


def cache_entry(server: Server, key: str) -> dict[str, Any] | None:
    """What the server's agent last reported about `key` (a CachedVersion as a dict)."""
    for entry in server.cache_entries or ():
        if isinstance(entry, dict) and entry.get("key") == key:
            return entry
    return None


def cache_state(server: Server, key: str) -> str | None:
    """ "ready", "fetching" or "failed" as the agent last reported it; None: not in its cache."""
    entry = cache_entry(server, key)
    state = entry.get("state") if entry is not None else None
    return state if isinstance(state, str) else None


def holds_ready(server: Server, key: str) -> bool:
    """Whether the server's agent reported `key` verified in its cache."""
    return cache_state(server, key) == "ready"


def set_deployment_version(session: Session, deployment: Deployment, version: ModelVersion) -> None:
    """Make `version` the one the deployment serves, with `model_uri` (the model's name; the
    weights' URI for an external version, as before versions) and `model_checksum` (the
    version's digest: the probe's reference key) following it. The caller commits."""
    artifacts = artifacts_of(session, version)
    if is_external(artifacts) and len(artifacts) == 1:
        deployment.model_uri = artifacts[0].uri
    else:
        deployment.model_uri = version.model
    deployment.model_checksum = version.digest
    deployment.model_version_id = version.id
    deployment.updated_at = utcnow()
    session.add(deployment)
