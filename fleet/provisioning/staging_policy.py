"""Pre-staging policy: which warm spares to power on to fetch a deployment's version (pure).

A deployment with `cached_spares` K asks the fleet to keep at least K warm spares of each GPU
model it allows holding its version verified in their weights cache, so that a scale-out boots
one that loads from local disk (docs/provisioning.md, "Pre-staged spares"). The staging step
(fleet/provisioning/staging.py) reads the database into these shapes, calls `plan`, and under
the placement lock moves the picked spares to `booting` (kind "stage"): what this module says
is a plan, that transaction is the commitment. The simulator may call the same function.

For each goal (a deployment's version on one GPU model), in deployment and GPU-model order:

1. **Holding** — warm spares of that GPU model, able to run a replica (GPUs ≥ GPUs per
   replica), whose agent last reported the version `ready`; plus spares already staging it
   (`InFlight`: powered on for it, or on their way back to warm). Only the deployment's current
   version counts: once a rollout promotes another, the spares holding the old one no longer
   do, and the new one is staged.
2. **Bounded** — at most `concurrency` spares stage a version at once (the deployment's
   disruption budget): a fetch takes a spare out of the pool for a while, and a bad source
   should fail on one spare, not on all of them.
3. **Candidates** — warm spares of the GPU model lacking the version, never one whose stage of
   it failed recently (`tried`: its agent reported the fetch `failed`, or the stage ran past
   its deadline) nor one whose cache budget is smaller than the version's files for its GPU
   model (the agent would refuse it), and only where booting it fits its rack's REMAINING
   power headroom (placement's rule: a staging spare commits its maximum like any boot).
4. **Order** — spread over racks (the rack with the fewest spares holding or staging the
   version first: a rack that loses power then takes the fewest with it), then the most
   bytes of the version already on its disk (a fetch cut by an earlier deadline resumes),
   then the most headroom left in its rack, then name, so that the same inputs always give
   the same plan.

`plan` returns the picks, in order, each with a one-line reason, and one `Gap` per goal it
could not meet, saying why (no spare left, all tried, power), for the tick's report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from fleet.provisioning.placement import RackRoom, Spare, extra_draw_w, fits

__all__ = ["Candidate", "Gap", "Goal", "InFlight", "Pick", "plan"]


@dataclass(frozen=True, slots=True)
class Goal:
    """K warm spares of `gpu_model` holding `version` for `deployment`."""

    deployment: str
    version: str  # the version key, "<model>@<version>"
    gpu_model: str
    keep: int  # K: cached_spares
    gpus_per_replica: int = 1
    size_bytes: int = 0  # the version's files for this GPU model (0: not known)
    concurrency: int = 1  # at most this many spares staging the version at once


@dataclass(frozen=True, slots=True)
class Candidate:
    """A warm spare as staging sees it: placement's view (`spare.cached`: the version keys its
    agent last reported ready), its cache, and the versions whose stage failed on it lately."""

    spare: Spare
    cache_budget_bytes: int | None = None  # None: not reported yet
    partial_bytes: Mapping[str, int] = field(default_factory=dict)  # key -> bytes on disk
    tried: frozenset[str] = frozenset()  # keys whose stage failed here recently


@dataclass(frozen=True, slots=True)
class InFlight:
    """A spare powered on to stage `version` (booting, loading, or powering off again)."""

    name: str
    rack: str
    version: str
    gpu_model: str


@dataclass(frozen=True, slots=True)
class Pick:
    name: str
    deployment: str
    version: str
    gpu_model: str
    reason: str  # one line: why this spare, and how far the goal is


@dataclass(frozen=True, slots=True)
class Gap:
    deployment: str
    version: str
    gpu_model: str
    holding: int  # warm spares holding it, plus those staging it
    keep: int
    reason: str


def plan(
    goals: Sequence[Goal],
    candidates: Sequence[Candidate],
    in_flight: Sequence[InFlight],
    racks: Mapping[str, RackRoom],
) -> tuple[list[Pick], list[Gap]]:
    """The spares to stage now and the goals left unmet (module docstring: the rules)."""
    for goal in goals:
        if goal.keep < 0 or goal.concurrency < 0:
            raise ValueError(f"{goal.deployment}: keep and concurrency must be 0 or more")
    names = [c.spare.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError("duplicate candidate names")
    flying = Counter(f.version for f in in_flight)
    committed: dict[str, float] = {}
    taken: set[str] = set()
    picks: list[Pick] = []
    gaps: list[Gap] = []
    for goal in sorted(goals, key=lambda g: (g.deployment, g.gpu_model, g.version)):
        if goal.keep == 0:
            continue
        able = [
            c
            for c in candidates
            if c.spare.gpu_model == goal.gpu_model
            and c.spare.gpu_count >= goal.gpus_per_replica
            and c.spare.name not in taken
        ]
        holders = [c for c in able if goal.version in c.spare.cached]
        staging = [
            f for f in in_flight if f.version == goal.version and f.gpu_model == goal.gpu_model
        ]
        mine = [p for p in picks if p.version == goal.version and p.gpu_model == goal.gpu_model]
        have = len(holders) + len(staging) + len(mine)
        need = goal.keep - have
        if need <= 0:
            continue
        per_rack = Counter(c.spare.rack for c in holders)
        per_rack.update(f.rack for f in staging)
        lacking = [c for c in able if goal.version not in c.spare.cached]
        fresh = [c for c in lacking if goal.version not in c.tried]
        roomy = [
            c
            for c in fresh
            if c.cache_budget_bytes is None or c.cache_budget_bytes >= goal.size_bytes
        ]
        placed = 0
        while placed < need and flying[goal.version] < goal.concurrency:
            fitting = [
                c
                for c in roomy
                if c.spare.rack in racks
                and fits(c.spare, racks[c.spare.rack], already_w=committed.get(c.spare.rack, 0.0))
            ]
            if not fitting:
                break

            best = min(
                fitting,
                key=partial(
                    _rank, version=goal.version, per_rack=per_rack, racks=racks, committed=committed
                ),
            )
            roomy.remove(best)
            taken.add(best.spare.name)
            committed[best.spare.rack] = committed.get(best.spare.rack, 0.0) + extra_draw_w(
                best.spare
            )
            per_rack[best.spare.rack] += 1
            flying[goal.version] += 1
            placed += 1
            on_disk = best.partial_bytes.get(goal.version, 0)
            resume = f", resuming {on_disk:,} bytes on disk" if on_disk else ""
            picks.append(
                Pick(
                    best.spare.name,
                    goal.deployment,
                    goal.version,
                    goal.gpu_model,
                    f"pre-stage {goal.version} for {goal.deployment}: {have + placed - 1} of "
                    f"{goal.keep} {goal.gpu_model} warm spares hold it; rack {best.spare.rack} "
                    f"has {per_rack[best.spare.rack] - 1}{resume}",
                )
            )
        if placed < need:
            gaps.append(
                Gap(
                    goal.deployment,
                    goal.version,
                    goal.gpu_model,
                    have + placed,
                    goal.keep,
                    _why_short(goal, able, lacking, fresh, roomy, racks, flying),
                )
            )
    return picks, gaps


def _rank(
    c: Candidate,
    *,
    version: str,
    per_rack: Counter[str],
    racks: Mapping[str, RackRoom],
    committed: Mapping[str, float],
) -> tuple[int, int, float, str]:
    left = racks[c.spare.rack].headroom_w - committed.get(c.spare.rack, 0.0) - extra_draw_w(c.spare)
    return (per_rack[c.spare.rack], -c.partial_bytes.get(version, 0), -left, c.spare.name)


def _why_short(
    goal: Goal,
    able: list[Candidate],
    lacking: list[Candidate],
    fresh: list[Candidate],
    roomy: list[Candidate],
    racks: Mapping[str, RackRoom],
    flying: Counter[str],
) -> str:
    head = f"{goal.deployment}: {goal.gpu_model} spares holding {goal.version}"
    if roomy and flying[goal.version] >= goal.concurrency:
        return f"{head}: {flying[goal.version]} staging now, at most {goal.concurrency} at once"
    if not able:
        return f"{head}: no warm {goal.gpu_model} spare with {goal.gpus_per_replica}+ GPUs"
    if not lacking:
        return f"{head}: every warm {goal.gpu_model} spare holds it already"
    if not fresh:
        return f"{head}: the {len(lacking)} left failed to stage it lately (see their events)"
    if not roomy:
        return (
            f"{head}: the {len(fresh)} left have a cache budget under the version's "
            f"{goal.size_bytes:,} bytes"
        )
    unknown = sorted({c.spare.rack for c in roomy if c.spare.rack not in racks})
    if unknown and len(unknown) == len({c.spare.rack for c in roomy}):
        return f"{head}: rack(s) {', '.join(unknown)} have no power figures"
    return f"{head}: no rack has the headroom to power one on now"
