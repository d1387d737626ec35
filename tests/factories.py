"""Plain helpers that build model rows for tests (no fixtures, no API).

Servers get their state the only legal way: `fleet.lifecycle.transitions.enroll` for the initial
state, then
a walk of legal moves through `fleet.lifecycle.transitions.transition`. Nothing here writes
`.state`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from cryptography.fernet import Fernet
from sqlmodel import Session, func, select

from fleet.crypto import SecretBox
from fleet.lifecycle import transitions as lifecycle
from fleet.lifecycle.states import INITIAL, TRANSITIONS, ServerState
from fleet.models import (
    BmcProtocol,
    Event,
    FeedSide,
    Phase,
    PowerFeed,
    Rack,
    Server,
    Site,
)

# One Fernet key for the whole test run (conftest's `secret_key` fixture returns it).
TEST_SECRET_KEY: bytes = Fernet.generate_key()
TEST_BMC_PASSWORD = "pw"
SETUP_ACTOR = "tests"
SETUP_REASON = "test setup"

# An HGX H100 8-GPU server.
H100_DEFAULTS: dict[str, Any] = {
    "u_position": 1,
    "u_height": 8,
    "bmc_protocol": BmcProtocol.REDFISH,
    "bmc_address": "127.0.0.1",
    "bmc_port": 8000,
    "bmc_username": "admin",
    "gpu_model": "H100",
    "gpu_count": 8,
    "gpu_memory_mib": 81559,
    "idle_w": 2000.0,
    "standby_w": 60.0,
    "max_w": 10200.0,
}


def path_to(target: ServerState, start: ServerState = INITIAL) -> list[ServerState]:
    """The shortest list of legal moves from `start` to `target` (empty when equal).

    Breadth-first over fleet.lifecycle.states.TRANSITIONS; raises ValueError if `target` is
    unreachable.
    """
    if target == start:
        return []
    previous: dict[ServerState, ServerState] = {}
    queue: deque[ServerState] = deque([start])
    seen = {start}
    while queue:
        state = queue.popleft()
        # Sorted so the path chosen never depends on frozenset iteration order.
        for nxt in sorted(TRANSITIONS[state], key=list(ServerState).index):
            if nxt in seen:
                continue
            seen.add(nxt)
            previous[nxt] = state
            if nxt == target:
                path = [nxt]
                while path[-1] in previous and previous[path[-1]] != start:
                    path.append(previous[path[-1]])
                return list(reversed(path))
            queue.append(nxt)
    raise ValueError(f"{target.value} is not reachable from {start.value}")


def feed(
    side: str,
    *,
    name: str | None = None,
    volts: float = 415.0,
    amps: float = 32.0,
    phase: str = "three",
    max_utilisation_pct: float = 80.0,
) -> dict[str, Any]:
    """A power-feed spec for `add_rack(feeds=[...])`."""
    spec: dict[str, Any] = {
        "side": FeedSide(side),
        "volts": volts,
        "amps": amps,
        "phase": Phase(phase),
        "max_utilisation_pct": max_utilisation_pct,
    }
    if name is not None:
        spec["name"] = name
    return spec


def add_site(session: Session, name: str = "site1") -> Site:
    site = Site(name=name)
    session.add(site)
    session.commit()
    return site


def add_rack(
    session: Session,
    site: Site,
    name: str = "rack1",
    feeds: Sequence[Mapping[str, Any]] | None = None,
    **overrides: Any,
) -> Rack:
    """A rack with its feeds; by default one 415 V 32 A three-phase feed on each side (A1, B1)."""
    assert site.id is not None
    rack = Rack(name=name, site_id=site.id, **overrides)
    session.add(rack)
    session.flush()
    assert rack.id is not None
    specs = [feed("A"), feed("B")] if feeds is None else list(feeds)
    per_side: dict[str, int] = {}
    for spec in specs:
        values = dict(spec)
        side = str(FeedSide(values["side"]))
        per_side[side] = per_side.get(side, 0) + 1
        values.setdefault("name", f"{side}{per_side[side]}")
        session.add(PowerFeed(rack_id=rack.id, **values))
    session.commit()
    return rack


def add_server(
    session: Session,
    rack: Rack,
    name: str,
    state: ServerState | str | None = None,
    **overrides: Any,
) -> Server:
    """An enrolled H100 server in `rack`, walked through legal moves to `state` if given."""
    assert rack.id is not None
    fields: dict[str, Any] = {
        **H100_DEFAULTS,
        "bmc_password_encrypted": SecretBox(TEST_SECRET_KEY).encrypt(TEST_BMC_PASSWORD),
        **overrides,
    }
    server = Server(name=name, rack_id=rack.id, **fields)
    lifecycle.enroll(session, server, actor=SETUP_ACTOR, reason=SETUP_REASON)
    session.flush()
    if state is not None:
        walk_to(session, server, ServerState(state), commit=False)
    session.commit()
    return server


def walk_to(
    session: Session, server: Server, target: ServerState, *, commit: bool = True
) -> list[ServerState]:
    """Move `server` to `target` along the shortest legal path; returns the states visited."""
    path = path_to(target, ServerState(server.state))
    for step in path:
        lifecycle.transition(
            session, server, step, actor=SETUP_ACTOR, reason=SETUP_REASON, commit=False
        )
    if commit:
        session.commit()
    return path


def event_count(session: Session, subject: str | None = None) -> int:
    query = select(func.count()).select_from(Event)
    if subject is not None:
        query = query.where(Event.subject == subject)
    return session.exec(query).one()
