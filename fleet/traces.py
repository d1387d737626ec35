"""The Azure LLM inference traces in fleet/data/traces/ (CC BY 4.0; attribution in
fleet/data/traces/README.md).

Each row: when a request arrived, its prompt tokens and its output tokens. Benchmarks, the
simulator and the demo replay them, faster or scaled when they say so.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from fleet.data import TRACES_DIR

TRACES = {
    "code": TRACES_DIR / "azure-llm-2023-code.csv",
    "conv": TRACES_DIR / "azure-llm-2023-conv.csv",
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float  # seconds after the trace's first request
    prompt_tokens: int
    output_tokens: int


def load_trace(name_or_path: str | Path) -> list[TraceRequest]:
    """A trace by name ("code", "conv") or path, in arrival order."""
    path = TRACES.get(str(name_or_path), Path(name_or_path))
    if not path.is_file():
        known = ", ".join(sorted(TRACES))
        raise FileNotFoundError(f"no trace {name_or_path!r} (known: {known}, or a CSV path)")
    rows: list[tuple[datetime, int, int]] = []
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path.name}:{line}: not a trace row ({exc})") from exc
    if not rows:
        return []
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [TraceRequest((t - start).total_seconds(), p, o) for t, p, o in rows]
