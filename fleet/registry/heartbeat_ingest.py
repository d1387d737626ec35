"""Steady heartbeats answered on the event loop, their measurements written in batches.

Why: a heartbeat through the full path (fleet/registry/agent_reports.py) costs ~7 ms of one
core (the ORM, four hops onto worker threads, four statements): one process ingests ~140 a
second, a tenth of what 12,500 servers at a 10 s interval send (docs/development.md,
bench/heartbeats.py). Nearly all of them are steady: equal, in everything the fleet acts on,
to the server's previous report (fleet/registry/heartbeat_steady.py).

How, on Postgres (SQLite keeps the full path for every report):

1. A report is handled in full (Events, wake-ups, GPU rows, the assignment). Inside that
   transaction `capture` reads the server row's and its deployment's `xmin` (Postgres's
   row version: any committed change to a row gives it a new one) and keeps, per server, the
   report's steady key, the answer given, the token, and those two versions.
2. The server's next report with the same steady key, the same token and the same peer is
   checked with one statement on this module's own asynchronous connection (no worker
   thread): the token still valid (not revoked, not expired) and both rows still at the kept
   versions. Then it is answered with the kept answer at once, and its measurements (time,
   replicas, the GPUs' readings, the draw estimate, the cache's free bytes) wait for the next
   batch.
3. Every `flush_s` one UPDATE writes the batch, each row only if still at its kept version;
   it returns the rows' new versions, so the next report stays on the fast path. A row
   changed meanwhile (a state change, another replica's write) is not overwritten: its kept
   answer is dropped, only `last_heartbeat_at` is written, and its next report takes the full
   path.

Anything else takes the full path: a report that differs in what the fleet acts on (a verdict
change is handled at once, never batched), a changed server or deployment, a server booting
(its answer changes within the second) or staging a version (its answer depends on other
deployments), a kept answer older than `max_age_s` (five minutes: what no row version covers,
a GPU model's idle figure for the draw estimate; model versions never change once made), no
free connection here, any database error (the full
path then answers 503 as it would). The full path is the reference; this one is only
allowed to give what it would have given.

What a crash loses: the last batch's measurements (at most `flush_s`); the next heartbeat
writes them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from datetime import datetime

import psycopg
import sqlalchemy as sa
from sqlmodel import Session

from fleet.lifecycle.states import ServerState
from fleet.models import Role, Server, as_utc, utcnow
from fleet.power.measure import BMC, ESTIMATE, estimate_w, gpu_idle_w
from fleet.power.readings import check_watts
from fleet.registry.agent_reports import Capture, gpu_readings
from fleet.registry.heartbeat_steady import steady_key
from fleet_core.wire import Heartbeat
from fleet_core.wire import Reply as WireReply

log = logging.getLogger("fleet.heartbeats")

# What `capture` reads inside the full path's transaction: the versions, and the fields the
# answer was computed from, to check that no change committed between the two.
_VERSIONS = sa.text(
    "SELECT s.xmin::text, d.xmin::text, s.state, s.deployment_id, s.model_version_id, "
    "s.stage_version_id, s.gpu_power_limit_w, s.gpu_count "
    "FROM server s LEFT JOIN deployment d ON d.id = s.deployment_id WHERE s.id = :id"
)
_CHECK = (
    "SELECT t.id, t.role, t.server_id, t.expires_at, s.xmin::text, d.xmin::text "
    "FROM api_token t JOIN server s ON s.id = t.server_id "
    "LEFT JOIN deployment d ON d.id = s.deployment_id "
    "WHERE t.token_hash = %s AND t.revoked_at IS NULL"
)
# The full path's draw rule (fleet/power/measure.record_estimate) in SQL: a BMC reading
# younger than `fresh` seconds stands; otherwise the agent's estimate, when it gave one.
_ESTIMATED = (
    "(v.watts IS NOT NULL AND NOT (s.drawn_source = %(bmc)s AND s.drawn_at IS NOT NULL "
    "AND v.at - s.drawn_at < v.fresh * interval '1 second'))"
)
_FLUSH = f"""
UPDATE server AS s SET
    last_heartbeat_at = v.at,
    replicas = v.replicas,
    drawn_w = CASE WHEN {_ESTIMATED} THEN v.watts ELSE s.drawn_w END,
    drawn_source = CASE WHEN {_ESTIMATED} THEN %(estimate)s ELSE s.drawn_source END,
    drawn_at = CASE WHEN {_ESTIMATED} THEN v.at ELSE s.drawn_at END,
    cache_free_bytes = CASE WHEN v.cached THEN v.free ELSE s.cache_free_bytes END,
    cache_reported_at = CASE WHEN v.cached THEN v.at ELSE s.cache_reported_at END,
    gpu_telemetry = v.gpus
