"""Servers over SSH (docs/ansible.md): host-key pinning and diagnostic bundles.

Diagnostics run while the request waits (at most diagnose_timeout_s per server, ssh_workers
servers at once): an operator's command, answered with one line per server. FastAPI runs these
plain handlers in its thread pool, and no database transaction is held while servers answer.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from fleet.api.deps import (
    Admin,
    EngineDep,
    Operator,
    PagingDep,
    SessionDep,
    SettingsDep,
)
from fleet.api.responses import Page
from fleet.inventory.servers import get_server
from fleet.models import NAME_PATTERN, ServerPublic
from fleet.ssh.diagnose import (
    DiagnoseResult,
    DiagnosticBundlePublic,
    diagnose,
    get_bundle,
    list_bundles,
)
from fleet.ssh.trust import trust

router = APIRouter(tags=["ssh"])

# One request collects while its caller waits: at most this many servers (with FLEET_SSH_WORKERS
# 8 and FLEET_DIAGNOSE_TIMEOUT_S 180, at worst 8 rounds of 3 minutes); a bigger sweep goes in
# parts.
MAX_SERVERS = 64


class DiagnoseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    servers: list[Annotated[str, StringConstraints(pattern=NAME_PATTERN, max_length=63)]] = Field(
        min_length=1, max_length=MAX_SERVERS
    )


class DiagnoseAnswer(BaseModel):
    results: list[DiagnoseResult]
    failed: int


@router.post("/diagnostics")
def run_diagnostics(
    body: DiagnoseRequest, user: Operator, engine: EngineDep, settings: SettingsDep
) -> DiagnoseAnswer:
    """Collect a diagnostic bundle over SSH from each named server, in parallel (at most
    `ssh_workers` at once, each within `diagnose_timeout_s`). 404 naming unknown servers
    (nothing is contacted then); otherwise one result per server, `ok` false with a one-line
    `error` for a server that could not be reached, whose host key is not the pinned one, or
    that refused the fleet's key."""
    results = diagnose(engine, body.servers, settings, user.actor)
    return DiagnoseAnswer(results=results, failed=sum(not r.ok for r in results))


@router.get("/servers/{name}/diagnostics")
def server_diagnostics(
    name: str, _: Operator, session: SessionDep, paging: PagingDep
) -> Page[DiagnosticBundlePublic]:
    """A server's diagnostic bundles, newest first (without their content)."""
    count, rows = list_bundles(session, name, paging.limit, paging.offset)
    return paging.page(count, rows)


GZIP_OUT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the bundle: a gzipped tar with summary.json and each command's output",
        "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.get("/diagnostics/{bundle_id}", response_class=Response, responses=GZIP_OUT)
def download_diagnostics(bundle_id: int, _: Operator, session: SessionDep) -> Response:
    """One bundle's content (application/gzip), with its SHA-256 in `X-Content-SHA256`."""
    server, bundle = get_bundle(session, bundle_id)
    filename = f"{server}-diagnostics-{bundle_id}.tar.gz"
    return Response(
        bundle.content,
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{filename}"',
            "X-Content-SHA256": bundle.sha256,
        },
    )


@router.post("/servers/{name}/ssh-trust")
def ssh_trust(
    name: str, user: Admin, engine: EngineDep, session: SessionDep, settings: SettingsDep
) -> ServerPublic:
    """Pin the SSH host key the server offers now (read without logging in), if none is
    pinned: the explicit first contact. Idempotent; 409 naming both fingerprints when another
    key is pinned; 502 when the server's sshd cannot be reached."""
    trust(engine, name, settings, user.actor)
    return get_server(session, name)
