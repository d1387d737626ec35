"""IpmiDriver against real OpenIPMI `ipmi_sim` emulators (fleet.lab.ipmi_sim) on 127.0.0.1.

Every test gets fresh emulators (own UDP port, own state directory), stopped in teardown. The
chassis_control log (`<epoch> set power 0`) shows what reached the "hardware". A few tests use a
fake pyghmi Command where a real emulator cannot produce the case (a busy BMC, a stalled one).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from pyghmi import exceptions as pyghmi_exc
from pyghmi.ipmi import command as pyghmi_command
from pyghmi.ipmi.private import session as pyghmi_session

from fleet.bmc import driver_for
from fleet.bmc import ipmi as ipmi_module
from fleet.bmc.base import (
    ActionResult,
    BmcAuthFailed,
    BmcError,
    BmcProtocolError,
    BmcTarget,
    BmcTransient,
    BmcUnreachable,
    BmcUnsupported,
    PowerDriver,
    Timeouts,
)
from fleet.bmc.ipmi import IpmiDriver
from fleet.lab import ipmi_sim as ipmi_sim_module
from fleet.lab.ipmi_sim import IpmiSim, free_udp_port
from fleet.models import BmcProtocol, PowerState

CALL = 2.0
TIMEOUTS = Timeouts(call=CALL, total=4.0, attempts=3, backoff=0.05)
MARGIN = 1.5  # seconds allowed past timeouts.call (a loaded 2-core CI machine)
PASSWORD = "Sim-pass.42"

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )


SimFactory = Callable[..., IpmiSim]


@pytest.fixture
def make_sim() -> Iterator[SimFactory]:
    """Start ipmi_sim emulators on demand; all stopped (and reaped) at teardown."""
    sims: list[IpmiSim] = []

    def make(**kwargs: Any) -> IpmiSim:
        sim = IpmiSim(kwargs.pop("password", PASSWORD), **kwargs)
        sims.append(sim)
        return sim.start()

    try:
        yield make
    finally:
        for sim in sims:
            sim.stop()


@pytest.fixture
def sim(make_sim: SimFactory) -> IpmiSim:
    return make_sim()


def target_of(sim: IpmiSim, server: str = "gpu-01", **changes: Any) -> BmcTarget:
    return dataclasses.replace(sim.bmc_target(server, TIMEOUTS), **changes)


def down_target(server: str = "gpu-down") -> BmcTarget:
    return BmcTarget(
        server=server,
        protocol=BmcProtocol.IPMI,
        address="127.0.0.1",
        port=free_udp_port(),  # nothing listens there
        username="admin",
        password=PASSWORD,
        timeouts=TIMEOUTS,
    )


def assert_one_line_naming(exc: BmcError, target: BmcTarget) -> None:
    text = str(exc)
    assert "\n" not in text
    assert target.server in text
    assert f"ipmi {target.address}:{target.port}" in text
    assert PASSWORD not in text and target.password not in text


def new_calls(sim: IpmiSim, before: int) -> list[str]:
    return sim.log_calls()[before:]


# ---------------------------------------------------------------------------------------------
# power


def test_power_on_off_and_status_read_back(sim: IpmiSim) -> None:
    with IpmiDriver(target_of(sim)) as driver:
        assert driver.power_state() is PowerState.OFF

        on = driver.power_on()
        assert on == ActionResult(
            "on", sent=True, state_before=PowerState.OFF, state_after=PowerState.ON
        )
        assert sim.chassis_power() is True
        assert driver.power_state() is PowerState.ON

        off = driver.power_off(force=True)
        assert off.action == "force_off" and off.sent
        assert (off.state_before, off.state_after) == (PowerState.ON, PowerState.OFF)
        assert sim.chassis_power() is False
    assert sim.log_calls() == ["set power 1", "set power 0"]


def test_asking_for_the_current_state_sends_nothing(make_sim: SimFactory) -> None:
    on_sim = make_sim(powered_on=True)
    with IpmiDriver(target_of(on_sim)) as driver:
        result = driver.power_on()
    assert result == ActionResult(
        "on", sent=False, state_before=PowerState.ON, state_after=PowerState.ON
    )
    assert on_sim.log_lines() == []  # no new line in the chassis_control log

    off_sim = make_sim(powered_on=False)
    with IpmiDriver(target_of(off_sim)) as driver:
        assert driver.power_off().sent is False
        assert driver.power_off(force=True).sent is False
    assert off_sim.log_lines() == []


def test_power_on_twice_adds_one_line(sim: IpmiSim) -> None:
    with IpmiDriver(target_of(sim)) as driver:
        assert driver.power_on().sent
        lines = len(sim.log_lines())
        second = driver.power_on()
    assert not second.sent and second.state_after is PowerState.ON
    assert len(sim.log_lines()) == lines


def test_cycle_is_set_power_0_then_set_power_1(make_sim: SimFactory) -> None:
    sim = make_sim(powered_on=True)
    with IpmiDriver(target_of(sim)) as driver:
        result = driver.power_cycle()
    assert result.action == "cycle" and result.sent
    assert (result.state_before, result.state_after) == (PowerState.ON, PowerState.ON)
    assert sim.log_calls() == ["set power 0", "set power 1"]
    epochs = [int(line.split()[0]) for line in sim.log_lines()]
    assert epochs == sorted(epochs)


def test_cycle_of_a_server_that_is_off_powers_it_on(sim: IpmiSim) -> None:
    with IpmiDriver(target_of(sim)) as driver:
        result = driver.power_cycle()
    assert result == ActionResult(
        "cycle", sent=True, state_before=PowerState.OFF, state_after=PowerState.ON
    )
    assert sim.log_calls() == ["set power 1"]


def test_soft_off_is_an_acpi_shutdown(make_sim: SimFactory) -> None:
    honoured = make_sim(powered_on=True, soft_off_powers_down=True)
    with IpmiDriver(target_of(honoured)) as driver:
        result = driver.power_off()
    assert result.action == "off" and result.sent
    assert result.state_after is PowerState.OFF
    assert honoured.log_calls() == ["set shutdown 1"]

    # An OS that ignores the request: the command went out, the server is still on.
    hung = make_sim(powered_on=True, soft_off_powers_down=False)
    with IpmiDriver(target_of(hung)) as driver:
        result = driver.power_off()
    assert result.sent and result.state_after is PowerState.ON
    assert hung.log_calls() == ["set shutdown 1"]


def test_change_behind_our_back_is_read(sim: IpmiSim) -> None:
    with IpmiDriver(target_of(sim)) as driver:
        assert driver.power_state() is PowerState.OFF
        sim.set_power_behind_our_back(True)
        assert driver.power_state() is PowerState.ON
        sim.set_power_behind_our_back(False)
        assert driver.power_state() is PowerState.OFF


def test_identify(sim: IpmiSim) -> None:
    with IpmiDriver(target_of(sim)) as driver:
        driver.identify()
        driver.identify(on=False)
    calls = sim.log_calls()
    assert len(calls) == 2
    assert calls[0].startswith("set identify") and calls[0].endswith("1")
    assert calls[1].startswith("set identify") and calls[1].endswith("0")


def test_info_and_sensors_where_offered(sim: IpmiSim) -> None:
    # ipmi_sim offers a BMC firmware version, no FRU data, no temperature sensors, and the
    # lab's power sensor, which has no reading until the lab sets one.
    with IpmiDriver(target_of(sim)) as driver:
        info = driver.info()
        sensors = driver.sensors()
    assert info.firmware == "9.8"
    assert info.manufacturer is None and info.model is None and info.serial is None
    assert sensors.temperatures_c == {} and sensors.power_w is None


def read_power_until(driver: PowerDriver, want: float | None) -> float | None:
    """The driver's power reading, polled (bounded) until it is `want`: ipmi_sim reads the
    lab's file every POWER_POLL_MS."""
    deadline = time.monotonic() + 5.0
    seen = driver.sensors().power_w
    while seen != want and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = driver.sensors().power_w
    return seen


