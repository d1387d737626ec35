"""IPMI power control over LAN (RMCP+, "lanplus") with `pyghmi`.

`IpmiDriver` keeps the `PowerDriver` contract (fleet/bmc/base.py):

- **Lazy connect.** The pyghmi `Command` (an RMCP+ session) is opened by the first call.
  pyghmi caches sessions process-wide per (BMC, port, user, password), so several drivers for
  one BMC share one session; the last driver to `close()` logs it out.
- **Bounded calls.** pyghmi is synchronous and has no per-call deadline: an unreachable BMC is
  detected by its own retransmit schedule after ~5 s, and a stalled one can hold a call longer.
  Each call (connect included) therefore runs in a short-lived daemon worker thread and the
  caller waits at most `target.timeouts.call` seconds (`threading.Event.wait`), then raises
  `BmcUnreachable` and drops the session. The abandoned worker ends by itself when pyghmi gives
  up (~5 s); a worker abandoned while queued behind another login to the same BMC does not
  log in at all, and a login still running when its call times out is ended, and not tried
  again (pyghmi can lose a login from its retransmit table, and it then waits for ever
  holding the BMC's lock; see `_break_logins` and `IpmiDriver._login`). Dropping a session
  and closing happen off the caller's thread. pyghmi's own knobs (module-level
  `initialtimeout`, per-session `maxtimeout`) are process-wide or reset at login, so they are
  left alone.
- **pyghmi 1.6 quirks handled here.** Credentials are passed as bytes (with str, a second
  Command for the same BMC waits forever on a stale cache entry), and no pyghmi wait lasts
  over 50 ms (a lost wake-up otherwise stalls 1-4 calls in 100 against a local BMC by 0.5-1 s,
  and a dead I/O thread left its waiters, and the locks they held, waiting forever); see
  `_bound_pyghmi_io_waits`.
- **Errors.** pyghmi raises `IpmiException` with text (and sometimes an IPMI completion code);
  they map to: wrong password / unknown user / privilege refused -> `BmcAuthFailed`; session
  timeout, DNS or socket failure -> `BmcUnreachable`; completion codes busy (0xC0), timeout
  (0xC3), no response (0xCE), duplicate (0xCF), initialising (0xD2), no free session ->
  `BmcTransient`; invalid command / data field / not present / not supported now (0xC1, 0xC2,
  0xC9, 0xCB, 0xCC, 0xD5, 0xD6) -> `BmcUnsupported`; anything else -> `BmcProtocolError`.
- **Retries.** Reads (power state, read-backs, identify, info, sensors) retry transient
  failures with `with_retries`. A power command is sent at most once: never retried by Fleet.
  (Inside one call pyghmi retransmits an unanswered UDP datagram, as IPMI over UDP must; that
  is below Fleet and cannot be switched off. A command that got no answer within the deadline
  is reported as "may or may not have taken effect".)
- **Power actions** read the state first and send nothing when the server is already there;
  then send one Chassis Control (`set_power(..., wait=False)`: on, off, soft `shutdown`; raw
  chassis control 0x02 "power cycle", which pyghmi's `set_power` does not offer, with hard
  reset 0x03 as fallback where the BMC rejects a cycle), `wait=False`, and read the state back
  once. A cycle passes through "off" (ipmi_sim powers back on ~1 s later), so its read-back is
  repeated every 0.25 s for at most `cycle_settle_s` (3 s, capped by `timeouts.call`) until it
  reads "on"; a read-back that fails reports UNKNOWN rather than hiding that a command went out.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, TypeVar

from pyghmi import exceptions as pyghmi_exc
from pyghmi.ipmi import command as pyghmi_command
from pyghmi.ipmi.private import session as pyghmi_session

from fleet.bmc.base import (
    ActionResult,
    BmcAuthFailed,
    BmcError,
    BmcInfo,
    BmcProtocolError,
    BmcTarget,
    BmcTransient,
    BmcUnreachable,
    BmcUnsupported,
    PowerAction,
    PowerDriver,
    Sensors,
)
from fleet.bmc.retry import with_retries
from fleet.models import PowerState

LOGIN_ATTEMPTS = 3  # pyghmi's login race (see IpmiDriver._login)

T = TypeVar("T")
log = logging.getLogger(__name__)

# IPMI Chassis Control (netfn 0x00, command 0x02) data byte values.
_CHASSIS_CONTROL = 0x02
_POWER_CYCLE = 0x02
_HARD_RESET = 0x03

_TRANSIENT_CODES = {0xC0, 0xC3, 0xCE, 0xCF, 0xD2}
_UNSUPPORTED_CODES = {0xC1, 0xC2, 0xC9, 0xCB, 0xCC, 0xD5, 0xD6}

# pyghmi often raises with the completion code's text only (code 0): match the texts too
# (pyghmi's own wording, pyghmi/ipmi/private/constants.py and session.py).
_AUTH_TEXTS = (
    "incorrect password",
    "unauthorized name",
    "invalid username length",
    "unauthorized role",
    "invalid role",
    "privilege",  # "Insufficient privilege level ...", "Requested privilege level exceeds ..."
    "privelege",  # sic: "... while requesting privelege level 4 for admin"
    "password is too long",
    "wrong kg",
)
_TRANSIENT_TEXTS = (
    "node busy",
    "timeout while processing command",
    "command response could not be provided",
    "cannot execute duplicated request",
    "bmc initialization in progress",
    "insufficient resources",
)
_UNSUPPORTED_TEXTS = (
    "invalid command",
    "invalid data field in request",
    "requested sensor, data, or record not present",
    "command not supported in present state",
    "subfunction disabled or unavailable",
    "parameter out of range",
)
_UNREACHABLE_TEXTS = (
    "none",  # pyghmi's session gave up on an unanswered login: IpmiException(None)
    "timeout",
    "session no longer connected",
    "session failed to initialize",
    "session disconnected",
    "unable to transmit",
)

# Drivers holding each pyghmi session; the last one out logs the session out.
_registry_lock = threading.Lock()
_session_users: dict[Any, int] = {}
_bmc_locks: dict[tuple[str, int, str], threading.Lock] = {}


def _bound_pyghmi_io_waits(slice_s: float = 0.05) -> None:
    """Replace pyghmi 1.6's `session._io_wait` with one that never waits longer than `slice_s`.

    pyghmi parks a waiting caller on an event that only its I/O thread sets: when the answer
    is due or its deadline passes. Two faults follow, both seen here:

    - A lost wake-up: a caller registers its wait only after sending; when the answer arrives
      first (a BMC on the same host answers in microseconds), nobody wakes the caller until
      its retransmit deadline, 0.5-1 s later.
    - A wait forever: if the I/O thread dies (`_revive_io_thread` starts another, which knows
      nothing of the old one's waiters), every caller parked on it waits without end, and some
      wait holding pyghmi's process-wide locks (a session that times out inside another
      caller's event loop logs out under `WAITING_SESSIONS`), so every later IPMI call in the
      process stalls behind them.

    Every pyghmi caller of `_io_wait` loops and re-checks its packets and deadlines, so a wait
    that ends by itself after `slice_s` is always safe: the first fault costs at most
    `slice_s`, the second nothing. The protocol with the I/O thread is pyghmi's own: queue
    (deadline, event, address), and break its select() when this deadline is sooner than the
    one it sleeps to. Applied once, process-wide.
    """
    if getattr(getattr(pyghmi_session, "_io_wait", None), "fleet_bounded", False):
        return

    def _io_wait(timeout: float, myaddr: Any = None, evq: Any = None) -> None:
        woken = threading.Event()
        if evq is not None:
            evq.append(woken)
        wait = min(max(timeout, 0.001), slice_s)
        deadline = pyghmi_session._monotonic_time() + wait
        pyghmi_session.ioqueue.append((deadline, woken, myaddr))
        if deadline < pyghmi_session.selectdeadline:
            wake = pyghmi_session.iosockets[0]
            with contextlib.suppress(OSError):  # a closed wake socket: the wait still ends
                wake.sendto(b"\x01", (pyghmi_session.myself, wake.getsockname()[1]))
        woken.wait(wait)

    _io_wait.fleet_bounded = True  # type: ignore[attr-defined]
    pyghmi_session._io_wait = _io_wait


_bound_pyghmi_io_waits()


def _bmc_lock(key: tuple[str, int, str]) -> threading.Lock:
    with _registry_lock:
        return _bmc_locks.setdefault(key, threading.Lock())


def _acquire_session(session: Any) -> None:
    with _registry_lock:
        _session_users[session] = _session_users.get(session, 0) + 1


def _release_session(session: Any, key: tuple[str, int, str], *, logout: bool) -> None:
    """Drop one driver's hold on a pyghmi session. The last one out logs it out (`logout`)
    or, after a timeout or a broken connection, retires it without a word to the BMC."""
    with _bmc_lock(key):  # no new Command for this BMC picks up the session while it closes
        with _registry_lock:
            if _forget_user(session) > 0:
                return
        logged_in = bool(getattr(session, "logged", 0)) and not getattr(session, "broken", True)
        if logout and logged_in:
            with contextlib.suppress(Exception):  # best effort: the BMC times it out anyway
                session.logout()
        _retire(session)


def _break_logins(address: str, port: int, username: str) -> int:
    """Mark broken every pyghmi session still logging in to this BMC as this user; returns
    how many. pyghmi 1.6 can leave a login that nothing drives (out of its retransmit table,
    so it neither retries nor gives up) and a new Command for the same BMC then waits on that
    session: both wait for ever (seen here under load, against a healthy BMC too). Called
    under the BMC's lock before a login (no Fleet login to it is in progress then, so any is
    stale) and after a call timed out (its login, if any, is abandoned)."""
    table = pyghmi_session.Session
    found: list[Any] = []
    with contextlib.suppress(RuntimeError):  # the tables change under us: best effort
        found.extend(list(table.initting_sessions.values()))
        for handlers in list(table.bmc_handlers.values()):
            found.extend(list(handlers.values()))
    user = username.encode("utf-8")
    broken = 0
    for session in {id(s): s for s in found}.values():
        if (
            getattr(session, "bmc", None) == address
            and getattr(session, "port", None) == port
            and getattr(session, "userid", None) == user
            and getattr(session, "logging", False)
            and not getattr(session, "logged", 0)
            and not getattr(session, "broken", True)
        ):
            with contextlib.suppress(Exception):
                # "timeout": the waiting Command raises it, mapped to BmcUnreachable.
                session._mark_broken("login timeout: abandoned by Fleet")
            broken += 1
    return broken


def _retire(session: Any) -> None:
    """Take a session out of pyghmi's process-wide tables (keepalives, retransmit timers,
    the per-address handlers). pyghmi runs every session's keepalive and retransmit timer in
    whichever caller thread happens to be waiting, so a session left behind after a timeout
    would go on costing the healthy BMCs' calls time, for as long as the process lives."""
    if getattr(session, "broken", False) and not getattr(session, "logged", 0):
        return
    with contextlib.suppress(Exception):
        session.logged = 0  # so that pyghmi sends no logout to a BMC that does not answer
        session._mark_broken("session retired by Fleet")


