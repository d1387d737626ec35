"""Redfish power driver, on the DMTF `redfish` client (`redfish.redfish_client`).

One ComputerSystem behind one BMC: `target.system_id` (an id under /redfish/v1/Systems, or a
full path), else the single member of the service's Systems collection.

How this driver uses the library, and why:

- `max_retry=0`: the library otherwise repeats *every* request that raises (POST included) up
  to 10 times, a second apart, so a slow answer to a Reset could power-cycle a server twice and
  a dead BMC would take ten timeouts to give up. Idempotent reads are retried here instead, with
  `fleet.bmc.retry.with_retries` and only on transient failures (HTTP 5xx); a Reset is never
  re-sent.
- `timeout=target.timeouts.call`: handed to `requests` for every request (connect and each read).
- TLS: the library sends `verify=cafile if cafile else False`, i.e. it does NOT verify unless it
  is given a CA file (and it silences urllib3's InsecureRequestWarning on import). So this driver
  always passes one: `target.ca_bundle` when set (a PEM file or a c_rehash'd directory, both
  accepted by `requests`), else `REQUESTS_CA_BUNDLE`/`CURL_CA_BUNDLE` from the environment, else
  certifi's bundle. Verification is off only when `target.verify_tls` is False.
- Authentication: a Redfish session (`X-Auth-Token`) when the service root offers a
  SessionService (or answers 401 itself); a failed session login is an error, never a retry
  with basic auth (that would only send the password once more, to a BMC that is broken or
  not who it claims to be). Basic auth only when there is no SessionService (sushy-tools has
  none). Plain HTTP only for a server whose inventory entry opts in (`bmc.plain_http`):
  `base_url` refuses an http:// address otherwise, before anything is sent.
  Logging in is lazy (first call); `close()` deletes the session.

PowerState mapping: "On" -> on, "Off" -> off; the transitional "PoweringOn" -> on and
"PoweringOff" -> off (they name where the server is going, so asking for that state again sends
nothing); "Paused" -> on (it is powered); anything else, or no PowerState -> unknown.

A power action reads the state first and sends nothing when the server is already there. Then it
POSTs `#ComputerSystem.Reset` once, with a ResetType the system advertises
(`ResetType@Redfish.AllowableValues`, or the action's `@Redfish.ActionInfo`; when a system
advertises neither, the first preference is sent and the BMC's answer decides), and reads the
state back once. BMCs apply a Reset late (sushy-tools 1-11 s) so `state_after` may still be the
old state; callers that need the outcome poll `power_state()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import redfish
import requests.exceptions
import requests.utils
from redfish.rest.v1 import (
    InvalidCredentialsError,
    JsonDecodingError,
    RetriesExhaustedError,
    ServerDownOrUnreachableError,
)

from fleet.bmc.base import (
    ActionResult,
    BmcAuthFailed,
    BmcError,
    BmcInfo,
    BmcProtocolError,
    BmcRefused,
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

log = logging.getLogger(__name__)


class _MaskCredentials(logging.Filter):
    """The DMTF client logs each request's headers and body at DEBUG. It masks Authorization
    and a "Password" field, but not a session's X-Auth-Token, and its Password mask stops at
    the first quote inside a password. Mask both completely, keeping the rest for debugging."""

    _TOKEN = re.compile(r"(X-Auth-Token\s*:\s*)\S+", re.IGNORECASE)
    _PASSWORD = re.compile(r'("Password"\s*:\s*)"(?:[^"\\]|\\.)*"', re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = self._TOKEN.sub(r"\1<REDACTED>", message)
        masked = self._PASSWORD.sub(r'\1"<REDACTED>"', masked)
        if masked != message:
            record.msg, record.args = masked, None
        return True


logging.getLogger("redfish.rest.v1").addFilter(_MaskCredentials())

T = TypeVar("T")
Json = dict[str, Any]

SYSTEMS = "/redfish/v1/Systems"
ACCEPTED = (200, 202, 204)

POWER_STATES = {
    "On": PowerState.ON,
    "Off": PowerState.OFF,
    "PoweringOn": PowerState.ON,
    "PoweringOff": PowerState.OFF,
    "Paused": PowerState.ON,
}

# ResetType preferences, best first.
RESET_ON = ("On", "ForceOn")
RESET_GRACEFUL_OFF = ("GracefulShutdown",)
RESET_FORCE_OFF = ("ForceOff",)
RESET_HARD_CYCLE = ("ForceRestart", "PowerCycle")

# PowerSubsystem: supplies in these states draw nothing (empty bay, switched out, off-line).
NOT_DRAWING = ("Absent", "Disabled", "StandbyOffline", "UnavailableOffline")
MAX_POWER_SUPPLIES = 16  # bounds the GETs one reading may take


def base_url(target: BmcTarget) -> str:
    """scheme://host:port for `target`: https unless the server opted into plain HTTP
    (`target.plain_http`: http for a bare host) or `address` carries a scheme; a port in the
    address wins over `target.port`; any path (and user info) in the address is dropped.

    Plain HTTP sends the password in clear, so an http:// address without the opt-in is
    refused (BmcRefused): nothing is sent."""
    address = target.address.strip()
    if "://" not in address:
        host = address
        if ":" in host and not host.startswith("["):  # a bare IPv6 address
            host = f"[{host}]"
        return f"{'http' if target.plain_http else 'https'}://{host}:{target.port}"
    parts = urllib.parse.urlsplit(address)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise BmcRefused(target, "the BMC address is not an http(s) URL or a host name")
    if scheme == "http" and not target.plain_http:
        raise BmcRefused(
            target,
            "Redfish over plain HTTP (http://) would send the BMC password in clear: use "
            "https, or opt this server in with `bmc: {plain_http: true}` in its inventory "
            "entry (only for a BMC without TLS, such as a lab emulator); nothing was sent",
        )
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{parts.port if parts.port is not None else target.port}"


def ca_file(target: BmcTarget) -> str | None:
    """What to hand the library as `cafile` (None turns verification off: only on request)."""
    if not target.verify_tls:
        return None
    if target.ca_bundle:
        return target.ca_bundle
    from_env = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    return from_env or str(requests.utils.DEFAULT_CA_BUNDLE_PATH)


def _one_line(text: object, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _link(resource: Any, key: str) -> str | None:
    value = resource.get(key) if isinstance(resource, dict) else None
    if isinstance(value, dict) and isinstance(value.get("@odata.id"), str):
        return str(value["@odata.id"])
    return None


def _links(resource: Json, key: str) -> list[str]:
    links = resource.get("Links")
    members = links.get(key) if isinstance(links, dict) else None
    if not isinstance(members, list):
        return []
    return [str(m["@odata.id"]) for m in members if isinstance(m, dict) and "@odata.id" in m]


def _number(value: Any) -> float | None:
    """A JSON number as a float (bool is not one); anything else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).strip() or None


