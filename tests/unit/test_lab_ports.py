"""The lab's ports (fleet/lab/processes.py, fleet/lab/colo.py): servers booting at once each get
ports of their own, even where the free check alone would hand two of them the same ones (it
sees only what is bound, and an engine binds seconds after its agent starts)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fleet.data import DEMO_INVENTORY
from fleet.lab import LabError, processes
from fleet.lab.colo import VirtualColo
from fleet.lab.processes import distinct_free_block


def test_a_block_apart_from_the_ports_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([20_000, 20_002, 20_004])  # free now, all three; the first two overlap `taken`
    monkeypatch.setattr(processes, "free_port_block", lambda count: next(draws))
    assert distinct_free_block(2, {20_001, 20_003}) == 20_004


def test_no_block_apart_is_a_lab_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "free_port_block", lambda count: 20_000)
    with pytest.raises(LabError, match="apart from 1 handed out"):
        distinct_free_block(1, {20_000}, attempts=5)


def test_servers_booting_at_once_get_ports_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The free check offers the same few bases again and again, as a random draw may.
    bases = itertools.cycle([21_000, 21_010, 21_020])
    monkeypatch.setattr(processes, "free_port_block", lambda count: next(bases) + 100 * count)
    lab = VirtualColo(DEMO_INVENTORY.read_text(), tmp_path, token_for=lambda _: "t")
    nodes = list(lab._nodes.values())
    assert len(nodes) >= 3
    held: dict[str, set[int]] = {}
    for node in nodes[:3]:
        env = lab._agent_env(node, "t", lab._claim_ports(node, 1))
        agent = int(env["FLEET_AGENT_LISTEN_PORT"])
        engines = int(env["FLEET_AGENT_ENGINE_BASE_PORT"])
        held[node.name] = {agent, *range(engines, engines + node.spec.gpu.count)}
        assert node.ports == held[node.name]
    for (a, ports_a), (b, ports_b) in itertools.combinations(held.items(), 2):
        assert ports_a.isdisjoint(ports_b), (a, b, ports_a & ports_b)

    # A server booting again (as _start_agent does) gives back what its last boot held and
    # still draws nothing another server holds.
    first = nodes[0]
    first.ports.clear()
    port = lab._claim_ports(first, 1)
    assert all(port not in held[n.name] for n in nodes[1:3]), port
    assert first.ports == {port}
