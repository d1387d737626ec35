"""Settings, the embedded default, secret keys, and refusing to run on an un-migrated database."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.fernet import Fernet
from pg import throwaway_database
from pydantic import SecretStr, ValidationError
from sqlalchemy.engine import Engine

from fleet import db
from fleet.api.app import create_app
from fleet.lab.harness import FLEETCTL, free_port
from fleet.settings import DB_FILE, SECRET_KEY_FILE, ConfigError, Settings

KEY = Fernet.generate_key().decode()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No FLEET_* configuration except a data directory of this test's own."""
    for name in list(os.environ):
        if name.startswith("FLEET_"):
            monkeypatch.delenv(name)
    data_dir = tmp_path / "data"
    monkeypatch.setenv("FLEET_DATA_DIR", str(data_dir))
    return data_dir


def fleetctl(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    assert FLEETCTL.exists(), f"console script missing: {FLEETCTL}"
    return subprocess.run(
        [str(FLEETCTL), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def cli_env(tmp_path: Path, **fleet: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    base["FLEET_DATA_DIR"] = str(tmp_path / "cli-data")
    base.update({f"FLEET_{k.upper()}": v for k, v in fleet.items()})
    return base


def empty_sqlite(tmp_path: Path) -> str:
    """A SQLite database file that exists and has no tables."""
    path = tmp_path / "empty.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect():
        pass
    engine.dispose()
    assert path.exists()
    return f"sqlite:///{path}"


# ---------------------------------------------------------------------------------------------
# The embedded default


def test_default_is_sqlite_in_the_data_dir(env: Path) -> None:
    settings = Settings()
    assert settings.database_url is None
    assert settings.is_embedded
    assert settings.data_dir == env
    assert settings.effective_database_url == f"sqlite:///{env / DB_FILE}"


def test_data_dir_defaults_to_xdg_data_home(
    env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FLEET_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert Settings().effective_database_url == f"sqlite:///{tmp_path / 'xdg' / 'fleet' / DB_FILE}"


def test_empty_database_url_means_the_embedded_default(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_DATABASE_URL", "")
    assert Settings().is_embedded


def test_embedded_secret_key_is_generated_once_with_mode_0600(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = env / SECRET_KEY_FILE
    assert not env.exists()

    key = Settings().resolve_secret_key()

    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().strip() == key
    Fernet(key)  # a valid Fernet key
    first = capsys.readouterr()
    assert first.out == ""
    assert first.err.count("generated a new secret key") == 1
    assert str(path) in first.err
    assert key.decode() not in first.err

    assert Settings().resolve_secret_key() == key
    assert Settings().resolve_secret_key() == key
    assert capsys.readouterr().err == ""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in env.iterdir()) == [SECRET_KEY_FILE]


def test_explicit_secret_key_wins_and_writes_no_file(
    env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_SECRET_KEY", KEY)
    assert Settings().resolve_secret_key() == KEY.encode()
    assert not (env / SECRET_KEY_FILE).exists()
    assert capsys.readouterr().err == ""
    assert KEY not in repr(Settings())


def test_embedded_default_migrates_itself(env: Path) -> None:
    app = create_app(Settings())
    engine: Engine = app.state.engine
    try:
        assert db.current_revision(engine) == db.head_revision() is not None
        db.check_migrated(engine)
    finally:
        engine.dispose()
    assert (env / DB_FILE).exists()
    assert (env / SECRET_KEY_FILE).exists()


# ---------------------------------------------------------------------------------------------
# Any other database


def test_other_database_requires_a_secret_key(env: Path, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'shared.db'}")
    assert not settings.is_embedded
    with pytest.raises(ConfigError, match="FLEET_SECRET_KEY"):
        settings.resolve_secret_key()
    assert not (env / SECRET_KEY_FILE).exists()


def test_other_database_without_key_is_refused_by_create_app(env: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="FLEET_SECRET_KEY"):
        create_app(Settings(database_url=f"sqlite:///{tmp_path / 'shared.db'}"))


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@db:5432/fleet", "postgresql+psycopg://u:p@db:5432/fleet"),
        pytest.param(
            "postgres://u@db/fleet",
            "postgresql+psycopg://u@db/fleet",
            id="postgres-scheme",
        ),
        ("postgresql+psycopg://u@db/fleet", "postgresql+psycopg://u@db/fleet"),
        ("sqlite:////var/lib/fleet/fleet.db", "sqlite:////var/lib/fleet/fleet.db"),
    ],
)
def test_database_urls_are_normalised(
    env: Path, monkeypatch: pytest.MonkeyPatch, given: str, expected: str
) -> None:
    monkeypatch.setenv("FLEET_DATABASE_URL", given)
    settings = Settings()
    assert settings.database_url == expected
    assert settings.effective_database_url == expected
    assert not settings.is_embedded


@pytest.mark.parametrize("url", ["mysql://u@db/fleet", "fleet.db", "https://db/fleet"])
def test_unknown_database_scheme_is_rejected(
    env: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("FLEET_DATABASE_URL", url)
    with pytest.raises(ValidationError, match="FLEET_DATABASE_URL"):
        Settings()


# ---------------------------------------------------------------------------------------------
# Un-migrated databases


def test_create_app_refuses_an_unmigrated_database(env: Path, tmp_path: Path) -> None:
    url = empty_sqlite(tmp_path)
    settings = Settings(database_url=url, secret_key=SecretStr(KEY))
    with pytest.raises(db.NotMigratedError, match="fleetctl db upgrade") as info:
        create_app(settings)
    assert f"code needs {db.head_revision()}" in str(info.value)
    engine = db.make_engine(url)
    try:
        assert db.current_revision(engine) is None  # looked, did not migrate
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_serve_refuses_an_unmigrated_database_in_one_line(tmp_path: Path) -> None:
    url = empty_sqlite(tmp_path)
    env = cli_env(tmp_path, database_url=url, secret_key=KEY, listen_port=str(free_port()))
    result = fleetctl("serve", env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "fleetctl db upgrade" in lines[0]
    assert "Traceback" not in result.stderr


def test_serve_refuses_an_unmigrated_database(tmp_path: Path) -> None:
    """What holds today: a non-zero exit naming the fix, and the database left alone."""
    url = empty_sqlite(tmp_path)
    env = cli_env(tmp_path, database_url=url, secret_key=KEY, listen_port=str(free_port()))
    result = fleetctl("serve", env=env)
    assert result.returncode != 0
    assert "fleetctl db upgrade" in result.stderr.strip().splitlines()[-1]
    assert "serving at" not in result.stdout
    engine = db.make_engine(url)
    try:
        assert db.current_revision(engine) is None
    finally:
        engine.dispose()


def test_db_upgrade_then_current_print_the_head(tmp_path: Path) -> None:
    head = db.head_revision()
    env = cli_env(tmp_path, database_url=f"sqlite:///{tmp_path / 'fresh' / 'fleet.db'}")

    before = fleetctl("db", "current", env=env)
    assert (before.returncode, before.stdout.strip()) == (0, f"database: empty  code: {head}")

    upgrade = fleetctl("db", "upgrade", env=env)
    assert upgrade.returncode == 0, upgrade.stderr
    assert upgrade.stdout.strip() == f"database at {head} (was empty)"

    current = fleetctl("db", "current", env=env)
    assert current.returncode == 0, current.stderr
    assert current.stdout.strip() == f"database: {head}  code: {head}"
    assert current.stderr == ""

    again = fleetctl("db", "upgrade", env=env)
    assert (again.returncode, again.stdout.strip()) == (0, f"database at {head}")


# ---------------------------------------------------------------------------------------------
# Postgres: a throwaway database of this test's own on the harness's server


@pytest.fixture
def empty_pg(pg_url: str) -> Iterator[str]:
    """A new, empty Postgres database (URL in psycopg form); dropped afterwards."""
    admin = sa.make_url(pg_url).set(database="postgres").render_as_string(hide_password=False)
    with throwaway_database("fleet_settings", admin) as url:
        yield url


def test_postgres_check_migrated_before_and_after_upgrade(empty_pg: str, tmp_path: Path) -> None:
    engine = db.make_engine(empty_pg)
    try:
        with pytest.raises(db.NotMigratedError, match="fleetctl db upgrade") as info:
            db.check_migrated(engine)
        assert "at nothing" in str(info.value)
        settings = Settings(database_url=empty_pg, secret_key=SecretStr(KEY), data_dir=tmp_path)
        with pytest.raises(db.NotMigratedError):
            create_app(settings, engine)

        # The CLI, with the URL as operators write it (normalised to psycopg by Settings).
        libpq_url = empty_pg.replace("postgresql+psycopg://", "postgresql://", 1)
        upgrade = fleetctl("db", "upgrade", env=cli_env(tmp_path, database_url=libpq_url))
        assert upgrade.returncode == 0, upgrade.stderr
        assert upgrade.stdout.strip() == f"database at {db.head_revision()} (was empty)"

        db.check_migrated(engine)
        assert db.current_revision(engine) == db.head_revision()
        create_app(settings, engine)
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------------------------
# The pool and the API's admission, sized together (docs/api.md)


def test_admission_cap_leaves_the_loops_their_connections(env: Path) -> None:
    from fleet.settings import LOOP_CONNECTIONS

    settings = Settings()
    pool = settings.db_pool_size + settings.db_max_overflow
    assert settings.api_max_in_flight <= pool - LOOP_CONNECTIONS
    # The most a pool allows, and one more.
    assert Settings(db_pool_size=10, db_max_overflow=0, api_max_in_flight=3).api_max_in_flight
    with pytest.raises(ValidationError, match="at most FLEET_DB_POOL_SIZE"):
        Settings(db_pool_size=10, db_max_overflow=0, api_max_in_flight=4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"api_max_in_flight": 100}, "FLEET_API_MAX_IN_FLIGHT must be at most"),
        ({"db_pool_size": 3, "db_max_overflow": 0}, "must exceed"),
        ({"shutdown_grace_s": 10, "shutdown_timeout_s": 8}, "FLEET_SHUTDOWN_TIMEOUT_S"),
    ],
)
def test_capacity_settings_that_could_wedge_are_refused(
    env: Path, overrides: dict[str, float], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings.model_validate(overrides)


def test_the_service_engine_has_the_configured_pool(env: Path, tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'pool.db'}",
        db_pool_size=12,
        db_max_overflow=3,
        db_pool_timeout_s=1.5,
    )
    engine = db.engine_from_settings(settings)
    try:
        pool = engine.pool
        assert isinstance(pool, sa.pool.QueuePool)
        assert (pool.size(), pool._max_overflow, pool._timeout) == (12, 3, 1.5)
    finally:
        engine.dispose()
