"""Placement: which warm spares to boot for a deployment, and which servers to release.

Pure: frozen dataclasses in, plain data out; no database, no clock, no I/O (docs/design.md,
"Placement"). The provisioning workflow reads the database into these shapes, calls
`choose_spares` / `choose_release`, and then re-checks `fits` against fresh headroom and marks
the chosen servers `booting` in one transaction: what this module says is a plan, the
transaction is the commitment.

Booting spares (`choose_spares`), greedily, one spare at a time:

1. **Eligible** — the spare's GPU model is one the deployment allows (none listed: any), it has
   at least `gpus_per_replica` GPUs (a replica never spans servers yet), and it is in the asked
   site, if one is asked. Anything else cannot serve the deployment at all.
2. **Fits its rack's power** — a warm spare already draws its standby watts (the BMC is on), so
   booting it commits `max_w - standby_w` more (`extra_draw_w`). That must fit the rack's
   REMAINING headroom: the headroom the workflow measured, less what this call has already
   committed there. Committed power counts a booting server at its maximum (`fleet.lifecycle.states.
   draws_max_power`), because inrush and a model load peg it there; a rack past its budget
   trips a breaker and takes every server on it down, so no plan ever exceeds it. A spare in a
   rack with no power figures is never booted (unknown headroom is no headroom).
3. Among the spares that are eligible and fit, the first by:
   1. **version already cached** on its local NVMe (`want.model in spare.cached`: in the
      fleet, the deployment's version key "<model>@<version>" among the versions its agent
      last reported `ready`; in the simulator, its own model names): loading weights from
      local disk takes seconds, pulling hundreds of GB over the network minutes;
   2. **spread** over failure domains: the rack with the fewest of this deployment's servers
      (already running there, `Want.running_per_rack`, plus those chosen so far in this call),
      then the site with the fewest, then a rack fed from two sides (A and B) before one fed
      from one side (losing that side takes it all down). A rack or site that dies then takes
      the fewest replicas with it;
   3. **fastest measured boot** for the cache state it would boot in (`spare_boot_s`: its
      last boot-to-ready with the version cached, or without, else its last of any kind); a
      spare never measured comes after every measured one — it is an unknown, not a fast one;
   4. **most headroom left** in its rack after the boot, keeping slack where it is thin;
   5. **name**, so that the same inputs always give the same plan, whatever their order.

   After each pick the rack's remaining headroom and the spread counts are updated and the
   order is worked out again. Greedy is not a knapsack solver: a cached 15 kW spare may use
   headroom two 10 kW ones could have shared. The preference order is the contract.

`Choice.chosen` is the boot order (best first); `Choice.short` is how many of the wanted
servers could not be placed, and `Choice.reasons` says why, one line per cause, naming the
racks, the numbers and the GPU models, so that an operator (and the decision record) can act
on it. No shortfall: no reasons.

`why(spare, want)` is the line a boot's Event and the autoscaler's decision carry for a chosen
spare ("version llama@v2 cached, …"), and `expected_boot_s` the boot-to-ready the look-ahead
and the calendar's lead count on for it: the fleet's p90 for its GPU model and cache state.

Releasing servers (`choose_release`, scale-in), greedily, one server at a time: only servers
of the deployment; the rack with the least headroom first (power is the scarce resource, so
the watts freed there are worth the most; a rack with no power figures counts as having none),
then the fewest in-flight requests (the least work to drain), then name. Each release frees
`max_w - standby_w` in its rack (it returns to warm, BMC on) and the order is worked out again.
Never more than `count`, never fewer than `keep_per_rack_min` left in a rack.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BootFigures",
    "Choice",
    "RackRoom",
    "Serving",
    "Spare",
    "Want",
    "choose_release",
    "choose_spares",
    "expected_boot_s",
    "extra_draw_w",
    "fits",
    "holds",
    "spare_boot_s",
    "why",
]


@dataclass(frozen=True, slots=True)
class Spare:
    """A warm spare: off (BMC on, drawing `standby_w`), ready to boot."""

    name: str
    site: str
    rack: str
    gpu_model: str
    gpu_count: int
    standby_w: float  # drawn now (off)
    max_w: float  # committed once it boots
    cached: tuple[str, ...] = ()  # what its local cache holds ready (version keys)
    boot_to_ready_s: float | None = None  # its last boot, any cache state (None: never)
    boot_cached_s: float | None = None  # its last boot that began with the version cached
    boot_uncached_s: float | None = None  # its last boot that had to fetch first


@dataclass(frozen=True, slots=True)
class RackRoom:
    """A rack's power room now, as the workflow measured it."""

    rack: str
    site: str
    headroom_w: float  # budget - committed, now
    feed_sides: tuple[str, ...] = ("A", "B")  # sides with feeds (a failure domain)


