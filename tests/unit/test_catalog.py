"""The catalog (fleet/catalog/) on both databases: model versions and their checks, the legacy
`external` versions, what a server's assignment says about versions, and the agents' cache
reports stored with an Event per change (fleet/registry/agent_reports.py)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import pytest
from factories import add_rack, add_server, add_site, walk_to
from pydantic import ValidationError
from sqlmodel import Session, col, select

from fleet.auth import Principal
from fleet.catalog import refs
from fleet.catalog import versions as catalog
from fleet.errors import ConflictError, FleetError, NotFoundError, RulesBroken
from fleet.inventory import deployments as deployments_service
from fleet.lifecycle.states import ServerState
from fleet.models import (
    ArtifactFormat,
    Deployment,
    DeploymentCreate,
    DeploymentUpdate,
    Event,
    ModelArtifact,
    ModelArtifactCreate,
    ModelVersion,
    ModelVersionCreate,
    Rack,
    Role,
    Server,
)
from fleet.registry import agent_reports
from fleet_core import weights
from fleet_core.wire import CachedVersion, CacheReport, Heartbeat

ACTOR = "operator:tests"
SHA_A = "a" * 64
SHA_B = "b" * 64
SHA_C = "c" * 64


def version_spec(
    version: str = "v1", model: str = "llama-8b", **artifact: Any
) -> ModelVersionCreate:
    files: list[dict[str, Any]] = [
        {
            "name": "config.json",
            "uri": "http://10.0.0.1/llama/config.json",
            "sha256": SHA_A,
            "size_bytes": 100,
        },
        {
            "name": "model.safetensors",
            "uri": "s3://weights/llama/model.safetensors",
            "sha256": SHA_B,
            "size_bytes": 5_000_000_000,
        },
    ]
    if artifact:
        files[0] = {**files[0], **artifact}
    return ModelVersionCreate.model_validate(
        {"model": model, "version": version, "artifacts": files}
    )


def create(session: Session, spec: ModelVersionCreate) -> ModelVersion:
    row = catalog.add_version(session, spec, ACTOR)
    session.commit()
    return row


def deployment_spec(**changes: Any) -> DeploymentCreate:
    base: dict[str, Any] = {
        "name": "chat",
        "engine_params": {"backend": "pytorch", "tp_size": 2, "pp_size": 1},
        "gpus_per_replica": 2,
        "gpu_models": ["H100"],
        "max_replicas": 4,
        "sla_p95_latency_ms": 2000,
        "sla_ttft_ms": 300,
    }
    return DeploymentCreate.model_validate(base | changes)


def problems(session: Session, spec: ModelVersionCreate) -> list[str]:
    before = len(session.exec(select(ModelVersion)).all())
    with pytest.raises(RulesBroken) as info:
        catalog.add_version(session, spec, ACTOR)
    session.rollback()
    assert len(session.exec(select(ModelVersion)).all()) == before  # nothing written
    return info.value.errors


# ---------------------------------------------------------------------------------------------
# Versions


def test_a_version_has_its_digest_size_and_files(session: Session) -> None:
    row = create(session, version_spec())
    expected = weights.digest([("config.json", SHA_A), ("model.safetensors", SHA_B)])
    assert (row.digest, row.size_bytes, row.created_by) == (expected, 5_000_000_100, ACTOR)
    shown = catalog.get_version(session, "llama-8b", "v1")
    assert shown.key == "llama-8b@v1" and not shown.external
    assert [a.name for a in shown.artifacts] == ["config.json", "model.safetensors"]
    event = session.exec(select(Event).where(Event.kind == "model.version_created")).one()
    assert (event.subject_type, event.subject) == ("model", "llama-8b@v1")
    create(session, version_spec("v2"))
    create(session, version_spec("v1", model="qwen-7b"))
    assert [v.key for v in catalog.list_versions(session)] == [
        "llama-8b@v1",
        "llama-8b@v2",
        "qwen-7b@v1",
    ]
    assert [v.key for v in catalog.list_versions(session, "qwen-7b")] == ["qwen-7b@v1"]


def test_the_digest_changes_with_any_file_and_with_the_gpu_an_engine_is_for(
    session: Session,
) -> None:
    one = catalog.version_digest(version_spec().artifacts)
    other = catalog.version_digest(version_spec(sha256=SHA_C).artifacts)
    built = catalog.version_digest(version_spec(gpu_model="H100", tp_size=2).artifacts)
    assert len({one, other, built}) == 3


@pytest.mark.parametrize(
    ("artifact", "expected"),
    [
        (
            {"uri": "ftp://host/x"},
            "artifacts[0].uri: unknown URI scheme 'ftp' (accepted: file://, http://, https://, "
            "s3://)",
        ),
        ({"uri": "just-a-path"}, "artifacts[0].uri: unknown URI no scheme (accepted:"),
        ({"sha256": "ABC"}, "artifacts[0].sha256: expected 64 lowercase hex digits"),
        ({"sha256": "A" * 64}, "artifacts[0].sha256: expected 64 lowercase hex digits"),
        ({"sha256": None}, "artifacts[0].sha256: required"),
        ({"size_bytes": None}, "artifacts[0].size_bytes: required"),
        ({"name": "../etc/passwd"}, "artifacts[0].name: must not contain '.', '..'"),
        ({"name": "/abs"}, "artifacts[0].name: must be a relative POSIX path"),
        ({"name": "model.safetensors/x"}, "artifacts[0].name: 'model.safetensors/x' lies under"),
        ({"uri": "s3://bucket"}, "artifacts[0].uri: an s3:// URI names a bucket and a key"),
        ({"uri": "file://host/x"}, "artifacts[0].uri: a file:// URI names an absolute path"),
        ({"uri": "https:///x"}, "artifacts[0].uri: an https:// URI names a host"),
        ({"gpu_model": "Z9000"}, "artifacts[0].gpu_model: unknown GPU model 'Z9000'"),
    ],
)
def test_bad_artifacts_are_400s_naming_the_place_and_what_to_give(
    session: Session, artifact: dict[str, Any], expected: str
) -> None:
    errors = problems(session, version_spec(**artifact))
    assert len(errors) == 1 and errors[0].startswith(expected), errors


def test_a_uri_with_a_credential_is_refused_without_echoing_it(session: Session) -> None:
    for uri in (
        "https://alice:hunter2-secret@host/w.bin",
        "https://host/w.bin?X-Amz-Signature=hunter2-secret&X-Amz-Credential=AKIA",
    ):
        errors = problems(session, version_spec(uri=uri))
        assert errors[0].startswith("artifacts[0].uri: no "), errors
        assert "hunter2" not in " ".join(errors)


@pytest.mark.parametrize(
    "uri",
    [
        "http://host:99999/w.bin",
        "https://host:65536/w.bin",
        "http://host:0/w.bin",
        "http://host:http/w.bin",
        "https://host:-1/w.bin",
        "s3://bucket:x/w.bin",
    ],
)
def test_a_uri_with_a_bad_port_is_a_400(session: Session, uri: str) -> None:
    """An agent's fetcher cannot use it: refused when the version is created, not found out
    on every agent."""
    with pytest.raises(RulesBroken) as info:
        catalog.add_version(session, version_spec(uri=uri), ACTOR)
    session.rollback()
    assert info.value.status_code == 400
    assert info.value.errors == [
        "artifacts[0].uri: the URI's port is not a port number (1-65535)"
    ], info.value.errors


def test_a_uri_with_a_good_port_is_taken(session: Session) -> None:
    create(session, version_spec(uri="https://host:8443/w.bin"))


def test_a_legacy_model_uri_with_a_credential_is_refused(session: Session) -> None:
    """Its external version's artifact is readable by every viewer: no password there."""
    from fleet.catalog.versions import external_version
    from fleet.errors import RulesBroken

    with pytest.raises(RulesBroken) as caught:
        external_version(session, "https://alice:hunter2-secret@host/llama", "sha256:1")
    assert caught.value.errors[0].startswith("model_uri: no user name or password")
    assert "hunter2" not in " ".join(caught.value.errors)


