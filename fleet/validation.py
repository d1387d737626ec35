"""What a client may send, and what it is told when it may not: the field types every API and
inventory model uses (names, JSON numbers within their columns), and validation errors as one
line each, `place: what to fix`, never echoing the input value.

Shared by the inventory parser and the API, because a rejected value may be a BMC password.
Pure: pydantic only, so the simulator's scenario models use the same checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from annotated_types import MaxLen
from pydantic import AllowInfNan, BeforeValidator, StringConstraints, ValidationError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# An SSH host key as OpenSSH prints it (`ssh-keygen -lf`, `ssh -v`): SHA-256, unpadded base64.
SSH_FINGERPRINT_PATTERN = r"^SHA256:[A-Za-z0-9+/]{43}$"
NAME_HELP = "1-63 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


# ---------------------------------------------------------------------------------------------
# Numbers a client sends: JSON numbers only, finite, and within their column
#
# pydantic's lax mode takes `true` for 1 and "1e3" for 1000.0 (`{"replicas": false}` pinned a
# deployment at 0), and lets inf and NaN through (`max_w: .inf` committed +Inf watts). Postgres
# INTEGER columns are 32-bit: a larger value fails the INSERT (a 500), so every integer field
# carries its bound and the 422 names the field. Query and path parameters arrive as text:
# they are plain `int`s with bounds (fleet/api/routes/).

INT32_MAX = 2**31 - 1
# Replica counts and budgets: far beyond any fleet, far within a column.
MAX_REPLICAS = 100_000
# Watts of one server or GPU: far beyond any (a DGX draws 10.2 kW), and a rack's sum of them
# stays finite.
MAX_WATTS = 1_000_000.0
# A latency SLA: from 1 ms to a day.
MAX_SLA_MS = 86_400_000.0


def _integer(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError("must be an integer")
    return value


def _number(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError("must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Int = Annotated[int, BeforeValidator(_integer)]
OptInt = Annotated[int | None, BeforeValidator(_integer)]
Number = Annotated[float, BeforeValidator(_number), AllowInfNan(False)]
OptNumber = Annotated[float | None, BeforeValidator(_number)]
# Model URIs a server holds in its local cache (placement prefers those): bounded like a
# deployment's `model_uri`, and in number.
ModelUris = Annotated[
    list[Annotated[str, StringConstraints(min_length=1, max_length=1000)]], MaxLen(256)
]


def exactly_one_of(*fields: str) -> dict[str, Any]:
    """The JSON schema of a model's rule "exactly one of these fields, not null" (the others
    left out or null), so that the schema refuses what the model refuses."""
    return {
        "oneOf": [
            {
                "required": [given],
                "properties": {
                    other: {"not": {"type": "null"}} if other == given else {"type": "null"}
                    for other in fields
                },
            }
            for given in fields
        ]
    }


# ---------------------------------------------------------------------------------------------
# Errors


def place(loc: Sequence[int | str]) -> str:
    """('sites', 0, 'racks', 2) -> 'sites[0].racks[2]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def message(error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be an integer"
    if kind in ("float_type", "float_parsing"):
        return "must be a number"
    if kind in ("string_type",):
        return "must be a string"
    if kind in ("list_type",):
        return "must be a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a mapping"
    if kind in ("bool_type", "bool_parsing"):
        return "must be true or false"
    if kind == "enum":
        return f"must be one of {ctx.get('expected', '')}"
    if kind == "string_pattern_mismatch":
        return f"not a valid name ({NAME_HELP})"
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "less_than_equal":
        return f"must be ≤ {ctx['le']}"
    if kind == "less_than":
        return f"must be < {ctx['lt']}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    # Fall back to pydantic's text, which does not include the input value.
    return str(error["msg"])


def error_messages(errors: Iterable[Any]) -> list[str]:
    """pydantic error dicts -> ['place: message', ...]."""
    return [f"{place(tuple(e['loc']))}: {message(e)}" if e["loc"] else message(e) for e in errors]


def messages_under(where: str, exc: ValidationError) -> list[str]:
    """Messages of a nested model, placed under `where` ('sites[0].racks[1]')."""
    return [
        f"{where}.{place(tuple(e['loc']))}: {message(e)}" if e["loc"] else f"{where}: {message(e)}"
        for e in exc.errors()
    ]


def validation_messages(exc: ValidationError) -> list[str]:
    return error_messages(exc.errors())
