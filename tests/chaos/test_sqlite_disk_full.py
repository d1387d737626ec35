"""Chaos: the embedded SQLite default's disk fills up under load.

The world: one real `fleetctl serve` on its embedded default (no FLEET_DATABASE_URL: SQLite in
WAL mode in FLEET_DATA_DIR, migrated by the service itself at start-up), its data directory on
a small filesystem of the test's own (tests/chaos/small_disk.py: a 16 MiB tmpfs, or an ext4
image on a loop device where tmpfs mounts are refused). Its log is written elsewhere, so that
the full disk is the database's alone. Client threads keep a steady load on it over real HTTP
(tests/chaos/api_load.py): two writers creating tenants with unique names (`POST
/api/v1/tenants`, the tenant and its `tenant.created` event in one transaction, a 503 retried
after its `Retry-After`), a reader (`GET /api/v1/tenants`, `/servers`, `/events?limit=10`) and
a prober on `/healthz` and `/readyz`.

Fault injected: while the service handles those writes, a ballast file fills the filesystem to
the last byte; FULL_FOR_S after the first write is refused, the ballast is deleted.

Why this is a faithful disk full: it is not a stand-in but a real filesystem that is really
full. The kernel answers the service's own write(2)s with ENOSPC, exactly as on a data disk
that filled up (SQLite's unix VFS turns ENOSPC into SQLITE_FULL, "database or disk is full"),
and space comes back to every process the moment the ballast is deleted. What was rejected:
RLIMIT_FSIZE (`prlimit --fsize`) limits each file's size for one process, and the write past
it fails with EFBIG (CPython ignores SIGXFSZ), which SQLite reports as SQLITE_IOERR_WRITE
("disk I/O error"): another error path than a full disk's, and no disk is involved. A tmpfs
allocates at write(2), so the ENOSPC comes at once; ext4 (the fallback, `-m 0` so root has no
reserved blocks) reserves delayed allocations at write(2) as well. Mounting needs root with
CAP_SYS_ADMIN, which CI (`.ci/run`, as root) has: where no mount is permitted the test is
skipped, and fails under CI=true.

Checked:
- writes are refused while the disk is full: 503 with a `Retry-After` of at least 1 s (never a
  500, never a hang: every request is answered within the client's timeout of 10 s), and the
  service's log names the cause ("database or disk is full");
- the service stays up (the same process throughout) and keeps answering: every read 200,
  every `/healthz` 200;
- no half-written state: every write acknowledged 201 exists, every write refused exists only
  if its retry found it (409), nothing else exists, each tenant has exactly one
  `tenant.created` event, and the database file passes `PRAGMA integrity_check` after the
  service has stopped (its rows agree with what the API said);
- once the ballast is deleted, writes succeed again within RECOVERY_BOUND_S, without a
  restart, and every refused write goes through on its retry.

`pytest -s` prints what happened: the filesystem, the ballast, writes acknowledged while the
disk was filling or full, the refusals and their message, the time from the space freed to the
first 201, reads during the full disk, /readyz meanwhile.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import pytest
from api_load import API_CLIENTS, ApiLoad
from small_disk import MountRefused, SmallDisk, small_disk

from fleet.lab.harness import ServeProcess
from fleet.lab.harness import wait_for as _wait_for

if shutil.which("mount") is None or shutil.which("umount") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("mount and umount are required in CI", pytrace=False)
    pytest.skip("mount/umount not installed (Debian: mount)", allow_module_level=True)

DISK_MIB = 16
CLIENT_TIMEOUT_S = 10.0  # an answer slower than this is a hang
REFUSAL_BOUND_S = 30.0  # the disk full -> a write refused (SQLite may first reuse WAL space)
FULL_FOR_S = 3.0  # the disk stays full this long after the first refusal
RECOVERY_BOUND_S = 20.0  # the space freed -> a write 201 (a busy 2-core machine)
SETTLE_S = 1.5
RETRY_FOR_S = 40.0
PACE_S = 0.05
SERVICE_SETTINGS = {
    "FLEET_RUN_LOOPS": "true",
    "FLEET_RECONCILE_INTERVAL_S": "1",
    "FLEET_API_ADMISSION_WAIT_S": "1",
    "FLEET_API_RETRY_AFTER_S": "1",
    "FLEET_LOG_LEVEL": "INFO",
}
DISK_FULL = "database or disk is full"  # SQLite's message for SQLITE_FULL

wait_for = partial(_wait_for, every=0.05)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """The small filesystem, mounted; unmounted after the test, passed or failed."""
    with ExitStack() as stack:
        problem: str | None = None
        try:
            found = stack.enter_context(small_disk(tmp_path / "disk", DISK_MIB))
        except MountRefused as exc:
            problem = f"no small filesystem to fill: {exc}"
        if problem is not None:  # outside the except block: a one-line failure, no chain
            if os.environ.get("CI") == "true":
                pytest.fail(problem, pytrace=False)
            pytest.skip(problem)
        yield found


def stored_in_file(path: Path) -> tuple[list[tuple[str]], set[str], Counter[str]]:
    """PRAGMA integrity_check, the tenants and the tenant.created events per subject, read
    from the database file itself."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchall()
        tenants = {row[0] for row in conn.execute("SELECT name FROM tenant")}
        events = Counter(
            row[0]
            for row in conn.execute("SELECT subject FROM event WHERE kind = 'tenant.created'")
        )
    finally:
        conn.close()
    return integrity, tenants, events


