"""Xid errors from the kernel log: line parsing, PCI → GPU index, and the two readers.

The fixtures are hand-written kernel-log excerpts modelled on real driver output. KmsgReader runs
against a regular file or a FIFO standing in for /dev/kmsg: both are opened exactly as the real
device is (O_RDONLY | O_NONBLOCK), and the FIFO with a writer but no data raises EAGAIN on read
as /dev/kmsg does when no record is waiting. One smoke test reads the real /dev/kmsg where this
machine allows it (read-only; nothing is written to the kernel log).
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from repo_paths import FIXTURES

from fleet_agent.telemetry.kmsg import (
    DmesgReader,
    KmsgReader,
    attach_gpu_indexes,
    linux_boot_time,
    parse_xid_line,
    parse_xid_lines,
    pci_key,
)
from fleet_core.telemetry import GpuSample, TelemetryUnavailable, XidEvent

BOOT = 1_715_000_000.0

# Every Xid in kmsg_xid.txt, in order.
KMSG_XIDS = [
    (13, "0000:b3:00"),
    (13, "0000:b3:00"),
    (31, "0000:c3:00"),
    (48, "0000:1b:00"),
    (63, "0000:1b:00"),
    (94, "0000:3b:00"),
    (64, "0000:1b:00"),
    (119, "0000:3b:00"),
    (79, "0000:3b:00"),
    (79, "0000:df:00"),
]
DMESG_XIDS = [
    (13, "0000:b3:00"),
    (48, "0000:1b:00"),
    (63, "0000:1b:00"),
    (94, "0000:3b:00"),
    (119, "0000:3b:00"),
    (79, "0000:3b:00"),
]
# The server these logs came from, as NVML lists it (no GPU at c3 here).
BUSES = (0x1B, 0x3B, 0x43, 0x52, 0x9D, 0xB3, 0xD1, 0xDF)
GPUS = tuple(
    GpuSample(index=i, pci_bus_id=f"00000000:{bus:02X}:00.0") for i, bus in enumerate(BUSES)
)


def fixture_lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text(encoding="utf-8").splitlines()


def pairs(events: list[XidEvent] | tuple[XidEvent, ...]) -> list[tuple[int, str | None]]:
    return [(e.xid, e.pci_bus_id) for e in events]


# -- parsing -----------------------------------------------------------------------------------


def test_kmsg_fixture_yields_exactly_its_xids() -> None:
    events = parse_xid_lines(fixture_lines("kmsg_xid.txt"), boot_time=BOOT)
    assert pairs(events) == KMSG_XIDS
    assert all(e.source == "kmsg" and e.gpu_index is None for e in events)
    # /dev/kmsg stamps are microseconds since boot.
    assert events[0].at == pytest.approx(BOOT + 4102.334871)
    assert events[-1].at == pytest.approx(BOOT + 9044.417506)
    assert events[0].message == (
        "NVRM: Xid (PCI:0000:b3:00): 13, pid=2331, name=python3, Graphics SM Warp Exception on "
        "(GPC 4, TPC 0, SM 1): Out Of Range Address"
    )
    assert events[-1].message.endswith("name=<unknown>, GPU has fallen off the bus.")


def test_dmesg_fixture_yields_exactly_its_xids() -> None:
    events = parse_xid_lines(fixture_lines("dmesg_xid.txt"), boot_time=BOOT)
    assert pairs(events) == DMESG_XIDS
    assert [round(e.at - BOOT, 6) for e in events] == [
        4102.334871,
        7719.20441,
        7719.204488,
        7802.110457,
        8300.456021,
        8301.002377,
    ]


@pytest.mark.parametrize(
    ("line", "xid", "pci"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.", 79, "0000:3b:00"),
        (
            "NVRM: Xid (PCI:0000:3b:00): 94, pid=4120, name=trtllm-serve, Contained: SM (0x1). "
            "RST: No, D-RST: No",
            94,
            "0000:3b:00",
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 64, pid=4120, name=trtllm-serve, Row Remapper: "
            "Failed to remap row",
            64,
            "0000:3b:00",
        ),
        ("NVRM: Xid (0000:03:00): 31, Ch 00000001, engmask 00000101", 31, "0000:03:00"),
        (
            "Jan 06 17:59:27 gpu01 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has "
            "fallen off the bus.",
            79,
            "0000:01:00",
        ),
        ("4,77,123,-;NVRM: Xid (PCI:0000:3B:00): 119, pid=9, Timeout after 6s", 119, "0000:3B:00"),
    ],
)
def test_xid_line_shapes(line: str, xid: int, pci: str) -> None:
    event = parse_xid_line(line, boot_time=BOOT)
    assert event is not None
    assert (event.xid, event.pci_bus_id) == (xid, pci)
    assert event.message.startswith("NVRM: Xid (")


@pytest.mark.parametrize(
    "line",
    [
        "",
        "3,1420,8301002380,-;NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "6,1405,25337210,-;NVRM: GPU at PCI:0000:3b:00: GPU-4f4c8bd7-6c1b-2b3e-9a11-0d6e1f5c8a42",
        "[ 8300.120912] pcieport 0000:3a:01.0: AER: Uncorrected (Fatal) error received",
        "NVRM: Xid (PCI:0000:3b:00): , pid=0",  # truncated: no number
        "user text mentioning Xid 79 without the driver's shape",
        " DEVICE=+pci:0000:1b:00.0",
    ],
)
def test_non_xid_lines_are_ignored(line: str) -> None:
    assert parse_xid_line(line, boot_time=BOOT) is None


def test_iso_timestamps_from_dmesg_time_format_iso() -> None:
    text = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."
    utc = parse_xid_line(f"2024-05-14T10:23:45,123456+00:00 {text}", boot_time=0.0)
    plus_two = parse_xid_line(f"2024-05-14T12:23:45,123456+0200 {text}", boot_time=0.0)
    assert utc is not None and plus_two is not None
    assert utc.at == pytest.approx(1_715_682_225.123456)
    assert plus_two.at == pytest.approx(utc.at)
    assert utc.xid == 79 and utc.pci_bus_id == "0000:3b:00"


def test_ctime_timestamps_from_dmesg_dash_t_are_local_time() -> None:
    event = parse_xid_line(
        "[Tue May 14 10:23:45 2024] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE", boot_time=0.0
    )
    assert event is not None
    assert event.at == datetime(2024, 5, 14, 10, 23, 45).timestamp()


def test_unstamped_lines_get_the_time_they_were_read() -> None:
    before = time.time()
    event = parse_xid_line("kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1, GPU has fallen off")
    assert event is not None and before <= event.at <= time.time()


def test_default_boot_time_is_this_machines() -> None:
    event = parse_xid_line("[   12.500000] NVRM: Xid (PCI:0000:01:00): 13, pid=1, x")
    assert event is not None
    assert event.at == pytest.approx(linux_boot_time() + 12.5, abs=1.0)


# -- PCI addresses and GPU indexes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("0000:3b:00", (0, 0x3B, 0, None)),
        ("00000000:3B:00.0", (0, 0x3B, 0, 0)),
        ("PCI:0001:B3:00", (1, 0xB3, 0, None)),
        ("3b:00.1", (0, 0x3B, 0, 1)),
        ("not-a-pci-address", None),
        ("0000:3b:00.9", None),
    ],
)
def test_pci_key_reads_both_spellings(address: str, key: tuple[int, int, int, int | None]) -> None:
    assert pci_key(address) == key


def test_attach_gpu_indexes_maps_kernel_addresses_to_nvml_gpus() -> None:
    events = attach_gpu_indexes(
        parse_xid_lines(fixture_lines("kmsg_xid.txt"), boot_time=BOOT), GPUS
    )
    assert [(e.xid, e.gpu_index) for e in events] == [
        (13, 5),
        (13, 5),
        (31, None),  # c3 is not one of this server's GPUs: kept, unindexed
        (48, 0),
        (63, 0),
        (94, 1),
        (64, 0),
        (119, 1),
        (79, 1),
        (79, 7),
    ]
    # A matched event takes NVML's spelling; an unmatched one keeps the kernel's.
    assert events[0].pci_bus_id == "00000000:B3:00.0"
    assert events[2].pci_bus_id == "0000:c3:00"
    assert events[0].message.startswith("NVRM: Xid (PCI:0000:b3:00): 13")


def test_attach_gpu_indexes_edge_cases() -> None:
    already = XidEvent(xid=79, at=1.0, gpu_index=4, pci_bus_id="0000:3b:00", source="nvml")
    other_domain = XidEvent(xid=79, at=1.0, pci_bus_id="0001:3b:00")
    no_address = XidEvent(xid=79, at=1.0)
    other_function = XidEvent(xid=79, at=1.0, pci_bus_id="0000:3b:00.1")
    gpus = [GpuSample(index=0), *GPUS]  # a GPU without a bus id is skipped
    assert attach_gpu_indexes([already, other_domain, no_address, other_function], gpus) == (
        already,
        other_domain,
        no_address,
        other_function,
    )
    assert attach_gpu_indexes([], GPUS) == ()


# -- KmsgReader --------------------------------------------------------------------------------


def append(path: Path, lines: list[str]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


@pytest.fixture
def log_file(tmp_path: Path) -> Path:
    """A regular file standing in for /dev/kmsg, already holding the fixture."""
    path = tmp_path / "kmsg"
    path.write_text((FIXTURES / "kmsg_xid.txt").read_text(encoding="utf-8"), encoding="utf-8")
    return path


def test_kmsg_reader_skips_what_was_logged_before_it_started(log_file: Path) -> None:
    reader = KmsgReader(log_file, boot_time=BOOT)
    try:
        assert reader.read_new() == []
        append(
            log_file,
            [
                "6,1426,9200000000,-;e1000e: eno1 NIC Link is Up 1000 Mbps Full Duplex",
                "4,1427,9300000000,-;NVRM: Xid (PCI:0000:43:00): 45, pid=77, name=python3, Ch 8",
            ],
        )
        events = reader.read_new()
        assert pairs(events) == [(45, "0000:43:00")]
        assert events[0].at == pytest.approx(BOOT + 9300.0)
        assert reader.read_new() == []
    finally:
        reader.close()


def test_kmsg_reader_from_start_reports_everything(log_file: Path) -> None:
    reader = KmsgReader(log_file, from_start=True, boot_time=BOOT)
    assert pairs(reader.read_new()) == KMSG_XIDS
    reader.close()
    with pytest.raises(TelemetryUnavailable, match="closed"):
        reader.read_new()
    reader.close()  # twice is fine


def test_kmsg_reader_is_bounded_per_call_and_joins_split_lines(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    lines = [
        f"4,{n},{n * 1000},-;NVRM: Xid (PCI:0000:1b:00): {n % 200}, pid={n}, name=python3, "
        + "x" * (n % 97)
        for n in range(2000)
    ]
    append(path, lines)
    reader = KmsgReader(path, from_start=True, max_reads=1, boot_time=BOOT)
    seen: list[XidEvent] = []
    for _ in range(100):
        batch = reader.read_new()
        if not batch and len(seen) == len(lines):
            break
        assert len(batch) < len(lines)  # one 16 KiB read per call, not the whole log
        seen.extend(batch)
    reader.close()
    # Records cut by the 16 KiB reads come out whole, once each, in order.
    assert [e.xid for e in seen] == [n % 200 for n in range(2000)]
    assert [e.at for e in seen] == [pytest.approx(BOOT + n / 1000) for n in range(2000)]


def test_kmsg_reader_on_a_fifo_handles_eagain_and_partial_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kmsg.fifo"
    os.mkfifo(path)
    reader = KmsgReader(path, boot_time=BOOT)  # seeking a FIFO fails with ESPIPE: tolerated
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    outcomes: list[str] = []
    real_read = os.read

    def spy(fd: int, size: int) -> bytes:
        try:
            data = real_read(fd, size)
        except BlockingIOError:
            outcomes.append("EAGAIN")
            raise
        outcomes.append(f"{len(data)} bytes")
        return data

    monkeypatch.setattr(os, "read", spy)
    try:
        started = time.monotonic()
        assert reader.read_new() == []
        assert outcomes == ["EAGAIN"]  # a writer, no data: would block, so it returns at once
        assert time.monotonic() - started < 1.0
        line = b"4,1,5000000,-;NVRM: Xid (PCI:0000:df:00): 79, pid=0, GPU has fallen off the bus.\n"
        os.write(writer, line[:30])
        assert reader.read_new() == []  # half a record: held back
        os.write(writer, line[30:] + b"6,2,5000001,-;unrelated\n")
        events = reader.read_new()
        assert pairs(events) == [(79, "0000:df:00")]
        assert events[0].at == pytest.approx(BOOT + 5.0)
        assert outcomes[-1] == "EAGAIN"
    finally:
        os.close(writer)
        reader.close()


def test_kmsg_reader_survives_overwritten_records(
    log_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_read = os.read
    raised: list[bool] = []

    def read_with_epipe(fd: int, size: int) -> bytes:
        if not raised:
            raised.append(True)
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return real_read(fd, size)

    reader = KmsgReader(log_file, from_start=True, boot_time=BOOT)
    monkeypatch.setattr(os, "read", read_with_epipe)
    with caplog.at_level(logging.WARNING, logger="fleet_agent.telemetry.kmsg"):
        assert pairs(reader.read_new()) == KMSG_XIDS
    assert reader.dropped == 1
    assert "overwritten" in caplog.text
    reader.close()


def test_kmsg_reader_refuses_clearly_when_it_cannot_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TelemetryUnavailable, match="cannot open the kernel log"):
        KmsgReader(tmp_path / "missing")

    def denied(*_: object) -> int:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(TelemetryUnavailable, match=r"permission denied.*CAP_SYSLOG"):
        KmsgReader(tmp_path / "kmsg")


def test_kmsg_reader_permission_error_on_read(
    log_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = KmsgReader(log_file, from_start=True)

    def denied(*_: object) -> bytes:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "read", denied)
    with pytest.raises(TelemetryUnavailable, match="permission denied"):
        reader.read_new()
    reader.close()


def test_kmsg_reader_on_the_real_dev_kmsg() -> None:
    """Smoke test on this machine's kernel log where it can be read: no hang, no crash."""
    try:
        reader = KmsgReader()
    except TelemetryUnavailable as exc:
        pytest.skip(str(exc))
    try:
        started = time.monotonic()
        events = reader.read_new()
        assert time.monotonic() - started < 5.0
        assert all(e.source == "kmsg" for e in events)
    finally:
        reader.close()


