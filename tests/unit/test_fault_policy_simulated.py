"""The fault policy driven through the simulated backend's fault injection.

Every rule of fleet_core/fault_policy.py once more, but with the snapshots a `SimulatedTelemetry`
produces after `inject()`: a fake clock advanced by the test, a snapshot every 5 s of fake time
into a history list, then `assess()`. Nothing sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fleet_agent.telemetry.simulated import Fault, SimulatedTelemetry
from fleet_core.fault_policy import (
    APPLICATION_XIDS,
    REBOOT_XIDS,
    Assessment,
    RepairAction,
    Thresholds,
    Verdict,
    assess,
)
from fleet_core.telemetry import ClockEvent, Snapshot

T0 = 1_700_000_000.0
PERIOD = 5.0  # seconds of fake time between snapshots
WINDOW = Thresholds().window_s

H = Verdict.HEALTHY
D = Verdict.DEGRADED
U = Verdict.UNHEALTHY


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Rig:
    """A simulated 8-GPU H100 server, its fake clock, and the agent's snapshot history."""

    def __init__(
        self,
        gpus: int = 8,
        *,
        load: Callable[[], float] | None = None,
        fault_file: Path | None = None,
        seed: int = 0,
    ) -> None:
        self.clock = FakeClock()
        self.telemetry = SimulatedTelemetry(
            "H100", gpus, fault_file=fault_file, clock=self.clock, load=load, seed=seed
        )
        self.history: list[Snapshot] = [self.telemetry.snapshot()]

    def step(self, seconds: float = PERIOD) -> Snapshot:
        self.clock.now += seconds
        snapshot = self.telemetry.snapshot()
        self.history.append(snapshot)
        return snapshot

    def run(self, seconds: float) -> None:
        """Snapshots every PERIOD for `seconds` of fake time."""
        for _ in range(round(seconds / PERIOD)):
            self.step()

    def inject(self, kind: str, **fields: object) -> None:
        self.telemetry.inject(Fault.from_dict({"kind": kind, **fields}))

    def assess(self, *, expected_gpus: int | None = None) -> Assessment:
        return assess(self.history, expected_gpus=expected_gpus)


def bus(rig: Rig, gpu: int) -> str:
    pci = rig.history[-1].gpus[gpu].pci_bus_id
    assert pci is not None
    return pci


def expect(
    result: Assessment,
    verdict: Verdict,
    action: RepairAction,
    reasons: list[tuple[str, int | None]],
) -> None:
    assert (result.verdict, result.action) == (verdict, action), result
    assert [(r.code, r.gpu) for r in result.reasons] == reasons, result


@pytest.fixture
def rig() -> Rig:
    """Two quiet minutes of history already taken."""
    server = Rig()
    server.run(120)
    return server


# --- no fault ------------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [0.0, 0.5, 1.0])
def test_a_quiet_simulated_server_is_healthy_at_any_load(load: float) -> None:
    server = Rig(load=lambda: load)
    server.run(2 * WINDOW)
    expect(server.assess(expected_gpus=8), H, RepairAction.NONE, [])


# --- Xids --------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(APPLICATION_XIDS))
def test_application_xid_restarts_the_engine(rig: Rig, code: int) -> None:
    rig.inject("xid", gpu=4, xid=code)
    rig.run(30)
    result = rig.assess()
    expect(result, D, RepairAction.RESTART_ENGINE, [("xid_app", 4)])
    assert result.reasons[0].message.startswith(f"GPU 4 ({bus(rig, 4)}): Xid {code} — ")


def test_application_xids_never_reboot(rig: Rig) -> None:
    for code in sorted(APPLICATION_XIDS):
        rig.inject("xid", gpu=1, xid=code, count=10)
        rig.run(20)
    result = rig.assess()
    assert (result.verdict, result.action) == (D, RepairAction.RESTART_ENGINE)
    assert {r.code for r in result.reasons} == {"xid_app"}