FROM json_to_recordset(%(batch)s::json) AS v(
    id int, version text, at timestamptz, replicas json, watts float8, fresh float8,
    cached bool, free int8, gpus json)
WHERE s.id = v.id AND s.xmin = v.version::xid
RETURNING s.id, s.xmin::text
"""
# A row changed since its answer was kept: the heartbeat still happened.
_TOUCH = (
    "UPDATE server AS s SET last_heartbeat_at = GREATEST(s.last_heartbeat_at, v.at) "
    "FROM unnest(%s::int[], %s::timestamptz[]) AS v(id, at) WHERE s.id = v.id"
)
# One warning per this many seconds while the database refuses batches.
_WARN_EVERY_S = 10.0


@dataclass
class Steady:
    """A server's last fully handled report, as the fast path needs it."""

    server_id: int
    server: str
    key: Hashable
    token_id: int
    server_version: str
    deployment_version: str | None
    answer: bytes  # the Reply as JSON
    dropped_urls: frozenset[int]  # replicas (by position) whose URL the full path refused
    kept_at: float  # time.monotonic()
    # The draw estimate's inputs (fleet/power/measure.py); gpu_idle_w None: no estimate.
    gpu_count: int
    gpu_idle_w: float | None
    server_idle_w: float
    max_w: float
    fresh_s: float


@dataclass(frozen=True)
class Measurements:
    """What a steady report adds: written by the next batch."""

    steady: Steady
    at: datetime
    replicas: list[dict[str, object]]
    gpus: list[dict[str, object]]  # each GPU's reading (agent_reports.gpu_readings)
    watts: float | None
    cached: bool
    free_bytes: int | None


@dataclass
class IngestStats:
    fast: int = 0  # answered here
    written: int = 0  # measurements written by batches
    diverted: int = 0  # rows changed before their batch: only the time written
    batches: int = 0
    failed_batches: int = 0


