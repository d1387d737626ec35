"""What the agent leaves behind about each engine it starts, so that the next agent (after a
crash or SIGKILL) can adopt it instead of starting another on the same port.

One JSON record per replica in the deployment's work dir (replica-<i>.json), written
atomically at spawn: the pid (the leash's, see leash.py), that process's start time (field 22
of /proc/<pid>/stat, so a recycled pid is never taken for the engine), the port, and what the
engine runs (deployment, engine, model version, a hash of the assignment's identity and argv).
An adopted engine is not the new agent's child: `AdoptedProcess` polls it by pid and start
time instead of waitpid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

RECORD_GLOB = "replica-*.json"


class EngineProcess(Protocol):
    """What the supervisor needs of an engine's process: a child (subprocess.Popen) or an
    adopted one (AdoptedProcess)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRecord:
    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    port: int
    index: int
    deployment: str
    engine: str
    version: str | None  # the model version key, when the assignment named one
    identity: str  # fingerprint(): the assignment, GPU layout and argv it was started for

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineRecord:
        """ValueError when `text` is not a record (a torn or foreign file)."""
        try:
            data: Any = json.loads(text)
            record = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
        except (TypeError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"not an engine record: {exc}") from None
        # Types checked: a pid that is a string would reach os.killpg.
        numbers = (record.pid, record.start_time, record.port, record.index)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise ValueError("not an engine record: pid, start_time, port, index not integers")
        if record.pid < 2 or not 1 <= record.port <= 65535:
            raise ValueError("not an engine record: pid or port out of range")
        texts = (record.deployment, record.engine, record.identity)
        if not all(isinstance(t, str) for t in texts) or not isinstance(record.version, str | None):
            raise ValueError("not an engine record: names are not strings")
        return record


def fingerprint(identity: str, argv: list[str]) -> str:
    """One short hash of what a replica was started for."""
    text = json.dumps([identity, argv], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (starttime), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after
    # the last ')'. Fields from 3 on follow; starttime is field 22.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def is_running(pid: int, start_time: int) -> bool:
    """The process `pid` exists, is the one that started at `start_time`, and is not a zombie."""
    if process_start_time(pid) != start_time:
        return False
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2 :].split()[:1] != ["Z"]
    return False


def write_record(path: Path, record: EngineRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(record.to_json())
    os.replace(tmp, path)


def read_record(path: Path) -> EngineRecord | None:
    """The record at `path`; None when absent or unreadable."""
    try:
        return EngineRecord.from_json(path.read_text())
    except (OSError, ValueError):
        return None


def remove_record(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def find_records(work_dir: Path) -> list[Path]:
    """Every record under work_dir/<deployment>/."""
    return sorted(work_dir.glob(f"*/{RECORD_GLOB}"))


class AdoptedProcess:
    """An engine a previous agent started: polled by pid and start time (it is not our child,
    so its exit status is unknown: poll() answers -1 once it is gone)."""

    def __init__(self, pid: int, start_time: int) -> None:
        self._pid = pid
        self.start_time = start_time
        self._code: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        if self._code is None and not is_running(self._pid, self.start_time):
            self._code = -1
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self._pid}", timeout or 0.0)
            time.sleep(0.05)
        return code
