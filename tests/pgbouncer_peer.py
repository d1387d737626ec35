"""Debian's PgBouncer in transaction mode on 127.0.0.1, in front of the test Postgres (not a
test module).

`pgbouncer_peer(server_connections=3)` starts `pgbouncer` on a free port with every database
of 127.0.0.1:5432 behind it (trust auth, as the test server has), `pool_mode = transaction`
and at most `server_connections` server connections per database and user, so that a
client pool larger than that is multiplexed: each transaction may run on another server
connection, which is what breaks session state (advisory locks held across transactions,
server-side prepared statements, SET outside a transaction). `peer.url(database)` is a
SQLAlchemy URL through it; `peer.servers(database)` counts its server connections to that
database (its admin console's SHOW SERVERS).

PgBouncer will not run as root: as root it is started with `-u postgres` (the user Debian's
postgresql package creates), in a directory of its own that user can write. Leaving the
context stops it (SIGTERM, then SIGKILL) and removes the directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psycopg

from fleet.lab.sushy import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0

CONFIG = """\
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = {host}
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
admin_users = postgres
pool_mode = transaction
default_pool_size = {servers}
max_client_conn = 500
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
; psycopg sends none of these, but a libpq client may
ignore_startup_parameters = extra_float_digits
"""


def pgbouncer_binary() -> str | None:
    for candidate in (shutil.which("pgbouncer"), "/usr/sbin/pgbouncer"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class PgBouncerPeer:
    port: int
    log: Path

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@{HOST}:{self.port}/{database}"

    def servers(self, database: str) -> int:
        """PgBouncer's server connections to `database` now (active, idle or in use)."""
        with psycopg.connect(
            host=HOST, port=self.port, dbname="pgbouncer", user="postgres", autocommit=True
        ) as conn:
            cursor = conn.execute("SHOW SERVERS")
            columns = [c.name for c in cursor.description or ()]
            rows = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
        return sum(1 for row in rows if row["database"] == database)


@contextmanager
def pgbouncer_peer(server_connections: int = 3) -> Iterator[PgBouncerPeer]:
    binary = pgbouncer_binary()
    if binary is None:
        raise RuntimeError("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    workdir = Path(tempfile.mkdtemp(prefix="fleet-pgbouncer-"))
    port = free_port()
    (workdir / "userlist.txt").write_text('"postgres" ""\n')
    config = workdir / "pgbouncer.ini"
    config.write_text(CONFIG.format(host=HOST, port=port, dir=workdir, servers=server_connections))
    argv = [binary, str(config)]
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for path in (workdir, *workdir.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        argv = [binary, "-u", "postgres", str(config)]
    log = workdir / "pgbouncer.log"
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _wait_listening(port, proc, log)
        yield PgBouncerPeer(port=port, log=log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        if proc.stderr is not None:
            proc.stderr.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            text = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(f"pgbouncer exited ({proc.returncode}):\n{err}\n{text[-2000:]}")
        with suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on {HOST}:{port} in {START_TIMEOUT_S:g} s")