class HeartbeatIngest:
    """See the module docstring. One per service process, used on one event loop; batches
    are written from its first fast answer on, until `stop` (the app's lifespan) writes the
    last one."""

    def __init__(
        self,
        conninfo: str,
        *,
        connections: int = 2,
        flush_s: float = 0.25,
        max_age_s: float = 300.0,
        timeout_s: float = 2.0,
        prepared: bool = True,
        application_name: str = "fleet",
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.conninfo = conninfo
        self.connections = connections
        self.flush_s = flush_s
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self.prepared = prepared
        self.application_name = application_name
        self.clock = clock
        self.stats = IngestStats()
        self._steady: dict[str, Steady] = {}  # by server name
        self._pending: dict[int, Measurements] = {}  # by server id: the latest wins
        self._idle: list[psycopg.AsyncConnection[tuple[object, ...]]] = []
        self._open = 0
        self._freed: asyncio.Condition | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._warned_at = -_WARN_EVERY_S

    # -- the full path's side (a worker thread) ------------------------------------------------

    def capture(
        self, report: Heartbeat, peer: str | None, token_id: int, fresh_s: float
    ) -> Capture:
        """For the full path (agent_reports.heartbeat): reads the row versions inside its
        transaction and returns what to call once it committed (None: nothing to keep)."""
        key = steady_key(report, peer)

        def capture(
            session: Session, server: Server, reply: WireReply
        ) -> Callable[[], None] | None:
            if server.id is None or server.state is ServerState.BOOTING:
                return None
            if server.stage_version_id is not None:
                return None
            row = session.execute(_VERSIONS, {"id": server.id}).one_or_none()
            if row is None:
                return None
            # Committed by someone else between this transaction's reads and its write: the
            # answer may be stale, so it is not kept (this report's answer is what it is).
            if tuple(row[2:]) != (
                server.state.value,
                server.deployment_id,
                server.model_version_id,
                server.stage_version_id,
                server.gpu_power_limit_w,
                server.gpu_count,
            ):
                return None
            steady = Steady(
                server_id=server.id,
                server=server.name,
                key=key,
                token_id=token_id,
                server_version=row[0],
                deployment_version=row[1],
                answer=reply.model_dump_json().encode(),
                dropped_urls=frozenset(
                    i
                    for i, (sent, kept) in enumerate(
                        zip(report.replicas, server.replicas, strict=False)
                    )
                    if sent.url is not None and kept.get("url") is None
                ),
                kept_at=time.monotonic(),
                gpu_count=server.gpu_count,
                gpu_idle_w=gpu_idle_w(session, server.gpu_model),
                server_idle_w=server.idle_w,
                max_w=server.max_w,
                fresh_s=fresh_s,
            )
            return lambda: self._keep(steady)

        return capture

    def _keep(self, steady: Steady) -> None:
        # Called from a worker thread: a dict assignment and a pop are atomic under the GIL.
        # Measurements batched before this report are older than what it wrote.
        self._steady[steady.server] = steady
        self._pending.pop(steady.server_id, None)

    def forget(self, server: str) -> None:
        self._steady.pop(server, None)

    # -- the fast path (the event loop) --------------------------------------------------------

    async def answer(self, token: str, report: Heartbeat, peer: str | None) -> bytes | None:
        """The kept answer for a steady report, its measurements queued; None: the full path
        must handle it."""
        steady = self._steady.get(report.server)
        if steady is None or time.monotonic() - steady.kept_at > self.max_age_s:
            return None
        if steady_key(report, peer) != steady.key:
            return None
        digest = hashlib.sha256(token.encode()).hexdigest()
        row = await self._fetch_one(_CHECK, (digest,))
        if row is None:
            return None
        token_id, role, server_id, expires_at, server_version, deployment_version = row
        now = self.clock()
        if (
            (token_id, role, server_id) != (steady.token_id, Role.AGENT.value, steady.server_id)
            or (isinstance(expires_at, datetime) and as_utc(expires_at) <= now)
            or (server_version, deployment_version)
            != (steady.server_version, steady.deployment_version)
        ):
            return None
        self._pending[steady.server_id] = _measurements(steady, report, now)
        self.stats.fast += 1
        if self._flusher is None:  # on the event loop that answers, from the first answer on
            self._flusher = asyncio.get_running_loop().create_task(self._flush_every())
        return steady.answer

    async def _fetch_one(self, query: str, params: tuple[object, ...]) -> tuple[object, ...] | None:
        conn = await self._acquire()
        if conn is None:
            return None
        healthy = False
        try:
            async with asyncio.timeout(self.timeout_s):
                cursor = await conn.execute(query, params)
                row = await cursor.fetchone()
            healthy = True
            return row
        except (psycopg.Error, TimeoutError, OSError):
            return None  # the full path answers (503 when the database is down)
        finally:
            await self._release(conn, healthy)

    async def _acquire(self) -> psycopg.AsyncConnection[tuple[object, ...]] | None:
        """An idle connection, a new one while fewer than `connections` are open, or None
        when all are busy past the timeout (the full path takes the report)."""
        if self._freed is None:
            self._freed = asyncio.Condition()
        if not self._idle and self._open >= self.connections:
            # All busy: wait for one back, or for a broken one's slot to open a new one in.
            async with self._freed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.timeout_s):
                        await self._freed.wait_for(
                            lambda: bool(self._idle) or self._open < self.connections
                        )
        if self._idle:
            return self._idle.pop()
        if self._open < self.connections:
            self._open += 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await psycopg.AsyncConnection.connect(
                        self.conninfo,
                        autocommit=True,
                        application_name=self.application_name,
                        prepare_threshold=5 if self.prepared else None,
                        connect_timeout=max(1, int(self.timeout_s)),
                    )
            except (psycopg.Error, TimeoutError, OSError):
                self._open -= 1
                return None
        return None

    async def _release(
        self, conn: psycopg.AsyncConnection[tuple[object, ...]], healthy: bool
    ) -> None:
        if healthy and not conn.closed:
            self._idle.append(conn)
        else:
            self._open -= 1
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()
        assert self._freed is not None
        async with self._freed:
            self._freed.notify()

    # -- batches ---------------------------------------------------------------------------

    async def stop(self) -> None:
        """The last batch (bounded by the timeout), then the connections closed."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timeout_s):  # within the shutdown's bound
                await self.flush()
        for conn in self._idle:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()
        self._idle.clear()
        self._open = 0

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Write the measurements queued so far: one UPDATE, rows still at their kept version
        only; the rest get their time alone and lose their kept answer. A batch the database
        refuses stays queued (the next one's newer measurements replace its own)."""
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        conn = await self._acquire()
        if conn is None:
            self._requeue(batch)
            return
        healthy = False
        try:
            async with asyncio.timeout(self.timeout_s), conn.transaction():
                cursor = await conn.execute(_FLUSH, _flush_params(batch.values()))
                written = {int(str(i)): str(v) for i, v in await cursor.fetchall()}
                missed = [m for i, m in batch.items() if i not in written]
                if missed:
                    await conn.execute(
                        _TOUCH, ([m.steady.server_id for m in missed], [m.at for m in missed])
                    )
            healthy = True
        except (psycopg.Error, TimeoutError, OSError) as exc:
            self.stats.failed_batches += 1
            self._requeue(batch)
            if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = time.monotonic()
                log.warning(
                    "heartbeat batch not written, kept for the next (%s)", type(exc).__name__
                )
            return
        finally:
            await self._release(conn, healthy)
        self.stats.batches += 1
        self.stats.written += len(written)
        self.stats.diverted += len(missed)
        for server_id, version in written.items():
            steady = batch[server_id].steady
            if self._steady.get(steady.server) is steady:
                steady.server_version = version
        for m in missed:
            if self._steady.get(m.steady.server) is m.steady:
                del self._steady[m.steady.server]

    def _requeue(self, batch: dict[int, Measurements]) -> None:
        for server_id, m in batch.items():
            self._pending.setdefault(server_id, m)


