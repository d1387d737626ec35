"""The catalog: model versions and their files (docs/weights.md).

A version is immutable: its files, their sha256 and sizes are what every agent verifies, and
its digest keys the quality probe's reference, so a changed file is a new version. Bad input
is refused before anything is written, each problem naming its place and what to give
instead; URIs never carry credentials (S3 keys live in the agents' settings), so that no
response, event or log line can show one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, or_, select

from fleet.errors import ConflictError, NotFoundError, RulesBroken
from fleet.models import (
    ArtifactFormat,
    Deployment,
    Event,
    GpuModelSpec,
    ModelArtifact,
    ModelArtifactCreate,
    ModelArtifactPublic,
    ModelVersion,
    ModelVersionCreate,
    ModelVersionPublic,
    Server,
    VersionHolder,
    utcnow,
)
from fleet_core.gpus import GPUS as BUILTIN  # fleet.inventory.gpu_models (no import cycle)
from fleet_core.weights import NAME_RE, SCHEMES, SHA256_PATTERN, artifact_name_problem, digest

from .refs import artifacts_of, is_external, key_of

_SHA256 = re.compile(SHA256_PATTERN)
# Query parameters that carry a credential (presigned URLs): a URI is shown in responses and
# events, so give s3:// and the agents' S3 settings instead.
_SECRET_PARAMS = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "signature",
        "awsaccesskeyid",
        "sig",
        "token",
        "access_token",
    }
)


def credential_problem(uri: str) -> str | None:
    """Why `uri` may not be stored where viewers read it: a user name or password, or a
    signature or token in its query (None: neither). Never echoes the URI."""
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        return f"not a URI ({exc})"
    if "@" in parts.netloc:
        return (
            "no user name or password in the URI (agents take S3 credentials from their "
            "settings: FLEET_AGENT_S3_*)"
        )
    if any(k.lower() in _SECRET_PARAMS for k, _ in parse_qsl(parts.query, keep_blank_values=True)):
        return "no signature or token in the URI's query (give s3://bucket/key instead)"
    return None


def uri_problem(uri: str) -> str | None:
    """Why an agent could not fetch `uri` safely (None: it can). Never echoes the URI: it may
    hold a credential."""
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        return f"not a URI ({exc})"
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        given = f"scheme {scheme!r}" if scheme else "no scheme"
        return f"unknown URI {given} (accepted: {', '.join(s + '://' for s in SCHEMES)})"
    problem = credential_problem(uri)
    if problem is not None:
        return problem
    try:
        port = parts.port  # a malformed port ("h:99999", "h:x") raises only when read
    except ValueError:
        port = 0
    if port == 0:  # urllib takes ":0"; no agent can connect there
        return "the URI's port is not a port number (1-65535)"
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            return "a file:// URI names an absolute path on the server (file:///path)"
    elif scheme == "s3":
        if not parts.netloc or not parts.path.strip("/"):
            return "an s3:// URI names a bucket and a key (s3://bucket/key)"
    elif not parts.hostname:
        return f"an {scheme}:// URI names a host"
    return None


def _known_gpu_models(session: Session) -> set[str]:
    return set(BUILTIN) | set(session.exec(select(GpuModelSpec.name)))


def artifact_problems(
    artifacts: Sequence[ModelArtifactCreate], known_gpus: set[str] | None, where: str = ""
) -> list[str]:
    """Every problem of a version's files, each with its place ("artifacts[2].sha256: …")."""
    problems: list[str] = []
    external = [a for a in artifacts if a.format is ArtifactFormat.EXTERNAL]
    if external and (len(external) != len(artifacts) or len(artifacts) != 1):
        problems.append(
            f"{where}artifacts: an external version has exactly one artifact (its weights "
            "are delivered outside Fleet): give the other files a version of their own"
        )
    seen: dict[tuple[str, str | None, int | None], int] = {}
    names = {a.name for a in artifacts}
    for i, a in enumerate(artifacts):
        place = f"{where}artifacts[{i}]"
        if (problem := artifact_name_problem(a.name)) is not None:
            problems.append(f"{place}.name: {problem}")
        else:
            parents = {str(p) for p in PurePosixPath(a.name).parents if str(p) != "."}
            if clash := sorted(parents & names):
                problems.append(
                    f"{place}.name: {a.name!r} lies under {clash[0]!r}, another artifact's "
                    "file: a path cannot be both a file and a directory"
                )
        if (problem := uri_problem(a.uri)) is not None:
            problems.append(f"{place}.uri: {problem}")
        if a.format is not ArtifactFormat.EXTERNAL:
            if a.sha256 is None:
                problems.append(f"{place}.sha256: required (64 lowercase hex digits)")
            elif not _SHA256.match(a.sha256):
                problems.append(
                    f"{place}.sha256: expected 64 lowercase hex digits (`sha256sum FILE`)"
                )
            if a.size_bytes is None:
                problems.append(f"{place}.size_bytes: required (the file's size in bytes)")
        elif a.sha256 is not None and not _SHA256.match(a.sha256):
            problems.append(f"{place}.sha256: expected 64 lowercase hex digits, or none")
        if a.gpu_model is not None and known_gpus is not None and a.gpu_model not in known_gpus:
            problems.append(
                f"{place}.gpu_model: unknown GPU model {a.gpu_model!r} "
                f"(known: {', '.join(sorted(known_gpus))})"
            )
        slot = (a.name, a.gpu_model, a.tp_size)
        if slot in seen:
            problems.append(
                f"{place}.name: {a.name!r} is already artifacts[{seen[slot]}] for the same "
                "GPU model and TP size"
            )
        seen.setdefault(slot, i)
    return problems