def _error_message(body: Any) -> str | None:
    """The message of a Redfish error body, if there is one."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    error = body["error"]
    info = error.get("@Message.ExtendedInfo")
    if isinstance(info, list) and info and isinstance(info[0], dict) and info[0].get("Message"):
        return str(info[0]["Message"])
    message = error.get("message")
    return str(message) if message else None


def _message_ids(body: Any) -> list[str]:
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return []
    info = body["error"].get("@Message.ExtendedInfo")
    ids = [str(m.get("MessageId", "")) for m in info or [] if isinstance(m, dict)]
    return [*ids, str(body["error"].get("code", ""))]


class RedfishDriver(PowerDriver):
    """A ComputerSystem's power, identify LED, inventory and sensors over Redfish."""

    def __init__(self, target: BmcTarget) -> None:
        super().__init__(target)
        self.url = base_url(target)
        self._client: Any = None
        self._auth: str | None = None  # "session" or "basic", once logged in
        self._system_path: str | None = None

    # -- power ---------------------------------------------------------------------------------

    def power_state(self) -> PowerState:
        _, system = self._system()
        return self._state_of(system)

    def power_on(self) -> ActionResult:
        return self._act("on", PowerState.ON, lambda _: RESET_ON)

    def power_off(self, force: bool = False) -> ActionResult:
        if force:
            return self._act("force_off", PowerState.OFF, lambda _: RESET_FORCE_OFF)
        return self._act("off", PowerState.OFF, lambda _: RESET_GRACEFUL_OFF)

    def power_cycle(self) -> ActionResult:
        return self._act(
            "cycle", None, lambda before: RESET_ON if before is PowerState.OFF else RESET_HARD_CYCLE
        )

    def _act(
        self,
        action: PowerAction,
        wanted: PowerState | None,
        preferences: Callable[[PowerState], tuple[str, ...]],
    ) -> ActionResult:
        path, system = self._system()
        before = self._state_of(system)
        if wanted is not None and before is wanted:
            log.debug("%s: already %s, nothing sent", self.target.server, wanted.value)
            return ActionResult(action=action, sent=False, state_before=before, state_after=before)
        target, allowed = self._reset_action(system)
        reset_type = self._choose(action, preferences(before), allowed)
        self._post_reset(target, reset_type)
        log.info("%s: sent Reset %s (%s)", self.target.server, reset_type, action)
        try:
            after = self._state_of(self._get(path, f"ComputerSystem {path}"))
        except BmcError as exc:
            # The Reset went out: report that, not a failure someone might "fix" by resending.
            log.warning(
                "%s: Reset %s sent, read-back failed: %s", self.target.server, reset_type, exc
            )
            after = PowerState.UNKNOWN
        return ActionResult(action=action, sent=True, state_before=before, state_after=after)

    def _state_of(self, system: Json) -> PowerState:
        value = system.get("PowerState")
        if not isinstance(value, str):
            return PowerState.UNKNOWN
        return POWER_STATES.get(value, PowerState.UNKNOWN)

    def _reset_action(self, system: Json) -> tuple[str, list[str] | None]:
        """The Reset action's target URI and the ResetTypes advertised (None: not advertised)."""
        actions = system.get("Actions")
        reset = actions.get("#ComputerSystem.Reset") if isinstance(actions, dict) else None
        if not isinstance(reset, dict):
            raise BmcUnsupported(self.target, "the ComputerSystem offers no #ComputerSystem.Reset")
        target = reset.get("target")
        if not isinstance(target, str) or not target:
            raise BmcProtocolError(self.target, "the #ComputerSystem.Reset action has no target")
        allowed = reset.get("ResetType@Redfish.AllowableValues")
        info_path = reset.get("@Redfish.ActionInfo")
        if allowed is None and isinstance(info_path, str):
            info = self._get(info_path, "the Reset ActionInfo")
            for parameter in info.get("Parameters") or []:
                if isinstance(parameter, dict) and parameter.get("Name") == "ResetType":
                    allowed = parameter.get("AllowableValues")
        if not isinstance(allowed, list):
            return target, None
        return target, [str(value) for value in allowed]

    def _choose(
        self, action: PowerAction, preferences: tuple[str, ...], allowed: list[str] | None
    ) -> str:
        if allowed is None:
            return preferences[0]
        for reset_type in preferences:
            if reset_type in allowed:
                return reset_type
        hint = ""
        if action == "off" and "ForceOff" in allowed:
            hint = "; a forced power-off (ForceOff) is available"
        raise BmcUnsupported(
            self.target,
            f"power {action} needs ResetType {' or '.join(preferences)}, but the system "
            f"advertises only {', '.join(allowed) or 'none'}{hint}",
        )

    def _post_reset(self, target: str, reset_type: str) -> None:
        """POST the Reset once. Never retried: a repeat could cycle a server twice."""
        what = f"Reset {reset_type}"
        try:
            resp = self._request("POST", target, what, body={"ResetType": reset_type})
        except BmcUnreachable as exc:
            raise BmcUnreachable(
                self.target, f"{exc.cause} (the Reset may still be applied: read the state)"
            ) from exc
        if resp.status in ACCEPTED:
            return
        body = self._body_or_none(resp)
        if resp.status == 501 or (
            resp.status == 400
            and any("NotInList" in m or "NotSupported" in m for m in _message_ids(body))
        ):
            detail = _error_message(body)
            raise BmcUnsupported(
                self.target,
                f"the BMC refused ResetType {reset_type} (HTTP {resp.status}"
                f"{': ' + _one_line(detail) if detail else ''})",
            )
        raise self._status_error(resp.status, what, body)

    # -- identify, info, sensors --------------------------------------------------------------

    def identify(self, on: bool = True) -> None:
        path, system, etag = self._system_with_etag()
        body: Json
        if "LocationIndicatorActive" in system:
            body = {"LocationIndicatorActive": on}
        elif "IndicatorLED" in system:
            body = {"IndicatorLED": "Lit" if on else "Off"}
        else:
            raise BmcUnsupported(
                self.target, "the ComputerSystem has no LocationIndicatorActive or IndicatorLED"
            )
        headers = {"If-Match": etag} if etag else None
        what = f"identify {'on' if on else 'off'}"
        resp = self._request("PATCH", path, what, body=body, headers=headers)
        if resp.status in ACCEPTED:
            return
        if resp.status in (405, 501):
            raise BmcUnsupported(self.target, f"the BMC refused {what} (HTTP {resp.status})")
        raise self._status_error(resp.status, what, self._body_or_none(resp))

    def info(self) -> BmcInfo:
        """Manufacturer, model and serial of the system; firmware is its BiosVersion, else the
        managing BMC's FirmwareVersion."""
        _, system = self._system()
        firmware = _text(system.get("BiosVersion"))
        if firmware is None:
            for manager in _links(system, "ManagedBy")[:1]:
                found = self._get_optional(manager, "the system's Manager")
                firmware = _text(found.get("FirmwareVersion")) if found else None
        return BmcInfo(
            manufacturer=_text(system.get("Manufacturer")),
            model=_text(system.get("Model")),
            firmware=firmware,
            serial=_text(system.get("SerialNumber")),
        )

    def sensors(self) -> Sensors:
        """Temperatures (°C, by sensor name) and power draw (W) of the system's first chassis:
        Thermal / ThermalSubsystem, and the chassis's input power (`_power_watts`). Missing ones
        are left out. The watts are what the BMC said, unchecked: the caller decides whether to
        believe them (fleet.power.readings.check_watts)."""
        _, system = self._system()
        chassis_paths = _links(system, "Chassis")
        if not chassis_paths:
            return Sensors()
        chassis_path = chassis_paths[0]
        chassis = self._get(chassis_path, "the Chassis")
        return Sensors(
            temperatures_c=self._temperatures(chassis),
            power_w=self._power_watts(chassis_path, chassis),
        )

    def _temperatures(self, chassis: Json) -> dict[str, float]:
        readings: list[tuple[str, str, float]] = []
        thermal_path = _link(chassis, "Thermal")
        thermal = self._get_optional(thermal_path, "the Chassis Thermal") if thermal_path else None
        if thermal:
            for sensor in thermal.get("Temperatures") or []:
                if not isinstance(sensor, dict):
                    continue
                value = sensor.get("ReadingCelsius")
                state = (sensor.get("Status") or {}).get("State")
                if isinstance(value, int | float) and state not in ("Absent", "Disabled"):
                    name = str(sensor.get("Name") or f"Temperature {sensor.get('MemberId')}")
                    readings.append((name, str(sensor.get("MemberId", len(readings))), value))
        else:
            subsystem_path = _link(chassis, "ThermalSubsystem")
            subsystem = (
                self._get_optional(subsystem_path, "the ThermalSubsystem")
                if subsystem_path
                else None
            )
            metrics_path = _link(subsystem, "ThermalMetrics") if subsystem else None
            metrics = (
                self._get_optional(metrics_path, "the ThermalMetrics") if metrics_path else None
            )
            for i, sensor in enumerate((metrics or {}).get("TemperatureReadingsCelsius") or []):
                if isinstance(sensor, dict) and isinstance(sensor.get("Reading"), int | float):
                    name = str(sensor.get("DeviceName") or f"Temperature {i}")
                    readings.append((name, str(i), sensor["Reading"]))
        names = [name for name, _, _ in readings]
        temperatures: dict[str, float] = {}
        for name, member, value in readings:
            key = name if names.count(name) == 1 else f"{name} ({member})"
            temperatures[key] = float(value)
        return temperatures

    def _power_watts(self, chassis_path: str, chassis: Json) -> float | None:
        """The chassis's input power draw in W, from the first source the chassis links that
        gives one, newest model first:

        1. EnvironmentMetrics `PowerWatts.Reading`: the chassis total (Redfish 2020.4 on);
        2. Power `PowerControl[0].PowerConsumedWatts`: deprecated but the most widespread; the
           first PowerControl is the system's input power by convention (later ones, where a
           BMC has them, are parts such as CPU or memory, so they are not summed or tried);
        3. PowerSubsystem: the sum of its power supplies' `Metrics.InputPowerWatts.Reading`
           (wall-side draw), only when every installed supply reports one: a partial sum would
           understate the draw.

        A chassis that links none of them gets one GET of `<chassis>/Power` (BMCs that serve it
        unlinked). None when no source gives a number."""
        metrics_path = _link(chassis, "EnvironmentMetrics")
        power_path = _link(chassis, "Power")
        subsystem_path = _link(chassis, "PowerSubsystem")
        if not (metrics_path or power_path or subsystem_path):
            power_path = f"{chassis_path.rstrip('/')}/Power"
        if metrics_path:
            metrics = self._get_optional(metrics_path, "the Chassis EnvironmentMetrics")
            reading = _number(((metrics or {}).get("PowerWatts") or {}).get("Reading"))
            if reading is not None:
                return reading
        if power_path:
            power = self._get_optional(power_path, "the Chassis Power")
            controls = (power or {}).get("PowerControl")
            if isinstance(controls, list) and controls and isinstance(controls[0], dict):
                reading = _number(controls[0].get("PowerConsumedWatts"))
                if reading is not None:
                    return reading
        if subsystem_path:
            return self._power_supplies_watts(subsystem_path)
        return None

    def _power_supplies_watts(self, subsystem_path: str) -> float | None:
        subsystem = self._get_optional(subsystem_path, "the Chassis PowerSubsystem")
        supplies_path = _link(subsystem, "PowerSupplies")
        collection = (
            self._get_optional(supplies_path, "the PowerSupplies collection")
            if supplies_path
            else None
        )
        members = [
            str(m["@odata.id"])
            for m in (collection or {}).get("Members") or []
            if isinstance(m, dict) and isinstance(m.get("@odata.id"), str)
        ]
        total: float | None = None
        for member in members[:MAX_POWER_SUPPLIES]:
            supply = self._get_optional(member, "a PowerSupply")
            if not supply:
                return None
            state = (supply.get("Status") or {}).get("State")
            if state in NOT_DRAWING:
                continue  # an empty bay or a supply switched out draws nothing
            supply_metrics = _link(supply, "Metrics")
            metrics = (
                self._get_optional(supply_metrics, "a PowerSupply's Metrics")
                if supply_metrics
                else None
            )
            reading = _number(((metrics or {}).get("InputPowerWatts") or {}).get("Reading"))
            if reading is None:
                return None  # an installed supply without a reading: the total is unknown
            total = reading if total is None else total + reading
        return total

    # -- the ComputerSystem --------------------------------------------------------------------

    def _system(self) -> tuple[str, Json]:
        path, system, _ = self._system_with_etag()
        return path, system

    def _system_with_etag(self) -> tuple[str, Json, str | None]:
        path = self._system_path or self._find_system()
        system, etag = self._get_with_etag(path, f"ComputerSystem {path}")
        canonical = system.get("@odata.id")
        if isinstance(canonical, str) and canonical.startswith("/"):
            path = canonical  # e.g. after a redirect from a name to the system's id
        self._system_path = path
        return path, system, etag

    def _find_system(self) -> str:
        system_id = self.target.system_id
        if system_id:
            if system_id.startswith("/"):
                return system_id
            return f"{SYSTEMS}/{urllib.parse.quote(system_id, safe='')}"
        collection_path = _link(self._connect_with_retries().root, "Systems") or SYSTEMS
        collection = self._get(collection_path, "the Systems collection")
        members = [
            str(m["@odata.id"])
            for m in collection.get("Members") or []
            if isinstance(m, dict) and "@odata.id" in m
        ]
        if len(members) != 1:
            ids = ", ".join(m.rstrip("/").rsplit("/", 1)[-1] for m in members[:5])
            more = ", …" if len(members) > 5 else ""
            listing = f" ({ids}{more})" if members else ""
            raise BmcProtocolError(
                self.target,
                f"{collection_path} has {len(members)} systems{listing}; "
                "set the server's BMC system_id to choose one",
            )
        return members[0]

    # -- requests ------------------------------------------------------------------------------

    def _get(self, path: str, what: str) -> Json:
        return self._get_with_etag(path, what)[0]

    def _get_with_etag(self, path: str, what: str) -> tuple[Json, str | None]:
        """GET a resource, retrying transient failures (bounded by the target's timeouts)."""

        def once() -> tuple[Json, str | None]:
            resp = self._request("GET", path, what)
            if resp.status != 200:
                raise self._status_error(resp.status, what, self._body_or_none(resp))
            etag = resp.getheader("ETag")
            return self._body(resp, what), str(etag) if etag else None

        return with_retries(once, self.target.timeouts)

    def _get_optional(self, path: str, what: str) -> Json | None:
        """Like `_get`, but a resource the BMC does not have (404, 405, 501) is None."""

        def once() -> Json | None:
            resp = self._request("GET", path, what)
            if resp.status in (404, 405, 501):
                return None
            if resp.status != 200:
                raise self._status_error(resp.status, what, self._body_or_none(resp))
            return self._body(resp, what)

        return with_retries(once, self.target.timeouts)

    def _request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        body: Json | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One request, no retries. A session that expired (401) is renewed once."""
        for attempt in (1, 2):
            client = self._connect()
            try:
                if method == "GET":
                    resp = client.get(path, headers=headers)
                elif method == "POST":
                    resp = client.post(path, body=body, headers=headers)
                elif method == "PATCH":
                    resp = client.patch(path, body=body, headers=headers)
                else:  # pragma: no cover
                    raise ValueError(method)
            except Exception as exc:
                raise self._map_exception(exc, what) from exc
            if resp.status == 401 and self._auth == "session" and attempt == 1:
                log.info("%s: session refused (401), logging in again", self.target.server)
                self.close()
                continue
            return resp
        raise AssertionError("unreachable")  # pragma: no cover

    def _body(self, resp: Any, what: str) -> Json:
        try:
            body = resp.dict
        except Exception as exc:
            raise BmcProtocolError(self.target, f"{what}: the answer is not JSON") from exc
        if not isinstance(body, dict):
            raise BmcProtocolError(self.target, f"{what}: the answer is not a JSON object")
        return body

    @staticmethod
    def _body_or_none(resp: Any) -> Any:
        try:
            return resp.dict
        except Exception:
            return None

    def _status_error(self, status: int, what: str, body: Any = None) -> BmcError:
        detail = _error_message(body)
        suffix = f": {_one_line(detail)}" if detail else ""
        if status in (401, 403):
            return BmcAuthFailed(
                self.target,
                f"HTTP {status} on {what}: the BMC refused user {self.target.username!r} "
                "(check the BMC credentials; an admin updates them with PATCH /servers/{name})",
            )
        if status == 501:
            return BmcUnsupported(self.target, f"{what}: not implemented by the BMC (HTTP 501)")
        if status >= 500:
            return BmcTransient(self.target, f"HTTP {status} on {what}{suffix}")
        if status == 404:
            hint = (
                " (check the server's BMC system_id)"
                if what.startswith("ComputerSystem ") and self.target.system_id
                else ""
            )
            return BmcProtocolError(self.target, f"{what} not found (HTTP 404){hint}")
        return BmcProtocolError(self.target, f"HTTP {status} on {what}{suffix}")

    def _map_exception(self, exc: BaseException, what: str) -> BmcError:
        """A library or transport exception as one of the BmcErrors."""
        if isinstance(exc, BmcError):
            return exc
        if isinstance(exc, InvalidCredentialsError):
            return self._status_error(401, what)
        if isinstance(exc, ServerDownOrUnreachableError):
            resp = getattr(exc, "response", None)
            status = getattr(resp, "status", None)
            if isinstance(status, int):
                return self._status_error(status, what, self._body_or_none(resp))
            return BmcUnreachable(self.target, f"{what}: {_one_line(exc)}")
        if isinstance(exc, JsonDecodingError):
            return BmcProtocolError(self.target, f"{what}: the answer is not JSON")
        cause = exc.__cause__ if isinstance(exc, RetriesExhaustedError) else exc
        call = self.target.timeouts.call
        if isinstance(cause, requests.exceptions.SSLError):
            return BmcUnreachable(
                self.target,
                f"TLS with {self.url} failed on {what}: {_tls_reason(cause)} (give the BMC's CA "
                "bundle; turn verify_tls off only for a BMC you accept unverified)",
            )
        if isinstance(cause, requests.exceptions.Timeout):
            return BmcUnreachable(self.target, f"no answer to {what} within {call:g} s")
        if isinstance(cause, requests.exceptions.ConnectionError):
            return BmcUnreachable(self.target, f"cannot connect to {self.url}: {_reason(cause)}")
        if isinstance(cause, requests.exceptions.RequestException):
            return BmcProtocolError(self.target, f"{what}: {_one_line(cause)}")
        if isinstance(exc, RetriesExhaustedError):
            return BmcUnreachable(self.target, f"{what}: no answer from {self.url}")
        return BmcProtocolError(self.target, f"{what}: {type(exc).__name__}: {_one_line(exc)}")

    # -- login and logout ----------------------------------------------------------------------

    def _connect_with_retries(self) -> Any:
        return with_retries(self._connect, self.target.timeouts)

    def _connect(self) -> Any:
        """The logged-in client (one service-root GET and a login, on first use)."""
        if self._client is not None:
            return self._client
        try:
            client = redfish.redfish_client(
                base_url=self.url,
                username=self.target.username,
                password=self.target.password,
                cafile=ca_file(self.target),
                timeout=self.target.timeouts.call,
                max_retry=0,
            )
        except Exception as exc:
            raise self._map_exception(exc, "the service root") from exc
        try:
            self._auth = self._login(client)
        except BaseException:
            with contextlib.suppress(Exception):
                client.logout()
            raise
        self._client = client
        return client

    def _login(self, client: Any) -> str:
        root = client.root if isinstance(client.root, dict) else {}
        links = root.get("Links")
        # An empty root: the BMC wanted credentials even for it (the library allows that);
        # try a session at the standard URI then too.
        offers_sessions = (
            not root
            or "SessionService" in root
            or (isinstance(links, dict) and "Sessions" in links)
        )
        if offers_sessions:
            # No fallback to basic auth: a BMC that offers sessions and refuses one is broken
            # or not who it claims to be, and a retry would only send the password again.
            try:
                client.login(auth=redfish.AuthMethod.SESSION)
            except Exception as exc:
                raise self._login_error(exc, "the session login") from exc
            if not client.get_session_key():
                raise BmcProtocolError(
                    self.target, "the session login answered without a session token"
                )
            return "session"
        # No SessionService: basic auth on every request. base_url() has already refused
        # plain HTTP unless the server opted in, so this is over TLS or in the lab.
        try:
            client.login(auth=redfish.AuthMethod.BASIC)
        except Exception as exc:
            raise self._login_error(exc, "the basic-auth login") from exc
        return "basic"

    def _login_error(self, exc: BaseException, what: str) -> BmcError:
        if isinstance(exc, InvalidCredentialsError):
            return BmcAuthFailed(
                self.target,
                f"the BMC refused user {self.target.username!r} on {what} (HTTP 401; check "
                "the BMC credentials; an admin updates them with PATCH /servers/{name})",
            )
        mapped = self._map_exception(exc, what)
        if type(mapped) is BmcProtocolError and what == "the session login":
            return BmcProtocolError(self.target, f"{mapped.cause} (no fallback to basic auth)")
        return mapped

    def close(self) -> None:
        """Delete the Redfish session (if any) and close the connection pool."""
        client, self._client, self._auth = self._client, None, None
        if client is None:
            return
        try:
            client.logout()
        except Exception as exc:
            log.info("%s: logout failed: %s", self.target.server, _one_line(exc, 120))
            with contextlib.suppress(Exception):
                client._session.close()


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError):
            return "connection refused"
        if isinstance(current, ConnectionResetError):
            return "connection reset"
        if isinstance(current, OSError) and "Name or service not known" in str(current):
            return "unknown host"
        current = current.__cause__ or current.__context__
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "No route to host"):
        if marker in text:
            return marker.lower()
    return _one_line(text, 160)


def _tls_reason(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("certificate verify failed", "CERTIFICATE_VERIFY_FAILED", "hostname mismatch"):
        if marker in text:
            start = text.find(marker)
            return _one_line(text[start:].split("(_ssl")[0].rstrip(" )'\""), 120)
    return _one_line(text, 160)
