"""The real GPU path, checked on a machine with GPUs and no network (issue 24).

    python bench/gpu_check.py --out DIR [--seconds 60] [--interval 1]
        [--engine trtllm|vllm|sglang --model PATH [--command "vllm"] [--requests 5]]

1. NVML telemetry, as the agent reads it (fleet_agent/telemetry/nvml.py), every `--interval`
   seconds for `--seconds`: every field of every GPU's sample (temperatures and the GPU's own
   thresholds, memory, utilisation, power and its enforced limit, ECC, remapped rows, clock
   event reasons), Xid events, and the notes naming what the driver cannot report. Nothing is
   set: power limits are read, never changed.
2. The fault policy (fleet_core/fault_policy.py) on those readings: the verdict and its
   reasons, as the agent would report them.
3. With `--engine` and `--model` (a checkpoint directory on the machine): the engine's version
   check, one replica started with the agent's own command line (fleet_core/engines) on GPU 0,
   its readiness (health route), `--requests` completions, and its metrics texts parsed by the
   agent's parsers (fleet_agent/engine/scrape/); then it is stopped.

Everything lands in DIR: snapshots.json, assessment.json, and for the engine version.txt,
argv.json, engine.log, the raw metrics texts (<engine>-<route>.txt: fixtures for the parser
tests, with the engine version they came from) and summary.json. Every wait is bounded. Exit
status 0 when every step that ran passed, 1 otherwise (the summary says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from fleet_core.engines import LaunchSpec
from fleet_core.engines import spec as engine_spec
from fleet_core.fault_policy import assess

READY_TIMEOUT_S = 1800.0  # a 70B checkpoint takes minutes to load
REQUEST_TIMEOUT_S = 300.0
PORT = 18100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--engine", choices=["trtllm", "vllm", "sglang"])
    parser.add_argument("--model", help="a checkpoint directory on this machine")
    parser.add_argument("--command", help="the engine's program (default: the engine's own)")
    parser.add_argument("--requests", type=int, default=5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"started_at": time.time()}
    ok = telemetry(args, summary)
    if args.engine and args.model:
        ok = engine(args, summary) and ok
    summary["ok"] = ok
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    return 0 if ok else 1


def telemetry(
    args: argparse.Namespace, summary: dict[str, Any], module: ModuleType | None = None
) -> bool:
    """`module`: a pynvml stand-in (tests/nvml_standin.py); the real one by default."""
    from fleet_agent.telemetry.nvml import NvmlTelemetry
    from fleet_core.telemetry import TelemetryUnavailable

    try:
        nvml = NvmlTelemetry(module)
    except TelemetryUnavailable as exc:
        summary["telemetry"] = {"error": str(exc)}
        return False
    history = []
    try:
        deadline = time.monotonic() + args.seconds
        while True:  # bounded by --seconds
            history.append(nvml.snapshot())
            if time.monotonic() + args.interval > deadline:
                break
            time.sleep(args.interval)
    finally:
        nvml.close()
    rows = [dataclasses.asdict(s) for s in history]
    (args.out / "snapshots.json").write_text(json.dumps(rows, indent=1, default=str))
    latest = history[-1]
    fields = [f.name for f in dataclasses.fields(latest.gpus[0])] if latest.gpus else []
    missing = sorted({name for gpu in latest.gpus for name in fields if getattr(gpu, name) is None})
    verdict = assess(history, expected_gpus=len(latest.gpus))
    (args.out / "assessment.json").write_text(json.dumps(verdict.to_dict(), indent=2))
    summary["telemetry"] = {
        "snapshots": len(history),
        "gpus": [g.name for g in latest.gpus],
        "driver": latest.driver_version,
        "fields_none": missing,
        "notes": list(latest.notes),
        "xids": sum(len(s.xids) for s in history),
        "verdict": str(verdict.verdict),
        "reasons": [r.message for r in verdict.reasons],
    }
    return bool(latest.gpus) and not any(g.lost for g in latest.gpus)


def engine(args: argparse.Namespace, summary: dict[str, Any]) -> bool:
    from fleet_agent.engine import scrape

    spec = engine_spec(args.engine)
    command = tuple(shlex.split(args.command)) if args.command else spec.default_command
    report: dict[str, Any] = {"engine": spec.name, "command": list(command)}
    summary["engine"] = report
    try:
        out = subprocess.run(
            spec.version_argv(command), capture_output=True, text=True, timeout=120, check=False
        )
        (args.out / "version.txt").write_text(out.stdout + out.stderr)
        # stdout first: a warning on stderr must not pass for the version.
        report["version"] = spec.check_version(out.stdout if out.stdout.strip() else out.stderr)
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        report["error"] = f"version check: {exc}"
        return False
    launch = spec.launch(
        LaunchSpec(
            command=command,
            model_path=args.model,
            served_names=("gpu-check",),
            params={},
            host="127.0.0.1",
            port=PORT,
            config_dir=str(args.out),
        )
    )
    for name, text in launch.files.items():
        (args.out / name).write_text(text)
    (args.out / "argv.json").write_text(json.dumps(launch.argv))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    started = time.monotonic()
    with open(args.out / "engine.log", "wb") as log:
        proc = subprocess.Popen(
            launch.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{PORT}"
    try:
        while True:  # bounded by READY_TIMEOUT_S
            if proc.poll() is not None:
                report["error"] = f"the engine exited with {proc.returncode} (engine.log)"
                return False
            if time.monotonic() - started > READY_TIMEOUT_S:
                report["error"] = f"not ready within {READY_TIMEOUT_S:g} s"
                return False
            try:
                if httpx.get(url + spec.health_path, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        report["load_s"] = round(time.monotonic() - started, 1)
        answers = []
        for i in range(args.requests):
            body = {"model": "gpu-check", "prompt": f"Count to {i + 3}:", "max_tokens": 32}
            t0 = time.monotonic()
            reply = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
            answers.append({"status": reply.status_code, "s": round(time.monotonic() - t0, 3)})
        report["requests"] = answers
        texts = {}
        for path in scrape.metrics_paths(spec.name):
            text = httpx.get(url + path, timeout=30).text
            texts[path] = text
            name = f"{spec.name}-{path.strip('/').replace('/', '-')}.txt"
            (args.out / name).write_text(text)
        sample = scrape.parse(spec.name, texts)
        report["sample"] = dataclasses.asdict(sample) | {"entries": len(sample.entries)}
        return all(a["status"] == 200 for a in answers)
    except (httpx.HTTPError, ValueError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return False
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
