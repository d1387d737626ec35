"""The Redfish driver against a real Redfish peer: sushy-tools' emulator (fleet.lab.sushy), plus
tiny in-test HTTP servers for what the emulator cannot do (503s, a BMC that never answers,
restricted ResetTypes, sessions).

The emulator applies a Reset 1-11 s late, so tests that need the outcome poll `power_state()`
(which also makes the emulator apply a change whose time has come), bounded at 15 s. Each test
takes fresh systems from the module's emulator, so no state leaks between tests.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fake_bmcs import SESSIONS, FakeRedfish, StalledBmc

from fleet.bmc import driver_for
from fleet.bmc.base import (
    BmcAuthFailed,
    BmcError,
    BmcProtocolError,
    BmcRefused,
    BmcTarget,
    BmcTransient,
    BmcUnreachable,
    BmcUnsupported,
    Timeouts,
)
from fleet.bmc.redfish import RedfishDriver, base_url, ca_file
from fleet.lab.harness import free_port
from fleet.lab.sushy import FakeSystem, SushyEmulator, fake_systems
from fleet.models import BmcProtocol, PowerState

FAST = Timeouts(call=2.0, total=5.0, attempts=3, backoff=0.05)
SETTLE_S = 15.0  # the emulator applies a Reset 1-11 s late
USER, PASSWORD = "admin", "s3cret-pw"
OFF_SYSTEMS, ON_SYSTEMS = 30, 10


def target(
    port: int,
    system_id: str | None = None,
    *,
    address: str = "http://127.0.0.1",
    server: str = "gpu-test-01",
    password: str = PASSWORD,
    timeouts: Timeouts = FAST,
    plain_http: bool | None = None,
    **kwargs: Any,
) -> BmcTarget:
    # The emulator and the fakes speak plain HTTP: opted in, as the lab's inventory does.
    if plain_http is None:
        plain_http = address.startswith("http://")
    return BmcTarget(
        server=server,
        protocol=BmcProtocol.REDFISH,
        address=address,
        port=port,
        username=USER,
        password=password,
        system_id=system_id,
        timeouts=timeouts,
        plain_http=plain_http,
        **kwargs,
    )


def assert_one_line(exc: BmcError, t: BmcTarget) -> None:
    text = str(exc)
    assert "\n" not in text, text
    assert t.server in text, text
    assert f"{t.address}:{t.port}" in text, text
    assert t.password not in text


# ---------------------------------------------------------------------------------------------
# The emulator, and fresh systems from it


@dataclass
class Pool:
    emulator: SushyEmulator
    free: dict[str, list[FakeSystem]]

    def take(self, power_state: str = "Off") -> FakeSystem:
        if not self.free[power_state]:
            raise RuntimeError(f"the module emulator has no fresh {power_state} system left")
        return self.free[power_state].pop(0)

    def driver(self, system: FakeSystem, **kwargs: Any) -> RedfishDriver:
        return RedfishDriver(target(self.emulator.port, system.uuid, **kwargs))


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    off = fake_systems(OFF_SYSTEMS, prefix="off", power_state="Off")
    on = fake_systems(ON_SYSTEMS, prefix="on", power_state="On")
    with SushyEmulator(off + on, username=USER, password=PASSWORD) as emulator:
        yield Pool(emulator, {"Off": list(off), "On": list(on)})
    assert not emulator.running()


@pytest.fixture
def drivers() -> Iterator[list[RedfishDriver]]:
    """Drivers a test creates; closed afterwards."""
    made: list[RedfishDriver] = []
    yield made
    for d in made:
        d.close()


def wait_for_states(states: dict[str, tuple[RedfishDriver, PowerState]]) -> dict[str, PowerState]:
    """Poll each driver until it reports its wanted state (bounded); the last states seen."""
    seen = {name: PowerState.UNKNOWN for name in states}
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        for name, (d, want) in states.items():
            if seen[name] is not want:
                seen[name] = d.power_state()
        if all(seen[name] is want for name, (_, want) in states.items()):
            break
        time.sleep(0.2)
    return seen


# ---------------------------------------------------------------------------------------------
# Power against the emulator


def test_power_actions_reach_the_emulator_and_read_back(
    pool: Pool, drivers: list[RedfishDriver]
) -> None:
    emu = pool.emulator
    systems = {
        "on": pool.take("Off"),
        "off": pool.take("On"),
        "force_off": pool.take("On"),
        "cycle_on": pool.take("On"),
        "cycle_off": pool.take("Off"),
    }
    behind = pool.take("Off")  # changed by "an operator with another tool", not by Fleet
    d = {name: pool.driver(s) for name, s in [*systems.items(), ("behind", behind)]}
    drivers.extend(d.values())
    assert d["behind"].power_state() is PowerState.OFF
    emu.set_power_behind_our_back(behind.uuid, PowerState.ON)

    results = {
        "on": d["on"].power_on(),
        "off": d["off"].power_off(),
        "force_off": d["force_off"].power_off(force=True),
        "cycle_on": d["cycle_on"].power_cycle(),
        "cycle_off": d["cycle_off"].power_cycle(),
    }
    before = {"on": "off", "off": "on", "force_off": "on", "cycle_on": "on", "cycle_off": "off"}
    for name, result in results.items():
        assert result.sent, name
        assert result.state_before.value == before[name], name
        assert result.action == ("force_off" if name == "force_off" else name.split("_")[0])
    # Read back once, right away: the emulator may not have applied it yet.
    assert results["on"].state_after in (PowerState.OFF, PowerState.ON)
    assert results["cycle_on"].state_after in (PowerState.OFF, PowerState.ON)

    want = {
        "on": PowerState.ON,
        "off": PowerState.OFF,
        "force_off": PowerState.OFF,
        "cycle_on": PowerState.ON,
        "cycle_off": PowerState.ON,
        "behind": PowerState.ON,
    }
    seen = wait_for_states({name: (d[name], want[name]) for name in d})
    assert seen == want
    for name, system in systems.items():
        assert emu.read_power_state(system.uuid) == want[name].value.capitalize()
        assert len(emu.resets(system.uuid)) == 1, name  # exactly one Reset each, never re-sent


def test_asking_for_the_current_state_sends_no_reset(
    pool: Pool, drivers: list[RedfishDriver]
) -> None:
    emu = pool.emulator
    on, off = pool.take("On"), pool.take("Off")
    d_on, d_off = pool.driver(on), pool.driver(off)
    drivers.extend([d_on, d_off])

    result = d_on.power_on()
    assert (result.sent, result.state_before, result.state_after) == (
        False,
        PowerState.ON,
        PowerState.ON,
    )
    for result in (d_off.power_off(), d_off.power_off(force=True)):
        assert (result.sent, result.state_before) == (False, PowerState.OFF)
    assert emu.resets(on.uuid) == [] and emu.resets(off.uuid) == []

    # The log does show a Reset when one is sent (so the empty lists above mean something).
    assert d_on.power_off(force=True).sent
    assert [r.status for r in emu.resets(on.uuid)] == [204]


def test_systems_addressed_by_id_and_by_name_on_one_emulator(
    pool: Pool, drivers: list[RedfishDriver]
) -> None:
    on, off = pool.take("On"), pool.take("Off")
    by_id = pool.driver(on)
    by_name = RedfishDriver(target(pool.emulator.port, off.name))  # the emulator redirects
    drivers.extend([by_id, by_name])
    assert by_id.power_state() is PowerState.ON
    assert by_name.power_state() is PowerState.OFF


def test_several_systems_and_no_system_id_is_a_clear_error(pool: Pool) -> None:
    t = target(pool.emulator.port)
    with RedfishDriver(t) as d, pytest.raises(BmcProtocolError) as err:
        d.power_state()
    assert f"has {OFF_SYSTEMS + ON_SYSTEMS} systems" in str(err.value)
    assert "system_id" in str(err.value)
    assert_one_line(err.value, t)


def test_unknown_system_id(pool: Pool) -> None:
    t = target(pool.emulator.port, "no-such-system")
    with RedfishDriver(t) as d, pytest.raises(BmcProtocolError) as err:
        d.power_on()
    assert "not found" in str(err.value) and "system_id" in str(err.value)
    assert_one_line(err.value, t)


def test_identify_info_and_sensors(pool: Pool, drivers: list[RedfishDriver]) -> None:
    system = pool.take("On")
    d = pool.driver(system)
    drivers.append(d)

    def led() -> Any:
        with pool.emulator._open("GET", f"/redfish/v1/Systems/{system.uuid}") as resp:
            return json.loads(resp.read())["IndicatorLED"]

    d.identify(False)
    assert led() == "Off"
    d.identify(True)
    assert led() == "Lit"

    info = d.info()
    assert info.manufacturer == "Sushy Emulator"
    assert info.firmware == "1.00"  # no BiosVersion: the managing BMC's FirmwareVersion
    assert info.model is None and info.serial is None

    sensors = d.sensors()
    assert sensors.temperatures_c["Chassis Intake Temp"] == 25.0
    assert sensors.temperatures_c["CPU Temp (0)"] == 41.0
    assert sensors.power_w is None  # no watts set for it: its chassis has no Power resource


def chassis_of(pool: Pool, system: FakeSystem) -> Any:
    with pool.emulator._open("GET", f"/redfish/v1/Chassis/{system.uuid}") as resp:
        return json.loads(resp.read())


def test_the_lab_power_extension_serves_the_watts_it_was_given(
    pool: Pool, drivers: list[RedfishDriver]
) -> None:
    """fleet.lab.sushy_power: a chassis per system, whose Power resource serves the lab's
    figure; the driver reads it as it would a real BMC's PowerControl."""
    system, other = pool.take("On"), pool.take("Off")
    d, d_other = pool.driver(system), pool.driver(other)
    drivers += [d, d_other]
    assert "Power" not in chassis_of(pool, system)  # nothing set: no Power resource

    pool.emulator.set_power_watts(system.uuid, 6_512.5)
    assert d.sensors().power_w == 6_512.5
    assert d_other.sensors().power_w is None  # per system, not per emulator
    chassis = chassis_of(pool, system)
    assert chassis["Power"] == {"@odata.id": f"/redfish/v1/Chassis/{system.uuid}/Power"}
    assert chassis["Links"]["ComputerSystems"] == [
        {"@odata.id": f"/redfish/v1/Systems/{system.uuid}"}
    ]
    # The temperatures still come from sushy's own (static) Thermal resource.
    assert d.sensors().temperatures_c["Chassis Intake Temp"] == 25.0

    pool.emulator.set_power_watts(system.uuid, 900)  # a change shows on the next read
    assert d.sensors().power_w == 900.0
    pool.emulator.set_power_watts(system.uuid, -40.0)  # nonsense is served as given
    assert d.sensors().power_w == -40.0
    pool.emulator.set_power_watts(system.uuid, None)
    assert d.sensors().power_w is None
    assert "Power" not in chassis_of(pool, system)
    power = f"/redfish/v1/Chassis/{system.uuid}/Power"
    assert [r.status for r in pool.emulator.requests() if r.path == power][-1] == 404
    with pytest.raises(ValueError, match="no system"):
        pool.emulator.set_power_watts("not-a-system", 1.0)


