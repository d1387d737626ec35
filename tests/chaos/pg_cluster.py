"""A private Postgres cluster for a chaos test (not a test module): its own data directory and
port, so that the test may stop, kill and restart it while the shared server at 127.0.0.1:5432
(every other test's) stays up.

`private_cluster()` runs Debian's `initdb` into a temporary directory (trust auth for
`postgres`, a free port on 127.0.0.1, its Unix socket in that directory), starts it with
`pg_ctl start -w` and yields a `PgCluster`; `cluster.stop(mode)`, `start()` and
`restart(mode)` are `pg_ctl`'s, each waited for (`-w`) within a bound. Leaving the context
stops it (`-m immediate`; the postmaster's PID from its `postmaster.pid` SIGKILLed if that
fails) and removes the directory, whether the test passed or not.

Postgres refuses to run as root: as root every command runs as `postgres` (`runuser -u
postgres --`, the user Debian's postgresql package creates) on a directory that user owns, as
tests/pgbouncer_peer.py runs PgBouncer. `postgres_bin_dir()` finds the binaries (Debian keeps
them in /usr/lib/postgresql/<version>/bin, off the PATH); `cluster_missing()` says what is
missing to make a cluster here (None: nothing).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psycopg

from fleet.lab.sushy import free_port

HOST = "127.0.0.1"
USER = "postgres"
INITDB_TIMEOUT_S = 60.0  # initdb on a busy 2-core machine: ~3 s idle
PG_CTL_TIMEOUT_S = 30  # pg_ctl's own -t: start (crash recovery included) or stop, waited for
COMMAND_SLACK_S = 15.0  # pg_ctl itself past its -t, before the test gives up on it

# Appended to the cluster's postgresql.conf: loopback TCP only, the socket in the cluster's own
# directory (not /var/run/postgresql, the shared server's), durable commits as in production
# (fsync and synchronous_commit stay on: a crash must not lose an acknowledged write).
CONFIG = """
listen_addresses = '{host}'
port = {port}
unix_socket_directories = '{socket_dir}'
max_connections = 60
shared_buffers = 32MB
fsync = on
synchronous_commit = on
log_line_prefix = '%m [%p] '
"""


def postgres_bin_dir() -> Path | None:
    """The newest installed Postgres's binaries (initdb, pg_ctl, postgres), or None."""

    def version(path: Path) -> tuple[int, ...]:
        with suppress(ValueError):
            return tuple(int(part) for part in path.parent.name.split("."))
        return (0,)

    found = [
        candidate
        for candidate in Path("/usr/lib/postgresql").glob("*/bin")
        if all(os.access(candidate / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres"))
    ]
    if found:
        return max(found, key=version)
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("pg_ctl") is not None:
        return Path(initdb).parent
    return None


def cluster_missing() -> str | None:
    """Why no private cluster can be made here (what to install), or None."""
    if postgres_bin_dir() is None:
        return "Postgres's initdb/pg_ctl not installed (Debian: postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return f"running as root, and there is no {USER!r} user to run Postgres as"
        if shutil.which("runuser") is None:
            return "runuser not installed (Debian: util-linux)"
    return None


def _as_postgres() -> list[str]:
    """The prefix that runs a command as the cluster's owner: `postgres` when we are root."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(USER)
    except KeyError:
        raise RuntimeError(
            f"running as root, and there is no {USER!r} user to run Postgres as"
        ) from None
    return ["runuser", "-u", USER, "--"]


@dataclass
class PgCluster:
    bin_dir: Path
    root: Path  # the temporary directory: data/, the socket, the server log
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@{HOST}:{self.port}/{database}"

    def pg_ctl(self, *args: str) -> None:
        """`pg_ctl ARGS` on this cluster as its owner, bounded; RuntimeError (with the end of
        the server's log) if it fails."""
        self._run(
            [
                str(self.bin_dir / "pg_ctl"),
                "-D",
                str(self.data),
                "-t",
                str(PG_CTL_TIMEOUT_S),
                *args,
            ],
            PG_CTL_TIMEOUT_S + COMMAND_SLACK_S,
        )

    def start(self) -> None:
        """Start and wait until it accepts connections (crash recovery first, if it crashed)."""
        self.pg_ctl("-l", str(self.log), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """`pg_ctl stop -m MODE`: `fast` rolls back every session and shuts down cleanly;
        `immediate` ends every process at once, as a crash or a power cut would (the next start
        recovers from the WAL)."""
        self.pg_ctl("-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """`pg_ctl restart -m MODE`, waited for until it accepts connections again."""
        self.pg_ctl("-m", mode, "-l", str(self.log), "-w", "restart")

    def accepting(self) -> bool:
        """A new connection is accepted and answers a query now."""
        try:
            with psycopg.connect(
                host=HOST, port=self.port, user=USER, dbname="postgres", connect_timeout=2
            ) as conn:
                return conn.execute("SELECT 1").fetchone() == (1,)
        except psycopg.Error:
            return False

    def create_database(self, name: str) -> str:
        """CREATE DATABASE `name`; its SQLAlchemy URL."""
        with psycopg.connect(
            host=HOST, port=self.port, user=USER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no server log)"
        return "postgres log:\n" + "\n".join(f"  pg| {line}" for line in text)

    def postmaster_pid(self) -> int | None:
        with suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        return None

    def _run(self, argv: Sequence[str], timeout: float) -> None:
        try:
            done = subprocess.run(
                [*_as_postgres(), *argv],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{argv[0]} ran past {timeout:g} s\n{self.log_tail()}") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}\n"
                f"{self.log_tail()}"
            )


@contextmanager
def private_cluster() -> Iterator[PgCluster]:
    """A fresh cluster, started; stopped and removed on the way out (see the module
    docstring)."""
    bin_dir = postgres_bin_dir()
    missing = cluster_missing()
    if bin_dir is None or missing is not None:
        raise RuntimeError(missing or "no Postgres binaries")
    root = Path(tempfile.mkdtemp(prefix="fleet-chaos-pg-"))
    cluster = PgCluster(bin_dir=bin_dir, root=root, port=free_port())
    try:
        if os.geteuid() == 0:
            owner = pwd.getpwnam(USER)
            os.chown(root, owner.pw_uid, owner.pw_gid)
        cluster._run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(cluster.data),
                "-U",
                USER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",  # the files of a throwaway cluster; the server itself fsyncs
            ],
            INITDB_TIMEOUT_S,
        )
        with (cluster.data / "postgresql.conf").open("a") as conf:
            conf.write(CONFIG.format(host=HOST, port=cluster.port, socket_dir=root))
        cluster.start()
        yield cluster
    finally:
        _destroy(cluster)


def _is_our_postmaster(pid: int, cluster: PgCluster) -> bool:
    """`pid` is this cluster's postmaster (a stale postmaster.pid may name another process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(cluster.data).encode() in argv


def _destroy(cluster: PgCluster) -> None:
    """Stop it however it is (running, stopped, half started) and remove its directory."""
    if cluster.postmaster_pid() is not None:
        with suppress(RuntimeError):
            cluster.stop("immediate")
    pid = cluster.postmaster_pid()  # still there: pg_ctl could not stop it
    if pid is not None and _is_our_postmaster(pid, cluster):
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    shutil.rmtree(cluster.root, ignore_errors=True)
