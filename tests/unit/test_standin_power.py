"""The stand-in engine's power: each iteration at the power model's watts and, under a limit,
its capped time (fleet_core/power_model.py); the meter that turns iterations and idle gaps into
mean watts per GPU."""

from __future__ import annotations

import pytest

from fleet_agent.engine.core import CoreConfig, EngineCore, GenerationRequest
from fleet_agent.engine.standin.power import PowerMeter
from fleet_core import cost_model as cm
from fleet_core import power_model as pm


def core(gpu: str = "H200", limit: float | None = None) -> EngineCore:
    shape = cm.EngineShape(gpu=cm.gpu_spec(gpu), model=cm.model_spec("llama-3.1-8b"))
    engine = EngineCore(CoreConfig(shape=shape))
    engine.power_limit_w = limit
    return engine


def prompt(tokens: int) -> str:
    return "x" * (4 * tokens)


def test_prefill_draws_near_tdp_and_a_cap_stretches_it() -> None:
    free, capped = core(), core(limit=350)
    for engine in (free, capped):
        engine.add_request(GenerationRequest("r", prompt(8000), max_tokens=4, ignore_eos=True))
    a, b = free.step(), capped.step()
    assert a.prefill == b.prefill == (("r", 8000),)
    assert a.power_w > 0.9 * 700 and not a.capped
    assert a.duration_s == cm.iteration_seconds(free.shape, 0, 8000, 8000)
    assert b.capped and b.power_w == 350
    assert b.duration_s == pm.capped_iteration(capped.shape, 0, 8000, 8000, 350)[0]
    assert b.duration_s > 1.3 * a.duration_s
    # Decode after it: far below the cap, so the cap changes nothing.
    c, d = free.step(), capped.step()
    assert c.decoded == d.decoded == ("r",)
    assert c.duration_s == d.duration_s and not d.capped
    assert 137 <= c.power_w <= 300


def test_the_meter_integrates_iterations_and_idle_gaps() -> None:
    meter = PowerMeter(idle_w=76.0, start=100.0)
    meter.iteration(100.0, 0.5, 600.0, capped=False)  # 0.5 s busy, then 0.5 s idle
    first = meter.read(101.0)
    assert first.power_w == pytest.approx((0.5 * 600 + 0.5 * 76) / 1.0)
    assert first.busy == pytest.approx(0.5) and not first.capped
    assert meter.read(103.0).power_w == pytest.approx(76.0)  # nothing ran: idle
    assert meter.energy_j == pytest.approx(0.5 * 600 + 2.5 * 76)


def test_an_iteration_counts_as_its_time_passes() -> None:
    meter = PowerMeter(idle_w=70.0, start=0.0)
    meter.iteration(0.0, 2.0, 350.0, capped=True)
    half = meter.read(1.0)  # half-way through: one second at 350 W, no more
    assert half.power_w == pytest.approx(350.0) and half.busy == 1.0 and half.capped
    rest = meter.read(3.0)  # its second half, then a second idle
    assert rest.power_w == pytest.approx((350.0 + 70.0) / 2)
    assert rest.capped  # the capped iteration ran in this period too
    assert not meter.read(4.0).capped


def test_back_to_back_iterations_and_reads_without_time() -> None:
    meter = PowerMeter(idle_w=70.0, start=0.0)
    for i in range(10):
        meter.iteration(i * 0.01, 0.01, 200.0 + i, capped=False)
    reading = meter.read(0.1)
    assert reading.power_w == pytest.approx(204.5) and reading.busy == pytest.approx(1.0)
    assert meter.read(0.1).power_w == 70.0  # no time passed, nothing running