def test_driver_for_picks_redfish(pool: Pool) -> None:
    d = driver_for(target(pool.emulator.port, pool.take("On").uuid))
    try:
        assert isinstance(d, RedfishDriver)
        assert d.power_state() is PowerState.ON
    finally:
        d.close()


# ---------------------------------------------------------------------------------------------
# Faults: credentials, a BMC that is down, a BMC that never answers


def test_wrong_password_fails_fast(pool: Pool) -> None:
    t = target(pool.emulator.port, pool.take("Off").uuid, password="wrong-password")
    started = time.monotonic()
    with RedfishDriver(t) as d, pytest.raises(BmcAuthFailed) as err:
        d.power_on()
    assert time.monotonic() - started < t.timeouts.call
    assert USER in str(err.value) and "credentials" in str(err.value)
    assert_one_line(err.value, t)


def test_bmc_down_is_unreachable_within_the_call_timeout() -> None:
    t = target(free_port(), "1")  # nothing listens there
    started = time.monotonic()
    with RedfishDriver(t) as d, pytest.raises(BmcUnreachable) as err:
        d.power_state()
    assert time.monotonic() - started < t.timeouts.call
    assert "connection refused" in str(err.value)
    assert_one_line(err.value, t)


@pytest.fixture
def stalled() -> Iterator[StalledBmc]:
    server = StalledBmc()
    yield server
    server.close()


