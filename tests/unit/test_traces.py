"""fleet.traces: the shipped Azure traces load as the README describes them."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from fleet.traces import load_trace


@pytest.mark.parametrize(("name", "count", "span"), [("code", 8819, 3436), ("conv", 19366, 3502)])
def test_shipped_traces(name: str, count: int, span: float) -> None:
    trace = load_trace(name)
    assert len(trace) == count
    assert trace[0].at_s == 0 and abs(trace[-1].at_s - span) < 1.0
    assert all(a.at_s <= b.at_s for a, b in pairwise(trace))
    assert all(r.prompt_tokens >= 0 and r.output_tokens >= 0 for r in trace)


def test_bad_traces_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="known: code, conv"):
        load_trace("nope")
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,x,1\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2"):
        load_trace(bad)
