"""The agent's token from a file (FLEET_AGENT_TOKEN_FILE): refused when group or others can read
it, exactly one of it and FLEET_AGENT_TOKEN, and a token written there by a rotation is used
from the next request on without restarting the agent; a file that cannot be read keeps the
token in use (said once). The token's value never appears in an error or a log line."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from fleet_agent.config import AgentSettings, TokenFile, TokenFileError, read_token_file
from fleet_agent.daemon import Agent
from fleet_agent.fleet_client import FleetClient
from fleet_agent.telemetry.simulated import SimulatedTelemetry

OLD, NEW = "flt_old-token-0123456789abcdef", "flt_new-token-fedcba9876543210"


def write(path: Path, content: str, mode: int = 0o600) -> Path:
    """Like Ansible's copy: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(content)
    tmp.chmod(mode)
    tmp.replace(path)
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """A MockTransport fleet that records the bearer of every request."""

    def __init__(self) -> None:
        self.bearers: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bearers.append((request.url.path, request.headers["Authorization"]))
        return httpx.Response(200, json={"state": "serving", "heartbeat_interval_s": 5})


def agent_with(path: Path) -> tuple[Agent, Fleet, Clock]:
    settings = AgentSettings(server="gpu-1", token_file=path, telemetry="simulated")
    fleet, clock = Fleet(), Clock()
    client = FleetClient(
        "http://fleet.invalid", settings.bearer(), 1.0, transport=httpx.MockTransport(fleet)
    )
    telemetry = SimulatedTelemetry("H100", 2, clock=clock)
    return Agent(settings, telemetry, client, clock=clock, rng=random.Random(1)), fleet, clock


def test_a_rotated_token_is_used_from_the_next_request_without_a_restart(tmp_path: Path) -> None:
    token = write(tmp_path / "token", f"  {OLD}\r\n")  # surrounding whitespace stripped
    agent, fleet, clock = agent_with(token)
    agent.tick()  # registers
    clock.now += 5
    agent.tick()  # a heartbeat
    assert [b for _, b in fleet.bearers] == [f"Bearer {OLD}"] * 2
    assert fleet.bearers[0][0].endswith("/register")

    write(token, f"{NEW}\n")
    clock.now += 5
    agent.tick()
    assert fleet.bearers[-1] == (fleet.bearers[1][0], f"Bearer {NEW}")  # the same agent, no restart


def test_a_rewrite_in_place_is_noticed_too(tmp_path: Path) -> None:
    token = write(tmp_path / "token", OLD)
    source = TokenFile(token)
    assert source() == OLD
    token.write_text(NEW + "\n")  # same inode: size and mtime change
    assert source() == NEW


def test_an_unreadable_file_keeps_the_token_in_use_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = write(tmp_path / "token", OLD)
    source = TokenFile(token)
    caplog.set_level(logging.INFO, logger="fleet_agent")

    token.unlink()  # gone (between a rotation's steps, or removed by mistake)
    assert source() == OLD and source() == OLD
    token.mkdir()  # not a file at all
    assert source() == OLD
    token.rmdir()
    write(token, NEW, mode=0o644)  # a new token others can read: refused, the old one kept
    assert source() == OLD
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(token) in warnings[0], warnings

    write(token, NEW)
    assert source() == NEW
    write(token, "\n")  # empty: refused, warned once more (a new episode)
    assert source() == NEW
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "empty" in warnings[1], warnings
    assert not any(OLD in r.getMessage() or NEW in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o622])
def test_a_file_group_or_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    token = write(tmp_path / "token", OLD, mode=mode)
    with pytest.raises(TokenFileError) as refused:
        read_token_file(token)
    message = str(refused.value)
    assert str(token) in message and f"{mode:04o}" in message and "chmod 600" in message
    assert "\n" not in message and OLD not in message
    with pytest.raises(ValidationError) as invalid:
        AgentSettings(server="gpu-1", token_file=token)
    assert str(token) in str(invalid.value) and OLD not in str(invalid.value)


def test_a_file_that_is_not_one_token_is_refused(tmp_path: Path) -> None:
    for content, says in [("", "empty"), (" \n", "empty"), (f"{OLD}\n{NEW}", "more than one")]:
        token = write(tmp_path / "token", content)
        with pytest.raises(TokenFileError, match=says):
            read_token_file(token)
    with pytest.raises(ValidationError, match="No such file"):
        AgentSettings(server="gpu-1", token_file=tmp_path / "missing")


def test_exactly_one_of_the_token_and_the_token_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = write(tmp_path / "token", OLD)
    for name in ("FLEET_AGENT_TOKEN", "FLEET_AGENT_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValidationError, match="neither is set"):
        AgentSettings(server="gpu-1")
    with pytest.raises(ValidationError, match="both are set") as both:
        AgentSettings(server="gpu-1", token=SecretStr(NEW), token_file=token)
    assert NEW not in str(both.value) and OLD not in str(both.value)

    # From the environment, as systemd gives them (agent.env).
    monkeypatch.setenv("FLEET_AGENT_SERVER", "gpu-1")
    monkeypatch.setenv("FLEET_AGENT_TOKEN_FILE", str(token))
    assert AgentSettings().bearer()() == OLD
    monkeypatch.setenv("FLEET_AGENT_TOKEN", NEW)
    with pytest.raises(ValidationError, match="both are set"):
        AgentSettings()
    monkeypatch.delenv("FLEET_AGENT_TOKEN_FILE")
    assert AgentSettings().bearer()() == NEW  # FLEET_AGENT_TOKEN works as before