def test_bmc_that_never_answers_times_out(stalled: StalledBmc) -> None:
    t = target(stalled.port, "1")
    started = time.monotonic()
    with RedfishDriver(t) as d, pytest.raises(BmcUnreachable) as err:
        d.power_on()
    elapsed = time.monotonic() - started
    assert t.timeouts.call * 0.9 <= elapsed < t.timeouts.call + 2.5
    assert "no answer" in str(err.value)
    assert_one_line(err.value, t)
    assert len(stalled.connections) == 1  # the library did not retry


def test_stalled_bmc_does_not_hold_up_healthy_ones(
    pool: Pool, stalled: StalledBmc, drivers: list[RedfishDriver]
) -> None:
    timeouts = replace(FAST, call=3.0)
    healthy = [pool.driver(pool.take("Off"), timeouts=timeouts) for _ in range(20)]
    hung = RedfishDriver(target(stalled.port, "1", server="gpu-hung", timeouts=timeouts))
    drivers.extend([*healthy, hung])

    def timed(call: Callable[[], Any]) -> tuple[float, Any]:
        try:
            outcome: Any = call()
        except BmcError as exc:
            outcome = exc
        return time.monotonic(), outcome

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(healthy) + 1) as executor:
        hung_future = executor.submit(timed, hung.power_on)
        futures = [executor.submit(timed, d.power_on) for d in healthy]
        hung_done, hung_outcome = hung_future.result(timeout=timeouts.call + 10)
        done = [f.result(timeout=timeouts.call + 10) for f in futures]

    stalled_deadline = started + timeouts.call
    assert isinstance(hung_outcome, BmcUnreachable)
    assert hung_done < stalled_deadline + 1.5
    for finished, outcome in done:
        assert not isinstance(outcome, BaseException), outcome
        assert outcome.sent and outcome.state_before is PowerState.OFF
        assert finished < stalled_deadline  # done while the hung BMC was still being waited on
        assert finished < hung_done


