"""Only fleet/lifecycle.py may write a server's state (docs/design.md, "Server lifecycle").

Scans the source tree with `ast` for every way Python code could set `state`: attribute
assignment, `setattr(..., "state", ...)`, SQLAlchemy `.values(state=...)`, and raw SQL
`SET state =` in string literals.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED_DIRS = ("fleet", "agents", "bench")
SCANNED_FILES = ("cli.py",)
ALLOWED = frozenset({"fleet/lifecycle.py"})
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
    assert (ROOT / "fleet" / "lifecycle.py") in files, "scanner found no source to check"
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
        "server state is written outside fleet/lifecycle.py "
        "(use fleet.lifecycle.transition):\n" + "\n".join(offenders)
    )


def test_lifecycle_itself_is_seen_writing_state() -> None:
    # The allowed file does write state; if the scanner stopped seeing it, it would see nothing.
    assert state_writes((ROOT / "fleet" / "lifecycle.py").read_text())


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
    ],
)
def test_scanner_ignores_reads(source: str) -> None:
    assert state_writes(source) == []