def _measurements(steady: Steady, report: Heartbeat, now: datetime) -> Measurements:
    """A steady report's measurements as the full path would store them: the replicas (their
    URLs already judged: a refused one is dropped, as the kept answer says), the GPUs'
    readings, the draw estimate
    (record_estimate's rule; the BMC's freshness is the batch's to check), the cache's free
    bytes."""
    replicas = [r.model_dump(mode="json") for r in report.replicas]
    for index in steady.dropped_urls:
        replicas[index]["url"] = None
    watts = None
    if steady.gpu_idle_w is not None:
        watts = estimate_w(
            [None if g.lost else g.power_w for g in report.gpus],
            gpu_count=steady.gpu_count,
            gpu_idle_w=steady.gpu_idle_w,
            server_idle_w=steady.server_idle_w,
        )
        if watts is not None and check_watts(watts, max_w=steady.max_w) is not None:
            watts = None
    cache = report.cache
    return Measurements(
        steady=steady,
        at=now,
        replicas=replicas,
        gpus=gpu_readings(report.gpus),
        watts=watts,
        cached=cache is not None,
        free_bytes=cache.free_bytes if cache is not None else None,
    )


def _flush_params(batch: Iterable[Measurements]) -> dict[str, object]:
    """The batch as one JSON document (one parameter, serialised in C; a text array per
    column cost psycopg a Python pass over every element)."""
    rows = [
        {
            "id": m.steady.server_id,
            "version": m.steady.server_version,
            "at": m.at.isoformat(),
            "replicas": m.replicas,
            "gpus": m.gpus,
            "watts": m.watts,
            "fresh": m.steady.fresh_s,
            "cached": m.cached,
            "free": m.free_bytes,
        }
        for m in batch
    ]
    return {"bmc": BMC, "estimate": ESTIMATE, "batch": json.dumps(rows)}


def conninfo_of(engine: sa.Engine) -> str:
    """The engine's database as a libpq URL (psycopg's own connections)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
