"""Racks, power and warm spares in the simulator: the data fleet/provisioning/placement.py chooses
from.

With `racks` in a scenario, the shared warm pool is made of servers that sit in racks with a
power budget, and the production placement rules are imported, not re-implemented:

- a scale-up asks `placement.choose_spares` for the spares to boot: model cache first, then
  spread over racks and sites, both feeds, measured boot time, the most headroom left — and
  never past a rack's budget; a shortfall is recorded with the placement's own reasons;
- a scale-in asks `placement.choose_release` which serving replicas to drain: the tightest
  rack first, then the fewest requests in flight.

A rack's headroom is its budget − `other_w` (whatever else the rack feeds) − what its servers
commit: `max_w` for a server that is on (booting, serving, draining, rebooting), `standby_w`
for one that is off (fleet/power/budget.py's rule). A spare is one server for one replica, so its
GPUs are the deployment's `tp_size` (as everywhere in the simulator).

Server power defaults (`SERVER_POWER`, per GPU, watts) come from docs/hardware.md's
figures as the demo inventory uses them (bench/gen_inventory.py): a DGX-class H100/H200 server
is 10.2 kW maximum for 8 GPUs; a 4 × L40S server is quoted near 2.8 kW; standby (off, BMC
only) has no published figure — 90 W and 40 W per server are ASSUMED. Idle (on, GPUs idle:
`SERVER_IDLE_W`, per GPU) is the demo inventory's assumption: 1,900 W for a DGX, 600 W for
4 × L40S; only the drawn-power model reads it (fleet/sim/power.py).

Budget modes (`budget_mode`, fleet/sim/power.py, with a scenario's `power:`): `nameplate`
commits an on server at its `max_w`; `measured` at fleet/power/budget.py's
`measured_commit_w` of its simulated draw (p99 over the window × `budget_margin`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fleet.provisioning import placement

# gpu model → (max W per GPU, standby W per server); unknown models: the H100 figures
SERVER_POWER: dict[str, tuple[float, float]] = {
    "H100": (10_200 / 8, 90.0),
    "H200": (10_200 / 8, 90.0),
    "L40S": (2_800 / 4, 40.0),
}
# gpu model → idle W per GPU of a whole server (host included); unknown models: the H100's
SERVER_IDLE_W: dict[str, float] = {"H100": 1_900 / 8, "H200": 1_900 / 8, "L40S": 600 / 4}


@dataclass(frozen=True)
class RackSpec:
    name: str
    budget_w: float
    site: str = "site"
    spares: tuple[tuple[str, int], ...] = ()  # (GPU model, servers), warm
    cached: tuple[str, ...] = ()  # models on its spares' local disks
    feed_sides: tuple[str, ...] = ("A", "B")
    other_w: float = 0.0  # what else the rack's budget feeds, always on
    server_max_w: float | None = None  # per spare; None: SERVER_POWER × GPUs
    server_standby_w: float | None = None
    server_idle_w: float | None = None  # None: SERVER_IDLE_W × GPUs
    budget_mode: str = "nameplate"  # or "measured" (fleet/sim/power.py; needs `power`)
    budget_margin: float = 1.15  # measured mode: p99 × this


def server_watts(gpu: str, gpus: int, rack: RackSpec) -> tuple[float, float]:
    """(max_w, standby_w) of one spare server with `gpus` GPUs in `rack`."""
    per_gpu, standby = SERVER_POWER.get(gpu, SERVER_POWER["H100"])
    max_w = rack.server_max_w if rack.server_max_w is not None else per_gpu * gpus
    standby_w = rack.server_standby_w if rack.server_standby_w is not None else standby
    return max_w, standby_w


def server_idle_w(gpu: str, gpus: int, rack: RackSpec) -> float:
    """What one spare server in `rack` draws on with its GPUs idle."""
    if rack.server_idle_w is not None:
        return rack.server_idle_w
    return SERVER_IDLE_W.get(gpu, SERVER_IDLE_W["H100"]) * gpus


def spares(racks: Iterable[RackSpec], gpus: int) -> list[placement.Spare]:
    """The racks' warm spares, `gpus` GPUs each, named RACK-GPU-k."""
    out: list[placement.Spare] = []
    for rack in racks:
        for gpu, count in rack.spares:
            max_w, standby_w = server_watts(gpu, gpus, rack)
            for k in range(count):
                out.append(
                    placement.Spare(
                        name=f"{rack.name}-{gpu}-{k}",
                        site=rack.site,
                        rack=rack.name,
                        gpu_model=gpu,
                        gpu_count=gpus,
                        standby_w=standby_w,
                        max_w=max_w,
                        cached=rack.cached,
                    )
                )
    return out


def rooms(
    racks: Iterable[RackSpec], servers: Iterable[placement.Spare], on: Mapping[str, bool]
) -> dict[str, placement.RackRoom]:
    """Each rack's room now: budget − other loads − its servers' committed power (`on[name]`:
    the server is on; a server not in `on` is off)."""
    committed: dict[str, float] = {}
    for s in servers:
        committed[s.rack] = committed.get(s.rack, 0.0) + (
            s.max_w if on.get(s.name, False) else s.standby_w
        )
    return {
        r.name: placement.RackRoom(
            rack=r.name,
            site=r.site,
            headroom_w=r.budget_w - r.other_w - committed.get(r.name, 0.0),
            feed_sides=r.feed_sides,
        )
        for r in racks
    }
