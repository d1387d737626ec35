"""Diagnostic bundles (`fleetctl servers diagnose`): over SSH, what an NVIDIA support case asks
for (nvidia-smi -q, the kernel's Xid lines, the agent's journal, dcgmi diag -r 1, the engine's
logs, the OS and driver versions), as a gzipped tar with a summary.json, stored per server.

Bounded everywhere: each command by ssh_command_timeout_s, one server's whole collection by
diagnose_timeout_s, each command's output by diagnose_max_output_bytes, a bundle by
diagnose_max_bundle_bytes, and at most ssh_workers servers at once. A tool the server does not
have is recorded as missing, not an error; what was cut is flagged in the summary.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shlex
import tarfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import paramiko
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.db import session_scope
from fleet.errors import NotFoundError
from fleet.models import DiagnosticBundle, Event, Server, utcnow
from fleet.settings import Settings
from fleet.ssh.client import SshError, SshTarget, connect, load_key, run_on, target_for

# The exit status a collector's shell snippet gives when its tool is not on the server (the
# shell's own "command not found").
MISSING = 127
# Room kept in a bundle for summary.json and the tar headers.
_RESERVE_PER_MEMBER = 1024
_RESERVE = 16 * 1024
# Below this much time left, the remaining commands are skipped rather than started.
_MIN_COMMAND_S = 0.5
# Extra seconds the server's own `timeout` gives a command past ours: we close the channel
# first; it then cleans up what is left on the server.
_REMOTE_GRACE_S = 2


@dataclass(frozen=True, slots=True)
class Collector:
    """One command of a bundle: its file name in the bundle, the shell snippet run, and the
    tool whose absence makes it "missing" (the snippet exits 127 then)."""

    name: str
    script: str
    needs: str


def _needs(*tools: str) -> str:
    # `command -v` is POSIX: no `which` needed on the server.
    test = " || ".join(f"command -v {t} >/dev/null 2>&1" for t in tools)
    return f"{{ {test}; }} || exit {MISSING}; "


def _logs(max_bytes: int) -> str:
    """The end of every engine/agent log file, each under a header; 127 when there is none."""
    return (
        "found=0; for f in /var/lib/fleet-agent/*.log /var/log/fleet-agent/*; do "
        '[ -f "$f" ] || continue; found=1; echo "==> $f <=="; '
        f'tail -c {max_bytes} "$f"; echo; done; [ "$found" = 1 ] || exit {MISSING}'
    )


def collectors(settings: Settings) -> tuple[Collector, ...]:
    """What a bundle holds, in order (cheap first: a slow dcgmi cannot starve the rest)."""
    return (
        Collector("uname", "uname -a", "uname"),
        Collector("uptime", _needs("uptime") + "uptime", "uptime"),
        Collector(
            "driver-version",
            f"[ -r /proc/driver/nvidia/version ] || exit {MISSING}; "
            "cat /proc/driver/nvidia/version",
            "/proc/driver/nvidia/version",
        ),
        Collector(
            "xid",
            _needs("journalctl", "dmesg")
            + "if command -v journalctl >/dev/null 2>&1; then echo '== journalctl -k =='; "
            "journalctl -k --no-pager -o short-iso 2>&1 | grep -a 'NVRM: Xid'; fi; "
            "if command -v dmesg >/dev/null 2>&1; then echo '== dmesg =='; "
            "dmesg -T 2>&1 | grep -a 'NVRM: Xid'; fi; exit 0",
            "journalctl or dmesg",
        ),
        Collector(
            "agent-journal",
            _needs("journalctl") + "journalctl -u fleet-agent --no-pager -n 5000",
            "journalctl",
        ),
        Collector("engine-logs", _logs(settings.diagnose_max_output_bytes), "log files"),
        Collector("nvidia-smi", _needs("nvidia-smi") + "nvidia-smi -q", "nvidia-smi"),
        Collector("dcgmi-diag", _needs("dcgmi") + "dcgmi diag -r 1", "dcgmi"),
    )


def _remote(script: str, timeout_s: float) -> str:
    """The command line sent: C locale, and the server's own `timeout` (where present) so that
    a command we gave up on does not run on after we closed its channel."""
    inner = shlex.quote(script)
    limit = int(timeout_s) + 1 + _REMOTE_GRACE_S
    return (
        "export LC_ALL=C; if command -v timeout >/dev/null 2>&1; then "
        f"exec timeout -k 2 {limit} sh -c {inner}; else exec sh -c {inner}; fi"
    )


@dataclass(frozen=True, slots=True)
class Collected:
    """One server's bundle, ready to store."""

    server: str
    summary: list[dict[str, Any]]
    truncated: bool
    content: bytes
    sha256: str

    @property
    def missing(self) -> int:
        return sum(1 for entry in self.summary if entry["missing"])


