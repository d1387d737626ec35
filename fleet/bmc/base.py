"""The contract every BMC driver keeps (docs/design.md, "PowerDriver").

Drivers are synchronous and blocking, one BMC each; concurrency and staggering live above them
(bulk actions run drivers in a bounded thread pool). A driver never assumes a power action
took effect: BMCs drop, delay and reorder resets, so every action reads the state back and
reports what it saw.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.models import BmcProtocol, PowerState

PowerAction = Literal["on", "off", "force_off", "cycle"]
# What may be asked of a BMC's power: an action, or a read of the state ("status").
Action = Literal["on", "off", "force_off", "cycle", "status"]
ACTIONS: tuple[Action, ...] = ("on", "off", "force_off", "cycle", "status")


# ---------------------------------------------------------------------------------------------
# Errors: few, with meaning. The message names the server, its BMC and what to try next.


class BmcError(Exception):
    """A BMC call failed; `str()` is one line naming the server, the BMC and the cause."""

    retryable = False

    def __init__(self, target: BmcTarget, cause: str) -> None:
        self.target = target
        self.cause = cause
        super().__init__(f"server {target.server} ({target.describe()}): {cause}")


class BmcUnreachable(BmcError):
    """Connection refused, DNS failure, or no answer within the timeout."""


class BmcAuthFailed(BmcError):
    """The BMC refused the credentials (an admin updates them with PATCH /servers/{name})."""


class BmcUnsupported(BmcError):
    """The BMC does not offer this action (e.g. a ResetType it does not advertise)."""


class BmcTransient(BmcError):
    """A failure worth retrying: HTTP 5xx/503, a busy BMC."""

    retryable = True


class BmcProtocolError(BmcError):
    """The BMC answered something this driver cannot make sense of."""


class BmcRefused(BmcError):
    """The fleet will not make this call at all, so nothing was sent: no password is stored
    (its BMC endpoint changed), or Redfish over plain HTTP without the inventory's opt-in."""


# ---------------------------------------------------------------------------------------------
# What a driver is given and what it returns


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. `call` bounds one request; retries of transient failures stop at `total`."""

    call: float = 10.0
    total: float = 30.0
    attempts: int = 3
    backoff: float = 0.5  # first retry delay; doubles, with full jitter


@dataclass(frozen=True, slots=True)
class BmcTarget:
    """One server's BMC, with its password decrypted (never logged, never in repr)."""

    server: str
    protocol: BmcProtocol
    address: str  # Redfish: host or URL (https:// unless a scheme is given); IPMI: host
    port: int
    username: str
    password: str = field(repr=False)
    system_id: str | None = None
    verify_tls: bool = True
    ca_bundle: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Redfish over http:// (the password in clear) only when the server's inventory entry
    # says so (`bmc.plain_http`); otherwise such an address is refused.
    plain_http: bool = False

    def describe(self) -> str:
        system = f" system {self.system_id}" if self.system_id else ""
        return f"{self.protocol.value} {self.address}:{self.port}{system}"


@dataclass(frozen=True, slots=True)
class ActionResult:
    """What a power action did: whether a command was sent, and the state read back after."""

    action: PowerAction
    sent: bool
    state_before: PowerState
    state_after: PowerState


@dataclass(frozen=True, slots=True)
class BmcInfo:
    manufacturer: str | None = None
    model: str | None = None
    firmware: str | None = None
    serial: str | None = None


@dataclass(frozen=True, slots=True)
class Sensors:
    """What a BMC reports. `power_w` is the server's input draw as the BMC gave it (None: it
    gives none), not checked: fleet.power.readings.check_watts decides whether it is believed."""

    temperatures_c: dict[str, float] = field(default_factory=dict)
    power_w: float | None = None


# ---------------------------------------------------------------------------------------------


class PowerDriver(abc.ABC):
    """One BMC. Asking for the state a server is already in sends no command."""

    def __init__(self, target: BmcTarget) -> None:
        self.target = target

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every driver's operations are timed and their errors counted: all BMC traffic passes
        here, whoever calls (fleet/bmc/metrics.py)."""
        super().__init_subclass__(**kwargs)
        from fleet.bmc.metrics import instrument_driver

        instrument_driver(cls)

    @abc.abstractmethod
    def power_state(self) -> PowerState: ...

    @abc.abstractmethod
    def power_on(self) -> ActionResult: ...

    @abc.abstractmethod
    def power_off(self, force: bool = False) -> ActionResult:
        """Graceful shutdown (ACPI) unless `force`."""

    @abc.abstractmethod
    def power_cycle(self) -> ActionResult:
        """Off then on (a hard reset where the BMC offers one); a server that is off is
        simply powered on."""

    def act(self, action: Action) -> ActionResult | PowerState:
        """The one place a power action is dispatched: "status" reads the state, the others
        act (each reads back what it did)."""
        if action == "status":
            return self.power_state()
        if action == "on":
            return self.power_on()
        if action == "off":
            return self.power_off(force=False)
        if action == "force_off":
            return self.power_off(force=True)
        if action == "cycle":
            return self.power_cycle()
        raise ValueError(f"unknown power action {action!r} (one of {', '.join(ACTIONS)})")

    @abc.abstractmethod
    def identify(self, on: bool = True) -> None:
        """Light (or put out) the chassis identify LED."""

    @abc.abstractmethod
    def info(self) -> BmcInfo: ...

    @abc.abstractmethod
    def sensors(self) -> Sensors: ...

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release sessions and sockets; drivers without any keep this no-op."""

    def __enter__(self) -> PowerDriver:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
