"""Where the repository's files are, for test modules in tests/, tests/unit/ and tests/e2e/ alike
(not a test module: `from repo_paths import ROOT`, as they import factories)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
