"""The agent's local API locks what changes state or runs a model: /probe and /faults need the
agent's key (reads stay open for routers and Prometheus), fault injection is the simulated
backend's only, and a probe's work is bounded. A real LocalApi (uvicorn) on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from fleet.data import DEMO_INVENTORY
from fleet.lab import LabError
from fleet.lab.colo import VirtualColo
from fleet.lab.processes import ProcRef
from fleet.lab.state import inject_fault
from fleet_agent.config import AgentSettings
from fleet_agent.daemon import Agent
from fleet_agent.fleet_client import FleetClient
from fleet_agent.local_api import MAX_BODY_BYTES, LocalApi
from fleet_agent.telemetry.simulated import SimulatedTelemetry
from fleet_core.telemetry import GpuTelemetry, Snapshot

KEY = "local-api-key-of-the-test-0123456789"
XID_79 = {"kind": "xid", "xid": 79, "gpu": 1}


class RealGpus:
    """Stands for NVML: a backend that is not the simulated one (no fault injection)."""

    name = "nvml"

    def __init__(self) -> None:
        self.inner = SimulatedTelemetry("H100", 2, seed=3)

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def close(self) -> None:
        self.inner.close()


def make_agent(telemetry: GpuTelemetry, **settings: Any) -> Agent:
    values: dict[str, Any] = {"server": "gpu-1", "token": SecretStr("flt_x")} | settings
    fleet = httpx.MockTransport(lambda _: httpx.Response(503))  # never reached here
    client = FleetClient("http://fleet.invalid", "flt_x", 1.0, transport=fleet)
    return Agent(AgentSettings(**values), telemetry, client)


@contextmanager
def serve(agent: Agent) -> Iterator[str]:
    api = LocalApi(agent, "127.0.0.1", 0).start()
    try:
        agent.tick()  # one snapshot, so /readyz and /state have something to say
        for _ in range(200):  # uvicorn listens once its thread is up: bounded wait
            with suppress(httpx.ConnectError):
                httpx.get(f"{api.url}/healthz")
                break
            time.sleep(0.025)
        yield api.url
    finally:
        api.stop()


@pytest.fixture
def simulated() -> Iterator[tuple[Agent, str]]:
    agent = make_agent(SimulatedTelemetry("H100", 2, seed=1), api_key=SecretStr(KEY))
    with serve(agent) as url:
        yield agent, url


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_probe_and_faults_need_the_key_and_reads_stay_open(
    simulated: tuple[Agent, str],
) -> None:
    agent, url = simulated
    probe = {"prompt": "list five primes", "max_tokens": 8}
    for headers in ({}, bearer("wrong-key-of-the-same-kind-012345"), {"Authorization": KEY}):
        for path, body in (("/probe", probe), ("/faults", XID_79)):
            reply = httpx.post(f"{url}{path}", json=body, headers=headers)
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.headers["www-authenticate"] == "Bearer"
            assert KEY not in reply.text
    assert agent.telemetry.snapshot().xids == ()  # nothing was injected
    for path in ("/healthz", "/readyz", "/state", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code in (200, 503), path  # no key asked
    assert KEY not in httpx.get(f"{url}/state").text
    answered = httpx.post(f"{url}/probe", json=probe, headers=bearer(KEY))
    assert answered.status_code == 200 and answered.json()["answers"] == []  # no engines here
    injected = httpx.post(f"{url}/faults", json=XID_79, headers=bearer(KEY))
    assert injected.status_code == 200 and injected.json() == {"injected": 1}
    agent.tick()
    assert agent.assessment is not None and agent.assessment.verdict.value == "unhealthy"


def test_faults_are_refused_on_a_real_backend_even_with_the_key() -> None:
    agent = make_agent(RealGpus(), api_key=SecretStr(KEY))
    with serve(agent) as url:
        reply = httpx.post(f"{url}/faults", json=XID_79, headers=bearer(KEY))
        assert reply.status_code == 403 and "simulated" in reply.json()["detail"]
        assert httpx.post(f"{url}/faults", json=XID_79).status_code == 401  # key first
        # The probe is the fleet's on every backend.
        probe = {"prompt": "p", "max_tokens": 4}
        assert httpx.post(f"{url}/probe", json=probe, headers=bearer(KEY)).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "p", "max_tokens": 257}, "max_tokens"),
        ({"prompt": "p", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "p", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "p", "max_tokens": True}, "max_tokens"),
        ({"prompt": "p", "max_tokens": "16"}, "max_tokens"),
        ({"prompt": "x" * 2001}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        (["prompt"], "JSON object"),
    ],
)
def test_a_probe_out_of_bounds_is_422_naming_the_field(
    simulated: tuple[Agent, str], body: Any, field: str
) -> None:
    _, url = simulated
    reply = httpx.post(f"{url}/probe", json=body, headers=bearer(KEY))
    assert reply.status_code == 422 and field in reply.json()["detail"], reply.text


def test_oversized_or_malformed_bodies_are_refused(simulated: tuple[Agent, str]) -> None:
    _, url = simulated
    huge = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 1)})
    headers = bearer(KEY) | {"Content-Type": "application/json"}
    for path in ("/probe", "/faults"):
        assert httpx.post(f"{url}{path}", content=huge, headers=headers).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    streamed = httpx.post(f"{url}/probe", content=chunks(), headers=headers)
    assert streamed.status_code == 413
    bad = httpx.post(f"{url}/probe", content=b"{not json", headers=headers)
    assert bad.status_code == 422
    many = httpx.post(f"{url}/faults", json=[XID_79] * 65, headers=bearer(KEY))
    assert many.status_code == 422 and "at most 64" in many.json()["detail"]


def test_the_key_comes_from_the_settings_or_is_generated_and_goes_to_the_fleet() -> None:
    configured = make_agent(SimulatedTelemetry("H100", 1), api_key=SecretStr(KEY))
    assert configured.api_key == KEY
    assert configured.registration().to_wire()["agent_api_key"] == KEY
    one = make_agent(SimulatedTelemetry("H100", 1))
    two = make_agent(SimulatedTelemetry("H100", 1))
    assert len(one.api_key) >= 32 and one.api_key != two.api_key
    assert one.registration().to_wire()["agent_api_key"] == one.api_key
    with pytest.raises(ValueError, match="api_key"):
        AgentSettings(server="gpu-1", token=SecretStr("t"), api_key=SecretStr("short"))


def test_the_lab_injects_with_the_key_it_gave_the_agent(simulated: tuple[Agent, str]) -> None:
    _, url = simulated
    entry: dict[str, Any] = {"on": True, "booting": False, "agent": {"url": url, "key": KEY}}
    assert inject_fault("gpu-1", entry, XID_79) == {"injected": 1}
    keyless = {**entry, "agent": {"url": url}}
    with pytest.raises(LabError, match=r"refused the fault: .*key"):
        inject_fault("gpu-1", keyless, XID_79)


def test_the_lab_gives_each_agent_a_key_of_its_own_and_keeps_it(tmp_path: Path) -> None:
    inventory = (DEMO_INVENTORY).read_text()
    overriding = {"FLEET_AGENT_API_KEY": "someone-elses-key-0123456789"}
    colo = VirtualColo(
        inventory, tmp_path, token_for=lambda _: "t", agent_env=overriding, state_file=None
    )
    first, second = (colo._node(name) for name in colo.servers[:2])
    env = colo._agent_env(first, "t", 9410)
    assert env["FLEET_AGENT_API_KEY"] == first.api_key != second.api_key  # the lab's, always
    assert len(first.api_key) >= 32
    first.agent_url = "http://127.0.0.1:9410"
    first.agent_ref = ProcRef(pid=1, start=0)
    assert colo._server_state(first)["agent"]["key"] == first.api_key  # for `lab inject`


def test_the_lab_gives_each_agent_a_weights_cache_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inventory = (DEMO_INVENTORY).read_text()
    probe = VirtualColo(inventory, tmp_path, token_for=lambda _: "t", state_file=None)
    first, second = probe.servers[:2]
    monkeypatch.setenv("FLEET_AGENT_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("FLEET_AGENT_S3_SECRET_ACCESS_KEY", "lab-secret")
    monkeypatch.setenv("FLEET_DATABASE_URL", "postgresql://lab")  # the lab's own: not passed
    colo = VirtualColo(
        inventory, tmp_path, token_for=lambda _: "t", state_file=None, cache_bytes={first: 1 << 30}
    )
    env = colo._agent_env(colo._node(first), "t", 9410)
    assert env["FLEET_AGENT_CACHE_DIR"] == str(tmp_path.resolve() / "servers" / first / "weights")
    assert env["FLEET_AGENT_CACHE_DIR"] == str(colo.cache_dir(first))
    assert env["FLEET_AGENT_CACHE_BYTES"] == str(1 << 30)
    assert env["FLEET_AGENT_S3_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert env["FLEET_AGENT_S3_SECRET_ACCESS_KEY"] == "lab-secret"
    assert "FLEET_DATABASE_URL" not in env
    other = colo._agent_env(colo._node(second), "t", 9411)
    assert other["FLEET_AGENT_CACHE_BYTES"] == str(4 << 30)  # the lab's default
    assert other["FLEET_AGENT_CACHE_DIR"].endswith(f"/servers/{second}/weights")
    one = VirtualColo(inventory, tmp_path, token_for=lambda _: "t", state_file=None, cache_bytes=7)
    assert one._agent_env(one._node(second), "t", 1)["FLEET_AGENT_CACHE_BYTES"] == "7"
    with pytest.raises(ValueError, match="cache_bytes names servers not in the inventory"):
        VirtualColo(inventory, tmp_path, token_for=lambda _: "t", cache_bytes={"nope": 1})