def test_the_power_sensor_reads_what_the_lab_set(make_sim: SimFactory) -> None:
    sim = make_sim(power_max_w=12_750.0)  # a DGX-class server: 50 W a step
    assert sim.power_step_w == 50
    # No DCMI in ipmi_sim: the driver falls back to the whole-system power sensor.
    with pytest.raises(ipmi_sim_module.IpmiSimError, match="Invalid command"):
        sim.ipmitool("dcmi", "power", "reading")
    with IpmiDriver(target_of(sim)) as driver:
        sim.set_power_watts(6_500.0)
        assert read_power_until(driver, 6_500.0) == 6_500.0
        sim.set_power_watts(4_321.0)  # rounded to the sensor's step
        assert read_power_until(driver, 4_300.0) == 4_300.0
        sim.set_power_watts(None)  # the sensor reads as unavailable: no reading at all
        assert read_power_until(driver, None) is None
        sim.set_power_watts(0.0)  # zero is a reading
        assert read_power_until(driver, 0.0) == 0.0
    listing = sim.ipmitool("sdr", "list")
    assert "Total Power" in listing and "Watts" in listing


def test_the_power_sensor_refuses_what_it_cannot_show(sim: IpmiSim) -> None:
    assert sim.power_max_w == 2550.0  # the default: 10 W a step
    for nonsense in (-1.0, float("nan"), float("inf"), 2551.0):
        with pytest.raises(ValueError, match="the power sensor shows 0-2550 W"):
            sim.set_power_watts(nonsense)
    assert sim.power_watts() is None