def test_the_embedded_databases_disk_fills_up(disk: SmallDisk, tmp_path: Path) -> None:
    data_dir = disk.path / "data"
    service = ServeProcess("serve", data_dir, SERVICE_SETTINGS, log=tmp_path / "serve.log")
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
        load.start(readers=[["/tenants", "/servers", "/events?limit=10"]], writers=2)
        wait_for("the load to get going", lambda: load.acks() >= 10, 30, why=service.tail)
        time.sleep(SETTLE_S)

        # The fault: the filesystem filled to the last byte while the writes go on.
        free_before = disk.free_bytes()
        filling_at = time.monotonic()
        ballast = disk.fill()
        full_at = time.monotonic()
        free_when_full = disk.free_bytes()
        refused = wait_for(
            "a write refused on the full disk",
            lambda: load.first(["writer", "retry"], 503, since=full_at),
            REFUSAL_BOUND_S,
            why=service.tail,
            give_up=service.exited,
        )
        time.sleep(FULL_FOR_S)
        freed_at = time.monotonic()
        disk.free()
        back = wait_for(
            "a write 201 once the space is freed",
            lambda: load.first(["writer", "retry"], 201, since=freed_at),
            RECOVERY_BOUND_S,
            why=service.tail,
            give_up=service.exited,
        )
        time.sleep(SETTLE_S)
        stuck = load.stop()
        assert not stuck, f"client threads still running: {stuck}"
        assert service.running and service.proc.pid == pid, "the service was restarted"

        api = load.answers(*API_CLIENTS)
        full = load.answers(*API_CLIENTS, since=full_at, until=freed_at)
        reads_full = Counter(a.status for a in full if a.who == "reader")
        writes_full = Counter(a.status for a in full if a.who != "reader")
        acked_while_full = [
            a for a in full if a.who != "reader" and a.status == 201 and a.started < refused.started
        ]
        refusals = [a for a in api if a.status == 503]
        readyz = Counter(a.status for a in load.answers("readyz", since=full_at, until=freed_at))
        health = Counter(a.status for a in load.answers("healthz"))
        slowest = max(api, key=lambda a: a.seconds)
        log = service.run_log()
        print(
            f"\nThe embedded SQLite's disk full ({disk.kind}):"
            f"\n  {free_before / 2**20:.1f} MiB free; a {ballast / 2**20:.1f} MiB ballast in "
            f"{full_at - filling_at:.2f} s left {free_when_full} bytes"
            f"\n  the first write refused {refused.ended - full_at:.2f} s after the disk was "
            f"full ({len(acked_while_full)} acknowledged before it): {refused.status}, "
            f"Retry-After {refused.retry_after}, {refused.detail!r}"
            f"\n  while full ({freed_at - full_at:.1f} s): writes {dict(writes_full)}, reads "
            f"{dict(reads_full)}, /readyz {dict(readyz)}"
            f"\n  the log says {DISK_FULL!r}: {DISK_FULL in log}"
            f"\n  space freed -> first 201 in {back.ended - freed_at:.2f} s (no restart); "
            f"slowest answer {slowest.seconds:.2f} s ({slowest.status} {slowest.path})"
            f"\n  writes: {len(load.acknowledged)} acknowledged "
            f"({dict(Counter(load.acknowledged.values()))}), {load.retried} refused first and "
            f"retried, {len(load.ambiguous)} refused but committed (409 on the retry), "
            f"{len(load.unresolved)} unresolved; 503 details "
            f"{dict(Counter(a.detail for a in refusals))}"
        )

        # Refused, not failed: 503 + Retry-After, never a 500, never a hang or a cut connection.
        no_answer = [a for a in load.answers() if a.status is None]
        assert not no_answer, f"requests without an HTTP answer (hang or refusal): {no_answer[:5]}"
        odd = [
            a
            for a in api
            if not (a.status in (200, 201, 503) or (a.status == 409 and a.who == "retry"))
        ]
        assert not odd, f"answers other than 200/201/503: {odd[:5]}\n{service.tail(60)}"
        for answer in refusals:
            assert answer.who != "reader", f"a read refused: {answer}"
            assert answer.retry_after is not None and int(answer.retry_after) >= 1, answer
        assert DISK_FULL in log, f"the log does not name the full disk\n{service.tail(60)}"
        # Up and answering throughout.
        assert set(health) == {200}, f"/healthz: {dict(health)}"
        assert reads_full.get(200, 0) > 0 and set(reads_full) == {200}, dict(reads_full)

        # Each write whole or not at all, through the API...
        stored = load.check_nothing_lost()
        # ... and in the file, once the service has closed it.
        service.stop()
        integrity, tenants, events = stored_in_file(data_dir / "fleet.db")
        print(
            f"  stored: {len(stored)} tenants, each with one tenant.created event; "
            f"PRAGMA integrity_check: {integrity}"
        )
        assert integrity == [("ok",)], integrity
        assert tenants == stored, sorted(tenants ^ stored)[:10]
        uneven = {n: events[n] for n in set(events) | stored if events[n] != 1 or n not in stored}
        assert not uneven, f"tenant.created events in the file, where not one a tenant: {uneven}"
