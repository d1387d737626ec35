"""The virtual colo's BMCs read the draw the lab models (fleet/lab/colo.py): real emulators (one
sushy-emulator with the lab's Power extension, one ipmi_sim with its power sensor), real agents
(`python -m fleet_agent`, simulated GPUs), and the fleet's own drivers reading them.

No fleet runs here: the agents cannot register (nothing listens at their fleet URL) but read
their GPUs and serve /metrics all the same, which is all the lab's power feeder needs. The GPUs'
load is what a stand-in engine would report into the agent's simulated-GPU state directory.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from fleet.bmc import driver_for
from fleet.bmc.base import BmcTarget, PowerDriver, Timeouts
from fleet.lab import LabError
from fleet.lab.colo import VirtualColo
from fleet.lab.harness import free_port
from fleet.lab.harness import wait_for as _wait_for
from fleet.lab.state import load_state
from fleet.models import BmcProtocol
from fleet_agent.telemetry import sim_gpu_state
from fleet_core.gpus import gpu_spec

if shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("ipmi_sim and ipmitool are required in CI", pytrace=False)
    pytest.skip(
        "ipmi_sim/ipmitool not installed (Debian openipmi, ipmitool)", allow_module_level=True
    )

T = TypeVar("T")
IDLE_W, STANDBY_W, MAX_W, GPUS = 1900.0, 90.0, 10200.0, 8
HOST_W = IDLE_W - GPUS * gpu_spec("H100").idle_mid_w  # 1340 W
# Simulated idle GPUs draw within their model's idle range, plus noise (±1.5 W) per sample.
IDLE_SPREAD_W = GPUS * ((gpu_spec("H100").idle_w[1] - gpu_spec("H100").idle_w[0]) / 2 + 1.5)
IPMI_STEP_W = 50.0  # ipmi_sim's sensor for a 10.2 kW server: 12,750 W range, 50 W a step
FEED_S = 0.3
SETTLE_S = 30.0  # sushy applies a Reset 1-11 s late; then the boot delay and the agent's start
RF, IPMI, QUIET = "pw-rf-01", "pw-ipmi-01", "pw-rf-02"
wait_for = partial(_wait_for, timeout=SETTLE_S)


def inventory() -> str:
    def server(u: int, name: str, protocol: str) -> dict[str, Any]:
        return {
            "name": name,
            "u": u,
            "gpu": {"model": "H100", "count": GPUS},
            "power": {"idle_w": IDLE_W, "standby_w": STANDBY_W, "max_w": MAX_W},
            "bmc": {
                "protocol": protocol,
                "address": "10.0.0.1",
                "port": 623,
                "username": "root",
                "password": "not-used-by-the-lab",
            },
        }

    feeds = [
        {"name": f"{s.lower()}1", "side": s, "volts": 415, "amps": 63, "phase": "three"}
        for s in "AB"
    ]
    servers = [server(1, RF, "redfish"), server(2, IPMI, "ipmi"), server(3, QUIET, "redfish")]
    doc = {
        "sites": [
            {"name": "pw1", "racks": [{"name": "pw1-r01", "feeds": feeds, "servers": servers}]}
        ]
    }
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture
def colo(tmp_path: Path) -> Iterator[VirtualColo]:
    lab = VirtualColo(
        inventory(),
        tmp_path / "lab",
        token_for=lambda _: "lab-token-not-checked",
        fleet_url=f"http://127.0.0.1:{free_port()}",  # nothing there: agents keep retrying
        boot_delay_s=0.3,
        power_feed_s=FEED_S,
        no_power_reading=[QUIET],
        agent_env={
            "FLEET_AGENT_SAMPLE_INTERVAL_S": "0.3",
            "FLEET_AGENT_BACKOFF_MAX_S": "2",
            "FLEET_AGENT_REQUEST_TIMEOUT_S": "1",
        },
    )
    with lab:
        yield lab


def drivers(colo: VirtualColo) -> dict[str, PowerDriver]:
    """The fleet's own drivers for the lab's BMCs, as the rewritten inventory gives them."""
    made = {}
    for rack in colo.rewritten_inventory()["sites"][0]["racks"]:
        for server in rack["servers"]:
            bmc = server["bmc"]
            made[server["name"]] = driver_for(
                BmcTarget(
                    server=server["name"],
                    protocol=BmcProtocol(bmc["protocol"]),
                    address=bmc["address"],
                    port=bmc["port"],
                    username=bmc["username"],
                    password=bmc["password"],
                    system_id=bmc.get("system_id"),
                    plain_http=bool(bmc.get("plain_http")),
                    timeouts=Timeouts(call=3.0, total=6.0, attempts=3, backoff=0.1),
                )
            )
    return made


def near(value: float | None, want: float, within: float) -> bool:
    return value is not None and abs(value - want) <= within


def until(what: str, probe: Callable[[], T | None], timeout: float = SETTLE_S) -> T:
    result: T = wait_for(what, probe, timeout=timeout)
    return result


def load_gpus(colo: VirtualColo, server: str, watts: float) -> None:
    """What a stand-in engine running on every GPU of `server` reports (fresh for ~3 s)."""
    state_dir = colo.workdir / "servers" / server / "agent" / "simulated-gpus"
    activity = sim_gpu_state.GpuActivity(
        at=time.time(), power_w=watts, busy=1.0, memory_used_mib=60_000, capped=False
    )
    for gpu in range(GPUS):
        sim_gpu_state.write_activity(state_dir, gpu, activity)


def test_the_bmcs_read_the_draw_the_lab_models(colo: VirtualColo) -> None:
    bmc = drivers(colo)
    try:
        # Off: each BMC reads the server's standby draw; the quiet one reads nothing.
        assert bmc[RF].sensors().power_w == STANDBY_W
        assert near(bmc[IPMI].sensors().power_w, STANDBY_W, IPMI_STEP_W / 2)
        assert bmc[QUIET].sensors().power_w is None
        assert colo.power_w(QUIET) == STANDBY_W  # the lab still models it

        # Power on at the BMCs: idle while booting, then host part + the agent's GPU power.
        for name in (RF, IPMI, QUIET):
            colo.set_power_behind_our_back(name, True)
        for name in (RF, IPMI, QUIET):
            until(f"{name}'s agent", partial(colo.agent_pid, name))
            # A figure from the agent is the host part plus eight idle GPUs: near, never equal
            # to, the inventory's idle_w (the simulated GPUs each idle at their own figure).
            until(
                f"{name}'s draw from its agent",
                lambda name=name: colo.power_w(name) != IDLE_W,  # type: ignore[misc]
            )
            assert near(colo.power_w(name), IDLE_W, IDLE_SPREAD_W)
        assert near(bmc[RF].sensors().power_w, IDLE_W, IDLE_SPREAD_W)
        assert near(bmc[IPMI].sensors().power_w, IDLE_W, IDLE_SPREAD_W + IPMI_STEP_W / 2)
        assert bmc[QUIET].sensors().power_w is None  # its BMC has no reading: the fleet estimates
        entry = load_state(colo.workdir)["servers"]
        assert entry[QUIET]["bmc_power_w"] is None and entry[RF]["bmc_power_w"] is not None

        # A BMC gone wrong, for the fleet's nonsense-watts rule: Redfish serves what it is given.
        colo.override_bmc_power(RF, -40.0)
        assert bmc[RF].sensors().power_w == -40.0
        colo.override_bmc_power(RF, 10 * MAX_W + 1)
        assert bmc[RF].sensors().power_w == 10 * MAX_W + 1
        colo.override_bmc_power(RF, None)
        assert bmc[RF].sensors().power_w is None
        with pytest.raises(LabError, match="IPMI power sensor shows 0-12750 W"):
            colo.override_bmc_power(IPMI, -1.0)
        colo.clear_bmc_power_override(RF)
        assert near(bmc[RF].sensors().power_w, IDLE_W, IDLE_SPREAD_W)

        # Load on RF's GPUs (as its engines would report): its BMC's reading rises with it...
        busy_w = 650.0
        loaded = HOST_W + GPUS * busy_w

        def loaded_reading() -> float | None:
            load_gpus(colo, RF, busy_w)
            seen = bmc[RF].sensors().power_w
            return seen if near(seen, loaded, GPUS * 1.5 + 1) else None

        until("RF's BMC to read the loaded GPUs", loaded_reading, timeout=10)
        # ... and falls back when the engines stop reporting (the GPUs idle again).
        until(
            "RF's BMC to read idle GPUs again",
            lambda: near(bmc[RF].sensors().power_w, IDLE_W, IDLE_SPREAD_W),
            timeout=15,
        )

        # Off again: standby at once in the lab, at the BMC once sushy applies the Reset.
        colo.set_power_behind_our_back(RF, False)
        until("RF's BMC to read standby", lambda: bmc[RF].sensors().power_w == STANDBY_W)
        assert colo.agent_pid(RF) is None
    finally:
        for d in bmc.values():
            d.close()
