"""`fleetctl sites` and `servers`: listing, power, verify, the operator's lifecycle moves
(transition, drain, maintenance, release, retire), and SSH: diagnostic bundles, pinning host
keys (ssh-trust) and a known_hosts file for Ansible (known-hosts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from fleet.cli.common import (
    DEFAULT_URL,
    CliError,
    Out,
    Output,
    Token,
    Url,
    _detail,
    api_client,
    console,
    err_console,
    handled,
    printable,
    show,
    typer_app,
)

servers_app = typer_app("GPU servers.")

SITE_COLUMNS = [
    ("name", "site"),
    ("description", "description"),
    ("rack_count", "racks #"),
    ("server_count", "servers #"),
]
SERVER_COLUMNS = [
    ("name", "server"),
    ("site", "site"),
    ("rack", "rack"),
    ("u_position", "U"),
    ("gpu_model", "GPU"),
    ("gpu_count", "GPUs #"),
    ("pool", "pool"),
    ("state", "state"),
    ("power_state", "power"),
    ("bmc_protocol", "BMC"),
]
Limit = Annotated[int | None, typer.Option("--limit", help="At most this many rows (default all).")]


@handled
def sites(url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE) -> None:
    """List sites."""
    show(list(api_client(url, token).pages("/api/v1/sites", None)), output, SITE_COLUMNS)


@servers_app.command("list")
@handled
def servers_list(
    site: Annotated[str | None, typer.Option()] = None,
    rack: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="baseline or warm")] = None,
    state: Annotated[str | None, typer.Option()] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model")] = None,
    deployment: Annotated[str | None, typer.Option(help="the deployment it serves")] = None,
    health: Annotated[
        str | None, typer.Option(help="the agent's verdict: healthy, degraded or unhealthy")
    ] = None,
    limit: Limit = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List servers, filtered."""
    rows = list(
        api_client(url, token).pages(
            "/api/v1/servers",
            limit,
            site=site,
            rack=rack,
            pool=pool,
            state=state,
            gpu_model=gpu_model,
            deployment=deployment,
            health=health,
        )
    )
    show(rows, output, SERVER_COLUMNS)


