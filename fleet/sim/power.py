"""Drawn power, budget modes and the cap valve in the simulator (a scenario's `power:`).

With `power`, every engine prices each block it runs with fleet_core/power_model.py (per-GPU
watts from what the iteration does: prefill near TDP, decode far below; under a GPU power limit
the capped duration), and this module keeps the racks' books:

- **Drawn power.** Every `sample_s` each server's draw is its mean over the interval: off
  (warm) its standby; on (booting, serving, draining) `server_w` of its GPUs' mean watts. A
  server draws its idle figure with its GPUs idle and its maximum with every GPU at TDP,
  linear between: the host's fans, PSU losses and NVSwitches rise with the GPUs' load, and at
  TDP the server draws its nameplate (conservative: a DGX H100 measured 8.4 kW peak in
  training, not 10.2 kW; docs/power.md). A booting server's GPUs are idle. A rack draws
  `other_w` + its servers. An **exceedance** is a sample with a rack's draw above its budget.
- **Budget modes** (fleet/power/budget.py's rule, imported): an on server commits its `max_w`
  in `nameplate` mode; in `measured` mode `measured_commit_w` of the p99 of its own samples
  while serving (not booting: a boot's idle draw says nothing of its draw under load) over
  `window_s` (fleet_core.stats.quantile, as fleet/power/series.py) × the rack's margin —
  its maximum until `min_history_s` of samples exist. Placement (fleet/provisioning/placement.py)
  sees that commitment as the spare's `max_w` ("committed once it boots"), and a rack's
  headroom is budget − max(committed, drawn now), as fleet/power/budget.py's `RackPower`.
- **The cap valve** (fleet/power/caps.py `next_cap_pct`, imported): every `valve.interval_s`
  each rack's latest drawn sample decides its GPU cap (percent of TDP); its on servers' engines
  run under it from their next iteration, and a server that boots there starts under it. At
  100 % drawn no boot enters the rack (headroom ≤ 0).

What it reports per rack (`RackFigures`): drawn power over time, peak, exceedances,
throttled GPU-seconds (GPU time the limit slowed), cap changes, servers serving (mean, peak)
and servers per kW of budget.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.power import caps
from fleet.power.budget import measured_commit_w
from fleet.provisioning import placement
from fleet.settings import Settings
from fleet.sim.engine import Engine
from fleet.sim.racks import RackSpec, server_idle_w
from fleet_core import cost_model, power_model
from fleet_core.stats import quantile

_DEFAULTS = Settings.model_fields
MODES = ("nameplate", "measured")


def _default(name: str) -> Any:
    return _DEFAULTS[name].default


@dataclass(frozen=True)
class ValveSpec:
    """The cap valve's knobs (defaults: fleet/settings.py)."""

    interval_s: float = float(_default("power_valve_interval_s"))
    high_pct: float = float(_default("power_cap_high_pct"))
    low_pct: float = float(_default("power_cap_low_pct"))
    floor_pct: float = float(_default("power_cap_floor_pct"))
    step_pct: float = float(_default("power_cap_step_pct"))


@dataclass(frozen=True)
class PowerSpec:
    sample_s: float = 5.0  # the drawn-power sample (a BMC reading's interval)
    window_s: float = float(_default("power_measured_window_s"))  # measured p99's window
    min_history_s: float = float(_default("power_measured_min_s"))
    valve: ValveSpec | None = ValveSpec()  # None: no cap valve


def server_w(gpu: cost_model.GpuSpec, idle_w: float, max_w: float, gpu_w: float) -> float:
    """A server's draw when each of its GPUs draws `gpu_w`: `idle_w` at the GPUs' idle,
    `max_w` at their TDP, linear between (module docstring)."""
    lo = power_model.idle_power_w(gpu)
    return idle_w + (max_w - idle_w) * (gpu_w - lo) / (gpu.tdp_w - lo)


@dataclass
class _Server:
    spare: placement.Spare
    idle_w: float
    gpu: cost_model.GpuSpec
    history: deque[float] = field(default_factory=deque)  # samples serving, newest last
    engine: Engine | None = None  # the engine on it now (on) or None (off)
    last_j: float = 0.0  # the engine's above-idle joules at the last sample


