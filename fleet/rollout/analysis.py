"""A rollout step's verdict (pure): the canary against the stable version over the same window.

Inputs are what the routers measured for each version since the step's window opened
(requests answered by a replica of that version and how many of them failed; the request
duration p95 and TTFT p95 of the last minute) plus the quality probe's mismatches on canary
servers. The canary fails as soon as it has `min_requests` and its error rate exceeds the
stable version's by more than `max_error_increase` (absolute), or its p95 or TTFT p95 exceeds
the stable one's × `max_latency_ratio` (plus LATENCY_FLOOR_S: a few milliseconds either way on
a fast model is noise, not a regression), or at once when a probe of it mismatched. It passes
when the window has lasted `step_s` with `min_requests` canary requests and nothing failed;
otherwise it waits. Failing early is the point: the sooner a bad version is caught, the fewer
requests it fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LATENCY_FLOOR_S = 0.05

Outcome = Literal["pass", "fail", "wait"]


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """One version's figures over the window (summed over the routers; p95s their worst)."""

    requests: int = 0
    errors: int = 0
    p95_s: float | None = None
    ttft_p95_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["error_rate"] = round(self.error_rate, 4)
        return out


@dataclass(frozen=True, slots=True)
class Thresholds:
    step_s: float
    min_requests: int
    max_error_increase: float
    max_latency_ratio: float


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)


def judge(
    stable: VersionFigures,
    canary: VersionFigures,
    *,
    elapsed_s: float,
    thresholds: Thresholds,
    probe_mismatches: list[str] | None = None,
) -> Verdict:
    """pass | fail | wait, with the reason (one line) and the figures it was decided on."""
    t = thresholds
    figures: dict[str, Any] = {
        "window_s": round(elapsed_s, 1),
        "stable": stable.as_dict(),
        "canary": canary.as_dict(),
        "probe_mismatches": list(probe_mismatches or []),
        "thresholds": asdict(t),
    }
    if probe_mismatches:
        return Verdict(
            "fail",
            "quality probe: the canary answered differently from its reference on "
            + ", ".join(probe_mismatches),
            figures,
        )
    if canary.requests < t.min_requests:
        return Verdict(
            "wait",
            f"canary has {canary.requests} of the {t.min_requests} requests a verdict needs",
            figures,
        )
    # The stable version's rate only counts once it has as many requests as the canary needs:
    # a handful of stable requests say nothing (then the canary is held to no errors beyond
    # the allowed increase).
    stable_rate = stable.error_rate if stable.requests >= t.min_requests else 0.0
    increase = canary.error_rate - stable_rate
    if increase > t.max_error_increase:
        return Verdict(
            "fail",
            f"error rate {canary.error_rate:.1%} ({canary.errors}/{canary.requests}) against the "
            f"stable version's {stable_rate:.1%}: +{increase:.1%} exceeds "
            f"+{t.max_error_increase:.1%}",
            figures,
        )
    for what, c, s in (
        ("latency p95", canary.p95_s, stable.p95_s),
        ("TTFT p95", canary.ttft_p95_s, stable.ttft_p95_s),
    ):
        if c is None or s is None:
            continue
        limit = s * t.max_latency_ratio + LATENCY_FLOOR_S
        if c > limit:
            return Verdict(
                "fail",
                f"{what} {c * 1000:.0f} ms against the stable version's {s * 1000:.0f} ms "
                f"(limit {limit * 1000:.0f} ms: × {t.max_latency_ratio:g} + "
                f"{LATENCY_FLOOR_S * 1000:.0f} ms)",
                figures,
            )
    if elapsed_s < t.step_s:
        return Verdict(
            "wait", f"window {elapsed_s:.0f} s of {t.step_s:.0f} s, no regression so far", figures
        )
    return Verdict(
        "pass",
        f"{canary.requests} canary requests over {elapsed_s:.0f} s: error rate "
        f"{canary.error_rate:.1%} (stable {stable_rate:.1%}), latency within "
        f"× {t.max_latency_ratio:g} of the stable version's",
        figures,
    )