@dataclass(frozen=True, slots=True)
class Want:
    """What a deployment asks for: `servers` more servers able to run its replicas."""

    deployment: str
    model: str  # what a spare's cache must hold to load it from disk (the version key)
    gpu_models: tuple[str, ...]  # allowed models; empty = any
    gpus_per_replica: int
    servers: int  # how many spares to boot
    running_per_rack: Mapping[str, int] = field(default_factory=dict)  # where it runs (spread)
    site: str | None = None  # restrict to a site (None: any)


@dataclass(frozen=True, slots=True)
class Choice:
    chosen: tuple[str, ...]  # spare names, in boot order
    short: int  # how many could not be placed
    reasons: tuple[str, ...]  # one line per shortfall cause (empty when short == 0)


@dataclass(frozen=True, slots=True)
class Serving:
    """A server serving a deployment, a candidate for scale-in."""

    name: str
    rack: str
    deployment: str
    in_flight: int  # queued + running requests from its last heartbeat
    max_w: float
    standby_w: float


def extra_draw_w(spare: Spare | Serving) -> float:
    """Watts a boot adds to its rack's committed power (and a release frees): max - standby.

    Never negative: a record whose standby exceeds its maximum frees nothing by booting.
    """
    return max(0.0, spare.max_w - spare.standby_w)


def fits(spare: Spare, room: RackRoom, *, already_w: float = 0.0) -> bool:
    """Whether booting `spare` keeps `room`'s rack within its budget.

    `already_w` is what other boots planned in the same rack (in the same transaction) commit
    first; the exact fit (headroom left == 0 W) fits.
    """
    if spare.rack != room.rack:
        raise ValueError(f"spare {spare.name} is in rack {spare.rack}, not {room.rack}")
    return already_w + extra_draw_w(spare) <= room.headroom_w


def choose_spares(spares: Sequence[Spare], racks: Mapping[str, RackRoom], want: Want) -> Choice:
    """The warm spares to boot for `want`, in boot order (module docstring: the rules)."""
    if want.servers < 0:
        raise ValueError(f"servers must be 0 or more, not {want.servers}")
    if want.gpus_per_replica < 1:
        raise ValueError(f"gpus_per_replica must be 1 or more, not {want.gpus_per_replica}")
    _unique([s.name for s in spares], "spare")

    in_site = [s for s in spares if want.site is None or s.site == want.site]
    model_ok = [s for s in in_site if not want.gpu_models or s.gpu_model in want.gpu_models]
    eligible = [s for s in model_ok if s.gpu_count >= want.gpus_per_replica]
    candidates = sorted((s for s in eligible if s.rack in racks), key=lambda s: s.name)

    per_rack: Counter[str] = Counter()
    per_site: Counter[str] = Counter()
    for rack, n in want.running_per_rack.items():
        per_rack[rack] += n
        if rack in racks:
            per_site[racks[rack].site] += n
    committed: dict[str, float] = {}  # extra watts planned per rack in this call
    chosen: list[Spare] = []

    def key(s: Spare) -> tuple[bool, int, int, bool, tuple[bool, float], float, str]:
        room = racks[s.rack]
        left = room.headroom_w - (committed.get(s.rack, 0.0) + extra_draw_w(s))
        boot = spare_boot_s(s, cached=holds(s, want))
        return (
            not holds(s, want),
            per_rack[s.rack],
            per_site[room.site],
            len(set(room.feed_sides)) < 2,
            (boot is None, boot or 0.0),
            -left,
            s.name,
        )

    while len(chosen) < want.servers:
        fitting = [
            s for s in candidates if fits(s, racks[s.rack], already_w=committed.get(s.rack, 0.0))
        ]
        if not fitting:
            break
        best = min(fitting, key=key)
        candidates.remove(best)
        chosen.append(best)
        committed[best.rack] = committed.get(best.rack, 0.0) + extra_draw_w(best)
        per_rack[best.rack] += 1
        per_site[racks[best.rack].site] += 1

    short = want.servers - len(chosen)
    reasons: list[str] = []
    if short:
        reasons = _shortfall(spares, in_site, model_ok, eligible, racks, want)
        reasons += _power_reasons(candidates, racks, committed, chosen)
    return Choice(tuple(s.name for s in chosen), short, tuple(reasons))