def _revive_io_thread() -> None:
    """pyghmi receives every IPMI datagram of the process on one I/O thread; if that thread
    has died (e.g. `select()` raised), every IPMI call in the process would wait for answers
    nobody reads. Start a new one, once, and say so."""
    thread = pyghmi_session.iothread
    # Not started yet (`ident` is None: pyghmi assigns the thread before it starts it, while
    # another caller may be looking) is not dead.
    if thread is None or thread.ident is None or thread.is_alive():
        return
    with _registry_lock:
        if pyghmi_session.iothread is not thread:
            return  # another caller revived it
        dead = [s for s in pyghmi_session.iosockets if s.fileno() < 0]
        for sock in dead:
            pyghmi_session.iosockets.remove(sock)
        log.error(
            "pyghmi's I/O thread had died (%d closed sockets dropped); starting a new one",
            len(dead),
        )
        worker = pyghmi_session.define_worker()()
        worker.daemon = True
        pyghmi_session.iothreadready = False
        pyghmi_session.iothread = worker
        worker.start()


def _forget_user(session: Any) -> int:
    left = _session_users.get(session, 0) - 1
    if left > 0:
        _session_users[session] = left
    else:
        _session_users.pop(session, None)
    return max(left, 0)


def _one_line(text: object) -> str:
    return " ".join(str(text).split()) or "no detail"


