"""The simulated GPU telemetry stand-in: realistic values per model, load, and fault injection.

Time comes from a fake clock, so temperature ramps are exact and no test sleeps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from fleet_agent.telemetry import sim_gpu_state
from fleet_agent.telemetry.sim_gpu_state import GpuActivity
from fleet_agent.telemetry.simulated import (
    ALL_GPUS,
    DRIVER_VERSION,
    MODELS,
    Fault,
    SimulatedTelemetry,
)
from fleet_core.telemetry import ClockEvent, GpuSample, Snapshot

THERMAL = ClockEvent.HW_THERMAL_SLOWDOWN | ClockEvent.SW_THERMAL_SLOWDOWN
# Per-snapshot noise bounds in simulated.py: ±1.5 W power, ±0.5 °C temperature.
POWER_NOISE_W = 1.5
TEMP_NOISE_C = 0.5


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Load:
    """A settable load() callable."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


def make(
    model: str = "H100", gpus: int = 8, **kwargs: Any
) -> tuple[SimulatedTelemetry, FakeClock, Load]:
    clock, load = FakeClock(), Load()
    return SimulatedTelemetry(model, gpus, clock=clock, load=load, **kwargs), clock, load


def gpu(snapshot: Snapshot, index: int) -> GpuSample:
    return snapshot.gpus[index]


# -- realistic values ------------------------------------------------------------------------

# Expected figures from docs/hardware.md (A100: our assumption, see simulated.py).
SPECS = {
    "H100": ("NVIDIA H100 80GB HBM3", 81_559, 700.0, (67.0, 73.0)),
    "H200": ("NVIDIA H200", 143_771, 700.0, (73.0, 79.0)),
    "L40S": ("NVIDIA L40S", 46_068, 350.0, (22.0, 33.0)),
    "A100": ("NVIDIA A100-SXM4-80GB", 81_251, 400.0, (50.0, 60.0)),
}


@pytest.mark.parametrize("model", sorted(SPECS))
def test_idle_values_are_realistic_per_model(model: str) -> None:
    name, memory, tdp, (idle_lo, idle_hi) = SPECS[model]
    sim, clock, _ = make(model)
    snap = sim.snapshot()
    assert snap.backend == "simulated" and sim.name == "simulated"
    assert snap.at == clock.now
    assert snap.driver_version == DRIVER_VERSION
    assert snap.xids == ()
    assert len(snap.gpus) == 8
    for index, sample in enumerate(snap.gpus):
        assert sample.index == index
        assert sample.name == name
        assert sample.memory_total_mib == memory
        assert sample.power_limit_w == tdp
        assert sample.power_w is not None
        assert idle_lo - POWER_NOISE_W <= sample.power_w <= idle_hi + POWER_NOISE_W
        assert sample.temperature_c is not None
        assert 30.0 - TEMP_NOISE_C <= sample.temperature_c <= 35.0 + TEMP_NOISE_C
        assert sample.utilization_pct == 0.0
        assert sample.memory_used_mib is not None and sample.memory_used_mib < 64
        assert sample.ecc_uncorrected_volatile == 0
        assert sample.remap_pending is False and sample.remap_failed is False
        assert sample.remapped_rows_uncorrectable == 0
        assert sample.clock_events == 0
        assert sample.lost is False
        assert sample.slowdown_temp_c == MODELS[model].slowdown_temp_c
        assert sample.shutdown_temp_c is not None and sample.max_operating_temp_c is not None
        assert sample.max_operating_temp_c < sample.slowdown_temp_c < sample.shutdown_temp_c


def test_hopper_thresholds_are_the_documented_typical_values() -> None:
    for model in ("H100", "H200"):
        sample = gpu(make(model)[0].snapshot(), 0)
        assert (sample.slowdown_temp_c, sample.shutdown_temp_c, sample.max_operating_temp_c) == (
            87.0,
            92.0,
            85.0,
        )


