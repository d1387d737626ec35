"""`fleetctl simulate` and `simulate-compile`: what-if capacity planning with the production
routing code (fleet/sim/)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.cli.common import CliError, handled

if TYPE_CHECKING:
    from fleet.sim import week as week_t
from fleet.data import bundled_scenarios, scenario_path


@handled
def simulate(
    scenario: Annotated[
        Path,
        typer.Argument(
            help="Scenario YAML (docs/sim.md), or the name of one that ships with Fleet: "
            + ", ".join(bundled_scenarios())
            + ".",
        ),
    ],
    seed: Annotated[int | None, typer.Option("--seed", help="Overrides the scenario's.")] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            "--compare",
            help="Variants run on the SAME requests, comma-separated: a strategy, a batching "
            "(continuous|static), strategy/batching, or a variant the scenario names under "
            "`variants` (e.g. nameplate,measured). A week scenario (`kind: week`): "
            "predictive, reactive, peak.",
        ),
    ] = None,
    charts: Annotated[
        Path | None,
        typer.Option(
            "--charts",
            help="Write a PNG per run to this directory (made if missing), "
            "DIR/<scenario>-<variant>.png: demand vs capacity, p95 vs SLA, spares in use.",
        ),
    ] = None,
    pure: Annotated[
        bool,
        typer.Option(
            "--pure",
            help="Run the Python modules even where `fleetctl simulate-compile` built them "
            "(the same results, ~3× slower).",
        ),
    ] = False,
) -> None:
    """Simulate a scenario: the production routing strategies, autoscaling policy, calendar,
    placement, fault policy and escalation rule over engines timed by the cost model
    (docs/sim.md)."""
    from fleet.sim import native

    path = scenario_path(scenario)
    if not path.exists() and path != scenario:  # a bare name, and no bundled scenario has it
        raise CliError(
            f"no scenario {str(scenario)!r}: no such file, nor a bundled scenario "
            f"({', '.join(bundled_scenarios())})"
        )
    # Before anything imports the hot modules (fleet/sim/native.py).
    why_not = "--pure" if pure else native.enable()
    from fleet.sim import week

    weekly = week.load(path)
    if weekly is not None:
        _simulate_week(weekly, seed, compare, charts)
        return
    from fleet.sim import charts as sim_charts
    from fleet.sim import scenario as sim
    from fleet.sim.core import RunResult

    loaded = sim.load(path)
    out = None if charts is None else sim_charts.chart_dir(charts)  # before the runs
    typer.echo(
        "simulator: compiled (mypyc)" if why_not is None else f"simulator: Python ({why_not})",
        err=True,
    )
    written: list[Path] = []

    def chart(variant: str, result: RunResult) -> None:
        if out is not None:
            path = out / sim_charts.file_name(loaded.name, variant)
            title = f"{loaded.name} ({variant})"
            written.append(
                sim_charts.render(result, path, title=title, shared_warm_pool=loaded.shared_pool())
            )

    if compare:
        variants = [v.strip() for v in compare.split(",") if v.strip()]
        rows = sim.compare(loaded, variants, seed, on_result=chart)
    else:
        result, summary = sim.run(loaded, seed)
        rows = [(loaded.name, summary)]
        chart(sim_charts.variant_name(result.deployments), result)
    typer.echo(sim.table(rows))
    racks = sim.rack_table(rows)  # with `power:` (fleet/sim/power.py)
    if racks:
        typer.echo("")
        typer.echo(racks)
    if not compare:
        for line in sim.report(result):
            typer.echo(line)
    for path in written:
        typer.echo(f"chart: {path}")


def _simulate_week(
    scenario: week_t.WeekScenario, seed: int | None, compare: str | None, charts: Path | None
) -> None:
    """A week at fleet scale (fleet/sim/week.py): the fluid model, calibrated first."""
    from fleet.sim import week

    if charts is not None:
        raise CliError("--charts draws request-level runs; a week scenario prints its table")
    variants = [v.strip() for v in compare.split(",") if v.strip()] if compare else ["predictive"]
    started = time.monotonic()
    cal, demand, results = week.compare(scenario, variants, seed)
    for line in week.report(scenario, cal, demand):
        typer.echo(line)
    typer.echo(week.table(results))
    for r in results:
        for at, how in r.forecast_off:
            typer.echo(f"{r.variant}: forecast switched {how} at {at / 3600:.1f} h")
    typer.echo(f"({time.monotonic() - started:.0f} s)", err=True)


@handled
def simulate_compile(
    force: Annotated[bool, typer.Option("--force", help="Build again even if built.")] = False,
) -> None:
    """Compile the simulator's hot modules with mypyc (about a minute; needs gcc, Python's
    headers and mypy) so that `fleetctl simulate` runs ~3× faster with the same results. The
    build is cached per source version ($XDG_CACHE_HOME/fleet/sim-native)."""
    from fleet.sim import native

    started = time.monotonic()
    try:
        where = native.build(force=force)
    except native.NativeError as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    typer.echo(f"compiled in {time.monotonic() - started:.0f} s: {where}")
