"""The lab's engines: the stand-in command per engine, and inventories moved onto one engine
(pure, but for `standin_commands`' interpreter path).

Every lab agent gets the stand-in of each engine (FLEET_AGENT_ENGINE_COMMAND for trtllm,
FLEET_AGENT_ENGINE_COMMAND_VLLM, FLEET_AGENT_ENGINE_COMMAND_SGLANG): a deployment's `engine`
picks which one its replicas run, so a lab or demo fleet can mix engines. `on_engine` rewrites
an inventory's deployments onto one engine (`fleetctl lab up --engine`, `fleetctl demo
--engine`): the replica's shape (tensor and pipeline parallel sizes, batch limit) is kept, in
the target engine's own option names; the source engine's other options have no counterpart
and are dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

from fleet_core.engines import DEFAULT_ENGINE, ENGINES
from fleet_core.engines import spec as engine_spec

# The agent's setting per engine, and the stand-in module that speaks its dialect.
STANDIN_MODULES: dict[str, tuple[str, str]] = {
    "trtllm": ("FLEET_AGENT_ENGINE_COMMAND", "fleet_agent.engine.standin"),
    "vllm": ("FLEET_AGENT_ENGINE_COMMAND_VLLM", "fleet_agent.engine.standin.vllm"),
    "sglang": ("FLEET_AGENT_ENGINE_COMMAND_SGLANG", "fleet_agent.engine.standin.sglang"),
}


def standin_commands(python: str = sys.executable) -> dict[str, str]:
    """The agent's engine-command settings: every engine's stand-in, on this interpreter."""
    return {setting: f"{python} -m {module}" for setting, module in STANDIN_MODULES.values()}


def engine_of(entry: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """An inventory deployment's engine and options, in either form: `engine: vllm` with
    `engine_params`, or (files from before engines) `engine: {trtllm-serve's options}`."""
    engine = entry.get("engine", DEFAULT_ENGINE)
    if isinstance(engine, Mapping):
        return DEFAULT_ENGINE, dict(engine)
    return str(engine), dict(entry.get("engine_params") or {})


def translate_params(source: str, params: Mapping[str, Any], target: str) -> dict[str, Any]:
    """`params` of engine `source` as options of engine `target`: the same parallel sizes and
    batch limit under the target's names; nothing else (no option means the same thing in
    two engines' vocabularies beyond these). The same engine: `params` unchanged."""
    if source == target:
        return dict(params)
    src, dst = engine_spec(source), engine_spec(target)
    tp, pp = src.parallelism(params)
    out: dict[str, Any] = {dst.parallel_keys[0]: tp}
    if pp > 1:
        out[dst.parallel_keys[1]] = pp
    batch = src.max_batch_size(params)
    if batch is not None:
        out[dst.batch_key] = batch
    dst.check_params(out)
    return out


def on_engine(entry: Mapping[str, Any], engine: str) -> dict[str, Any]:
    """An inventory deployment entry moved onto `engine` (written in the new form)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    source, params = engine_of(entry)
    out = deepcopy(dict(entry))
    out["engine"] = engine
    out["engine_params"] = translate_params(source, params, engine)
    return out


def inventory_on_engine(doc: Mapping[str, Any], engine: str | None) -> dict[str, Any]:
    """An inventory document with every deployment on `engine` (None: as written)."""
    out = dict(doc)
    if engine is not None and isinstance(doc.get("deployments"), list):
        out["deployments"] = [on_engine(d, engine) for d in doc["deployments"]]
    return out