def test_bad_names_and_duplicates(session: Session) -> None:
    # A name that is no path component is refused by the schema itself (422).
    with pytest.raises(ValidationError, match="version"):
        version_spec(version="../v1")
    twice = version_spec()
    twice.artifacts.append(twice.artifacts[0])
    assert problems(session, twice) == [
        "artifacts[2].name: 'config.json' is already artifacts[0] for the same GPU model and "
        "TP size"
    ]
    create(session, version_spec())
    with pytest.raises(ConflictError, match="already exists: versions are immutable"):
        catalog.add_version(session, version_spec(), ACTOR)


def test_an_external_version_has_one_file_and_no_checksum_needed(session: Session) -> None:
    spec = ModelVersionCreate.model_validate(
        {
            "model": "old",
            "version": "v1",
            "artifacts": [{"name": "old", "uri": "file:///models/old", "format": "external"}],
        }
    )
    assert catalog.public(session, create(session, spec)).external
    two = version_spec(format="external", sha256=None)
    assert problems(session, two)[0].startswith("artifacts: an external version has exactly one")


def test_delete_refuses_a_version_in_use_and_removes_a_free_one(session: Session) -> None:
    used = create(session, version_spec())
    create(session, version_spec("v2"))
    deployments_service.create_deployment(
        session, deployment_spec(model_version="llama-8b@v1"), ACTOR
    )
    with pytest.raises(ConflictError, match=r"in use by deployment chat \(stable\)"):
        catalog.delete_version(session, "llama-8b", "v1", ACTOR)
    catalog.delete_version(session, "llama-8b", "v2", ACTOR)
    assert [v.key for v in catalog.list_versions(session)] == ["llama-8b@v1"]
    left = session.exec(select(ModelArtifact.version_id)).all()
    assert set(left) == {used.id}
    with pytest.raises(NotFoundError, match="no model version llama-8b@v2"):
        catalog.delete_version(session, "llama-8b", "v2", ACTOR)


