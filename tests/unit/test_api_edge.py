"""The request edge and the truthful errors (fleet/api/edge.py, fleet/api/access.py; issue 19).

- Refused before reading: the app is called directly over ASGI with a `receive` that counts what
  it hands out, so "the body was never read" is observed, not inferred. A real `fleetctl serve`
  gets ~400 MB chunked bodies over a raw socket, and its RSS is read from /proc.
- Control characters in the path, the query and any JSON string: 422 naming the place.
- Errors: a forced 500 is logged with its traceback and counted; a value the database cannot
  hold is 422; Postgres cut off (a TCP proxy of the test's own between the service and
  127.0.0.1:5432, so the shared server is never touched) is 503 + Retry-After, then 200 again.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import threading
from collections.abc import Iterable, Iterator, MutableMapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from live import live_settings, make_token
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.testclient import TestClient

from fleet import db as fleet_db
from fleet.api import access, edge
from fleet.api.app import create_app
from fleet.api.deps import SessionDep, Viewer
from fleet.auth import Principal, authenticate
from fleet.lab.harness import ServeProcess
from fleet.models import Role

API = "/api/v1"
JSON_LIMIT = 4096
INVENTORY_LIMIT = 16384
UPLOAD = f"{API}/inventory/import"
sqlite_only = pytest.mark.parametrize("engine", ["sqlite"], indirect=True)


# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_json_scan_names_every_place_of_a_control_character() -> None:
    body = json.dumps(
        {
            "reason": "\x1b]0;owned\x07",  # an OSC sequence: terminal title
            "gpus": [{"uuid": "GPU-1"}, {"uuid": "a\x00b"}],
            "ok": "tabs\\and\\backslashes are fine",
            "k\x7fey": 1,
            "c1": "\x9b31m",
            "nl": "two\nlines",
        },
        ensure_ascii=False,  # DEL and C1 raw in the text, as JSON allows
    ).encode()
    assert edge.body_problems(body) == [
        "body: a key has control character U+007F",  # a mapping's keys before its values
        "body.reason: control character U+001B is not allowed",
        "body.gpus[1].uuid: control character U+0000 is not allowed",
        "body.c1: control character U+009B is not allowed",
        "body.nl: control character U+000A is not allowed",
    ]
    # ASCII-escaped the same: `\u009b`, `\u007f`.
    assert len(edge.body_problems(json.dumps(json.loads(body)).encode())) == 5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b'{"reason": "bell\x07"}', "body: control characters are not allowed"),  # not JSON
        (b'{"a": 1}\x7f', "body: control characters are not allowed"),
        (b'["ok", "\\\\\\u0000"]', "body[1]: control character U+0000 is not allowed"),
    ],
)
def test_json_scan_refuses_raw_control_bytes(text: bytes, expected: str) -> None:
    assert edge.body_problems(text) == [expected]


@pytest.mark.parametrize(
    "text",
    [
        rb'{"reason": "C:\\new\\table"}',  # escaped backslashes, then letters: no control
        rb'{"reason": "\\\\u001b"}',  # a backslash pair, then the text u001b
        b'{\n\t"reason": "pretty-printed",\r\n "n": [1, 2]}',  # JSON whitespace between tokens
        json.dumps({"name": "caf\u00e9 \u2603 \u00c2\u00a0", "q": '"quoted"'}).encode(),
        json.dumps({"name": "caf\u00e9 \u00c2\u00a0"}, ensure_ascii=False).encode(),
    ],
)
def test_json_scan_has_no_false_hits(text: bytes) -> None:
    assert edge.body_problems(text) == []


def test_a_clean_heartbeat_is_not_parsed_by_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agents' hot path: one regular-expression pass over the bytes, no JSON parse."""
    heartbeat = {
        "server": "fra1-r01-h100-01",
        "verdict": "healthy",
        "reasons": [{"code": "xid_other", "message": 'Xid 31 — driver: "MMU Fault" \\ ok'}],
        "gpus": [{"index": i, "uuid": f"GPU-{i:08x}", "temperature_c": 61.5} for i in range(8)],
        "replicas": [{"url": "http://10.0.0.5:8001", "queued": 3}],
    }
    monkeypatch.setattr(edge, "json", None)  # any parse here would fail loudly
    assert edge.body_problems(json.dumps(heartbeat).encode()) == []
    assert edge.body_problems(json.dumps(heartbeat, ensure_ascii=False).encode()) == []


