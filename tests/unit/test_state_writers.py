"""Only fleet/lifecycle/transitions.py may write a server's state (docs/design.md, "Server
lifecycle").

Statically: scans the source tree with `ast` for every way Python code could set `state`:
attribute assignment, `setattr(..., "state", ...)`, SQLAlchemy `.values(state=...)` and
`set_committed_value(..., "state", ...)`, and raw SQL `SET state =` in string literals.

At run time (both databases): the attribute guard on `Server.state` (fleet/models.py) refuses
every write but the initial state of a new server, while `fleet.lifecycle.transitions.transition`
(which
writes with set_committed_value, firing no attribute event) still updates the object it got.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from factories import (
    H100_DEFAULTS,
    TEST_BMC_PASSWORD,
    TEST_SECRET_KEY,
    add_rack,
    add_server,
    add_site,
)
from repo_paths import ROOT
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.crypto import SecretBox
from fleet.lifecycle.states import INITIAL, ServerState
from fleet.lifecycle.transitions import transition
from fleet.models import Rack, Server

# The agent is another process that never imports the fleet (checked below): its own
# `.state` fields (an engine replica's) are not a server's lifecycle state.
SCANNED_DIRS = ("fleet", "fleet_core", "bench")
SCANNED_FILES: tuple[str, ...] = ()
ALLOWED = frozenset({"fleet/lifecycle/transitions.py"})
FIELD = "state"
RAW_SQL = re.compile(r"SET\s+state\s*=", re.IGNORECASE)


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """Assignment targets of `node`, with tuple/list/starred unpacking flattened."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        pending = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        pending = [node.optional_vars]
    else:
        return
    while pending:
        target = pending.pop()
        if isinstance(target, ast.Tuple | ast.List):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            yield target


