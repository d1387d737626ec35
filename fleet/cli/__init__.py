"""fleetctl: the operator's command line, a thin front over the fleet's REST API.

`serve`, `db` and `token create` work on the database directly (they start or bootstrap the
service); every other command talks to a running service at --url / FLEET_URL with
--token / FLEET_TOKEN. Errors are one line on stderr and a non-zero exit code.

This module only assembles the app: one module per command group (db, tokens and agent-tokens,
serve, agent, router, callers (tenants and keys), inventory, servers, racks, deployments, events,
spares, autoscaler, schedule, prometheus, lab, simulate, demo), what they share in
fleet/cli/common.py. The modules import the service's code inside each command, so that
`fleetctl --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from fleet.cli import (
    agent,
    autoscaler,
    callers,
    common,
    db,
    demo,
    deployments,
    events,
    inventory,
    lab,
    models,
    prometheus,
    racks,
    rollouts,
    router,
    schedule,
    serve,
    servers,
    simulate,
    spares,
    tokens,
)

app = common.typer_app("Operate a bare-metal GPU inference fleet.", name="fleetctl")
app.callback()(common.root_options)

# Commands at the top level, in the order `fleetctl --help` lists them.
app.command("secret-key")(tokens.secret_key)
app.command("serve")(serve.serve)
app.command("sites")(servers.sites)
app.command("events")(events.events)
app.command("prometheus-config")(prometheus.prometheus_config)
app.command("simulate")(simulate.simulate)
app.command("simulate-compile")(simulate.simulate_compile)
app.command("demo")(demo.demo)

# Command groups, listed after the commands.
app.add_typer(db.db_app, name="db")
app.add_typer(tokens.token_app, name="token")
app.add_typer(tokens.agent_tokens_app, name="agent-tokens")
app.add_typer(inventory.inventory_app, name="inventory")
app.add_typer(servers.servers_app, name="servers")
app.add_typer(racks.racks_app, name="racks")
app.add_typer(deployments.deployments_app, name="deployments")
rollouts.register(deployments.deployments_app)
app.add_typer(models.models_app, name="models")
app.add_typer(agent.agent_app, name="agent")
app.add_typer(router.router_app, name="router")
app.add_typer(callers.tenants_app, name="tenants")
app.add_typer(callers.keys_app, name="keys")
app.add_typer(spares.spares_app, name="spares")
app.add_typer(spares.autopilot_app, name="autopilot")
app.add_typer(autoscaler.autoscaler_app, name="autoscaler")
app.add_typer(schedule.schedule_app, name="schedule")
app.add_typer(lab.lab_app, name="lab")


def main() -> None:
    """The console script: like `app()`, but a usage error is one line too."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except Exception as exc:
        # Click's usage errors, matched by shape: Typer vendors its own copy of Click.
        exit_code, message = getattr(exc, "exit_code", None), getattr(exc, "format_message", None)
        if not isinstance(exit_code, int) or message is None:
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            typer.echo(message(), err=True)  # the help text itself
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            typer.echo(f"error: {message()}{hint}", err=True)
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