# ---------------------------------------------------------------------------------------------
# A small fake Redfish service, for what the emulator cannot do


ALL_RESETS = ["On", "ForceOff", "GracefulShutdown", "ForceRestart", "PowerCycle", "ForceOn"]
SYSTEM = "/redfish/v1/Systems/1"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"


@pytest.fixture
def fake_bmc() -> Iterator[Callable[..., tuple[FakeRedfish, int]]]:
    """Start fake Redfish services: `fake_bmc(**knobs)` -> (fake, port). One system, "1", that
    reports `power_state` and keeps it whatever is reset; every ResetType advertised."""
    started: list[FakeRedfish] = []

    def start(power_state: str | None = "On", **knobs: Any) -> tuple[FakeRedfish, int]:
        knobs = {"allowed": list(ALL_RESETS), "resets_apply": False, **knobs}
        fake = FakeRedfish({"1": power_state}, USER, PASSWORD, **knobs)
        started.append(fake)
        return fake, fake.start()

    yield start
    for fake in started:
        fake.close()


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_are_retried_then_transient(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]], status: int
) -> None:
    fake, port = fake_bmc(system_status=status)
    t = target(port, "1")
    with RedfishDriver(t) as d, pytest.raises(BmcTransient) as err:
        d.power_on()
    assert fake.count("GET", SYSTEM) == t.timeouts.attempts
    assert fake.count("POST", RESET) == 0
    assert f"HTTP {status}" in str(err.value) and err.value.retryable
    assert_one_line(err.value, t)


def test_retries_stop_at_the_total_time(fake_bmc: Callable[..., tuple[FakeRedfish, int]]) -> None:
    fake, port = fake_bmc(system_status=503)
    t = target(port, "1", timeouts=Timeouts(call=2.0, total=1.0, attempts=50, backoff=0.2))
    started = time.monotonic()
    with RedfishDriver(t) as d, pytest.raises(BmcTransient):
        d.power_state()
    assert time.monotonic() - started < t.timeouts.total + 2.5
    assert 1 <= fake.count("GET", SYSTEM) < 50


