"""The virtual colo's hardware: real BMC emulators (sushy-tools, ipmi_sim) started as child
processes on 127.0.0.1, and the colo (`fleetctl lab`) that hangs simulated GPU servers (an agent
with simulated GPUs and stand-in engines) off their power buttons. Tests use the emulators as real
protocol peers.

    colo.py       VirtualColo: the emulators, the power watch, an agent per powered-on server
    state.py      the lab-state file (lab.json) and what other processes read from it
    processes.py  child-process plumbing: identity, death with the parent, groups, /proc usage
    notices.py    the receiver of sushy-emulator's power notices
    sushy.py      the Redfish emulator (sushy-tools); ipmi_sim.py: the IPMI emulator
    sushy_power.py  the lab's Power extension of sushy-tools (a chassis per system, its draw)
    harness.py    the fleet's own processes (service, router, lab) for tests, bench and demo
    ssh_hosts.py  SSH mode: each server's OS as a real sshd in its own mount+PID namespace
    standin_systemd.py  the STAND-IN systemctl/journalctl those hosts run (not systemd)
"""

from __future__ import annotations

from fleet.errors import FleetError


class LabError(FleetError):
    """A lab operation that cannot be done; the message says what to do instead."""