# ---------------------------------------------------------------------------------------------
# Deployments: a version, or the legacy URI and checksum


def test_a_deployment_serves_a_version_with_its_identity(session: Session) -> None:
    version = create(session, version_spec())
    shown = deployments_service.create_deployment(
        session, deployment_spec(model_version="llama-8b@v1"), ACTOR
    )
    assert (shown.model_version, shown.model_uri, shown.model_checksum) == (
        "llama-8b@v1",
        "llama-8b",  # the name the engine serves it under (engine_path's base name)
        version.digest,
    )


def test_a_legacy_deployment_gets_an_external_version_reused_by_the_same_weights(
    session: Session,
) -> None:
    uri, checksum = "s3://fleet-models/meta/Llama-3.1-8B", "sha256:" + "d0" * 32
    shown = deployments_service.create_deployment(
        session, deployment_spec(model_uri=uri, model_checksum=checksum), ACTOR
    )
    # Named as migration 0012 names the versions of existing deployments.
    name = "legacy-" + hashlib.sha256(f"{uri}\n{checksum}".encode()).hexdigest()[:12]
    assert shown.model_version == f"Llama-3.1-8B@{name}"
    assert (shown.model_uri, shown.model_checksum) == (uri, checksum)
    again = deployments_service.create_deployment(
        session, deployment_spec(name="chat2", model_uri=uri, model_checksum=checksum), ACTOR
    )
    assert again.model_version == shown.model_version
    assert len(session.exec(select(ModelVersion)).all()) == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({}, 'model_version ("<model>@<version>", fleetctl models list) is required'),
        ({"model_uri": "s3://x/y"}, "is required, or both model_uri and model_checksum"),
        (
            {"model_version": "llama-8b@v1", "model_uri": "s3://x", "model_checksum": "c"},
            "give model_version or model_uri and model_checksum",
        ),
        ({"model_version": "llama-8b@v9"}, "model_version: no model version 'llama-8b@v9'"),
        ({"model_version": "llama-8b"}, "expected <model>@<version>"),
    ],
)
def test_a_deployment_without_a_clear_version_is_a_400(
    session: Session, changes: dict[str, Any], message: str
) -> None:
    create(session, version_spec())
    with pytest.raises(FleetError) as info:
        deployments_service.create_deployment(session, deployment_spec(**changes), ACTOR)
    assert info.value.status_code == 400 and message in str(info.value), str(info.value)


