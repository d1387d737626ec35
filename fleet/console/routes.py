"""The console's pages (`/ui`): server-rendered HTML (Jinja2, autoescaped) over the same service
functions the REST API calls, with a small script of our own (static/console.js) that swaps in
fresh fragments every few seconds and appends events from a server-sent stream.

Who may do what is the API's rule: any console token reads; an operator's (or an admin's)
acts, and the pages draw no action controls for anyone else — the POST routes refuse them
anyway (403). Every POST needs the session's CSRF value (fleet/console/session.py). Lists are
paged in the database (`PAGE` rows), so a 10,000-server fleet costs one page's rows.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import sqlalchemy as sa
from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.api import edge
from fleet.auth import Principal
from fleet.autoscaler import demand
from fleet.bmc.base import Action
from fleet.calendar.entries import list_entries
from fleet.console import session as sessions
from fleet.console.charts import Chart, line_chart
from fleet.console.elevation import STATE_GROUP, elevation, power_bars
from fleet.console.event_watch import EventWatch
from fleet.crypto import SecretBox
from fleet.errors import FleetError
from fleet.inventory.servers import ServerFilter, get_server, list_gpus, list_servers
from fleet.inventory.sites import count_racks, get_rack, list_feeds, list_racks
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import ServerState
from fleet.models import (
    Deployment,
    Event,
    Pool,
    PowerSample,
    Rack,
    RackPublic,
    Role,
    ScalingDecision,
    Server,
    Verdict,
)
from fleet.power.actions import power
from fleet.provisioning import operator_moves
from fleet.provisioning.autopilot import get_autopilot, set_paused
from fleet.settings import Settings

router = APIRouter(prefix="/ui", include_in_schema=False)
TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
STATIC_DIR = Path(__file__).parent / "static"
PAGE = 50  # rows per list page; racks per racks page: RACKS_PAGE
RACKS_PAGE = 24
STREAM_S = 600.0  # an event stream ends after this; the browser reconnects
STREAM_POLL_S = 1.0
STREAM_RECHECK_S = 30.0  # an open event stream checks its sign-in this often (a revoked token)
CHART_S = 3 * 3600.0  # the deployments page's charts: the last three hours
SECURITY_HEADERS = {
    # Our own script and styles only: no inline script, no other origin, no framing.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
# Operator actions on a server: the label, and what the fleet does.
ACTIONS = {
    "drain": "Drain",
    "undrain": "Undrain",
    "maintenance": "Maintenance",
    "release": "Release to enrolled",
    "power_on": "Power on",
    "power_off": "Power off",
    "power_cycle": "Power cycle",
}
# drain and undrain are the API's own moves (a drain the operator must undrain; the tick
# woken); the others are plain transitions, as `POST /servers/{name}/transition` makes them.
_DRAINS = {"drain": operator_moves.operator_drain, "undrain": operator_moves.operator_undrain}
_MOVES = {
    "maintenance": ServerState.MAINTENANCE,
    "release": ServerState.ENROLLED,
}
_POWER: dict[str, Action] = {"power_on": "on", "power_off": "off", "power_cycle": "cycle"}


@dataclass(frozen=True, slots=True)
class Who:
    principal: Principal
    session: sessions.Session

    @property
    def operator(self) -> bool:
        return self.principal.may(Role.OPERATOR)


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def _box(request: Request) -> SecretBox:
    box: SecretBox = request.app.state.box
    return box


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def who(request: Request) -> Who | None:
    """The signed-in caller, checked against the token store on every request (blocking: the
    routes are plain functions, which FastAPI runs in its worker threads)."""
    held = sessions.read(_box(request), request.cookies.get(sessions.COOKIE))
    if held is None or len(held.token) > edge.MAX_TOKEN_CHARS:
        return None
    principal = edge.lookup(_engine(request), held.token)
    if principal is None or not sessions.may_sign_in(principal):
        return None
    return Who(principal, held)


def page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    reply = TEMPLATES.TemplateResponse(request, name, context, status_code=status)
    reply.headers.update(SECURITY_HEADERS)
    return reply


def _login() -> Response:
    return RedirectResponse("/ui/login", status_code=303)


def _refused(request: Request, w: Who | None, why: str, status: int = 403) -> Response:
    csrf = w.session.csrf if w is not None else ""
    return page(request, "refused.html", {"who": w, "why": why, "csrf": csrf}, status)


def operator_post(request: Request, csrf: str) -> Who | Response:
    """The caller of an action's POST, or the refusal: signed in, the session's CSRF value,
    and an operator's (or an admin's) token, checked in that order."""
    w = who(request)
    if w is None:
        return _refused(request, None, "Sign in first.", 401)
    if not sessions.same_csrf(w.session, csrf):
        return _refused(request, w, "The form's CSRF value is missing or wrong.")
    if not w.operator:
        return _refused(request, w, edge.role_refusal(w.principal, Role.OPERATOR))
    return w


def _base(w: Who, **more: Any) -> dict[str, Any]:
    return {"who": w, "csrf": w.session.csrf, **more}


# ---------------------------------------------------------------------------------------------
# sign-in


@router.get("")
@router.get("/")
def home() -> Response:
    return RedirectResponse("/ui/racks", status_code=303)


@router.get("/login")
def login_page(request: Request) -> Response:
    return _login_form(request, None, 200)


def _login_form(request: Request, error: str | None, status: int) -> Response:
    """The sign-in form with a fresh pre-session CSRF value, in the form and in a cookie a
    page elsewhere cannot send (SameSite=Strict): signing a browser in with someone else's
    token (login CSRF) needs both."""
    value = secrets.token_urlsafe(32)
    reply = page(request, "login.html", {"who": None, "error": error, "csrf": value}, status)
    _cookie(reply, request, sessions.LOGIN_COOKIE, value, 3600, "/ui/login")
    return reply


def _cookie(
    reply: Response, request: Request, name: str, value: str, max_age: int, path: str
) -> None:
    """Every console cookie, set or cleared (max_age 0) alike: HttpOnly, SameSite=Strict,
    Secure when the request came over TLS (the service's own, or a proxy on this host saying
    so in X-Forwarded-Proto)."""
    reply.set_cookie(
        name,
        value,
        max_age=max_age,
        path=path,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


@router.post("/login")
def login(
    request: Request,
    token: str = Form("", max_length=edge.MAX_TOKEN_CHARS),
    csrf: str = Form(""),
) -> Response:
    expected = request.cookies.get(sessions.LOGIN_COOKIE) or ""
    if not expected or not hmac.compare_digest(expected.encode(), csrf.encode()):
        return _login_form(request, "The sign-in form expired: sign in again.", 403)
    principal = edge.lookup(_engine(request), token.strip()) if token.strip() else None
    if principal is None:
        return _login_form(request, "That token is not valid (unknown, revoked or expired).", 401)
    if not sessions.may_sign_in(principal):
        error = f"A {principal.role.value} token cannot sign in to the console."
        return _login_form(request, error, 403)
    cookie, _ = sessions.issue(_box(request), token.strip())
    reply = RedirectResponse("/ui/racks", status_code=303)
    _cookie(reply, request, sessions.COOKIE, cookie, sessions.LIFETIME_S, "/ui")
    _cookie(reply, request, sessions.LOGIN_COOKIE, "", 0, "/ui/login")
    return reply


@router.post("/logout")
def logout(request: Request, csrf: str = Form("")) -> Response:
    w = who(request)
    if w is not None and not sessions.same_csrf(w.session, csrf):
        return _refused(request, w, "The form's CSRF value is missing or wrong.")
    reply = RedirectResponse("/ui/login", status_code=303)
    _cookie(reply, request, sessions.COOKIE, "", 0, "/ui")
    return reply


# ---------------------------------------------------------------------------------------------
# racks


def _servers_by_rack(session: Session, rack_ids: list[int]) -> dict[int, list[Any]]:
    rows = session.execute(
        sa.select(
            col(Server.rack_id),
            col(Server.name),
            col(Server.u_position),
            col(Server.u_height),
            col(Server.state),
            col(Server.gpu_model),
            col(Server.gpu_count),
            col(Deployment.name),
        )
        .outerjoin(Deployment, col(Deployment.id) == Server.deployment_id)
        .where(col(Server.rack_id).in_(rack_ids))
    )
    out: dict[int, list[Any]] = {}
    for rack_id, name, u, height, state, gpu, gpus, deployment in rows:
        out.setdefault(rack_id, []).append(
            (name, u, height, str(state), f"{gpus}× {gpu}" if gpus else "", deployment)
        )
    return out


def _cards(session: Session, settings: Settings, racks: list[RackPublic]) -> list[dict[str, Any]]:
    """Each rack as the card template draws it: its figures, bars and elevation."""
    shape = {
        name: (rack_id or 0, height)
        for name, rack_id, height in session.execute(
            sa.select(col(Rack.name), col(Rack.id), col(Rack.u_height)).where(
                col(Rack.name).in_([r.name for r in racks])
            )
        )
    }
    servers = _servers_by_rack(session, [rack_id for rack_id, _ in shape.values()])
    cards = []
    for r in racks:
        rack_id, height = shape[r.name]
        cards.append(
            {
                "rack": r,
                "power": power_bars(
                    r.budget_w, r.committed_w, r.drawn_w, settings.power_cap_high_pct
                ),
                "boxes": elevation(height, servers.get(rack_id, [])),
                "height": height,
            }
        )
    return cards


def rack_cards(
    session: Session, settings: Settings, site: str | None, number: int
) -> dict[str, Any]:
    total = count_racks(session, site)
    pages = max(1, math.ceil(total / RACKS_PAGE))
    number = min(max(number, 1), pages)
    shown = list_racks(
        session, site, settings=settings, offset=(number - 1) * RACKS_PAGE, limit=RACKS_PAGE
    )
    return {
        "cards": _cards(session, settings, shown),
        "site": site or "",
        "number": number,
        "pages": pages,
        "total": total,
    }


def _one_rack(session: Session, settings: Settings, name: str) -> dict[str, Any] | None:
    try:
        rack = get_rack(session, name, settings=settings)
    except FleetError:
        return None
    return _cards(session, settings, [rack])[0]


@router.get("/racks")
def racks_page(request: Request, site: str | None = None, p: int = 1) -> Response:
    w = who(request)
    if w is None:
        return _login()
    with Session(_engine(request)) as session:
        body = rack_cards(session, _settings(request), site or None, p)
    live = "/ui/racks/live?" + urlencode({"site": site or "", "p": body["number"]})
    return page(request, "racks.html", _base(w, live=live, legend=_legend(), **body))


@router.get("/racks/live")
def racks_live(request: Request, site: str | None = None, p: int = 1) -> Response:
    w = who(request)
    if w is None:
        return Response(status_code=401)
    with Session(_engine(request)) as session:
        body = rack_cards(session, _settings(request), site or None, p)
    return page(request, "_racks_body.html", _base(w, **body))


@router.get("/racks/{name}")
def rack_page(request: Request, name: str) -> Response:
    w = who(request)
    if w is None:
        return _login()
    with Session(_engine(request)) as session:
        card = _one_rack(session, _settings(request), name)
        feeds = list_feeds(session, name) if card is not None else []
    if card is None:
        return _refused(request, w, f"No rack named {name!r}.", 404)
    live = f"/ui/racks/{name}/live"
    return page(request, "rack.html", _base(w, card=card, feeds=feeds, legend=_legend(), live=live))


@router.get("/racks/{name}/live")
def rack_live(request: Request, name: str) -> Response:
    w = who(request)
    if w is None:
        return Response(status_code=401)
    with Session(_engine(request)) as session:
        card = _one_rack(session, _settings(request), name)
    if card is None:
        return Response(status_code=404)
    return page(request, "_rack_card.html", _base(w, card=card, single=True))


def _legend() -> list[tuple[str, list[str]]]:
    groups: dict[str, list[str]] = {}
    for state, group in STATE_GROUP.items():
        groups.setdefault(group, []).append(state)
    return sorted(groups.items())


# ---------------------------------------------------------------------------------------------
# servers


@router.get("/servers")
def servers_page(
    request: Request,
    site: str = "",
    rack: str = "",
    pool: str = "",
    state: str = "",
    gpu_model: str = "",
    deployment: str = "",
    health: str = "",
    p: int = 1,
) -> Response:
    w = who(request)
    if w is None:
        return _login()
    try:
        where = ServerFilter(
            site=site or None,
            rack=rack or None,
            pool=Pool(pool) if pool else None,
            state=ServerState(state) if state else None,
            gpu_model=gpu_model or None,
            deployment=deployment or None,
            health=Verdict(health) if health else None,
        )
    except ValueError as exc:
        return _refused(request, w, f"Not a filter: {exc}.", 400)
    number = max(p, 1)
    with Session(_engine(request)) as session:
        count, rows = list_servers(session, where, PAGE, (number - 1) * PAGE)
    pages = max(1, math.ceil(count / PAGE))
    filters = {
        "site": site,
        "rack": rack,
        "pool": pool,
        "state": state,
        "gpu_model": gpu_model,
        "deployment": deployment,
        "health": health,
    }
    return page(
        request,
        "servers.html",
        _base(
            w,
            rows=rows,
            count=count,
            number=number,
            pages=pages,
            filters=filters,
            query=urlencode({k: v for k, v in filters.items() if v}),
            states=[s.value for s in ServerState],
            pools=[x.value for x in Pool],
            verdicts=[x.value for x in Verdict],
            group=STATE_GROUP,
        ),
    )


def _server_context(session: Session, name: str) -> dict[str, Any]:
    server = get_server(session, name)
    _, gpus = list_gpus(session, name, 64, 0)
    events = list(
        session.exec(
            select(Event)
            .where(Event.subject_type == "server", Event.subject == name)
            .order_by(col(Event.id).desc())
            .limit(50)
        )
    )
    samples = list(
        session.exec(
            select(PowerSample)
            .where(PowerSample.kind == "server", PowerSample.subject == name)
            .order_by(col(PowerSample.bucket_start).desc())
            .limit(24)
        )
    )
    return {
        "server": server,
        "gpus": gpus,
        "events": events,
        "samples": samples,
        "group": STATE_GROUP.get(str(server.state), "out"),
    }


@router.get("/servers/{name}")
def server_page(request: Request, name: str, said: str = "") -> Response:
    w = who(request)
    if w is None:
        return _login()
    try:
        with Session(_engine(request)) as session:
            context = _server_context(session, name)
    except FleetError as exc:
        return _refused(request, w, str(exc), 404)
    return page(
        request,
        "server.html",
        _base(w, actions=ACTIONS, said=said[:300], live=f"/ui/servers/{name}/live", **context),
    )


@router.get("/servers/{name}/live")
def server_live(request: Request, name: str) -> Response:
    w = who(request)
    if w is None:
        return Response(status_code=401)
    try:
        with Session(_engine(request)) as session:
            context = _server_context(session, name)
    except FleetError:
        return Response(status_code=404)
    return page(request, "_server_state.html", _base(w, **context))


@router.post("/servers/{name}/action")
def server_action(
    request: Request,
    name: str,
    action: str = Form(""),
    reason: str = Form("", max_length=500),
    confirm: str = Form(""),
    csrf: str = Form(""),
) -> Response:
    w = operator_post(request, csrf)
    if not isinstance(w, Who):
        return w
    if action not in ACTIONS:
        return _refused(request, w, f"No action {action!r}: one of {', '.join(ACTIONS)}.", 400)
    if confirm != "yes":
        return _refused(request, w, "Confirm the action (tick the box) to act.", 400)
    why = reason.strip()
    if not why:
        return _refused(request, w, "Give a reason: it goes into the server's events.", 400)
    actor = w.principal.actor
    try:
        if action in _DRAINS:
            with Session(_engine(request)) as session:
                _DRAINS[action](session, name, actor, f"console: {why}")
            said = f"{ACTIONS[action]}: done"
        elif action in _MOVES:
            with Session(_engine(request)) as session:
                lifecycle.transition(session, name, _MOVES[action], actor, f"console: {why}")
            said = f"{ACTIONS[action]}: done"
        else:
            [report] = power(
                _engine(request), _box(request), _settings(request), [name], _POWER[action], actor
            )
            said = f"{ACTIONS[action]}: " + ("done" if report.ok else f"failed: {report.error}")
    except FleetError as exc:
        return _refused(request, w, str(exc), 409)
    target = f"/ui/servers/{name}?" + urlencode({"said": said})
    return RedirectResponse(target, status_code=303)


# ---------------------------------------------------------------------------------------------
# deployments, events, autopilot


@router.get("/deployments")
def deployments_page(request: Request) -> Response:
    w = who(request)
    if w is None:
        return _login()
    # The rows are read after the session (the template): nothing may expire them.
    with Session(_engine(request), expire_on_commit=False) as session:
        deployments = list(session.exec(select(Deployment).order_by(col(Deployment.name))))
        counts: dict[int, dict[str, int]] = {}
        for dep_id, state, n in session.exec(
            select(Server.deployment_id, Server.state, sa.func.count())
            .where(col(Server.deployment_id).is_not(None))
            .group_by(col(Server.deployment_id), col(Server.state))
        ):
            counts.setdefault(dep_id or 0, {})[str(state)] = n
        decisions: dict[str, list[ScalingDecision]] = {}
        for d in deployments:
            decisions[d.name] = list(
                session.exec(
                    select(ScalingDecision)
                    .where(ScalingDecision.deployment == d.name)
                    .order_by(col(ScalingDecision.id).desc())
                    .limit(8)
                )
            )
        autopilot = get_autopilot(session)
        end = time.time()
        charts = {d.name: _charts(session, d, end) for d in deployments}
        windows = {
            d.name: [e for e in list_entries(session, _settings(request), d.name) if e["next"]]
            for d in deployments
        }
    rows = [
        {
            "deployment": d,
            "states": counts.get(d.id or 0, {}),
            "decisions": decisions[d.name],
            "charts": charts[d.name],
            "windows": windows[d.name],
        }
        for d in deployments
    ]
    return page(request, "deployments.html", _base(w, rows=rows, autopilot=autopilot))


def _charts(session: Session, d: Deployment, end: float) -> dict[str, Chart]:
    """The last CHART_S of the deployment's minutes (fleet/autoscaler/demand.py): requests
    per minute, and the p95 and TTFT p95 the autoscaler saw against the SLA."""
    start = end - CHART_S
    since = datetime.fromtimestamp(start, tz=UTC).replace(minute=0, second=0, microsecond=0)
    minutes = demand.read_recent(session, d.name, since)
    return {
        "requests": line_chart([(t, r) for t, r, _, _ in minutes], start, end),
        "p95": line_chart(
            [(t, p) for t, _, p, _ in minutes], start, end, limit=d.sla_p95_latency_ms / 1000
        ),
        "ttft": line_chart(
            [(t, x) for t, _, _, x in minutes], start, end, limit=d.sla_ttft_ms / 1000
        ),
    }


@router.post("/autopilot")
def autopilot(
    request: Request,
    to: str = Form(""),
    reason: str = Form("", max_length=500),
    confirm: str = Form(""),
    csrf: str = Form(""),
) -> Response:
    w = operator_post(request, csrf)
    if not isinstance(w, Who):
        return w
    if to not in ("pause", "resume") or confirm != "yes" or not reason.strip():
        return _refused(request, w, "Pause or resume, with the box ticked and a reason.", 400)
    with Session(_engine(request)) as session:
        set_paused(session, to == "pause", w.principal.actor, f"console: {reason.strip()}")
    return RedirectResponse("/ui/deployments", status_code=303)


def _event_query(kind: str, subject: str) -> Any:
    query = select(Event)
    if kind:
        query = query.where(col(Event.kind).startswith(kind))
    if subject:
        query = query.where(Event.subject == subject)
    return query


@router.get("/events")
def events_page(request: Request, kind: str = "", subject: str = "") -> Response:
    w = who(request)
    if w is None:
        return _login()
    with Session(_engine(request)) as session:
        rows = list(
            session.exec(_event_query(kind, subject).order_by(col(Event.id).desc()).limit(PAGE))
        )
    stream = "/ui/events/stream?" + urlencode(
        {"kind": kind, "subject": subject, "after": rows[0].id if rows else 0}
    )
    return page(
        request,
        "events.html",
        _base(w, rows=rows, kind=kind, subject=subject, stream=stream),
    )


def _event_watch(request: Request) -> EventWatch:
    """The process's shared watch of the settled event id (fleet/console/event_watch.py)."""
    watch: EventWatch | None = getattr(request.app.state, "event_watch", None)
    if watch is None:
        engine = _engine(request)

        def read_newest() -> int:
            with Session(engine) as session:
                return int(session.exec(select(sa.func.max(Event.id))).one() or 0)

        def read_ids(after: int, limit: int) -> list[int]:
            query = select(Event.id).where(col(Event.id) > after).order_by(col(Event.id))
            with Session(engine) as session:
                return [int(i) for i in session.exec(query.limit(limit)) if i is not None]

        watch = EventWatch(read_newest, read_ids, STREAM_POLL_S)
        request.app.state.event_watch = watch
    return watch


