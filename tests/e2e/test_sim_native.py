"""The compiled simulator (fleet/sim/native.py): built by its own command, loaded only where
asked, and the same to the bit as the Python modules it is compiled from.

The build (mypyc, about a minute here) is cached per source version, so a second run of the
suite reuses it. Each side runs in a process of its own: a process holds one build of the hot
modules, and the test process keeps the Python ones (conftest sets FLEET_SIM_NATIVE=off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import ROOT

from fleet.data import SCENARIOS_DIR
from fleet.sim import native

FLEETCTL = str(Path(sys.executable).with_name("fleetctl"))

# Every request's story (its replica, its times, its fate) and the run's own report, for a
# scenario cut to `cut` seconds of arrivals (Xids per GPU-hour set to `xids` when > 0), under
# the variants named; printed as JSON.
RUN = """
import json, sys
from fleet.sim import native
mode, path, variants = sys.argv[1], sys.argv[2], sys.argv[5:]
cut, xids = float(sys.argv[3]), float(sys.argv[4])
if mode == "native":
    why = native.enable()
    assert why is None, why
from fleet.sim import scenario as sim
loaded = sim.load(path)
if xids > 0:
    faults = loaded.faults.model_copy(update={"xids_per_gpu_hour": xids})
    loaded = loaded.model_copy(update={"faults": faults})
requests = [r for r in sim.generate(loaded) if r.arrival < cut]
out = {"active": native.active(), "runs": {}}
for variant in variants or [""]:
    named = variant in loaded.variants
    scenario = loaded.variant(variant) if named else loaded
    strategy, batching = sim.parse_variant(variant) if variant and not named else (None, None)
    result = sim.run_requests(scenario, requests, strategy=strategy, batching=batching)
    index = {id(e): k for k, (_, e) in enumerate(result.engines)}
    out["runs"][variant] = {
        "requests": [
            [r.rid, index.get(r.engine, -1), repr(r.routed), repr(r.start),
             repr(r.first_token), repr(r.finish), r.failed, r.retries]
            for r in result.requests
        ],
        "report": sim.report(result),
        "timeline": [repr(p) for p in result.timeline],
        "busy": [repr(e.busy_s) for _, e in result.engines],
        "power": None if result.power is None else [
            [repr(w) for w in rack.drawn_w] for rack in result.power.racks
        ],
    }
print(json.dumps(out))
"""

CASES = [
    # every strategy, and static batching, over mixed GPUs
    (
        "mixed-code.yaml",
        1e9,
        0.0,
        [
            "round_robin",
            "least_pending",
            "least_kv",
            "estimated_completion_time",
            "model_affinity",
            "estimated_completion_time/static",
        ],
    ),
    # racks, placement, autoscaling into the spike (at 1,800 s) and out of spares; Xids at a
    # rate that, in 35 minutes, restarts an engine (losing streams), self-drains two replicas,
    # power-cycles one and quarantines the other
    ("racks-faults.yaml", 2100.0, 6.0, []),
    # the calendar's floor ahead of a launch
    ("launch-calendar.yaml", 2100.0, 0.0, []),
    # drawn power priced per block by the power model, nameplate and measured racks (the boots
    # finish at ~10 min)
    ("rack-power.yaml", 720.0, 0.0, ["nameplate", "measured"]),
]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "FLEET_SIM_NATIVE": "auto", **extra}


@pytest.fixture(scope="module")
def built() -> Path:
    """`fleetctl simulate-compile`, for real (a no-op when this version is built already)."""
    done = subprocess.run(
        [FLEETCTL, "simulate-compile"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("compiled in "), done.stdout
    assert native.is_built()
    return native.build_dir()


def _run(mode: str, scenario: str, cut: float, xids: float, variants: list[str]) -> dict[str, Any]:
    path = str(SCENARIOS_DIR / scenario)
    done = subprocess.run(
        [sys.executable, "-c", RUN, mode, path, str(cut), str(xids), *variants],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize(("scenario", "cut", "xids", "variants"), CASES, ids=[c[0] for c in CASES])
def test_compiled_runs_give_the_same_requests_to_the_bit(
    built: Path, scenario: str, cut: float, xids: float, variants: list[str]
) -> None:
    fast = _run("native", scenario, cut, xids, variants)
    slow = _run("pure", scenario, cut, xids, variants)
    assert fast["active"] is True and slow["active"] is False
    assert fast["runs"].keys() == slow["runs"].keys()
    report = " ".join(line for run in slow["runs"].values() for line in run["report"])
    if xids:  # the fault paths ran
        for path in ("1 engine restarts", "2 self-drains", "1 power cycles", "1 quarantined"):
            assert path in report
    for variant, run in slow["runs"].items():
        assert len(run["requests"]) > 100
        assert any(r[5] != "nan" for r in run["requests"])  # requests finished
        assert fast["runs"][variant] == run, f"{scenario} {variant or '(as written)'} differs"


def test_simulate_says_which_build_runs(built: Path) -> None:
    scenario = str(SCENARIOS_DIR / "mixed-code.yaml")
    runs = {}
    for flags in ([], ["--pure"]):
        done = subprocess.run(
            [FLEETCTL, "simulate", scenario, *flags],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        runs[bool(flags)] = done
    assert runs[False].stderr.startswith("simulator: compiled (mypyc)")
    assert runs[True].stderr.startswith("simulator: Python (--pure)")
    assert runs[False].stdout == runs[True].stdout  # the same table and report


def test_a_stale_or_missing_build_is_never_loaded(tmp_path: Path) -> None:
    """Another cache (as after a source edit: a new key) holds no build: the simulator says
    so and stays in Python; with FLEET_SIM_NATIVE=off it does not look."""
    code = "from fleet.sim import native; print(native.enable()); import fleet.sim.core; " + (
        "print(native.active())"
    )
    for extra, said in (
        ({"FLEET_SIM_NATIVE_DIR": str(tmp_path)}, "not compiled for these sources"),
        ({"FLEET_SIM_NATIVE": "off"}, "FLEET_SIM_NATIVE is off"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=_env(**extra),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        lines = done.stdout.splitlines()
        assert lines[0].startswith(said) and lines[1] == "False"


def test_the_build_key_follows_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = native.key()
    assert native.key() == before  # stable
    copy = tmp_path / "fleet" / "sim"
    copy.mkdir(parents=True)
    for path in native.sources():
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    monkeypatch.setattr(native, "_ROOT", tmp_path)
    assert native.key() == before  # the same bytes elsewhere: the same build
    engine = tmp_path / "fleet" / "sim" / "engine.py"
    engine.write_text(engine.read_text() + "\n# an edit\n")
    assert native.key() != before  # an edit: a build of its own


def test_enable_refuses_once_a_hot_module_is_imported() -> None:
    import fleet.sim.core  # noqa: F401  (the test process's Python modules)

    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLEET_SIM_NATIVE", "auto")
        env.setattr(native, "is_built", lambda: True)
        why = native.enable()
    assert why is not None and "already imported as Python" in why
    assert not native.enabled()
