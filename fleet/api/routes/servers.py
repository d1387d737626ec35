"""Servers, their GPUs, operator edits and operator state moves."""

from __future__ import annotations

from fastapi import APIRouter

from fleet.api.deps import BoxDep, Operator, PagingDep, SessionDep, Viewer
from fleet.api.responses import Page, TransitionOutcome
from fleet.errors import NotAnOperatorMove
from fleet.inventory.servers import ServerFilter, get_server, list_gpus, list_servers, update_server
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import OPERATOR_TARGETS, ServerState
from fleet.models import (
    EventPublic,
    GpuPublic,
    Pool,
    Role,
    ServerPublic,
    ServerUpdate,
    TransitionRequest,
    Verdict,
)

router = APIRouter(tags=["servers"])


@router.get("/servers")
def servers(
    _: Viewer,
    session: SessionDep,
    paging: PagingDep,
    site: str | None = None,
    rack: str | None = None,
    pool: Pool | None = None,
    state: ServerState | None = None,
    gpu_model: str | None = None,
    deployment: str | None = None,
    health: Verdict | None = None,
) -> Page[ServerPublic]:
    where = ServerFilter(
        site=site,
        rack=rack,
        pool=pool,
        state=state,
        gpu_model=gpu_model,
        deployment=deployment,
        health=health,
    )
    count, results = list_servers(session, where, paging.limit, paging.offset)
    return paging.page(count, results)


@router.get("/servers/{name}")
def server(name: str, _: Viewer, session: SessionDep) -> ServerPublic:
    return get_server(session, name)


@router.patch("/servers/{name}")
def edit_server(
    name: str, update: ServerUpdate, user: Operator, session: SessionDep, box: BoxDep
) -> ServerPublic:
    """403 unless an admin for bmc_username or bmc_password; a new BMC endpoint without a new
    password drops the stored one (the event names both endpoints)."""
    admin = user.may(Role.ADMIN)
    return update_server(session, name, update, box, user.actor, credentials_allowed=admin)


@router.post("/servers/{name}/transition")
def transition(
    name: str, move: TransitionRequest, user: Operator, session: SessionDep
) -> TransitionOutcome:
    """An operator's lifecycle move: maintenance, retired, enrolled (release) or draining.

    422 for a target only the fleet's own loops may reach; 409 if the move is not allowed
    from the server's current state.
    """
    if move.to not in OPERATOR_TARGETS:
        allowed = ", ".join(sorted(s.value for s in OPERATOR_TARGETS))
        raise NotAnOperatorMove(
            f"{move.to.value} is reached by the fleet itself (it records what the BMC or the "
            f"agent reported), not by hand; operators may move a server to: {allowed}"
        )
    event = lifecycle.transition(session, name, move.to, user.actor, move.reason)
    return TransitionOutcome(
        server=get_server(session, name),
        event=EventPublic.model_validate(event.model_dump()) if event else None,
    )


@router.get("/servers/{name}/gpus")
def server_gpus(name: str, _: Viewer, session: SessionDep, paging: PagingDep) -> Page[GpuPublic]:
    count, results = list_gpus(session, name, paging.limit, paging.offset)
    return paging.page(count, results)


@router.get("/gpus")
def gpus(
    _: Viewer, session: SessionDep, paging: PagingDep, server: str | None = None
) -> Page[GpuPublic]:
    count, results = list_gpus(session, server, paging.limit, paging.offset)
    return paging.page(count, results)
