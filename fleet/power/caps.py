"""The cap valve's rule: pure arithmetic on a rack's drawn power (docs/power.md).

Averages do not trip breakers; peaks do. Measured mode commits servers at their measured p99,
so a rack can, on a bad minute, draw more than that. The valve is what keeps it inside: when a
rack's drawn power crosses `high_pct` of its budget, the GPU power limit of its serving servers
steps down by `step_pct` of TDP per decision, never below `floor_pct`; once the draw falls under
`low_pct` it steps back up, and at 100 % the cap is lifted. Between the two marks nothing moves
(hysteresis: a rack hovering at one mark does not flap). Capping slows compute-bound prefill and
barely touches memory-bound decode (fleet_core/power_model.py).
"""

from __future__ import annotations

__all__ = ["admits_boot", "next_cap_pct"]


def next_cap_pct(
    drawn_w: float | None,
    budget_w: float,
    cap_pct: float | None,
    *,
    high_pct: float,
    low_pct: float,
    floor_pct: float,
    step_pct: float,
) -> float | None:
    """The rack's next GPU cap in percent of TDP (None: uncapped), from its drawn power now.

    No reading (None) or no budget: the cap stays as it is; the valve never acts on nothing.
    """
    if not 0 < low_pct < high_pct <= 100:
        raise ValueError(f"need 0 < low_pct < high_pct <= 100, not {low_pct} and {high_pct}")
    if not 0 < floor_pct <= 100 or step_pct <= 0:
        raise ValueError(f"need 0 < floor_pct <= 100 and step_pct > 0, not {floor_pct}, {step_pct}")
    if drawn_w is None or budget_w <= 0:
        return cap_pct
    share = 100.0 * drawn_w / budget_w
    if share >= high_pct:
        return max(floor_pct, (100.0 if cap_pct is None else cap_pct) - step_pct)
    if share < low_pct and cap_pct is not None:
        raised = cap_pct + step_pct
        return None if raised >= 100.0 else raised
    return cap_pct


def admits_boot(drawn_w: float | None, budget_w: float) -> bool:
    """Whether a new boot may enter the rack: not while it draws its whole budget or more."""
    return drawn_w is None or drawn_w < budget_w