def test_reset_type_not_advertised_is_unsupported_and_nothing_is_sent(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]],
) -> None:
    fake, port = fake_bmc(allowed=["On"], power_state="On")
    t = target(port, "1")
    with RedfishDriver(t) as d:
        calls: list[Callable[[], Any]] = [
            d.power_off,
            lambda: d.power_off(force=True),
            d.power_cycle,
        ]
        for call in calls:
            with pytest.raises(BmcUnsupported) as err:
                call()
            assert "advertises only On" in str(err.value)
            assert_one_line(err.value, t)
        assert fake.count("POST", RESET) == 0

        fake.systems["1"] = "Off"
        assert d.power_on().sent
    assert [s.body for s in fake.requests_to("POST", RESET)] == [{"ResetType": "On"}]


def test_reset_types_from_action_info(fake_bmc: Callable[..., tuple[FakeRedfish, int]]) -> None:
    fake, port = fake_bmc(allowed=None, action_info=["On", "ForceOff"], power_state="On")
    with RedfishDriver(target(port, "1")) as d:
        with pytest.raises(BmcUnsupported) as err:
            d.power_off()
        assert "GracefulShutdown" in str(err.value) and "ForceOff" in str(err.value)
        assert d.power_off(force=True).sent
    assert [s.body for s in fake.requests_to("POST", RESET)] == [{"ResetType": "ForceOff"}]


@pytest.mark.parametrize(
    ("state", "allowed", "action", "sent"),
    [
        ("On", ALL_RESETS, "off", "GracefulShutdown"),
        ("On", ALL_RESETS, "force_off", "ForceOff"),
        ("On", ALL_RESETS, "cycle", "ForceRestart"),
        ("On", ["On", "PowerCycle"], "cycle", "PowerCycle"),
        ("Off", ALL_RESETS, "cycle", "On"),
        ("Off", ["ForceOn", "ForceOff"], "on", "ForceOn"),
        ("PoweringOff", ALL_RESETS, "on", "On"),
        ("Off", None, "on", "On"),  # nothing advertised: the first preference
    ],
)
def test_reset_type_choice(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]],
    state: str,
    allowed: list[str] | None,
    action: str,
    sent: str,
) -> None:
    fake, port = fake_bmc(power_state=state, allowed=allowed)
    with RedfishDriver(target(port, "1")) as d:
        calls: dict[str, Callable[[], Any]] = {
            "on": d.power_on,
            "off": d.power_off,
            "force_off": lambda: d.power_off(force=True),
            "cycle": d.power_cycle,
        }
        result = calls[action]()
    assert result.sent and result.action == action
    assert [s.body for s in fake.requests_to("POST", RESET)] == [{"ResetType": sent}]


@pytest.mark.parametrize(
    ("reported", "mapped"),
    [
        ("On", PowerState.ON),
        ("Off", PowerState.OFF),
        ("PoweringOn", PowerState.ON),
        ("PoweringOff", PowerState.OFF),
        ("Paused", PowerState.ON),
        ("Bogus", PowerState.UNKNOWN),
        (None, PowerState.UNKNOWN),
    ],
)
def test_power_state_mapping(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]], reported: str | None, mapped: PowerState
) -> None:
    _, port = fake_bmc(power_state=reported)
    with RedfishDriver(target(port, "1")) as d:
        assert d.power_state() is mapped


def test_powering_on_counts_as_on(fake_bmc: Callable[..., tuple[FakeRedfish, int]]) -> None:
    fake, port = fake_bmc(power_state="PoweringOn")
    with RedfishDriver(target(port, "1")) as d:
        assert not d.power_on().sent
    assert fake.count("POST", RESET) == 0


@pytest.mark.parametrize(
    ("status", "error"), [(501, BmcUnsupported), (503, BmcTransient), (400, BmcProtocolError)]
)
def test_a_refused_reset_is_sent_once(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]], status: int, error: type[BmcError]
) -> None:
    fake, port = fake_bmc(power_state="Off", reset_status=status)
    t = target(port, "1")
    with RedfishDriver(t) as d, pytest.raises(error) as err:
        d.power_on()
    assert fake.count("POST", RESET) == 1  # never re-sent, not even a 503
    assert_one_line(err.value, t)