def test_path_and_query_places() -> None:
    assert edge.path_problems("/api/v1/servers/a\x00b", b"") == [
        "path: control character U+0000 is not allowed"
    ]
    assert edge.path_problems("/api/v1/servers", b"site=a%00b&rack=r1&state=%1b%5b2J") == [
        "query.site: control character U+0000 is not allowed",
        "query.state: control character U+001B is not allowed",
    ]
    assert edge.path_problems("/x", b"a%0Ab=1&c=%C2%9B") == [
        "query: a parameter name has control character U+000A",
        "query.c: control character U+009B is not allowed",
    ]
    assert edge.path_problems("/api/v1/servers/caf\u00e9", b"site=%E2%98%83&x=%ff") == []


def test_a_422_lists_a_bounded_number_of_places() -> None:
    body = json.dumps({f"f{i}": "\x00" for i in range(500)}).encode()
    answer = edge.invalid(edge.body_problems(body))
    assert answer["detail"] == "body.f0: control character U+0000 is not allowed (and 499 more)"
    assert len(answer["errors"]) == edge.MAX_REPORTED + 1
    assert answer["errors"][-1] == f"… {500 - edge.MAX_REPORTED} more not listed"


# ---------------------------------------------------------------------------------------------
# The app over ASGI, with a `receive` that counts


@dataclass
class Exchange:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    receive_calls: int  # messages the app took from the client
    received: int  # body bytes among them


async def _exchange(
    app: FastAPI,
    method: str,
    path: str,
    *,
    token: str | None = None,
    chunks: Iterable[bytes] = (),
    declared: int | None = None,
    content_type: str = "application/json",
) -> Exchange:
    """One request straight into the ASGI app; the body is `chunks`, declared by
    Content-Length `declared`, else chunked (when there are chunks)."""
    headers = [(b"host", b"testserver"), (b"content-type", content_type.encode())]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    pieces = list(chunks)
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    elif pieces:
        headers.append((b"transfer-encoding", b"chunked"))
    path, _, query = path.partition("?")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
    }
    calls = received = 0
    done = anyio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal calls, received
        calls += 1
        if calls <= len(pieces):
            received += len(pieces[calls - 1])
            return {
                "type": "http.request",
                "body": pieces[calls - 1],
                "more_body": calls < len(pieces),
            }
        if not pieces and calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    status, out_headers, body = 0, {}, bytearray()

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return Exchange(status, out_headers, json.loads(body) if body else {}, calls, received)


def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> Exchange:
    async def run() -> Exchange:
        return await _exchange(app, method, path, **kwargs)

    return anyio.run(run)


@dataclass
class Service:
    app: FastAPI
    engine: Engine
    tokens: dict[Role, str] = field(default_factory=dict)
    lookups: list[str] = field(default_factory=list)

    def token(self, role: Role) -> str:
        if role not in self.tokens:
            self.tokens[role] = make_token(self.engine, role, name=f"edge-{role.value}")
        return self.tokens[role]

    def client(self, role: Role | None = None) -> TestClient:
        headers = {"Authorization": f"Bearer {self.token(role)}"} if role else {}
        return TestClient(self.app, headers=headers)


