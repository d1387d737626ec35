"""Chaos: Postgres restarted under load. The service recovers by itself, answers 503 during the
outage and never hangs; nothing is lost.

The world: a private Postgres 15 cluster of the test's own (tests/chaos/pg_cluster.py: initdb in
a temporary directory, a free port; never the shared server at 5432, which other tests use),
migrated with the real migrations, and one real `fleetctl serve` on it (control loops on,
short pool and admission waits). Client threads keep a steady load on it over real HTTP: two
readers (`GET /api/v1/servers`, `GET /api/v1/events?limit=10`), two writers creating tenants
with unique names (`POST /api/v1/tenants`: the tenant and its `tenant.created` event are one
transaction), and a prober on `/healthz` and `/readyz`.

Faults injected, one after the other:
1. `pg_ctl restart -m fast`: every session rolled back and disconnected, a clean shutdown, a
   new postmaster (the service's pooled connections are all dead after it);
2. `pg_ctl stop -m immediate` (every Postgres process ends at once, as in a crash or a power
   cut: the next start recovers from the WAL), ~3 s with nothing listening on the port, then
   `pg_ctl start`.

Checked:
- every answer the service gives is 200/201 or 503 with a `Retry-After` of at least 1 s and a
  body naming the database (docs/api.md, "Errors": "the database cannot be reached or refuses
  connections (a Postgres restart)"); never a 500, never a connection refused (the service
  process is not what restarts, and the documentation promises no connection-level refusal),
  never a request that runs into the client's timeout (10 s): no hang;
- no keep-alive connection closed without an answer: this test found the service doing so
  when Postgres terminated a session between a route's query and the session's close (the
  close's ROLLBACK failed after the response was sent, a 500 was logged and uvicorn dropped
  the connection under the client's next request); fixed in fleet/api/deps.py (the dead
  connection is invalidated), and the second test below makes it frequent;
- the outage is seen: the load gets 503s while Postgres is down;
- after each fault, once `pg_ctl` says Postgres accepts connections again, a read answers 200
  within RECOVERY_BOUND_S, from the same service process (never restarted), and `/readyz` is
  200 again; `/healthz` answers 200 throughout;
- nothing lost: a writer retries a 503 after its `Retry-After`, the same name, until it gets 201
  or 409. Every name acknowledged 201 exists afterwards; a 409 on a retry says the attempt
  answered 503 had committed after all (its commit reached Postgres, its acknowledgement did
  not: the client is told, not misled); no tenant exists that was never asked for, none is
  missing, and each has exactly one `tenant.created` event (no half-written transaction);
- the control loops (their leader lease is a row in the same database) tick again after the
  outage.

`pytest -s` prints the figures: each outage's length, the time from Postgres back to the first
200, the counts of answers by status, the slowest answer, the writes that needed a retry and
the ambiguous commits, any connection cut without an answer.

The second test is that bug alone, made frequent: readers on keep-alive connections while
`pg_terminate_backend` ends the service's sessions every few milliseconds (what `pg_ctl restart
-m fast` does to each of them once). Correct: every request answered, 200 or 503 +
`Retry-After`, and no 500 in the service's log.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import psycopg
import pytest
from api_load import API_CLIENTS, Answer, ApiLoad
from cryptography.fernet import Fernet
from pg_cluster import PgCluster, cluster_missing, private_cluster

from fleet import db
from fleet.lab.harness import ServeProcess
from fleet.lab.harness import wait_for as _wait_for

pytestmark = pytest.mark.postgres

if (missing := cluster_missing()) is not None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"a private Postgres cluster is required in CI: {missing}", pytrace=False)
    pytest.skip(missing, allow_module_level=True)

CLIENT_TIMEOUT_S = 10.0  # an answer slower than this is a hang
RECOVERY_BOUND_S = 20.0  # Postgres accepting again -> a 200 (a busy 2-core machine)
OUTAGE_S = 3.0  # the long outage: nothing listening on the port
SETTLE_S = 1.5  # normal load between and after the faults
RETRY_FOR_S = 40.0  # a writer retries one name this long at most
PACE_S = 0.05  # between one client's requests: a steady load, not a flood
# What the service logged when a session's close failed after its answer went out (fixed:
# fleet/api/deps.py); uvicorn then dropped the keep-alive connection.
MID_RESPONSE = "unhandled OperationalError mid-response"
TERMINATE_FOR_S = 8.0  # the second test: sessions terminated this long, at most
APPLICATION_NAME = "fleet-chaos"  # the service's sessions in pg_stat_activity

SERVICE_SETTINGS = {
    "FLEET_SECRET_KEY": Fernet.generate_key().decode(),
    "FLEET_RUN_LOOPS": "true",  # the loops' leader lease lives in the same database
    "FLEET_RECONCILE_INTERVAL_S": "1",
    "FLEET_LEADER_LEASE_S": "2",
    # Short waits (docs/api.md, "Capacity, probes and shutdown"): a request waits 1 s for an
    # admission slot and 2 s for a pooled connection at most; 503s say "retry after 1 s".
    "FLEET_API_ADMISSION_WAIT_S": "1",
    "FLEET_DB_POOL_TIMEOUT_S": "2",
    "FLEET_API_RETRY_AFTER_S": "1",
    "FLEET_DB_APPLICATION_NAME": APPLICATION_NAME,
    "FLEET_LOG_LEVEL": "INFO",
}

wait_for = partial(_wait_for, every=0.05)


@dataclass(frozen=True)
class Outage:
    name: str
    began: float  # the pg_ctl command that takes Postgres down was issued
    back: float  # pg_ctl said Postgres accepts connections again
    first_ok: Answer

    @property
    def recovery_s(self) -> float:
        return self.first_ok.ended - self.back


@pytest.fixture
def cluster() -> Iterator[PgCluster]:
    """The private cluster, up; stopped and removed after the test, passed or failed."""
    with private_cluster() as found:
        yield found


def good_ticks(service: ServeProcess, loop: str = "reconciler") -> int:
    """The ticks of `loop` that did not fail, while this process leads it (0 otherwise, and
    while /metrics does not answer)."""
    try:
        text = httpx.get(f"{service.url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0

    def value(series: str) -> float:
        found = re.search(rf'^{series}\{{loop="{loop}"\}} (\S+)$', text, re.M)
        return float(found[1]) if found else 0.0

    if value("fleet_loop_leader") != 1.0:
        return 0
    return int(value("fleet_loop_ticks_total") - value("fleet_loop_failed_ticks_total"))


def migrated(cluster: PgCluster) -> str:
    """A database `fleet` on the cluster, migrated to head; its URL."""
    url = cluster.create_database("fleet")
    engine = db.make_engine(url)
    try:
        db.upgrade(engine)  # what `fleetctl db upgrade` does
    finally:
        engine.dispose()
    return url


def test_postgres_restarted_under_load(cluster: PgCluster, tmp_path: Path) -> None:
    url = migrated(cluster)
    service = ServeProcess(
        "serve", tmp_path / "data", {"FLEET_DATABASE_URL": url, **SERVICE_SETTINGS}
    )
    with ExitStack() as stack:
        stack.callback(service.stop)
        service.start(admin_token=True)
        pid = service.proc.pid
        load = ApiLoad(
            service.url,
            service.admin_token(),
            client_timeout_s=CLIENT_TIMEOUT_S,
            retry_for_s=RETRY_FOR_S,
            pace_s=PACE_S,
        )
        stack.callback(load.stop, abandon=True)

        def why() -> str:
            return f"{service.tail()}\n{cluster.log_tail(15)}"

        load.start(readers=[["/servers"], ["/events?limit=10"]], writers=2)
        wait_for("the load to get going", lambda: load.acks() >= 10, 30, why=why)
        wait_for("the control loops to tick", lambda: good_ticks(service) >= 2, 30, why=why)
        time.sleep(SETTLE_S)

        def recovered(name: str, began: float, back: float) -> Outage:
            first_ok = wait_for(
                f"a 200 after {name}",
                lambda: load.first(["reader"], 200, since=back),
                RECOVERY_BOUND_S,
                why=why,
                give_up=service.exited,
            )
            return Outage(name, began, back, first_ok)

        # 1. A restart in fast mode: sessions rolled back and cut, a clean shutdown, a new server.
        began = time.monotonic()
        cluster.restart("fast")
        outages = [recovered("pg_ctl restart -m fast", began, time.monotonic())]
        time.sleep(SETTLE_S)

        # 2. A crash (immediate stop), OUTAGE_S with nothing on the port, a start (WAL recovery).
        began = time.monotonic()
        cluster.stop("immediate")
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        up_at = time.monotonic()  # from here on Postgres may accept connections again
        cluster.start()
        outages.append(recovered("pg_ctl stop -m immediate; start", began, time.monotonic()))
        ticks_back = good_ticks(service)
        wait_for(
            "the control loops to lead and tick well again after the outage",
            lambda: good_ticks(service) >= ticks_back + 2,
            RECOVERY_BOUND_S,
            why=why,
        )
        loops_back_s = time.monotonic() - outages[-1].back
        time.sleep(SETTLE_S)
        stuck = load.stop()
        assert not stuck, f"client threads still running: {stuck}"

        wait_for(
            "/readyz 200 after the outages",
            lambda: httpx.get(f"{service.url}/readyz", timeout=2).status_code == 200,
            RECOVERY_BOUND_S,
            why=why,
        )
        assert service.running and service.proc.pid == pid, "the service was restarted"

        api = load.answers(*API_CLIENTS)
        by_status = Counter(a.status for a in api)
        during = load.answers(*API_CLIENTS, since=down_at, until=up_at)
        statuses_during = Counter(a.status for a in during)
        slowest = max(api, key=lambda a: a.seconds)
        print(
            "\nPostgres restarted under load:"
            f"\n  answers: {len(api)} API requests, by status "
            f"{dict(sorted(by_status.items(), key=lambda kv: kv[0] or 0))}; "
            f"slowest {slowest.seconds:.2f} s ({slowest.status} {slowest.path})"
        )
        for outage in outages:
            seen = Counter(
                a.status for a in load.answers(*API_CLIENTS, since=outage.began, until=outage.back)
            )
            print(
                f"  {outage.name}: Postgres away {outage.back - outage.began:.2f} s "
                f"(the pg_ctl commands; answers meanwhile {dict(seen)}), "
                f"first 200 {outage.recovery_s:.2f} s after it was back"
            )
        print(
            f"  during the {OUTAGE_S:g} s with nothing listening: {len(during)} answers "
            f"{dict(statuses_during)}, slowest "
            f"{max((a.seconds for a in during), default=0.0):.2f} s"
        )
        print(
            f"  writes: {len(load.acknowledged)} tenants acknowledged "
            f"({dict(Counter(load.acknowledged.values()))}), {load.retried} refused first "
            f"and retried, {len(load.ambiguous)} answered 503 had committed (409 on the retry: "
            f"{load.ambiguous[:5]}), {len(load.unresolved)} unresolved"
        )
        health = Counter(a.status for a in load.answers("healthz"))
        readyz = Counter(a.status for a in load.answers("readyz"))
        print(
            f"  /healthz {dict(health)}; /readyz {dict(readyz)}; "
            f"control loops ticking again {loops_back_s:.2f} s after Postgres was back"
        )
        log = service.run_log()
        cuts = [a for a in load.answers() if a.cut]
        print(
            f"  connections cut without an answer: {len(cuts)} "
            f"{[f'{a.who} {a.path}: {a.detail}' for a in cuts[:3]]}; "
            f"{log.count(MID_RESPONSE)} {MID_RESPONSE!r} in the service's log"
        )

        # Never a hang, never a refused connection, never a 500: 2xx, or 503 + Retry-After.
        hangs = [a for a in load.answers() if a.timed_out]
        assert not hangs, f"requests not answered within {CLIENT_TIMEOUT_S:g} s: {hangs[:5]}"
        cut = [a for a in load.answers() if a.cut]
        assert not cut, f"requests without an HTTP answer: {cut[:5]}"
        assert MID_RESPONSE not in log, service.tail(40)
        odd = [
            a
            for a in api
            if a.status is not None
            and not (a.status in (200, 201, 503) or (a.status == 409 and a.who == "retry"))
        ]
        assert not odd, f"answers other than 200/201/503: {odd[:5]}\n{service.tail(60)}"
        for answer in api:
            if answer.status == 503:
                assert answer.retry_after is not None and int(answer.retry_after) >= 1, answer
                assert re.search(r"database|capacity|busy", answer.detail), answer
        assert set(health) == {200}, f"/healthz: {dict(health)}"
        assert statuses_during.get(503, 0) > 0, "the load never saw the outage"
        answered_during = {status for status in statuses_during if status is not None}
        assert answered_during == {503}, f"answers with Postgres down: {statuses_during}"

        # Nothing lost: what was acknowledged exists, what answered 503 is either absent or was
        # reported by its retry, nothing else exists, one event per tenant.
        stored = load.check_nothing_lost()
        print(f"  stored: {len(stored)} tenants, each with exactly one tenant.created event")


def test_sessions_terminated_under_reads_cost_no_request_its_answer(
    cluster: PgCluster, tmp_path: Path
) -> None:
    url = migrated(cluster)
    service = ServeProcess(
        "serve",
        tmp_path / "data",
        {"FLEET_DATABASE_URL": url, **SERVICE_SETTINGS, "FLEET_RUN_LOOPS": "false"},
    )
    with ExitStack() as stack:
        stack.callback(service.stop)
        service.start(admin_token=True)
        # Back to back on each connection (no pause): the next request is under way when the
        # service drops the connection.
        load = ApiLoad(
            service.url, service.admin_token(), client_timeout_s=CLIENT_TIMEOUT_S, pace_s=0.0
        )
        stack.callback(load.stop, abandon=True)
        load.start(readers=[["/events?limit=10"]] * 3, writers=0, prober=False)
        wait_for("reads answered", lambda: load.first(["reader"], 200, since=0.0), 30)

        # The service's sessions terminated again and again (what a fast restart does to each
        # of them once), until the first request goes unanswered or TERMINATE_FOR_S is over.
        terminated = 0
        deadline = time.monotonic() + TERMINATE_FOR_S
        with psycopg.connect(
            host="127.0.0.1", port=cluster.port, user="postgres", dbname="postgres", autocommit=True
        ) as admin:
            while time.monotonic() < deadline and not any(a.cut for a in load.answers()):
                row = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = %s",
                    (APPLICATION_NAME,),
                ).fetchone()
                terminated += row[0] if row else 0
                time.sleep(0.005)
        stuck = load.stop()
        assert not stuck, f"client threads still running: {stuck}"

        answers = load.answers()
        log = service.run_log()
        print(
            f"\nSessions terminated under reads: {terminated} terminated; answers "
            f"{dict(Counter(a.status for a in answers))}; "
            f"{log.count(MID_RESPONSE)} {MID_RESPONSE!r} in the service's log; first cut: "
            f"{next((a.detail for a in answers if a.cut), None)}"
        )
        assert terminated > 0
        assert not [a for a in answers if a.timed_out], "a read hung"
        assert not [a for a in answers if a.cut], "requests without an answer (cut)"
        assert {a.status for a in answers} <= {200, 503}
        assert MID_RESPONSE not in log, service.tail(40)
