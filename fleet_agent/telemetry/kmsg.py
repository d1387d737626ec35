"""NVIDIA Xid errors from the kernel log (/dev/kmsg, or `dmesg` where /dev/kmsg is closed).

The driver logs every Xid as `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., <text>`. NVML's event set
also reports Xids, but only while a process holds an NVML handle and only for event types it
registered; the kernel log catches everything, including Xids from before the agent started (if
asked) and from a GPU NVML can no longer open. Events are matched to NVML's GPU indexes by PCI
address (`attach_gpu_indexes`).

Line shapes understood (the Xid text may follow any of these prefixes):
    /dev/kmsg          4,1234,5678901234,-;NVRM: Xid ...        (prio,seq,usec since boot,flags)
    dmesg              [ 1234.567890] NVRM: Xid ...             (seconds since boot)
    dmesg iso          2024-05-14T10:23:45,123456+00:00 NVRM: Xid ...
    dmesg -T           [Tue May 14 10:23:45 2024] NVRM: Xid ...  (local time)
    anything else      ... NVRM: Xid ...                        (journalctl -k; time = now)
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from fleet_core.telemetry import GpuSample, TelemetryUnavailable, XidEvent

log = logging.getLogger(__name__)

SOURCE = "kmsg"

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}"
    r"(?:\.[0-7])?)\): (?P<xid>\d+)\b.*$"
)
_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;")
_DMESG = re.compile(r"^\[\s*(?P<secs>\d+\.\d+)\]")
_DMESG_ISO = re.compile(
    r"^(?P<iso>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)\s"
)
_DMESG_CTIME = re.compile(r"^\[(?P<ctime>[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} [\d:]{8} \d{4})\]")
_PCI = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<dev>[0-9a-f]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$",
    re.IGNORECASE,
)

# One /dev/kmsg record never exceeds this (the kernel's CONSOLE_EXT_LOG_MAX is 8 KiB);
# a smaller buffer makes read() fail with EINVAL.
KMSG_READ_SIZE = 16384
# Bounds on one read_new() call, so a flood of kernel messages cannot stall the agent.
MAX_READS_PER_CALL = 10_000
MAX_PARTIAL_LINE = 65536


def linux_boot_time() -> float:
    """Epoch seconds at boot: kernel log stamps count CLOCK_MONOTONIC, which starts at boot."""
    return time.time() - time.monotonic()


def parse_xid_line(line: str, *, boot_time: float | None = None) -> XidEvent | None:
    """One kernel-log line → an XidEvent, or None if it is not an Xid line.

    `boot_time` (epoch seconds) turns since-boot stamps into wall-clock time; None means this
    machine's boot (`linux_boot_time()`). A line with no recognisable stamp gets the time now.
    `pci_bus_id` is the kernel's "0000:3b:00"; `gpu_index` is left None (see attach_gpu_indexes).
    """
    match = _XID.search(line)
    if match is None:
        return None
    return XidEvent(
        xid=int(match["xid"]),
        at=_line_time(line, boot_time),
        pci_bus_id=match["pci"],
        message=match.group(0).strip(),
        source=SOURCE,
    )


def parse_xid_lines(lines: Iterable[str], *, boot_time: float | None = None) -> list[XidEvent]:
    """Every Xid in `lines`, in order; /dev/kmsg continuation lines (" KEY=value") are skipped."""
    events = []
    for line in lines:
        if line.startswith(" "):
            continue
        event = parse_xid_line(line, boot_time=boot_time)
        if event is not None:
            events.append(event)
    return events


def _line_time(line: str, boot_time: float | None) -> float:
    if (m := _KMSG.match(line)) is not None:
        return _since_boot(int(m["usec"]) / 1e6, boot_time)
    if (m := _DMESG.match(line)) is not None:
        return _since_boot(float(m["secs"]), boot_time)
    if (m := _DMESG_ISO.match(line)) is not None:
        # util-linux writes "2024-05-14T10:23:45,123456+0000"; a stamp without zone is local.
        return datetime.fromisoformat(m["iso"].replace(",", ".")).timestamp()
    if (m := _DMESG_CTIME.match(line)) is not None:
        return datetime.strptime(m["ctime"], "%a %b %d %H:%M:%S %Y").timestamp()
    return time.time()


def _since_boot(seconds: float, boot_time: float | None) -> float:
    return (linux_boot_time() if boot_time is None else boot_time) + seconds


def pci_key(address: str) -> tuple[int, int, int, int | None] | None:
    """(domain, bus, device, function or None) from either spelling of a PCI address.

    The kernel writes "0000:3b:00" (4-digit domain, no function); NVML "00000000:3B:00.0".
    """
    match = _PCI.match(address.strip())
    if match is None:
        return None
    fn = match["fn"]
    return (
        int(match["domain"] or "0", 16),
        int(match["bus"], 16),
        int(match["dev"], 16),
        None if fn is None else int(fn),
    )


def _same_device(a: str, b: str) -> bool:
    ka, kb = pci_key(a), pci_key(b)
    if ka is None or kb is None:
        return False
    functions_match = ka[3] is None or kb[3] is None or ka[3] == kb[3]
    return ka[:3] == kb[:3] and functions_match


def attach_gpu_indexes(
    events: Iterable[XidEvent], gpus: Sequence[GpuSample]
) -> tuple[XidEvent, ...]:
    """Give each event the index of the GPU at its PCI address.

    A matched event also takes the GPU's NVML spelling of the address, so events from every
    source look alike downstream. Events with no matching GPU (or already indexed) are kept as
    they are: an Xid from a GPU NVML no longer lists is still worth reporting.
    """
    result = []
    for event in events:
        gpu = None
        if event.gpu_index is None and event.pci_bus_id:
            gpu = next(
                (g for g in gpus if g.pci_bus_id and _same_device(event.pci_bus_id, g.pci_bus_id)),
                None,
            )
        if gpu is None:
            result.append(event)
        else:
            result.append(replace(event, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id))
    return tuple(result)


class KmsgReader:
    """Reads new Xid lines from /dev/kmsg without blocking.

    /dev/kmsg hands out one record per read(); O_NONBLOCK makes read() fail with EAGAIN when no
    record is waiting, and EPIPE when records were overwritten in the ring buffer before we read
    them (the next read continues with the oldest record still there). `path` may name a FIFO or
    a regular file for tests: those return several lines per read, or end-of-file, which this
    reader handles too. Opening needs CAP_SYSLOG where kernel.dmesg_restrict=1.
    """

    def __init__(
        self,
        path: str | Path = "/dev/kmsg",
        *,
        from_start: bool = False,
        boot_time: float | None = None,
        max_reads: int = MAX_READS_PER_CALL,
    ) -> None:
        self.path = Path(path)
        self.boot_time = linux_boot_time() if boot_time is None else boot_time
        self.max_reads = max_reads
        self.dropped = 0  # EPIPE count: times records were lost before we read them
        self._partial = b""
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError as exc:
            raise TelemetryUnavailable(
                f"cannot read the kernel log at {self.path}: permission denied; run the agent as "
                "root or with CAP_SYSLOG (or set kernel.dmesg_restrict=0)"
            ) from exc
        except OSError as exc:
            raise TelemetryUnavailable(f"cannot open the kernel log at {self.path}: {exc}") from exc
        if not from_start:
            self._seek_to_end()

    def _seek_to_end(self) -> None:
        """Skip what is already logged, so a restarted agent does not re-report old Xids."""
        assert self._fd is not None
        try:
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as exc:
            if exc.errno != errno.ESPIPE:  # a FIFO has no end to seek to: nothing old in it
                raise

    def read_new(self) -> list[XidEvent]:
        """Xid events logged since the previous call (at most `max_reads` reads' worth)."""
        if self._fd is None:
            raise TelemetryUnavailable(f"kernel log reader for {self.path} is closed")
        chunks: list[bytes] = []
        for _ in range(self.max_reads):
            data = self._read_once()
            if data is None:
                continue  # records were lost; the next read goes on from the oldest left
            if not data:
                break
            chunks.append(data)
        return parse_xid_lines(self._complete_lines(b"".join(chunks)), boot_time=self.boot_time)

    def _read_once(self) -> bytes | None:
        """One read(): data; b"" when nothing more is waiting (EAGAIN, end of a file); None
        when the kernel reports overwritten records (EPIPE)."""
        assert self._fd is not None
        try:
            return os.read(self._fd, KMSG_READ_SIZE)
        except BlockingIOError:
            return b""
        except BrokenPipeError:
            self.dropped += 1
            log.warning("kernel log records were overwritten before %s read them", self.path)
            return None
        except PermissionError as exc:
            raise TelemetryUnavailable(f"reading {self.path}: permission denied") from exc

    def _complete_lines(self, data: bytes) -> list[str]:
        """Split into whole lines; keep a trailing partial line (FIFO/file) for next time."""
        buffered = self._partial + data
        *lines, self._partial = buffered.split(b"\n")
        if len(self._partial) > MAX_PARTIAL_LINE:
            self._partial = b""  # not a log line anyone wrote on purpose; do not grow forever
        return [raw.decode("utf-8", errors="replace") for raw in lines]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DmesgReader:
    """Fallback when /dev/kmsg cannot be opened: runs `dmesg` and reports Xid lines it has not
    seen before.

    "Seen" is the previous run's output, so memory is bounded by the kernel ring buffer. Two
    identical lines (same timestamp and text) count as one; with dmesg's timestamps that
    happens only for records the kernel itself duplicated. The first run happens in the
    constructor: a missing or forbidden dmesg is a clear refusal to start, and (unless
    `include_existing`) what is already logged is not reported.
    """

    def __init__(
        self,
        command: Sequence[str] = ("dmesg", "--kernel", "--nopager"),
        *,
        timeout_s: float = 10.0,
        include_existing: bool = False,
        boot_time: float | None = None,
    ) -> None:
        self.command = tuple(command)
        self.timeout_s = timeout_s
        self.boot_time = linux_boot_time() if boot_time is None else boot_time
        self._seen: set[str] = set()
        if not include_existing:
            lines = self._run()
            self._seen = set(lines) if lines is not None else set()

    def read_new(self) -> list[XidEvent]:
        """Xid events in lines that were not in the previous output."""
        lines = self._run()
        if lines is None:
            return []
        new = [line for line in lines if line not in self._seen]
        self._seen = set(lines)
        return parse_xid_lines(new, boot_time=self.boot_time)

    def _run(self) -> list[str] | None:
        """dmesg's lines; None after a timeout (transient: try again next time)."""
        try:
            done = subprocess.run(
                self.command,
                capture_output=True,
                timeout=self.timeout_s,
                check=False,
            )
        except FileNotFoundError as exc:
            raise TelemetryUnavailable(f"cannot run {self.command[0]!r}: not installed") from exc
        except subprocess.TimeoutExpired:
            log.warning("%s took over %.1f s; skipped this time", self.command[0], self.timeout_s)
            return None
        if done.returncode != 0:
            detail = done.stderr.decode("utf-8", errors="replace").strip() or "no message"
            raise TelemetryUnavailable(
                f"{' '.join(self.command)} exited with {done.returncode}: {detail} "
                "(reading the kernel log needs root or CAP_SYSLOG where kernel.dmesg_restrict=1)"
            )
        return done.stdout.decode("utf-8", errors="replace").splitlines()
