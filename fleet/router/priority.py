"""The router's class as the engine's own request field (pure: bytes and dicts in, bytes out).

An engine that schedules by priority (vLLM under `--scheduling-policy priority`, SGLang under
`--enable-priority-scheduling`) reads a `priority` field in the completion and chat bodies;
fleet_core/engines/ says, per engine and deployment, which fields carry each class
(`EngineSpec.priority_fields`; the fleet's routing table carries them computed, and a table
without them gets the engine's defaults here). TensorRT-LLM has no such field: its bodies pass
byte for byte.

The router's class wins: a client's own value for one of those fields is replaced by its
class's, so that no client raises itself above its `x-fleet-priority` class inside the engine.

Hot path: the body was parsed once already (the router needs its `model`); when the client set
none of the fields, the fields are spliced in before the closing brace of the raw bytes instead
of re-serialising the whole body (a 64 MiB prompt costs a copy, not a dump).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleet.router.admission import PRIORITIES, Priority
from fleet_core.engines import DEFAULT_ENGINE
from fleet_core.engines import spec as engine_spec


@dataclass(frozen=True)
class ClassFields:
    """What one class adds to a body: the fields, and the same as the bytes that replace the
    body's closing brace (`,"priority":10}`); empty: nothing to add."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    splice: bytes = b""


NONE = ClassFields()


def class_fields(fields: Mapping[str, Any]) -> ClassFields:
    if not fields:
        return NONE
    members = json.dumps(dict(fields), separators=(",", ":"))[1:-1]
    return ClassFields(dict(fields), b"," + members.encode() + b"}")


def table_priorities(row: Mapping[str, Any]) -> dict[Priority, ClassFields]:
    """Per class, what a routing-table row's deployment adds to its requests: the row's
    `priority_fields` when it has them (the fleet computed them from the deployment's options),
    else its engine's defaults (`engine` absent: trtllm, which adds nothing). A malformed or
    unknown entry adds nothing: the request reaches the engine as the client sent it."""
    given = row.get("priority_fields")
    out: dict[Priority, ClassFields] = {}
    for cls in PRIORITIES:
        if isinstance(given, Mapping):
            fields = given.get(cls)
            out[cls] = class_fields(fields) if isinstance(fields, Mapping) else NONE
            continue
        try:
            out[cls] = class_fields(
                engine_spec(str(row.get("engine") or DEFAULT_ENGINE)).priority_fields(cls)
            )
        except ValueError:  # an engine this router does not know
            out[cls] = NONE
    return out


def with_priority(raw: bytes, body: Mapping[str, Any], add: ClassFields) -> bytes:
    """The body to forward: `raw` itself when there is nothing to add; the fields spliced in
    when the client set none of them; else the body re-serialised with the class's values."""
    if not add.fields:
        return raw
    if not any(key in body for key in add.fields):
        end = raw.rstrip()
        # Plain UTF-8 JSON (what every client sends): splice. Anything else (a BOM, UTF-16)
        # was still valid JSON to json.loads: dump it again instead.
        if end.endswith(b"}") and raw.lstrip()[:1] == b"{":
            return end[:-1] + add.splice
    return json.dumps({**body, **add.fields}, separators=(",", ":")).encode()
