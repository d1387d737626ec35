"""Data the wheel carries: the Azure traces, the bundled scenarios and the demo inventory.

Code finds them here, never through the checkout's layout, so an installed `fleetctl demo` or
`fleetctl simulate` works from any directory (docs/development.md, "The wheel").
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TRACES_DIR = DATA_DIR / "traces"
SCENARIOS_DIR = DATA_DIR / "scenarios"
DEMO_INVENTORY = DATA_DIR / "inventory" / "demo.yaml"


def bundled_scenarios() -> list[str]:
    """The names of the scenarios that ship with Fleet (`racks-faults`, ...)."""
    return sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))


def scenario_path(name_or_path: str | Path) -> Path:
    """A scenario file: the path as given when it exists, else a bundled scenario's name."""
    path = Path(name_or_path)
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path
    return SCENARIOS_DIR / f"{path.name}.yaml"
