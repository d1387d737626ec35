"""argparse options from an EngineSpec's FlagTable (fleet_core/engines/flags.py), so that the
vLLM and SGLang dialects accept exactly the flags the agent's launch() emits, and follow the
table when it changes."""

from __future__ import annotations

import argparse

from fleet_core.engines.flags import FlagTable


def add_flag_table(parser: argparse.ArgumentParser, table: FlagTable) -> None:
    """One option per flag; dest is the engine_params key, default None (engine default)."""
    for key, flag in table.ints.items():
        parser.add_argument(flag, dest=key, type=int, default=None)
    for key, flag in table.fractions.items():
        parser.add_argument(flag, dest=key, type=float, default=None)
    for key, flag in table.bools.items():
        parser.add_argument(flag, dest=key, action="store_true", default=False)
    for key, (flag, allowed) in table.choices.items():
        parser.add_argument(flag, dest=key, choices=list(allowed), default=None)
    for key, flag in table.toggles.items():  # --x / --no-x; None: the engine's default
        parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None)
    for key, flag in table.strings.items():
        parser.add_argument(flag, dest=key, default=None)