def holds(spare: Spare, want: Want) -> bool:
    """Whether the spare's cache holds what the deployment serves (it loads from local disk)."""
    return bool(want.model) and want.model in spare.cached


def spare_boot_s(spare: Spare, *, cached: bool) -> float | None:
    """The spare's own last boot-to-ready in the cache state it would boot in; its last boot
    of any kind when it never booted in that state (a figure from before the cache state was
    recorded); None when never measured."""
    own = spare.boot_cached_s if cached else spare.boot_uncached_s
    return own if own is not None else spare.boot_to_ready_s


@dataclass(frozen=True, slots=True)
class BootFigures:
    """The fleet's measured boot-to-ready p90s (fleet/provisioning/boot_times.py), each
    (p90 seconds, boots measured), per (GPU model, cache state): True, the boot began with the
    version cached; False, it had to fetch first; None, not recorded (boots measured before
    the cache state was)."""

    p90: Mapping[tuple[str, bool | None], tuple[float, int]] = field(default_factory=dict)
    label: str = "p90"  # what the figures are: "p90", "p90 + 10 %" (a reason names it)


def expected_boot_s(
    gpu_model: str, cached: bool, figures: BootFigures, default_s: float
) -> tuple[float, str]:
    """(seconds, basis): how long a boot of a `gpu_model` spare is expected to take to
    serving, with the version cached or not. The p90 of that model's boots in that cache
    state; without one, of its boots whose state was not recorded; a cached boot may also
    count on the uncached figure (slower: the safe side), an uncached one never on the cached
    figure; `default_s` for the rest. The basis names what it stood on, for a reason."""
    state = "version cached" if cached else "version not cached"
    order: tuple[bool | None, ...] = (True, None, False) if cached else (False, None)
    for key in order:
        if (gpu_model, key) in figures.p90:
            seconds, n = figures.p90[(gpu_model, key)]
            what = {True: "cached boot", False: "uncached boot", None: "boot"}[key]
            plural = "" if n == 1 else "s"
            return seconds, f"{gpu_model}, {state}: {figures.label} of {n} {what}{plural}"
    return default_s, f"{gpu_model}, {state}: never measured, default"


def why(
    spare: Spare, want: Want, *, boot: tuple[float, str] | None = None, named: bool = True
) -> str:
    """One line on a chosen spare for an Event or a decision: its cache state first (the first
    preference), its rack and GPU model, and the boot it is expected to take (`boot`:
    `expected_boot_s`'s answer). `named`: the line starts with the spare's name."""
    if holds(spare, want):
        cache = f"version {want.model} cached"
    else:
        cache = (
            f"version {want.model} not cached: fetches first"
            if want.model
            else "weights delivered outside Fleet"
        )
    line = f"{cache}; {spare.gpu_model} in rack {spare.rack}"
    if named:
        line = f"{spare.name}: {line}"
    if boot is not None:
        line += f"; boot {boot[0]:.0f} s ({boot[1]})"
    return line


def choose_release(
    serving: Sequence[Serving],
    racks: Mapping[str, RackRoom],
    deployment: str,
    count: int,
    *,
    keep_per_rack_min: int = 0,
) -> tuple[str, ...]:
    """The servers of `deployment` to release, in release order (module docstring: the rules)."""
    if count < 0:
        raise ValueError(f"count must be 0 or more, not {count}")
    if keep_per_rack_min < 0:
        raise ValueError(f"keep_per_rack_min must be 0 or more, not {keep_per_rack_min}")
    _unique([s.name for s in serving], "serving server")

    mine = sorted((s for s in serving if s.deployment == deployment), key=lambda s: s.name)
    left_in_rack = Counter(s.rack for s in mine)
    headroom = {r: racks[r].headroom_w if r in racks else -math.inf for r in left_in_rack}
    released: list[str] = []
    while len(released) < count:
        releasable = [s for s in mine if left_in_rack[s.rack] > keep_per_rack_min]
        if not releasable:
            break
        best = min(releasable, key=lambda s: (headroom[s.rack], s.in_flight, s.name))
        mine.remove(best)
        released.append(best.name)
        left_in_rack[best.rack] -= 1
        headroom[best.rack] += extra_draw_w(best)
    return tuple(released)


