"""What the stand-in's simulated GPUs draw: per-GPU power integrated over the iterations the
engine runs (each at the power model's watts, fleet_core/power_model.py) and the idle gaps
between them (the GPU's idle draw). Pure: times are passed in (the engine's simulated seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PowerReading:
    """Since the previous reading: mean watts per GPU, the fraction of time an iteration ran,
    and whether the power limit slowed any iteration."""

    power_w: float
    busy: float
    capped: bool


class PowerMeter:
    """Energy per GPU of one engine, from its iterations; read() gives the means since the
    previous read(). An iteration's energy is counted as its time passes, not in advance."""

    def __init__(self, idle_w: float, start: float) -> None:
        self.idle_w = idle_w
        self.energy_j = 0.0  # per GPU, since start
        self._t = start  # integrated up to here
        self._busy_s = 0.0
        self._iter_end = start
        self._iter_w = idle_w
        self._capped = False
        self._read_t, self._read_energy, self._read_busy = start, 0.0, 0.0

    def iteration(self, start: float, seconds: float, watts: float, capped: bool) -> None:
        """An iteration of `seconds` at `watts` per GPU begins at `start`."""
        self._advance(start)
        begin = max(start, self._t)
        self._iter_end, self._iter_w = begin + max(0.0, seconds), watts
        self._capped = self._capped or capped

    def _advance(self, t: float) -> None:
        if t <= self._t:
            return
        busy_to = min(t, self._iter_end)
        if busy_to > self._t:
            self.energy_j += (busy_to - self._t) * self._iter_w
            self._busy_s += busy_to - self._t
        idle_from = max(self._t, self._iter_end)
        if t > idle_from:
            self.energy_j += (t - idle_from) * self.idle_w
        self._t = t

    def read(self, now: float) -> PowerReading:
        self._advance(now)
        span = now - self._read_t
        if span <= 0:
            running = now < self._iter_end
            return PowerReading(self._iter_w if running else self.idle_w, float(running), False)
        reading = PowerReading(
            power_w=(self.energy_j - self._read_energy) / span,
            busy=min(1.0, (self._busy_s - self._read_busy) / span),
            capped=self._capped,
        )
        self._read_t, self._read_energy, self._read_busy = now, self.energy_j, self._busy_s
        self._capped = now < self._iter_end and self._capped  # a capped iteration still running
        return reading
