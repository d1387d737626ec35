"""What differs between the engines the stand-in speaks for (trtllm-serve, `vllm serve`, SGLang's
launch_server): the version it claims, how priority reaches its scheduler, whether a request's
"model" is checked, and the JSON of its errors. One cost model and one EngineCore behind all.

Error bodies, as each server writes them (docs/engine.md, "Dialects", names the sources):

- trtllm-serve: `{"object": "error", "message", "type", "param": null, "code"}`
  (openai_protocol.ErrorResponse via OpenAIServer.create_error_response); a request that fails
  validation: `{"error": "<text>"}` (its RequestValidationError handler).
- vLLM (0.10.2+): `{"error": {"message", "type", "param", "code"}}` (ErrorResponse(error=
  ErrorInfo)); validation failures the same with type "Bad Request".
- SGLang: `{"object": "error", "message", "type", "param", "code"}` (its ErrorResponse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from starlette.responses import JSONResponse

EngineName = Literal["trtllm", "vllm", "sglang"]
# How the request's "priority" reaches EngineCore (lower runs first there): not at all, as is
# (vLLM; SGLang with --schedule-low-priority-values-first), or negated (SGLang's default, where
# higher values run first).
PriorityMode = Literal["off", "low_first", "high_first"]

LAST = 2**31  # an SGLang request without a priority, behind every one with a priority
_KINDS = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


@dataclass(frozen=True)
class Dialect:
    engine: EngineName
    version: str  # what --version and /version claim: inside the EngineSpec's supported range
    priority: PriorityMode = "off"
    check_model: bool = False  # vLLM answers 404 for a "model" it does not serve
    metrics: bool = True  # SGLang exposes /metrics only with --enable-metrics
    # vLLM refuses a nonzero priority unless --scheduling-policy priority.
    refuse_priority: bool = False
    max_queued: int | None = None  # SGLang's --max-queued-requests: 503 past it

    def error(self, status: int, message: str, param: str | None = None) -> JSONResponse:
        """This engine's error body for an error it raises itself."""
        info: dict[str, Any] = {
            "message": message,
            "type": _KINDS.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
        if self.engine == "vllm":
            return JSONResponse({"error": info}, status_code=status)
        return JSONResponse({"object": "error", **info}, status_code=status)

    def invalid(self, message: str, param: str | None = None) -> JSONResponse:
        """This engine's answer to a body that fails validation (400)."""
        if self.engine == "trtllm":
            return JSONResponse({"error": message}, status_code=400)
        if self.engine == "vllm":
            info = {"message": message, "type": "Bad Request", "param": param, "code": 400}
            return JSONResponse({"error": info}, status_code=400)
        return self.error(400, message, param)

    def priority_key(self, priority: int | None) -> int:
        """The request's priority as EngineCore orders it (lower first). Without one: 0 in
        vLLM (its default); last in SGLang, as fleet_core/engines/sglang.py describes it."""
        if self.priority == "off":
            return 0
        if priority is None:
            return LAST if self.engine == "sglang" else 0
        return -priority if self.priority == "high_first" else priority


# The versions each dialect claims (--version, /version): inside fleet_core/engines' supported
# ranges (tests/unit/test_engine_standin_cli.py checks them against the specs).
TRTLLM_VERSION = "1.1.0"
VLLM_VERSION = "0.11.0"
SGLANG_VERSION = "0.5.4"
TRTLLM = Dialect("trtllm", TRTLLM_VERSION)


def version_line(program: str, version: str) -> str:
    """--version's output: the version last, as EngineSpec.parse_version reads it."""
    return f"Fleet stand-in (no GPU) for {program}, version {version}"
