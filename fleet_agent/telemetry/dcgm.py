"""DCGM telemetry: scrape the local dcgm-exporter (Prometheus text format).

For servers where DCGM already owns the GPUs (its host engine and dcgm-exporter run anyway).
`parse_dcgm` is the pure part: exporter text in, one `GpuSample` per GPU plus the last Xid each
GPU reported. `DcgmTelemetry` adds HTTP and turns a change of DCGM_FI_DEV_XID_ERRORS (which
holds the *last* Xid number, not a count) into one `XidEvent`.

What dcgm-exporter exports is its counters CSV's choice: several fields the fault policy reads
are off in the shipped CSVs (ECC volatile totals, clock-event reasons, temperature thresholds).
They are None here and named in every snapshot's notes; docs/telemetry.md lists the CSV lines
to add.

Errors: an exporter that does not answer at start is `TelemetryUnavailable` (naming the URL);
at run time a failed scrape raises `DcgmScrapeError`, which the daemon counts as a telemetry
error before trying again on the next tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet_agent.telemetry import PowerLimitUnsupported
from fleet_core.telemetry import GpuSample, Snapshot, TelemetryUnavailable, XidEvent

DEFAULT_URL = "http://127.0.0.1:9400/metrics"

TEMP = "DCGM_FI_DEV_GPU_TEMP"
SLOWDOWN_TEMP = "DCGM_FI_DEV_SLOWDOWN_TEMP"
SHUTDOWN_TEMP = "DCGM_FI_DEV_SHUTDOWN_TEMP"
MAX_OP_TEMP = "DCGM_FI_DEV_GPU_MAX_OP_TEMP"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
POWER = "DCGM_FI_DEV_POWER_USAGE"
ENFORCED_POWER_LIMIT = "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"
POWER_MGMT_LIMIT = "DCGM_FI_DEV_POWER_MGMT_LIMIT"
XID = "DCGM_FI_DEV_XID_ERRORS"
ECC_DBE_VOLATILE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
REMAP_CORRECTABLE = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
REMAP_UNCORRECTABLE = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
REMAP_PENDING = "DCGM_FI_DEV_ROW_REMAP_PENDING"
REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
# DCGM 3.3 renamed the field (same id, 112); exporters built on either name exist.
CLOCK_REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")

# Fields the fault policy needs: when an exporter exports none of a group, a note says so.
WANTED: tuple[tuple[str, ...], ...] = (
    (TEMP,),
    (FB_USED,),
    (FB_FREE,),
    (GPU_UTIL,),
    (POWER,),
    (XID,),
    (ECC_DBE_VOLATILE,),
    (REMAP_CORRECTABLE,),
    (REMAP_UNCORRECTABLE,),
    (REMAP_PENDING,),
    (REMAP_FAILURE,),
    CLOCK_REASONS,
    (SLOWDOWN_TEMP,),
    (SHUTDOWN_TEMP,),
)


class DcgmScrapeError(RuntimeError):
    """A scrape failed at run time (exporter restarting, timing out, or answering something
    that is not Prometheus text). Transient: the daemon logs it, counts a telemetry error and
    scrapes again on the next tick."""


@dataclass(frozen=True, slots=True)
class DcgmScrape:
    """One dcgm-exporter page, parsed."""

    gpus: tuple[GpuSample, ...]
    # GPU index -> DCGM_FI_DEV_XID_ERRORS as exported: the last Xid seen, 0 for none yet.
    last_xid: Mapping[int, int] = field(default_factory=dict)
    driver_version: str | None = None
    # Wanted fields (WANTED) this exporter does not export, e.g. off in its counters CSV.
    missing: tuple[str, ...] = ()


@dataclass
class _Gpu:
    index: int
    labels: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)
    from_mig: set[str] = field(default_factory=set)  # fields taken from a MIG instance series

    def add(self, metric: str, labels: dict[str, str], value: float) -> None:
        """One value per field. MIG instance series (label GPU_I_ID) repeat device fields per
        instance: a whole-GPU series wins over them, else the first one is kept."""
        mig = bool(labels.get("GPU_I_ID"))
        if metric in self.values and (mig or metric not in self.from_mig):
            return
        self.values[metric] = value
        if mig:
            self.from_mig.add(metric)
        else:
            self.from_mig.discard(metric)
            self.labels = labels


def parse_dcgm(text: str) -> DcgmScrape:
    """Parse dcgm-exporter's /metrics text. Raises ValueError for text that is not Prometheus
    exposition format."""
    gpus: dict[int, _Gpu] = {}
    for metric, labels, value in _dcgm_samples(text):
        index = _gpu_index(labels)
        if index is not None:
            gpus.setdefault(index, _Gpu(index, labels)).add(metric, labels, value)
    ordered = [gpus[i] for i in sorted(gpus)]
    exported = {metric for gpu in ordered for metric in gpu.values}
    return DcgmScrape(
        gpus=tuple(_sample(gpu) for gpu in ordered),
        last_xid={gpu.index: int(gpu.values[XID]) for gpu in ordered if XID in gpu.values},
        driver_version=_driver_version(ordered),
        missing=tuple(group[0] for group in WANTED if not exported.intersection(group)),
    )


def _dcgm_samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("DCGM_FI_"):
            continue
        # The parser may add "_total" to counter sample names; the family keeps the field name.
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                yield family.name, dict(sample.labels), float(sample.value)


def _gpu_index(labels: Mapping[str, str]) -> int | None:
    try:
        return int(labels["gpu"])
    except (KeyError, ValueError):
        return None  # not a per-GPU series (e.g. NVSwitch or CPU entities)


def _driver_version(gpus: list[_Gpu]) -> str | None:
    for gpu in gpus:
        version = gpu.labels.get("DCGM_FI_DRIVER_VERSION")
        if version:
            return version
    return None


def _sample(gpu: _Gpu) -> GpuSample:
    v = gpu.values

    def number(*names: str) -> float | None:
        for name in names:
            if name in v:
                return v[name]
        return None

    def integer(*names: str) -> int | None:
        value = number(*names)
        return None if value is None else int(value)

    def flag(name: str) -> bool | None:
        value = number(name)
        return None if value is None else value != 0

    return GpuSample(
        index=gpu.index,
        uuid=gpu.labels.get("UUID") or None,
        name=gpu.labels.get("modelName") or None,
        pci_bus_id=gpu.labels.get("pci_bus_id") or None,
        temperature_c=number(TEMP),
        slowdown_temp_c=number(SLOWDOWN_TEMP),
        shutdown_temp_c=number(SHUTDOWN_TEMP),
        max_operating_temp_c=number(MAX_OP_TEMP),
        memory_used_mib=integer(FB_USED),
        memory_total_mib=_memory_total(v),
        utilization_pct=number(GPU_UTIL),
        power_w=number(POWER),
        power_limit_w=number(ENFORCED_POWER_LIMIT, POWER_MGMT_LIMIT),
        ecc_uncorrected_volatile=integer(ECC_DBE_VOLATILE),
        remapped_rows_correctable=integer(REMAP_CORRECTABLE),
        remapped_rows_uncorrectable=integer(REMAP_UNCORRECTABLE),
        remap_pending=flag(REMAP_PENDING),
        remap_failed=flag(REMAP_FAILURE),
        clock_events=integer(*CLOCK_REASONS),
    )


def _memory_total(values: Mapping[str, float]) -> int | None:
    """FB_TOTAL when exported, else used + free (+ reserved: newer DCGM keeps the driver's
    reservation out of "used", so without FB_RESERVED the total is ~0.5 GiB short)."""
    if FB_TOTAL in values:
        return int(values[FB_TOTAL])
    if FB_USED not in values or FB_FREE not in values:
        return None
    return int(values[FB_USED] + values[FB_FREE] + values.get(FB_RESERVED, 0))


class DcgmTelemetry:
    name = "dcgm"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        timeout: float = 2.0,
        http: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self._timeout = timeout
        self._clock = clock
        # The exporter is local: no proxy from the environment may stand in between.
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client(timeout=timeout, trust_env=False)
        self._last_xid: dict[int, int] = {}
        self._seen: dict[int, GpuSample] = {}  # GPUs seen so far, for "missing" notes
        self._start_notes: list[str] = []
        try:
            first = self._scrape()
        except DcgmScrapeError as exc:
            self.close()
            raise TelemetryUnavailable(
                f"dcgm-exporter does not answer at {url} ({exc}): start it "
                "(port 9400 by default) or use --telemetry nvml or simulated"
            ) from exc
        if not first.gpus:
            self.close()
            raise TelemetryUnavailable(
                f"dcgm-exporter at {url} lists no GPUs: check that DCGM sees them, "
                "or use --telemetry nvml or simulated"
            )
        self._baseline(first)

    def set_power_limit(self, watts: float | None) -> dict[int, float]:
        """dcgm-exporter only exports: this backend has no way to set a limit."""
        raise PowerLimitUnsupported(
            "dcgm-exporter is read-only, so the dcgm backend cannot set GPU power limits "
            "(DCGM's host engine can: dcgmi config --set -P; or run the agent with "
            "--telemetry nvml)"
        )

    def _baseline(self, scrape: DcgmScrape) -> None:
        """The Xid values already there at start happened before us: noted once, not events
        (an agent restart must not replay an old Xid 79). The kernel log reader covers them."""
        self._last_xid = dict(scrape.last_xid)
        self._seen = {gpu.index: gpu for gpu in scrape.gpus}
        for index, xid in sorted(scrape.last_xid.items()):
            if xid:
                self._start_notes.append(f"GPU {index}: last Xid before the agent started: {xid}")

    def _scrape(self) -> DcgmScrape:
        try:
            response = self._http.get(self.url, timeout=self._timeout)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise DcgmScrapeError(f"GET {self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            return parse_dcgm(response.text)
        except (ValueError, IndexError, KeyError) as exc:  # the parser's ways of refusing
            raise DcgmScrapeError(f"{self.url} answered no Prometheus text: {exc}") from exc

    def snapshot(self) -> Snapshot:
        at = self._clock()
        scrape = self._scrape()
        notes = [*self._start_notes]
        self._start_notes.clear()
        if scrape.missing:
            fields = ", ".join(scrape.missing)
            notes.append(
                f"dcgm-exporter does not export {fields}: add them to its counters CSV "
                "(docs/telemetry.md)"
            )
        notes += self._missing_gpus(scrape)
        return Snapshot(
            at=at,
            backend=self.name,
            gpus=scrape.gpus,
            xids=self._new_xids(scrape, at),
            driver_version=scrape.driver_version,
            notes=tuple(notes),
        )

    def _missing_gpus(self, scrape: DcgmScrape) -> list[str]:
        present = {gpu.index for gpu in scrape.gpus}
        self._seen.update((gpu.index, gpu) for gpu in scrape.gpus)
        return [
            f"GPU {index} ({self._seen[index].pci_bus_id}) is missing from dcgm-exporter's output"
            for index in sorted(self._seen.keys() - present)
        ]

    def _new_xids(self, scrape: DcgmScrape, at: float) -> tuple[XidEvent, ...]:
        """A changed, non-zero last-Xid value is one new event. The same Xid twice in a row does
        not change the value: the kernel log reader (kmsg) catches those."""
        by_index = {gpu.index: gpu for gpu in scrape.gpus}
        events = []
        for index, xid in sorted(scrape.last_xid.items()):
            previous = self._last_xid.get(index, 0)
            self._last_xid[index] = xid
            if xid and xid != previous:
                events.append(
                    XidEvent(
                        xid=xid,
                        at=at,
                        gpu_index=index,
                        pci_bus_id=by_index[index].pci_bus_id,
                        message=f"{XID} changed from {previous} to {xid}",
                        source=self.name,
                    )
                )
        return tuple(events)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()