def test_driver_for_picks_ipmi(sim: IpmiSim) -> None:
    driver = driver_for(target_of(sim))
    try:
        assert isinstance(driver, IpmiDriver)
        assert driver.power_state() is PowerState.OFF
    finally:
        driver.close()


def test_sessions_are_shared_and_closed_cleanly(sim: IpmiSim) -> None:
    first, second = IpmiDriver(target_of(sim)), IpmiDriver(target_of(sim))
    try:
        assert first.power_state() is PowerState.OFF
        assert second.power_on().sent
        first.close()  # the other driver's session survives
        assert second.power_state() is PowerState.ON
    finally:
        second.close()
    with IpmiDriver(target_of(sim)) as third:  # and a fresh one logs in again
        assert third.power_off(force=True).sent


# ---------------------------------------------------------------------------------------------
# faults


def test_wrong_password_is_auth_failed_quickly(sim: IpmiSim) -> None:
    target = target_of(sim, password="not-the-password")
    for _ in range(2):  # a second try fails just as fast (no stale session is waited on)
        started = time.monotonic()
        with pytest.raises(BmcAuthFailed) as caught, IpmiDriver(target) as driver:
            driver.power_on()
        assert time.monotonic() - started < CALL  # refused at once, not timed out
        assert_one_line_naming(caught.value, target)
        assert "password" in str(caught.value).lower()
    assert sim.log_lines() == []
    with IpmiDriver(target_of(sim)) as driver:  # the right password still works
        assert driver.power_on().sent


def test_unknown_user_is_auth_failed(sim: IpmiSim) -> None:
    # A generous call timeout: under a loaded machine a UDP round trip may stall, and this
    # test is about the kind of error, not its speed (that is the wrong-password test's job).
    target = target_of(sim, username="nobody", timeouts=dataclasses.replace(TIMEOUTS, call=10.0))
    with pytest.raises(BmcAuthFailed) as caught, IpmiDriver(target) as driver:
        driver.power_state()
    assert_one_line_naming(caught.value, target)
    assert "nobody" in str(caught.value)