def test_identities_are_distinct_stable_per_seed_and_nvml_shaped() -> None:
    first = make(seed=7)[0].snapshot().gpus
    again = make(seed=7)[0].snapshot().gpus
    other = make(seed=8)[0].snapshot().gpus
    uuids = [g.uuid for g in first]
    assert uuids == [g.uuid for g in again]
    assert set(uuids).isdisjoint(g.uuid for g in other)
    assert len(set(uuids)) == 8
    for sample in first:
        assert sample.uuid is not None and sample.uuid.startswith("GPU-")
        uuid.UUID(sample.uuid.removeprefix("GPU-"))  # raises if malformed
        assert sample.pci_bus_id is not None
        assert re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", sample.pci_bus_id)
    assert len({g.pci_bus_id for g in first}) == 8
    assert first[0].pci_bus_id == "00000000:1B:00.0"
    # Same seed, same clock, same load: the same numbers (noise is seeded too).
    assert [g.power_w for g in first] == [g.power_w for g in again]


def test_many_gpus_get_distinct_bus_ids() -> None:
    snap = make(gpus=64)[0].snapshot()
    assert len({g.pci_bus_id for g in snap.gpus}) == 64


@pytest.mark.parametrize(("model", "gpus"), [("B200", 8), ("H100", 0), ("H100", 65)])
def test_bad_constructor_arguments_are_refused(model: str, gpus: int) -> None:
    with pytest.raises(ValueError, match=r"model|gpus"):
        SimulatedTelemetry(model, gpus)


def test_model_name_is_case_insensitive() -> None:
    sample = gpu(SimulatedTelemetry("h200", 1).snapshot(), 0)
    assert sample.memory_total_mib == 143_771


def test_load_raises_power_temperature_utilisation_and_memory() -> None:
    sim, _, load = make("H100")
    readings = []
    for value in (0.0, 0.5, 1.0):
        load.value = value
        readings.append(gpu(sim.snapshot(), 0))
    idle, half, full = readings
    for field in ("power_w", "temperature_c", "utilization_pct", "memory_used_mib"):
        values = [getattr(sample, field) for sample in readings]
        assert values[0] < values[1] < values[2], field
    assert full.utilization_pct == 100.0 and half.utilization_pct == 50.0
    assert full.power_w is not None and 700.0 - POWER_NOISE_W <= full.power_w <= 700.0
    assert full.temperature_c is not None and 70.0 <= full.temperature_c <= 75.0
    assert full.memory_used_mib is not None and full.memory_used_mib > 0.9 * 81_559
    assert full.memory_used_mib <= 81_559
    # Power = idle + load * (TDP - idle): half load lands half-way.
    assert idle.power_w is not None and half.power_w is not None
    assert half.power_w == pytest.approx((idle.power_w + 700.0) / 2, abs=2 * POWER_NOISE_W)


def test_load_outside_zero_to_one_is_clamped() -> None:
    sim, _, load = make("L40S", gpus=1)
    load.value = 7.0
    assert gpu(sim.snapshot(), 0).utilization_pct == 100.0
    load.value = float("nan")
    assert gpu(sim.snapshot(), 0).utilization_pct == 0.0
    load.value = -1.0
    assert gpu(sim.snapshot(), 0).utilization_pct == 0.0


def test_default_load_is_idle() -> None:
    sample = gpu(SimulatedTelemetry("H100", 1).snapshot(), 0)
    assert sample.utilization_pct == 0.0


# -- faults ----------------------------------------------------------------------------------


def test_xid_is_reported_once_in_the_next_snapshot() -> None:
    sim, clock, _ = make()
    sim.inject(Fault(kind="xid", gpu=2, xid=79, count=2))
    clock.advance(5)
    snap = sim.snapshot()
    assert len(snap.xids) == 2
    for event in snap.xids:
        assert event.xid == 79
        assert event.gpu_index == 2
        assert event.pci_bus_id == gpu(snap, 2).pci_bus_id == "00000000:52:00.0"
        assert event.source == "simulated"
        assert event.at == clock.now - 5  # when it happened, not when it was read
        assert event.message.startswith("NVRM: Xid (PCI:0000:52:00): 79, ")
        assert "fallen off the bus" in event.message
    assert sim.snapshot().xids == ()


def test_xids_on_several_gpus_and_an_unknown_xid_number() -> None:
    sim, _, _ = make()
    sim.inject(Fault(kind="xid", gpu=0, xid=48))
    sim.inject(Fault(kind="xid", gpu=5, xid=1234))
    events = sim.snapshot().xids
    assert [(e.xid, e.gpu_index) for e in events] == [(48, 0), (1234, 5)]
    assert "double bit error" in events[0].message
    assert events[1].message.startswith("NVRM: Xid (PCI:0000:c3:00): 1234, ")