def collect(
    target: SshTarget,
    settings: Settings,
    *,
    key: paramiko.PKey | None = None,
    commands: Sequence[Collector] | None = None,
) -> Collected:
    """Connect to one server and run every collector within settings.diagnose_timeout_s;
    SshError when the server cannot be reached, its host key is not the pinned one, or the
    login is refused."""
    start = time.monotonic()
    deadline = start + settings.diagnose_timeout_s
    commands = collectors(settings) if commands is None else commands
    reserve = min(
        settings.diagnose_max_bundle_bytes // 2, _RESERVE + 2 * _RESERVE_PER_MEMBER * len(commands)
    )
    room = settings.diagnose_max_bundle_bytes - reserve
    taken_at = utcnow()
    files: list[tuple[str, bytes]] = []
    summary: list[dict[str, Any]] = []
    transport = connect(target, settings, key)
    try:
        for collector in commands:
            entry: dict[str, Any] = {
                "name": collector.name,
                "command": collector.script,
                "exit_status": None,
                "missing": False,
                "truncated": False,
                "timed_out": False,
                "skipped": None,
                "bytes": 0,
                "seconds": 0.0,
            }
            summary.append(entry)
            left = deadline - time.monotonic()
            if left < _MIN_COMMAND_S:
                entry["skipped"] = (
                    f"out of time (diagnose_timeout_s {settings.diagnose_timeout_s:g} s)"
                )
                continue
            if room <= 0:
                entry["skipped"] = (
                    f"bundle full (diagnose_max_bundle_bytes {settings.diagnose_max_bundle_bytes})"
                )
                continue
            timeout_s = min(settings.ssh_command_timeout_s, left)
            cap = min(settings.diagnose_max_output_bytes, room)
            result = run_on(transport, target, _remote(collector.script, timeout_s), timeout_s, cap)
            kept = len(result.stdout) + len(result.stderr)
            room -= kept
            missing = result.exit_status == MISSING
            entry.update(
                exit_status=result.exit_status,
                missing=missing,
                truncated=result.truncated,
                timed_out=result.timed_out,
                bytes=kept,
                seconds=result.seconds,
            )
            if missing:
                entry["missing_tool"] = collector.needs
                continue
            files.append((f"{collector.name}.txt", result.stdout))
            if result.stderr:
                files.append((f"{collector.name}.stderr.txt", result.stderr))
    finally:
        transport.close()
    truncated = any(e["truncated"] or e["timed_out"] or e["skipped"] for e in summary)
    head = {
        "server": target.server,
        "address": f"{target.address}:{target.port}",
        "host_key": target.host_key,
        "user": settings.ssh_user,
        "collected_at": taken_at.isoformat(),
        "seconds": round(time.monotonic() - start, 3),
        "truncated": truncated,
        "commands": summary,
    }
    content = _tar_gz(f"{target.server}-diagnostics", [("summary.json", _json(head)), *files])
    return Collected(
        server=target.server,
        summary=summary,
        truncated=truncated,
        content=content,
        sha256=hashlib.sha256(content).hexdigest(),
    )


def _json(value: Any) -> bytes:
    return json.dumps(value, indent=2, sort_keys=False).encode() + b"\n"