def version_problems(
    spec: ModelVersionCreate, known_gpus: set[str] | None, where: str = ""
) -> list[str]:
    problems = []
    for field in ("model", "version"):
        if not NAME_RE.match(getattr(spec, field)):
            problems.append(
                f"{where}{field}: 1-63 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit"
            )
    return problems + artifact_problems(spec.artifacts, known_gpus, where)


def _digest_name(a: ModelArtifactCreate | ModelArtifact) -> str:
    """An artifact's name in the digest: qualified by the GPU model and TP size it was built
    for, so that swapping two engines between GPU models is another version."""
    if a.gpu_model is None and a.tp_size is None:
        return a.name
    return f"{a.name}\0{a.gpu_model or '*'}\0{a.tp_size or '*'}"


def version_digest(artifacts: Sequence[ModelArtifactCreate | ModelArtifact]) -> str:
    return digest((_digest_name(a), a.sha256 or "") for a in artifacts)


def _rows(spec: ModelVersionCreate, actor: str) -> tuple[ModelVersion, list[ModelArtifact]]:
    version = ModelVersion(
        model=spec.model,
        version=spec.version,
        description=spec.description,
        digest=version_digest(spec.artifacts),
        size_bytes=sum(a.size_bytes or 0 for a in spec.artifacts),
        created_by=actor[:100],
        created_at=utcnow(),
    )
    artifacts = [
        ModelArtifact(
            version_id=0,
            name=a.name,
            uri=a.uri,
            sha256=a.sha256,
            size_bytes=a.size_bytes,
            format=a.format,
            gpu_model=a.gpu_model,
            tp_size=a.tp_size,
        )
        for a in spec.artifacts
    ]
    return version, artifacts


def _find(session: Session, model: str, version: str) -> ModelVersion | None:
    return session.exec(
        select(ModelVersion).where(ModelVersion.model == model, ModelVersion.version == version)
    ).first()


def get_row(session: Session, model: str, version: str) -> ModelVersion:
    row = _find(session, model, version)
    if row is None:
        raise NotFoundError(
            f"no model version {model}@{version} (fleetctl models list --model {model})"
        )
    return row


def row_for_key(session: Session, key: str, place: str = "model_version") -> ModelVersion:
    """The version a client names as "<model>@<version>"; 400 naming `place` otherwise (the
    client's input is wrong, not the URL)."""
    model, sep, version = key.partition("@")
    row = _find(session, model, version) if sep else None
    if row is None:
        hint = "" if sep else ": expected <model>@<version>"
        raise RulesBroken(
            [
                f"{place}: no model version {key[:140]!r}{hint} (fleetctl models list; create it "
                "with fleetctl models create)"
            ]
        )
    return row


