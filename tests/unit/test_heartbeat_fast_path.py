"""Steady heartbeats on Postgres: answered from what the last full one kept, their measurements
written in batches (fleet/registry/heartbeat_ingest.py, fleet/api/fast_heartbeats.py), and
never an answer or a write the full path would not have given.

A real service (uvicorn in a thread) on the tests' Postgres, batches every 0.2 s; each test
reads the database itself, and the ingest's counters say which path answered.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from factories import add_rack, add_server, add_site, walk_to
from live import Live, revoke_token, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.lifecycle.states import ServerState
from fleet.models import Event, Gpu, Role, Server
from fleet.registry.heartbeat_ingest import HeartbeatIngest

API = "/api/v1/agent"
BATCH_S = 0.2
WAIT_S = 10.0


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("fast-heartbeats"), heartbeat_batch_s=BATCH_S) as s:
        yield s


@pytest.fixture
def ingest(live: Live, pg_url: str) -> HeartbeatIngest:
    """(Postgres only: on SQLite every heartbeat takes the full path.)"""
    ingest = live.app.state.heartbeats
    assert isinstance(ingest, HeartbeatIngest)
    return ingest


@pytest.fixture
def agent(
    live: Live, ingest: HeartbeatIngest, db: Engine, session: Session
) -> Iterator[httpx.Client]:
    rack = add_rack(session, add_site(session, "lab"), "r1")
    server = add_server(session, rack, "gpu-a", gpu_count=2)
    assert server.id is not None
    for index in range(2):
        session.add(Gpu(server_id=server.id, index=index, model="H100", memory_mib=81559))
    walk_to(session, server, ServerState.SERVING)
    token = live.token(Role.AGENT, name="agent-a", server="gpu-a")
    client = live.client(token)
    client.headers["x-token"] = token  # for the revocation test; the service ignores it
    yield client
    live.close_clients()


def heartbeat(temperature: float = 40.0, power: float = 300.0, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "server": "gpu-a",
        "verdict": "healthy",
        "action": "none",
        "reasons": [],
        "ready": True,
        "gpus": [
            {"index": i, "health": "healthy", "temperature_c": temperature, "power_w": power}
            for i in range(2)
        ],
        "replicas": [
            {
                "index": 0,
                "gpus": [0, 1],
                "port": 8001,
                "url": "http://127.0.0.1:8001",
                "state": "ready",
                "queued": int(temperature),
            }
        ],
    }
    return body | changes


def row(db: Engine) -> Server:
    with Session(db) as session:
        server = session.exec(select(Server).where(Server.name == "gpu-a")).one()
        session.expunge(server)
        return server


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.02)


def post(agent: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    answer = agent.post(f"{API}/heartbeat", json=body)
    assert answer.status_code == 200, answer.text
    reply: dict[str, Any] = answer.json()
    return reply


def test_a_steady_heartbeat_gets_the_full_paths_answer_and_its_measurements_are_written(
    agent: httpx.Client, ingest: HeartbeatIngest, db: Engine, live: Live
) -> None:
    full = post(agent, heartbeat())
    before = row(db)
    fast = ingest.stats.fast
    steady = post(agent, heartbeat(temperature=55.0, power=420.0))
    assert ingest.stats.fast == fast + 1
    assert steady == full
    # Written by the next batch: the time, the replicas' stats, the draw estimate.
    until(lambda: row(db).replicas[0]["queued"] == 55, "the steady report's replicas written")
    after = row(db)
    assert after.last_heartbeat_at is not None and before.last_heartbeat_at is not None
    assert after.last_heartbeat_at > before.last_heartbeat_at
    assert after.drawn_source == "estimate" and after.drawn_w is not None
    assert before.drawn_w is not None and after.drawn_w > before.drawn_w
    # And each GPU's reading, as the full path stores it.
    assert [g["temperature_c"] for g in after.gpu_telemetry] == [55.0, 55.0]
    assert [g["power_w"] for g in before.gpu_telemetry] == [300.0, 300.0]
    # The batch left the row at a version the next report matches: still the fast path.
    post(agent, heartbeat(temperature=56.0))
    assert ingest.stats.fast == fast + 2
    # And /metrics counts them.
    metrics = httpx.get(f"{live.url}/metrics", timeout=5).text
    assert f"fleet_heartbeats_fast_total {float(ingest.stats.fast)}" in metrics


def test_a_verdict_change_takes_the_full_path_at_once(
    agent: httpx.Client, ingest: HeartbeatIngest, db: Engine
) -> None:
    post(agent, heartbeat())
    post(agent, heartbeat())
    fast = ingest.stats.fast
    reason = {
        "code": "xid_79",
        "gpu": 1,
        "message": "GPU fell off the bus",
        "action": "reboot",
        "verdict": "unhealthy",
    }
    post(agent, heartbeat(verdict="unhealthy", action="reboot", reasons=[reason]))
    assert ingest.stats.fast == fast
    # Recorded before the answer, not by a batch.
    with Session(db) as session:
        events = session.exec(
            select(Event.kind).where(Event.subject == "gpu-a").order_by(col(Event.id))
        ).all()
    assert events[-1] == "server.health"
    assert row(db).health_verdict == "unhealthy"


def test_a_server_changed_elsewhere_gets_its_new_answer(
    agent: httpx.Client, ingest: HeartbeatIngest, db: Engine, session: Session
) -> None:
    post(agent, heartbeat())
    assert post(agent, heartbeat())["state"] == "serving"
    # An operator's drain (another transaction, another process would be the same).
    server = session.exec(select(Server).where(Server.name == "gpu-a")).one()
    walk_to(session, server, ServerState.DRAINING)
    fast = ingest.stats.fast
    reply = post(agent, heartbeat())
    assert ingest.stats.fast == fast
    assert reply["state"] == "draining" and reply["assignment"]["kind"] == "drain"


@contextmanager
def batches_by_hand(ingest: HeartbeatIngest) -> Iterator[Callable[[], None]]:
    """The ingest's batches held (a fast answer restarts them: they then wait an hour);
    yields a function that writes one, on the service's event loop."""
    task = ingest._flusher
    assert task is not None, "no fast answer yet: no batches"
    loop = task.get_loop()

    def hold() -> None:
        running = ingest._flusher
        if running is not None:
            loop.call_soon_threadsafe(running.cancel)
            until(running.done, "the batches stopped")
            ingest._flusher = None

    def write() -> None:
        asyncio.run_coroutine_threadsafe(ingest.flush(), loop).result(WAIT_S)

    flush_s, ingest.flush_s = ingest.flush_s, 3600.0
    hold()
    try:
        yield write
    finally:
        ingest.flush_s = flush_s
        hold()


