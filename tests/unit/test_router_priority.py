"""The router's class as the engine's request field (fleet/router/priority.py), on bytes."""

from __future__ import annotations

import json

from fleet.router.priority import NONE, class_fields, table_priorities, with_priority

BATCH = class_fields({"priority": 10})


def test_the_field_is_spliced_into_plain_json_and_nothing_else_changes() -> None:
    raw = b'{"model": "m", "prompt": "a } b", "max_tokens": 3}  \n'
    out = with_priority(raw, json.loads(raw), BATCH)
    assert out == b'{"model": "m", "prompt": "a } b", "max_tokens": 3,"priority":10}'
    assert with_priority(raw, json.loads(raw), NONE) is raw


def test_a_clients_own_value_is_replaced_and_other_encodings_are_dumped_again() -> None:
    raw = b'{"model": "m", "priority": -5}'
    assert json.loads(with_priority(raw, json.loads(raw), BATCH)) == {"model": "m", "priority": 10}
    utf16 = '{"model": "m"}'.encode("utf-16")  # valid JSON to json.loads, with a BOM
    assert json.loads(with_priority(utf16, json.loads(utf16), BATCH)) == {
        "model": "m",
        "priority": 10,
    }


def test_a_table_row_gives_its_own_fields_else_its_engines() -> None:
    given = table_priorities({"engine": "vllm", "priority_fields": {"interactive": {}}})
    # Nothing added, but a client's own `priority` is still vLLM's field: taken out.
    assert given["interactive"].fields == {} and given["batch"].fields == {}
    assert given["interactive"].strip == frozenset({"priority"})
    stripped = with_priority(
        b'{"model":"m","priority":-100}', {"model": "m", "priority": -100}, given["batch"]
    )
    assert json.loads(stripped) == {"model": "m"}
    vllm = table_priorities({"engine": "vllm"})
    assert (vllm["interactive"].fields, vllm["batch"].fields) == ({"priority": 0}, {"priority": 10})
    assert vllm["batch"].splice == b',"priority":10}'
    assert table_priorities({})["batch"] is NONE  # trtllm
    assert table_priorities({"engine": "triton"})["batch"] is NONE  # unknown: nothing added
