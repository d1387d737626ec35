"""TLS end to end, with a CA made by the test: `fleetctl serve`, an agent's local API that
requires client certificates, and `fleetctl router run`, all on https.

Clients with the test's CA get through (fleetctl --ca-bundle lists racks, the agent registers
and heartbeats, the router reads the fleet's routing table and an agent's /state, the fleet's
probe client presents its certificate to the agent); a client with another CA is refused
(certificate verify failed), and one without a client certificate is refused by the agent.
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import SecretStr
from typer.testing import CliRunner

from fleet import cli
from fleet.auth import create_token
from fleet.data import DEMO_INVENTORY
from fleet.db import make_engine, session_scope
from fleet.lab.harness import Child, child_env, free_port, wait_for
from fleet.models import Role
from fleet.provisioning.quality_probe import ask_agent_http, http_asker
from fleet.router.config import RouterSettings
from fleet.router.discovery import WorkerView, client_tls
from fleet.settings import Settings, get_settings
from fleet.tls import client_context
from fleet_agent.config import AgentSettings
from fleet_agent.fleet_client import FleetClient, FleetUnreachable
from fleet_agent.main import run as run_agent
from fleet_core.fault_policy import Verdict
from fleet_core.wire import Heartbeat

DEMO = DEMO_INVENTORY
SERVER = "fra1-r01-h100-01"
AGENT_KEY = "the-agents-local-api-key-for-tls-0123"
START_S = 60.0  # a child process answering, at most (two shared cores)
VERIFY_FAILED = "CERTIFICATE_VERIFY_FAILED"


# ---------------------------------------------------------------------------------------------
# A CA of the test's own, and another one that signed nothing here


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # 127.0.0.1 / localhost: the service, the agent and the router serve with it
    key: Path
    client_cert: Path  # the fleet's and the router's client certificate
    client_key: Path
    other_ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, common_name: str, *, server: bool
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    purpose = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if server:
        names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return path


def make_pki(where: Path) -> Pki:
    ca_key, ca = _ca("fleet test CA")
    _, other = _ca("some other CA")
    server_key, server = _leaf(ca_key, ca, "127.0.0.1", server=True)
    client_key, client = _leaf(ca_key, ca, "fleet-client", server=False)
    cert = _write(where / "server.pem", server, server_key)
    client_cert = _write(where / "client.pem", client, client_key)
    return Pki(
        ca=_write(where / "ca.pem", ca, None),
        cert=cert,
        key=cert.with_suffix(".key"),
        client_cert=client_cert,
        client_key=client_cert.with_suffix(".key"),
        other_ca=_write(where / "other-ca.pem", other, None),
    )


# ---------------------------------------------------------------------------------------------
# The world: the service and the router as child processes, the agent in a thread


@dataclass
class World:
    pki: Pki
    fleet_url: str
    service_log: Path
    admin: str
    agent_url: str
    router_url: str
    router_token: str

    def trusting(self, **kwargs: Any) -> httpx.Client:
        """A client that trusts the test's CA (and presents `cert` if given)."""
        return httpx.Client(verify=client_context(self.pki.ca, **kwargs), timeout=10.0)


def _healthy(url: str, verify: Any, path: str = "/readyz") -> bool:
    return httpx.get(f"{url}{path}", verify=verify, timeout=2.0).status_code == 200


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("tls")
    pki = make_pki(base)
    data_dir = base / "fleet"
    env = child_env(
        {
            "FLEET_DATA_DIR": str(data_dir),
            "FLEET_RUN_LOOPS": "false",
            "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
            "FLEET_TLS_CERT": str(pki.cert),
            "FLEET_TLS_KEY": str(pki.key),
        }
    )
    port = free_port()
    fleet_url = f"https://127.0.0.1:{port}"
    trust = client_context(pki.ca)
    children: list[Child] = []
    stop_agent = threading.Event()
    agent: threading.Thread | None = None
    try:
        service = Child("serve", base / "serve.log")
        children.append(service)
        service.launch(["serve", "--port", str(port), "--import", str(DEMO)], env)
        wait_for("the service on https", lambda: _healthy(fleet_url, trust), START_S)
        engine = make_engine(f"sqlite:///{data_dir / 'fleet.db'}")
        with session_scope(engine) as session:
            admin = create_token(session, "tls-admin", Role.ADMIN, actor="tests")
            agent_token = create_token(session, "tls-agent", Role.AGENT, SERVER, actor="tests")
            router_token = create_token(session, "tls-router", Role.ROUTER, actor="tests")
        engine.dispose()

        # The agent: https for its own API, client certificates required, the fleet verified.
        agent_port = free_port()
        settings = AgentSettings(
            server=SERVER,
            token=SecretStr(agent_token),
            api_key=SecretStr(AGENT_KEY),
            fleet_url=fleet_url,
            ca_bundle=pki.ca,
            listen_port=agent_port,
            tls_cert=pki.cert,
            tls_key=pki.key,
            tls_client_ca=pki.ca,
            telemetry="simulated",
            heartbeat_interval_s=0.5,
            backoff_initial_s=0.2,
            backoff_max_s=1.0,
            request_timeout_s=5.0,
            work_dir=base / "agent",
        )
        agent = threading.Thread(target=run_agent, args=(settings, stop_agent), daemon=True)
        agent.start()
        agent_url = f"https://127.0.0.1:{agent_port}"
        mtls = client_context(pki.ca, pki.client_cert, pki.client_key)
        wait_for("the agent on https", lambda: _healthy(agent_url, mtls, "/healthz"), START_S)

        # The router: https, the fleet and agents verified with the test's CA.
        router_port = free_port()
        router_env = env | {
            "FLEET_ROUTER_TOKEN": router_token,
            "FLEET_ROUTER_TLS_CLIENT_CERT": str(pki.client_cert),
            "FLEET_ROUTER_TLS_CLIENT_KEY": str(pki.client_key),
        }
        router_args = [
            "router",
            "run",
            "--port",
            str(router_port),
            "--fleet-url",
            fleet_url,
            "--tls-cert",
            str(pki.cert),
            "--tls-key",
            str(pki.key),
            "--ca-bundle",
            str(pki.ca),
        ]
        router = Child("router", base / "router.log")
        children.append(router)
        router.launch(router_args, router_env)
        router_url = f"https://127.0.0.1:{router_port}"
        yield World(
            pki=pki,
            fleet_url=fleet_url,
            service_log=base / "serve.log",
            admin=admin,
            agent_url=agent_url,
            router_url=router_url,
            router_token=router_token,
        )
    finally:
        stop_agent.set()
        if agent is not None:
            agent.join(timeout=10)
        for child in reversed(children):
            child.stop()


