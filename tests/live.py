"""A real Fleet service under uvicorn in a background thread, for API and CLI tests.

Not a test module: test modules import these helpers (`from live import ...`, as they import
factories) and wrap `serve` in a fixture of the scope they need, usually one server per module
per database. The service shares the test's `engine`, so the per-test `db` wipe empties what it
sees; tokens are rows too, so create them after the wipe (`Live.token`).
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
import yaml
from factories import TEST_SECRET_KEY
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import col

from fleet.api.app import create_app
from fleet.auth import create_token, hash_token
from fleet.data import DEMO_INVENTORY
from fleet.db import session_scope
from fleet.lab.harness import free_port
from fleet.models import ApiToken, Role, utcnow
from fleet.power.budget import Feed
from fleet.settings import Settings, get_settings

DEMO_INVENTORY = DEMO_INVENTORY
YAML = {"Content-Type": "application/yaml"}
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


@dataclass
class Live:
    """A running service: its base URL, the app object and the settings it was built with."""

    url: str
    app: FastAPI
    settings: Settings
    engine: Engine
    _clients: list[httpx.Client] = field(default_factory=list)

    def token(self, role: Role | str, *, name: str | None = None, server: str | None = None) -> str:
        """A new token of `role` (agent tokens need `server`), stored the way fleetctl does."""
        return make_token(self.engine, Role(role), name=name, server=server)

    def client(self, token: str | None = None) -> httpx.Client:
        """An HTTP client on the service, with `token` as its bearer token (if any)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        client = httpx.Client(
            base_url=self.url, headers=headers, timeout=30.0, verify=_ssl_context()
        )
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # One context for every client: building one (certifi's bundle) costs ~20 ms, and these
    # clients only ever speak plain HTTP to 127.0.0.1.
    return ssl.create_default_context()


def make_token(
    engine: Engine, role: Role, *, name: str | None = None, server: str | None = None
) -> str:
    with session_scope(engine) as session:
        return create_token(session, name or f"test-{role.value}", role, server, actor="tests")


def revoke_token(engine: Engine, token: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.update(ApiToken)
            .where(col(ApiToken.token_hash) == hash_token(token))
            .values(revoked_at=utcnow())
        )


def database_url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