def test_patching_the_version_moves_the_identity_but_not_during_a_rollout(
    session: Session,
) -> None:
    create(session, version_spec())
    v2 = create(session, version_spec("v2", sha256=SHA_C))
    deployments_service.create_deployment(
        session, deployment_spec(model_version="llama-8b@v1"), ACTOR
    )
    shown = deployments_service.update_deployment(
        session, "chat", DeploymentUpdate(model_version="llama-8b@v2"), ACTOR
    )
    assert (shown.model_version, shown.model_checksum) == ("llama-8b@v2", v2.digest)
    row = session.exec(select(Deployment)).one()
    row.canary_version_id = row.model_version_id
    session.add(row)
    session.commit()
    with pytest.raises(ConflictError, match="is rolling out a version"):
        deployments_service.update_deployment(
            session, "chat", DeploymentUpdate(model_version="llama-8b@v1"), ACTOR
        )


# ---------------------------------------------------------------------------------------------
# refs: what a server serves and fetches


def _engines_version(session: Session) -> ModelVersion:
    spec = version_spec()
    spec.artifacts += [
        ModelArtifactCreate(
            name="rank0.engine",
            uri="http://10.0.0.1/e/h100-tp2",
            sha256=SHA_C,
            size_bytes=7,
            format=ArtifactFormat.TRTLLM_ENGINE,
            gpu_model="H100",
            tp_size=2,
        ),
        ModelArtifactCreate(
            name="rank0.engine",
            uri="http://10.0.0.1/e/l40s-tp2",
            sha256=SHA_A,
            size_bytes=7,
            format=ArtifactFormat.TRTLLM_ENGINE,
            gpu_model="L40S",
            tp_size=2,
        ),
    ]
    return create(session, spec)


def test_a_server_fetches_the_files_for_its_gpu_model_and_tp_size(session: Session) -> None:
    version = _engines_version(session)
    ref = refs.model_ref_for(session, version, "H100", 2)
    assert (ref.key, ref.external) == ("llama-8b@v1", False)
    assert [(a.name, a.uri) for a in ref.artifacts] == [
        ("config.json", "http://10.0.0.1/llama/config.json"),
        ("model.safetensors", "s3://weights/llama/model.safetensors"),
        ("rank0.engine", "http://10.0.0.1/e/h100-tp2"),
    ]
    assert [a.name for a in refs.model_ref_for(session, version, "H200", 2).artifacts] == [
        "config.json",
        "model.safetensors",
    ]


def _fleet(session: Session) -> tuple[Deployment, Server, ModelVersion, ModelVersion]:
    v1 = create(session, version_spec())
    v2 = create(session, version_spec("v2", sha256=SHA_C))
    deployments_service.create_deployment(
        session, deployment_spec(model_version="llama-8b@v1"), ACTOR
    )
    deployment = session.exec(select(Deployment)).one()
    rack = add_rack(session, add_site(session))
    server = add_server(session, rack, "gpu-a", deployment_id=deployment.id)
    return deployment, server, v1, v2


def test_the_assignment_names_the_version_the_server_serves(session: Session) -> None:
    deployment, server, v1, v2 = _fleet(session)
    assert agent_reports.assignment_for(session, server).kind == "none"
    walk_to(session, server, ServerState.LOADING)
    serve = agent_reports.assignment_for(session, server)
    assert serve.kind == "serve" and serve.model is not None
    assert (serve.model.key, serve.model_uri, serve.model_checksum) == (
        "llama-8b@v1",
        "llama-8b",
        v1.digest,
    )
    assert serve.keep == ["llama-8b@v1"] and serve.stage == []
    # A rollout: the deployment's canary is v2 and this server was moved to it.
    deployment.canary_version_id, server.model_version_id = v2.id, v2.id
    session.add_all([deployment, server])
    session.commit()
    assert refs.serving_key(session, server) == "llama-8b@v2"
    canary = agent_reports.assignment_for(session, server)
    assert canary.model is not None and canary.model.key == "llama-8b@v2"
    assert canary.model_checksum == v2.digest
    assert canary.keep == ["llama-8b@v1", "llama-8b@v2"]


