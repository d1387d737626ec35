"""NvmlTelemetry against a stand-in pynvml (tests/nvml_standin.py) and against the real one.

The stand-in keeps nvidia-ml-py's own structures, constants and exception classes; only the
calls into libnvidia-ml.so are replaced. The last test uses the real module on this machine.
"""

from __future__ import annotations

import ctypes

import pynvml  # type: ignore[import-untyped]
import pytest
from nvml_standin import DRIVER_VERSION, H100_MEMORY_MIB, HGX_BUS_IDS, NvmlStandIn, eight_h100s

from fleet_agent.telemetry import PowerLimitFailed, PowerLimitUnsupported
from fleet_agent.telemetry.nvml import UNAVAILABLE, NvmlTelemetry
from fleet_core.telemetry import ClockEvent, GpuSample, TelemetryUnavailable, XidEvent

NOW = 1_750_000_000.0


def start(nvml: NvmlStandIn) -> NvmlTelemetry:
    return NvmlTelemetry(nvml=nvml, clock=lambda: NOW)


def test_full_snapshot_of_eight_h100s() -> None:
    nvml = NvmlStandIn(temperature_v=True)
    telemetry = start(nvml)
    snap = telemetry.snapshot()

    assert snap.backend == "nvml"
    assert snap.at == NOW
    assert snap.driver_version == DRIVER_VERSION
    assert snap.notes == ()
    assert snap.xids == ()
    assert [g.index for g in snap.gpus] == list(range(8))
    assert [g.pci_bus_id for g in snap.gpus] == list(HGX_BUS_IDS)
    assert snap.gpus[0] == GpuSample(
        index=0,
        uuid=nvml.gpus[0].uuid,
        name="NVIDIA H100 80GB HBM3",
        pci_bus_id="00000000:18:00.0",
        temperature_c=58.0,
        slowdown_temp_c=89.0,
        shutdown_temp_c=92.0,
        max_operating_temp_c=87.0,
        memory_used_mib=74_211,
        memory_total_mib=H100_MEMORY_MIB,
        utilization_pct=87.0,
        power_w=512.48,
        power_limit_w=700.0,
        ecc_uncorrected_volatile=0,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        remap_pending=False,
        remap_failed=False,
        clock_events=0,
        lost=False,
    )
    idle = snap.gpus[7]
    assert idle.power_w == pytest.approx(70.315)
    assert idle.utilization_pct == 0.0
    assert idle.clock_events == ClockEvent.GPU_IDLE
    # The newer call is used when the module has it; the deprecated one is never needed.
    assert nvml.count("nvmlDeviceGetTemperatureV") == 8
    assert nvml.count("nvmlDeviceGetTemperature") == 0
    # Identity is read once, at start.
    telemetry.snapshot()
    assert nvml.count("nvmlDeviceGetUUID") == 8


def test_temperature_falls_back_when_the_module_has_no_temperature_v() -> None:
    nvml = NvmlStandIn(temperature_v=False)
    assert not hasattr(nvml, "nvmlDeviceGetTemperatureV")
    snap = start(nvml).snapshot()
    assert [g.temperature_c for g in snap.gpus] == [58, 59, 60, 61, 62, 63, 31, 31]
    assert nvml.count("nvmlDeviceGetTemperature") == 8