def fleetctl(world: World, *args: str, **env: str) -> Any:
    env = {"FLEET_URL": world.fleet_url, "FLEET_TOKEN": world.admin} | env
    return CliRunner().invoke(cli.app, list(args), env=env)


# ---------------------------------------------------------------------------------------------
# The service


def test_fleetctl_verifies_the_service_against_its_ca_bundle(world: World) -> None:
    lines = world.service_log.read_text().splitlines()
    assert any(f"serving at {world.fleet_url}" in line for line in lines), lines

    listed = fleetctl(world, "--ca-bundle", str(world.pki.ca), "racks")
    assert listed.exit_code == 0, listed.stderr
    assert "fra1-r01" in listed.stdout
    from_env = fleetctl(world, "racks", FLEET_CA_BUNDLE=str(world.pki.ca))
    assert from_env.exit_code == 0, from_env.stderr

    # Another CA, or the system's CAs: refused, one line naming what to fix.
    for args, env in (
        (["--ca-bundle", str(world.pki.other_ca), "racks"], {}),
        (["racks"], {"FLEET_CA_BUNDLE": str(world.pki.other_ca)}),
        (["racks"], {}),
    ):
        refused = fleetctl(world, *args, **env)
        assert refused.exit_code == 1, refused.stdout
        [line] = refused.stderr.splitlines()
        assert "TLS certificate verify failed" in line and "--ca-bundle" in line, line

    # Plain http to the https port gets nowhere.
    with pytest.raises(httpx.HTTPError):
        httpx.get(world.fleet_url.replace("https", "http") + "/healthz", timeout=5.0)


def test_the_consoles_session_cookie_is_secure_over_tls(world: World) -> None:
    """Signed in over https, the console's cookie is `Secure` (a browser never sends it over
    plain http), as well as HttpOnly and SameSite=Strict; the sign-in form's cookie too."""
    import re

    tls = client_context(world.pki.ca)
    with httpx.Client(base_url=world.fleet_url, verify=tls, timeout=10.0) as browser:
        form = browser.get("/ui/login")
        [form_cookie] = form.headers.get_list("set-cookie")
        assert "Secure" in form_cookie, form_cookie
        match = re.search(r'name="csrf" value="([^"]+)"', form.text)
        assert match is not None
        signed = browser.post("/ui/login", data={"token": world.admin, "csrf": match[1]})
        assert signed.status_code == 303, signed.text
        [session] = [
            c for c in signed.headers.get_list("set-cookie") if c.startswith("fleet_console=")
        ]
        assert "Secure" in session and "HttpOnly" in session and "SameSite=strict" in session
        assert browser.get("/ui/racks").status_code == 200


# ---------------------------------------------------------------------------------------------
# The agent


