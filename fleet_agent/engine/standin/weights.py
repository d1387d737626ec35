"""The stand-in's weights: the checkpoint directory it is started on, read for real at load,
and the "bad version" behaviour a version's `fleet-standin.json` asks for (docs/engine.md,
"Weights and bad versions").

trtllm-serve loads a checkpoint directory before it listens; a directory that is missing or
holds no files is an error there, and so it is here. The stand-in reads every file once (real
disk reads, optionally capped at FLEET_STANDIN_READ_MB_S to model a slower disk), so a model
served from the agent's weights cache loads in the time its files take to read, plus
FLEET_STANDIN_LOAD_S. A model argument that is not a path (a Hugging Face name) reads nothing,
as before; FLEET_STANDIN_MISSING_WEIGHTS=ignore serves an absolute path that does not exist
without weights (the agent sets it for weights Fleet does not fetch, on hosts without GPUs).

`fleet-standin.json`, one of a version's files, makes the version a bad one for tests and the
demo: {"errors": 0.5} answers that share of generation requests with HTTP 500 (trtllm-serve's
error body), {"slow": 3.0} makes every iteration take 3 times as long, {"wrong_answers": true}
makes greedy answers nondeterministic (the quality probe then mismatches). Unknown keys are
refused: a typo must not make a bad version good.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEHAVIOUR_FILE = "fleet-standin.json"
MISSING_ENV = "FLEET_STANDIN_MISSING_WEIGHTS"
READ_ENV = "FLEET_STANDIN_READ_MB_S"
_READ_CHUNK = 8 << 20


class WeightsError(Exception):
    """The checkpoint cannot be loaded: one line saying why."""


@dataclass(frozen=True)
class Behaviour:
    errors: float = 0.0  # share of generation requests answered 500
    slow: float = 1.0  # iteration time multiplier
    wrong_answers: bool = False

    @property
    def bad(self) -> bool:
        return self.errors > 0 or self.slow != 1.0 or self.wrong_answers

    def describe(self) -> str:
        parts = []
        if self.errors:
            parts.append(f"{self.errors:.0%} of requests fail (HTTP 500)")
        if self.slow != 1.0:
            parts.append(f"{self.slow:g}x slower")
        if self.wrong_answers:
            parts.append("wrong answers")
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class Weights:
    path: Path
    files: tuple[Path, ...]
    bytes: int
    behaviour: Behaviour


def find_weights(model: str, env: Mapping[str, str]) -> Weights | None:
    """The checkpoint directory `model` names, or None when it names none (a Hugging Face
    name, or a missing path allowed by FLEET_STANDIN_MISSING_WEIGHTS=ignore)."""
    path = Path(model)
    if path.is_dir():
        files = tuple(
            sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        )
        if not files:
            raise WeightsError(f"checkpoint directory {path} holds no files: nothing to load")
        size = sum(p.stat().st_size for p in files)
        return Weights(path, files, size, load_behaviour(path))
    if path.exists():
        raise WeightsError(f"{path} is not a checkpoint directory")
    if not path.is_absolute():
        return None  # a Hugging Face name: trtllm-serve would download it
    if (env.get(MISSING_ENV) or "").lower() == "ignore":
        return None
    raise WeightsError(
        f"checkpoint directory {path} does not exist ({MISSING_ENV}=ignore serves without it)"
    )


def load_behaviour(directory: Path) -> Behaviour:
    path = directory / BEHAVIOUR_FILE
    try:
        raw: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return Behaviour()
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    unknown = sorted(set(raw) - {"errors", "slow", "wrong_answers"})
    if unknown:
        raise WeightsError(f"{path}: unknown keys {unknown} (errors, slow, wrong_answers)")
    errors, slow, wrong = raw.get("errors", 0.0), raw.get("slow", 1.0), raw.get("wrong_answers")
    if isinstance(errors, bool) or not isinstance(errors, int | float) or not 0 <= errors <= 1:
        raise WeightsError(f"{path}: errors must be a share from 0 to 1")
    if (
        isinstance(slow, bool)
        or not isinstance(slow, int | float)
        or not (math.isfinite(slow) and slow > 0)
    ):
        raise WeightsError(f"{path}: slow must be a positive number (a time multiplier)")
    if wrong is not None and not isinstance(wrong, bool):
        raise WeightsError(f"{path}: wrong_answers must be true or false")
    return Behaviour(float(errors), float(slow), bool(wrong))


def read_mb_s(env: Mapping[str, str]) -> float | None:
    raw = env.get(READ_ENV)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise WeightsError(f"{READ_ENV}={raw!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise WeightsError(f"{READ_ENV}={raw!r} must be a positive number of MB/s")
    return value


def read_all(
    weights: Weights, mb_s: float | None = None, stop: threading.Event | None = None
) -> tuple[int, float]:
    """Read every file once, at most `mb_s` MB/s (10^6 bytes). Returns (bytes, seconds);
    stops early when `stop` is set. WeightsError when a file cannot be read."""
    started = time.monotonic()
    done = 0
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    for path in weights.files:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise WeightsError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            with open(fd, "rb", buffering=0, closefd=True) as f:
                while n := f.readinto(view):
                    done += n
                    if stop is not None and stop.is_set():
                        return done, time.monotonic() - started
                    if mb_s is not None:
                        ahead = done / (mb_s * 1e6) - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
        except OSError as exc:
            raise WeightsError(f"cannot read {path}: {exc.strerror or exc}") from None
    return done, time.monotonic() - started
