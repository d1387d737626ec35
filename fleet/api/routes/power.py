"""Power actions through BMCs: one server, or many (by name or by filter) at once."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlmodel import Session

from fleet.api.deps import BoxDep, Operator, SessionDep, get_settings
from fleet.models import Pool
from fleet.power_control import Action, PowerReport, power, verify
from fleet.servers import ServerFilter, list_servers
from fleet.settings import Settings
from fleet.states import ServerState

router = APIRouter(tags=["power"])
SettingsDep = Annotated[Settings, Depends(get_settings)]
MAX_BULK = 10_000


class PowerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Action


class SelectServers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    site: str | None = None
    rack: str | None = None
    pool: Pool | None = None
    state: ServerState | None = None
    gpu_model: str | None = None


class ChooseServers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    servers: list[str] | None = Field(default=None, min_length=1, max_length=MAX_BULK)
    select: SelectServers | None = None

    @model_validator(mode="after")
    def _one_way_to_choose(self) -> ChooseServers:
        if (self.servers is None) == (self.select is None):
            raise ValueError("give either servers (names) or select (a filter), not both")
        return self

    def names(self, session: Session) -> list[str]:
        if self.servers is not None:
            return self.servers
        assert self.select is not None
        _, rows = list_servers(session, ServerFilter(**self.select.model_dump()), MAX_BULK, 0)
        return [row.name for row in rows]


class BulkPowerRequest(ChooseServers):
    action: Action


def _report(r: PowerReport) -> dict[str, Any]:
    return {
        "server": r.server,
        "action": r.action,
        "ok": r.ok,
        "sent": r.sent,
        "state_before": r.state_before,
        "state_after": r.state_after,
        "error": r.error,
        "started": r.started,
        "seconds": r.seconds,
    }


@router.post("/servers/{name}/power")
def power_one(
    name: str,
    request: PowerRequest,
    user: Operator,
    session: SessionDep,
    box: BoxDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Read back after acting; asking for the state the server is in sends nothing."""
    engine = session.get_bind()
    session.close()  # no transaction held open while a BMC takes its time
    [report] = power(engine, box, settings, [name], request.action, user.actor)  # type: ignore[arg-type]
    return _report(report)


@router.post("/power")
def power_many(
    request: BulkPowerRequest,
    user: Operator,
    session: SessionDep,
    box: BoxDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Many servers at once: bounded concurrency, power-ons staggered per rack."""
    names = request.names(session)
    session.close()  # the bulk action opens its own sessions per server
    reports = power(session.get_bind(), box, settings, names, request.action, user.actor)  # type: ignore[arg-type]
    return {
        "count": len(reports),
        "failed": sum(not r.ok for r in reports),
        "results": [_report(r) for r in reports],
    }


@router.post("/verify")
def verify_servers(
    request: ChooseServers,
    user: Operator,
    session: SessionDep,
    box: BoxDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """First contact with enrolled servers' BMCs: warm-pool servers found off become `warm`;
    baseline servers are powered on and become `booting`. Others are left as they are."""
    names = request.names(session)
    session.close()
    reports = verify(session.get_bind(), box, settings, names, user.actor)  # type: ignore[arg-type]
    return {
        "count": len(reports),
        "failed": sum(not r.ok for r in reports),
        "results": [
            {
                "server": r.server,
                "ok": r.ok,
                "power_state": r.power_state,
                "moved_to": r.moved_to,
                "message": r.message,
            }
            for r in reports
        ],
    }
