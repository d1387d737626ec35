"""Model versions as both sides name them (pure): the cache key, the digest, which of a
version's files a server fetches, and where the agent's cache keeps them (docs/weights.md).

The fleet computes the digest and picks the artifacts for a server's assignment
(fleet/catalog/); the agent lays its cache out with `version_dir` and starts engines on
`engine_path`, whose base name is the model's name: trtllm-serve (and the stand-in) serve a
checkpoint directory under its base name, so every version of a model answers to one name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Protocol, TypeVar

SCHEMES = ("file", "http", "https", "s3")
SHA256_PATTERN = r"^[0-9a-f]{64}$"
# A model's or version's name: safe as one path component.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ArtifactLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def gpu_model(self) -> str | None: ...
    @property
    def tp_size(self) -> int | None: ...


def version_key(model: str, version: str) -> str:
    """The one name of a version on the wire and in the cache: "<model>@<version>"."""
    return f"{model}@{version}"


def split_key(key: str) -> tuple[str, str]:
    model, sep, version = key.partition("@")
    if not sep or not NAME_RE.match(model) or not NAME_RE.match(version):
        raise ValueError(f"not a model version key: {key[:140]!r}")
    return model, version


def digest(artifacts: Iterable[tuple[str, str]]) -> str:
    """The "sha256:<hex>" digest over (name, sha256) pairs, in name order: a version's identity."""
    h = hashlib.sha256()
    for name, sha in sorted(artifacts):
        h.update(f"{name}\0{sha}\n".encode())
    return "sha256:" + h.hexdigest()


def artifact_name_problem(name: str) -> str | None:
    """Why `name` cannot be a file's path inside a version's directory (None: it can)."""
    if not name or len(name) > 255:
        return "must be 1-255 characters"
    if "\\" in name or "\0" in name or name.startswith("/"):
        return "must be a relative POSIX path"
    parts = PurePosixPath(name).parts
    if any(p in (".", "..") or p.startswith(".") for p in parts):
        return "must not contain '.', '..' or hidden components"
    return None


A = TypeVar("A", bound=ArtifactLike)


def for_server(artifacts: Sequence[A], gpu_model: str, tp_size: int) -> list[A]:
    """The files a server of `gpu_model` serving at `tp_size` fetches: every file built for
    no GPU model in particular, plus those built for this one (an engine built for another GPU
    model or TP size is useless there). Where both exist under one name, the specific wins."""
    chosen: dict[str, A] = {}
    for a in artifacts:
        if a.gpu_model not in (None, gpu_model) or a.tp_size not in (None, tp_size):
            continue
        held = chosen.get(a.name)
        specific = (a.gpu_model is not None) + (a.tp_size is not None)
        if held is None or specific > (held.gpu_model is not None) + (held.tp_size is not None):
            chosen[a.name] = a
    return [chosen[n] for n in sorted(chosen)]


def version_dir(cache_dir: Path, key: str) -> Path:
    """A version's directory in the cache: <cache>/<model>/<version>/."""
    model, version = split_key(key)
    return cache_dir / model / version


def engine_path(cache_dir: Path, key: str) -> Path:
    """The checkpoint directory an engine starts on: <cache>/<model>/<version>/<model>/ (its
    base name is the model's: the name the engine serves it under)."""
    model, _ = split_key(key)
    return version_dir(cache_dir, key) / model