def _as_power_state(value: object) -> PowerState:
    if value == "on":
        return PowerState.ON
    if value == "off":
        return PowerState.OFF
    return PowerState.UNKNOWN


class IpmiDriver(PowerDriver):
    """One BMC over IPMI lanplus. Synchronous; every call bounded by `timeouts.call`."""

    cycle_settle_s: ClassVar[float] = 3.0
    settle_poll_s: ClassVar[float] = 0.25

    def __init__(self, target: BmcTarget) -> None:
        super().__init__(target)
        self._lock = threading.Lock()
        self._cmd: Any = None
        self._generation = 0
        self._key = (target.address, target.port, target.username)

    # -----------------------------------------------------------------------------------------
    # PowerDriver

    def power_state(self) -> PowerState:
        return self._read(
            "power-state read", lambda cmd: _as_power_state(cmd.get_power()["powerstate"])
        )

    def power_on(self) -> ActionResult:
        before = self.power_state()
        if before is PowerState.ON:
            return ActionResult("on", sent=False, state_before=before, state_after=before)
        sent = self._send("power-on command", lambda cmd: self._set_power(cmd, "on"))
        return ActionResult("on", sent=sent, state_before=before, state_after=self._read_back())

    def power_off(self, force: bool = False) -> ActionResult:
        action: PowerAction = "force_off" if force else "off"
        before = self.power_state()
        if before is PowerState.OFF:
            return ActionResult(action, sent=False, state_before=before, state_after=before)
        # "off": Chassis Control power down (hard); "shutdown": soft off, an ACPI request to
        # the OS, which may take minutes (or be ignored): the read-back says what happened.
        pyghmi_state = "off" if force else "shutdown"
        what = "forced power-off command" if force else "soft shutdown command"
        sent = self._send(what, lambda cmd: self._set_power(cmd, pyghmi_state))
        return ActionResult(action, sent=sent, state_before=before, state_after=self._read_back())

    def power_cycle(self) -> ActionResult:
        before = self.power_state()
        if before is PowerState.OFF:  # nothing to cycle: simply power on
            sent = self._send("power-on command", lambda cmd: self._set_power(cmd, "on"))
            after = self._read_back()
            return ActionResult("cycle", sent=sent, state_before=before, state_after=after)
        self._send("power-cycle command", self._cycle)
        after = self._read_back()
        deadline = time.monotonic() + min(self.cycle_settle_s, self.target.timeouts.call)
        while after is not PowerState.ON and time.monotonic() + self.settle_poll_s < deadline:
            time.sleep(self.settle_poll_s)
            after = self._read_back()
        return ActionResult("cycle", sent=True, state_before=before, state_after=after)

    def identify(self, on: bool = True) -> None:
        # Chassis Identify "force on" (indefinitely) or off: idempotent, so retried like a read.
        self._read("identify command", lambda cmd: cmd.set_identify(on=on))

    def info(self) -> BmcInfo:
        firmware = self._optional("firmware read", _firmware_version)
        system = self._optional("FRU inventory read", _system_fru) or {}
        return BmcInfo(
            manufacturer=_field(system, "Manufacturer", "Board manufacturer"),
            model=_field(system, "Product name", "Model", "Board product name"),
            firmware=firmware,
            serial=_field(system, "Serial Number", "Board serial number"),
        )

    def sensors(self) -> Sensors:
        """Temperatures (°C) from the SDR's temperature sensors, and the server's draw (W):
        DCMI Get Power Reading where the BMC answers it (a reading of 0 counts as none), else
        the whole-system power sensor (`_system_watts`). The watts are what the BMC said,
        unchecked: the caller decides whether to believe them
        (fleet.power.readings.check_watts)."""
        readings = self._optional("sensor read", lambda cmd: list(cmd.get_sensor_data())) or []
        temperatures: dict[str, float] = {}
        watts: dict[str, float] = {}
        for reading in readings:
            value = getattr(reading, "value", None)
            if value is None or getattr(reading, "unavailable", False):
                continue
            name = str(getattr(reading, "name", "")).strip() or "sensor"
            units = getattr(reading, "units", "")
            if units == "°C":
                temperatures[name] = float(value)
            elif units == "°F":
                temperatures[name] = round((float(value) - 32.0) * 5.0 / 9.0, 2)
            elif units == "W":
                watts[name] = float(value)
        # DCMI "Get Power Reading" is the standard whole-system figure; else a power sensor.
        power = self._optional("DCMI power read", _dcmi_watts)
        if power is None:
            power = _system_watts(watts)
        return Sensors(temperatures_c=temperatures, power_w=power)

    def close(self) -> None:
        with self._lock:
            cmd, self._cmd = self._cmd, None
            self._generation += 1
        if cmd is None:
            return
        # Log out off the caller's thread: a stalled BMC must not hold close() up.
        self._release_off_thread(cmd, logout=True, wait_s=min(self.target.timeouts.call, 2.0))

    # -----------------------------------------------------------------------------------------
    # plumbing

    def _read(self, what: str, fn: Callable[[Any], T]) -> T:
        return with_retries(lambda: self._call(what, fn), self.target.timeouts)

    def _send(self, what: str, fn: Callable[[Any], T]) -> T:
        """A power command: exactly one attempt (a retry could switch a server twice)."""
        return self._call(what, fn, command=True)

    def _read_back(self) -> PowerState:
        """The state after a command was sent; UNKNOWN rather than an error, so that the
        caller still learns the command went out."""
        try:
            return self.power_state()
        except BmcError:
            return PowerState.UNKNOWN

    def _optional(self, what: str, fn: Callable[[Any], T]) -> T | None:
        """A read of something a BMC may not offer (FRU, SDRs, DCMI): None when it does not."""
        try:
            return self._read(what, fn)
        except (BmcUnsupported, BmcProtocolError):
            return None

    @staticmethod
    def _set_power(cmd: Any, state: str) -> bool:
        """pyghmi's set_power re-reads the state and sends nothing if it is already there:
        its answer says which (`pendingpowerstate` when a command went out)."""
        answer = cmd.set_power(state, wait=False)
        return isinstance(answer, dict) and "pendingpowerstate" in answer

    @staticmethod
    def _cycle(cmd: Any) -> bool:
        try:
            cmd.xraw_command(netfn=0x00, command=_CHASSIS_CONTROL, data=(_POWER_CYCLE,))
        except pyghmi_exc.IpmiException as exc:
            # Rejected outright (not executed): some BMCs offer only a hard reset.
            if getattr(exc, "ipmicode", 0) not in _UNSUPPORTED_CODES:
                raise
            cmd.xraw_command(netfn=0x00, command=_CHASSIS_CONTROL, data=(_HARD_RESET,))
        return True

    def _call(self, what: str, fn: Callable[[Any], T], *, command: bool = False) -> T:
        """Run `fn(pyghmi Command)` in a worker thread; wait at most `timeouts.call` s."""
        limit = self.target.timeouts.call
        _revive_io_thread()
        with self._lock:
            generation = self._generation
        box: dict[str, Any] = {}
        done = threading.Event()
        gave_up = threading.Event()

        def work() -> None:
            try:
                cmd, owned = self._command(generation, gave_up)
                box["connected"] = True
                try:
                    box["value"] = fn(cmd)
                finally:
                    if not owned:  # this call was abandoned meanwhile: do not keep a session
                        _release_session(cmd.ipmi_session, self._key, logout=True)
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        worker = threading.Thread(target=work, name=f"ipmi {self.target.server}", daemon=True)
        worker.start()
        if not done.wait(limit):
            gave_up.set()
            self._drop(generation)
            if "connected" not in box:  # still logging in, perhaps for ever: end that login
                self._break_logins_off_thread()
            hint = (
                "it may or may not have taken effect; read the power state before retrying"
                if command
                else "check the address, the UDP port and that IPMI over LAN is enabled"
            )
            raise BmcUnreachable(
                self.target, f"no answer within {limit:g} s to the {what} ({hint})"
            )
        if "error" in box:
            error = self._map_error(box["error"], what)
            if isinstance(error, BmcUnreachable | BmcAuthFailed):
                self._drop(generation)
            raise error from box["error"]
        value: T = box["value"]
        return value

    def _command(self, generation: int, gave_up: threading.Event) -> tuple[Any, bool]:
        """The driver's pyghmi Command, connecting on first use. Returns (command, owned):
        not owned when the call that asked was abandoned while connecting. Raises
        `BmcUnreachable` when its caller gave up (`gave_up`) before its turn to log in."""
        with self._lock:
            if self._cmd is not None and generation == self._generation:
                return self._cmd, True
        with _bmc_lock(self._key):
            if gave_up.is_set():
                # Abandoned while queued behind another login to this BMC: logging in now
                # would only hold the next caller up (a login to a dead BMC lasts as long as
                # pyghmi tries).
                raise BmcUnreachable(self.target, "login abandoned: the call timed out")
            _break_logins(*self._key)
            # Credentials as bytes: pyghmi (1.6) keys its session cache with the values given
            # but stores them encoded, so with str a second Command for the same BMC finds a
            # stale "logging in" entry and waits on it forever.
            cmd = self._login(gave_up)
            _acquire_session(cmd.ipmi_session)
        with self._lock:
            if generation == self._generation and self._cmd is None:
                self._cmd = cmd
                return cmd, True
        return cmd, False

    def _login(self, gave_up: threading.Event) -> Any:
        for attempt in range(LOGIN_ATTEMPTS):
            try:
                return pyghmi_command.Command(
                    bmc=self.target.address,
                    userid=self.target.username.encode("utf-8"),
                    password=self.target.password.encode("utf-8"),
                    port=self.target.port,
                )
            except AttributeError as exc:
                # pyghmi 1.6 can mark a failing login broken before it stores the reason, then
                # trip over its own missing `errormsg`. A login sends no power command, so
                # logging in again is safe, and tells the real cause. Under load it has
                # tripped twice in a row (CI, a wrong password): three tries in all.
                if "errormsg" not in str(exc) or attempt == LOGIN_ATTEMPTS - 1:
                    raise
                if gave_up.is_set():
                    # The call timed out and Fleet ended this login (`_break_logins`), which
                    # trips the same bug: a new login would wait on the same silent BMC with
                    # nobody left to end it, holding the BMC's lock.
                    raise BmcUnreachable(
                        self.target, "login abandoned: the call timed out"
                    ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _drop(self, generation: int) -> None:
        """Forget the session after a timeout or a broken connection: the next call reconnects."""
        with self._lock:
            if generation != self._generation:
                return
            cmd, self._cmd = self._cmd, None
            self._generation += 1
        if cmd is not None:
            # Off the caller's thread too: retiring takes the BMC's lock, which another
            # driver's login to this (hung) BMC may hold for as long as pyghmi tries.
            self._release_off_thread(cmd, logout=False, wait_s=min(self.target.timeouts.call, 0.5))

    def _break_logins_off_thread(self) -> None:
        """`_break_logins` without holding the caller up (it takes pyghmi's table locks)."""
        self._off_thread(_break_logins, *self._key, wait_s=min(self.target.timeouts.call, 0.5))

    def _release_off_thread(self, cmd: Any, *, logout: bool, wait_s: float) -> None:
        """`_release_session` off the caller's thread: done by `wait_s` when nothing holds the
        BMC's lock (so the next call logs in afresh), and never a caller held past its
        deadline when something does."""
        release = partial(_release_session, logout=logout)
        self._off_thread(release, cmd.ipmi_session, self._key, wait_s=wait_s)

    def _off_thread(self, fn: Callable[..., object], *args: Any, wait_s: float) -> None:
        """`fn(*args)` in a daemon thread, waited for at most `wait_s` s."""
        name = f"ipmi-release {self.target.server}"
        worker = threading.Thread(target=fn, args=args, name=name, daemon=True)
        worker.start()
        worker.join(wait_s)

    def _map_error(self, exc: BaseException, what: str) -> BmcError:
        target = self.target
        if isinstance(exc, BmcError):
            return exc
        if isinstance(exc, socket.gaierror):
            return BmcUnreachable(target, f"cannot resolve {target.address}: {_one_line(exc)}")
        if isinstance(exc, OSError):
            return BmcUnreachable(target, f"network error during {what}: {_one_line(exc)}")
        if isinstance(exc, pyghmi_exc.InvalidParameterValue | pyghmi_exc.UnsupportedFunctionality):
            return BmcUnsupported(target, f"{what} is not supported: {_one_line(exc)}")
        if not isinstance(exc, pyghmi_exc.IpmiException):
            return BmcProtocolError(
                target, f"unexpected answer to the {what}: {type(exc).__name__}: {_one_line(exc)}"
            )
        text = _one_line(exc.args[0] if exc.args else exc)
        lowered = text.lower()
        code = int(getattr(exc, "ipmicode", 0) or 0)
        if any(marker in lowered for marker in _AUTH_TEXTS):
            return BmcAuthFailed(
                target,
                f"authentication failed for user {target.username!r}: {text} "
                "(check the BMC credentials)",
            )
        if code in _TRANSIENT_CODES or any(m in lowered for m in _TRANSIENT_TEXTS):
            return BmcTransient(target, f"BMC busy during the {what}: {text}")
        if code in _UNSUPPORTED_CODES or any(m in lowered for m in _UNSUPPORTED_TEXTS):
            return BmcUnsupported(target, f"the BMC rejected the {what}: {text}")
        if code == 0xFFFF or lowered in _UNREACHABLE_TEXTS or _is_session_failure(lowered):
            return BmcUnreachable(
                target, f"no answer: the IPMI session failed during the {what} ({text})"
            )
        return BmcProtocolError(target, f"unexpected IPMI answer to the {what}: {text}")


def _is_session_failure(lowered: str) -> bool:
    return any(marker in lowered for marker in _UNREACHABLE_TEXTS[1:])


def _firmware_version(cmd: Any) -> str | None:
    for name, data in cmd.get_firmware():
        if name == "BMC Version" and isinstance(data, dict) and data.get("version"):
            return str(data["version"])
    return None


def _system_fru(cmd: Any) -> dict[str, Any] | None:
    # get_inventory yields ("System", FRU 0 + device id) first; the rest needs the SDRs.
    for name, data in cmd.get_inventory():
        if name == "System" and isinstance(data, dict):
            return data
        break
    return None


def _dcmi_watts(cmd: Any) -> float | None:
    value = cmd.get_system_power_watts()
    return float(value) if isinstance(value, int | float) and value > 0 else None


# Whole-system power sensors as vendors name them: "Total Power", "Sys Power", "Pwr
# Consumption" (Dell), "Power Meter" (HPE), "Platform Power", "Node Power", "Chassis Power".
_SYSTEM_POWER_NAME = re.compile(
    r"total|sys|platform|node|chassis|consumption|power ?meter|pwr ?meter", re.IGNORECASE
)
# Per-supply input power ("PS1 Input Power", "PSU2 In Power", "Power Supply 1 Input"): their sum
# is the wall draw when no whole-system sensor exists.
_SUPPLY_INPUT_NAME = re.compile(
    r"\b(?:ps|psu|pwr ?supply|power ?supply) ?\d+\b.*\b(?:in|input)\b", re.IGNORECASE
)


def _system_watts(watts: dict[str, float]) -> float | None:
    """A whole-system figure from power sensors (W): one whose name says it is the system's;
    else the sum of the supplies' input sensors (one supply's alone would understate a
    redundant pair by half); else the largest power sensor."""
    if not watts:
        return None
    named = [value for name, value in watts.items() if _SYSTEM_POWER_NAME.search(name)]
    if named:
        return max(named)
    supplies = [value for name, value in watts.items() if _SUPPLY_INPUT_NAME.search(name)]
    if supplies:
        return sum(supplies)
    return max(watts.values())


def _field(data: dict[str, Any], *names: str) -> str | None:
    for name in names:
        value = data.get(name)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if value is not None and str(value).strip():
            return _one_line(value)
    return None


__all__ = ["IpmiDriver"]
