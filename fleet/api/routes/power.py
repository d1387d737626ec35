"""Power actions through BMCs: one server, or many (by name or by filter) at once."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any, Self

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy.engine import Engine
from sqlmodel import Session

from fleet.api.deps import BoxDep, EngineDep, Operator, SessionDep, SettingsDep
from fleet.api.responses import BulkPowerOutcome, BulkVerifyOutcome, PowerOutcome, VerifyOutcome
from fleet.auth import Principal
from fleet.bmc.base import Action
from fleet.crypto import SecretBox
from fleet.errors import ForbiddenError
from fleet.inventory.servers import ServerFilter, list_servers
from fleet.lifecycle.states import ServerState
from fleet.models import Pool, Role, exactly_one_of
from fleet.power.actions import PowerReport, load_servers, power, verify
from fleet.power.gate import Override
from fleet.settings import Settings

router = APIRouter(tags=["power"])
MAX_BULK = 10_000


# The schema's form of "override_budget needs a reason", so that it refuses what the model
# refuses (an absent override_budget is false).
OVERRIDE_NEEDS_REASON: dict[str, Any] = {
    "anyOf": [
        {"properties": {"override_budget": {"const": False}}},
        {"required": ["reason"], "properties": {"reason": {"type": "string"}}},
    ]
}


_TEXT = "[^\\u0000-\\u001f\\u007f-\\u009f]"
REASON_PATTERN = f"^{_TEXT}*[^\\s\\u0000-\\u001f\\u007f-\\u009f]{_TEXT}*$"


class BudgetOverride(BaseModel):
    """An admin's override of the rack budget gate for the power-ons of this request."""

    override_budget: bool = Field(
        default=False,
        description="power on even past the rack's budget (admins only; needs a reason)",
    )
    # At least one non-blank character and no control character: the reason is what the rack
    # shows until it is cleared.
    reason: str | None = Field(default=None, min_length=1, max_length=500, pattern=REASON_PATTERN)

    @model_validator(mode="after")
    def _override_needs_reason(self) -> Self:
        if self.override_budget and self.reason is None:
            raise ValueError("reason: a budget override (override_budget) needs a reason")
        return self

    def override(self, user: Principal) -> Override | None:
        """The override asked for, if any; only an admin may ask (403 otherwise)."""
        if not self.override_budget:
            return None
        if not user.may(Role.ADMIN):
            raise ForbiddenError(
                f"overriding a rack's power budget needs an admin; {user.actor} is "
                f"{user.role.value}"
            )
        assert self.reason is not None
        return Override(actor=user.actor, reason=self.reason)


class PowerRequest(BudgetOverride):
    model_config = ConfigDict(extra="forbid", json_schema_extra=OVERRIDE_NEEDS_REASON)
    action: Action


class SelectServers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    site: str | None = None
    rack: str | None = None
    pool: Pool | None = None
    state: ServerState | None = None
    gpu_model: str | None = None


class ChooseServers(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of("servers", "select"))
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


class BulkPowerRequest(ChooseServers, BudgetOverride):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={**exactly_one_of("servers", "select"), **OVERRIDE_NEEDS_REASON},
    )
    action: Action


def _outcome(report: PowerReport) -> PowerOutcome:
    return PowerOutcome.model_validate(report, from_attributes=True)


@router.post("/servers/{name}/power")
def power_one(
    name: str,
    request: PowerRequest,
    user: Operator,
    engine: EngineDep,
    box: BoxDep,
    settings: SettingsDep,
) -> PowerOutcome:
    """Read back after acting; asking for the state the server is in sends nothing. A
    power-on (on, cycle) its rack's budget has no room for is refused (`ok` false, the error
    naming the rack, the watts needed and the headroom) unless an admin overrides it."""
    override = request.override(user)
    # No session of the request's: no transaction held open while a BMC takes its time.
    [report] = power(engine, box, settings, [name], request.action, user.actor, override=override)
    return _outcome(report)


NDJSON = "application/x-ndjson"


@router.post(
    "/power",
    response_model=BulkPowerOutcome,
    responses={
        200: {
            "description": (
                "All results at once (JSON), or with `Accept: application/x-ndjson` one line "
                'per server as its BMC answers: `{"count": N}`, then `{"result": {...}}` lines '
                'in the order they finish, then `{"count": N, "failed": F}`.'
            ),
            "content": {NDJSON: {}},
        }
    },
)
def power_many(
    request: BulkPowerRequest,
    http: Request,
    user: Operator,
    session: SessionDep,
    engine: EngineDep,
    box: BoxDep,
    settings: SettingsDep,
) -> BulkPowerOutcome | StreamingResponse:
    """Many servers at once: bounded concurrency, power-ons staggered per rack, each through
    its rack's budget gate (what fits is powered on; the rest fail with the refusal)."""
    override = request.override(user)
    names = request.names(session)
    session.close()  # the bulk action opens its own sessions per server
    load_servers(engine, names)  # unknown names are a 404 before anything is sent
    action: Action = request.action
    if NDJSON in http.headers.get("accept", ""):
        stream = _stream(engine, box, settings, names, action, user.actor, override)
        return StreamingResponse(stream, media_type=NDJSON)
    reports = power(engine, box, settings, names, action, user.actor, override=override)
    return BulkPowerOutcome(
        count=len(reports),
        failed=sum(not r.ok for r in reports),
        results=[_outcome(r) for r in reports],
    )


def _stream(
    engine: Engine,
    box: SecretBox,
    settings: Settings,
    names: list[str],
    action: Action,
    actor: str,
    override: Override | None,
) -> Iterator[str]:
    """Run the bulk action on a thread; yield each server's result as it lands (a progress
    bar for `fleetctl servers power`). Starlette iterates this in its thread pool."""
    done: queue.Queue[PowerReport | BaseException | None] = queue.Queue()

    def work() -> None:
        try:
            power(engine, box, settings, names, action, actor, on_done=done.put, override=override)
        except BaseException as exc:  # reported in the stream: the status line is gone
            done.put(exc)
        finally:
            done.put(None)

    threading.Thread(target=work, name="power-stream", daemon=True).start()
    yield json.dumps({"count": len(dict.fromkeys(names))}) + "\n"
    failed = 0
    while (item := done.get()) is not None:
        if isinstance(item, BaseException):
            yield json.dumps({"error": f"{type(item).__name__}: {item}"}) + "\n"
            continue
        failed += not item.ok
        yield json.dumps({"result": _outcome(item).model_dump(mode="json")}) + "\n"
    yield json.dumps({"count": len(dict.fromkeys(names)), "failed": failed}) + "\n"


@router.post("/verify")
def verify_servers(
    request: ChooseServers,
    user: Operator,
    session: SessionDep,
    engine: EngineDep,
    box: BoxDep,
    settings: SettingsDep,
) -> BulkVerifyOutcome:
    """First contact with enrolled servers' BMCs: warm-pool servers found off become `warm`;
    baseline servers are powered on and become `booting`. Others are left as they are."""
    names = request.names(session)
    session.close()
    reports = verify(engine, box, settings, names, user.actor)
    return BulkVerifyOutcome(
        count=len(reports),
        failed=sum(not r.ok for r in reports),
        results=[VerifyOutcome.model_validate(r, from_attributes=True) for r in reports],
    )
