"""The fault policy, table-tested with hand-built snapshots (fleet_core/fault_policy.py).

One row per rule of the policy table, both sides of every threshold, window expiry, combinations
(the worst verdict and the most severe action win), determinism, and the JSON shape.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from fleet_core.fault_policy import (
    APPLICATION_XIDS,
    REBOOT_XIDS,
    XID_MEANINGS,
    Assessment,
    Reason,
    RepairAction,
    Thresholds,
    Verdict,
    assess,
)
from fleet_core.telemetry import ClockEvent, GpuSample, Snapshot, XidEvent

T0 = 1_700_000_000.0
WINDOW = Thresholds().window_s

H = Verdict.HEALTHY
D = Verdict.DEGRADED
U = Verdict.UNHEALTHY
NONE = RepairAction.NONE
RESTART = RepairAction.RESTART_ENGINE
REBOOT = RepairAction.REBOOT
INSPECT = RepairAction.HARDWARE_INSPECTION


def bus(index: int) -> str:
    return f"00000000:{0x18 + index:02X}:00.0"


def gpu(index: int = 0, **fields: Any) -> GpuSample:
    """A healthy H100 at rest, unless `fields` says otherwise."""
    base = GpuSample(
        index=index,
        uuid=f"GPU-{index:08d}",
        name="NVIDIA H100 80GB HBM3",
        pci_bus_id=bus(index),
        temperature_c=45.0,
        slowdown_temp_c=87.0,
        shutdown_temp_c=92.0,
        ecc_uncorrected_volatile=0,
        remap_pending=False,
        remap_failed=False,
        clock_events=0,
    )
    return replace(base, **fields)


def snap(
    at: float,
    gpus: Sequence[GpuSample] | None = None,
    xids: Sequence[XidEvent] = (),
) -> Snapshot:
    return Snapshot(
        at=at,
        backend="test",
        gpus=tuple(gpus if gpus is not None else [gpu(i) for i in range(4)]),
        xids=tuple(xids),
    )


def xid(code: int, gpu_index: int | None = 1, at: float = T0, **fields: Any) -> XidEvent:
    return XidEvent(xid=code, at=at, gpu_index=gpu_index, source="test", **fields)


def quiet(duration: float = WINDOW, step: float = 30.0) -> list[Snapshot]:
    """Healthy snapshots every `step` seconds from T0 to T0 + duration."""
    times = [T0 + k * step for k in range(int(duration // step) + 1)]
    if times[-1] != T0 + duration:
        times.append(T0 + duration)
    return [snap(t) for t in times]


def with_xids(*events: tuple[float, XidEvent], duration: float = WINDOW) -> list[Snapshot]:
    """`quiet()` with each event carried by an extra snapshot at its offset from T0."""
    history = quiet(duration)
    for offset, event in events:
        history.append(snap(T0 + offset, xids=[replace(event, at=T0 + offset)]))
    return sorted(history, key=lambda s: s.at)


def counters(values: Sequence[int | None], step: float = 30.0, index: int = 2) -> list[Snapshot]:
    """GPU `index`'s volatile uncorrected ECC counter over successive snapshots."""
    return [
        snap(
            T0 + k * step,
            [gpu(i) for i in range(4) if i != index]
            + [gpu(index, **{"ecc_uncorrected_volatile": v})],
        )
        for k, v in enumerate(values)
    ]


def thermal(
    hot_minutes: int, sampled_minutes: int = 10, bits: int = ClockEvent.HW_THERMAL_SLOWDOWN
) -> list[Snapshot]:
    """One snapshot per minute (the newest is `now`); GPU 3 has `bits` in the newest
    `hot_minutes` of them."""
    now = T0 + WINDOW
    return [
        snap(now - 60.0 * m, [gpu(0), gpu(3, clock_events=int(bits) if m < hot_minutes else 0)])
        for m in reversed(range(sampled_minutes))
    ]