# --- shortfall reasons ------------------------------------------------------------------------


def _shortfall(
    spares: Sequence[Spare],
    in_site: list[Spare],
    model_ok: list[Spare],
    eligible: list[Spare],
    racks: Mapping[str, RackRoom],
    want: Want,
) -> list[str]:
    reasons: list[str] = []
    where = f" in site {want.site}" if want.site is not None else ""
    if want.site is not None and len(in_site) < len(spares):
        elsewhere = Counter(s.site for s in spares if s.site != want.site)
        sites = ", ".join(f"{site}: {n}" for site, n in sorted(elsewhere.items()))
        n_out = len(spares) - len(in_site)
        reasons.append(f"{_spares(n_out)} outside site {want.site} ({sites})")
    if not in_site:
        reasons.append(f"no warm spare{where}, {want.servers} wanted")
    elif len(in_site) < want.servers:
        reasons.append(f"only {_spares(len(in_site))}{where}, {want.servers} wanted")

    if len(model_ok) < len(in_site):
        allowed = "/".join(want.gpu_models)
        other = Counter(s.gpu_model for s in in_site if s.gpu_model not in want.gpu_models)
        models = sorted(other.items(), key=lambda kv: (-kv[1], kv[0]))
        listing = ", ".join(
            f"{_spares(n) if i == 0 else n} {'is' if n == 1 else 'are'} {model}"
            for i, (model, n) in enumerate(models)
        )
        if not model_ok:
            reasons.append(f"no warm spare{where} with GPU model {allowed} ({listing})")
        else:
            reasons.append(f"{listing}, not {allowed}")

    eligible_names = {s.name for s in eligible}
    for s in sorted(model_ok, key=lambda s: s.name):
        if s.name not in eligible_names:
            reasons.append(
                f"spare {s.name} has {s.gpu_count} GPU{'' if s.gpu_count == 1 else 's'}, "
                f"fewer than {want.gpus_per_replica} per replica"
            )

    unknown = Counter(s.rack for s in eligible if s.rack not in racks)
    for rack, n in sorted(unknown.items()):
        reasons.append(f"rack {rack}: no power figures (headroom unknown), {_spares(n)} not booted")
    return reasons


def _power_reasons(
    unchosen: list[Spare],
    racks: Mapping[str, RackRoom],
    committed: Mapping[str, float],
    chosen: list[Spare],
) -> list[str]:
    """One line per rack whose eligible spares are left over for want of power."""
    reasons: list[str] = []
    by_rack: dict[str, list[Spare]] = {}
    for s in unchosen:
        by_rack.setdefault(s.rack, []).append(s)
    booted_here = Counter(s.rack for s in chosen)
    for rack, left in sorted(by_rack.items()):
        room = racks[rack]
        headroom = room.headroom_w - committed.get(rack, 0.0)
        smallest = min(left, key=lambda s: (extra_draw_w(s), s.name))
        need = extra_draw_w(smallest)
        after = f" left after {booted_here[rack]} chosen here" if booted_here[rack] else ""
        how = (
            f"a spare needs {_w(need, up=True)} W more"
            if len(left) == 1
            else f"{len(left)} spares need {_w(need, up=True)} W or more each"
        )
        reasons.append(
            f"rack {rack}: {_w(headroom)} W headroom{after}, {how} "
            f"({_w(smallest.max_w)} max - {_w(smallest.standby_w)} standby)"
        )
    return reasons


def _spares(n: int) -> str:
    return f"{n} warm spare{'' if n == 1 else 's'}"


def _w(watts: float, *, up: bool = False) -> str:
    """Watts for a person: thousands separated, a decimal only when there is one.

    Headroom rounds down and need rounds up (to 0.1 W), so a line never shows a spare that
    seems to fit.
    """
    if not math.isfinite(watts):
        return str(watts)
    tenths = math.ceil(watts * 10 - 1e-6) if up else math.floor(watts * 10 + 1e-6)
    if tenths % 10 == 0:
        return f"{tenths // 10:,}"
    return f"{tenths / 10:,.1f}"


def _unique(names: list[str], what: str) -> None:
    dupes = sorted(n for n, c in Counter(names).items() if c > 1)
    if dupes:
        raise ValueError(f"duplicate {what} names: {', '.join(dupes)}")