def test_ecc_uncorrected_rises_with_each_injection_and_persists() -> None:
    sim, _, _ = make()
    sim.inject(Fault(kind="ecc_uncorrected", gpu=1, count=2))
    assert gpu(sim.snapshot(), 1).ecc_uncorrected_volatile == 2
    assert gpu(sim.snapshot(), 1).ecc_uncorrected_volatile == 2
    sim.inject(Fault(kind="ecc_uncorrected", gpu=1, count=3))
    snap = sim.snapshot()
    assert gpu(snap, 1).ecc_uncorrected_volatile == 5
    assert [g.ecc_uncorrected_volatile for g in snap.gpus if g.index != 1] == [0] * 7


def test_remap_pending_and_remap_failed() -> None:
    sim, _, _ = make()
    sim.inject(Fault(kind="remap_pending", gpu=3))
    sample = gpu(sim.snapshot(), 3)
    assert sample.remap_pending is True and sample.remap_failed is False
    assert sample.remapped_rows_uncorrectable == 0
    sim.inject(Fault(kind="remap_failed", gpu=3))
    sample = gpu(sim.snapshot(), 3)
    assert sample.remap_failed is True and sample.remapped_rows_uncorrectable == 1
    assert gpu(sim.snapshot(), 4).remap_pending is False


def test_temperature_ramp_follows_the_clock_and_sets_thermal_bits_at_slowdown() -> None:
    sim, clock, _ = make("H100")
    start = gpu(sim.snapshot(), 0).temperature_c
    assert start is not None
    sim.inject(Fault(kind="temperature_ramp", gpu=0, rate_c_per_s=2.0))
    ramp_start = gpu(sim.snapshot(), 0).temperature_c
    assert ramp_start is not None and abs(ramp_start - start) <= 2 * TEMP_NOISE_C
    clock.advance(10)
    sample = gpu(sim.snapshot(), 0)
    assert sample.temperature_c == pytest.approx(ramp_start + 20.0, abs=0.11)
    assert sample.clock_events == 0
    # Slowdown is 87 °C; the default target is slowdown + 2 = 89 °C.
    clock.advance((87.0 - ramp_start - 20.0) / 2.0 + 0.1)
    sample = gpu(sim.snapshot(), 0)
    assert sample.temperature_c is not None and 87.0 <= sample.temperature_c < 89.0
    assert sample.clock_events == THERMAL
    clock.advance(3600)
    sample = gpu(sim.snapshot(), 0)
    assert sample.temperature_c == 89.0  # holds at the target
    assert sample.clock_events == THERMAL
    assert gpu(sim.snapshot(), 1).clock_events == 0  # only the faulted GPU


def test_temperature_ramp_to_an_explicit_target_can_stay_below_slowdown() -> None:
    sim, clock, load = make("L40S", gpus=2)
    load.value = 1.0
    sim.inject(Fault(kind="temperature_ramp", gpu=1, target_c=80.0, rate_c_per_s=0.5))
    clock.advance(1000)
    sample = gpu(sim.snapshot(), 1)
    assert sample.temperature_c == 80.0
    assert sample.clock_events == 0  # L40S slowdown is higher than 80 °C
    sim.inject(Fault(kind="temperature_ramp", gpu=1, target_c=40.0, rate_c_per_s=4.0))
    clock.advance(5)
    assert gpu(sim.snapshot(), 1).temperature_c == 60.0  # ramps down from where it was


def test_clock_event_bits_are_ored_and_held() -> None:
    sim, clock, _ = make()
    sim.inject(Fault(kind="clock_events", gpu=6, bits=int(ClockEvent.HW_SLOWDOWN)))
    sim.inject(Fault(kind="clock_events", gpu=6, bits=int(ClockEvent.HW_POWER_BRAKE_SLOWDOWN)))
    clock.advance(60)
    for _ in range(2):
        assert gpu(sim.snapshot(), 6).clock_events == (
            ClockEvent.HW_SLOWDOWN | ClockEvent.HW_POWER_BRAKE_SLOWDOWN
        )


