"""The stand-in's checkpoint (fleet_agent/engine/standin/weights.py): what it refuses, what it
reads and how fast, and the bad-version behaviours of fleet-standin.json. The stand-in process
itself with weights: tests/e2e/test_agent_weights.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from fleet_agent.engine.standin.weights import (
    BEHAVIOUR_FILE,
    Behaviour,
    WeightsError,
    find_weights,
    load_behaviour,
    read_all,
    read_mb_s,
)


def checkpoint(tmp_path: Path, files: dict[str, bytes]) -> Path:
    root = tmp_path / "llama-3.1-8b"
    root.mkdir()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_checkpoint_directory_is_found_with_its_files(tmp_path: Path) -> None:
    root = checkpoint(
        tmp_path, {"config.json": b"{}", "shards/a.safetensors": b"x" * 1000, ".hidden": b"?"}
    )
    weights = find_weights(str(root), {})
    assert weights is not None
    assert weights.path == root and weights.bytes == 1002
    assert [p.name for p in weights.files] == ["config.json", "a.safetensors"]
    assert weights.behaviour == Behaviour() and not weights.behaviour.bad


def test_missing_or_empty_checkpoints_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds no files"):
        find_weights(str(tmp_path / "empty"), {})
    with pytest.raises(WeightsError, match="does not exist"):
        find_weights(str(tmp_path / "gone"), {})
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(WeightsError, match="not a checkpoint directory"):
        find_weights(str(tmp_path / "file"), {})
    # Allowed where nobody delivers weights Fleet does not fetch (the lab's external versions).
    assert find_weights(str(tmp_path / "gone"), {"FLEET_STANDIN_MISSING_WEIGHTS": "ignore"}) is None
    # A Hugging Face name is no path: nothing to read, as before.
    assert find_weights("meta-llama/Llama-3.1-8B", {}) is None


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({"errors": 0.5}, Behaviour(errors=0.5)),
        ({"slow": 3}, Behaviour(slow=3.0)),
        ({"wrong_answers": True}, Behaviour(wrong_answers=True)),
        ({"errors": 1, "slow": 2.5}, Behaviour(errors=1.0, slow=2.5)),
        ({}, Behaviour()),
    ],
)
def test_bad_version_behaviours(tmp_path: Path, content: object, expected: Behaviour) -> None:
    root = checkpoint(tmp_path, {"w.bin": b"x", BEHAVIOUR_FILE: json.dumps(content).encode()})
    weights = find_weights(str(root), {})
    assert weights is not None and weights.behaviour == expected
    assert weights.behaviour.bad == (expected != Behaviour())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"error": 0.5}', "unknown keys"),
        ('{"errors": 1.5}', "share from 0 to 1"),
        ('{"errors": true}', "share from 0 to 1"),
        ('{"slow": 0}', "positive number"),
        ('{"wrong_answers": "yes"}', "true or false"),
        ("[1]", "JSON object"),
        ("{not json", "not readable JSON"),
    ],
)
def test_bad_behaviour_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / BEHAVIOUR_FILE).write_text(text)
    with pytest.raises(WeightsError, match=message):
        load_behaviour(tmp_path)


def test_every_file_is_read_once(tmp_path: Path) -> None:
    root = checkpoint(tmp_path, {"a.bin": b"a" * (9 << 20), "b.bin": b"b" * 100})
    weights = find_weights(str(root), {})
    assert weights is not None
    done, seconds = read_all(weights)
    assert done == (9 << 20) + 100 and seconds >= 0


def test_the_read_rate_cap_models_a_slower_disk(tmp_path: Path) -> None:
    root = checkpoint(tmp_path, {"a.bin": b"a" * 3_000_000})
    weights = find_weights(str(root), {})
    assert weights is not None
    started = time.monotonic()
    done, seconds = read_all(weights, mb_s=10.0)  # 3 MB at 10 MB/s: at least 0.3 s
    assert done == 3_000_000
    assert 0.29 <= seconds <= time.monotonic() - started + 0.01
    assert read_mb_s({"FLEET_STANDIN_READ_MB_S": "250"}) == 250.0
    assert read_mb_s({}) is None
    for bad in ("fast", "0", "-1", "inf"):
        with pytest.raises(WeightsError, match="FLEET_STANDIN_READ_MB_S"):
            read_mb_s({"FLEET_STANDIN_READ_MB_S": bad})


def test_a_read_stops_when_asked(tmp_path: Path) -> None:
    root = checkpoint(tmp_path, {"a.bin": b"a" * (20 << 20)})
    weights = find_weights(str(root), {})
    assert weights is not None
    stop = threading.Event()
    stop.set()
    done, seconds = read_all(weights, mb_s=1.0, stop=stop)
    assert done == 8 << 20 and seconds < 1.0  # one read, and no wait for the rate cap
