"""The records an agent leaves about its engines (records.py) and the leash (leash.py) that
stops an engine whose agent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet_agent.engine.leash import lease_age
from fleet_agent.engine.records import (
    AdoptedProcess,
    EngineRecord,
    fingerprint,
    is_running,
    process_start_time,
    read_record,
    write_record,
)

RECORD = EngineRecord(
    pid=123,
    start_time=456,
    port=8100,
    index=0,
    deployment="llama-8b",
    engine="vllm",
    version="llama@v1",
    identity="abc",
)


def test_record_round_trip_and_torn_files(tmp_path: Path) -> None:
    path = tmp_path / "d" / "replica-0.json"
    write_record(path, RECORD)
    assert read_record(path) == RECORD
    assert not list(path.parent.glob("*.tmp"))
    path.write_text('{"pid": 1')  # torn
    assert read_record(path) is None
    path.write_text('{"pid": 1}')  # fields missing
    assert read_record(path) is None
    assert read_record(tmp_path / "absent.json") is None
    with pytest.raises(ValueError, match="not an engine record"):
        EngineRecord.from_json("[]")


def test_fingerprint_tells_assignments_and_argv_apart() -> None:
    assert fingerprint("a", ["x"]) == fingerprint("a", ["x"])
    assert fingerprint("a", ["x"]) != fingerprint("b", ["x"])
    assert fingerprint("a", ["x"]) != fingerprint("a", ["x", "y"])


def test_a_process_is_known_by_pid_and_start_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_start_time(child.pid)
        assert started is not None and started >= (process_start_time(os.getpid()) or 0)
        assert is_running(child.pid, started)
        assert not is_running(child.pid, started + 1)  # a recycled pid is another process
        adopted = AdoptedProcess(child.pid, started)
        assert adopted.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            adopted.wait(timeout=0.1)
        child.kill()
        child.wait()
        assert adopted.poll() == -1 and adopted.wait(timeout=1.0) == -1
    finally:
        child.kill()
        child.wait()
    assert process_start_time(2**22 + 17) is None


def test_a_comm_with_parentheses_and_spaces(tmp_path: Path) -> None:
    script = tmp_path / "odd ) name"
    script.symlink_to(sys.executable)
    child = subprocess.Popen([str(script), "-c", "import time; time.sleep(30)"])
    try:
        started = process_start_time(child.pid)
        assert started is not None and is_running(child.pid, started)
    finally:
        child.kill()
        child.wait()


def test_lease_age(tmp_path: Path) -> None:
    lease = tmp_path / "lease"
    assert lease_age(str(lease), 110.0, 100.0) == 10.0  # absent: since the leash started
    lease.touch()
    os.utime(lease, (50.0, 50.0))
    assert lease_age(str(lease), 110.0, 100.0) == 60.0


def _leash(lease: Path, bound: float, *command: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "fleet_agent.engine.leash", "--lease", str(lease)]
    argv += ["--bound", str(bound), "--grace", "2", "--", *command]
    return subprocess.Popen(argv, start_new_session=True, stderr=subprocess.PIPE)


SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


def test_the_leash_passes_the_engines_exit_status(tmp_path: Path) -> None:
    leash = _leash(tmp_path / "lease", 300, sys.executable, "-c", "raise SystemExit(3)")
    assert leash.wait(timeout=30) == 3


def test_the_leash_forwards_sigterm(tmp_path: Path) -> None:
    (tmp_path / "lease").touch()
    leash = _leash(tmp_path / "lease", 300, *SLEEPER)
    time.sleep(0.5)  # the engine started (a SIGTERM before that ends the leash itself: 143 too)
    os.kill(leash.pid, signal.SIGTERM)  # the leash alone, not its group
    assert leash.wait(timeout=30) == 128 + signal.SIGTERM


def test_an_untouched_lease_stops_the_engine(tmp_path: Path) -> None:
    lease = tmp_path / "lease"
    lease.touch()
    leash = _leash(lease, 0.5, *SLEEPER)
    assert leash.wait(timeout=30) == 128 + signal.SIGTERM
    assert leash.stderr is not None
    assert b"untouched for over 0.5 s (agent gone)" in leash.stderr.read()


def test_a_touched_lease_keeps_the_engine(tmp_path: Path) -> None:
    lease = tmp_path / "lease"
    leash = _leash(lease, 1.0, sys.executable, "-c", "import time; time.sleep(2.5)")
    for _ in range(60):  # touch for 3 s: longer than the bound, as an agent would
        lease.touch()
        if leash.poll() is not None:
            break
        time.sleep(0.05)
    assert leash.wait(timeout=30) == 0  # it ran to its own end


def test_the_leash_wants_a_command(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "fleet_agent.engine.leash", "--lease", "x", "--bound", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "no engine command" in done.stderr