def test_a_row_changed_before_its_batch_is_not_overwritten(
    agent: httpx.Client, ingest: HeartbeatIngest, db: Engine, session: Session
) -> None:
    post(agent, heartbeat())
    batches = ingest.stats.batches
    post(agent, heartbeat(temperature=41.0))  # a fast answer: the batches run
    # Written and its new row version kept (the queue empties before the UPDATE returns: a
    # report in between saw the old version and took the full path, a flake in CI)
    until(lambda: ingest.stats.batches > batches and not ingest._pending, "the first batch")
    with batches_by_hand(ingest) as write:
        fast, diverted = ingest.stats.fast, ingest.stats.diverted
        before = row(db).last_heartbeat_at
        post(agent, heartbeat(temperature=77.0))
        assert ingest.stats.fast == fast + 1
        # Someone else writes the row before the batch does.
        server = session.exec(select(Server).where(Server.name == "gpu-a")).one()
        server.replicas = [{"index": 0, "state": "stopped"}]
        session.add(server)
        session.commit()
        write()
    assert ingest.stats.diverted == diverted + 1
    after = row(db)
    assert after.replicas == [{"index": 0, "state": "stopped"}]  # theirs stands
    assert before is not None and after.last_heartbeat_at is not None
    assert after.last_heartbeat_at > before  # the heartbeat happened all the same
    # The next report takes the full path, which stores it all again.
    fast = ingest.stats.fast
    post(agent, heartbeat(temperature=78.0))
    assert ingest.stats.fast == fast
    assert row(db).replicas[0]["queued"] == 78


def test_a_revoked_token_is_refused_at_once(
    agent: httpx.Client, ingest: HeartbeatIngest, live: Live
) -> None:
    post(agent, heartbeat())
    post(agent, heartbeat())
    revoke_token(live.engine, agent.headers["x-token"])
    answer = agent.post(f"{API}/heartbeat", json=heartbeat())
    assert answer.status_code == 401


def test_a_report_for_another_server_is_refused_as_before(
    agent: httpx.Client, ingest: HeartbeatIngest
) -> None:
    post(agent, heartbeat())
    post(agent, heartbeat())
    answer = agent.post(f"{API}/heartbeat", json=heartbeat(server="gpu-b"))
    assert answer.status_code in (403, 404)
    bad = agent.post(f"{API}/heartbeat", json=heartbeat(verdict="splendid"))
    assert bad.status_code == 422
    # A steady body under another content type is not read as JSON by the route: 422, and
    # the fast path must not answer it either.
    fast = ingest.stats.fast
    raw = agent.post(
        f"{API}/heartbeat",
        content=json.dumps(heartbeat()),
        headers={"Content-Type": "text/plain"},
    )
    assert raw.status_code == 422 and ingest.stats.fast == fast
