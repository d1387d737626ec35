"""A rollout's plan (pure): the canary share and the steps after it, as router weights.

`fleetctl deployments rollout D --version V --canary 5% --step 25% --step 50%` is the plan
[0.05, 0.25, 0.5]: the new version first takes 5 % of the deployment's requests on
ceil(5 % × servers) servers, then 25 %, then 50 %, each step judged against the stable version
over the same window (fleet/rollout/analysis.py). After the last step passes the rollout
promotes: the remaining servers move within the disruption budget and the new version becomes
the deployment's. A share is written "5%", "5" (percent) or "0.05" (a fraction below 1).
"""

from __future__ import annotations

import itertools
import math

DEFAULT_CANARY = 0.05
DEFAULT_STEPS = (0.25, 0.5)
MAX_STEPS = 20


class PlanError(ValueError):
    """A plan that cannot run: the message says which share and why."""


def parse_share(text: str | float) -> float:
    """'5%' / '5' / '0.05' / 0.05 → 0.05. A bare number of 1 or more is a percentage, below 1 a
    fraction (so '1' is 1 %, and 100 % is written '100%' or '100')."""
    if isinstance(text, bool):
        raise PlanError("a share is a percentage such as 5% or a fraction such as 0.05")
    if isinstance(text, int | float):
        value = float(text)
        percent = value >= 1
    else:
        raw = text.strip()
        percent = raw.endswith("%")
        try:
            value = float(raw.rstrip("%").strip())
        except ValueError:
            raise PlanError(
                f"share {raw[:20]!r}: a percentage such as 5% or a fraction such as 0.05"
            ) from None
        percent = percent or value >= 1
    if not math.isfinite(value):
        raise PlanError("a share must be a finite number")
    share = value / 100 if percent else value
    if not 0 < share <= 1:
        raise PlanError(f"share {text!s:.20}: must be above 0 % and at most 100 %")
    return round(share, 6)


def build_plan(canary: str | float | None, steps: list[str] | list[float] | None) -> list[float]:
    """The step weights, strictly increasing, each in (0, 1). Without any step given, the
    default 5 % canary then 25 % and 50 %; a canary alone is followed by no further step; a
    last step of 100 % is the promotion (which follows the last step anyway)."""
    if canary is None and not steps:
        return [DEFAULT_CANARY, *DEFAULT_STEPS]
    weights = [parse_share(canary if canary is not None else DEFAULT_CANARY)]
    weights += [parse_share(s) for s in steps or []]
    if len(weights) > MAX_STEPS:
        raise PlanError(f"at most {MAX_STEPS} steps (got {len(weights)})")
    if weights[0] >= 1:
        raise PlanError("the canary must take less than 100 % (it is judged against the rest)")
    if weights[-1] >= 1:  # 100 % is the promotion, which follows the last step anyway
        weights.pop()
    for before, after in itertools.pairwise(weights):
        if after <= before:
            raise PlanError(
                f"steps must increase: {after:.2%} follows {before:.2%} "
                f"(plan {', '.join(f'{w:.2%}' for w in weights)})"
            )
    return weights


def canary_servers(weight: float, servers: int) -> int:
    """Servers the canary runs on at `weight`: ceil(weight × servers), at least 1. Before the
    promotion it leaves at least one server on the stable version (a canary needs a stable
    version to be judged against): min(…, servers − 1), and 0 when there is only one."""
    if servers <= 0:
        return 0
    wanted = max(1, math.ceil(round(weight * servers, 9)))
    if weight >= 1:
        return servers
    return min(wanted, servers - 1)
