"""Rack power budgets: pure arithmetic on plain data (docs/design.md, "power feed").

usable watts of a feed = V × A × (√3 for three-phase, V line-to-line) × max utilisation.
A rack fed from both sides is budgeted at what its smaller side can carry, so losing a whole
side (a PDU, a UPS, a utility feed) drops nothing. Committed draw counts a server at what it
commits while it is on or on its way up — its maximum in `nameplate` mode, its measured p99 × the
rack's margin in `measured` mode (`measured_commit_w`) — and at its standby (BMC-only) draw
otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Plain strings ("A"/"B", "single"/"three"): the models' StrEnums pass as they are.
Side = str
PhaseKind = str


@dataclass(frozen=True, slots=True)
class Feed:
    side: Side
    volts: float
    amps: float
    phase: PhaseKind = "single"
    max_utilisation_pct: float = 80.0


@dataclass(frozen=True, slots=True)
class ServerDraw:
    max_w: float
    standby_w: float
    on: bool
    commit_w: float | None = None  # what it commits while on; None: max_w (nameplate)

    @property
    def on_w(self) -> float:
        return self.max_w if self.commit_w is None else self.commit_w


@dataclass(frozen=True, slots=True)
class RackPower:
    budget_w: float
    committed_w: float
    all_on_w: float
    # What the rack's servers draw now, as measured (None: no reading). A commitment is a
    # forecast; a reading above it is a fact, so headroom counts whichever is larger.
    drawn_w: float | None = None

    @property
    def load_w(self) -> float:
        """What headroom is counted from: the committed draw, or the drawn one when larger."""
        if self.drawn_w is None:
            return self.committed_w
        return max(self.committed_w, self.drawn_w)

    @property
    def headroom_w(self) -> float:
        """Budget minus load: at 100 % drawn or more, none (no boot fits: caps.admits_boot)."""
        return self.budget_w - self.load_w

    @property
    def oversubscribed_w(self) -> float:
        """How far the rack would exceed its budget with every server at max draw (0 if not)."""
        return max(0.0, self.all_on_w - self.budget_w)


def feed_watts(feed: Feed) -> float:
    phase_factor = math.sqrt(3) if feed.phase == "three" else 1.0
    return feed.volts * feed.amps * phase_factor * feed.max_utilisation_pct / 100.0


def side_watts(feeds: Iterable[Feed]) -> dict[Side, float]:
    totals: dict[Side, float] = {}
    for feed in feeds:
        totals[feed.side] = totals.get(feed.side, 0.0) + feed_watts(feed)
    return totals


def rack_budget(feeds: Iterable[Feed]) -> float:
    """Usable watts: the smaller side when both sides exist, else the one side present."""
    sides = side_watts(feeds)
    return min(sides.values()) if sides else 0.0


def committed_watts(servers: Iterable[ServerDraw]) -> float:
    return sum(s.on_w if s.on else s.standby_w for s in servers)


def measured_commit_w(
    p99_w: float | None,
    history_s: float,
    *,
    margin: float,
    idle_w: float,
    max_w: float,
    min_history_s: float,
) -> float:
    """What a powered server commits in `measured` mode: its measured p99 draw × `margin`,
    never below its idle draw nor above its maximum; its maximum (nameplate) until
    `min_history_s` of history exists, since a server never seen under load is an unknown."""
    if margin < 1.0:
        raise ValueError(f"margin must be 1.0 or more, not {margin}")
    if p99_w is None or history_s < min_history_s:
        return max_w
    return min(max_w, max(idle_w, p99_w * margin))


def rack_power(
    feeds: Iterable[Feed], servers: Iterable[ServerDraw], drawn_w: float | None = None
) -> RackPower:
    servers = list(servers)
    return RackPower(
        budget_w=rack_budget(feeds),
        committed_w=committed_watts(servers),
        all_on_w=sum(s.max_w for s in servers),
        drawn_w=drawn_w,
    )