def add_version(
    session: Session, spec: ModelVersionCreate, actor: str, *, known_gpus: set[str] | None = None
) -> ModelVersion:
    """Insert a checked version and its files (the caller commits): 409 if it exists."""
    problems = version_problems(
        spec, _known_gpu_models(session) if known_gpus is None else known_gpus
    )
    if problems:
        raise RulesBroken(problems)
    if _find(session, spec.model, spec.version) is not None:
        raise ConflictError(
            f"model version {spec.model}@{spec.version} already exists: versions are "
            "immutable, create another version name for other files"
        )
    version, artifacts = _rows(spec, actor)
    session.add(version)
    session.flush()
    assert version.id is not None
    for a in artifacts:
        a.version_id = version.id
        session.add(a)
    session.add(
        Event(
            subject_type="model",
            subject=key_of(version),
            actor=actor,
            kind="model.version_created",
            message=(f"{len(artifacts)} file(s), {version.size_bytes:,} bytes, {version.digest}"),
            details={"digest": version.digest, "files": len(artifacts)},
        )
    )
    return version


def same_content(session: Session, row: ModelVersion, spec: ModelVersionCreate) -> bool:
    """Whether an existing version has exactly the files `spec` gives (an inventory file
    re-imported), description aside."""
    have = sorted(_artifact_tuple(a) for a in artifacts_of(session, row))
    want = sorted(_artifact_tuple(a) for a in spec.artifacts)
    return have == want


def _artifact_tuple(a: ModelArtifact | ModelArtifactCreate) -> tuple[Any, ...]:
    return (a.name, a.uri, a.sha256, a.size_bytes, a.format.value, a.gpu_model, a.tp_size)


def create_version(session: Session, spec: ModelVersionCreate, actor: str) -> ModelVersionPublic:
    row = add_version(session, spec, actor)
    try:
        session.commit()
    except IntegrityError:  # the same version created by another request meanwhile
        session.rollback()
        raise ConflictError(f"model version {spec.model}@{spec.version} already exists") from None
    return public(session, row)


def public(session: Session, row: ModelVersion, *, detail: bool = False) -> ModelVersionPublic:
    artifacts = artifacts_of(session, row)
    out = ModelVersionPublic(
        key=key_of(row),
        model=row.model,
        version=row.version,
        description=row.description,
        digest=row.digest,
        size_bytes=row.size_bytes,
        external=is_external(artifacts),
        created_by=row.created_by,
        created_at=row.created_at,
        artifacts=[ModelArtifactPublic.model_validate(a.model_dump()) for a in artifacts],
    )
    if detail:
        out.deployments = _deployments_using(session, row)
        out.cached_on = holders(session, row)
    return out


def _deployments_using(session: Session, row: ModelVersion) -> list[dict[str, str]]:
    rows = session.exec(
        select(Deployment)
        .where(
            or_(
                col(Deployment.model_version_id) == row.id,
                col(Deployment.canary_version_id) == row.id,
            )
        )
        .order_by(col(Deployment.name))
    )
    return [
        {"deployment": d.name, "as": "stable" if d.model_version_id == row.id else "canary"}
        for d in rows
    ]


def holders(session: Session, row: ModelVersion) -> list[VersionHolder]:
    """Servers whose agent reported the version in its cache, in name order. The JSON column
    is read in Python: the fleet has thousands of servers, not millions."""
    key = key_of(row)
    out: list[VersionHolder] = []
    query = (
        select(Server).where(col(Server.cache_reported_at).is_not(None)).order_by(col(Server.name))
    )
    for server in session.exec(query):
        for entry in server.cache_entries or ():
            if isinstance(entry, dict) and entry.get("key") == key:
                out.append(
                    VersionHolder(
                        server=server.name,
                        state=str(entry.get("state", "")),
                        bytes=int(entry.get("bytes") or 0),
                        total_bytes=entry.get("total_bytes"),
                        verified_at=entry.get("verified_at"),
                        error=entry.get("error"),
                        reported_at=server.cache_reported_at,
                    )
                )
                break
    return out


def list_versions(session: Session, model: str | None = None) -> list[ModelVersionPublic]:
    query = select(ModelVersion).order_by(col(ModelVersion.model), col(ModelVersion.created_at))
    if model is not None:
        query = query.where(ModelVersion.model == model)
    rows = list(session.exec(query))
    files: dict[int, list[ModelArtifact]] = {}
    ids = [r.id for r in rows]
    if ids:
        for a in session.exec(
            select(ModelArtifact)
            .where(col(ModelArtifact.version_id).in_(ids))
            .order_by(col(ModelArtifact.name), col(ModelArtifact.id))
        ):
            files.setdefault(a.version_id, []).append(a)
    return [
        ModelVersionPublic(
            key=key_of(r),
            model=r.model,
            version=r.version,
            description=r.description,
            digest=r.digest,
            size_bytes=r.size_bytes,
            external=is_external(files.get(r.id or 0, [])),
            created_by=r.created_by,
            created_at=r.created_at,
            artifacts=[
                ModelArtifactPublic.model_validate(a.model_dump()) for a in files.get(r.id or 0, [])
            ],
        )
        for r in rows
    ]