@pytest.mark.parametrize("code", sorted(REBOOT_XIDS))
def test_reset_xid_reboots(rig: Rig, code: int) -> None:
    rig.inject("xid", gpu=2, xid=code)
    rig.run(30)
    result = rig.assess()
    expect(result, U, RepairAction.REBOOT, [(f"xid_{code}", 2)])
    assert result.reasons[0].message.startswith(f"GPU 2 ({bus(rig, 2)}): Xid {code} — ")


def test_xid_79_message(rig: Rig) -> None:
    rig.inject("xid", gpu=2, xid=79)
    rig.step()
    (reason,) = rig.assess().reasons
    assert reason.message == "GPU 2 (00000000:52:00.0): Xid 79 — GPU has fallen off the bus"


def test_xid_64_needs_hardware_inspection(rig: Rig) -> None:
    rig.inject("xid", gpu=6, xid=64)
    rig.run(30)
    expect(rig.assess(), U, RepairAction.HARDWARE_INSPECTION, [("xid_64", 6)])


def test_xid_63_alone_is_informational(rig: Rig) -> None:
    rig.inject("xid", gpu=3, xid=63)
    rig.run(30)
    expect(rig.assess(), H, RepairAction.NONE, [])


def test_xid_63_with_a_pending_remap_reboots(rig: Rig) -> None:
    rig.inject("xid", gpu=3, xid=63)
    rig.inject("remap_pending", gpu=3)
    rig.run(30)
    expect(rig.assess(), U, RepairAction.REBOOT, [("remap_pending", 3)])


@pytest.mark.parametrize(
    ("count", "verdict", "action", "reasons"),
    [
        (3, H, RepairAction.NONE, []),
        (4, U, RepairAction.REBOOT, [("xid_94_rate", 5)]),
    ],
    ids=["at-limit", "over-limit"],
)
def test_xid_94_only_past_the_rate_limit(
    rig: Rig,
    count: int,
    verdict: Verdict,
    action: RepairAction,
    reasons: list[tuple[str, int | None]],
) -> None:
    for _ in range(count):  # one every 30 s
        rig.inject("xid", gpu=5, xid=94)
        rig.run(30)
    expect(rig.assess(), verdict, action, reasons)


def test_xid_94_burst_in_one_snapshot_counts_each_event(rig: Rig) -> None:
    rig.inject("xid", gpu=5, xid=94, count=4)
    rig.step()
    expect(rig.assess(), U, RepairAction.REBOOT, [("xid_94_rate", 5)])


def test_xid_94_older_than_the_window_no_longer_counts(rig: Rig) -> None:
    rig.inject("xid", gpu=5, xid=94, count=2)
    rig.run(WINDOW / 2)
    rig.inject("xid", gpu=5, xid=94, count=2)
    rig.run(30)
    expect(rig.assess(), U, RepairAction.REBOOT, [("xid_94_rate", 5)])
    rig.run(WINDOW / 2)  # the first pair is now older than the window
    expect(rig.assess(), H, RepairAction.NONE, [])


def test_unclassified_xid_is_recorded_without_action(rig: Rig) -> None:
    rig.inject("xid", gpu=0, xid=61)
    rig.run(30)
    result = rig.assess()
    expect(result, D, RepairAction.NONE, [("xid_other", 0)])
    assert "simulated Xid 61" in result.reasons[0].message


def test_xid_expires_with_the_window(rig: Rig) -> None:
    rig.inject("xid", gpu=2, xid=79)
    rig.step()  # the snapshot carrying the Xid
    rig.run(WINDOW)  # exactly one window later: still in (the window is inclusive)
    expect(rig.assess(), U, RepairAction.REBOOT, [("xid_79", 2)])
    rig.step()
    expect(rig.assess(), H, RepairAction.NONE, [])


# --- ECC and row remapping ---------------------------------------------------------------------


def test_rising_uncorrected_ecc_reboots(rig: Rig) -> None:
    rig.inject("ecc_uncorrected", gpu=7, count=2)
    rig.run(30)
    result = rig.assess()
    expect(result, U, RepairAction.REBOOT, [("ecc_uncorrected_rising", 7)])
    assert "from 0 to 2" in result.reasons[0].message


