"""Validation errors as one line each: `place: what to fix`, never echoing the input value.

Shared by the inventory parser and the API, because a rejected value may be a BMC password.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from fleet.models import NAME_HELP


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
