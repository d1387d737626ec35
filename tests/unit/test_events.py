"""The event log (fleet/events.py and the migration's guard) on both databases.

Events are append-only in the database itself; the kind filter is a prefix match on whole
dot-separated words, never a LIKE pattern; set_fields/record_update log field names, never
values.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from factories import TEST_BMC_PASSWORD, add_rack, add_server, add_site, event_count
from pg import throwaway_database
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.db import make_engine, upgrade
from fleet.events import EventFilter, list_events, record_update, set_fields
from fleet.lifecycle.states import ServerState
from fleet.models import Event, Rack, Server

ACTOR = "tests:events"
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def add_event(session: Session, kind: str, at: datetime = T0, subject: str = "s1") -> Event:
    event = Event(at=at, subject_type="server", subject=subject, actor=ACTOR, kind=kind)
    session.add(event)
    session.commit()
    return event


def kinds(session: Session, where: EventFilter) -> list[str]:
    count, rows = list_events(session, where, limit=100, offset=0)
    assert count == len(rows)
    return sorted(e.kind for e in rows)


# ---------------------------------------------------------------------------------------------
# Append-only


def test_update_of_an_event_is_refused(db: Engine, session: Session) -> None:
    add_event(session, "server.transition")
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.begin() as conn:
        conn.execute(sa.text("UPDATE event SET kind = 'x'"))
    with Session(db) as fresh:
        assert fresh.exec(select(Event.kind)).all() == ["server.transition"]


def test_orm_update_of_an_event_is_refused(db: Engine, session: Session) -> None:
    event = add_event(session, "server.transition")
    event.message = "rewritten"
    session.add(event)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        session.commit()
    session.rollback()


def test_delete_of_an_event_is_refused_on_postgres(
    pg_url: str, db: Engine, session: Session
) -> None:
    add_event(session, "server.transition")
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.begin() as conn:
        conn.execute(sa.text("DELETE FROM event"))
    assert event_count(session) == 1


def test_maintenance_may_delete_events_in_its_own_transaction(
    pg_url: str, db: Engine, session: Session
) -> None:
    add_event(session, "server.transition")
    add_event(session, "server.updated")
    with db.begin() as conn:
        conn.execute(sa.text("SET LOCAL fleet.event_maintenance = 'on'"))
        conn.execute(sa.text("DELETE FROM event WHERE kind = 'server.updated'"))
    assert [e.kind for e in session.exec(select(Event))] == ["server.transition"]
    # SET LOCAL ends with its transaction: the next one is refused again.
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.begin() as conn:
        conn.execute(sa.text("DELETE FROM event"))
    assert event_count(session) == 1


# ---------------------------------------------------------------------------------------------
# The kind filter

KINDS = [
    "server",
    "server.transition",
    "server.updated",
    "server.transition.retry",
    "serverx.y",
    "servers.z",
    "server_a.b",
    "server-a.b",
    "server/x",
    "rack.updated",
    "inventory.imported",
]


@pytest.fixture
def many_kinds(session: Session) -> Session:
    for kind in KINDS:
        add_event(session, kind)
    return session


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        pytest.param(
            "server",
            ["server", "server.transition", "server.transition.retry", "server.updated"],
            id="prefix",
        ),
        pytest.param(
            "server.transition", ["server.transition", "server.transition.retry"], id="exact"
        ),
        pytest.param("server.updated", ["server.updated"], id="exact-leaf"),
        pytest.param("rack", ["rack.updated"], id="other-prefix"),
        pytest.param("server_", [], id="underscore-is-no-wildcard"),
        pytest.param("server%", [], id="percent-is-no-wildcard"),
        pytest.param("serv", [], id="partial-word"),
        pytest.param("server.", [], id="trailing-dot"),
        pytest.param("%", [], id="percent-alone"),
        pytest.param("_", [], id="underscore-alone"),
        pytest.param("server_a.b", ["server_a.b"], id="underscore-literal"),
        pytest.param("serverx", ["serverx.y"], id="longer-word"),
    ],
)
def test_kind_filter(many_kinds: Session, kind: str, expected: list[str]) -> None:
    assert kinds(many_kinds, EventFilter(kind=kind)) == expected


def test_no_kind_filter_lists_every_event(many_kinds: Session) -> None:
    assert kinds(many_kinds, EventFilter()) == sorted(KINDS)


def test_kind_filter_combines_with_subject(session: Session) -> None:
    add_event(session, "server.transition", subject="s1")
    add_event(session, "server.transition", subject="s2")
    add_event(session, "rack.updated", subject="s1")
    count, rows = list_events(
        session, EventFilter(kind="server", subject="s1", subject_type="server"), 10, 0
    )
    assert count == 1
    assert [(e.kind, e.subject) for e in rows] == [("server.transition", "s1")]


@pytest.fixture
def punctuation_blind_db(pg_url: str) -> Iterator[Engine]:
    """A migrated Postgres database whose default collation ignores punctuation at the first
    level, as glibc's en_US.UTF-8 does (the official postgres image initdb's with it)."""
    admin = sa.make_url(pg_url).set(database="postgres").render_as_string(hide_password=False)
    options = (
        "TEMPLATE template0 LOCALE 'C.UTF-8' LOCALE_PROVIDER icu ICU_LOCALE 'en-US-u-ka-shifted'"
    )
    with throwaway_database("fleet_test_collation", admin, options) as url:
        engine = make_engine(url)
        try:
            upgrade(engine)
            yield engine
        finally:
            engine.dispose()


def test_kind_filter_under_a_punctuation_blind_collation(punctuation_blind_db: Engine) -> None:
    with Session(punctuation_blind_db) as session:
        for kind in KINDS:
            add_event(session, kind)
        assert kinds(session, EventFilter(kind="server")) == [
            "server",
            "server.transition",
            "server.transition.retry",
            "server.updated",
        ]


# ---------------------------------------------------------------------------------------------
# since / until


@pytest.fixture
def hourly(session: Session) -> Session:
    """Events at T0, T0 + 1 h and T0 + 2 h."""
    for hour in range(3):
        add_event(session, f"server.h{hour}", at=T0 + timedelta(hours=hour))
    return session


def naive(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(tzinfo=None)


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda d: d, id="aware-utc"),
        pytest.param(naive, id="naive-is-utc"),
        pytest.param(lambda d: d.astimezone(timezone(timedelta(hours=-5))), id="aware-minus-5"),
        pytest.param(lambda d: d.astimezone(timezone(timedelta(hours=9))), id="aware-plus-9"),
    ],
)
def test_since_is_inclusive_until_exclusive(
    hourly: Session, convert: Callable[[datetime], datetime]
) -> None:
    one = T0 + timedelta(hours=1)
    two = T0 + timedelta(hours=2)
    assert kinds(hourly, EventFilter(since=convert(one))) == ["server.h1", "server.h2"]
    assert kinds(hourly, EventFilter(until=convert(one))) == ["server.h0"]
    assert kinds(hourly, EventFilter(since=convert(one), until=convert(two))) == ["server.h1"]
    assert kinds(hourly, EventFilter(since=convert(two), until=convert(one))) == []


@pytest.mark.skipif(not hasattr(time, "tzset"), reason="time.tzset is POSIX-only")
def test_naive_times_are_not_read_as_local_time(hourly: Session) -> None:
    """On a host whose clock is UTC a naive time read as local time would pass unnoticed."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Kolkata"  # UTC+05:30, no daylight saving
    time.tzset()
    try:
        one, two = T0 + timedelta(hours=1), T0 + timedelta(hours=2)
        where = EventFilter(since=naive(one), until=naive(two))
        assert kinds(hourly, where) == ["server.h1"]
    finally:
        if saved is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = saved
        time.tzset()