def test_a_reset_without_answer_is_not_resent(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]],
) -> None:
    fake, port = fake_bmc(power_state="Off", reset_stall_s=5.0)
    t = target(port, "1", timeouts=replace(FAST, call=1.0))
    started = time.monotonic()
    with RedfishDriver(t) as d, pytest.raises(BmcUnreachable) as err:
        d.power_on()
    assert time.monotonic() - started < t.timeouts.call + 2.5
    assert "may still be applied" in str(err.value)
    assert_one_line(err.value, t)
    fake.release.set()
    assert fake.count("POST", RESET) == 1


def test_single_system_found_without_system_id(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]],
) -> None:
    _, port = fake_bmc(power_state="Off")
    with RedfishDriver(target(port)) as d:
        assert d.power_state() is PowerState.OFF


def test_no_systems_is_a_clear_error(fake_bmc: Callable[..., tuple[FakeRedfish, int]]) -> None:
    _, port = fake_bmc(members=0)
    t = target(port)
    with RedfishDriver(t) as d, pytest.raises(BmcProtocolError) as err:
        d.power_state()
    assert "has 0 systems" in str(err.value)
    assert_one_line(err.value, t)


def test_session_login_is_preferred_and_logged_out(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]],
) -> None:
    fake, port = fake_bmc(sessions=True)
    with RedfishDriver(target(port, "1")) as d:
        assert d.power_state() is PowerState.ON
        (get,) = fake.requests_to("GET", SYSTEM)
        assert "X-Auth-Token" in get.headers and "Authorization" not in get.headers
        assert len(fake.tokens) == 1

        # A session the BMC forgot (expired) is renewed once, transparently.
        fake.tokens.clear()
        assert d.power_state() is PowerState.ON
        assert fake.count("POST", SESSIONS) == 2
    assert fake.tokens == set()  # close() deleted the session
    assert len([s for s in fake.seen if s.method == "DELETE"]) >= 1


@pytest.mark.parametrize(
    ("session_status", "password", "error"),
    [(500, PASSWORD, BmcProtocolError), (201, "nope", BmcAuthFailed)],
    ids=["session-refused", "wrong-password"],
)
def test_failed_session_login_is_an_error_not_a_basic_auth_retry(
    fake_bmc: Callable[..., tuple[FakeRedfish, int]],
    session_status: int,
    password: str,
    error: type[BmcError],
) -> None:
    """A BMC that offers sessions and refuses one gets no second try with basic auth: that
    would only send the password again, to a BMC broken or not who it claims to be."""
    fake, port = fake_bmc(sessions=True, session_status=session_status)
    t = target(port, "1", password=password)
    with RedfishDriver(t) as d, pytest.raises(error) as err:
        d.power_state()
    assert_one_line(err.value, t)
    assert fake.count("POST", SESSIONS) == 1
    assert [s for s in fake.seen if "Authorization" in s.headers] == []
    assert fake.requests_to("GET", SYSTEM) == []


def test_plain_http_needs_the_opt_in(fake_bmc: Callable[..., tuple[FakeRedfish, int]]) -> None:
    fake, port = fake_bmc()
    t = target(port, "1", plain_http=False)
    with pytest.raises(BmcRefused) as err:
        RedfishDriver(t)
    assert "plain HTTP" in str(err.value) and "plain_http: true" in str(err.value)
    assert_one_line(err.value, t)
    assert fake.seen == []  # refused before anything was sent
    # Opted in, a bare host means http (the lab's emulators), and it works.
    with RedfishDriver(target(port, "1", address="127.0.0.1", plain_http=True)) as d:
        assert d.power_state() is PowerState.ON


def test_identify_variants(fake_bmc: Callable[..., tuple[FakeRedfish, int]]) -> None:
    fake, port = fake_bmc(extra={"LocationIndicatorActive": False})
    with RedfishDriver(target(port, "1")) as d:
        d.identify(True)
    assert [s.body for s in fake.requests_to("PATCH", SYSTEM)] == [
        {"LocationIndicatorActive": True}
    ]

    _, port = fake_bmc()
    t = target(port, "1")
    with RedfishDriver(t) as d, pytest.raises(BmcUnsupported) as err:
        d.identify(True)
    assert_one_line(err.value, t)