def test_gpu_lost_reports_no_readings_but_keeps_the_gpu_listed() -> None:
    sim, _, load = make()
    load.value = 0.8
    before = gpu(sim.snapshot(), 4)
    sim.inject(Fault(kind="gpu_lost", gpu=4))
    snap = sim.snapshot()
    assert len(snap.gpus) == 8
    lost = gpu(snap, 4)
    assert lost.lost is True
    assert (lost.index, lost.uuid, lost.pci_bus_id) == (4, before.uuid, before.pci_bus_id)
    for name in (
        "temperature_c",
        "slowdown_temp_c",
        "memory_used_mib",
        "memory_total_mib",
        "utilization_pct",
        "power_w",
        "power_limit_w",
        "ecc_uncorrected_volatile",
        "remap_pending",
        "remap_failed",
        "clock_events",
    ):
        assert getattr(lost, name) is None, name
    assert gpu(snap, 3).lost is False and gpu(snap, 3).power_w is not None


def _fault_everything(sim: SimulatedTelemetry, index: int) -> None:
    for fault in (
        Fault(kind="ecc_uncorrected", gpu=index, count=4),
        Fault(kind="remap_pending", gpu=index),
        Fault(kind="remap_failed", gpu=index),
        Fault(kind="temperature_ramp", gpu=index, target_c=95.0, rate_c_per_s=100.0),
        Fault(kind="clock_events", gpu=index, bits=int(ClockEvent.SW_POWER_CAP)),
    ):
        sim.inject(fault)


def test_clear_one_gpu_resets_it_like_a_driver_reload() -> None:
    sim, clock, _ = make()
    _fault_everything(sim, 0)
    _fault_everything(sim, 1)
    sim.inject(Fault(kind="gpu_lost", gpu=0))
    clock.advance(10)
    sim.clear(0)
    snap = sim.snapshot()
    cleared, still = gpu(snap, 0), gpu(snap, 1)
    assert cleared.lost is False
    assert cleared.ecc_uncorrected_volatile == 0
    assert cleared.remap_pending is False and cleared.remap_failed is False
    assert cleared.remapped_rows_uncorrectable == 1  # remapped rows survive a reset
    assert cleared.clock_events == 0
    assert cleared.temperature_c is not None and cleared.temperature_c < 40.0
    assert still.ecc_uncorrected_volatile == 4 and still.remap_pending is True
    assert still.temperature_c == 95.0 and still.clock_events is not None
    assert still.clock_events & ClockEvent.SW_POWER_CAP


def test_clear_all_and_clear_through_a_fault() -> None:
    sim, _, _ = make()
    for index in range(3):
        _fault_everything(sim, index)
    sim.inject(Fault.from_dict({"kind": "clear", "gpu": 2}))
    assert gpu(sim.snapshot(), 2).ecc_uncorrected_volatile == 0
    assert gpu(sim.snapshot(), 1).ecc_uncorrected_volatile == 4
    sim.inject(Fault.from_dict({"kind": "clear"}))  # no gpu: every GPU
    snap = sim.snapshot()
    assert [g.ecc_uncorrected_volatile for g in snap.gpus] == [0] * 8
    assert [g.clock_events for g in snap.gpus] == [0] * 8
    _fault_everything(sim, 5)
    sim.clear()
    assert gpu(sim.snapshot(), 5).remap_pending is False


def test_xid_raised_before_a_clear_is_still_reported() -> None:
    sim, _, _ = make()
    sim.inject(Fault(kind="xid", gpu=1, xid=79))
    sim.clear()
    assert [e.xid for e in sim.snapshot().xids] == [79]


@pytest.mark.parametrize("index", [8, 100, -1])
def test_inject_refuses_a_gpu_out_of_range(index: int) -> None:
    sim, _, _ = make()
    with pytest.raises(ValueError, match="out of range"):
        sim.inject(Fault(kind="ecc_uncorrected", gpu=index))
    with pytest.raises(ValueError, match="out of range"):
        sim.clear(index)


# -- Fault.from_dict -------------------------------------------------------------------------