def test_paging_counts_every_match(hourly: Session) -> None:
    count, rows = list_events(hourly, EventFilter(kind="server"), limit=1, offset=1)
    assert count == 3
    assert [e.kind for e in rows] == ["server.h1"]  # newest first


# ---------------------------------------------------------------------------------------------
# set_fields / record_update


@pytest.fixture
def rack(session: Session) -> Rack:
    return add_rack(session, add_site(session), u_height=42)


def test_set_fields_sets_and_lists_only_what_differs(session: Session, rack: Rack) -> None:
    server = add_server(session, rack, "gpu-1")
    changed = set_fields(
        server,
        {
            "bmc_port": 9000,
            "bmc_username": server.bmc_username,  # unchanged
            "bmc_system_id": "sys-9",
            "pool": server.pool,  # unchanged
        },
    )
    assert changed == ["bmc_port", "bmc_system_id"]
    assert (server.bmc_port, server.bmc_system_id) == (9000, "sys-9")
    assert set_fields(server, {"bmc_port": 9000, "bmc_system_id": "sys-9"}) == []


def test_set_fields_cannot_write_a_servers_state(session: Session, rack: Rack) -> None:
    server = add_server(session, rack, "gpu-1")
    with pytest.raises(AttributeError, match=r"fleet\.lifecycle"):
        set_fields(server, {"state": ServerState.SERVING})
    assert server.state == ServerState.ENROLLED


def test_record_update_logs_field_names_only(db: Engine, session: Session, rack: Rack) -> None:
    server = add_server(session, rack, "gpu-1")
    before_events, before_updated = event_count(session), server.updated_at
    secret = "new-" + TEST_BMC_PASSWORD + "-distinctive"
    changed = set_fields(server, {"bmc_username": "root", "bmc_password_encrypted": secret})
    at = before_updated + timedelta(minutes=5)
    record_update(session, server, "server", server.name, changed, ACTOR, "edited", at)
    session.commit()

    assert event_count(session) == before_events + 1
    with Session(db) as fresh:
        event = fresh.exec(select(Event).order_by(col(Event.id).desc()).limit(1)).one()
        row = fresh.exec(select(Server).where(Server.name == "gpu-1")).one()
    assert (event.kind, event.subject_type, event.subject) == ("server.updated", "server", "gpu-1")
    assert (event.actor, event.message, event.at) == (ACTOR, "edited", at)
    assert event.details == {"fields": ["bmc_username", "bmc_password_encrypted"]}
    assert secret not in event.model_dump_json()
    assert "root" not in event.model_dump_json()
    assert row.updated_at == at
    assert row.bmc_username == "root"


def test_record_update_without_changes_records_nothing(
    db: Engine, session: Session, rack: Rack
) -> None:
    server = add_server(session, rack, "gpu-1")
    before_events, before_updated = event_count(session), server.updated_at
    changed = set_fields(server, {"bmc_username": server.bmc_username})
    assert changed == []
    record_update(session, server, "server", server.name, changed, ACTOR, "edited")
    session.commit()
    assert event_count(session) == before_events
    with Session(db) as fresh:
        row = fresh.exec(select(Server).where(Server.name == "gpu-1")).one()
    assert row.updated_at == before_updated


def test_record_update_stamps_now_when_no_time_is_given(session: Session, rack: Rack) -> None:
    server = add_server(session, rack, "gpu-1")
    start = datetime.now(UTC)
    changed = set_fields(server, {"bmc_port": 9999})
    record_update(session, server, "server", server.name, changed, ACTOR, "edited")
    session.commit()
    event = session.exec(select(Event).where(Event.kind == "server.updated")).one()
    assert start <= event.at <= datetime.now(UTC)
    assert server.updated_at == event.at
