"""Where a deployment's replicas run on one host, whatever the engine (pure): which GPUs each
replica gets, which port it listens on, how CUDA sees them, and where weights Fleet does not
fetch live."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse


def replica_layout(gpu_indexes: Sequence[int], gpus_per_replica: int) -> list[tuple[int, ...]]:
    """⌊GPUs ÷ GPUs per replica⌋ groups of consecutive GPU indexes (sorted); the rest stay idle.

    Fewer GPUs than one replica needs is a ValueError, not an empty layout: an empty set of
    replicas would read as "every replica ready".
    """
    if isinstance(gpus_per_replica, bool) or gpus_per_replica < 1:
        raise ValueError(f"gpus_per_replica must be a positive integer, not {gpus_per_replica!r}")
    gpus = sorted(gpu_indexes)
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GPU indexes repeat: {list(gpu_indexes)}")
    if any(g < 0 for g in gpus):
        raise ValueError(f"GPU indexes must not be negative: {list(gpu_indexes)}")
    count = len(gpus) // gpus_per_replica
    if count == 0:
        raise ValueError(
            f"{len(gpus)} GPU(s) cannot hold one replica of {gpus_per_replica} GPUs: "
            "no replica to run"
        )
    return [tuple(gpus[i * gpus_per_replica : (i + 1) * gpus_per_replica]) for i in range(count)]


def replica_ports(base_port: int, replicas: int) -> list[int]:
    """Replica i listens on base_port + i."""
    if replicas < 0 or base_port < 1 or base_port + replicas - 1 > 65535:
        raise ValueError(f"ports {base_port}..{base_port + replicas - 1} are out of range")
    return [base_port + i for i in range(replicas)]


def cuda_visible_devices(gpus: Sequence[int]) -> str:
    """The CUDA_VISIBLE_DEVICES value that pins a replica to its GPUs ("2,3")."""
    return ",".join(str(g) for g in gpus)


def model_path(model_root: Path, deployment: str, model_uri: str) -> Path:
    """Where a deployment's weights live on the host: model_root/<deployment>/<URI basename>.

    s3://bucket/llama-3.1-8b -> model_root/<deployment>/llama-3.1-8b. Fetching the weights (and
    checking model_checksum) happens before the engine starts and is not done here: on a real
    host the path must exist; the stand-in engine ignores it.
    """
    _check_name(deployment, "deployment")
    parsed = urlparse(model_uri)
    path = parsed.path if parsed.scheme else model_uri
    name = PurePosixPath(path.rstrip("/")).name or parsed.netloc
    _check_name(name, f"the basename of model_uri {model_uri!r}")
    return model_root / deployment / name


def _check_name(name: str, what: str) -> None:
    if not name or name in {".", ".."} or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{what} ({name!r}) cannot name a directory")