def test_flat_uncorrected_ecc_is_healthy_once_the_rise_leaves_the_window(rig: Rig) -> None:
    rig.inject("ecc_uncorrected", gpu=7, count=2)
    rig.run(WINDOW)
    expect(rig.assess(), U, RepairAction.REBOOT, [("ecc_uncorrected_rising", 7)])
    rig.run(30)  # the window now starts after the rise: 2 → 2
    expect(rig.assess(), H, RepairAction.NONE, [])


def test_ecc_counter_reset_by_a_gpu_reset_is_not_a_rise(rig: Rig) -> None:
    rig.inject("ecc_uncorrected", gpu=7, count=2)
    rig.run(WINDOW)
    rig.telemetry.clear(7)  # as a GPU reset / driver reload would
    rig.run(WINDOW / 2)
    expect(rig.assess(), H, RepairAction.NONE, [])


def test_remap_pending_reboots(rig: Rig) -> None:
    rig.inject("remap_pending", gpu=1)
    rig.step()
    expect(rig.assess(), U, RepairAction.REBOOT, [("remap_pending", 1)])


def test_remap_failed_needs_hardware_inspection(rig: Rig) -> None:
    rig.inject("remap_failed", gpu=1)
    rig.step()
    expect(rig.assess(), U, RepairAction.HARDWARE_INSPECTION, [("remap_failed", 1)])


# --- thermal ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hot_minutes", "verdict", "reasons"),
    [(5, H, []), (6, U, [("thermal_slowdown", 4)])],
    ids=["share-0.5", "share-0.6"],
)
def test_hw_thermal_slowdown_share_of_the_window(
    hot_minutes: int, verdict: Verdict, reasons: list[tuple[str, int | None]]
) -> None:
    server = Rig()
    server.run(WINDOW - 60 * hot_minutes)
    server.inject("clock_events", gpu=4, bits=int(ClockEvent.HW_THERMAL_SLOWDOWN))
    server.run(60 * hot_minutes)
    action = RepairAction.HARDWARE_INSPECTION if reasons else RepairAction.NONE
    expect(server.assess(), verdict, action, reasons)


def test_hw_thermal_slowdown_needs_most_of_the_window_covered() -> None:
    server = Rig()  # a fresh agent: a single minute of history, all of it throttled
    server.inject("clock_events", gpu=4, bits=int(ClockEvent.HW_THERMAL_SLOWDOWN))
    server.run(60)
    expect(server.assess(), H, RepairAction.NONE, [])


@pytest.mark.parametrize(
    "bits",
    [ClockEvent.SW_THERMAL_SLOWDOWN, ClockEvent.HW_SLOWDOWN, ClockEvent.SW_POWER_CAP],
    ids=lambda b: b.name,
)
def test_other_clock_events_do_not_count(bits: ClockEvent) -> None:
    server = Rig()
    server.inject("clock_events", gpu=4, bits=int(bits))
    server.run(WINDOW)
    expect(server.assess(), H, RepairAction.NONE, [])


def _ramp_to_slowdown(rig: Rig) -> None:
    """GPU 0 jumps to slowdown + 2 °C within the next snapshot period."""
    rig.inject("temperature_ramp", gpu=0, rate_c_per_s=100.0)


def test_temperature_at_slowdown_for_119_s_then_120_s(rig: Rig) -> None:
    _ramp_to_slowdown(rig)
    rig.run(115)  # hot from the first of these snapshots: 110 s so far
    rig.step(9)  # 119 s
    assert (rig.history[-1].gpus[0].temperature_c or 0.0) >= 87.0
    expect(rig.assess(), H, RepairAction.NONE, [])
    rig.step(1)  # 120 s
    result = rig.assess()
    expect(result, U, RepairAction.HARDWARE_INSPECTION, [("temperature_sustained", 0)])
    assert "for 120 s" in result.reasons[0].message