@dataclass(frozen=True)
class RackFigures:
    rack: str
    mode: str
    budget_w: float
    times: tuple[float, ...]  # sample ends, simulated seconds
    drawn_w: tuple[float, ...]  # the rack's mean draw over each sample
    serving: tuple[int, ...]  # its servers serving at each sample
    exceedances: int  # samples above the budget
    throttled_gpu_s: float  # GPU-seconds the cap slowed
    cap_changes: int
    from_s: float  # the means and peaks below are over samples ending after this
    committed_w: float = 0.0  # what its servers commit at the end (mode's rule) + other loads

    def _tail(self) -> range:
        first = next((k for k, t in enumerate(self.times) if t > self.from_s), len(self.times))
        return range(first, len(self.times))

    @property
    def peak_w(self) -> float:
        return max((self.drawn_w[k] for k in self._tail()), default=0.0)

    @property
    def serving_mean(self) -> float:
        tail = self._tail()
        return sum(self.serving[k] for k in tail) / len(tail) if tail else 0.0

    @property
    def serving_peak(self) -> int:
        return max((self.serving[k] for k in self._tail()), default=0)

    @property
    def servers_per_kw(self) -> float:
        return self.serving_mean / (self.budget_w / 1000)


@dataclass(frozen=True)
class PowerReport:
    racks: tuple[RackFigures, ...]

    @property
    def serving_mean(self) -> float:
        return sum(r.serving_mean for r in self.racks)

    @property
    def serving_peak(self) -> int:
        if not self.racks:
            return 0
        tail = self.racks[0]._tail()
        return max((sum(r.serving[k] for r in self.racks) for k in tail), default=0)

    @property
    def exceedances(self) -> int:
        return sum(r.exceedances for r in self.racks)

    @property
    def throttled_gpu_s(self) -> float:
        return sum(r.throttled_gpu_s for r in self.racks)

    @property
    def budget_kw(self) -> float:
        return sum(r.budget_w for r in self.racks) / 1000

    @property
    def servers_per_kw(self) -> float:
        return self.serving_mean / self.budget_kw if self.budget_kw else 0.0