def test_temperature_falls_back_once_when_the_driver_lacks_temperature_v() -> None:
    nvml = NvmlStandIn(temperature_v=True, temperature_v_error=pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    telemetry = start(nvml)
    telemetry.snapshot()
    snap = telemetry.snapshot()
    assert snap.gpus[0].temperature_c == 58.0
    assert snap.notes == ()
    assert nvml.count("nvmlDeviceGetTemperatureV") == 1  # not asked again
    assert nvml.count("nvmlDeviceGetTemperature") == 16


def test_clock_events_fall_back_to_throttle_reasons() -> None:
    nvml = NvmlStandIn(clocks_event_reasons=False)
    snap = start(nvml).snapshot()
    assert snap.gpus[6].clock_events == ClockEvent.GPU_IDLE
    assert nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 8


def test_not_supported_fields_are_none_noted_and_not_asked_again() -> None:
    gpus = eight_h100s()
    gpus[3].errors["nvmlDeviceGetRemappedRows"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    gpus[5].errors["nvmlDeviceGetRemappedRows"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    gpus[5].errors["nvmlDeviceGetTotalEccErrors"] = pynvml.NVML_ERROR_NO_PERMISSION
    nvml = NvmlStandIn(gpus)
    telemetry = start(nvml)

    first = telemetry.snapshot()
    second = telemetry.snapshot()

    for snap in (first, second):
        g3, g5 = snap.gpus[3], snap.gpus[5]
        assert g3.remapped_rows_correctable is None
        assert g3.remapped_rows_uncorrectable is None
        assert g3.remap_pending is None
        assert g3.remap_failed is None
        assert g3.ecc_uncorrected_volatile == 0
        assert g5.ecc_uncorrected_volatile is None
        assert g5.remap_failed is None
        assert snap.gpus[4].remap_failed is False
        assert g3.temperature_c is not None and not g3.lost
        assert snap.notes == (
            "ecc_uncorrected_volatile: NVMLError_NoPermission on GPU 5",
            "remapped_rows: NVMLError_NotSupported on GPU 3, 5",
        )
    assert nvml.count("nvmlDeviceGetRemappedRows", 3) == 1
    assert nvml.count("nvmlDeviceGetTotalEccErrors", 5) == 1
    assert nvml.count("nvmlDeviceGetRemappedRows", 4) == 2


def test_other_errors_leave_the_field_empty_this_time_only() -> None:
    gpus = eight_h100s()
    gpus[2].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NOT_READY
    nvml = NvmlStandIn(gpus)
    telemetry = start(nvml)

    snap = telemetry.snapshot()
    assert snap.gpus[2].power_w is None
    assert snap.notes == ("GPU 2: power unread this time (NVMLError_NotReady)",)

    del gpus[2].errors["nvmlDeviceGetPowerUsage"]
    snap = telemetry.snapshot()
    assert snap.gpus[2].power_w == pytest.approx(514.48)
    assert snap.notes == ()


def test_a_gpu_lost_at_run_time_is_reported_lost_with_its_identity() -> None:
    nvml = NvmlStandIn()
    telemetry = start(nvml)
    telemetry.snapshot()

    nvml.gpus[4].lost = True
    snap = telemetry.snapshot()
    assert snap.gpus[4] == GpuSample(
        index=4,
        uuid=nvml.gpus[4].uuid,
        name="NVIDIA H100 80GB HBM3",
        pci_bus_id="00000000:9A:00.0",
        lost=True,
    )
    assert [g.lost for g in snap.gpus] == [False] * 4 + [True] + [False] * 3
    assert snap.gpus[5].temperature_c == 63.0
    assert snap.notes == ()


def test_a_gpu_lost_before_start_is_reported_lost() -> None:
    gpus = eight_h100s()
    gpus[0].lost = True
    gpus[1].errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_UNKNOWN
    snap = start(NvmlStandIn(gpus)).snapshot()
    assert snap.gpus[0] == GpuSample(index=0, lost=True)
    assert snap.gpus[1].lost and snap.gpus[1].uuid == gpus[1].uuid
    assert not any(g.lost for g in snap.gpus[2:])


def test_xid_events_are_drained_once_without_blocking() -> None:
    nvml = NvmlStandIn()
    telemetry = start(nvml)
    assert nvml.registered == set(range(8))
    assert telemetry.snapshot().xids == ()

    nvml.push_xid(2, 79)
    nvml.push_xid(5, 48)
    snap = telemetry.snapshot()
    assert snap.xids == (
        XidEvent(
            xid=79,
            at=NOW,
            gpu_index=2,
            pci_bus_id="00000000:3A:00.0",
            message="NVML Xid critical error event",
            source="nvml",
        ),
        XidEvent(
            xid=48,
            at=NOW,
            gpu_index=5,
            pci_bus_id="00000000:AB:00.0",
            message="NVML Xid critical error event",
            source="nvml",
        ),
    )
    assert telemetry.snapshot().xids == ()
    assert set(nvml.wait_timeouts) == {0}


def test_gpus_that_refuse_xid_events_are_noted() -> None:
    gpus = eight_h100s()
    gpus[6].errors["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml = NvmlStandIn(gpus)
    telemetry = start(nvml)
    nvml.push_xid(6, 31)
    snap = telemetry.snapshot()
    assert snap.xids == ()
    assert snap.notes == ("no Xid events from NVML on GPU 6",)


@pytest.mark.parametrize(
    "error", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_no_driver_refuses_with_a_clear_message(error: int) -> None:
    with pytest.raises(TelemetryUnavailable) as refused:
        start(NvmlStandIn(init_error=error))
    assert str(refused.value) == (
        "NVML is not available here (no NVIDIA driver/libnvidia-ml.so): "
        "use --telemetry dcgm or simulated"
    )
    assert str(refused.value) == UNAVAILABLE


def test_other_start_errors_refuse_naming_the_error() -> None:
    with pytest.raises(TelemetryUnavailable, match="NVMLError_LibRmVersionMismatch"):
        start(NvmlStandIn(init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH))


def test_a_failure_after_init_shuts_nvml_down() -> None:
    nvml = NvmlStandIn(count_error=pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(TelemetryUnavailable, match="cannot count the GPUs"):
        start(nvml)
    assert nvml.initialized == 0


def test_close_frees_the_event_set_and_shuts_down_once() -> None:
    nvml = NvmlStandIn()
    telemetry = start(nvml)
    telemetry.close()
    telemetry.close()
    assert nvml.event_sets_freed == 1
    assert nvml.count("nvmlShutdown") == 1
    assert nvml.initialized == 0
    with pytest.raises(RuntimeError, match="closed"):
        telemetry.snapshot()


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_real_pynvml_here() -> None:
    """The real module: where there is no driver (CI), a clean refusal; on a GPU host, a real
    snapshot (or a refusal when the library is there but the kernel driver is not)."""
    if not _driver_present():
        with pytest.raises(TelemetryUnavailable) as refused:
            NvmlTelemetry()
        assert str(refused.value) == UNAVAILABLE
        return
    try:
        telemetry = NvmlTelemetry()
    except TelemetryUnavailable as exc:
        assert str(exc) == UNAVAILABLE
        return
    try:
        snap = telemetry.snapshot()
        assert snap.driver_version
        assert all(g.uuid and g.uuid.startswith("GPU-") for g in snap.gpus if not g.lost)
    finally:
        telemetry.close()


# ---- power limits (the fleet's cap valve) ----------------------------------------------------


def test_a_power_limit_is_set_on_every_gpu_in_milliwatts_and_enforced() -> None:
    nvml = NvmlStandIn()
    telemetry = start(nvml)
    assert telemetry.set_power_limit(350) == {i: 350.0 for i in range(8)}
    assert [g.power_limit_mw for g in nvml.gpus] == [350_000] * 8
    assert nvml.count("nvmlDeviceSetPowerManagementLimit") == 8
    assert [g.power_limit_w for g in telemetry.snapshot().gpus] == [350.0] * 8
    # Fractions of a watt reach NVML as milliwatts.
    telemetry.set_power_limit(412.5)
    assert nvml.gpus[0].power_limit_mw == 412_500


def test_a_power_limit_is_clamped_to_the_boards_constraints() -> None:
    nvml = NvmlStandIn()
    nvml.gpus[3].power_limit_constraints_mw = (250_000, 650_000)
    telemetry = start(nvml)
    low = telemetry.set_power_limit(50)
    assert low[0] == 200.0 and low[3] == 250.0
    high = telemetry.set_power_limit(10_000)
    assert high[0] == 700.0 and high[3] == 650.0
    assert nvml.count("nvmlDeviceGetPowerManagementLimitConstraints") == 16


def test_none_restores_each_boards_default_limit() -> None:
    nvml = NvmlStandIn()
    nvml.gpus[1].power_limit_default_mw = 600_000  # a board shipped below its TDP
    telemetry = start(nvml)
    telemetry.set_power_limit(300)
    restored = telemetry.set_power_limit(None)
    assert restored[0] == 700.0 and restored[1] == 600.0
    assert nvml.count("nvmlDeviceGetPowerManagementDefaultLimit") == 8
    assert nvml.count("nvmlDeviceGetPowerManagementLimitConstraints") == 8  # the 300 W call only


def test_no_permission_on_every_gpu_is_unsupported() -> None:
    gpus = eight_h100s()
    for gpu in gpus:
        gpu.errors["nvmlDeviceSetPowerManagementLimit"] = pynvml.NVML_ERROR_NO_PERMISSION
    telemetry = start(NvmlStandIn(gpus))
    with pytest.raises(PowerLimitUnsupported, match="NVMLError_NoPermission"):
        telemetry.set_power_limit(350)


def test_a_gpu_that_fails_leaves_the_others_set_and_says_which() -> None:
    nvml = NvmlStandIn()
    nvml.gpus[2].errors["nvmlDeviceSetPowerManagementLimit"] = pynvml.NVML_ERROR_TIMEOUT
    nvml.gpus[5].lost = True  # skipped: a lost GPU has nothing to limit
    telemetry = start(nvml)
    with pytest.raises(PowerLimitFailed, match=r"not on GPU 2: NVMLError_Timeout"):
        telemetry.set_power_limit(350)
    set_mw = [g.power_limit_mw for g in nvml.gpus]
    assert set_mw == [350_000, 350_000, 700_000, 350_000, 350_000, 700_000, 350_000, 350_000]
    nvml.gpus[2].errors.clear()
    assert set(telemetry.set_power_limit(350)) == {0, 1, 2, 3, 4, 6, 7}
