"""API tokens: created once, stored hashed, scoped, revocable (fleet/auth.py)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from factories import add_rack, add_server, add_site
from live import database_env, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner

from fleet import cli
from fleet.auth import (
    MAX_LIFETIME,
    MAX_TOKEN_NAME,
    authenticate,
    create_token,
    hash_token,
    list_tokens,
    parse_lifetime,
    revoke_token,
)
from fleet.errors import FleetError, NotFoundError
from fleet.models import ApiToken, Event, Role, as_utc, utcnow


def test_token_is_stored_only_as_its_hash(session: Session) -> None:
    token = create_token(session, "ops", Role.OPERATOR)
    session.commit()
    [row] = session.exec(select(ApiToken)).all()
    assert row.token_hash == hash_token(token) and token not in row.token_hash
    principal = authenticate(session, token)
    assert principal is not None and principal.role is Role.OPERATOR
    assert principal.actor == "operator:ops"
    assert authenticate(session, token + "x") is None


def test_roles_form_a_ladder_and_agents_stand_apart(session: Session) -> None:
    site = add_site(session, "s1")
    rack = add_rack(session, site, "r1")
    add_server(session, rack, "gpu-1")
    tokens: dict[Role, str] = {
        role: create_token(session, role.value, role) for role in Role if role != Role.AGENT
    }
    tokens[Role.AGENT] = create_token(session, "agent", Role.AGENT, server="gpu-1")
    session.commit()
    may: dict[Role, set[Role]] = {}
    for role, token in tokens.items():
        principal = authenticate(session, token)
        assert principal is not None
        may[role] = {needed for needed in Role if principal.may(needed)}
    assert may[Role.ADMIN] == {Role.ADMIN, Role.OPERATOR, Role.ROUTER, Role.VIEWER}
    assert may[Role.OPERATOR] == {Role.OPERATOR, Role.ROUTER, Role.VIEWER}
    assert may[Role.ROUTER] == {Role.ROUTER, Role.VIEWER}  # reads, and reports its load
    assert may[Role.VIEWER] == {Role.VIEWER}
    assert may[Role.AGENT] == {Role.AGENT}


def test_agent_tokens_need_exactly_one_known_server(session: Session) -> None:
    with pytest.raises(FleetError, match="--server"):
        create_token(session, "a", Role.AGENT)
    with pytest.raises(NotFoundError, match="ghost"):
        create_token(session, "a", Role.AGENT, server="ghost")
    with pytest.raises(FleetError, match="only to agent tokens"):
        create_token(session, "v", Role.VIEWER, server="ghost")


def test_revoked_tokens_stop_working_and_revoking_twice_is_a_no_op(session: Session) -> None:
    site = add_site(session, "s1")
    add_server(session, add_rack(session, site, "r1"), "gpu-1")
    token = create_token(session, "agent-1", Role.AGENT, server="gpu-1")
    session.commit()
    [info] = list_tokens(session)
    assert (info.role, info.server, info.revoked_at) == ("agent", "gpu-1", None)

    revoked = revoke_token(session, info.id)
    session.commit()
    assert revoked.revoked_at is not None
    assert authenticate(session, token) is None
    assert revoke_token(session, info.id).revoked_at == revoked.revoked_at
    session.commit()
    # Ordered by id: without ORDER BY, Postgres returns rows wherever they sit on disk, and
    # earlier tests' wiped rows leave free space that a later insert may fill first.
    token_events = select(Event).where(Event.subject_type == "token").order_by(col(Event.id))
    kinds = [e.kind for e in session.exec(token_events)]
    assert kinds == ["token.created", "token.revoked"]
    with pytest.raises(NotFoundError, match="token list"):
        revoke_token(session, 999)


def test_token_names_are_1_to_80_characters(session: Session) -> None:
    """Events name a caller "<role>:<name>" in a 100-character column."""
    assert MAX_TOKEN_NAME == 80
    for name in ("", "n" * (MAX_TOKEN_NAME + 1), "n" * 1000):
        with pytest.raises(FleetError, match=f"a token name must be 1-{MAX_TOKEN_NAME} characters"):
            create_token(session, name, Role.ADMIN)
    session.commit()
    assert session.exec(select(ApiToken)).all() == []
    assert session.exec(select(Event)).all() == []
    longest = "n" * MAX_TOKEN_NAME
    token = create_token(session, longest, Role.OPERATOR)
    session.commit()
    principal = authenticate(session, token)
    assert principal is not None and principal.actor == f"operator:{longest}"
    [event] = session.exec(select(Event)).all()
    assert (event.kind, event.subject) == ("token.created", longest)


# -- lifetimes --------------------------------------------------------------------------------


def test_lifetimes_parse_days_hours_and_minutes_and_refuse_the_rest() -> None:
    assert parse_lifetime("90d") == timedelta(days=90)
    assert parse_lifetime("12h") == timedelta(hours=12)
    assert parse_lifetime(" 30m ") == timedelta(minutes=30)
    assert parse_lifetime("3650d") == MAX_LIFETIME
    for text in ("", "90", "d", "0d", "-1d", "1.5h", "1w", "90 days", "1d2h", "99999999d"):
        with pytest.raises(FleetError, match="--expires-in"):
            parse_lifetime(text)


def test_an_expired_token_answers_like_a_revoked_one(session: Session) -> None:
    token = create_token(session, "ci", Role.OPERATOR, expires_in=timedelta(hours=1))
    forever = create_token(session, "ops", Role.OPERATOR)
    session.commit()
    [row] = session.exec(select(ApiToken).where(ApiToken.name == "ci")).all()
    assert row.expires_at is not None
    expires_at = as_utc(row.expires_at)
    assert authenticate(session, token) is not None  # now: an hour to go
    assert authenticate(session, token, now=expires_at - timedelta(seconds=1)) is not None
    assert authenticate(session, token, now=expires_at) is None
    assert authenticate(session, token, now=expires_at + timedelta(days=400)) is None
    # A token without a lifetime never expires.
    assert authenticate(session, forever, now=expires_at + timedelta(days=4000)) is not None
    with pytest.raises(FleetError, match="lifetime"):
        create_token(session, "x", Role.VIEWER, expires_in=timedelta(0))


def test_a_token_whose_expiry_has_passed_gets_401_from_the_api(
    db: Engine, session: Session, tmp_path: Path
) -> None:
    token = create_token(session, "short", Role.VIEWER, expires_in=timedelta(minutes=30))
    session.commit()
    with serve(db, tmp_path, run_loops=False) as live:
        client = live.client(token)
        assert client.get("/api/v1/sites").status_code == 200
        [row] = session.exec(select(ApiToken)).all()
        row.expires_at = utcnow() - timedelta(seconds=1)  # as if the half hour had gone by
        session.add(row)
        session.commit()
        reply = client.get("/api/v1/sites")
    assert reply.status_code == 401, reply.text
    assert reply.headers["www-authenticate"].startswith("Bearer")


def test_the_expiry_is_recorded_and_listed(session: Session) -> None:
    create_token(session, "ci", Role.VIEWER, expires_in=timedelta(days=90))
    create_token(session, "ops", Role.VIEWER)
    session.commit()
    ci, ops = list_tokens(session)
    assert ops.expires_at is None and not ops.expired
    assert ci.expires_at is not None and not ci.expired
    expires_at = datetime.fromisoformat(ci.expires_at)
    assert timedelta(days=89) < expires_at - utcnow() <= timedelta(days=90)
    later, _ = list_tokens(session, now=expires_at + timedelta(seconds=1))
    assert later.expired
    event = session.exec(select(Event).where(Event.subject == "ci")).one()
    assert event.details["expires_at"] == ci.expires_at
    assert "expires" in event.message


def test_fleetctl_token_create_expires_in_and_list_shows_it(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    with database_env(db, monkeypatch):
        made = runner.invoke(
            cli.app, ["token", "create", "--role", "viewer", "--name", "ci", "--expires-in", "90d"]
        )
        assert made.exit_code == 0, made.stderr
        assert made.stdout.startswith("flt_")
        bad = runner.invoke(cli.app, ["token", "create", "--role", "viewer", "--expires-in", "1y"])
        listed = runner.invoke(cli.app, ["token", "list", "-o", "json"])
        table = runner.invoke(cli.app, ["token", "list"])
    assert bad.exit_code == 1 and "--expires-in '1y'" in bad.stderr and "90d" in bad.stderr
    [row] = json.loads(listed.stdout)
    assert row["expired"] is False
    assert timedelta(days=89) < datetime.fromisoformat(row["expires_at"]) - utcnow()
    assert "expires" in table.stdout and "expired" in table.stdout