class PowerBooks:
    """The racks' power books for one run (the Simulation calls it; module docstring)."""

    def __init__(
        self, spec: PowerSpec, racks: Sequence[RackSpec], spares: Iterable[placement.Spare]
    ) -> None:
        for r in racks:
            if r.budget_mode not in MODES:
                raise ValueError(f"rack {r.name}: budget_mode must be one of {', '.join(MODES)}")
            if not 1.0 <= r.budget_margin <= 2.0:
                raise ValueError(f"rack {r.name}: budget_margin must be within 1.0–2.0")
        self.spec = spec
        self.racks = {r.name: r for r in racks}
        self.servers: dict[str, _Server] = {}
        for s in spares:
            rack = self.racks[s.rack]
            self.servers[s.name] = _Server(
                s, server_idle_w(s.gpu_model, s.gpu_count, rack), cost_model.gpu_spec(s.gpu_model)
            )
        self._keep = max(1, int(spec.window_s / spec.sample_s))
        self.cap_pct: dict[str, float | None] = {r: None for r in self.racks}
        self.cap_changes: dict[str, int] = dict.fromkeys(self.racks, 0)
        self.times: list[float] = []
        self.drawn: dict[str, list[float]] = {r: [] for r in self.racks}
        self.serving: dict[str, list[int]] = {r: [] for r in self.racks}
        self.exceedances: dict[str, int] = dict.fromkeys(self.racks, 0)
        self.engines: list[tuple[str, Engine]] = []  # (rack, engine) of every placed engine
        self._last_t: float | None = None

    # --- servers on and off -------------------------------------------------------------

    def limit_w(self, name: str) -> float | None:
        """The GPU power limit a server in this rack runs under now (None: uncapped)."""
        x = self.servers[name]
        cap = self.cap_pct[x.spare.rack]
        return None if cap is None else x.gpu.tdp_w * cap / 100.0

    def placed(self, name: str, engine: Engine, now: float) -> None:
        """`engine` runs on server `name` from `now` (booting, then serving)."""
        x = self.servers[name]
        engine.power = True
        engine.set_limit(self.limit_w(name), now)
        x.engine = engine
        x.last_j = engine.above_idle_j_at(now)
        self.engines.append((x.spare.rack, engine))

    def off(self, name: str) -> None:
        """Server `name` powered off (back to warm)."""
        if (x := self.servers.get(name)) is not None:
            x.engine = None

    def gone(self, name: str) -> None:
        """Server `name` left the fleet (quarantined): it draws nothing any more."""
        self.servers.pop(name, None)

    # --- commitments and headroom --------------------------------------------------------

    def commit_w(self, name: str) -> float:
        """What server `name` commits while on, in its rack's mode."""
        x = self.servers[name]
        rack = self.racks[x.spare.rack]
        if rack.budget_mode == "nameplate":
            return x.spare.max_w
        spec = self.spec
        return measured_commit_w(
            quantile(x.history, 0.99),
            len(x.history) * spec.sample_s,
            margin=rack.budget_margin,
            idle_w=x.idle_w,
            max_w=x.spare.max_w,
            min_history_s=spec.min_history_s,
        )

    def spares(self, free: Iterable[str]) -> list[placement.Spare]:
        """The warm spares as placement sees them: `max_w` is what each commits once it boots."""
        out = []
        for name in free:
            s = self.servers[name].spare
            commit = self.commit_w(name)
            out.append(s if commit == s.max_w else _with_max(s, commit))
        return out

    def _committed(self) -> dict[str, float]:
        """Per rack: other loads + each server's commitment (on) or standby (off)."""
        committed = {name: rack.other_w for name, rack in self.racks.items()}
        for name, x in self.servers.items():
            on = x.engine is not None
            committed[x.spare.rack] += self.commit_w(name) if on else x.spare.standby_w
        return committed

    def rooms(self) -> dict[str, placement.RackRoom]:
        """Each rack's headroom: budget − max(other loads + committed, drawn now)."""
        committed = self._committed()
        rooms = {}
        for name, rack in self.racks.items():
            drawn = self.drawn[name][-1] if self.drawn[name] else None
            load = committed[name] if drawn is None else max(committed[name], drawn)
            if not caps.admits_boot(drawn, rack.budget_w):
                load = max(load, rack.budget_w)  # at 100 % no new boot enters
            rooms[name] = placement.RackRoom(
                rack=name,
                site=rack.site,
                headroom_w=rack.budget_w - load,
                feed_sides=rack.feed_sides,
            )
        return rooms

    # --- sampling and the valve ----------------------------------------------------------

    def sample(self, now: float, serving: Mapping[str, bool]) -> None:
        """One sample ending at `now`: each server's mean draw since the last one, summed per
        rack; `serving[name]`: the server's replica serves (for the counts)."""
        last = self._last_t
        self._last_t = now
        if last is None or now <= last:
            for x in self.servers.values():
                if x.engine is not None:
                    x.last_j = x.engine.above_idle_j_at(now)
            return
        dt = now - last
        drawn = {name: rack.other_w for name, rack in self.racks.items()}
        counts = dict.fromkeys(self.racks, 0)
        keep = self._keep
        for name, x in self.servers.items():
            rack = x.spare.rack
            e = x.engine
            if e is None:
                drawn[rack] += x.spare.standby_w
                continue
            j = e.above_idle_j_at(now)
            gpu_w = power_model.idle_power_w(x.gpu) + (j - x.last_j) / dt
            x.last_j = j
            w = server_w(x.gpu, x.idle_w, x.spare.max_w, gpu_w)
            drawn[rack] += w
            if serving.get(name, False):
                counts[rack] += 1
                # Its history is its draw while serving: a boot's idle minutes say nothing of
                # what it draws under load (measured_commit_w: nameplate until enough of it).
                x.history.append(w)
                if len(x.history) > keep:
                    x.history.popleft()
        self.times.append(now)
        for name, spec in self.racks.items():
            self.drawn[name].append(drawn[name])
            self.serving[name].append(counts[name])
            if drawn[name] > spec.budget_w:
                self.exceedances[name] += 1

    def valve(self) -> dict[str, float | None]:
        """The racks whose cap changes now, with the new cap (percent of TDP; None: lifted)."""
        v = self.spec.valve
        if v is None:
            return {}
        changed: dict[str, float | None] = {}
        for name, rack in self.racks.items():
            series = self.drawn[name]
            cap = caps.next_cap_pct(
                series[-1] if series else None,
                rack.budget_w,
                self.cap_pct[name],
                high_pct=v.high_pct,
                low_pct=v.low_pct,
                floor_pct=v.floor_pct,
                step_pct=v.step_pct,
            )
            if cap != self.cap_pct[name]:
                self.cap_pct[name] = cap
                self.cap_changes[name] += 1
                changed[name] = cap
        return changed

    def on_engines(self, rack: str) -> list[tuple[str, Engine]]:
        return [
            (name, x.engine)
            for name, x in self.servers.items()
            if x.spare.rack == rack and x.engine is not None
        ]

    def report(self, from_s: float) -> PowerReport:
        throttled = dict.fromkeys(self.racks, 0.0)
        for where, e in self.engines:
            throttled[where] += e.shape.gpus * e.throttled_s
        committed = self._committed()
        return PowerReport(
            tuple(
                RackFigures(
                    rack=name,
                    mode=rack.budget_mode,
                    budget_w=rack.budget_w,
                    times=tuple(self.times),
                    drawn_w=tuple(self.drawn[name]),
                    serving=tuple(self.serving[name]),
                    exceedances=self.exceedances[name],
                    throttled_gpu_s=throttled[name],
                    cap_changes=self.cap_changes[name],
                    from_s=from_s,
                    committed_w=committed[name],
                )
                for name, rack in self.racks.items()
            )
        )


def _with_max(s: placement.Spare, max_w: float) -> placement.Spare:
    return dataclasses.replace(s, max_w=max_w)
