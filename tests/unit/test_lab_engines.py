"""The lab's and the demo's engines (fleet/lab/engines.py, fleet/demo/plan.py): every agent
gets every engine's stand-in; an inventory moved onto one engine keeps each replica's shape in
that engine's own option names; the demo's fleet is one deployment per engine."""

from __future__ import annotations

from typing import Any

import yaml

from fleet.demo import plan
from fleet.demo.run import DEMO_FLEET
from fleet.inventory.schema import parse_inventory
from fleet.lab.engines import inventory_on_engine, on_engine, standin_commands

OLD_FORM: dict[str, Any] = {
    "name": "d",
    "engine": {"backend": "pytorch", "tp_size": 2, "pp_size": 2, "max_batch_size": 64},
}


def test_every_agent_gets_each_engines_standin() -> None:
    assert standin_commands("/py") == {
        "FLEET_AGENT_ENGINE_COMMAND": "/py -m fleet_agent.engine.standin",
        "FLEET_AGENT_ENGINE_COMMAND_VLLM": "/py -m fleet_agent.engine.standin.vllm",
        "FLEET_AGENT_ENGINE_COMMAND_SGLANG": "/py -m fleet_agent.engine.standin.sglang",
    }


def test_a_deployment_moved_onto_an_engine_keeps_its_shape_in_that_engines_names() -> None:
    vllm = on_engine(OLD_FORM, "vllm")
    assert (vllm["engine"], vllm["engine_params"]) == (
        "vllm",
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_num_seqs": 64},
    )
    sglang = on_engine(vllm, "sglang")
    assert sglang["engine_params"] == {"tp_size": 2, "pp_size": 2, "max_running_requests": 64}
    back = on_engine(sglang, "trtllm")
    assert back["engine_params"] == {"tp_size": 2, "pp_size": 2, "max_batch_size": 64}
    # The same engine: its options as written (the old form becomes the new one).
    same = on_engine(OLD_FORM, "trtllm")
    assert (same["engine"], same["engine_params"]) == ("trtllm", OLD_FORM["engine"])
    assert OLD_FORM["engine"]["tp_size"] == 2  # the entry itself is left alone


def test_the_demo_fleet_is_one_deployment_per_engine_and_moves_onto_one() -> None:
    doc = yaml.safe_load(DEMO_FLEET.read_text())
    parse_inventory(DEMO_FLEET.read_bytes())  # a valid inventory file
    mixed = plan.deployments(doc, 6)
    assert [d["engine"] for d in mixed] == ["trtllm", "vllm", "sglang"]
    assert [plan.replica_shape(d) for d in mixed] == [(4, 8)] * 3
    # Each may grow onto what the others' floors leave.
    assert [(d["min_replicas"], d["max_replicas"]) for d in mixed] == [(1, 4)] * 3
    assert mixed[1]["engine_params"] == {"tensor_parallel_size": 4, "max_num_seqs": 8}
    assert mixed[2]["engine_params"] == {"tp_size": 4, "max_running_requests": 8}
    on_vllm = plan.deployments(doc, 6, "vllm")
    assert {d["engine"] for d in on_vllm} == {"vllm"}
    assert [plan.replica_shape(d) for d in on_vllm] == [(4, 8)] * 3
    moved = inventory_on_engine(doc, "sglang")
    assert {d.engine for d in parse_inventory(yaml.safe_dump(moved)).deployments} == {"sglang"}


def test_each_deployment_gets_its_own_draw_of_the_traffic() -> None:
    from fleet.traces import load_trace

    trace = load_trace("conv")
    timeline = plan.Timeline(60.0)
    names = ["a", "b", "c"]
    merged = plan.mixed_arrivals(trace, timeline, 1.0, names, seed=3)
    assert [x.at_s for x in merged] == sorted(x.at_s for x in merged)
    per = {n: [x for x in merged if x.deployment == n] for n in names}
    assert all(per[n] for n in names)
    assert [x.at_s for x in per["a"]] != [x.at_s for x in per["b"]]
