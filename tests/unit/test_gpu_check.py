"""bench/gpu_check.py's telemetry half, on nvidia-ml-py's own structures without a GPU
(tests/nvml_standin.py): what it will do on a lent GPU machine, short of the driver."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from nvml_standin import NvmlStandIn

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_telemetry_reads_every_gpu_and_judges_them(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    args = argparse.Namespace(out=tmp_path, seconds=0.0, interval=0.0)
    summary: dict[str, Any] = {}
    assert gpu_check.telemetry(args, summary, NvmlStandIn())
    report = summary["telemetry"]
    assert report["snapshots"] == 1 and len(report["gpus"]) == 8, report
    assert report["verdict"] == "healthy", report
    snapshots = json.loads((tmp_path / "snapshots.json").read_text())
    gpu = snapshots[0]["gpus"][0]
    for name in ("temperature_c", "slowdown_temp_c", "power_w", "power_limit_w", "clock_events"):
        assert gpu[name] is not None, name
    assert json.loads((tmp_path / "assessment.json").read_text())["verdict"] == "healthy"


def test_without_a_driver_it_says_so_in_one_line(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    code = gpu_check.main(["--out", str(tmp_path), "--seconds", "0"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    if summary["telemetry"].get("error"):  # this machine: no NVIDIA driver
        assert code == 1 and "NVML is not available" in summary["telemetry"]["error"]
    else:  # a GPU machine
        assert code == 0 and summary["telemetry"]["gpus"]
