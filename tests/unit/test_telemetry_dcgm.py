"""DcgmTelemetry: parsing dcgm-exporter text, Xid changes, and scraping over 127.0.0.1.

The fixture is dcgm-exporter output for two H100s with dcp-metrics-included.csv's counters;
the "ECC enabled" sample appends the families an operator adds (docs/telemetry.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from repo_paths import FIXTURES

from fleet.lab.harness import free_port
from fleet_agent.telemetry import PowerLimitControl, PowerLimitUnsupported
from fleet_agent.telemetry.dcgm import (
    DcgmScrapeError,
    DcgmTelemetry,
    parse_dcgm,
)
from fleet_core.telemetry import ClockEvent, GpuSample, TelemetryUnavailable, XidEvent

FIXTURE = (FIXTURES / "dcgm_exporter_metrics.txt").read_text()
NOW = 1_750_000_000.0

LABELS = (
    'gpu="0",UUID="GPU-3f9d2c71-5b0e-4a8e-9c1d-7e2a6b4f0c18",pci_bus_id="00000000:18:00.0",'
    'device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-01",'
    'DCGM_FI_DRIVER_VERSION="550.54.15"',
    'gpu="1",UUID="GPU-a81e44d2-0c6b-4f3a-b2d7-19c5e8f6a302",pci_bus_id="00000000:2A:00.0",'
    'device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-01",'
    'DCGM_FI_DRIVER_VERSION="550.54.15"',
)


def family(name: str, kind: str, help_text: str, gpu0: str, gpu1: str) -> str:
    """One field as dcgm-exporter writes it: HELP, TYPE, then one line per GPU."""
    return (
        f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"
        f"{name}{{{LABELS[0]}}} {gpu0}\n{name}{{{LABELS[1]}}} {gpu1}\n"
    )


# What the counters CSV lines in docs/telemetry.md add to the default output.
ECC_ENABLED = FIXTURE + "".join(
    [
        family(
            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
            "counter",
            "Total number of single-bit volatile ECC errors.",
            "0",
            "17",
        ),
        family(
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            "counter",
            "Total number of double-bit volatile ECC errors.",
            "0",
            "2",
        ),
        family(
            "DCGM_FI_DEV_FB_RESERVED",
            "gauge",
            "Framebuffer memory reserved (in MiB).",
            "555",
            "555",
        ),
        family(
            "DCGM_FI_DEV_ROW_REMAP_PENDING",
            "gauge",
            "Whether remapping of rows is pending",
            "0",
            "1",
        ),
        family(
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            "gauge",
            "Current clock throttle reasons.",
            "0",
            "1",
        ),
        family("DCGM_FI_DEV_SLOWDOWN_TEMP", "gauge", "Slowdown temperature (in C).", "89", "89"),
        family("DCGM_FI_DEV_SHUTDOWN_TEMP", "gauge", "Shutdown temperature (in C).", "92", "92"),
    ]
)


def with_xid(text: str, gpu: int, xid: int) -> str:
    old = f"DCGM_FI_DEV_XID_ERRORS{{{LABELS[gpu]}}} 0\n"
    assert old in text
    return text.replace(old, f"DCGM_FI_DEV_XID_ERRORS{{{LABELS[gpu]}}} {xid}\n")


# ---- parsing --------------------------------------------------------------------------------


def test_parse_the_default_counters() -> None:
    scrape = parse_dcgm(FIXTURE)
    assert scrape.driver_version == "550.54.15"
    assert scrape.last_xid == {0: 0, 1: 0}
    assert scrape.gpus == (
        GpuSample(
            index=0,
            uuid="GPU-3f9d2c71-5b0e-4a8e-9c1d-7e2a6b4f0c18",
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id="00000000:18:00.0",
            temperature_c=58.0,
            memory_used_mib=73_660,
            memory_total_mib=81_004,  # used + free: the default CSV has no FB_RESERVED
            utilization_pct=87.0,
            power_w=512.48,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=0,
            remap_failed=False,
        ),
        GpuSample(
            index=1,
            uuid="GPU-a81e44d2-0c6b-4f3a-b2d7-19c5e8f6a302",
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id="00000000:2A:00.0",
            temperature_c=31.0,
            memory_used_mib=1,
            memory_total_mib=81_004,
            utilization_pct=0.0,
            power_w=70.315,
            remapped_rows_correctable=2,
            remapped_rows_uncorrectable=0,
            remap_failed=False,
        ),
    )
    # Off in the shipped counters CSVs: None above, and named.
    assert scrape.missing == (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "DCGM_FI_DEV_SLOWDOWN_TEMP",
        "DCGM_FI_DEV_SHUTDOWN_TEMP",
    )


def test_parse_with_ecc_and_the_other_added_counters() -> None:
    scrape = parse_dcgm(ECC_ENABLED)
    assert scrape.missing == ()
    g0, g1 = scrape.gpus
    assert (g0.ecc_uncorrected_volatile, g1.ecc_uncorrected_volatile) == (0, 2)
    assert g1.memory_total_mib == 81_559  # used + free + reserved: NVML's total
    assert (g0.remap_pending, g1.remap_pending) == (False, True)
    assert g0.clock_events == 0
    assert g1.clock_events == ClockEvent.GPU_IDLE  # the pre-3.3 field name still works
    assert (g1.slowdown_temp_c, g1.shutdown_temp_c) == (89.0, 92.0)


def test_parse_prefers_whole_gpu_series_over_mig_instances() -> None:
    mig = (
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2"} 100\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",modelName="NVIDIA H100 80GB HBM3"} 2000\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2"} 40\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="5"} 41\n'
        'DCGM_NVSWITCH_THING{nvswitch="0"} 1\n'
    )
    (gpu,) = parse_dcgm(mig).gpus
    assert gpu.memory_used_mib == 2000
    assert gpu.temperature_c == 40.0
    assert gpu.name == "NVIDIA H100 80GB HBM3"


def test_parse_refuses_what_is_not_prometheus_text() -> None:
    with pytest.raises(ValueError):
        parse_dcgm("<html><body>502 Bad Gateway</body></html>\n")


# ---- a local exporter -----------------------------------------------------------------------


class Exporter:
    """dcgm-exporter's /metrics on a free 127.0.0.1 port, serving whatever `body` holds."""

    def __init__(self, body: str) -> None:
        self.body = body
        self.requests = 0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                exporter.requests += 1
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                data = exporter.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output quiet

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    server = Exporter(FIXTURE)
    yield server
    server.stop()


