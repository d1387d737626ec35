"""`fleetctl deployments`: served models (list, show, create, scale)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
import yaml

from fleet.cli.common import (
    DEFAULT_URL,
    CliError,
    Out,
    Output,
    Token,
    Url,
    api_client,
    handled,
    show,
    typer_app,
)
from fleet_core.engines import DEFAULT_ENGINE, ENGINES
from fleet_core.engines import spec as engine_spec

deployments_app = typer_app("Deployments (served models).")
DEPLOYMENT_COLUMNS = [
    ("name", "deployment"),
    ("model_version", "version"),
    ("canary_version", "canary"),
    ("gpus_per_replica", "GPUs/replica #"),
    ("gpu_models", "GPU models"),
    ("min_replicas", "min #"),
    ("max_replicas", "max #"),
    ("sla_p95_latency_ms", "p95 SLA ms"),
    ("sla_ttft_ms", "TTFT SLA ms"),
]


@deployments_app.command("list")
@handled
def deployments_list(
    url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """List deployments."""
    show(
        list(api_client(url, token).pages("/api/v1/deployments", None)), output, DEPLOYMENT_COLUMNS
    )


@deployments_app.command("show")
@handled
def deployments_show(
    name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Show one deployment."""
    show(api_client(url, token).get(f"/api/v1/deployments/{name}"), output)


def _engine_choice(values: list[str]) -> tuple[str | None, dict[str, Any]]:
    """`--engine vllm --engine max_num_seqs=64`: a bare word names the engine, KEY=VALUE is
    one of its options (its own flag's name; docs/engine.md, Engines)."""
    engine: str | None = None
    params: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep:
            if engine is not None and engine != value:
                raise CliError(f"--engine {value!r}: the engine is already {engine!r}")
            if value not in ENGINES:
                raise CliError(
                    f"--engine {value!r}: expected an engine ({', '.join(ENGINES)}) or KEY=VALUE"
                )
            engine = value
        elif not key:
            raise CliError(f"--engine {value!r}: expected KEY=VALUE")
        else:
            params[key] = yaml.safe_load(raw)  # 8 -> int, 0.9 -> float, pytorch -> str
    return engine, params


@deployments_app.command("create")
@handled
def deployments_create(
    name: str,
    sla_p95_ms: Annotated[float, typer.Option("--sla-p95-ms", help="p95 latency SLA.")],
    sla_ttft_ms: Annotated[float, typer.Option("--sla-ttft-ms", help="Time-to-first-token SLA.")],
    gpus_per_replica: Annotated[int, typer.Option("--gpus-per-replica")] = 1,
    gpu_model: Annotated[
        list[str] | None, typer.Option("--gpu-model", help="Allowed; repeat.")
    ] = None,
    min_replicas: Annotated[int, typer.Option("--min")] = 0,
    max_replicas: Annotated[int, typer.Option("--max")] = 1,
    disruption_budget: Annotated[int, typer.Option("--disruption-budget")] = 1,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine", help="trtllm (default), vllm or sglang; KEY=VALUE: its options. Repeat."
        ),
    ] = None,
    model_version: Annotated[
        str | None,
        typer.Option("--model-version", help="<model>@<version> (fleetctl models list)."),
    ] = None,
    model_uri: Annotated[
        str | None,
        typer.Option("--model-uri", help="Weights delivered outside Fleet (with --checksum)."),
    ] = None,
    checksum: Annotated[str | None, typer.Option("--checksum", help="e.g. sha256:…")] = None,
    cached_spares: Annotated[
        int, typer.Option("--cached-spares", help="Warm spares per GPU model holding it.")
    ] = 0,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Create a deployment serving --model-version (or, as before versions, the weights at
    --model-uri with --checksum)."""
    if (model_version is None) == (model_uri is None and checksum is None):
        raise CliError(
            "give --model-version <model>@<version>, or --model-uri and --checksum (weights "
            "delivered outside Fleet)"
        )
    if model_version is None and (model_uri is None or checksum is None):
        raise CliError("--model-uri and --checksum go together")
    name_of_engine, params = _engine_choice(engine or [])
    spec = engine_spec(name_of_engine or DEFAULT_ENGINE)
    tp_key, pp_key = spec.parallel_keys
    params.setdefault(tp_key, gpus_per_replica)
    params.setdefault(pp_key, 1)
    model = (
        {"model_version": model_version}
        if model_version is not None
        else {"model_uri": model_uri, "model_checksum": checksum}
    )
    body = {
        "name": name,
        **model,
        "engine": spec.name,
        "engine_params": params,
        "gpus_per_replica": gpus_per_replica,
        "gpu_models": gpu_model or [],
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "sla_p95_latency_ms": sla_p95_ms,
        "sla_ttft_ms": sla_ttft_ms,
        "disruption_budget": disruption_budget,
        "cached_spares": cached_spares,
    }
    show(api_client(url, token).request("POST", "/api/v1/deployments", json=body), output)


@deployments_app.command("scale")
@handled
def deployments_scale(
    name: str,
    replicas: Annotated[
        int | None, typer.Option("--replicas", min=0, help="Pin at this many replicas.")
    ] = None,
    auto: Annotated[bool, typer.Option("--auto", help="Back to automatic scaling.")] = False,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Pin a deployment at N replicas (manual mode), or hand it back with --auto."""
    if (replicas is None) == (not auto):
        raise CliError("give --replicas N (manual mode) or --auto, not both")
    body = {"replicas": None if auto else replicas}
    row = api_client(url, token).request("POST", f"/api/v1/deployments/{name}/scale", json=body)
    typer.echo(f"{name}: " + ("automatic" if row["mode"] == "auto" else f"pinned at {replicas}"))
