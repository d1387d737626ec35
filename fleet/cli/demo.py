"""`fleetctl demo`: the whole fleet in one command (fleet/demo/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleet.cli.common import (
    CliError,
    console,
    handled,
)


@handled
def demo(
    duration: Annotated[
        float, typer.Option("--duration", min=30, max=3600, help="Seconds of traffic.")
    ] = 120.0,
    servers: Annotated[int, typer.Option("--servers", min=2, max=12, help="L40S servers.")] = 6,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Live view or log lines.")] = True,
    keep: Annotated[
        bool, typer.Option("--keep", help="Leave it running; print the URLs and a token.")
    ] = False,
    workdir: Annotated[
        Path | None, typer.Option("--dir", help="Working directory [a new temporary one].")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="Run every deployment on this engine (trtllm, vllm, sglang) [each on its own: "
            "one deployment per engine].",
        ),
    ] = None,
) -> None:
    """The whole fleet on this machine: a virtual colo, the fleet service and the router, a
    replayed day of real traffic with a spike, a GPU fault and a calendar entry; a summary and
    a chart at the end. Everything it starts stops when it ends (or on Ctrl-C).

    The fleet mixes engines: one deployment each on TensorRT-LLM, vLLM and SGLang stand-ins,
    served through the one router (--engine puts all three on one engine)."""
    from fleet.demo.run import Options, run_demo
    from fleet_core.engines import ENGINES

    if engine is not None and engine not in ENGINES:
        raise CliError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    options = Options(
        duration_s=duration, servers=servers, live=live, keep=keep, workdir=workdir, engine=engine
    )
    try:
        run_demo(options, console)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except RuntimeError as exc:  # DemoError, LabError: one line
        raise CliError(str(exc)) from None
