"""Writers racing each other on both databases: lifecycle transitions, inventory imports, and the
BMC endpoint index that backs the importer's own check.

Every race runs its contenders in threads, each with its own Session on the shared engine,
released together by a Barrier and joined with a timeout, so a deadlock fails the test instead
of hanging the run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from factories import add_rack, add_server, add_site
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.db import session_scope
from fleet.errors import ConflictError, ValidationFailed
from fleet.inventory import import_inventory, parse_inventory
from fleet.lifecycle.states import ServerState
from fleet.lifecycle.transitions import transition
from fleet.models import Event, Rack, Server

ACTOR = "tests:concurrency"
BARRIER_TIMEOUT_S = 20.0
JOIN_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# Running contenders together


@dataclass
class Outcome:
    value: object = None
    error: BaseException | None = None


def run_together(contenders: Sequence[Callable[[], object]]) -> list[Outcome]:
    """Run every callable in its own thread, all released at once; one Outcome each, in order."""
    barrier = threading.Barrier(len(contenders))
    outcomes = [Outcome() for _ in contenders]

    def run(index: int, fn: Callable[[], object]) -> None:
        try:
            barrier.wait(timeout=BARRIER_TIMEOUT_S)
            outcomes[index].value = fn()
        except BaseException as exc:  # reported to the test thread, never lost in this one
            outcomes[index].error = exc

    threads = [
        threading.Thread(target=run, args=(i, fn), name=f"contender-{i}", daemon=True)
        for i, fn in enumerate(contenders)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still running after {JOIN_TIMEOUT_S:.0f} s: {stuck}"
    return outcomes


# ---------------------------------------------------------------------------------------------
# Concurrent transitions

SERVERS = 8
THREADS_PER_SERVER = 4


def test_concurrent_transitions_move_each_server_once(db: Engine, session: Session) -> None:
    site = add_site(session)
    rack = add_rack(session, site, u_height=60)
    names = [f"gpu-{i}" for i in range(SERVERS)]
    for i, name in enumerate(names):
        add_server(
            session,
            rack,
            name,
            state=ServerState.SERVING,
            u_position=1 + 7 * i,
            u_height=7,
            bmc_system_id=f"sys-{i}",
        )

    def drain(name: str, thread: int) -> str | None:
        with Session(db, expire_on_commit=False) as own:
            event = transition(
                own, name, ServerState.DRAINING, actor=f"{ACTOR}:{thread}", reason="race"
            )
            return None if event is None else event.kind

    contenders = [partial(drain, name, t) for name in names for t in range(THREADS_PER_SERVER)]
    outcomes = run_together(contenders)

    unexpected = [
        repr(o.error)
        for o in outcomes
        if o.error is not None and not isinstance(o.error, ConflictError)
    ]
    assert unexpected == [], "only ConflictError may escape a racing transition"
    for index, name in enumerate(names):
        mine = outcomes[index * THREADS_PER_SERVER : (index + 1) * THREADS_PER_SERVER]
        moved = [o for o in mine if o.error is None and o.value == "server.transition"]
        assert len(moved) == 1, f"{name}: {len(moved)} threads moved it"
        assert all(o.error is not None or o.value in (None, "server.transition") for o in mine)

    with Session(db) as fresh:
        states = dict(fresh.exec(select(Server.name, Server.state)).all())
        assert states == dict.fromkeys(names, ServerState.DRAINING)
        drains = fresh.exec(
            select(Event.subject).where(
                Event.kind == "server.transition",
                Event.from_state == ServerState.SERVING.value,
                Event.to_state == ServerState.DRAINING.value,
            )
        ).all()
        assert sorted(drains) == sorted(names), "exactly one serving→draining event per server"


# ---------------------------------------------------------------------------------------------
# Concurrent inventory imports

ROUNDS = 4
PASSWORD = "race-bmc-password"


@pytest.fixture
def box(secret_key: bytes) -> SecretBox:
    return SecretBox(secret_key)


def server_doc(name: str, rack: str, u: int, *, port: int, system_id: str) -> dict[str, Any]:
    return {
        "name": name,
        "rack": rack,
        "u": u,
        "u_height": 8,
        "bmc": {
            "protocol": "redfish",
            "address": "127.0.0.1",
            "port": port,
            "username": "admin",
            "password": PASSWORD,
            "system_id": system_id,
        },
        "gpu": {"model": "H100", "count": 8},
        "power": {"idle_w": 1900, "standby_w": 90, "max_w": 10_200},
    }


def base_doc() -> dict[str, Any]:
    """One site with a rack per round, each with feeds on both sides and no servers."""
    racks = [
        {
            "name": f"r{i}",
            "feeds": [
                {"name": "a1", "side": "A", "volts": 415, "amps": 63, "phase": "three"},
                {"name": "b1", "side": "B", "volts": 415, "amps": 63, "phase": "three"},
            ],
        }
        for i in range(ROUNDS)
    ]
    return {"sites": [{"name": "lab", "racks": racks}]}


def import_text(engine: Engine, box: SecretBox, text: str) -> None:
    with session_scope(engine) as s:
        import_inventory(s, parse_inventory(text), box, ACTOR)


# The first file puts server a-<rack> at U1-U8 of <rack>, BMC 127.0.0.1:<port> system "a". Each
# conflict: the second file's server (given the rack and port), and what the loser's error says.
CONFLICTS: dict[str, tuple[Callable[[str, int], dict[str, Any]], str]] = {
    "same-u": (
        lambda rack, port: server_doc(f"b-{rack}", rack, 1, port=port, system_id="b"),
        "overlaps",
    ),
    "same-bmc": (
        lambda rack, port: server_doc(f"b-{rack}", rack, 20, port=port, system_id="a"),
        "is already the BMC of",
    ),
}


@pytest.mark.parametrize("conflict", sorted(CONFLICTS))
def test_concurrent_imports_one_wins_the_other_is_refused(
    db: Engine, box: SecretBox, conflict: str
) -> None:
    import_text(db, box, yaml.safe_dump(base_doc()))
    second, words = CONFLICTS[conflict]
    for round_ in range(ROUNDS):
        rack, port = f"r{round_}", 9000 + round_  # a BMC endpoint of this round's own
        first_doc = {"servers": [server_doc(f"a-{rack}", rack, 1, port=port, system_id="a")]}
        second_doc = {"servers": [second(rack, port)]}
        texts = [yaml.safe_dump(first_doc), yaml.safe_dump(second_doc)]
        outcomes = run_together([partial(import_text, db, box, t) for t in texts])

        winners = [i for i, o in enumerate(outcomes) if o.error is None]
        assert len(winners) == 1, f"round {round_}: {[repr(o.error) for o in outcomes]}"
        loser = outcomes[1 - winners[0]].error
        assert isinstance(loser, ValidationFailed), f"round {round_}: {loser!r}"
        assert any(words in e for e in loser.errors), loser.errors
        winner_name = [f"a-{rack}", f"b-{rack}"][winners[0]]

        with Session(db) as fresh:
            rack_id = fresh.exec(select(Rack.id).where(Rack.name == rack)).one()
            in_rack = fresh.exec(select(Server.name).where(Server.rack_id == rack_id)).all()
            assert in_rack == [winner_name]
            imported = fresh.exec(
                select(sa.func.count())
                .select_from(Event)
                .where(col(Event.kind) == "inventory.imported")
            ).one()
            # The base file, then one import per round so far.
            assert imported == 1 + round_ + 1


# ---------------------------------------------------------------------------------------------
# The BMC endpoint index


@pytest.fixture
def rack(session: Session) -> Rack:
    return add_rack(session, add_site(session), u_height=60)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param("sys-1", "sys-1", id="same-system-id"),
        pytest.param(None, None, id="both-null"),
        pytest.param(None, "", id="null-and-empty"),
    ],
)
def test_same_bmc_endpoint_is_refused_by_the_database(
    db: Engine, session: Session, rack: Rack, first: str | None, second: str | None
) -> None:
    add_server(session, rack, "gpu-1", u_position=1, bmc_system_id=first)
    with pytest.raises(sa.exc.IntegrityError):
        add_server(session, rack, "gpu-2", u_position=9, bmc_system_id=second)
    session.rollback()
    with Session(db) as fresh:
        assert fresh.exec(select(Server.name)).all() == ["gpu-1"]


def test_other_system_ids_or_ports_on_one_address_are_fine(
    db: Engine, session: Session, rack: Rack
) -> None:
    endpoints: list[tuple[int, str | None]] = [
        (8000, None),
        (8000, "sys-1"),
        (8000, "sys-2"),
        (8001, None),
        (8001, "sys-1"),
    ]
    for i, (port, system_id) in enumerate(endpoints):
        add_server(
            session,
            rack,
            f"gpu-{i}",
            u_position=1 + 8 * i,
            bmc_port=port,
            bmc_system_id=system_id,
        )
    with Session(db) as fresh:
        rows = fresh.exec(select(Server.bmc_port, Server.bmc_system_id)).all()
        assert sorted(rows, key=repr) == sorted(endpoints, key=repr)
