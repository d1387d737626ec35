"""An engine whose options are all command-line flags (vLLM, SGLang): a table of the flags the
agent may pass, by kind, checked and turned into argv the same way for each (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleet_core.engines.base import (
    check_bool,
    check_choice,
    check_fraction,
    check_int,
)

_CONTROLS = "\\u0000-\\u001f\\u007f-\\u009f"


@dataclass(frozen=True)
class FlagTable:
    """engine_params key -> the engine's flag, by the kind of value it takes. A key is the
    flag's long name without its dashes, in snake_case (`max_num_seqs` for `--max-num-seqs`)."""

    ints: Mapping[str, str] = field(default_factory=dict)  # integers, at least 1 by default
    fractions: Mapping[str, str] = field(default_factory=dict)  # numbers in (0, 1]
    bools: Mapping[str, str] = field(default_factory=dict)  # store_true flags: given when true
    choices: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    strings: Mapping[str, str] = field(default_factory=dict)  # free text (bounded)
    # argparse BooleanOptionalAction flags: `--x` when true, `--no-x` when false (vLLM's bools).
    toggles: Mapping[str, str] = field(default_factory=dict)
    # The least value of an int key other than 1 (a seed may be 0).
    int_minimums: Mapping[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(
            {*self.ints, *self.fractions, *self.bools, *self.choices, *self.strings, *self.toggles}
        )

    def flags(self) -> frozenset[str]:
        """Every flag `argv` can emit (the tests hold them against the engine's real flags)."""
        out = {*self.ints.values(), *self.fractions.values(), *self.bools.values()}
        out |= {flag for flag, _ in self.choices.values()} | set(self.strings.values())
        for flag in self.toggles.values():
            out |= {flag, negated(flag)}
        return frozenset(out)

    def check(self, params: Mapping[str, Any]) -> None:
        for key in self.ints:
            check_int(params, key, minimum=self.int_minimums.get(key, 1))
        for key in self.fractions:
            check_fraction(params, key)
        for key in (*self.bools, *self.toggles):
            check_bool(params, key)
        for key, (_, allowed) in self.choices.items():
            check_choice(params, key, allowed)
        for key in self.strings:
            value = params.get(key)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 200):
                raise ValueError(f"engine_params.{key} must be a string of 1-200 characters")
            if isinstance(value, str) and value.startswith("-"):
                raise ValueError(f"engine_params.{key} may not start with '-': {value!r}")

    def argv(self, params: Mapping[str, Any]) -> list[str]:
        """The flags for the params that are present, in table order."""
        out: list[str] = []
        for key, flag in self.ints.items():
            if params.get(key) is not None:
                out += [flag, str(int(params[key]))]
        for key, flag in self.fractions.items():
            if params.get(key) is not None:
                out += [flag, repr(float(params[key]))]
        for key, flag in self.bools.items():
            if params.get(key) is True:
                out.append(flag)
        for key, flag in self.toggles.items():
            if key in params:
                out.append(flag if params[key] is True else negated(flag))
        for key, (flag, _) in self.choices.items():
            if params.get(key) is not None:
                out += [flag, str(params[key])]
        for key, flag in self.strings.items():
            if params.get(key) is not None:
                out += [flag, str(params[key])]
        return out

    def schema(self, never_null: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The JSON schema of params this table accepts."""
        props: dict[str, Any] = {}
        for key in self.ints:
            kind: Any = "integer" if key in never_null else ["integer", "null"]
            props[key] = {"type": kind, "minimum": self.int_minimums.get(key, 1)}
        for key in self.fractions:
            props[key] = {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1}
        for key in (*self.bools, *self.toggles):
            props[key] = {"type": "boolean"}
        for key, (_, allowed) in self.choices.items():
            props[key] = {"enum": [*allowed, None]}
        for key in self.strings:
            props[key] = {
                "type": ["string", "null"],
                "minLength": 1,
                "maxLength": 200,
                # Not a flag (no leading '-'), no control characters (the API's edge
                # refuses them anywhere; the schema says so).
                "pattern": f"^[^-{_CONTROLS}][^{_CONTROLS}]*$",
            }
        return {"type": "object", "properties": props, "additionalProperties": False}


def negated(flag: str) -> str:
    """`--enable-x` -> `--no-enable-x` (argparse's BooleanOptionalAction)."""
    return "--no-" + flag.removeprefix("--")