@pytest.mark.parametrize("peer", ["closed", "silent"])
def test_bmc_down_is_unreachable_within_the_call_timeout(peer: str) -> None:
    """`closed`: nothing listens on the UDP port. `silent`: a socket takes every packet and
    never answers. Both end after `timeouts.call`, not after pyghmi's own ~5 s."""
    target = down_target()
    silent: socket.socket | None = None
    if peer == "silent":
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        silent.bind(("127.0.0.1", 0))
        target = dataclasses.replace(target, port=silent.getsockname()[1])
    try:
        started = time.monotonic()
        with pytest.raises(BmcUnreachable) as caught, IpmiDriver(target) as driver:
            driver.power_on()
        elapsed = time.monotonic() - started
    finally:
        if silent is not None:
            silent.close()
    assert CALL - 0.1 <= elapsed <= CALL + MARGIN
    assert_one_line_naming(caught.value, target)
    assert f"within {CALL:g} s" in str(caught.value)


def test_stopped_bmc_is_unreachable(make_sim: SimFactory) -> None:
    sim = make_sim(powered_on=True)
    target = target_of(sim)
    with IpmiDriver(target) as driver:
        assert driver.power_state() is PowerState.ON
        sim.stop()
        started = time.monotonic()
        with pytest.raises(BmcUnreachable) as caught:
            driver.power_state()
        assert time.monotonic() - started <= CALL + MARGIN
        assert_one_line_naming(caught.value, target)


def test_a_dropped_session_leaves_nothing_in_pyghmis_tables(make_sim: SimFactory) -> None:
    """A session dropped after a timeout must not stay in pyghmi's keepalive and retransmit
    tables: pyghmi runs those in whichever caller thread waits, so a leftover would go on
    costing every later IPMI call time (and more with each dead BMC)."""
    sim = make_sim(powered_on=True)
    driver = IpmiDriver(target_of(sim))
    with driver:
        assert driver.power_state() is PowerState.ON
        session = driver._cmd.ipmi_session
        assert session in pyghmi_session.Session.keepalive_sessions
        sim.stop()
        with pytest.raises(BmcUnreachable):
            driver.power_state()
    assert session not in pyghmi_session.Session.keepalive_sessions
    assert session not in pyghmi_session.Session.waiting_sessions
    assert session.broken


