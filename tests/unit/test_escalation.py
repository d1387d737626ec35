"""The escalation rule (fleet/provisioning/escalation.py): power cycle, count, quarantine."""

from __future__ import annotations

from fleet.provisioning.escalation import escalate


def test_a_first_fault_power_cycles_and_counts_one() -> None:
    r = escalate("reboot", "xid_79", reboot_fault=None, reboot_count=0, max_reboots=2)
    assert (r.quarantine, r.reboot_count, r.reboot_fault) == (False, 1, "xid_79")
    assert r.why == "remediation: power cycle (reboot 1 for xid_79)"


def test_the_same_fault_counts_up_then_quarantines() -> None:
    history: tuple[str | None, int] = (None, 0)
    steps = []
    for _ in range(4):
        r = escalate(
            "reboot", "xid_48", reboot_fault=history[0], reboot_count=history[1], max_reboots=2
        )
        steps.append((r.quarantine, r.reboot_count))
        if r.quarantine:
            break
        history = (r.reboot_fault, r.reboot_count)
    assert steps == [(False, 1), (False, 2), (True, 2)]
    assert r.why == "quarantined: xid_48 again after 2 reboots"


def test_a_different_fault_starts_the_count_again() -> None:
    r = escalate("reboot", "xid_79", reboot_fault="xid_48", reboot_count=2, max_reboots=2)
    assert (r.quarantine, r.reboot_count, r.reboot_fault) == (False, 1, "xid_79")


def test_hardware_inspection_quarantines_at_once() -> None:
    r = escalate("hardware_inspection", "xid_64", reboot_fault=None, reboot_count=0, max_reboots=2)
    assert r.quarantine and r.reboot_count == 0
    assert r.why == "quarantined: xid_64 needs hardware inspection"


def test_no_reboots_allowed_quarantines_a_repeat_only() -> None:
    first = escalate(
        "reboot", "missed_heartbeats", reboot_fault=None, reboot_count=0, max_reboots=0
    )
    again = escalate(
        "reboot",
        "missed_heartbeats",
        reboot_fault="missed_heartbeats",
        reboot_count=0,
        max_reboots=0,
    )
    assert not first.quarantine and again.quarantine
