"""The router's class as the engine's own request field (pure: bytes and dicts in, bytes out).

An engine that schedules by priority (vLLM under `--scheduling-policy priority`, SGLang under
`--enable-priority-scheduling`) reads a `priority` field in the completion and chat bodies;
fleet_core/engines/ says, per engine and deployment, which fields carry each class
(`EngineSpec.priority_fields`; the fleet's routing table carries them computed, and a table
without them gets the engine's defaults here). TensorRT-LLM has no such field: its bodies pass
byte for byte.

The router's class wins: a client's own value for one of those fields is replaced by its
class's, so that no client raises itself above its `x-fleet-priority` class inside the engine;
and where the router adds nothing (priority passing off, or a deployment that turned its
engine's priority scheduling off) a client's own value is taken out, for the same reason.

Hot path: the body was parsed once already (the router needs its `model`); the fields are
spliced in before the closing brace of the raw bytes instead of re-serialising the whole body
(a 64 MiB prompt costs a copy, not a dump). A client's own value is then an earlier duplicate
key: JSON parsers (Python's, the engines') keep the last one, the class's.
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
    # The engine's priority fields, which a client may not set itself (taken out when the
    # router adds none).
    strip: frozenset[str] = frozenset()

    def without_fields(self) -> ClassFields:
        """Add nothing; still take a client's own priority out."""
        return ClassFields(strip=self.strip)


NONE = ClassFields()


def class_fields(fields: Mapping[str, Any], strip: frozenset[str] = frozenset()) -> ClassFields:
    if not fields:
        return ClassFields(strip=strip) if strip else NONE
    members = json.dumps(dict(fields), separators=(",", ":"))[1:-1]
    return ClassFields(dict(fields), b"," + members.encode() + b"}", strip | set(fields))


def table_priorities(row: Mapping[str, Any]) -> dict[Priority, ClassFields]:
    """Per class, what a routing-table row's deployment adds to its requests: the row's
    `priority_fields` when it has them (the fleet computed them from the deployment's options),
    else its engine's defaults (`engine` absent: trtllm, which adds nothing). A malformed or
    unknown entry adds nothing: the request reaches the engine as the client sent it."""
    given = row.get("priority_fields")
    try:
        engine = engine_spec(str(row.get("engine") or DEFAULT_ENGINE))
    except ValueError:  # an engine this router does not know
        engine = None
    out: dict[Priority, ClassFields] = {}
    for cls in PRIORITIES:
        # The engine's own field names, whatever this deployment's options say.
        strip = frozenset(engine.priority_fields(cls)) if engine is not None else frozenset()
        if isinstance(given, Mapping):
            fields = given.get(cls)
            out[cls] = class_fields(fields if isinstance(fields, Mapping) else {}, strip)
        else:
            out[cls] = class_fields(engine.priority_fields(cls) if engine else {}, strip)
    return out


def with_priority(raw: bytes, body: Mapping[str, Any], add: ClassFields) -> bytes:
    """The body to forward: `raw` itself when there is nothing to add or take out; the
    fields spliced in (last: they win over a client's own); a client's own priority taken out
    when the router adds none (re-serialised: rare, and the client's doing)."""
    if not add.fields:
        if not any(key in body for key in add.strip):
            return raw
        return json.dumps(
            {k: v for k, v in body.items() if k not in add.strip}, separators=(",", ":")
        ).encode()
    end = raw.rstrip()
    # Plain UTF-8 JSON (what every client sends): splice. Anything else (a BOM, UTF-16) was
    # still valid JSON to json.loads: dump it again instead.
    if end.endswith(b"}") and raw.lstrip()[:1] == b"{":
        return end[:-1] + add.splice
    return json.dumps({**body, **add.fields}, separators=(",", ":")).encode()
