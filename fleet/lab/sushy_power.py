"""LAB EXTENSION of sushy-tools' Redfish emulator: a chassis per system, with a Power resource
that serves the draw the virtual colo models. Not part of sushy-tools and not hardware.

sushy-tools (2.x) has no Power resource, and its fake driver links every ComputerSystem to one
shared chassis (the first of SUSHY_EMULATOR_CHASSIS, "SheetMetalChassis" by default), like the
servers of a blade enclosure. A rack of GPU servers is one chassis per server, each with its own
power reading, so this wrapper runs sushy-tools' own Flask app with four changes, all inside
this process and only when the configuration sets FLEET_LAB_POWER_DIR (without it, this is
plain sushy-emulator):

- `GET /redfish/v1/Systems/<uuid>` links the system to its own chassis,
  `/redfish/v1/Chassis/<uuid>` (the system's uuid: a rack server and its chassis are one box);
- `GET /redfish/v1/Chassis/<uuid>` serves that chassis: RackMount, containing the system,
  contained by sushy's chassis, its Thermal link pointing at sushy's (static) Thermal, and a
  `Power` link only while the system has a watts file;
- `GET /redfish/v1/Chassis/<uuid>/Power` serves `PowerControl[0].PowerConsumedWatts` from
  `FLEET_LAB_POWER_DIR/<uuid>.watts` (a number as text, written by
  fleet.lab.sushy.SushyEmulator.set_power_watts); no file: 404, the driver reads no power;
- the Chassis collection lists the per-system chassis after sushy's own.

Nothing here reads a system's power state: in sushy's fake driver a read applies a pending
Reset, and the colo decides when that happens (fleet/lab/colo.py). The watts file is read on
every request, so a change shows at once. A file holding something that is not a number is
served as no reading; a number is served as it is, nonsense included (the lab can play a BMC
that answers negative or absurd watts, which the fleet must refuse).

    python -m fleet.lab.sushy_power --config sushy-emulator.conf   # sushy-emulator's arguments
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flask
from sushy_tools.emulator import main as sushy

POWER_DIR_SETTING = "FLEET_LAB_POWER_DIR"
CHASSIS = "/redfish/v1/Chassis"
SYSTEMS = "/redfish/v1/Systems"
LAB_NOTE = "fleet lab extension of sushy-tools: one emulated server's chassis"


def watts_file(power_dir: Path | str, system: str) -> Path:
    """Where the watts of `system` (its uuid) are kept."""
    return Path(power_dir) / f"{system}.watts"


def read_watts(power_dir: Path | str, system: str) -> float | None:
    """The figure in the system's watts file; None when there is no file or no number in it."""
    try:
        text = watts_file(power_dir, system).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _power_dir() -> str | None:
    value = flask.current_app.config.get(POWER_DIR_SETTING)
    return str(value) if value else None


def _systems() -> dict[str, str]:
    """The fake driver's systems as configured: uuid -> name (no state is read)."""
    if not flask.current_app.config.get("SUSHY_EMULATOR_FAKE_DRIVER"):
        return {}
    found: dict[str, str] = {}
    for system in flask.current_app.config.get("SUSHY_EMULATOR_FAKE_SYSTEMS") or []:
        if isinstance(system, dict) and isinstance(system.get("uuid"), str):
            found[system["uuid"]] = str(system.get("name") or system["uuid"])
    return found


def _json(body: Any, status: int = 200) -> flask.Response:
    # allow_nan: a nonsense figure (NaN, inf) is served as a BMC with a bug would send it.
    text = json.dumps(body, allow_nan=True)
    return flask.Response(response=text, status=status, content_type="application/json")


def _not_found(what: str) -> flask.Response:
    return _json(
        {
            "error": {
                "code": "Base.1.0.GeneralError",
                "message": f"{what} not found",
                "@Message.ExtendedInfo": [
                    {"MessageId": "Base.1.0.ResourceMissingAtURI", "Message": f"{what} not found"}
                ],
            }
        },
        404,
    )


def _sushy_chassis() -> str | None:
    """sushy's own first chassis (the one it links every system to)."""
    chassis = sushy.app.chassis.chassis
    return str(chassis[0]) if chassis else None