def _service(engine: Engine, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Service:
    settings = live_settings(
        engine, data_dir, max_body_bytes=JSON_LIMIT, max_inventory_bytes=INVENTORY_LIMIT
    )
    service = Service(create_app(settings, engine, migrate=False), engine)

    def counted(session: Session, token: str) -> Principal | None:
        service.lookups.append(token)
        return authenticate(session, token)

    monkeypatch.setattr(edge, "authenticate", counted)
    return service


@pytest.fixture
def service(db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Service:
    return _service(db, tmp_path, monkeypatch)


def junk(total: int, chunk: int = 1024) -> list[bytes]:
    return [b"x" * chunk for _ in range(total // chunk)]


@sqlite_only
def test_no_token_is_401_before_the_body_is_read(service: Service) -> None:
    for token in (None, "flt_not-a-token", "x" * 5000):
        answer = call(service.app, "POST", f"{API}/deployments", token=token, chunks=junk(10**6))
        assert answer.status == 401, answer
        assert answer.receive_calls == 0
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.headers["connection"] == "close"  # the rest is never read
        assert "fleetctl token create" in answer.body["detail"]
    # An unparseable body with no token: 401, not 422 (the token first, the body never).
    answer = call(service.app, "POST", f"{API}/deployments", chunks=[b"{not json"], declared=9)
    assert (answer.status, answer.receive_calls) == (401, 0)
    assert service.lookups == ["flt_not-a-token"]  # the overlong one costs no query either


@sqlite_only
def test_a_declared_length_over_the_limit_is_413_unread(service: Service) -> None:
    for token in (None, service.token(Role.OPERATOR)):
        answer = call(
            service.app, "POST", f"{API}/deployments", token=token, declared=10**9, chunks=[b"{"]
        )
        assert (answer.status, answer.receive_calls) == (413, 0), answer
        assert answer.body["detail"] == (
            f"request body too large: the limit is {JSON_LIMIT} bytes here (FLEET_MAX_BODY_BYTES)"
        )
        assert answer.headers["connection"] == "close"
    # The inventory uploads have their own limit, past which nobody is asked for a token.
    answer = call(service.app, "POST", UPLOAD, declared=INVENTORY_LIMIT + 1, chunks=[b"x"])
    assert (answer.status, answer.receive_calls) == (413, 0)
    assert f"{INVENTORY_LIMIT} bytes here (FLEET_MAX_INVENTORY_BYTES)" in answer.body["detail"]
    assert service.lookups == []  # no database asked at all


@sqlite_only
def test_a_streamed_body_stops_at_the_limit(service: Service) -> None:
    operator = service.token(Role.OPERATOR)
    answer = call(service.app, "POST", f"{API}/deployments", token=operator, chunks=junk(10**6))
    assert answer.status == 413, answer
    assert JSON_LIMIT < answer.received <= JSON_LIMIT + 1024
    assert answer.headers["connection"] == "close"
    # Within the limit, the route gets the body as it came (here: its validation's 422).
    answer = call(service.app, "POST", f"{API}/deployments", token=operator, chunks=[b"{}"])
    assert answer.status == 422, answer
    assert "body.name: required" in answer.body["errors"]


@sqlite_only
def test_inventory_uploads_are_for_operators_and_have_their_own_limit(service: Service) -> None:
    yaml = "application/yaml"
    viewer, operator = service.token(Role.VIEWER), service.token(Role.OPERATOR)
    for path in (UPLOAD, f"{API}/inventory/validate"):
        answer = call(
            service.app, "POST", path, token=viewer, chunks=junk(10**6), content_type=yaml
        )
        assert (answer.status, answer.receive_calls) == (403, 0), answer
        assert answer.body["detail"] == (
            "a viewer token cannot do this; it needs the operator role"
        )
        assert answer.headers["connection"] == "close"
        # An operator streams up to the inventory limit (past the JSON one), not a byte more.
        answer = call(
            service.app, "POST", path, token=operator, chunks=junk(10**6), content_type=yaml
        )
        assert answer.status == 413, answer
        assert INVENTORY_LIMIT < answer.received <= INVENTORY_LIMIT + 1024
        assert "FLEET_MAX_INVENTORY_BYTES" in answer.body["detail"]
        assert answer.headers["connection"] == "close"
    # Under it, the file is read: a body bigger than the JSON limit reaches the parser.
    big = b"sites: []\n" + b"# padding\n" * (JSON_LIMIT // 10 + 10)
    answer = call(service.app, "POST", UPLOAD, token=operator, chunks=[big], content_type=yaml)
    assert answer.status == 200, answer
    assert answer.received == len(big) > JSON_LIMIT


@sqlite_only
def test_the_handler_gets_the_edge_principal_without_a_second_lookup(service: Service) -> None:
    viewer = service.client(Role.VIEWER)
    assert viewer.get(f"{API}/sites").status_code == 200
    assert viewer.get(f"{API}/servers", params={"limit": 5}).status_code == 200
    assert service.lookups == [service.token(Role.VIEWER)] * 2  # one lookup a request
    assert service.client().get(f"{API}/sites").status_code == 401
    # Outside /api/v1 no token is asked for (probes, metrics).
    assert service.client().get("/healthz").status_code == 200
    assert service.lookups == [service.token(Role.VIEWER)] * 2


@sqlite_only
def test_control_characters_are_refused_by_place(service: Service) -> None:
    operator = service.client(Role.OPERATOR)
    cases = [
        ("GET", f"{API}/servers?site=a%00b", None, "query.site: control character U+0000"),
        ("GET", f"{API}/servers/a%00b", None, "path: control character U+0000"),
        ("GET", f"{API}/events?kind=%1B%5B31m", None, "query.kind: control character U+001B"),
        (
            "POST",
            f"{API}/servers/any/transition",
            {"to": "maintenance", "reason": "\x1b]2;pwned\x07 fixed"},
            "body.reason: control character U+001B",
        ),
        (
            "POST",
            f"{API}/deployments",
            {"name": "d", "engine_params": {"ba\x00d": 1}},
            "body.engine_params: a key has control character U+0000",
        ),
        (
            "PATCH",
            f"{API}/servers/any",
            {"bmc_username": "root\u0085"},  # C1 next line
            "body.bmc_username: control character U+0085",
        ),
    ]
    for method, path, body, expected in cases:
        reply = operator.request(method, path, json=body)
        assert reply.status_code == 422, (path, reply.text)
        assert reply.json()["detail"].startswith(expected), reply.json()
        assert reply.json()["errors"][0].startswith(expected)
    # The path and the query are checked before the token: nothing else to know about them.
    reply = service.client().get(f"{API}/servers?site=%00")
    assert reply.status_code == 422
    # A legal backslash is no control character: the route answers (no such server).
    reply = operator.post(
        f"{API}/servers/any/transition", json={"to": "maintenance", "reason": "C:\\new"}
    )
    assert reply.status_code == 404, reply.text


# ---------------------------------------------------------------------------------------------
# Errors that tell the truth


def _with_route(service: Service, path: str, endpoint: Any) -> None:
    service.app.router.add_api_route(path, endpoint, methods=["GET"])


@sqlite_only
def test_an_unhandled_error_is_a_counted_logged_500(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(_: Viewer) -> None:
        raise RuntimeError("the internals: /etc/fleet/secret.key")

    _with_route(service, f"{API}/test-boom", boom)
    caplog.set_level(logging.INFO, logger="fleet")
    reply = service.client(Role.VIEWER).get(f"{API}/test-boom")
    assert reply.status_code == 500
    assert reply.json() == {"detail": access.INTERNAL}  # nothing of the exception
    [error] = [r for r in caplog.records if r.name == "fleet.api" and r.levelno == logging.ERROR]
    assert error.getMessage() == f"GET {API}/test-boom: unhandled RuntimeError"
    assert error.exc_info is not None and "secret.key" in str(error.exc_info[1])  # traceback
    [line] = [r.getMessage() for r in caplog.records if r.name == "fleet.access"]
    assert line.startswith(f"GET {API}/test-boom 500 "), line
    metrics = service.client().get("/metrics").text
    assert (
        f'fleet_http_requests_total{{method="GET",route="{API}/test-boom",status="500"}} 1.0'
        in metrics
    )


def test_a_value_the_database_cannot_hold_is_422(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """Postgres: DataError (integer out of range); SQLite: OverflowError (beyond 64 bits)."""

    def too_big(_: Viewer, session: SessionDep) -> None:
        session.execute(sa.text("SELECT CAST(:v AS INTEGER)"), {"v": 2**70})

    _with_route(service, f"{API}/test-too-big", too_big)
    caplog.set_level(logging.INFO, logger="fleet")
    reply = service.client(Role.VIEWER).get(f"{API}/test-too-big")
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"].startswith(
        "a number is out of range for its database column"
        if service.engine.dialect.name == "postgresql"
        else "a number is too large"
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    metrics = service.client().get("/metrics").text
    assert f'route="{API}/test-too-big",status="422"}} 1.0' in metrics


def test_access_log_never_prints_control_characters(caplog: pytest.LogCaptureFixture) -> None:
    assert access.printable("/a\x1b]0;x\x07b") == "/a\\x1b]0;x\\x07b"
    assert access.printable("y" * 1000).endswith("…")


# ---------------------------------------------------------------------------------------------
# Postgres cut off: a proxy of the test's own


class Proxy:
    """A TCP proxy on 127.0.0.1 to `target`; `cut()` drops every connection and refuses new
    ones (accepts and closes them: a server restarting), `restore()` lets them through again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port: int = self.listener.getsockname()[1]
        self.up = True
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="pg-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self.up:
                conn.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                conn.close()  # the server itself is away: so is the proxy's answer
                continue
            upstream.settimeout(None)
            conn.settimeout(None)
            with self._lock:
                self._open.update((conn, upstream))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for sock in (src, dst):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.up = False
        with self._lock:
            doomed, self._open = self._open, set()
        for sock in doomed:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pumps; they close nothing twice
            sock.close()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._thread.join(5)
        self.listener.close()


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    proxy = Proxy(("127.0.0.1", 5432))
    try:
        yield proxy
    finally:
        proxy.close()


def test_postgres_unreachable_is_503_with_retry_after(
    pg_url: str, db: Engine, proxy: Proxy, tmp_path: Path
) -> None:
    url = sa.make_url(pg_url).set(host="127.0.0.1", port=proxy.port)
    through = fleet_db.make_engine(url.render_as_string(hide_password=False))
    try:
        settings = live_settings(db, tmp_path, api_retry_after_s=7)
        service = Service(create_app(settings, through, migrate=False), db)
        viewer = service.client(Role.VIEWER)
        assert viewer.get(f"{API}/sites").status_code == 200
        proxy.cut()
        for path in (f"{API}/sites", f"{API}/servers", f"{API}/deployments"):
            reply = viewer.get(path)
            assert reply.status_code == 503, reply.text
            assert reply.headers["retry-after"] == "7"
            assert reply.json() == {"detail": "the database is unavailable: retry after 7 s"}
        proxy.restore()
        assert viewer.get(f"{API}/sites").status_code == 200
        metrics = service.client().get("/metrics").text
        assert 'route="unmatched",status="503"} 3.0' in metrics  # refused at the edge's lookup
    finally:
        through.dispose()


# ---------------------------------------------------------------------------------------------
# A real `fleetctl serve`: ~400 MB streamed at it, and its memory


STREAM_BYTES = 400 * 1024 * 1024
CHILD_INVENTORY_LIMIT = 8 * 1024 * 1024
# What the kernel's socket buffers on both sides may hold while the answer is on its way.
IN_FLIGHT_SLACK = 48 * 1024 * 1024
RSS_GROWTH_LIMIT = 64 * 1024 * 1024


@dataclass
class Streamed:
    status: int
    sent: int


def stream_chunked(port: int, path: str, token: str | None, total: int) -> Streamed:
    """POST `total` bytes of chunked body until the service answers (or hangs up)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
    head += "Content-Type: application/json\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    sock.sendall((head + "\r\n").encode())
    answer = bytearray()
    answered = threading.Event()

    def read() -> None:
        with suppress(OSError):
            while data := sock.recv(65536):
                answer.extend(data)
                if b"\r\n\r\n" in answer:
                    answered.set()
        answered.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    size = 1024 * 1024
    piece = b"%x\r\n" % size + b" " * size + b"\r\n"
    sent = 0
    try:
        while sent < total and not answered.is_set():
            sock.sendall(piece)
            sent += size
        else:
            if sent >= total:
                sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # it hung up on the rest: what it is meant to do
    answered.wait(60)
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    reader.join(10)
    sock.close()
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", bytes(answer))
    assert match, f"no answer from the service: {bytes(answer[:200])!r}"
    return Streamed(int(match[1]), sent)


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M)
    assert match, status
    return int(match[1]) * 1024


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, str]]:
    """`fleetctl serve` on its embedded SQLite, with an admin token; (process, port, token)."""
    settings = {
        "FLEET_RUN_LOOPS": "false",
        "FLEET_MAX_INVENTORY_BYTES": str(CHILD_INVENTORY_LIMIT),
    }
    service = ServeProcess("serve", tmp_path / "data", settings, log=tmp_path / "serve.log")
    try:
        service.start(admin_token=True)
        yield service.proc, service.port, service.admin_token()
    finally:
        service.stop()


def test_a_real_service_refuses_400_mb_without_reading_it(
    child: tuple[subprocess.Popen[bytes], int, str],
) -> None:
    proc, port, admin = child
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {admin}"}
    # Warm up every path below once (imports, first allocations), then measure.
    assert httpx.post(f"{base}{API}/deployments", content=b"{}").status_code == 401
    assert httpx.post(f"{base}{API}/deployments", content=b"{}", headers=auth).status_code == 422
    assert httpx.post(f"{base}{UPLOAD}", content=b"x: [", headers=auth).status_code == 422
    before = rss_bytes(proc.pid)
    cases = [
        (f"{API}/deployments", None, 401, 0),
        (f"{API}/deployments", admin, 413, 1024 * 1024),
        (UPLOAD, admin, 413, CHILD_INVENTORY_LIMIT),
    ]
    for path, token, status, limit in cases:
        streamed = stream_chunked(port, path, token, STREAM_BYTES)
        assert streamed.status == status, (path, streamed)
        # Refused at the limit: the client could not push the 400 MB through.
        assert streamed.sent < limit + IN_FLIGHT_SLACK, (path, streamed)
    growth = rss_bytes(proc.pid) - before
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.0f} MiB"
    # And it still serves.
    assert httpx.get(f"{base}{API}/sites", headers=auth).status_code == 200