def test_temperature_below_slowdown_is_fine(rig: Rig) -> None:
    rig.inject("temperature_ramp", gpu=0, target_c=85.0, rate_c_per_s=1.0)
    rig.run(WINDOW)
    expect(rig.assess(), H, RepairAction.NONE, [])


def test_slow_ramp_trips_once_hot_for_long_enough(rig: Rig) -> None:
    rig.inject("temperature_ramp", gpu=0, rate_c_per_s=0.5)  # from ~33 °C: ~110 s to 87 °C
    rig.run(200)
    expect(rig.assess(), H, RepairAction.NONE, [])
    rig.run(60)
    expect(rig.assess(), U, RepairAction.HARDWARE_INSPECTION, [("temperature_sustained", 0)])


def test_a_hot_gpu_for_the_whole_window_trips_both_thermal_rules(rig: Rig) -> None:
    _ramp_to_slowdown(rig)
    rig.run(WINDOW)
    expect(
        rig.assess(),
        U,
        RepairAction.HARDWARE_INSPECTION,
        [("temperature_sustained", 0), ("thermal_slowdown", 0)],
    )


# --- GPUs gone -------------------------------------------------------------------------------


def test_lost_gpu_reboots(rig: Rig) -> None:
    rig.inject("gpu_lost", gpu=3)
    rig.step()
    result = rig.assess(expected_gpus=8)  # still enumerated: lost, not missing
    expect(result, U, RepairAction.REBOOT, [("gpu_lost", 3)])
    assert result.reasons[0].message.startswith(f"GPU 3 ({bus(rig, 3)}): lost")


def test_lost_gpu_cleared_is_healthy_again(rig: Rig) -> None:
    rig.inject("gpu_lost", gpu=3)
    rig.step()
    rig.telemetry.clear()
    rig.step()
    expect(rig.assess(), H, RepairAction.NONE, [])


def test_fewer_gpus_than_expected_reboots() -> None:
    server = Rig(gpus=7)
    server.run(30)
    result = server.assess(expected_gpus=8)
    expect(result, U, RepairAction.REBOOT, [("gpu_missing", None)])
    assert result.reasons[0].message == "7 of 8 expected GPUs found"
    expect(server.assess(expected_gpus=7), H, RepairAction.NONE, [])


# --- the fault file, combinations, determinism -------------------------------------------------


def test_fault_file_injection(tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    server = Rig(fault_file=faults)
    server.run(30)
    faults.write_text(json.dumps({"faults": [{"id": "f1", "kind": "xid", "gpu": 3, "xid": 79}]}))
    server.step()
    expect(server.assess(), U, RepairAction.REBOOT, [("xid_79", 3)])


def test_the_worst_fault_wins(rig: Rig) -> None:
    rig.inject("xid", gpu=1, xid=13)
    rig.run(30)
    expect(rig.assess(), D, RepairAction.RESTART_ENGINE, [("xid_app", 1)])
    rig.inject("xid", gpu=2, xid=79)
    rig.run(30)
    expect(rig.assess(), U, RepairAction.REBOOT, [("xid_app", 1), ("xid_79", 2)])
    rig.inject("remap_failed", gpu=5)
    rig.run(30)
    expect(
        rig.assess(),
        U,
        RepairAction.HARDWARE_INSPECTION,
        [("xid_app", 1), ("xid_79", 2), ("remap_failed", 5)],
    )


def test_same_seed_same_faults_same_assessment() -> None:
    def scenario() -> list[dict[str, object]]:
        server = Rig(seed=42, load=lambda: 0.7)
        results = []
        for fault in (
            {"kind": "xid", "gpu": 1, "xid": 31},
            {"kind": "ecc_uncorrected", "gpu": 2, "count": 1},
            {"kind": "temperature_ramp", "gpu": 3, "rate_c_per_s": 2.0},
        ):
            server.telemetry.inject(Fault.from_dict(fault))
            server.run(150)
            results.append(server.assess().to_dict())
        return results

    first = scenario()
    assert scenario() == first
    assert json.loads(json.dumps(first)) == first
    assert first[-1]["verdict"] == "unhealthy"