@contextmanager
def database_env(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """FLEET_DATABASE_URL and FLEET_SECRET_KEY for `engine`, as fleetctl's database-direct
    commands (token, db, serve) read them; fleet's settings cache is cleared in and out."""
    monkeypatch.setenv("FLEET_DATABASE_URL", database_url(engine))
    monkeypatch.setenv("FLEET_SECRET_KEY", TEST_SECRET_KEY.decode())
    get_settings.cache_clear()
    try:
        yield
    finally:
        get_settings.cache_clear()


def live_settings(engine: Engine, data_dir: Path, **overrides: Any) -> Settings:
    """Settings for a service on `engine` (not the embedded default) with the tests' key."""
    return Settings(
        data_dir=data_dir,
        database_url=database_url(engine),
        secret_key=SecretStr(TEST_SECRET_KEY.decode()),
        **overrides,
    )


# A port on 127.0.0.1 that nothing listens on: one the harness found free (bound, released).
closed_port = free_port


@contextmanager
def serve(engine: Engine, data_dir: Path, **settings: Any) -> Iterator[Live]:
    """Run create_app(settings, engine) under uvicorn on a free 127.0.0.1 port until exit."""
    config_settings = live_settings(engine, data_dir, **settings)
    app = create_app(config_settings, engine)
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP, and without it every keep-alive response waits ~40 ms for a
    # delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # log_config=None: uvicorn leaves logging alone, so its records reach the root logger (and
    # whatever a test attached there) like everyone else's.
    config = uvicorn.Config(app, log_config=None, access_log=True, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    live = Live(url=f"http://127.0.0.1:{port}", app=app, settings=config_settings, engine=engine)
    try:
        _wait_until_healthy(live, thread)
        yield live
    finally:
        live.close_clients()
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
        if thread.is_alive():  # pragma: no cover - a hung server fails the run loudly
            raise RuntimeError(f"uvicorn on {live.url} did not stop in {STOP_TIMEOUT_S} s")


def _wait_until_healthy(live: Live, thread: threading.Thread) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn on {live.url} exited during startup")
        try:
            if httpx.get(f"{live.url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.02)
    raise RuntimeError(f"uvicorn on {live.url} did not answer /healthz: {last!r}")


# ---------------------------------------------------------------------------------------------
# Log capture that sees every thread (the service runs in its own)


class RecordingHandler(logging.Handler):
    """Keeps every record, formatted (message, exception and stack text included)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(threadName)s %(name)s: %(message)s"))
        self.lines: list[str] = []
        self.loggers: set[str] = set()
        self._lock_lines = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a record that cannot format is still evidence: keep its parts
            text = f"{record.name}: {record.msg!r} {record.args!r}"
        with self._lock_lines:
            self.lines.append(text)
            self.loggers.add(record.name)


DEBUG_LOGGERS = (
    "",
    "fleet",
    "fleet.api",
    "fleet.access",
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "sqlalchemy",
    "sqlalchemy.engine",
    "sqlalchemy.pool",
    "sqlalchemy.orm",
    "alembic",
    "httpx",
    "httpcore",
    "asyncio",
    "fleet.cli",
)


@contextmanager
def debug_logging() -> Iterator[RecordingHandler]:
    """Every interesting logger at DEBUG, all records captured; levels restored after.

    Each is also made to propagate to the root for the while: a uvicorn.Config built earlier in
    this process with `access_log=False` (`fleetctl serve` run in-process by another test) leaves
    uvicorn.access not propagating, which would hide its records from the capture."""
    handler = RecordingHandler()
    root = logging.getLogger()
    loggers = [logging.getLogger(name) for name in DEBUG_LOGGERS]
    saved = [(lg.level, lg.disabled, lg.propagate) for lg in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.disabled = False
        logger.propagate = True
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        for logger, (level, disabled, propagate) in zip(loggers, saved, strict=True):
            logger.setLevel(level)
            logger.disabled = disabled
            logger.propagate = propagate


# ---------------------------------------------------------------------------------------------
# Every route of the app, so a sweep covers a route added later without being told about it

HTTP_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
# Routes kept out of the OpenAPI schema that no top-level route lists either (they sit in an
# included router): named here, and checked to exist by `operations`.
HIDDEN_ROUTES = (("GET", "/metrics", "metrics"),)
PARAM = re.compile(r"\{([^}/]+)\}")


def operations(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path template) of every route: the OpenAPI paths, the app's own top-level
    routes (docs, schema) and HIDDEN_ROUTES."""
    ops: set[tuple[str, str]] = set()
    for path, item in app.openapi()["paths"].items():
        ops.update((method.upper(), path) for method in item if method.upper() in HTTP_METHODS)
    for route in app.routes:
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if isinstance(path, str) and methods:
            ops.update((method, path) for method in methods if method in HTTP_METHODS)
    for method, path, name in HIDDEN_ROUTES:
        assert app.url_path_for(name) == path, f"{name} moved: update HIDDEN_ROUTES"
        ops.add((method, path))
    return sorted(ops)


def fill_path(template: str, names: dict[str, str], default: str) -> str:
    """/api/v1/servers/{name}/gpus -> /api/v1/servers/<names["servers"]>/gpus.

    Each `{param}` gets the real name of the collection just before it, or `default`.
    """
    parts = template.split("/")
    out = []
    for i, part in enumerate(parts):
        if PARAM.fullmatch(part):
            collection = parts[i - 1] if i > 0 else ""
            out.append(names.get(collection, default))
        else:
            out.append(part)
    return "/".join(out)


# ---------------------------------------------------------------------------------------------
# What fleet/data/inventory/demo.yaml holds, read from the file itself (expected values for the
# tests)


@dataclass(frozen=True)
class DemoServer:
    name: str
    site: str
    rack: str
    pool: str
    gpu_model: str
    gpu_count: int
    standby_w: float
    max_w: float


@dataclass(frozen=True)
class DemoRack:
    name: str
    site: str
    feeds: tuple[Feed, ...]
    feed_names: tuple[str, ...]
    servers: tuple[DemoServer, ...]


@dataclass(frozen=True)
class Demo:
    sites: tuple[str, ...]
    racks: tuple[DemoRack, ...]
    deployments: tuple[str, ...]

    @property
    def servers(self) -> list[DemoServer]:
        return [s for rack in self.racks for s in rack.servers]

    def rack(self, name: str) -> DemoRack:
        return next(r for r in self.racks if r.name == name)

    def server(self, name: str) -> DemoServer:
        return next(s for s in self.servers if s.name == name)


def load_demo(path: Path = DEMO_INVENTORY) -> Demo:
    doc = yaml.safe_load(path.read_text())
    assert not doc.get("servers"), "top-level servers: extend load_demo"
    racks = []
    for site in doc["sites"]:
        for rack in site["racks"]:
            feeds = tuple(
                Feed(
                    f["side"],
                    float(f["volts"]),
                    float(f["amps"]),
                    f.get("phase", "single"),
                    float(f.get("max_utilisation_pct", 80.0)),
                )
                for f in rack["feeds"]
            )
            servers = tuple(
                DemoServer(
                    name=s["name"],
                    site=site["name"],
                    rack=rack["name"],
                    pool=s.get("pool", "warm"),
                    gpu_model=s["gpu"]["model"],
                    gpu_count=int(s["gpu"]["count"]),
                    standby_w=float(s["power"]["standby_w"]),
                    max_w=float(s["power"]["max_w"]),
                )
                for s in rack["servers"]
            )
            names = tuple(f["name"] for f in rack["feeds"])
            racks.append(DemoRack(rack["name"], site["name"], feeds, names, servers))
    return Demo(
        sites=tuple(s["name"] for s in doc["sites"]),
        racks=tuple(racks),
        deployments=tuple(d["name"] for d in doc.get("deployments", [])),
    )