def test_a_spare_asked_to_stage_gets_kind_stage(session: Session) -> None:
    _, server, _, v2 = _fleet(session)
    rack = session.get(Rack, server.rack_id)
    assert rack is not None
    spare = add_server(session, rack, "gpu-b", u_position=20, bmc_port=8001)
    assert agent_reports.assignment_for(session, spare).kind == "none"
    spare.stage_version_id = v2.id
    session.add(spare)
    session.commit()
    staged = agent_reports.assignment_for(session, spare)
    assert staged.kind == "stage" and [r.key for r in staged.stage] == ["llama-8b@v2"]
    assert staged.keep == ["llama-8b@v2"] and staged.model is None
    assert [a.name for a in staged.stage[0].artifacts] == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------------------------------------
# Heartbeats: the cache report stored, each change an Event once


def _beat(session: Session, server: Server, *entries: CachedVersion) -> None:
    principal = Principal(token_id=1, name="agent", role=Role.AGENT, server_id=server.id)
    report = Heartbeat(
        server=server.name,
        verdict="healthy",
        cache=CacheReport(
            budget_bytes=10**12,
            used_bytes=sum(e.bytes for e in entries),
            free_bytes=10**11,
            entries=list(entries),
        ),
    )
    agent_reports.heartbeat(session, principal, report, 5.0, peer="127.0.0.1")


def _kinds(session: Session, subject_type: str = "server") -> list[str]:
    return list(
        session.exec(
            select(Event.kind)
            .where(Event.subject_type == subject_type, col(Event.kind).contains("weights"))
            .order_by(col(Event.id))
        )
    )


def test_cache_reports_are_stored_and_each_change_is_one_event(session: Session) -> None:
    _, server, _, _ = _fleet(session)
    at = datetime(2026, 12, 2, tzinfo=UTC)
    fetching = CachedVersion(key="llama-8b@v1", state="fetching", bytes=10, total_bytes=99)
    _beat(session, server, fetching)
    _beat(session, server, fetching.model_copy(update={"bytes": 50, "resumes": 1}))
    ready = CachedVersion(
        key="llama-8b@v1",
        state="ready",
        bytes=99,
        total_bytes=99,
        verified_at=at,
        resumes=1,
        checksum_failures=1,
    )
    _beat(session, server, ready)
    _beat(session, server, ready)  # nothing new
    row = session.get(Server, server.id)
    assert row is not None and row.cache_used_bytes == 99 and row.cache_budget_bytes == 10**12
    assert refs.holds_ready(row, "llama-8b@v1") and row.cache_reported_at is not None
    assert _kinds(session) == [
        "server.weights_resumed",
        "server.weights_checksum_mismatch",
        "server.weights_ready",
    ]
    holders = catalog.version_holders(session, "llama-8b", "v1")
    assert [(h.server, h.state, h.bytes) for h in holders] == [("gpu-a", "ready", 99)]


def test_a_failed_version_is_one_event_on_the_server_and_each_deployment(
    session: Session,
) -> None:
    _, server, _, _ = _fleet(session)
    failed = CachedVersion(
        key="llama-8b@v1", state="failed", error="model.safetensors: sha256 mismatch twice"
    )
    for _ in range(3):
        _beat(session, server, failed)
    assert _kinds(session) == ["server.weights_failed"]
    event = session.exec(select(Event).where(Event.kind == "deployment.weights_failed")).one()
    assert (event.subject, event.message) == (
        "chat",
        "server gpu-a: llama-8b@v1: model.safetensors: sha256 mismatch twice",
    )
    # Another error later is news again.
    _beat(session, server, failed.model_copy(update={"error": "disk full"}))
    assert _kinds(session) == ["server.weights_failed", "server.weights_failed"]