@servers_app.command("show")
@handled
def servers_show(
    name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Show one server."""
    show(api_client(url, token).get(f"/api/v1/servers/{name}"), output)


GPU_COLUMNS = [
    ("index", "GPU"),
    ("model", "model"),
    ("health", "health"),
    ("temperature_c", "°C"),
    ("power_w", "W"),
    ("memory_used_mib", "used MiB"),
    ("utilization_pct", "util %"),
    ("ecc_uncorrected_volatile", "ECC uncorr. #"),
    ("remapped", "remapped rows"),
    ("xids", "Xids"),
]


@servers_app.command("gpus")
@handled
def servers_gpus(
    name: str, url: Url = DEFAULT_URL, token: Token = None, output: Out = Output.TABLE
) -> None:
    """Each GPU of a server: health, and its readings as of the last heartbeat."""
    rows = list(api_client(url, token).pages(f"/api/v1/servers/{name}/gpus", None))
    if output is Output.JSON:
        show(rows, output)
        return
    show([_gpu_row(g) for g in rows], output, GPU_COLUMNS, title=f"{name}: GPUs")


def _gpu_row(gpu: dict[str, Any]) -> dict[str, Any]:
    """A GPU and its reading in one flat row; what the GPU could not give (or no Xid seen)
    is a dash."""
    reading = gpu.get("reading") or {}
    counts = [reading.get(f"remapped_rows_{k}") for k in ("correctable", "uncorrectable")]
    parts = [] if counts == [None, None] else [f"{counts[0]} corr.", f"{counts[1]} uncorr."]
    parts += [flag for flag in ("pending", "failed") if reading.get(f"remap_{flag}")]
    return {
        **reading,
        "index": gpu.get("index"),
        "model": gpu.get("model"),
        "health": "lost" if reading.get("lost") else gpu.get("health"),
        "remapped": ", ".join(parts) or None,
        "xids": ", ".join(str(x) for x in reading.get("xids") or ()) or None,
    }


POWER_COLUMNS = [
    ("server", "server"),
    ("ok", "ok"),
    ("sent", "sent"),
    ("state_before", "before"),
    ("state_after", "after"),
    ("seconds", "seconds"),
    ("error", "error"),
]


@servers_app.command("power")
@handled
def servers_power(
    action: Annotated[str, typer.Argument(help="on, off, force_off, cycle or status")],
    names: Annotated[list[str] | None, typer.Argument(help="Servers (or use the filters).")] = None,
    site: Annotated[str | None, typer.Option()] = None,
    rack: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="baseline or warm")] = None,
    state: Annotated[str | None, typer.Option()] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model")] = None,
    override_budget: Annotated[
        bool,
        typer.Option(
            "--override-budget",
            help="Power on even past the rack's budget (admins only; needs --reason).",
        ),
    ] = False,
    reason: Annotated[
        str | None,
        typer.Option("--reason", help="Why the budget may be exceeded (recorded on the rack)."),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Power servers on/off/cycle through their BMCs, or read their power state.

    Power-ons are staggered per rack (inrush current) and pass the rack's budget gate: what
    fits is powered on, the rest fail naming the rack, the watts needed and the headroom. An
    admin may override with --override-budget --reason TEXT (an Event, shown on the rack).
    Every result is read back from the BMC. Exit code 1 if any server failed.
    """
    if override_budget and not (reason or "").strip():
        raise CliError("--override-budget needs --reason TEXT (why the budget may be exceeded)")
    if reason is not None and not override_budget:
        raise CliError("--reason goes with --override-budget")
    filters = {"site": site, "rack": rack, "pool": pool, "state": state, "gpu_model": gpu_model}
    body: dict[str, Any] = {"action": action, **_choose(names, filters)}
    if override_budget:
        body |= {"override_budget": True, "reason": reason}
    results: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    # The service streams one line per server as its BMC answers: a live progress bar (on
    # stderr, so that `-o json` output stays clean), then the table in the order asked.
    progress = Progress(
        SpinnerColumn(),
        TextColumn(f"power {action}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        # Only for a person at a terminal: piped or captured stderr stays one line per error.
        disable=not err_console.is_terminal,
    )
    with progress:
        task = progress.add_task("power", total=None, failed=0)
        for line in api_client(url, token).stream_lines("POST", "/api/v1/power", json=body):
            if "result" in line:
                results.append(line["result"])
                failed = sum(not r["ok"] for r in results)
                progress.update(task, advance=1, failed=failed)
            elif "error" in line:
                raise CliError(f"the service failed mid-way: {line['error']}")
            elif "failed" in line:
                summary = line
            elif "count" in line:
                progress.update(task, total=line["count"])
    if not summary:
        raise CliError("the service ended the stream early (see its log); results may be partial")
    order = {name: i for i, name in enumerate(names or [])}
    results.sort(key=lambda r: (order.get(r["server"], len(order)), r["server"]))
    show(results, output, POWER_COLUMNS)
    if summary["failed"]:
        raise CliError(f"{summary['failed']} of {summary['count']} servers failed (see the table)")


VERIFY_COLUMNS = [
    ("server", "server"),
    ("ok", "ok"),
    ("power_state", "power"),
    ("moved_to", "now"),
    ("message", "message"),
]


def _choose(names: list[str] | None, filters: dict[str, str | None]) -> dict[str, Any]:
    select = {k: v for k, v in filters.items() if v is not None}
    if bool(names) == bool(select):
        raise CliError("name servers, or select them with --site/--rack/--pool/--state/--gpu-model")
    return {"servers": names} if names else {"select": select}


@servers_app.command("verify")
@handled
def servers_verify(
    names: Annotated[list[str] | None, typer.Argument(help="Servers (or use the filters).")] = None,
    site: Annotated[str | None, typer.Option()] = None,
    rack: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="baseline or warm")] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Check enrolled servers' BMCs (all of them when none are named): warm-pool spares found
    off become warm; baseline servers are powered on (booting). Exit code 1 if any server
    could not be verified."""
    body = _choose(
        names,
        {
            "site": site,
            "rack": rack,
            "pool": pool,
            "gpu_model": gpu_model,
            "state": "enrolled" if not names else None,
        },
    )
    with console.status("verifying BMCs…", spinner="dots"):
        result = api_client(url, token).request("POST", "/api/v1/verify", json=body, timeout=None)
    show(result["results"], output, VERIFY_COLUMNS)
    if result["failed"]:
        raise CliError(
            f"{result['failed']} of {result['count']} servers not verified (see the table)"
        )


@servers_app.command("transition")
@handled
def servers_transition(
    name: str,
    to: Annotated[str, typer.Argument(help="Target state.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in the event).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Move a server through the lifecycle (operator moves)."""
    result = api_client(url, token).request(
        "POST", f"/api/v1/servers/{name}/transition", json={"to": to, "reason": reason}
    )
    if output is Output.JSON:
        show(result, output)
    elif result["event"] is None:
        typer.echo(f"{name} is already {to}")
    else:
        typer.echo(f"{name}: {result['event']['from_state']} → {result['event']['to_state']}")


def _server_move(path: str, name: str, url: str, token: str | None) -> None:
    row = api_client(url, token).request("POST", f"/api/v1/servers/{name}/{path}")
    typer.echo(f"{row['server']}: {row['state']}")


@servers_app.command("drain")
@handled
def servers_drain(name: str, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Drain a serving server (in-flight requests finish); it then waits, drained."""
    _server_move("drain", name, url, token)


@servers_app.command("undrain")
@handled
def servers_undrain(name: str, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Back to serving: a server an operator drained loads its deployment again."""
    _server_move("undrain", name, url, token)


def _operator_transition(name: str, to: str, reason: str, url: str, token: str | None) -> None:
    body = {"to": to, "reason": reason}
    row = api_client(url, token).request("POST", f"/api/v1/servers/{name}/transition", json=body)
    typer.echo(f"{name}: {row['server']['state']}")


Reason = Annotated[str, typer.Option("--reason", help="Why (recorded in the event).")]


@servers_app.command("maintenance")
@handled
def servers_maintenance(
    name: str, reason: Reason = "operator maintenance", url: Url = DEFAULT_URL, token: Token = None
) -> None:
    """Take a server out for maintenance (nothing automatic touches it until released)."""
    _operator_transition(name, "maintenance", reason, url, token)


@servers_app.command("release")
@handled
def servers_release(
    name: str,
    reason: Reason = "released by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Release a failed, quarantined or maintenance server: back to enrolled (verify next)."""
    _operator_transition(name, "enrolled", reason, url, token)


@servers_app.command("retire")
@handled
def servers_retire(
    name: str,
    reason: Reason = "retired by an operator",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Retire a server for good."""
    _operator_transition(name, "retired", reason, url, token)


# ---------------------------------------------------------------------------------------------
# Over SSH (fleet/ssh/, docs/ansible.md)

DIAGNOSTICS_COLUMNS = [
    ("id", "bundle"),
    ("created_at", "created"),
    ("created_by", "by"),
    ("size", "size"),
    ("commands", "commands"),
    ("missing", "missing"),
    ("truncated", "truncated"),
]


def _size(size: int) -> str:
    return f"{size / 1024:.1f} KiB" if size < 1024 * 1024 else f"{size / 1024 / 1024:.1f} MiB"


def _without_name(name: str, error: str) -> str:
    """An error already naming its server, without that prefix (the line starts with it)."""
    return error.removeprefix(f"server {name}: ")


def _download(api: Any, bundle_id: int, path: Path) -> int:
    """Write bundle `bundle_id` to `path` (through a temporary file: no half bundle is left);
    returns its size."""
    # Raw bytes: Api.request decodes every body as text.
    response = api._client.get(f"/api/v1/diagnostics/{bundle_id}")
    if response.status_code >= 400:
        raise CliError(_detail(response))
    part = path.with_name(path.name + ".part")
    part.write_bytes(response.content)
    part.replace(path)
    return len(response.content)


@servers_app.command("diagnose")
@handled
def servers_diagnose(
    names: Annotated[list[str], typer.Argument(help="Servers to collect from.")],
    directory: Annotated[
        Path | None,
        typer.Option("--output-dir", "-o", help="Also download each bundle into this folder."),
    ] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Collect a diagnostic bundle over SSH from each server (nvidia-smi -q, Xid lines, the
    agent's journal, dcgmi diag -r 1, the engine's logs, ...), stored by the fleet. One line
    per server; exit code 1 if any failed."""
    api = api_client(url, token)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    with console.status("collecting over SSH…", spinner="dots"):
        answer = api.request(
            "POST", "/api/v1/diagnostics", json={"servers": list(names)}, timeout=None
        )
    for result in answer["results"]:
        name = result["server"]
        if not result["ok"]:
            typer.echo(
                f"{name}: error: {printable(_without_name(name, result['error']), one_line=True)}"
            )
            continue
        missing = f" ({result['missing']} missing)" if result["missing"] else ""
        cut = ", truncated" if result["truncated"] else ""
        line = (
            f"{name}: bundle {result['bundle_id']}, {_size(result['size_bytes'])}, "
            f"{result['commands']} commands{missing}{cut}"
        )
        if directory is not None:
            path = directory / f"{name}-diagnostics-{result['bundle_id']}.tar.gz"
            _download(api, result["bundle_id"], path)
            line += f" -> {path}"
        typer.echo(line)
    if answer["failed"]:
        raise CliError(f"{answer['failed']} of {len(answer['results'])} servers failed")


@servers_app.command("diagnostics")
@handled
def servers_diagnostics(
    name: str,
    limit: Limit = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List a server's diagnostic bundles, newest first."""
    rows = list(api_client(url, token).pages(f"/api/v1/servers/{name}/diagnostics", limit))
    if output is Output.TABLE:
        for row in rows:
            row["size"] = _size(row["size_bytes"])
            row["commands"] = len(row["summary"])
            row["missing"] = sum(1 for c in row["summary"] if c.get("missing"))
    show(rows, output, DIAGNOSTICS_COLUMNS)


@servers_app.command("diagnostics-get")
@handled
def servers_diagnostics_get(
    bundle_id: Annotated[int, typer.Argument(help="The bundle's id (`servers diagnostics`).")],
    path: Annotated[Path, typer.Option("--output", "-o", help="Write the .tar.gz here.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Download one diagnostic bundle (a gzipped tar with summary.json)."""
    size = _download(api_client(url, token), bundle_id, path)
    typer.echo(f"bundle {bundle_id}: {_size(size)} -> {path}")


@servers_app.command("ssh-trust")
@handled
def servers_ssh_trust(
    names: Annotated[list[str], typer.Argument(help="Servers whose key to pin.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Pin the SSH host key each server offers now (admins; the service reads it, without
    logging in). A server with another key pinned is refused, naming both. Exit code 1 if any
    failed."""
    api = api_client(url, token)
    failed = 0
    for name in names:
        try:
            row = api.request("POST", f"/api/v1/servers/{name}/ssh-trust", timeout=None)
        except CliError as exc:
            failed += 1
            typer.echo(f"{name}: error: {printable(_without_name(name, str(exc)), one_line=True)}")
            continue
        typer.echo(f"{name}: pinned {row['ssh_host_key']}")
    if failed:
        raise CliError(f"{failed} of {len(names)} servers failed")


@servers_app.command("known-hosts")
@handled
def servers_known_hosts(
    names: Annotated[
        list[str] | None, typer.Argument(help="Servers (default: every one with SSH).")
    ] = None,
    path: Annotated[
        Path, typer.Option("--output", "-o", help="The known_hosts file to write.")
    ] = Path("known_hosts"),
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for each server's sshd.")
    ] = 10.0,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Write an OpenSSH known_hosts file for the servers' pinned host keys (for Ansible or ssh
    with StrictHostKeyChecking=yes). Each server's key is read from here, without logging in,
    and kept only if it equals the fleet's pin; a server with no pin or another key is a line
    `NAME: error: …` and exit code 1 (the others are still written)."""
    from concurrent.futures import ThreadPoolExecutor

    api = api_client(url, token)
    if names:
        servers = [api.get(f"/api/v1/servers/{n}") for n in dict.fromkeys(names)]
    else:
        servers = [s for s in api.pages("/api/v1/servers", None) if s.get("ssh_address")]

    def line(server: dict[str, Any]) -> str:
        from fleet.ssh.hostkeys import SshError, check, known_hosts_line, scan

        name = server["name"]
        if not server.get("ssh_address"):
            raise SshError(f"server {name}: no SSH address")
        key = scan(server["ssh_address"], server["ssh_port"], timeout, server=name)
        check(name, server.get("ssh_host_key"), key)
        return known_hosts_line(server["ssh_address"], server["ssh_port"], key)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(servers)))) as pool:
        futures = [(s["name"], pool.submit(line, s)) for s in servers]
    lines: list[str] = []
    failed = 0
    for name, future in futures:
        error = future.exception()
        if error is None:
            lines.append(future.result())
            continue
        failed += 1
        typer.echo(f"{name}: error: {printable(_without_name(name, str(error)), one_line=True)}")
    part = path.with_name(path.name + ".part")
    part.write_text("".join(f"{entry}\n" for entry in lines))
    part.replace(path)
    typer.echo(f"{len(lines)} host keys -> {path}")
    if failed:
        raise CliError(f"{failed} of {len(servers)} servers have no verified key in {path}")