@pytest.fixture
def telemetry(exporter: Exporter) -> Iterator[DcgmTelemetry]:
    backend = DcgmTelemetry(exporter.url, timeout=2.0, clock=lambda: NOW)
    yield backend
    backend.close()


def test_snapshot_from_a_local_exporter(telemetry: DcgmTelemetry) -> None:
    snap = telemetry.snapshot()
    assert snap.backend == "dcgm"
    assert snap.at == NOW
    assert snap.driver_version == "550.54.15"
    assert snap.gpus == parse_dcgm(FIXTURE).gpus
    assert snap.xids == ()
    assert snap.notes == (
        "dcgm-exporter does not export DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, "
        "DCGM_FI_DEV_ROW_REMAP_PENDING, DCGM_FI_DEV_CLOCKS_EVENT_REASONS, "
        "DCGM_FI_DEV_SLOWDOWN_TEMP, DCGM_FI_DEV_SHUTDOWN_TEMP: add them to its counters CSV "
        "(docs/telemetry.md)",
    )


def test_an_xid_change_is_exactly_one_event(exporter: Exporter, telemetry: DcgmTelemetry) -> None:
    assert telemetry.snapshot().xids == ()
    exporter.body = with_xid(ECC_ENABLED, gpu=1, xid=79)

    snap = telemetry.snapshot()
    assert snap.xids == (
        XidEvent(
            xid=79,
            at=NOW,
            gpu_index=1,
            pci_bus_id="00000000:2A:00.0",
            message="DCGM_FI_DEV_XID_ERRORS changed from 0 to 79",
            source="dcgm",
        ),
    )
    assert telemetry.snapshot().xids == ()  # same value: nothing new
    exporter.body = with_xid(ECC_ENABLED, gpu=1, xid=48)
    assert [x.xid for x in telemetry.snapshot().xids] == [48]


def test_an_xid_from_before_start_is_a_note_not_an_event() -> None:
    server = Exporter(with_xid(ECC_ENABLED, gpu=0, xid=94))
    backend = DcgmTelemetry(server.url, clock=lambda: NOW)
    try:
        first = backend.snapshot()
        assert first.xids == ()
        assert first.notes == ("GPU 0: last Xid before the agent started: 94",)
        assert backend.snapshot().notes == ()
    finally:
        backend.close()
        server.stop()


def test_a_gpu_missing_from_the_output_is_noted(
    exporter: Exporter, telemetry: DcgmTelemetry
) -> None:
    exporter.body = "".join(
        line + "\n" for line in ECC_ENABLED.splitlines() if 'gpu="1"' not in line
    )
    snap = telemetry.snapshot()
    assert [g.index for g in snap.gpus] == [0]
    assert snap.notes == ("GPU 1 (00000000:2A:00.0) is missing from dcgm-exporter's output",)


def test_exporter_down_at_start_refuses_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    with pytest.raises(TelemetryUnavailable) as refused:
        DcgmTelemetry(url, timeout=1.0)
    assert f"dcgm-exporter does not answer at {url}" in str(refused.value)
    assert "--telemetry nvml or simulated" in str(refused.value)


def test_an_exporter_without_gpus_refuses() -> None:
    server = Exporter("# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\n")
    try:
        with pytest.raises(TelemetryUnavailable, match="lists no GPUs"):
            DcgmTelemetry(server.url)
    finally:
        server.stop()


def test_failures_at_run_time_are_scrape_errors(exporter: Exporter) -> None:
    backend = DcgmTelemetry(exporter.url, timeout=1.0)
    try:
        exporter.body = "<html>502 Bad Gateway</html>\n"
        with pytest.raises(DcgmScrapeError, match="no Prometheus text"):
            backend.snapshot()
        exporter.body = FIXTURE
        assert len(backend.snapshot().gpus) == 2  # recovers on the next tick
        exporter.stop()
        with pytest.raises(DcgmScrapeError, match="ConnectError"):
            backend.snapshot()
    finally:
        backend.close()


def test_power_limits_cannot_be_set_through_the_exporter(telemetry: DcgmTelemetry) -> None:
    # dcgm-exporter only exports; the daemon logs this (once per requested limit) and goes on.
    with pytest.raises(PowerLimitUnsupported, match=r"read-only.*--telemetry nvml"):
        telemetry.set_power_limit(350)
    assert isinstance(telemetry, PowerLimitControl)
