"""fleet.lifecycle.transitions on both databases: the full transition matrix, events, and
refusals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from factories import add_rack, add_server, add_site, event_count, path_to
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.errors import IllegalTransitionError, NotFoundError
from fleet.lifecycle.states import INITIAL, TERMINAL, TRANSITIONS, ServerState
from fleet.lifecycle.transitions import transition
from fleet.models import Event, Rack, Server

ORDER = list(ServerState)
LEGAL = [(a, b) for a in ORDER for b in sorted(TRANSITIONS[a], key=ORDER.index)]
ILLEGAL = [(a, b) for a in ORDER for b in ORDER if a != b and b not in TRANSITIONS[a]]
ACTOR = "alice"
REASON = "rack 7 maintenance window"


def pair_id(pair: tuple[ServerState, ServerState]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


@pytest.fixture
def rack(session: Session) -> Rack:
    return add_rack(session, add_site(session, "site1"), "rack1")


def read_server(engine: Engine, name: str) -> Server:
    """The row as the database has it, through a session of its own."""
    with Session(engine) as fresh:
        return fresh.exec(select(Server).where(Server.name == name)).one()


def last_event(engine: Engine) -> Event:
    with Session(engine) as fresh:
        return fresh.exec(select(Event).order_by(col(Event.id).desc()).limit(1)).one()


def test_matrix_covers_every_pair() -> None:
    assert len(LEGAL) + len(ILLEGAL) + len(ORDER) == len(ORDER) ** 2
    # Every state is reachable from enrolled, so every pair below is actually exercised.
    for state in ORDER:
        path = path_to(state)
        previous = INITIAL
        for step in path:
            assert step in TRANSITIONS[previous]
            previous = step
        assert previous == state


@pytest.mark.parametrize(("current", "target"), LEGAL, ids=[pair_id(p) for p in LEGAL])
def test_legal_transition_writes_one_event(
    db: Engine, session: Session, rack: Rack, current: ServerState, target: ServerState
) -> None:
    server = add_server(session, rack, "gpu-1", state=current)
    assert server.state == current
    changed_before = server.state_changed_at
    before = event_count(session)

    event = transition(session, server, target, ACTOR, REASON, {"ticket": "OPS-1"})

    assert event is not None
    assert event_count(session) == before + 1
    assert server.state == target
    row = read_server(db, "gpu-1")
    assert row.state == target
    assert row.state_changed_at >= changed_before
    assert row.state_changed_at == event.at
    stored = last_event(db)
    assert stored.id == event.id
    assert (stored.subject_type, stored.subject) == ("server", "gpu-1")
    assert stored.kind == "server.transition"
    assert (stored.from_state, stored.to_state) == (current.value, target.value)
    assert (stored.actor, stored.message) == (ACTOR, REASON)
    assert stored.details == {"ticket": "OPS-1"}


@pytest.mark.parametrize(("current", "target"), ILLEGAL, ids=[pair_id(p) for p in ILLEGAL])
def test_illegal_transition_is_refused_and_changes_nothing(
    db: Engine, session: Session, rack: Rack, current: ServerState, target: ServerState
) -> None:
    server = add_server(session, rack, "gpu-1", state=current)
    changed_before = server.state_changed_at
    before = event_count(session)

    with pytest.raises(IllegalTransitionError, match=f"from {current.value} to {target.value}"):
        transition(session, server, target, ACTOR, REASON)
    session.rollback()

    assert server.state == current
    assert event_count(session) == before
    row = read_server(db, "gpu-1")
    assert row.state == current
    assert row.state_changed_at == changed_before


@pytest.mark.parametrize("state", ORDER, ids=[s.value for s in ORDER])
def test_transition_to_current_state_is_a_no_op(
    db: Engine, session: Session, rack: Rack, state: ServerState
) -> None:
    server = add_server(session, rack, "gpu-1", state=state)
    changed_before = server.state_changed_at
    before = event_count(session)

    assert transition(session, server, state, ACTOR, REASON) is None
    assert transition(session, "gpu-1", state, ACTOR, REASON) is None

    session.rollback()
    assert event_count(session) == before
    row = read_server(db, "gpu-1")
    assert row.state == state
    assert row.state_changed_at == changed_before


def test_retired_is_terminal(session: Session, rack: Rack) -> None:
    assert {ServerState.RETIRED} == TERMINAL
    assert TRANSITIONS[ServerState.RETIRED] == frozenset()
    add_server(session, rack, "gpu-1", state=ServerState.RETIRED)
    for target in ORDER:
        if target is ServerState.RETIRED:
            continue
        with pytest.raises(IllegalTransitionError, match=r"none \(terminal\)"):
            transition(session, "gpu-1", target, ACTOR, REASON)
        session.rollback()


def test_transition_by_name(db: Engine, session: Session, rack: Rack) -> None:
    add_server(session, rack, "gpu-1")
    event = transition(session, "gpu-1", ServerState.WARM, ACTOR, REASON)
    assert event is not None
    assert (event.from_state, event.to_state) == ("enrolled", "warm")
    assert read_server(db, "gpu-1").state == ServerState.WARM


def test_detached_server_object_is_updated(db: Engine, session: Session, rack: Rack) -> None:
    add_server(session, rack, "gpu-1")
    detached = read_server(db, "gpu-1")  # loaded by a session that is now closed
    transition(session, detached, ServerState.BOOTING, ACTOR, REASON)
    assert detached.state == ServerState.BOOTING
    assert read_server(db, "gpu-1").state == ServerState.BOOTING


def test_commit_false_leaves_state_and_event_to_the_caller(
    db: Engine, session: Session, rack: Rack
) -> None:
    add_server(session, rack, "gpu-1")
    before = event_count(session)
    transition(session, "gpu-1", ServerState.WARM, ACTOR, REASON, commit=False)
    session.rollback()
    # The state and its event went together.
    assert read_server(db, "gpu-1").state == ServerState.ENROLLED
    assert event_count(session) == before


def test_unknown_server(session: Session, rack: Rack) -> None:
    before = event_count(session)
    with pytest.raises(NotFoundError, match="no-such-server"):
        transition(session, "no-such-server", ServerState.WARM, ACTOR, REASON)
    session.rollback()
    assert event_count(session) == before


def test_events_record_the_whole_walk(db: Engine, session: Session, rack: Rack) -> None:
    add_server(session, rack, "gpu-1", state=ServerState.SERVING)
    with Session(db) as fresh:
        events = fresh.exec(
            select(Event).where(Event.subject == "gpu-1").order_by(col(Event.id))
        ).all()
    moves = [(e.from_state, e.to_state) for e in events]
    assert moves == [
        (None, "enrolled"),
        ("enrolled", "booting"),
        ("booting", "loading"),
        ("loading", "serving"),
    ]
    assert events[0].kind == "server.enrolled"


@pytest.fixture
def other_session(db: Engine) -> Iterator[Session]:
    with Session(db, expire_on_commit=False) as other:
        yield other


def test_stale_object_in_session_does_not_defeat_the_check(
    db: Engine, session: Session, other_session: Session, rack: Rack
) -> None:
    """Another writer retires the server; a session holding the old row must not revive it."""
    server = add_server(session, rack, "gpu-1", state=ServerState.WARM)
    transition(other_session, "gpu-1", ServerState.RETIRED, "bob", "decommissioned")
    assert read_server(db, "gpu-1").state == ServerState.RETIRED

    before = event_count(session)
    with pytest.raises(IllegalTransitionError):
        transition(session, server, ServerState.BOOTING, ACTOR, REASON)
    session.rollback()
    assert read_server(db, "gpu-1").state == ServerState.RETIRED
    assert event_count(session) == before