def _is_state_key(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == FIELD


def _called(func: ast.expr, name: str) -> bool:
    """`name(...)` or `anything.name(...)`."""
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def state_writes(source: str, filename: str = "<string>") -> list[str]:
    """`line: what` for every write of `state` in `source`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr == FIELD:
                found.append(f"{target.lineno}: assignment to .{FIELD}")
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Name)
                and func.id == "setattr"
                and len(node.args) >= 2
                and _is_state_key(node.args[1])
            ):
                found.append(f"{node.lineno}: setattr(..., {FIELD!r}, ...)")
            if _called(func, "set_committed_value"):
                # It skips the attribute guard of Server.state, so a key that is worked out at
                # run time counts too: nothing here can show it is never "state".
                key = node.args[1] if len(node.args) >= 2 else _keyword(node, "key")
                if _is_state_key(key):
                    found.append(f"{node.lineno}: set_committed_value(..., {FIELD!r}, ...)")
                elif key is not None and not isinstance(key, ast.Constant):
                    found.append(f"{node.lineno}: set_committed_value(..., <computed key>, ...)")
            if isinstance(func, ast.Attribute) and func.attr == "values":
                if any(kw.arg == FIELD for kw in node.keywords):
                    found.append(f"{node.lineno}: .values({FIELD}=...)")
                for arg in node.args:
                    if isinstance(arg, ast.Dict) and any(_is_state_key(k) for k in arg.keys):
                        found.append(f"{node.lineno}: .values({{{FIELD!r}: ...}})")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and RAW_SQL.search(node.value)
        ):
            found.append(f"{node.lineno}: raw SQL {RAW_SQL.pattern!r}")
    return found


def source_files() -> list[Path]:
    files: list[Path] = []
    for directory in SCANNED_DIRS:
        if (ROOT / directory).is_dir():
            files.extend(sorted((ROOT / directory).rglob("*.py")))
    files.extend(ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file())
    return files


def test_only_lifecycle_writes_state() -> None:
    files = source_files()
    writer = ROOT / "fleet" / "lifecycle" / "transitions.py"
    assert writer in files, "scanner found no source to check"
    offenders: list[str] = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        if relative in ALLOWED:
            continue
        offenders.extend(
            f"{relative}:{hit}" for hit in state_writes(path.read_text(), filename=relative)
        )
    for offender in offenders:
        print(offender)
    assert offenders == [], (
        "server state is written outside fleet/lifecycle/transitions.py "
        "(use fleet.lifecycle.transitions.transition):\n" + "\n".join(offenders)
    )


def test_lifecycle_itself_is_seen_writing_state() -> None:
    # The allowed file does write state; if the scanner stopped seeing it, it would see nothing.
    assert state_writes((ROOT / "fleet" / "lifecycle" / "transitions.py").read_text())


@pytest.mark.parametrize(
    "source",
    [
        'server.state = "x"',
        'self.server.state: str = "x"',
        "server.state += suffix",
        "a, (b.state, c) = values",
        "first, *rest.state = values",
        "for server.state in states: pass",
        "with open(p) as server.state: pass",
        'setattr(server, "state", "x")',
        'session.execute(update(Server).values(state="serving"))',
        'session.execute(sa.update(Server).values({"state": "serving"}))',
        'conn.execute(text("UPDATE server SET state = :s WHERE id = :id"))',
        "conn.execute(text(f\"update server set\\n   STATE='{s}' where id = {i}\"))",
        'set_committed_value(server, "state", ServerState.SERVING)',
        'attributes.set_committed_value(row, "state", to)',
        'sa.orm.attributes.set_committed_value(row, key="state", value=to)',
        'set_committed_value(instance=row, value=to, key="state")',
        "for key, value in changes.items(): set_committed_value(row, key, value)",
        "set_committed_value(row, FIELD, to)",
    ],
)
def test_scanner_flags_writes(source: str) -> None:
    assert state_writes(source), f"not flagged: {source}"


@pytest.mark.parametrize(
    "source",
    [
        "print(server.state)",
        'assert server.state == "warm"',
        "server.state_changed_at = now",
        "state = server.state",
        "power_state = 'on'",
        "stmt = select(Server).where(Server.state == 'warm')",
        "update(Server).values(power_state='on')",
        'getattr(server, "state")',
        "# server.state = 'x' in a comment",
        'conn.execute(text("SELECT state FROM server"))',
        'set_committed_value(row, "state_changed_at", now)',
        'attributes.set_committed_value(row, key="power_state", value="on")',
        "set_committed_value(row)",
    ],
)
def test_scanner_ignores_reads(source: str) -> None:
    assert state_writes(source) == []


# ---------------------------------------------------------------------------------------------
# The run-time guard (fleet/models.py), on both databases

GUARD = r"written only by fleet\.lifecycle"


def new_server(name: str = "gpu-1", **overrides: Any) -> Server:
    """A Server object not yet in any session (rack_id need not exist: nothing is flushed)."""
    fields: dict[str, Any] = {
        **H100_DEFAULTS,
        "bmc_password_encrypted": SecretBox(TEST_SECRET_KEY).encrypt(TEST_BMC_PASSWORD),
        "rack_id": 1,
        **overrides,
    }
    return Server(name=name, **fields)


@pytest.fixture
def rack(session: Session) -> Rack:
    return add_rack(session, add_site(session))


def load(engine: Engine, name: str) -> Server:
    with Session(engine) as fresh:
        return fresh.exec(select(Server).where(Server.name == name)).one()


@pytest.mark.parametrize(
    "value",
    [ServerState.SERVING, "serving", ServerState.RETIRED, INITIAL],
    ids=["serving", "serving-str", "retired", "initial"],
)
def test_persistent_server_refuses_a_state_write(
    db: Engine, session: Session, rack: Rack, value: str
) -> None:
    add_server(session, rack, "gpu-1", state=ServerState.WARM)
    with Session(db) as own:
        server = own.exec(select(Server).where(Server.name == "gpu-1")).one()
        with pytest.raises(AttributeError, match=GUARD):
            server.state = value  # type: ignore[assignment]
        with pytest.raises(AttributeError, match=GUARD):
            setattr(server, "state", value)  # noqa: B010
        assert server.state == ServerState.WARM
        assert not own.dirty
        own.commit()
    assert load(db, "gpu-1").state == ServerState.WARM


def test_detached_server_refuses_a_state_write(db: Engine, session: Session, rack: Rack) -> None:
    add_server(session, rack, "gpu-1")
    detached = load(db, "gpu-1")
    with pytest.raises(AttributeError, match=GUARD):
        detached.state = ServerState.WARM


def test_factory_server_refuses_a_state_write(session: Session, rack: Rack) -> None:
    server = add_server(session, rack, "gpu-1", state=ServerState.SERVING)
    with pytest.raises(AttributeError, match=GUARD):
        server.state = ServerState.DRAINING
    assert server.state == ServerState.SERVING


@pytest.mark.parametrize("value", [ServerState.SERVING, "warm", ServerState.RETIRED])
def test_new_server_may_not_be_built_in_another_state(value: str) -> None:
    with pytest.raises(AttributeError, match=GUARD):
        new_server(state=value)
    with pytest.raises(AttributeError, match=GUARD):
        Server.model_validate({**new_server().model_dump(exclude={"state"}), "state": value})


def test_new_server_starts_in_the_initial_state() -> None:
    assert new_server().state == INITIAL
    assert new_server(state=INITIAL).state == INITIAL
    assert new_server(state=INITIAL.value).state == INITIAL
    transient = new_server()
    transient.state = INITIAL  # a server not yet stored may (re)state the initial state
    assert transient.state == INITIAL


def test_enroll_stores_the_initial_state(db: Engine, session: Session, rack: Rack) -> None:
    server = add_server(session, rack, "gpu-1")
    assert server.state == INITIAL
    assert load(db, "gpu-1").state == INITIAL


@pytest.mark.parametrize("by_name", [False, True], ids=["by-object", "by-name"])
def test_transition_updates_the_object_without_tripping_the_guard(
    db: Engine, session: Session, rack: Rack, by_name: bool
) -> None:
    server = add_server(session, rack, "gpu-1", state=ServerState.DRAINED)
    before = server.state_changed_at
    event = transition(
        session,
        "gpu-1" if by_name else server,
        ServerState.POWERING_OFF,
        actor="tests",
        reason="guard",
    )
    assert event is not None
    # The session's own copy, with no refresh: set_committed_value wrote it, unflagged.
    assert server.state == ServerState.POWERING_OFF
    assert server.state_changed_at == event.at
    assert server.state_changed_at > before
    assert "state" not in sa.inspect(server).committed_state
    assert load(db, "gpu-1").state == ServerState.POWERING_OFF
    # The guard still holds for the object afterwards.
    with pytest.raises(AttributeError, match=GUARD):
        server.state = ServerState.WARM


def test_transition_updates_an_object_from_another_session(
    db: Engine, session: Session, rack: Rack
) -> None:
    add_server(session, rack, "gpu-1", state=ServerState.SERVING)
    elsewhere = load(db, "gpu-1")  # detached, from a session of its own
    with Session(db) as own:
        transition(own, elsewhere, ServerState.DRAINING, actor="tests", reason="guard")
    assert elsewhere.state == ServerState.DRAINING
    assert load(db, "gpu-1").state == ServerState.DRAINING


def test_the_agent_never_imports_the_fleet_service() -> None:
    """docs/design.md: agents talk only to the fleet API, NVML/DCGM and their engines."""
    offenders = []
    for path in sorted((ROOT / "fleet_agent").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            line = 0
            if isinstance(node, ast.Import):
                names, line = [alias.name for alias in node.names], node.lineno
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names, line = [node.module], node.lineno
            offenders += [
                f"{path.relative_to(ROOT)}:{line}: {name}"
                for name in names
                if name == "fleet" or name.startswith("fleet.")
            ]
    assert offenders == []