def get_version(session: Session, model: str, version: str) -> ModelVersionPublic:
    return public(session, get_row(session, model, version), detail=True)


def version_holders(session: Session, model: str, version: str) -> list[VersionHolder]:
    return holders(session, get_row(session, model, version))


def delete_version(session: Session, model: str, version: str, actor: str) -> None:
    """Remove a version no deployment or server references (409 naming who does)."""
    row = get_row(session, model, version)
    users = [f"deployment {d['deployment']} ({d['as']})" for d in _deployments_using(session, row)]
    servers = session.exec(
        select(Server.name)
        .where(or_(col(Server.model_version_id) == row.id, col(Server.stage_version_id) == row.id))
        .order_by(col(Server.name))
        .limit(5)
    ).all()
    users += [f"server {name}" for name in servers]
    if users:
        raise ConflictError(
            f"model version {key_of(row)} is in use by {', '.join(users)}: move them to "
            "another version first"
        )
    for a in artifacts_of(session, row):
        session.delete(a)
    session.delete(row)
    session.add(
        Event(
            subject_type="model",
            subject=key_of(row),
            actor=actor,
            kind="model.version_deleted",
            message=f"{row.digest}",
        )
    )
    session.commit()


# ---------------------------------------------------------------------------------------------
# Legacy input: a bare model_uri and checksum


def legacy_model_name(uri: str) -> tuple[str, str]:
    """(model name, artifact name) for a weights URI given without a version: its basename, as
    migration 0012 named the versions of existing deployments."""
    parsed = urlsplit(uri)
    path = parsed.path if parsed.scheme else uri
    base = PurePosixPath(path.rstrip("/")).name or parsed.netloc or "model"
    model = re.sub(r"[^A-Za-z0-9._-]", "-", base).strip("._-")[:63].rstrip("._-") or "model"
    return model, base[:255] or "model"


def legacy_digest(checksum: str) -> str:
    """A legacy checksum as a version's digest (71 characters at most: a longer one is hashed,
    so one checksum always maps to one digest)."""
    if len(checksum) <= 71:
        return checksum
    return "sha256:" + hashlib.sha256(checksum.encode()).hexdigest()


def external_version(session: Session, uri: str, checksum: str, actor: str = "") -> ModelVersion:
    """The `external` version for weights named by a URI and a checksum (delivered outside
    Fleet, as before versions): the existing one with that URI and digest, or a new one named
    "legacy-<12 hex>" as migration 0012 names them. The caller commits."""
    problem = credential_problem(uri)
    if problem is not None:  # the version's artifact is readable by every viewer
        raise RulesBroken([f"model_uri: {problem}"])
    digest_ = legacy_digest(checksum)
    found = session.exec(
        select(ModelVersion)
        .join(ModelArtifact, col(ModelArtifact.version_id) == ModelVersion.id)
        .where(
            ModelArtifact.uri == uri,
            ModelArtifact.format == ArtifactFormat.EXTERNAL,
            ModelVersion.digest == digest_,
        )
        .order_by(col(ModelVersion.id))
    ).first()
    if found is not None:
        return found
    model, artifact = legacy_model_name(uri)
    version = "legacy-" + hashlib.sha256(f"{uri}\n{checksum}".encode()).hexdigest()[:12]
    existing = _find(session, model, version)
    if existing is not None:  # same name, other content: cannot happen short of a collision
        raise ConflictError(f"model version {model}@{version} exists with other weights")
    row = ModelVersion(
        model=model,
        version=version,
        description="weights delivered outside Fleet (model_uri and checksum)",
        digest=digest_,
        size_bytes=0,
        created_by=(actor or "fleet")[:100],
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    assert row.id is not None
    session.add(
        ModelArtifact(version_id=row.id, name=artifact, uri=uri, format=ArtifactFormat.EXTERNAL)
    )
    session.flush()
    return row