def _tar_gz(folder: str, members: list[tuple[str, bytes]]) -> bytes:
    raw = io.BytesIO()
    now = time.time()
    # mtime 0 in the gzip header: the same files give the same bytes.
    with (
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, data in members:
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size, info.mtime, info.mode = len(data), int(now), 0o644
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


# ---------------------------------------------------------------------------------------------
# Many servers, stored


class DiagnoseResult(BaseModel):
    """One server's outcome of `POST /diagnostics`."""

    server: str
    ok: bool
    bundle_id: int | None = None
    size_bytes: int | None = None
    commands: int | None = None
    missing: int | None = None
    truncated: bool | None = None
    error: str | None = None


class DiagnosticBundlePublic(BaseModel):
    """A stored bundle without its content (download: `GET /diagnostics/{id}`)."""

    id: int
    server: str
    created_at: datetime
    created_by: str
    summary: list[dict[str, Any]]
    truncated: bool
    size_bytes: int
    sha256: str


def targets_of(session: Session, names: Sequence[str]) -> list[tuple[str, SshTarget | SshError]]:
    """Each named server with its SSH target (or why it has none), in order; NotFoundError
    naming the unknown ones before anything is contacted."""
    rows = {s.name: s for s in session.exec(select(Server).where(col(Server.name).in_(names)))}
    unknown = [n for n in names if n not in rows]
    if unknown:
        raise NotFoundError(f"no server named {', '.join(repr(n) for n in unknown)}")
    out: list[tuple[str, SshTarget | SshError]] = []
    for name in names:
        try:
            out.append((name, target_for(rows[name])))
        except SshError as exc:
            out.append((name, exc))
    return out


def diagnose(
    engine: Engine, names: Sequence[str], settings: Settings, actor: str
) -> list[DiagnoseResult]:
    """Collect a bundle from each named server (at most settings.ssh_workers at once), store
    each as it arrives (no transaction is held while servers answer), and say per server how
    it went. An Event per server records it."""
    names = list(dict.fromkeys(names))
    with session_scope(engine) as session:
        targets = targets_of(session, names)
    results: dict[str, DiagnoseResult] = {}
    try:
        key: paramiko.PKey | None = load_key(settings)
    except SshError as exc:
        key = None
        for name in names:
            results[name] = DiagnoseResult(server=name, ok=False, error=f"server {name}: {exc}")
    reachable = [t for _, t in targets if isinstance(t, SshTarget)]
    for name, target in targets:
        if isinstance(target, SshError):
            results.setdefault(name, DiagnoseResult(server=name, ok=False, error=str(target)))
    if key is not None and reachable:
        workers = min(settings.ssh_workers, len(reachable))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ssh-diagnose") as pool:
            futures = {pool.submit(collect, t, settings, key=key): t for t in reachable}
            for future in as_completed(futures):
                target = futures[future]
                try:
                    collected = future.result()
                except SshError as exc:
                    results[target.server] = DiagnoseResult(
                        server=target.server, ok=False, error=str(exc)
                    )
                    continue
                results[target.server] = _store(engine, collected, actor)
    _record_failures(engine, [r for r in results.values() if not r.ok], actor)
    return [results[name] for name in names]


def _store(engine: Engine, collected: Collected, actor: str) -> DiagnoseResult:
    size = len(collected.content)
    missing, count = collected.missing, len(collected.summary)
    with session_scope(engine) as session:
        server_id = session.exec(select(Server.id).where(Server.name == collected.server)).one()
        assert server_id is not None
        row = DiagnosticBundle(
            server_id=server_id,
            created_by=actor,
            summary=collected.summary,
            truncated=collected.truncated,
            size_bytes=size,
            sha256=collected.sha256,
            content=collected.content,
        )
        session.add(row)
        session.flush()
        assert row.id is not None
        bundle_id = row.id
        cut = ", truncated" if collected.truncated else ""
        session.add(
            Event(
                at=utcnow(),
                subject_type="server",
                subject=collected.server,
                actor=actor,
                kind="server.diagnosed",
                message=(
                    f"diagnostic bundle {bundle_id} collected over SSH ({size} bytes, {count} "
                    f"commands, {missing} missing{cut})"
                ),
                details={"bundle_id": bundle_id, "size_bytes": size, "missing": missing},
            )
        )
    return DiagnoseResult(
        server=collected.server,
        ok=True,
        bundle_id=bundle_id,
        size_bytes=size,
        commands=count,
        missing=missing,
        truncated=collected.truncated,
    )


def _record_failures(engine: Engine, failed: list[DiagnoseResult], actor: str) -> None:
    if not failed:
        return
    now = utcnow()
    with session_scope(engine) as session:
        known = set(
            session.exec(
                select(Server.name).where(col(Server.name).in_([r.server for r in failed]))
            )
        )
        for result in failed:
            if result.server in known:
                session.add(
                    Event(
                        at=now,
                        subject_type="server",
                        subject=result.server,
                        actor=actor,
                        kind="server.diagnose_failed",
                        message=(result.error or "failed")[:2000],
                        details={},
                    )
                )


def list_bundles(
    session: Session, server: str, limit: int, offset: int
) -> tuple[int, list[DiagnosticBundlePublic]]:
    """A server's bundles, newest first (without their content)."""
    server_id = session.exec(select(Server.id).where(Server.name == server)).one_or_none()
    if server_id is None:
        raise NotFoundError(f"no server named {server!r}")
    where = col(DiagnosticBundle.server_id) == server_id
    count = session.exec(select(sa.func.count()).select_from(DiagnosticBundle).where(where)).one()
    columns = [c for c in DiagnosticBundle.__table__.columns if c.name != "content"]  # type: ignore[attr-defined]
    rows = session.connection().execute(
        sa.select(*columns)
        .where(where)
        .order_by(col(DiagnosticBundle.id).desc())
        .limit(limit)
        .offset(offset)
    )
    return count, [
        DiagnosticBundlePublic(
            id=r.id,
            server=server,
            created_at=r.created_at,
            created_by=r.created_by,
            summary=r.summary,
            truncated=r.truncated,
            size_bytes=r.size_bytes,
            sha256=r.sha256,
        )
        for r in rows
    ]


def get_bundle(session: Session, bundle_id: int) -> tuple[str, DiagnosticBundle]:
    """A stored bundle (with its content) and its server's name."""
    row = session.exec(
        select(DiagnosticBundle, Server.name)
        .join(Server, col(Server.id) == DiagnosticBundle.server_id)
        .where(DiagnosticBundle.id == bundle_id)
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"no diagnostic bundle {bundle_id}")
    bundle, name = row
    return name, bundle