@contextmanager
def frozen(sim: IpmiSim) -> Iterator[None]:
    """The BMC hangs (SIGSTOP: the process holds its port and answers nothing) for a while."""
    assert sim.pid is not None
    os.killpg(sim.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(sim.pid, signal.SIGCONT)


def kill_pyghmi_io_thread() -> socket.socket:
    """Make pyghmi's I/O thread's select() raise (a closed socket among its sockets); returns
    that socket."""
    thread = pyghmi_session.iothread
    assert thread is not None and thread.is_alive()
    closed = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    closed.close()
    pyghmi_session.iosockets.append(closed)
    wake = pyghmi_session.iosockets[0]
    wake.sendto(b"\x01", (pyghmi_session.myself, wake.getsockname()[1]))
    deadline = time.monotonic() + 5  # (pyghmi's thread overrides join() without a timeout)
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not thread.is_alive()  # select() raised on the closed socket
    return closed


def ipmi_workers(server: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"ipmi {server}"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_pyghmi_io_thread_is_revived(sim: IpmiSim) -> None:
    """pyghmi's single I/O thread dies if its select() raises (here: a closed socket among its
    sockets); the driver starts a new one instead of letting every IPMI call hang."""
    with IpmiDriver(target_of(sim)) as driver:
        assert driver.power_state() is PowerState.OFF
    thread = pyghmi_session.iothread
    closed = kill_pyghmi_io_thread()

    with IpmiDriver(target_of(sim)) as driver:
        assert driver.power_on().sent
        assert driver.power_state() is PowerState.ON
    assert pyghmi_session.iothread is not thread and pyghmi_session.iothread.is_alive()
    assert closed not in pyghmi_session.iosockets


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_call_waiting_when_the_io_thread_dies_still_ends(sim: IpmiSim) -> None:
    """pyghmi parks a waiting caller on an event only its I/O thread sets: when that thread
    died, the waiter (a worker, possibly holding pyghmi's process-wide locks) waited forever.
    Fleet's waits are bounded, so the stranded worker ends once the revived thread (or
    pyghmi's own give-up) answers it."""
    target = target_of(sim, "gpu-stranded")
    with IpmiDriver(target) as driver:
        assert driver.power_state() is PowerState.OFF
        with frozen(sim):
            with pytest.raises(BmcUnreachable):
                driver.power_state()  # its worker now waits in pyghmi for an answer
            assert ipmi_workers(target.server), "no worker left waiting"
            kill_pyghmi_io_thread()
        # A later call revives the I/O thread; the stranded worker must end by itself.
        assert driver.power_state() is PowerState.OFF
        deadline = time.monotonic() + 15  # pyghmi's own retransmits give up within ~10 s
        while ipmi_workers(target.server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ipmi_workers(target.server), "a worker waits forever on a dead I/O thread"


def test_a_timed_out_call_is_not_held_by_a_login_to_the_same_bmc(sim: IpmiSim) -> None:
    """After a timeout the driver drops its session, which needs the BMC's lock; another
    driver's login to that BMC (stuck on the hung BMC) may hold it for as long as pyghmi
    tries. The caller must not wait for it: the call still ends within its total."""
    target = target_of(sim, "gpu-held")
    with IpmiDriver(target) as driver:
        assert driver.power_state() is PowerState.OFF
        lock = ipmi_module._bmc_lock((target.address, target.port, target.username))
        with frozen(sim), lock:  # the lock: another driver logging in to the hung BMC
            started = time.monotonic()
            with pytest.raises(BmcUnreachable):
                driver.power_state()
            elapsed = time.monotonic() - started
        # Retries start until `total`, each bounded by `call`: the read's worst case.
        assert elapsed <= TIMEOUTS.total + CALL + MARGIN, elapsed
        assert driver.power_state() is PowerState.OFF  # and it reconnects afterwards


def test_calls_abandoned_behind_a_login_to_a_dead_bmc_do_not_log_in_after_it() -> None:
    """Six drivers call a BMC that never answers at once. Each timed-out call leaves its
    worker queued behind the one login in progress (pyghmi's ~5 s per login); a worker whose
    caller gave up must not log in when its turn comes, or the queue outlives every caller
    by minutes and holds the next one up."""
    target = down_target("gpu-queue")
    drivers = [IpmiDriver(target) for _ in range(6)]

    def call(driver: IpmiDriver) -> BaseException | None:
        try:
            driver.power_state()
        except BmcError as exc:
            return exc
        return None

    with ThreadPoolExecutor(max_workers=len(drivers)) as pool:
        errors = list(pool.map(call, drivers))
    assert all(isinstance(e, BmcUnreachable) for e in errors), errors
    deadline = time.monotonic() + 8  # one login's give-up, and some
    while ipmi_workers(target.server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ipmi_workers(target.server), f"{len(ipmi_workers(target.server))} still queued"
    for driver in drivers:
        driver.close()


def test_a_login_nothing_drives_is_ended_when_its_call_times_out(sim: IpmiSim) -> None:
    """pyghmi can lose a login from its retransmit table: then it neither retries nor gives
    up, its worker waits for ever holding the BMC's lock, and every later call to that BMC
    times out behind it. Here the BMC is frozen and the login's entry taken out of the
    table by hand; when the call times out, Fleet ends that login."""
    target = target_of(sim, "gpu-lost-login")
    outcome: list[BaseException | None] = []
    with frozen(sim):
        driver = IpmiDriver(target)

        def call() -> None:
            try:
                driver.power_state()
                outcome.append(None)
            except BmcError as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + CALL
        lost: list[Any] = []
        while not lost and time.monotonic() < deadline:  # the login in progress, found
            time.sleep(0.05)
            lost = [
                s
                for s in list(pyghmi_session.Session.waiting_sessions)
                if getattr(s, "port", None) == sim.port
            ]
        assert lost, "no login in progress to lose"
        for session in lost:
            pyghmi_session.Session.waiting_sessions.pop(session, None)
        caller.join(TIMEOUTS.total + CALL + MARGIN)
        assert outcome and isinstance(outcome[0], BmcUnreachable), outcome
        deadline = time.monotonic() + 5
        while ipmi_workers(target.server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ipmi_workers(target.server), "the lost login's worker waits for ever"
    assert driver.power_state() is PowerState.OFF  # the BMC is usable again
    driver.close()


# ---------------------------------------------------------------------------------------------
# many BMCs at once


def test_concurrent_bmcs_in_a_thread_pool(make_sim: SimFactory) -> None:
    """Eight emulators driven at once (each a power-on and a cycle, ~1 s for the cycle), plus
    one dead BMC in the same pool: it fails on its own deadline and holds nobody up."""
    sims = [make_sim() for _ in range(8)]
    dead = down_target("gpu-dead")

    spans: list[tuple[float, float]] = []

    def drive(target: BmcTarget) -> tuple[ActionResult, ActionResult] | BmcError:
        began = time.monotonic()
        try:
            with IpmiDriver(target) as driver:
                return driver.power_on(), driver.power_cycle()
        except BmcError as exc:
            return exc
        finally:
            spans.append((began, time.monotonic()))

    # The healthy BMCs get a generous call timeout (this is about concurrency, not speed, and a
    # loaded 2-core machine can stall a UDP round trip); the dead one keeps the short one.
    roomy = dataclasses.replace(TIMEOUTS, call=10.0, total=20.0)
    targets = [target_of(s, f"gpu-{i:02d}", timeouts=roomy) for i, s in enumerate(sims)] + [dead]
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        results = list(pool.map(drive, targets))

    assert isinstance(results[-1], BmcUnreachable)
    assert_one_line_naming(results[-1], dead)
    for sim_, result in zip(sims, results[:-1], strict=True):
        assert not isinstance(result, BmcError), result
        on, cycle = result
        assert on.sent and on.state_after is PowerState.ON
        assert cycle.sent and cycle.state_after is PowerState.ON
        assert sim_.log_calls() == ["set power 1", "set power 0", "set power 1"]
    # They ran at once (every BMC's work overlapped every other's), not one after another.
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans


# ---------------------------------------------------------------------------------------------
# the emulator itself


def test_ipmi_sim_stop_reaps_the_process_group_and_cleans_up() -> None:
    sim = IpmiSim(PASSWORD).start()
    pid, directory = sim.pid, sim.dir
    assert pid is not None and directory is not None and directory.exists()
    other = IpmiSim(PASSWORD).start()
    try:
        assert other.port != sim.port
        sim.stop()
        sim.stop()  # idempotent
        assert not sim.running and not directory.exists()
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # no process left in its group
        assert other.running  # the other emulator is untouched
    finally:
        other.stop()


def test_ipmi_sim_moves_to_a_fresh_port_when_its_port_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process can bind the port between the kernel's pick and ipmi_sim's bind (CI
    met it once): ipmi_sim exits "Address already in use" and the start tries a fresh port."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # no SO_REUSEADDR, as a client's
    taken.bind(("127.0.0.1", 0))
    ports = [int(taken.getsockname()[1])]
    real = ipmi_sim_module.free_udp_port
    monkeypatch.setattr(ipmi_sim_module, "free_udp_port", lambda: ports.pop() if ports else real())
    try:
        sim = IpmiSim(PASSWORD).start()
        try:
            assert sim.port != taken.getsockname()[1]
            assert sim.running  # and it answered ipmitool: start() waits for that
        finally:
            sim.stop()
    finally:
        taken.close()
    assert not ports  # the taken port was tried first


def test_ipmi_sim_rejects_passwords_it_cannot_hold() -> None:
    with pytest.raises(ValueError):
        IpmiSim("x" * 20)  # ipmi_sim accepts at most 19 characters
    with pytest.raises(ValueError):
        IpmiSim('quote"d')


# ---------------------------------------------------------------------------------------------
# error mapping and retries, with a fake pyghmi Command (cases no emulator produces)


class FakeSession:
    broken = False
    logged = 1

    def logout(self) -> None:
        self.logged = 0


class FakeCommand:
    """Stands in for pyghmi's Command: `script` maps a method to what each call does."""

    script: dict[str, list[Any]] = {}
    calls: list[str] = []
    lock = threading.Lock()

    def __init__(self, **_: Any) -> None:
        self.ipmi_session = FakeSession()

    def _next(self, name: str) -> Any:
        with self.lock:
            self.calls.append(name)
            step = self.script[name].pop(0) if len(self.script[name]) > 1 else self.script[name][0]
        if isinstance(step, BaseException):
            raise step
        if callable(step):
            return step()
        return step

    def get_power(self) -> Any:
        return self._next("get_power")

    def set_power(self, state: str, wait: bool = False) -> Any:
        assert wait is False
        return self._next(f"set_power {state}")

    def xraw_command(self, netfn: int, command: int, data: tuple[int, ...] = ()) -> Any:
        return self._next(f"raw {netfn:#x} {command:#x} {list(data)}")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeCommand]:
    monkeypatch.setattr(pyghmi_command, "Command", FakeCommand)
    FakeCommand.script = {}
    FakeCommand.calls = []
    return FakeCommand


def fake_target() -> BmcTarget:
    return BmcTarget(
        server="gpu-fake",
        protocol=BmcProtocol.IPMI,
        address="127.0.0.1",  # never contacted: the pyghmi Command is a fake
        port=free_udp_port(),
        username="admin",
        password=PASSWORD,
        timeouts=Timeouts(call=1.0, total=3.0, attempts=3, backoff=0.01),
    )


def busy() -> pyghmi_exc.IpmiException:
    return pyghmi_exc.IpmiException("Node Busy", 0xC0)


def test_busy_reads_are_retried(fake: type[FakeCommand]) -> None:
    fake.script = {"get_power": [busy(), busy(), {"powerstate": "on"}]}
    with IpmiDriver(fake_target()) as driver:
        assert driver.power_state() is PowerState.ON
    assert fake.calls == ["get_power"] * 3


def test_a_busy_power_command_is_never_resent(fake: type[FakeCommand]) -> None:
    fake.script = {"get_power": [{"powerstate": "off"}], "set_power on": [busy()]}
    target = fake_target()
    with pytest.raises(BmcTransient) as caught, IpmiDriver(target) as driver:
        driver.power_on()
    assert fake.calls.count("set_power on") == 1
    assert_one_line_naming(caught.value, target)


def test_a_stalled_power_command_is_bounded_and_not_resent(fake: type[FakeCommand]) -> None:
    fake.script = {
        "get_power": [{"powerstate": "on"}],
        "raw 0x0 0x2 [2]": [lambda: time.sleep(3)],
    }
    target = fake_target()
    started = time.monotonic()
    with pytest.raises(BmcUnreachable) as caught, IpmiDriver(target) as driver:
        driver.power_cycle()
    assert time.monotonic() - started <= target.timeouts.call + MARGIN
    assert fake.calls.count("raw 0x0 0x2 [2]") == 1
    assert "may or may not have taken effect" in str(caught.value)
    assert_one_line_naming(caught.value, target)


def test_cycle_falls_back_to_a_hard_reset_where_cycle_is_rejected(
    fake: type[FakeCommand],
) -> None:
    rejected = pyghmi_exc.IpmiException("Invalid data field in request", 0xCC)
    fake.script = {
        "get_power": [{"powerstate": "on"}],
        "raw 0x0 0x2 [2]": [rejected],
        "raw 0x0 0x2 [3]": [{"code": 0}],
    }
    with IpmiDriver(fake_target()) as driver:
        result = driver.power_cycle()
    assert result.sent and result.state_after is PowerState.ON
    assert fake.calls.count("raw 0x0 0x2 [3]") == 1


def test_read_back_failure_still_reports_the_command_as_sent(fake: type[FakeCommand]) -> None:
    fake.script = {
        "get_power": [{"powerstate": "off"}, pyghmi_exc.IpmiException("weird", 0x99)],
        "set_power on": [{"pendingpowerstate": "on"}],
    }
    with IpmiDriver(fake_target()) as driver:
        result = driver.power_on()
    assert result.sent and result.state_after is PowerState.UNKNOWN


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (pyghmi_exc.IpmiException("Incorrect password provided"), BmcAuthFailed),
        (pyghmi_exc.IpmiException("Unauthorized name in RAKP2"), BmcAuthFailed),
        (
            pyghmi_exc.IpmiException("Insufficient privilege level or firmware firewall"),
            BmcAuthFailed,
        ),
        (pyghmi_exc.IpmiException("Node Busy"), BmcTransient),
        (pyghmi_exc.IpmiException("x", 0xC3), BmcTransient),
        (pyghmi_exc.IpmiException("BMC initialization in progress"), BmcTransient),
        (pyghmi_exc.IpmiException(None), BmcUnreachable),
        (pyghmi_exc.IpmiException("timeout", 0xFFFF), BmcUnreachable),
        (pyghmi_exc.IpmiException("Session no longer connected"), BmcUnreachable),
        (socket.gaierror(-2, "Name or service not known"), BmcUnreachable),
        (OSError(101, "Network is unreachable"), BmcUnreachable),
        (pyghmi_exc.IpmiException("Invalid command", 0xC1), BmcUnsupported),
        (pyghmi_exc.IpmiException("Invalid data field in request"), BmcUnsupported),
        (pyghmi_exc.InvalidParameterValue("Unknown power state"), BmcUnsupported),
        (pyghmi_exc.IpmiException("Unknown code 0x99 encountered", 0x99), BmcProtocolError),
        (AssertionError(), BmcProtocolError),
    ],
)
def test_error_mapping(
    fake: type[FakeCommand], error: BaseException, expected: type[BmcError]
) -> None:
    fake.script = {"get_power": [error]}
    target = fake_target()
    with pytest.raises(expected) as caught, IpmiDriver(target) as driver:
        driver.power_state()
    assert type(caught.value) is expected
    assert_one_line_naming(caught.value, target)


def test_a_login_fleet_ended_is_not_logged_in_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a call times out while logging in, Fleet ends that login (`_break_logins`), which
    can trip pyghmi's `errormsg` bug below. For an abandoned call the driver must not log in
    again: nothing would end the new login to the silent BMC, and it would hold the BMC's lock
    (test_a_login_nothing_drives_is_ended_when_its_call_times_out failed so, its worker alive
    5 s after the call, in ~1 run in 15)."""
    attempts: list[int] = []

    def ended_login(**_: Any) -> Any:
        attempts.append(1)
        raise AttributeError("'Session' object has no attribute 'errormsg'")

    monkeypatch.setattr(pyghmi_command, "Command", ended_login)
    driver = IpmiDriver(down_target("gpu-abandoned"))
    gave_up = threading.Event()
    gave_up.set()
    with pytest.raises(BmcUnreachable, match="login abandoned"):
        driver._login(gave_up)
    assert len(attempts) == 1
    driver.close()


def test_pyghmi_login_race_is_retried_and_the_real_cause_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pyghmi 1.6 sometimes fails a bad login with AttributeError ('errormsg', its own bug),
    twice in a row under load: the driver logs in again (three tries in all) and reports what
    the BMC really said."""
    attempts: list[int] = []

    def flaky_login(**_: Any) -> Any:
        attempts.append(1)
        if len(attempts) <= 2:
            raise AttributeError("'Session' object has no attribute 'errormsg'")
        raise pyghmi_exc.IpmiException("Incorrect password provided")

    monkeypatch.setattr(pyghmi_command, "Command", flaky_login)
    target = down_target("gpu-race")
    with pytest.raises(BmcAuthFailed) as caught, IpmiDriver(target) as driver:
        driver.power_state()
    assert len(attempts) == 3
    assert_one_line_naming(caught.value, target)
