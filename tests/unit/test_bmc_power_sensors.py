"""Which IPMI power sensor is the server's draw (fleet/bmc/ipmi.py `_system_watts`), for BMCs
without DCMI: sensor names as vendors ship them."""

from __future__ import annotations

import pytest

from fleet.bmc.ipmi import _system_watts


@pytest.mark.parametrize(
    ("sensors", "want"),
    [
        ({}, None),
        ({"Total Power": 4300.0}, 4300.0),  # the lab's ipmi_sim sensor
        ({"Pwr Consumption": 812.0, "CPU1 Power": 150.0}, 812.0),  # Dell
        ({"Power Meter": 640.0, "CPU Power": 90.0}, 640.0),  # HPE
        ({"Sys Power": 990.0, "PS1 Input Power": 500.0, "PS2 Input Power": 495.0}, 990.0),
        # Only per-supply inputs: a redundant pair shares the load, so the draw is the sum.
        ({"PS1 Input Power": 500.0, "PS2 Input Power": 495.0, "CPU1 Power": 150.0}, 995.0),
        ({"PSU1 In Power": 300.0, "PSU2 In Power": 310.0}, 610.0),
        # Nothing says what it is: the largest is the best guess.
        ({"CPU1 Power": 150.0, "GPU Board Power": 2800.0}, 2800.0),
    ],
)
def test_the_system_figure_among_power_sensors(
    sensors: dict[str, float], want: float | None
) -> None:
    assert _system_watts(sensors) == want