def event_row(e: Event) -> str:
    """One event as the feed's table row (escaped: messages are operators' and agents' text)."""
    cells = (e.at.strftime("%Y-%m-%d %H:%M:%S"), e.subject, e.kind, e.actor, e.message)
    return "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"


@router.get("/events/stream")
async def events_stream(
    request: Request, kind: str = "", subject: str = "", after: int = 0
) -> Response:
    engine = _engine(request)
    w = await asyncio.to_thread(who, request)
    if w is None:
        return Response(status_code=401)

    watch = _event_watch(request)
    # A browser reconnecting (the stream ends after STREAM_S) sends the last id it got: go on
    # from there, not from the page's `after` again (which would repeat every row since)
    resumed = request.headers.get("last-event-id", "")
    if resumed.isdigit():
        after = max(after, int(resumed))

    def newer(last: int, settled: int) -> list[Event]:
        with Session(engine) as session:
            query = _event_query(kind, subject).where(
                col(Event.id) > last, col(Event.id) <= settled
            )
            return list(session.exec(query.order_by(col(Event.id)).limit(200)))

    async def feed() -> AsyncIterator[str]:
        last = after  # the newest event this feed sent (its filter's)
        seen = -1  # the settled event id when this feed last queried (-1: not yet)
        ends = time.monotonic() + STREAM_S
        recheck = time.monotonic() + STREAM_RECHECK_S
        yield "retry: 2000\n\n"
        while time.monotonic() < ends:
            if await request.is_disconnected():
                return
            if time.monotonic() >= recheck:  # signed out or revoked: the stream ends
                if await asyncio.to_thread(who, request) is None:
                    return
                recheck = time.monotonic() + STREAM_RECHECK_S
            settled = await watch.newest()
            if settled > seen:  # something happened since (the feed's filter may drop it)
                rows = await asyncio.to_thread(newer, last, settled)
                seen = settled if len(rows) < 200 else -1  # a full page: more to read
                for e in rows:
                    last = e.id or last
                    yield f"id: {last}\ndata: {event_row(e)}\n\n"
            await asyncio.sleep(STREAM_POLL_S)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(feed(), media_type="text/event-stream", headers=headers)


def static_response(name: str) -> Response:
    path = STATIC_DIR / name
    if not path.is_file() or path.parent != STATIC_DIR:
        return Response(status_code=404)
    kind = {"js": "text/javascript", "css": "text/css"}.get(path.suffix[1:], "text/plain")
    return Response(path.read_bytes(), media_type=kind, headers={"Cache-Control": "max-age=300"})


@router.get("/static/{name}")
def static(name: str) -> Response:
    return static_response(name)