def test_the_agent_registers_over_tls_and_requires_client_certificates(world: World) -> None:
    with world.trusting() as fleet:

        def registered() -> dict[str, Any] | None:
            row: dict[str, Any] = fleet.get(
                f"{world.fleet_url}/api/v1/servers/{SERVER}",
                headers={"Authorization": f"Bearer {world.admin}"},
            ).json()
            return row if row.get("agent_url") == world.agent_url else None

        # The agent verified the fleet with its CA bundle and told it its https URL.
        wait_for("the agent's registration over https", registered, START_S)

    cert = {"cert": world.pki.client_cert, "key": world.pki.client_key}
    with world.trusting(**cert) as client:
        state = client.get(f"{world.agent_url}/state").json()
    assert state["registered"] is True

    # No client certificate: the agent ends the connection before any answer (under TLS 1.3
    # the client learns it as an alert or a closed connection, whichever it reads first).
    with world.trusting() as client, pytest.raises(httpx.TransportError):
        client.get(f"{world.agent_url}/state")
    # A client certificate, but the agent's own certificate from a CA the client does not trust.
    other = client_context(world.pki.other_ca, world.pki.client_cert, world.pki.client_key)
    with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
        httpx.get(f"{world.agent_url}/state", verify=other)

    # And an agent given the wrong CA for the fleet refuses to talk to it.
    client_ = FleetClient(world.fleet_url, "flt_x", 5.0, ca_bundle=world.pki.other_ca)
    with pytest.raises(FleetUnreachable, match=VERIFY_FAILED):
        client_.heartbeat(Heartbeat(server="gpu-1", verdict=Verdict.HEALTHY))
    client_.close()


def test_the_fleets_probe_presents_its_client_certificate(world: World) -> None:
    """fleet/provisioning/quality_probe.py's client, configured as `fleetctl serve` would be."""
    settings = Settings(
        tls_ca_bundle=world.pki.ca,
        tls_client_cert=world.pki.client_cert,
        tls_client_key=world.pki.client_key,
    )
    body = {"prompt": "hello", "max_tokens": 4}
    answer = http_asker(settings)(world.agent_url, body, AGENT_KEY)
    assert answer["answers"] == []  # no engine is ready: nothing to compare, but it got through

    # The same without the fleet's client certificate, or with the system's CAs: refused.
    with pytest.raises(httpx.TransportError):
        ask_agent_http(world.agent_url, body, AGENT_KEY, tls=client_context(world.pki.ca))
    with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
        http_asker(Settings())(world.agent_url, body, AGENT_KEY)


# ---------------------------------------------------------------------------------------------
# The router


def test_the_router_serves_tls_and_reads_the_fleet_and_agents_over_tls(world: World) -> None:
    trust = client_context(world.pki.ca)
    # Ready means it has read the fleet's routing table: over https, verified with its bundle.
    wait_for("the router's first table read", lambda: _healthy(world.router_url, trust), START_S)
    with world.trusting() as client:
        models = client.get(f"{world.router_url}/v1/models").json()
    assert models["object"] == "list"
    with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
        httpx.get(f"{world.router_url}/healthz", verify=client_context(world.pki.other_ca))

    # The router's own worker view (its client context, its polls) on an agent's /state.
    def misses(settings: RouterSettings) -> int:
        async def poll() -> int:
            connector = aiohttp.TCPConnector(ssl=client_tls(settings))
            async with aiohttp.ClientSession(connector=connector) as http:
                view = WorkerView(settings, http)
                await view.poll_fleet()
                assert view.table_ok
                replica = {"url": "http://127.0.0.1:9/r0", "agent_url": world.agent_url}
                view.apply_table([{"deployment": "tls", "replicas": [replica]}])
                await view._poll_agent(world.agent_url)  # one poll, awaited to its end
                return view.agent_misses[world.agent_url]

        return asyncio.run(poll())

    base: dict[str, Any] = {
        "fleet_url": world.fleet_url,
        "token": SecretStr(world.router_token),
        "ca_bundle": world.pki.ca,
        "agent_timeout_s": 10.0,
    }
    with_cert = RouterSettings(
        **base, tls_client_cert=world.pki.client_cert, tls_client_key=world.pki.client_key
    )
    assert misses(with_cert) == 0
    assert misses(RouterSettings(**base)) == 1  # no client certificate: the agent refuses it


# ---------------------------------------------------------------------------------------------
# Refusals before anything listens


def test_serve_refuses_tls_files_that_do_not_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = make_pki(tmp_path)
    cases = [
        (["--tls-cert", str(pki.cert)], {}, "--tls-cert and --tls-key go together"),
        # The server's certificate with the client's key: not a pair.
        (["--tls-cert", str(pki.cert), "--tls-key", str(pki.client_key)], {}, "cannot load"),
        # The fleet's client certificate for agents is checked at start too.
        ([], {"FLEET_TLS_CLIENT_CERT": str(pki.cert), "FLEET_TLS_CLIENT_KEY": str(pki.ca)}, "TLS"),
    ]
    for args, env, needle in cases:
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            get_settings.cache_clear()
            try:
                done = CliRunner().invoke(cli.app, ["serve", "--port", "1", *args])
            finally:
                get_settings.cache_clear()
        assert done.exit_code == 1, done.stdout
        assert done.stdout == "" and needle in done.stderr, done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith("error: "), line
