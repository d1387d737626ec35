"""The virtual colo's modelled draw (fleet/lab/colo.py): the pure rule and the /metrics sum, and
the checks on its power options. The feeder against real emulators and agents is in
tests/e2e/worlds/test_lab_power.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.data import DEMO_INVENTORY
from fleet.lab.colo import VirtualColo, gpu_power_from_metrics, modelled_draw_w
from fleet.lab.ipmi_sim import power_sdr, power_step_w

DGX: dict[str, Any] = {"standby_w": 90.0, "idle_w": 1900.0, "gpu_count": 8, "gpu_idle_w": 70.0}


def test_off_draws_standby_whatever_the_agent_said() -> None:
    assert modelled_draw_w(on=False, gpu_power_w=None, **DGX) == 90.0
    assert modelled_draw_w(on=False, gpu_power_w=5000.0, **DGX) == 90.0


def test_on_without_an_agent_answer_draws_idle() -> None:
    assert modelled_draw_w(on=True, gpu_power_w=None, **DGX) == 1900.0


def test_on_is_the_host_part_plus_the_gpus() -> None:
    # host part: 1900 - 8 * 70 = 1340 W
    assert modelled_draw_w(on=True, gpu_power_w=8 * 70.0, **DGX) == 1900.0
    assert modelled_draw_w(on=True, gpu_power_w=8 * 700.0, **DGX) == 1340.0 + 5600.0
    assert modelled_draw_w(on=True, gpu_power_w=0.0, **DGX) == 1340.0


def test_the_host_part_is_never_negative() -> None:
    tiny = {**DGX, "idle_w": 300.0}  # less than the GPUs' own idle: all of it is GPU
    assert modelled_draw_w(on=True, gpu_power_w=1000.0, **tiny) == 1000.0


METRICS = """# HELP agent_gpu_power_watts GPU power draw
# TYPE agent_gpu_power_watts gauge
agent_gpu_power_watts{gpu="0",uuid="GPU-a"} 612.5
agent_gpu_power_watts{gpu="1",uuid="GPU-b"} 71.0
# HELP agent_gpu_power_limit_watts GPU power limit
# TYPE agent_gpu_power_limit_watts gauge
agent_gpu_power_limit_watts{gpu="0",uuid="GPU-a"} 700.0
agent_gpu_power_limit_watts{gpu="1",uuid="GPU-b"} 700.0
"""


def test_the_gpus_power_is_summed_from_the_agents_metrics() -> None:
    assert gpu_power_from_metrics(METRICS) == 683.5


def test_an_agent_without_gpu_power_reports_none() -> None:
    assert gpu_power_from_metrics("") is None
    limits_only = "\n".join(line for line in METRICS.splitlines() if "limit" in line) + "\n"
    assert gpu_power_from_metrics(limits_only) is None


def test_no_power_reading_must_name_servers_of_the_inventory(tmp_path: Path) -> None:
    inventory = DEMO_INVENTORY.read_text()
    with pytest.raises(ValueError, match=r"not in the inventory: \['nope'\]"):
        VirtualColo(inventory, tmp_path, token_for=lambda _: "t", no_power_reading=["nope"])
    with pytest.raises(ValueError, match="power_feed_s"):
        VirtualColo(inventory, tmp_path, token_for=lambda _: "t", power_feed_s=0)


def test_the_ipmi_power_sensor_scale() -> None:
    assert power_step_w(2550.0) == 10
    assert power_step_w(10_200 * 1.25) == 50  # a DGX H100's range: 50 W a step
    assert power_step_w(100.0) == 1
    for bad in (0.0, -1.0, float("nan"), 255.0 * 1024):
        with pytest.raises(ValueError):
            power_step_w(bad)


def test_the_power_sensor_record_matches_openipmis_compiler() -> None:
    """The bytes OpenIPMI's own SDR compiler (`sdrcomp`, openipmi 2.0.33) gives for this
    sensor (threshold, Watts, M = 50, "Total Power"), but for the record id, which ipmi_sim
    assigns, and the sensor type: 0x0B here (other units-based) for sdrcomp's 0x09."""
    compiled = bytes.fromhex(
        "01005101362000301701450009010000000000000006000032000001010000000000ff00"
        "0000000000000000000000cb"
    ).hex(" ").split() + [f"{ord(c):02x}" for c in "Total Power"]
    ours = [byte.removeprefix("0x") for byte in power_sdr(50).split()]
    assert len(ours) == len(compiled)
    differing = [i for i, (a, b) in enumerate(zip(ours, compiled, strict=True)) if a != b]
    assert differing == [0, 12]  # record id (low byte), sensor type
    assert (ours[0], ours[12]) == ("00", "0b")