# -- DmesgReader -------------------------------------------------------------------------------


def cat(path: Path) -> tuple[str, ...]:
    return ("cat", str(path))


def test_dmesg_reader_reports_only_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "dmesg.txt"
    path.write_text((FIXTURES / "dmesg_xid.txt").read_text(encoding="utf-8"), encoding="utf-8")
    reader = DmesgReader(cat(path), boot_time=BOOT)
    assert reader.read_new() == []
    append(
        path,
        [
            "[ 9000.000001] NVRM: Xid (PCI:0000:d1:00): 92, pid=0, High single-bit ECC error rate",
            "[ 9000.500000] usb 1-1: new high-speed USB device number 3 using xhci_hcd",
        ],
    )
    events = reader.read_new()
    assert pairs(events) == [(92, "0000:d1:00")]
    assert events[0].at == pytest.approx(BOOT + 9000.000001)
    assert reader.read_new() == []


def test_dmesg_reader_can_include_what_is_already_logged() -> None:
    reader = DmesgReader(cat(FIXTURES / "dmesg_xid.txt"), include_existing=True, boot_time=BOOT)
    assert pairs(reader.read_new()) == DMESG_XIDS
    assert reader.read_new() == []


def test_dmesg_reader_when_the_ring_buffer_rotates(tmp_path: Path) -> None:
    path = tmp_path / "dmesg.txt"
    lines = fixture_lines("dmesg_xid.txt")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    reader = DmesgReader(cat(path), boot_time=BOOT)
    newest = "[ 9500.000000] NVRM: Xid (PCI:0000:9d:00): 74, pid=0, NVLink: fatal error"
    path.write_text("\n".join([*lines[6:], newest]) + "\n", encoding="utf-8")  # oldest gone
    assert pairs(reader.read_new()) == [(74, "0000:9d:00")]


def test_dmesg_reader_refuses_clearly(tmp_path: Path) -> None:
    with pytest.raises(TelemetryUnavailable, match="not installed"):
        DmesgReader((str(tmp_path / "no-dmesg"),))
    failing = (
        "sh",
        "-c",
        "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1",
    )
    with pytest.raises(TelemetryUnavailable, match="exited with 1: dmesg: read kernel buffer"):
        DmesgReader(failing)


def test_dmesg_reader_timeout_skips_one_round(caplog: pytest.LogCaptureFixture) -> None:
    slow = (sys.executable, "-c", "import time; time.sleep(30)")
    reader = DmesgReader(slow, timeout_s=0.2, include_existing=True)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fleet_agent.telemetry.kmsg"):
        assert reader.read_new() == []
    assert time.monotonic() - started < 5.0
    assert "took over 0.2 s" in caplog.text


def test_dmesg_reader_on_this_machine() -> None:
    """Smoke test with the real `dmesg` where this machine allows it."""
    try:
        reader = DmesgReader(shlex.split("dmesg --kernel --nopager"))
    except TelemetryUnavailable as exc:
        pytest.skip(str(exc))
    assert all(e.source == "kmsg" for e in reader.read_new())
