"""Power control through server BMCs: Redfish (DMTF `redfish`) and IPMI (`pyghmi`).

`driver_for(target)` picks the implementation; everything above it speaks `PowerDriver`.
"""

from __future__ import annotations

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
    PowerDriver,
    Sensors,
    Timeouts,
)
from fleet.models import BmcProtocol


def driver_for(target: BmcTarget) -> PowerDriver:
    # Imported here: each backend pulls in its protocol library only when used.
    if target.protocol is BmcProtocol.REDFISH:
        from fleet.bmc.redfish import RedfishDriver

        return RedfishDriver(target)
    if target.protocol is BmcProtocol.IPMI:
        from fleet.bmc.ipmi import IpmiDriver

        return IpmiDriver(target)
    raise ValueError(f"no driver for BMC protocol {target.protocol!r}")


__all__ = [
    "ActionResult",
    "BmcAuthFailed",
    "BmcError",
    "BmcInfo",
    "BmcProtocolError",
    "BmcRefused",
    "BmcTarget",
    "BmcTransient",
    "BmcUnreachable",
    "BmcUnsupported",
    "PowerDriver",
    "Sensors",
    "Timeouts",
    "driver_for",
]
