"""API tokens: created once, stored hashed, scoped, revocable (fleet/auth.py)."""

from __future__ import annotations

import pytest
from factories import add_rack, add_server, add_site
from sqlmodel import Session, col, select

from fleet.auth import (
    MAX_TOKEN_NAME,
    authenticate,
    create_token,
    hash_token,
    list_tokens,
    revoke_token,
)
from fleet.errors import FleetError, NotFoundError
from fleet.models import ApiToken, Event, Role


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