def chassis_body(system: str, name: str, power_dir: str) -> dict[str, Any]:
    path = f"{CHASSIS}/{system}"
    body: dict[str, Any] = {
        "@odata.type": "#Chassis.v1_14_0.Chassis",
        "@odata.id": path,
        "Id": system,
        "Name": f"{name} chassis",
        "Description": LAB_NOTE,
        "ChassisType": "RackMount",
        "Status": {"State": "Enabled", "Health": "OK"},
        "Links": {"ComputerSystems": [{"@odata.id": f"{SYSTEMS}/{system}"}]},
    }
    outer = _sushy_chassis()
    if outer is not None:
        body["Links"]["ContainedBy"] = {"@odata.id": f"{CHASSIS}/{outer}"}
        body["Thermal"] = {"@odata.id": f"{CHASSIS}/{outer}/Thermal"}
    if read_watts(power_dir, system) is not None:
        body["Power"] = {"@odata.id": f"{path}/Power"}
    return body


def power_body(system: str, watts: float) -> dict[str, Any]:
    path = f"{CHASSIS}/{system}/Power"
    value: float | int = int(watts) if math.isfinite(watts) and watts.is_integer() else watts
    return {
        "@odata.type": "#Power.v1_7_1.Power",
        "@odata.id": path,
        "Id": "Power",
        "Name": "Power",
        "Description": f"fleet lab: the draw the virtual colo models for this server ({LAB_NOTE})",
        "PowerControl": [
            {
                "@odata.id": f"{path}#/PowerControl/0",
                "MemberId": "0",
                "Name": "System Input Power",
                "PowerConsumedWatts": value,
                "RelatedItem": [
                    {"@odata.id": f"{SYSTEMS}/{system}"},
                    {"@odata.id": f"{CHASSIS}/{system}"},
                ],
                "Status": {"State": "Enabled", "Health": "OK"},
            }
        ],
    }


# ---------------------------------------------------------------------------------------------
# The four changes to sushy's app


def _wrap(endpoint: str, wrapper: Callable[..., Any]) -> None:
    original = sushy.app.view_functions[endpoint]
    sushy.app.view_functions[endpoint] = lambda **kwargs: wrapper(original, **kwargs)


def _system_resource(original: Callable[..., Any], **kwargs: Any) -> Any:
    response = original(**kwargs)
    power_dir = _power_dir()
    if (
        power_dir is None
        or flask.request.method != "GET"
        or not isinstance(response, flask.Response)
        or response.status_code != 200
    ):
        return response
    body = json.loads(response.get_data())
    system = str(body.get("Id"))
    if system in _systems():
        body.setdefault("Links", {})["Chassis"] = [{"@odata.id": f"{CHASSIS}/{system}"}]
        response.set_data(json.dumps(body))
    return response


def _chassis_resource(original: Callable[..., Any], **kwargs: Any) -> Any:
    power_dir = _power_dir()
    identity = str(kwargs.get("identity"))
    systems = _systems()
    if power_dir is None or identity not in systems:
        return original(**kwargs)
    if flask.request.method != "GET":
        return _json({"error": {"code": "Base.1.0.GeneralError", "message": "read only"}}, 405)
    return _json(chassis_body(identity, systems[identity], power_dir))


def _chassis_collection(original: Callable[..., Any], **kwargs: Any) -> Any:
    response = original(**kwargs)
    if _power_dir() is None or not isinstance(response, flask.Response):
        return response
    if response.status_code != 200:
        return response
    body = json.loads(response.get_data())
    members = list(body.get("Members") or [])
    members += [{"@odata.id": f"{CHASSIS}/{system}"} for system in _systems()]
    body["Members"], body["Members@odata.count"] = members, len(members)
    response.set_data(json.dumps(body))
    return response


def power_resource(identity: str) -> flask.Response:
    power_dir = _power_dir()
    if power_dir is None or identity not in _systems():
        return _not_found(f"{CHASSIS}/{identity}/Power")
    watts = read_watts(power_dir, identity)
    if watts is None:
        return _not_found(f"{CHASSIS}/{identity}/Power")
    return _json(power_body(identity, watts))


def install() -> None:
    """Patch sushy's app (once): the routes above. Idempotent."""
    app = sushy.app
    if "fleet_lab_power" in app.view_functions:
        return
    _wrap("system_resource", _system_resource)
    _wrap("chassis_resource", _chassis_resource)
    _wrap("chassis_collection_resource", _chassis_collection)
    app.add_url_rule(
        f"{CHASSIS}/<identity>/Power",
        endpoint="fleet_lab_power",
        view_func=power_resource,
        methods=["GET"],
    )


def main() -> int:
    install()
    result: int = sushy.main()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