def test_from_dict_builds_each_kind() -> None:
    assert Fault.from_dict({"kind": "xid", "gpu": 3, "xid": 79, "count": 2}) == Fault(
        kind="xid", gpu=3, xid=79, count=2
    )
    assert Fault.from_dict({"kind": "ecc_uncorrected", "count": 5}) == Fault(
        kind="ecc_uncorrected", count=5
    )
    ramp = Fault.from_dict({"kind": "temperature_ramp", "target_c": 90, "rate_c_per_s": 3})
    assert ramp == Fault(kind="temperature_ramp", target_c=90.0, rate_c_per_s=3.0)
    named = Fault.from_dict({"kind": "clock_events", "bits": ["HW_SLOWDOWN", "SW_POWER_CAP"]})
    assert named.bits == ClockEvent.HW_SLOWDOWN | ClockEvent.SW_POWER_CAP
    assert Fault.from_dict({"kind": "clock_events", "bits": 0x40}).bits == 0x40
    assert Fault.from_dict({"kind": "gpu_lost", "gpu": 7, "id": "ignored"}).gpu == 7
    assert Fault.from_dict({"kind": "clear"}).gpu == ALL_GPUS
    assert Fault.from_dict({"kind": "clear", "gpu": 1}).gpu == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "meteor"}, r"unknown fault kind 'meteor'"),
        ({}, r"unknown fault kind None"),
        ({"kind": "xid"}, r"'xid' fault needs an 'xid' number"),
        ({"kind": "xid", "xid": -4}, r"non-negative 'xid'"),
        ({"kind": "xid", "xid": "79"}, r"'xid' must be an integer"),
        ({"kind": "xid", "xid": 79, "gpu": True}, r"'gpu' must be an integer"),
        ({"kind": "xid", "xid": 79, "gpu": 1.5}, r"'gpu' must be an integer"),
        ({"kind": "ecc_uncorrected", "count": 0}, r"'count' must be at least 1"),
        ({"kind": "temperature_ramp", "rate_c_per_s": 0}, r"'rate_c_per_s' must be a positive"),
        ({"kind": "temperature_ramp", "target_c": "hot"}, r"'target_c' must be a number"),
        ({"kind": "clock_events"}, r"non-zero 'bits'"),
        ({"kind": "clock_events", "bits": ["THROTTLE"]}, r"unknown ClockEvent name 'THROTTLE'"),
        ({"kind": "clock_events", "bits": 0x10000}, r"outside ClockEvent"),
        ({"kind": "temperature_ramp", "target": 90}, r"unknown fault field\(s\) \['target'\]"),
    ],
)
def test_from_dict_rejects_bad_input_clearly(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fault.from_dict(data)


def test_from_dict_rejects_a_non_object() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        Fault.from_dict(["xid", 79])  # type: ignore[arg-type]


def test_a_fault_built_directly_is_validated_too() -> None:
    with pytest.raises(ValueError, match="'xid' number"):
        Fault(kind="xid")


# -- fault file ------------------------------------------------------------------------------

_mtimes = count(1)


def write_faults(path: Path, faults: list[dict[str, Any]] | str) -> None:
    """Replace the file atomically (as the virtual colo does) with a distinct mtime, so the
    change is seen even on filesystems with coarse timestamps."""
    text = faults if isinstance(faults, str) else json.dumps({"faults": faults})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    stamp = 1_600_000_000_000_000_000 + next(_mtimes) * 1_000_000_000
    os.utime(tmp, ns=(stamp, stamp))
    os.replace(tmp, path)


def test_missing_fault_file_means_no_faults(tmp_path: Path) -> None:
    sim, _, _ = make(fault_file=tmp_path / "absent.json")
    snap = sim.snapshot()
    assert snap.xids == () and all(g.ecc_uncorrected_volatile == 0 for g in snap.gpus)


def test_fault_file_applies_each_id_once(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    sim, _, _ = make(fault_file=path)
    sim.snapshot()
    write_faults(
        path,
        [
            {"id": "a", "kind": "xid", "gpu": 1, "xid": 79},
            {"id": "b", "kind": "ecc_uncorrected", "gpu": 1, "count": 2},
        ],
    )
    snap = sim.snapshot()
    assert [(e.xid, e.gpu_index) for e in snap.xids] == [(79, 1)]
    assert gpu(snap, 1).ecc_uncorrected_volatile == 2
    snap = sim.snapshot()  # file unchanged: nothing re-applied, ECC held
    assert snap.xids == () and gpu(snap, 1).ecc_uncorrected_volatile == 2
    write_faults(
        path,
        [
            {"id": "a", "kind": "xid", "gpu": 1, "xid": 79},
            {"id": "b", "kind": "ecc_uncorrected", "gpu": 1, "count": 2},
            {"id": "c", "kind": "ecc_uncorrected", "gpu": 1, "count": 1},
            {"id": "d", "kind": "xid", "gpu": 0, "xid": 48},
        ],
    )
    snap = sim.snapshot()  # changed: only the new ids apply
    assert [(e.xid, e.gpu_index) for e in snap.xids] == [(48, 0)]
    assert gpu(snap, 1).ecc_uncorrected_volatile == 3


def test_fault_file_clear_entry(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    sim, _, _ = make(fault_file=path)
    write_faults(path, [{"id": "lost", "kind": "gpu_lost", "gpu": 2}])
    assert gpu(sim.snapshot(), 2).lost is True
    write_faults(
        path,
        [{"id": "lost", "kind": "gpu_lost", "gpu": 2}, {"id": "reset", "kind": "clear"}],
    )
    assert gpu(sim.snapshot(), 2).lost is False
    assert gpu(sim.snapshot(), 2).lost is False  # the lost fault is not re-applied


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_malformed_fault_file_is_ignored_with_one_warning_per_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fleet_agent.telemetry.simulated")
    path = tmp_path / "faults.json"
    sim, _, _ = make(fault_file=path)
    write_faults(path, [{"id": "a", "kind": "ecc_uncorrected", "count": 1}])
    assert gpu(sim.snapshot(), 0).ecc_uncorrected_volatile == 1

    write_faults(path, '{"faults": [ {"id": "b", "kind": ')  # half-written
    for _ in range(3):
        assert gpu(sim.snapshot(), 0).ecc_uncorrected_volatile == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "not valid JSON" in warnings[0] and str(path) in warnings[0]

    caplog.clear()
    write_faults(path, [{"id": "b", "kind": "meteor"}, {"id": "c", "kind": "gpu_lost"}])
    snap = sim.snapshot()
    assert gpu(snap, 0).lost is False  # one bad entry: the whole file is ignored
    (warning,) = _warnings(caplog)
    assert "fault 'b'" in warning and "meteor" in warning

    caplog.clear()
    write_faults(path, [{"kind": "gpu_lost"}])
    sim.snapshot()
    assert "needs a non-empty string 'id'" in _warnings(caplog)[0]

    caplog.clear()
    write_faults(path, json.dumps({"faults": "all of them"}))
    sim.snapshot()
    assert len(_warnings(caplog)) == 1

    caplog.clear()
    write_faults(path, [{"id": "c", "kind": "ecc_uncorrected", "count": 2}])
    assert gpu(sim.snapshot(), 0).ecc_uncorrected_volatile == 3  # fixed file applies
    assert _warnings(caplog) == []


def test_fault_file_entry_for_a_missing_gpu_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fleet_agent.telemetry.simulated")
    path = tmp_path / "faults.json"
    sim, _, _ = make(gpus=2, fault_file=path)
    write_faults(
        path,
        [
            {"id": "far", "kind": "gpu_lost", "gpu": 5},
            {"id": "near", "kind": "gpu_lost", "gpu": 1},
        ],
    )
    assert gpu(sim.snapshot(), 1).lost is True
    (warning,) = _warnings(caplog)
    assert "'far'" in warning and "out of range" in warning


def test_fault_file_with_duplicate_ids_or_wrong_shape_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fleet_agent.telemetry.simulated")
    path = tmp_path / "faults.json"
    sim, _, _ = make(fault_file=path)
    write_faults(path, [{"id": "x", "kind": "gpu_lost"}, {"id": "x", "kind": "gpu_lost"}])
    assert gpu(sim.snapshot(), 0).lost is False
    write_faults(path, "[]")
    assert gpu(sim.snapshot(), 0).lost is False
    first, second = _warnings(caplog)
    assert "fault id 'x' appears twice" in first
    assert 'expected {"faults": [...]}' in second


def test_fault_file_removed_and_restored(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    sim, _, _ = make(fault_file=path)
    write_faults(path, [{"id": "a", "kind": "ecc_uncorrected"}])
    assert gpu(sim.snapshot(), 0).ecc_uncorrected_volatile == 1
    path.unlink()
    assert gpu(sim.snapshot(), 0).ecc_uncorrected_volatile == 1  # held faults stay
    write_faults(path, [{"id": "b", "kind": "ecc_uncorrected"}])
    assert gpu(sim.snapshot(), 0).ecc_uncorrected_volatile == 2


# -- power: limits and what the engines draw ---------------------------------------------------


def test_a_power_limit_is_clamped_reported_and_never_exceeded() -> None:
    sim, _, load = make("H100", gpus=2)
    load.value = 1.0
    assert {g.power_limit_w for g in sim.snapshot().gpus} == {700.0}
    assert sim.set_power_limit(350) == {0: 350.0, 1: 350.0}
    for _ in range(20):  # noise never pushes a reading past the limit
        for sample in sim.snapshot().gpus:
            assert sample.power_limit_w == 350.0
            assert sample.power_w is not None and sample.power_w <= 350.0
    assert sim.set_power_limit(10) == {0: 200.0, 1: 200.0}  # the H100's lowest limit
    assert sim.set_power_limit(5000) == {0: 700.0, 1: 700.0}
    assert sim.set_power_limit(None) == {0: 700.0, 1: 700.0}
    l40s, _, _ = make("L40S", gpus=1)
    assert l40s.set_power_limit(10) == {0: 100.0}


def test_limits_go_to_the_state_directory_a_fresh_start_resets_them(tmp_path: Path) -> None:
    sim, _, _ = make("H200", gpus=4, state_dir=tmp_path)
    assert sim_gpu_state.read_limits(tmp_path) == dict.fromkeys(range(4), 700.0)
    sim.set_power_limit(420)
    assert sim_gpu_state.read_limits(tmp_path) == dict.fromkeys(range(4), 420.0)
    make("H200", gpus=4, state_dir=tmp_path)  # the agent restarted: no stale cap survives
    assert sim_gpu_state.read_limits(tmp_path) == dict.fromkeys(range(4), 700.0)


def test_an_engines_activity_drives_power_utilisation_and_memory(tmp_path: Path) -> None:
    sim, clock, load = make("H200", gpus=2, state_dir=tmp_path)
    load.value = 1.0  # ignored where an engine reports
    report = GpuActivity(
        at=clock.now, power_w=612.0, busy=0.9, memory_used_mib=130_000, capped=False
    )
    sim_gpu_state.write_activity(tmp_path, 0, report)
    busy, other = sim.snapshot().gpus
    assert busy.power_w == pytest.approx(612.0, abs=POWER_NOISE_W)
    assert busy.utilization_pct == 90.0 and busy.memory_used_mib == 130_000
    assert busy.clock_events is not None and not busy.clock_events & ClockEvent.SW_POWER_CAP
    assert other.utilization_pct == 100.0  # no engine report: the load() callable

    # Under a limit the engine reports being held there; NVML would show the power-cap reason.
    sim.set_power_limit(350)
    sim_gpu_state.write_activity(
        tmp_path, 0, GpuActivity(clock.now, 350.0, 1.0, 130_000, capped=True)
    )
    held = sim.snapshot().gpus[0]
    assert held.power_w is not None and 350.0 - POWER_NOISE_W <= held.power_w <= 350.0
    assert held.clock_events is not None and held.clock_events & ClockEvent.SW_POWER_CAP

    # A report that stopped coming (the engine exited): the GPU idles again.
    load.value = 0.0
    clock.advance(10)
    idle = sim.snapshot().gpus[0]
    assert idle.power_w is not None and idle.power_w < 80.0
    assert idle.utilization_pct == 0.0


def test_unreadable_state_files_are_ignored(tmp_path: Path) -> None:
    sim, _, _ = make("H100", gpus=1, state_dir=tmp_path)
    (tmp_path / "gpu-0.json").write_text("{not json")
    assert gpu(sim.snapshot(), 0).utilization_pct == 0.0
    (tmp_path / "gpu-0.json").write_text('{"at": "x", "power_w": 500}')
    assert gpu(sim.snapshot(), 0).utilization_pct == 0.0
    (tmp_path / "limits.json").write_text('{"limits_w": {"0": "350", "x": 300, "1": -4}}')
    assert sim_gpu_state.read_limits(tmp_path) == {}
