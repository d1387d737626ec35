"""Chaos: the Postgres host goes silent. Its TCP port still accepts connections, and nothing
comes back: a black hole between the service and the database (a partition behind a load
balancer or a NAT that still completes handshakes, a host wedged under its kernel). Postgres
restarting is tests/chaos/test_postgres_restart.py's; a refusal is tests/e2e/test_db_refusing.py's.

The world: the test's throwaway Postgres database behind a TCP fault proxy
(tests/chaos/tcp_faults.py, on 127.0.0.1) and a service whose engine connects through it, with
the settings an operator gets (`engine_from_settings`: libpq's connect timeout, TCP user timeout
and keepalives, docs/api.md) and a short connect timeout (2 s, libpq's least).

1. Through the proxy, a read answers 200.
2. The pool emptied (every request needs a new connection) and the proxy a black hole: reads
   from three clients at once, each with a 30 s timeout. Every one is answered 503 with a
   `Retry-After` and a body naming the database, within SILENT_BOUND_S: the connect timeout
   plus the admission wait and scheduling, far under the client's timeout. Before
   `FLEET_DB_CONNECT_TIMEOUT_S`, each waited for its client to give up (libpq waits for the
   server's first byte without end), holding its slot and its worker thread meanwhile.
   `/healthz` answers 200 throughout (it needs no database).
3. The proxy passes again: a read answers 200 within RECOVERY_BOUND_S, from the same process.

Not covered here, and not by the service: a statement already sent on a live connection to a
host that still acknowledges TCP but never answers (a stopped postmaster) waits until that host
answers or the connection is cut; TCP_USER_TIMEOUT bounds it only where the bytes go
unacknowledged (a real partition), which a proxy on the loopback cannot show.

`pytest -s` prints the figures.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import sqlalchemy as sa
from factories import TEST_SECRET_KEY
from live import make_token, serve
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from tcp_faults import TcpFaultProxy

from fleet import db as fleet_db
from fleet.models import Role
from fleet.settings import Settings

API = "/api/v1"
CONNECT_TIMEOUT_S = 2
SILENT_BOUND_S = 10.0  # connect timeout 2 s + admission wait 2 s + a busy 2-core machine
RECOVERY_BOUND_S = 10.0
CLIENT_TIMEOUT_S = 30.0
CLIENTS, READS = 3, 3
# The defaults' TCP options (15 s TCP_USER_TIMEOUT, keepalives) beside the short connect timeout.
EXPECTED_LIBPQ = {
    "connect_timeout": str(CONNECT_TIMEOUT_S),
    "tcp_user_timeout": "15000",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
}


def test_a_silent_database_host_is_503_in_seconds_and_the_service_recovers(
    pg_url: str, db: Engine, tmp_path: Path
) -> None:
    token = make_token(db, Role.VIEWER, name="viewer")
    target = sa.make_url(pg_url)
    with TcpFaultProxy(target.port or 5432, name="postgres") as proxy:
        proxied = target.set(host="127.0.0.1", port=proxy.port)
        settings = Settings(
            data_dir=tmp_path,
            database_url=proxied.render_as_string(hide_password=False),
            secret_key=SecretStr(TEST_SECRET_KEY.decode()),
            db_connect_timeout_s=CONNECT_TIMEOUT_S,
        )
        engine = fleet_db.engine_from_settings(settings)
        try:
            with serve(engine, tmp_path, db_connect_timeout_s=CONNECT_TIMEOUT_S) as service:
                client = service.client(token)
                assert client.get(f"{API}/servers").status_code == 200
                with engine.connect() as conn:  # what libpq was given, as it reports it
                    given = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
                assert {k: given.get(k) for k in EXPECTED_LIBPQ} == EXPECTED_LIBPQ, given

                engine.dispose()
                proxy.black_hole()
                answers: list[tuple[float, httpx.Response | Exception]] = []
                guard = threading.Lock()

                def ask() -> None:
                    with httpx.Client(
                        base_url=service.url,
                        headers={"Authorization": f"Bearer {token}"},
                        timeout=CLIENT_TIMEOUT_S,
                    ) as own:
                        for _ in range(READS):
                            began = time.monotonic()
                            reply: httpx.Response | Exception
                            try:
                                reply = own.get(f"{API}/servers")
                            except httpx.HTTPError as error:
                                reply = error
                            with guard:
                                answers.append((time.monotonic() - began, reply))

                askers = [threading.Thread(target=ask) for _ in range(CLIENTS)]
                for asker in askers:
                    asker.start()
                healthz = [client.get("/healthz").status_code]
                while any(asker.is_alive() for asker in askers):
                    healthz.append(client.get("/healthz").status_code)
                    time.sleep(0.2)
                for asker in askers:
                    asker.join(timeout=CLIENTS * READS * CLIENT_TIMEOUT_S)

                assert len(answers) == CLIENTS * READS
                unanswered = [(s, r) for s, r in answers if isinstance(r, Exception)]
                assert not unanswered, f"no answer within the client's timeout: {unanswered}"
                replies = [(s, r) for s, r in answers if isinstance(r, httpx.Response)]
                statuses = Counter(r.status_code for _, r in replies)
                assert set(statuses) == {503}, statuses
                for _, reply in replies:
                    assert int(reply.headers["Retry-After"]) >= 1, reply.headers
                    assert "database" in reply.json()["detail"], reply.json()
                slowest = max(s for s, _ in replies)
                assert slowest < SILENT_BOUND_S, sorted(s for s, _ in replies)
                assert set(healthz) == {200}, Counter(healthz)

                proxy.pass_through()
                back = time.monotonic()
                while (status := client.get(f"{API}/servers").status_code) != 200:
                    assert time.monotonic() - back < RECOVERY_BOUND_S, status
                    time.sleep(0.2)
                recovered = time.monotonic() - back
                seconds = sorted(round(s, 2) for s, _ in replies)
                print(
                    f"\nsilent Postgres: {len(replies)} reads answered 503 in {seconds} s "
                    f"(connect timeout {CONNECT_TIMEOUT_S} s); /healthz {len(healthz)} × 200; "
                    f"200 again {recovered:.2f} s after the proxy passed"
                )
        finally:
            engine.dispose()
