"""tests/failure_reports.py: a failure whose long traceback cannot be made (CPython 3.11.7's
`ast.parse` bug, simulated by a conftest that makes pytest's statement-range parse raise it)
still reports its own message, and the run goes on — under xdist, as `./run test` runs. The
same module without the plugin loses the failure (the control)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT

BROKEN_PARSE = """
import _pytest._code.code as code

def _broken(*args, **kwargs):
    raise SystemError("AST constructor recursion depth mismatch (before=48, after=47)")

code.getstatementrange_ast = _broken  # what the long traceback calls per frame
"""

FAILING = """
def test_fails():
    served = {"llama": 1}
    assert served["llama"] == 2, "the deliberate failure's own message"


def test_after():
    assert True
"""


def _pytest(tmp_path: Path, *plugins: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(BROKEN_PARSE)
    (tmp_path / "test_deliberate.py").write_text(FAILING)
    args = [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q"]
    for plugin in plugins:
        args += ["-p", plugin]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    return subprocess.run(
        [*args, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_failure_whose_traceback_cannot_be_made_still_reports_itself(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "failure_reports")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out  # tests failed: not 3 (internal error)
    assert "INTERNALERROR" not in out
    assert "the deliberate failure's own message" in out
    assert "assert 1 == 2" in out
    assert "1 failed, 1 passed" in out
    assert "could not be made" in out and "AST constructor recursion depth mismatch" in out


def test_without_the_plugin_the_failure_is_lost(tmp_path: Path) -> None:
    """The control: the simulated bug does what the real one did."""
    done = _pytest(tmp_path)
    out = done.stdout + done.stderr
    assert "INTERNALERROR" in out
    assert "1 failed" not in out
