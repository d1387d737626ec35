"""The demo's ending: a summary of what happened, from the clients' results, the samples and the
fleet's own event log, and a PNG chart (demand vs serving capacity, p95 vs SLA)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.demo.load import Result
from fleet.demo.plan import Timeline
from fleet.demo.view import Sample, p95
from fleet_core.stats import quantile


@dataclass(frozen=True)
class Summary:
    sent: int
    answered: int
    refused: dict[str, int]
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    ttft_p95_s: float | None
    sla_s: float
    sla_attainment: float  # share of requests sent answered within the SLA
    booted: int
    returned: int
    drained_for_faults: int
    power_cycled: int
    quarantined: int
    decisions: dict[str, int]
    calendar_firings: int
    gpu_hours: float
    kwh: float
    # The racks' drawn power as the fleet measured it (BMC readings, agent estimates), summed
    # over racks: lowest and highest seen by the samples (None: no reading yet).
    drawn_low_w: float | None = None
    drawn_high_w: float | None = None

    def lines(self) -> list[str]:
        def s(value: float | None) -> str:
            return "–" if value is None else f"{value:.2f} s"

        refused = ", ".join(f"{n} × {k}" for k, n in sorted(self.refused.items())) or "none"
        rules = ", ".join(f"{n} {k}" for k, n in sorted(self.decisions.items())) or "none"
        return [
            f"requests     {self.sent} sent, {self.answered} answered; not answered: {refused}",
            f"latency      p50 {s(self.p50_s)}, p95 {s(self.p95_s)}, p99 {s(self.p99_s)}; "
            f"TTFT p95 {s(self.ttft_p95_s)}",
            f"SLA          p95 ≤ {self.sla_s:.0f} s: {self.sla_attainment:.1%} of requests "
            "answered within it",
            f"spares       {self.booted} boots, {self.returned} returned to the warm pool",
            f"faults       {self.drained_for_faults} drained for a fault, {self.power_cycled} "
            f"power cycled, {self.quarantined} quarantined",
            f"autoscaler   {rules}; calendar firings: {self.calendar_firings}",
            f"energy       {self.gpu_hours:.3f} GPU-hours powered, {self.kwh:.3f} kWh "
            "(demo time, the lab's power model)",
            f"rack draw    measured by the fleet from {kw(self.drawn_low_w)} to "
            f"{kw(self.drawn_high_w)} (`fleetctl racks`; docs/power.md)",
        ]


def kw(watts: float | None) -> str:
    return "–" if watts is None else f"{watts / 1000:.2f} kW"


def summarize(
    results: Sequence[Result],
    samples: Sequence[Sample],
    events: Sequence[dict[str, Any]],
    decisions: Sequence[dict[str, Any]],
    sla_s: float,
) -> Summary:
    answered = [r for r in results if r.ok]
    latencies = sorted(r.latency_s for r in answered if r.latency_s is not None)

    def pct(q: float) -> float | None:
        return quantile(latencies, q)

    transitions = [e for e in events if e.get("kind") == "server.transition"]
    to = Counter(e.get("to_state") for e in transitions)
    # A fault's drain is the provisioner's remediation ("remediation: agent asks for reboot").
    faults = [
        e
        for e in transitions
        if e.get("to_state") == "draining" and "remediation" in str(e.get("message", ""))
    ]
    cycled = sum(
        1
        for e in transitions
        if e.get("from_state") == "drained" and e.get("to_state") == "booting"
    )
    gpu_s = kwh_s = 0.0
    for before, after in itertools.pairwise(samples):
        span = max(0.0, after.t - before.t)
        gpu_s += before.gpus_on * span
        kwh_s += before.power_w * span
    within = sum(1 for r in answered if r.latency_s is not None and r.latency_s <= sla_s)
    drawn = [
        sum(float(r["drawn_w"]) for r in sample.racks if r.get("drawn_w") is not None)
        for sample in samples
        if any(r.get("drawn_w") is not None for r in sample.racks)
    ]
    return Summary(
        sent=len(results),
        answered=len(answered),
        refused=dict(Counter(str(r.status or "no answer") for r in results if not r.ok)),
        p50_s=pct(0.50),
        p95_s=pct(0.95),
        p99_s=pct(0.99),
        ttft_p95_s=p95([r.ttft_s for r in answered if r.ttft_s is not None]),
        sla_s=sla_s,
        sla_attainment=within / len(results) if results else 0.0,
        booted=to["booting"],
        returned=sum(
            1
            for e in transitions
            if (e.get("from_state"), e.get("to_state")) == ("powering_off", "warm")
        ),
        drained_for_faults=len(faults),
        power_cycled=cycled,
        quarantined=to["quarantined"],
        decisions=dict(Counter(d["rule"] for d in decisions)),
        calendar_firings=sum(1 for e in events if e.get("kind") == "schedule.fired"),
        gpu_hours=gpu_s / 3600,
        kwh=kwh_s / 3600 / 1000,
        drawn_low_w=min(drawn) if drawn else None,
        drawn_high_w=max(drawn) if drawn else None,
    )


def chart(
    path: Path,
    samples: Sequence[Sample],
    results: Sequence[Result],
    timeline: Timeline,
    sla_s: float,
    capacity_rps_per_server: float,
) -> Path:
    """Demand vs serving capacity (top), the clients' p95 vs the SLA (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    top.plot(t, [s.offered_rps for s in samples], label="demand (requests/s offered)", color="C0")
    top.step(
        t,
        [s.serving * capacity_rps_per_server for s in samples],
        where="post",
        label="serving capacity (requests/s at the SLA)",
        color="C2",
    )
    top.step(
        t,
        [s.target * capacity_rps_per_server for s in samples],
        where="post",
        label="target capacity",
        color="C2",
        linestyle=":",
    )
    for start, end, label, color in (
        (timeline.launch_at, timeline.launch_until, "calendar window", "C4"),
        (timeline.spike_at, timeline.spike_until, "spike", "C3"),
    ):
        top.axvspan(timeline.at(start), timeline.at(end), alpha=0.08, color=color, label=label)
    top.axvline(timeline.at(timeline.fault_at), color="C3", linestyle="--", label="fatal Xid")
    top.set_ylabel("requests/s")
    top.legend(loc="upper left", fontsize=8)
    top.set_title("Fleet demo: demand vs serving capacity")

    window = 15.0
    p95_t: list[float] = []
    p95_v: list[float] = []
    done = sorted((r.sent_at + (r.latency_s or 0.0), r.latency_s) for r in results if r.ok)
    for s in samples:
        recent = [lat for end, lat in done if s.t - window <= end <= s.t and lat is not None]
        value = p95(recent)
        if value is not None:
            p95_t.append(s.t)
            p95_v.append(value)
    bottom.plot(p95_t, p95_v, label=f"p95 latency (last {window:.0f} s, clients)", color="C1")
    bottom.axhline(sla_s, color="C3", linestyle="--", label="SLA p95")
    bottom.set_xlabel("seconds of traffic")
    bottom.set_ylabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
