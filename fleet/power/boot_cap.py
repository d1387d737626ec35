"""A spare that fits a rack only under a GPU cap may boot capped: pure arithmetic (docs/power.md,
"The cap valve").

A GPU server's maximum draw is its GPUs at TDP plus the rest (CPUs, memory, fans, NICs). A
power limit of c % of TDP takes `gpu_count × tdp × (1 − c/100)` off that maximum and nothing off
the rest, so a spare that does not fit a rack's headroom at its full commitment may fit with
its GPUs capped. `boot_fit` finds the highest cap, in the valve's steps from 100 % down to its
floor, under which it fits.

What the caller must keep (not done here): the boot's cap is the server's own, not the rack's.
Its commitment stays at the capped figure only while its limit holds, so the valve must not
lift a boot cap with the rack's (the server's limit is the lower of the two), and the rack's
committed draw must count the server at its capped maximum until the boot cap is released
(when the rack has room for its full commitment).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BootFit", "boot_fit", "capped_max_w"]


@dataclass(frozen=True, slots=True)
class BootFit:
    cap_pct: float | None  # the GPU cap it boots under, in % of TDP; None: uncapped
    commit_w: float  # what it commits under that cap


def capped_max_w(max_w: float, gpu_count: int, tdp_w: float, cap_pct: float | None) -> float:
    """A server's maximum draw with its GPUs limited to `cap_pct` of TDP (None: its maximum)."""
    if cap_pct is None:
        return max_w
    if not 0 < cap_pct <= 100:
        raise ValueError(f"need 0 < cap_pct <= 100, not {cap_pct}")
    return max(0.0, max_w - gpu_count * tdp_w * (1.0 - cap_pct / 100.0))


def boot_fit(
    commit_w: float,
    headroom_w: float,
    *,
    max_w: float,
    gpu_count: int,
    tdp_w: float,
    floor_pct: float,
    step_pct: float,
) -> BootFit | None:
    """The highest cap under which a spare fits `headroom_w`, or None when it does not fit even
    at the floor. `commit_w` is what it commits uncapped (its maximum in a `nameplate` rack, its
    measured p99 × margin in a `measured` one); a cap bounds that by its capped maximum."""
    if not 0 < floor_pct <= 100 or step_pct <= 0:
        raise ValueError(f"need 0 < floor_pct <= 100 and step_pct > 0, not {floor_pct}, {step_pct}")
    if commit_w <= headroom_w:
        return BootFit(None, commit_w)
    if gpu_count <= 0:
        return None  # nothing to cap
    cap = 100.0
    while cap > floor_pct:
        cap = max(floor_pct, cap - step_pct)
        capped = min(commit_w, capped_max_w(max_w, gpu_count, tdp_w, cap))
        if capped <= headroom_w:
            return BootFit(cap, capped)
    return None