def hot_run(
    duration: float,
    step: float = 5.0,
    *,
    start: float = T0,
    then_cool_until: float | None = None,
) -> list[Snapshot]:
    """GPU 1 at its slowdown temperature from `start` for `duration` seconds (samples every
    `step`, and one exactly at the end), then optionally cool until `then_cool_until`."""
    times = [start + k * step for k in range(int(duration // step) + 1)]
    if times[-1] != start + duration:
        times.append(start + duration)
    history = [snap(t, [gpu(0), gpu(1, temperature_c=87.0)]) for t in times]
    if then_cool_until is not None:
        t = times[-1] + step
        while t <= then_cool_until:
            history.append(snap(t, [gpu(0), gpu(1, temperature_c=70.0)]))
            t += step
    return history


@dataclass(frozen=True)
class Row:
    id: str
    history: list[Snapshot]
    verdict: Verdict
    action: RepairAction
    reasons: tuple[tuple[str, int | None], ...] = ()  # (code, gpu) in order
    expected_gpus: int | None = None


ROWS: list[Row] = [
    Row("empty-history", [], D, NONE, (("no_telemetry", None),)),
    Row("quiet", quiet(), H, NONE),
    Row("single-snapshot", [snap(T0)], H, NONE),
    # --- application Xids: degraded, restart the engine, never more
    *(
        Row(f"xid-{code}-application", with_xids((300.0, xid(code))), D, RESTART, (("xid_app", 1),))
        for code in sorted(APPLICATION_XIDS)
    ),
    Row(
        "xid-13-many-times-still-restart-only",
        with_xids(*((10.0 * k, xid(13)) for k in range(1, 40))),
        D,
        RESTART,
        (("xid_app", 1),),
    ),
    # --- Xids that need a reset
    *(
        Row(f"xid-{code}-reboot", with_xids((300.0, xid(code))), U, REBOOT, ((f"xid_{code}", 1),))
        for code in sorted(REBOOT_XIDS)
    ),
    Row("xid-64-row-remap-failure", with_xids((300.0, xid(64))), U, INSPECT, (("xid_64", 1),)),
    Row("xid-63-alone-informational", with_xids((300.0, xid(63))), H, NONE),
    Row(
        "xid-63-with-remap-pending",
        [*with_xids((300.0, xid(63))), snap(T0 + WINDOW + 1, [gpu(0), gpu(1, remap_pending=True)])],
        U,
        REBOOT,
        (("remap_pending", 1),),
    ),
    # --- Xid 94: only past the rate limit (3 in the window)
    Row("xid-94-x3-at-limit", with_xids(*((100.0 * k, xid(94)) for k in (1, 2, 3))), H, NONE),
    Row(
        "xid-94-x4-over-limit",
        with_xids(*((100.0 * k, xid(94)) for k in (1, 2, 3, 4))),
        U,
        REBOOT,
        (("xid_94_rate", 1),),
    ),
    Row(
        "xid-94-x4-spread-over-two-gpus",
        with_xids(*((100.0 * k, xid(94, gpu_index=k % 2)) for k in (1, 2, 3, 4))),
        H,
        NONE,
    ),
    Row(
        "xid-94-x4-one-expired",
        with_xids(*((100.0 * k, xid(94)) for k in (0, 3, 4, 5)), duration=WINDOW + 50),
        H,
        NONE,
    ),
    # --- anything else: recorded, degraded, no action
    Row("xid-61-unclassified", with_xids((300.0, xid(61))), D, NONE, (("xid_other", 1),)),
    # --- window expiry
    Row("xid-79-expired", with_xids((0.0, xid(79)), duration=WINDOW + 1), H, NONE),
    Row(
        "xid-79-at-window-edge",
        with_xids((0.0, xid(79)), duration=WINDOW),
        U,
        REBOOT,
        (("xid_79", 1),),
    ),
    Row("xid-13-expired", with_xids((0.0, xid(13)), duration=WINDOW + 1), H, NONE),
    # --- Xids named by PCI bus id only (the kernel log's form) or by nothing
    Row(
        "xid-79-by-kernel-bus-id",
        with_xids((300.0, xid(79, gpu_index=None, pci_bus_id="PCI:0000:1b:00"))),
        U,
        REBOOT,
        (("xid_79", 3),),
    ),
    Row(
        "xid-79-unknown-bus-id",
        with_xids((300.0, xid(79, gpu_index=None, pci_bus_id="0000:99:00"))),
        U,
        REBOOT,
        (("xid_79", None),),
    ),
    Row(
        "xid-79-no-gpu-named",
        with_xids((300.0, xid(79, gpu_index=None))),
        U,
        REBOOT,
        (("xid_79", None),),
    ),
    # --- volatile uncorrected ECC
    Row("ecc-flat", counters([0] * 21), H, NONE),
    Row("ecc-flat-nonzero", counters([5] * 21), H, NONE),
    Row("ecc-rising", counters([0] * 10 + [1] * 11), U, REBOOT, (("ecc_uncorrected_rising", 2),)),
    Row("ecc-reset-by-driver-reload", counters([4] * 10 + [0] * 11), H, NONE),
    Row("ecc-rose-before-the-window", counters([0] * 5 + [2] * 30), H, NONE),
    Row("ecc-unreadable", counters([None] * 21), H, NONE),
    Row(
        "ecc-rising-across-unreadable",
        counters([0, None, None, 3]),
        U,
        REBOOT,
        (("ecc_uncorrected_rising", 2),),
    ),
    # --- row remapping
    Row(
        "remap-pending",
        [snap(T0, [gpu(0, remap_pending=True)])],
        U,
        REBOOT,
        (("remap_pending", 0),),
    ),
    Row(
        "remap-failed", [snap(T0, [gpu(0, remap_failed=True)])], U, INSPECT, (("remap_failed", 0),)
    ),
    Row("remap-unknown", [snap(T0, [gpu(0, remap_pending=None, remap_failed=None)])], H, NONE),
    # --- HW thermal slowdown share of the window's minutes (0.6)
    Row("thermal-share-0.5", thermal(5), H, NONE),
    Row("thermal-share-0.6", thermal(6), U, INSPECT, (("thermal_slowdown", 3),)),
    Row("thermal-share-1.0", thermal(10), U, INSPECT, (("thermal_slowdown", 3),)),
    Row("thermal-one-minute-of-data", thermal(1, sampled_minutes=1), H, NONE),
    Row("thermal-5-of-5-minutes-too-little-data", thermal(5, sampled_minutes=5), H, NONE),
    Row(
        "thermal-4-of-6-minutes-enough-data",
        thermal(4, sampled_minutes=6),
        U,
        INSPECT,
        (("thermal_slowdown", 3),),
    ),
    Row("thermal-sw-slowdown-ignored", thermal(10, bits=ClockEvent.SW_THERMAL_SLOWDOWN), H, NONE),
    Row("thermal-hw-slowdown-ignored", thermal(10, bits=ClockEvent.HW_SLOWDOWN), H, NONE),
    Row(
        "thermal-hw-thermal-among-other-bits",
        thermal(10, bits=ClockEvent.HW_THERMAL_SLOWDOWN | ClockEvent.SW_POWER_CAP),
        U,
        INSPECT,
        (("thermal_slowdown", 3),),
    ),
    # --- temperature at or over slowdown, continuously (120 s)
    Row("temperature-119s", hot_run(119.0), H, NONE),
    Row("temperature-120s", hot_run(120.0), U, INSPECT, (("temperature_sustained", 1),)),
    Row(
        "temperature-120s-then-cooled-within-window",
        hot_run(120.0, then_cool_until=T0 + 400),
        U,
        INSPECT,
        (("temperature_sustained", 1),),
    ),
    Row(
        "temperature-120s-then-cooled-past-window",
        hot_run(120.0, then_cool_until=T0 + 120 + WINDOW + 30),
        H,
        NONE,
    ),
    Row(
        "temperature-interrupted-by-a-cool-sample",
        [
            *hot_run(80.0),
            snap(T0 + 85, [gpu(0), gpu(1, temperature_c=80.0)]),
            *hot_run(80.0, start=T0 + 90),
        ],
        H,
        NONE,
    ),
    Row(
        "temperature-interrupted-by-a-gap",
        [*hot_run(60.0), *hot_run(60.0, start=T0 + 200)],
        H,
        NONE,
    ),
    Row(
        "temperature-unknown-threshold",
        [
            snap(T0 + t, [gpu(1, temperature_c=99.0, slowdown_temp_c=None)])
            for t in range(0, 300, 5)
        ],
        H,
        NONE,
    ),
    # --- GPUs gone
    Row("gpu-lost", [snap(T0, [gpu(0), gpu(1, lost=True)])], U, REBOOT, (("gpu_lost", 1),)),
    Row(
        "gpu-missing",
        [snap(T0, [gpu(i) for i in range(8)]), snap(T0 + 5, [gpu(i) for i in range(8) if i != 5])],
        U,
        REBOOT,
        (("gpu_missing", None),),
        expected_gpus=8,
    ),
    Row("gpu-count-as-expected", [snap(T0, [gpu(i) for i in range(8)])], H, NONE, expected_gpus=8),
    Row("gpu-count-not-expected", [snap(T0, [gpu(i) for i in range(7)])], H, NONE),
    Row(
        "gpu-missing-no-gpu-at-all",
        [snap(T0, [])],
        U,
        REBOOT,
        (("gpu_missing", None),),
        expected_gpus=8,
    ),
]


def _check(row: Row, result: Assessment) -> None:
    assert result.verdict is row.verdict, result
    assert result.action is row.action, result
    assert [(r.code, r.gpu) for r in result.reasons] == list(row.reasons), result
    if row.verdict is H:
        assert result.reasons == ()


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_policy_table(row: Row) -> None:
    _check(row, assess(row.history, expected_gpus=row.expected_gpus))


def test_every_row_id_is_unique() -> None:
    assert len({r.id for r in ROWS}) == len(ROWS)


# --- messages --------------------------------------------------------------------------------


def _one(history: Sequence[Snapshot], **kwargs: Any) -> Reason:
    (reason,) = assess(history, **kwargs).reasons
    return reason


def test_xid_message_names_the_gpu_its_bus_and_the_catalog_meaning() -> None:
    reason = _one(with_xids((300.0, xid(79, gpu_index=3))))
    assert reason.message == f"GPU 3 ({bus(3)}): Xid 79 — GPU has fallen off the bus"
    assert "\n" not in reason.message


def test_repeated_xid_message_counts_them() -> None:
    reason = _one(with_xids((100.0, xid(13)), (200.0, xid(13))))
    assert (
        reason.message
        == f"GPU 1 ({bus(1)}): Xid 13 ×2 in the last 10 min — Graphics Engine Exception"
        " (application error)"
    )


def test_unclassified_xid_quotes_the_driver_on_one_line() -> None:
    driver = "pid=1234,\n  name=trtllm-serve, Channel 0x00000018 " + "x" * 300
    reason = _one(with_xids((300.0, xid(61, message=driver))))
    assert reason.message.startswith(f"GPU 1 ({bus(1)}): Xid 61 — not classified")
    assert "pid=1234, name=trtllm-serve" in reason.message
    assert "\n" not in reason.message
    assert len(reason.message) < 250


def test_xid_94_message_gives_the_count_and_limit() -> None:
    reason = _one(with_xids(*((100.0 * k, xid(94)) for k in (1, 2, 3, 4, 5))))
    assert "Xid 94 ×5 in the last 10 min (more than 3)" in reason.message


def test_gpu_missing_message_names_expected_found_and_the_gone_gpu() -> None:
    history = [
        snap(T0, [gpu(i) for i in range(8)]),
        snap(T0 + 5, [gpu(i) for i in range(8) if i != 5]),
    ]
    reason = _one(history, expected_gpus=8)
    assert reason.message == "7 of 8 expected GPUs found (gone since earlier in the window: GPU 5)"


def test_ecc_message_gives_the_rise() -> None:
    reason = _one(counters([0, 0, 2]))
    assert (
        reason.message
        == f"GPU 2 ({bus(2)}): volatile uncorrected ECC errors rose from 0 to 2 in the last 10 min"
    )


def test_thermal_messages() -> None:
    share = _one(thermal(7))
    assert (
        share.message == f"GPU 3 ({bus(3)}): hardware thermal slowdown in 7 of 10 sampled minutes"
        " of the last 10 min — check its cooling"
    )
    sustained = _one(hot_run(125.0))
    assert (
        sustained.message
        == f"GPU 1 ({bus(1)}): at or over its slowdown temperature (87 °C) for 125 s"
        " — check its cooling"
    )


def test_gpu_without_bus_id_is_named_by_index() -> None:
    reason = _one([snap(T0, [gpu(4, pci_bus_id=None, lost=True)])])
    assert reason.message.startswith("GPU 4: lost")


# --- matching a GPU across snapshots -------------------------------------------------------------


def test_ecc_follows_the_gpu_by_uuid_when_indices_change() -> None:
    """After a GPU drops out, NVML renumbers: the uuid is the GPU, the index is not."""
    before = snap(T0, [gpu(0, uuid="GPU-a"), gpu(1, uuid="GPU-b", ecc_uncorrected_volatile=0)])
    after = snap(T0 + 30, [gpu(0, uuid="GPU-b", ecc_uncorrected_volatile=0)])
    assert assess([before, after]).verdict is H
    rising = snap(T0 + 60, [gpu(0, uuid="GPU-b", ecc_uncorrected_volatile=1)])
    before_a = snap(T0, [gpu(0, uuid="GPU-a", ecc_uncorrected_volatile=9), gpu(1, uuid="GPU-b")])
    assert [(r.code, r.gpu) for r in assess([before_a, rising]).reasons] == [
        ("ecc_uncorrected_rising", 0)
    ]
    assert "from 0 to 1" in assess([before_a, rising]).reasons[0].message


def test_ecc_falls_back_to_index_without_uuids() -> None:
    history = [
        snap(T0, [gpu(0, uuid=None, ecc_uncorrected_volatile=0)]),
        snap(T0 + 30, [gpu(0, uuid=None, ecc_uncorrected_volatile=1)]),
    ]
    assert [r.code for r in assess(history).reasons] == ["ecc_uncorrected_rising"]


# --- combinations: the worst wins -------------------------------------------------------------


def test_application_and_reboot_xids_reboot() -> None:
    result = assess(with_xids((100.0, xid(13)), (200.0, xid(79))))
    assert (result.verdict, result.action) == (U, REBOOT)
    assert [r.code for r in result.reasons] == ["xid_79", "xid_app"]


def test_reboot_and_hardware_inspection_inspect() -> None:
    history = with_xids((100.0, xid(48, gpu_index=0)))
    history.append(snap(T0 + WINDOW + 1, [gpu(0), gpu(1, remap_failed=True)]))
    result = assess(history)
    assert (result.verdict, result.action) == (U, INSPECT)
    assert [(r.code, r.gpu) for r in result.reasons] == [("xid_48", 0), ("remap_failed", 1)]


def test_degraded_without_action_and_restart() -> None:
    result = assess(with_xids((100.0, xid(61, gpu_index=0)), (200.0, xid(31, gpu_index=2))))
    assert (result.verdict, result.action) == (D, RESTART)


def test_unhealthy_with_reboot_beats_degraded_with_restart() -> None:
    history = with_xids((100.0, xid(43)))
    history.append(snap(T0 + WINDOW + 1, [gpu(0, lost=True), gpu(1)]))
    result = assess(history)
    assert (result.verdict, result.action) == (U, REBOOT)


def test_reasons_are_ordered_by_gpu_then_code_with_the_server_first() -> None:
    history = [
        snap(T0, [gpu(i) for i in range(4)]),
        snap(
            T0 + 30,
            [gpu(0), gpu(2, remap_pending=True, remap_failed=True, lost=True), gpu(3)],
            xids=[xid(79, gpu_index=2), xid(13, gpu_index=0), xid(61, gpu_index=None)],
        ),
    ]
    result = assess(history, expected_gpus=4)
    assert [(r.code, r.gpu) for r in result.reasons] == [
        ("gpu_missing", None),
        ("xid_other", None),
        ("xid_app", 0),
        ("gpu_lost", 2),
        ("remap_failed", 2),
        ("remap_pending", 2),
        ("xid_79", 2),
    ]
    assert (result.verdict, result.action) == (U, INSPECT)


def test_one_reason_per_gpu_and_xid() -> None:
    result = assess(
        with_xids(
            (100.0, xid(79, gpu_index=0)),
            (200.0, xid(79, gpu_index=1)),
            (300.0, xid(79, gpu_index=1)),
        )
    )
    assert [(r.code, r.gpu) for r in result.reasons] == [("xid_79", 0), ("xid_79", 1)]
    assert "×2" in result.reasons[1].message


# --- determinism, purity, thresholds ---------------------------------------------------------


def _busy_history() -> list[Snapshot]:
    history = with_xids(
        (100.0, xid(13, gpu_index=0)),
        (150.0, xid(94)),
        (200.0, xid(79, gpu_index=3)),
        (250.0, xid(61, gpu_index=None)),
    )
    history.append(snap(T0 + WINDOW + 5, [gpu(0), gpu(1, remap_pending=True), gpu(2, lost=True)]))
    return history


def test_same_history_same_assessment() -> None:
    history = _busy_history()
    first = assess(history, expected_gpus=4)
    assert all(assess(list(history), expected_gpus=4) == first for _ in range(5))


def test_input_order_does_not_matter() -> None:
    history = _busy_history()
    expected = assess(history, expected_gpus=4)
    rng = random.Random(7)
    for _ in range(10):
        shuffled = history[:]
        rng.shuffle(shuffled)
        assert assess(shuffled, expected_gpus=4) == expected


def test_history_is_not_modified() -> None:
    history = _busy_history()
    copy = list(history)
    assess(history)
    assert history == copy


def test_custom_thresholds() -> None:
    one_94 = with_xids((300.0, xid(94)))
    assert assess(one_94).verdict is H
    strict = Thresholds(xid94_max_per_window=0)
    assert [r.code for r in assess(one_94, thresholds=strict).reasons] == ["xid_94_rate"]
    # A shorter window lets an older Xid expire.
    old_79 = with_xids((0.0, xid(79)))
    assert assess(old_79).verdict is U
    assert assess(old_79, thresholds=Thresholds(window_s=300.0)).verdict is H
    # Sustained temperature threshold.
    assert assess(hot_run(60.0), thresholds=Thresholds(thermal_sustained_s=60.0)).verdict is U


@pytest.mark.parametrize(
    "fields",
    [
        {"window_s": 0.0},
        {"window_s": float("nan")},
        {"thermal_sustained_s": -1.0},
        {"max_sample_gap_s": 0.0},
        {"thermal_minutes_share": 0.0},
        {"thermal_minutes_share": 1.5},
        {"thermal_min_coverage": 0.0},
        {"xid94_max_per_window": -1},
    ],
    ids=lambda f: next(iter(f)),
)
def test_thresholds_refuse_nonsense(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Thresholds(**fields)


def test_threshold_defaults() -> None:
    t = Thresholds()
    assert (t.window_s, t.thermal_minutes_share, t.thermal_sustained_s, t.xid94_max_per_window) == (
        600.0,
        0.6,
        120.0,
        3,
    )


# --- shapes ----------------------------------------------------------------------------------


def test_to_dict_is_json_ready() -> None:
    result = assess(_busy_history(), expected_gpus=4)
    data = result.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["verdict"] == "unhealthy" and type(data["verdict"]) is str
    assert data["action"] == "reboot" and type(data["action"]) is str
    assert data["reasons"][0] == {
        "code": "gpu_missing",
        "gpu": None,
        "message": "3 of 4 expected GPUs found (gone since earlier in the window: GPU 3)",
        "action": "reboot",
        "verdict": "unhealthy",
    }
    for reason in data["reasons"]:
        assert set(reason) == {"code", "gpu", "message", "action", "verdict"}
        assert all(type(reason[k]) is str for k in ("code", "message", "action", "verdict"))


def test_healthy_to_dict() -> None:
    assert assess(quiet()).to_dict() == {"verdict": "healthy", "action": "none", "reasons": []}


def test_verdict_values_match_the_fleets() -> None:
    from fleet.models import Verdict as FleetVerdict

    assert [v.value for v in Verdict] == [v.value for v in FleetVerdict]


def test_enums_are_ordered_by_severity() -> None:
    assert [a.value for a in RepairAction] == [
        "none",
        "restart_engine",
        "reboot",
        "hardware_inspection",
    ]
    assert [v.value for v in Verdict] == ["healthy", "degraded", "unhealthy"]


def test_every_classified_xid_has_a_meaning() -> None:
    assert {*APPLICATION_XIDS, *REBOOT_XIDS, 63, 64, 94} <= set(XID_MEANINGS)
