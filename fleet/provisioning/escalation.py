"""The escalation rule: what a drained, faulty server gets next — a power cycle or quarantine.

PURE: plain data in, plain data out. The provisioner (fleet/provisioning/tick.py) applies it
when a
remediation drain is over, and the simulator (fleet/sim/faults.py) imports it, so both escalate
the same way.

An agent sees one boot of one server and forgets across reboots, so escalation is the fleet's:
the server row keeps the fault that caused its last power cycle (`reboot_fault`) and how many
cycles in a row that same fault has caused (`reboot_count`).

- The agent asks for `hardware_inspection` (Xid 64, failed row remapping, a cooling fault): a
  reboot does not fix it → quarantine.
- The same fault again after `max_reboots` power cycles for it → quarantine.
- Otherwise → power cycle; the count goes up when the fault is the same as last time and
  starts again at 1 when it is a different one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Remedy", "escalate"]


@dataclass(frozen=True, slots=True)
class Remedy:
    quarantine: bool
    reboot_count: int  # the server's count after this step
    reboot_fault: str | None  # the fault the count is for after this step
    why: str  # one line for the event log


def escalate(
    action: str | None,
    fault: str | None,
    *,
    reboot_fault: str | None,
    reboot_count: int,
    max_reboots: int,
) -> Remedy:
    """The next step for a server drained for remediation.

    `action` is the agent's repair action, `fault` what the drain was for (the reasons' codes,
    or "missed_heartbeats"), and `reboot_fault` / `reboot_count` the server's history."""
    same = fault == reboot_fault
    if action == "hardware_inspection":
        return Remedy(
            True, reboot_count, reboot_fault, f"quarantined: {fault} needs hardware inspection"
        )
    if reboot_count >= max_reboots and same:
        return Remedy(
            True,
            reboot_count,
            reboot_fault,
            f"quarantined: {fault} again after {reboot_count} reboots",
        )
    count = reboot_count + 1 if same else 1
    return Remedy(False, count, fault, f"remediation: power cycle (reboot {count} for {fault})")