# ---------------------------------------------------------------------------------------------
# TLS: verification on by default, a CA bundle, off only when asked


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fleet test CA"))
        .issuer_name(name("fleet test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = (directory / n for n in ("ca.pem", "bmc.pem", "bmc.key"))
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_path, cert_path, key_path


@pytest.fixture(scope="module")
def tls_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SushyEmulator, Path]]:
    ca, cert, key = _tls_files(tmp_path_factory.mktemp("tls"))
    system = FakeSystem.new("tls-node", "On")
    with SushyEmulator(
        [system], username=USER, password=PASSWORD, tls_cert=str(cert), tls_key=str(key)
    ) as emu:
        yield emu, ca


def test_tls_verified_by_default(
    tls_emulator: tuple[SushyEmulator, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    emu, _ = tls_emulator
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    t = target(emu.port, address="127.0.0.1")  # no scheme: https
    assert base_url(t) == f"https://127.0.0.1:{emu.port}"
    with RedfishDriver(t) as d, pytest.raises(BmcUnreachable) as err:
        d.power_state()
    assert "TLS" in str(err.value) and "certificate verify failed" in str(err.value)
    assert_one_line(err.value, t)


def test_tls_with_a_ca_bundle(tls_emulator: tuple[SushyEmulator, Path]) -> None:
    emu, ca = tls_emulator
    with RedfishDriver(target(emu.port, address="127.0.0.1", ca_bundle=str(ca))) as d:
        assert d.power_state() is PowerState.ON  # and the single system found without an id


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_tls_verification_off_only_when_asked(tls_emulator: tuple[SushyEmulator, Path]) -> None:
    emu, _ = tls_emulator
    with RedfishDriver(target(emu.port, address="127.0.0.1", verify_tls=False)) as d:
        assert d.power_state() is PowerState.ON


def test_ca_file_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    default = ca_file(target(443))
    assert default is not None and os.path.exists(default)
    assert ca_file(target(443, ca_bundle="/etc/bmc-ca.pem")) == "/etc/bmc-ca.pem"
    assert ca_file(target(443, verify_tls=False, ca_bundle="/etc/bmc-ca.pem")) is None
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/site-ca.pem")
    assert ca_file(target(443)) == "/etc/site-ca.pem"


@pytest.mark.parametrize(
    ("address", "port", "plain_http", "url"),
    [
        ("10.0.0.5", 443, False, "https://10.0.0.5:443"),
        ("bmc-01.example", 8443, False, "https://bmc-01.example:8443"),
        ("fd00::5", 443, False, "https://[fd00::5]:443"),
        ("http://127.0.0.1", 8000, True, "http://127.0.0.1:8000"),
        ("127.0.0.1", 8000, True, "http://127.0.0.1:8000"),
        ("https://bmc:9443/redfish/v1", 443, False, "https://bmc:9443"),
        ("https://bmc:9443", 443, True, "https://bmc:9443"),  # TLS given: kept
        ("https://user:pw@bmc", 443, False, "https://bmc:443"),  # user info dropped
    ],
)
def test_base_url(address: str, port: int, plain_http: bool, url: str) -> None:
    assert base_url(target(port, address=address, plain_http=plain_http)) == url


@pytest.mark.parametrize("address", ["http://127.0.0.1", "HTTP://bmc:80", "ftp://bmc", "http://"])
def test_base_url_refuses_plain_http_without_the_opt_in(address: str) -> None:
    with pytest.raises(BmcRefused) as err:
        base_url(target(443, address=address, plain_http=False))
    assert "nothing was sent" in str(err.value) or "not an http(s) URL" in str(err.value)


# ---------------------------------------------------------------------------------------------
# The emulator wrapper itself


def test_emulator_stops_its_whole_process_group() -> None:
    emu = SushyEmulator([FakeSystem.new("solo")], username=USER, password=PASSWORD).start()
    pid, workdir = emu.pid, emu.workdir
    assert pid is not None and workdir is not None and workdir.exists()
    try:
        assert emu.read_power_state(emu.systems[0]) == "Off"
        assert os.getpgid(pid) == pid  # its own process group
    finally:
        emu.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert not workdir.exists()
    emu.stop()  # idempotent
