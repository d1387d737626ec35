"""A STAND-IN for TensorRT-LLM's `trtllm-serve`, for hosts without GPUs (CI, the demo, the
virtual colo). It is not an inference engine: it computes nothing, it only behaves like one.

    python -m fleet_agent.engine.standin <model> [trtllm-serve flags]

It takes trtllm-serve's command line (the flags the agent's EngineSupervisor passes are honoured,
the other documented ones accepted and ignored, unknown ones refused with exit status 2), speaks
trtllm-serve's HTTP API (OpenAI completions and chat completions, plain and SSE, /health,
/health_generate, /version, /v1/models, /metrics iteration stats, /prometheus/metrics), and times
every token with the continuous-batching simulation of fleet_agent/engine/core.py, whose iteration
durations come from the cost model of fleet_core/cost_model.py for the GPU it pretends to run
on. docs/engine.md says what it models and how faithfully.

Lifecycle, as trtllm-serve: the port is bound at once but listens only once the weights are
"loaded" (connections are refused meanwhile); then /health answers 200. On SIGTERM or SIGINT it
answers 503 to /health and to new generations, lets the requests in flight finish (at most
FLEET_STANDIN_DRAIN_S wall seconds), then exits 0.

Environment (stand-in only):
  FLEET_STANDIN_GPU        H100 | H200 | L40S (default H100)
  FLEET_STANDIN_MODEL      llama-3.1-8b | llama-3.1-70b (default: "70b" in <model> → 70B, else 8B)
  FLEET_STANDIN_PRECISION  fp8 (default) | bf16
  FLEET_STANDIN_LOAD_S     load delay in simulated seconds (default weights ÷ 7 GB/s)
  FLEET_STANDIN_SEED       seed of the generated text and lengths (default 0)
  FLEET_STANDIN_SPEEDUP    divides every simulated duration, load included (default 1.0)
  FLEET_STANDIN_DRAIN_S    wall-clock bound on the drain after SIGTERM (default 30)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import uvicorn
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet_agent.engine.core import (
    CoreConfig,
    EngineCore,
    Finished,
    GenerationRequest,
    IterationResult,
    RequestRejected,
    TokenOut,
    count_tokens,
)
from fleet_core import cost_model

STANDIN_VERSION = "0.1.0"
STATS_BUFFER = 1000  # iteration stats kept for /metrics between reads
log = logging.getLogger("standin")


# --- command line -----------------------------------------------------------------------------

# trtllm-serve's `serve` options (tensorrt_llm/commands/serve.py). The stand-in uses the ones
# marked "used"; the rest are accepted so that any command line the real server takes works here.
_LOG_LEVELS = ["internal_error", "error", "warning", "info", "verbose", "debug", "trace"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fleet_agent.engine.standin",
        description="Stand-in for trtllm-serve (no GPU, simulated timing).",
        allow_abbrev=False,  # click, which trtllm-serve uses, takes no abbreviations
    )
    p.add_argument("model", help="model name | HF checkpoint path | engine path")
    p.add_argument("--host", default="localhost")  # used
    p.add_argument("--port", type=int, default=8000)  # used
    p.add_argument(
        "--backend", choices=["pytorch", "tensorrt", "trt", "_autodeploy"], default="pytorch"
    )
    p.add_argument("--log_level", choices=_LOG_LEVELS, default="info")  # used
    p.add_argument("--max_beam_width", type=int, default=1)
    p.add_argument("--max_batch_size", type=int, default=2048)  # used; BuildConfig default
    p.add_argument("--max_num_tokens", type=int, default=8192)  # used; BuildConfig default
    p.add_argument("--max_seq_len", type=int, default=None)  # used
    p.add_argument("--tensor_parallel_size", "--tp_size", dest="tp_size", type=int, default=1)
    p.add_argument("--pipeline_parallel_size", "--pp_size", dest="pp_size", type=int, default=1)
    p.add_argument("--context_parallel_size", "--cp_size", dest="cp_size", type=int, default=1)
    p.add_argument("--moe_expert_parallel_size", "--ep_size", dest="ep_size", type=int)
    p.add_argument("--moe_cluster_parallel_size", "--cluster_size", dest="cluster_size", type=int)
    p.add_argument("--gpus_per_node", type=int)
    p.add_argument(
        "--free_gpu_memory_fraction",
        "--kv_cache_free_gpu_memory_fraction",
        dest="kv_cache_free_gpu_memory_fraction",
        type=float,
        default=0.9,
    )  # used
    p.add_argument("--num_postprocess_workers", type=int, default=0)
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--revision")
    p.add_argument("--tokenizer")
    p.add_argument("--custom_tokenizer")
    p.add_argument("--custom_module_dirs", action="append", default=[])
    p.add_argument("--config", "--extra_llm_api_options", dest="extra_llm_api_options")  # used
    p.add_argument("--reasoning_parser")
    p.add_argument("--tool_parser")
    p.add_argument("--metadata_server_config_file")
    p.add_argument("--server_role")
    p.add_argument("--fail_fast_on_attention_window_too_large", action="store_true")
    p.add_argument("--otlp_traces_endpoint")
    p.add_argument("--disagg_cluster_uri")
    p.add_argument("--enable_chunked_prefill", action="store_true")  # used
    p.add_argument("--media_io_kwargs")
    p.add_argument("--chat_template")
    return p


class ConfigError(Exception):
    """The command line parsed but cannot be served (bad environment, YAML, GPU count)."""


@dataclass(frozen=True)
class Settings:
    served_model: str
    host: str
    port: int
    core: CoreConfig
    load_s: float  # simulated
    speedup: float
    drain_s: float  # wall
    log_level: str


def _env_float(env: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name}={raw!r} must be a finite number >= {minimum}")
    return value


def served_model_name(model: str) -> str:
    """As trtllm-serve: a checkpoint directory serves under its base name, anything else (a
    Hugging Face name) as is. An absolute path counts as a checkpoint directory even where it
    does not exist: on a real host it would, and the stand-in loads nothing from it."""
    path = Path(model)
    return path.name if path.is_dir() or path.is_absolute() else model


def _extra_options(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--extra_llm_api_options {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--extra_llm_api_options {path}: not YAML ({exc})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--extra_llm_api_options {path}: expected a mapping")
    return loaded


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """Command line + YAML + FLEET_STANDIN_* → what to serve. Raises ConfigError."""
    extra = _extra_options(args.extra_llm_api_options)
    # The YAML overrides the flags, as in trtllm-serve; keys the stand-in has no use for
    # (enable_iter_perf_stats, return_perf_metrics, ...) are accepted and ignored.
    kv_cfg = extra.get("kv_cache_config") or {}
    if not isinstance(kv_cfg, dict):
        raise ConfigError("extra_llm_api_options: kv_cache_config must be a mapping")
    try:
        max_batch_size = int(extra.get("max_batch_size", args.max_batch_size))
        max_num_tokens = int(extra.get("max_num_tokens", args.max_num_tokens))
        max_seq_len_raw = extra.get("max_seq_len", args.max_seq_len)
        max_seq_len = None if max_seq_len_raw is None else int(max_seq_len_raw)
        # A YAML kv_cache_config replaces the one the flag built (update_llm_args_with_extra_dict),
        # so its own fraction, or KvCacheConfig's default 0.9, wins over the flag.
        fraction = float(
            kv_cfg.get("free_gpu_memory_fraction", 0.9)
            if "kv_cache_config" in extra
            else args.kv_cache_free_gpu_memory_fraction
        )
        chunked = bool(extra.get("enable_chunked_prefill", args.enable_chunked_prefill))
        block_reuse = bool(kv_cfg.get("enable_block_reuse", True))
        tokens_per_block = int(extra.get("tokens_per_block", cost_model.TOKENS_PER_BLOCK))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"extra_llm_api_options: {exc}") from None

    try:
        gpu = cost_model.gpu_spec(env.get("FLEET_STANDIN_GPU") or "H100")
        model_env = env.get("FLEET_STANDIN_MODEL")
        model = (
            cost_model.model_spec(model_env) if model_env else cost_model.guess_model(args.model)
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    precision = (env.get("FLEET_STANDIN_PRECISION") or "fp8").lower()
    if precision not in ("fp8", "bf16"):
        raise ConfigError(f"FLEET_STANDIN_PRECISION={precision!r}: expected fp8 or bf16")

    # A real engine needs tp × pp GPUs; the supervisor hands them over in CUDA_VISIBLE_DEVICES.
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = len([d for d in visible.split(",") if d.strip()])
        if count < args.tp_size * args.pp_size:
            raise ConfigError(
                f"tp_size {args.tp_size} × pp_size {args.pp_size} needs "
                f"{args.tp_size * args.pp_size} GPUs; CUDA_VISIBLE_DEVICES={visible!r} has {count}"
            )
    try:
        shape = cost_model.EngineShape(
            gpu=gpu,
            model=model,
            precision="fp8" if precision == "fp8" else "bf16",
            tp_size=args.tp_size,
            pp_size=args.pp_size,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            kv_cache_free_gpu_memory_fraction=fraction,
            tokens_per_block=tokens_per_block,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cost_model.kv_capacity_blocks(shape) < 1:
        raise ConfigError(
            f"{model.name} {precision} does not fit on {shape.gpus} × {gpu.name} "
            "(out of GPU memory); raise tp_size"
        )
    seed = int(_env_float(env, "FLEET_STANDIN_SEED", 0, -(2**62)))
    return Settings(
        served_model=served_model_name(args.model),
        host=args.host,
        port=args.port,
        core=CoreConfig(
            shape=shape,
            max_seq_len=max_seq_len,
            enable_chunked_prefill=chunked,
            enable_block_reuse=block_reuse,
            seed=seed,
        ),
        load_s=_env_float(env, "FLEET_STANDIN_LOAD_S", cost_model.load_seconds(shape), 0.0),
        speedup=_env_float(env, "FLEET_STANDIN_SPEEDUP", 1.0, 1e-6),
        drain_s=_env_float(env, "FLEET_STANDIN_DRAIN_S", 30.0, 0.0),
        log_level=args.log_level,
    )


# --- OpenAI request bodies --------------------------------------------------------------------


class _Strict(BaseModel):
    # trtllm-serve's request models forbid unknown fields too (OpenAIBaseModel, extra="forbid").
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = True  # trtllm-serve's default once stream_options is given
    continuous_usage_stats: bool | None = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # TensorRT-LLM extensions that benchmark clients send.
    ignore_eos: bool = False
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        if self.n != 1:
            raise ValueError("the stand-in serves n=1 only")
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when stream is true.")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompt(self) -> CompletionBody:
        prompts = self.prompt if isinstance(self.prompt, list) else [self.prompt]
        if prompts and isinstance(prompts[0], str) and len(prompts) != 1:
            raise ValueError("the stand-in serves one prompt per request")
        if self.logprobs:
            raise ValueError("logprobs are not supported by the stand-in")
        if self.echo:
            raise ValueError("echo is not supported by the stand-in")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompt_text(self) -> tuple[str, int | None]:
        """The prompt as text, and its token count when given as token ids."""
        if isinstance(self.prompt, str):
            return self.prompt, None
        if self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0]), None
        ids = [int(t) for t in self.prompt]
        return " ".join(map(str, ids)), max(1, len(ids))


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _chat(self) -> ChatBody:
        if self.logprobs:
            raise ValueError("logprobs are not supported by the stand-in")
        return self

    def prompt_text(self) -> str:
        # Llama-3-like rendering: header per message, then the assistant's header.
        rendered = "".join(f"<|{m.role}|>\n{m.text()}\n" for m in self.messages)
        return rendered + "<|assistant|>\n"


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    body = {
        "error": {
            "message": message,
            "type": kind.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else str(err["msg"]))
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return "; ".join(parts), (str(first[0]) if first else None)


# --- Prometheus -------------------------------------------------------------------------------


class PromMetrics:
    """trtllm-serve's `trtllm_*` metrics (names and buckets of tensorrt_llm/metrics/collector.py;
    trtllm-serve labels every series model_name="undefined", engine_type="undefined")."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": "undefined", "engine_type": "undefined"}
        names = list(self.labels)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"trtllm_{name}", doc, names, registry=r)

        self.success = Counter(
            "trtllm_request_success_total",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.e2e = Histogram(
            "trtllm_e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            names,
            registry=r,
            buckets=[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
        )  # fmt: skip
        self.ttft = Histogram(
            "trtllm_time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            registry=r,
            buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
        )  # fmt: skip
        self.tpot = Histogram(
            "trtllm_time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            names,
            registry=r,
            buckets=[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0],
        )  # fmt: skip
        self.queue = Histogram(
            "trtllm_request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            registry=r,
            buckets=[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "trtllm_prompt_tokens_total",
            "Cumulative number of prompt (input) tokens processed.",
            names,
            registry=r,
        )
        self.generation_tokens = Counter(
            "trtllm_generation_tokens_total",
            "Cumulative number of generation (output) tokens produced.",
            names,
            registry=r,
        )
        self.completed = Counter(
            "trtllm_num_requests_completed_total",
            "Total number of completed requests across iterations",
            names,
            registry=r,
        )
        self.running = gauge("num_requests_running", "Number of active requests")
        self.waiting = gauge("num_requests_waiting", "Number of queued requests")
        self.kv_util = gauge("kv_cache_utilization", "KV cache utilization")
        self.kv_hit = gauge("kv_cache_hit_rate", "KV cache hit rate")
        self.kv_max = gauge("kv_cache_max_blocks", "Maximum number of KV cache blocks")
        self.kv_free = gauge("kv_cache_free_blocks", "Number of free KV cache blocks")
        self.kv_used = gauge("kv_cache_used_blocks", "Number of used KV cache blocks")
        self.kv_tpb = gauge("kv_cache_tokens_per_block", "Number of tokens per KV cache block")
        self.iter_latency = gauge("iteration_latency_seconds", "Iteration latency in seconds")
        self.gpu_mem = gauge("gpu_memory_usage_bytes", "GPU memory usage in bytes")
        self.max_active = gauge("max_num_active_requests", "Maximum number of active requests")
        self.ctx_requests = gauge("num_context_requests", "Number of context (prefill) requests")
        self.gen_requests = gauge(
            "num_generation_requests", "Number of generation (decode) requests"
        )
        self.scheduled = gauge("num_scheduled_requests", "Number of scheduled requests")
        self.ctx_tokens = gauge("total_context_tokens", "Total number of context tokens")

    def iteration(self, stats: Mapping[str, Any]) -> None:
        lv = self.labels
        kv = stats["kvCacheStats"]
        ifb = stats["inflightBatchingStats"]
        self.iter_latency.labels(**lv).set(stats["iterLatencyMS"] / 1e3)
        if stats["numCompletedRequests"]:
            self.completed.labels(**lv).inc(stats["numCompletedRequests"])
        self.kv_hit.labels(**lv).set(kv["cacheHitRate"])
        self.kv_free.labels(**lv).set(kv["freeNumBlocks"])
        self.kv_used.labels(**lv).set(kv["usedNumBlocks"])
        self.ctx_requests.labels(**lv).set(ifb["numContextRequests"])
        self.gen_requests.labels(**lv).set(ifb["numGenRequests"])
        self.scheduled.labels(**lv).set(ifb["numScheduledRequests"])
        self.ctx_tokens.labels(**lv).set(ifb["numCtxTokens"])

    def finished(self, f: Finished) -> None:
        lv = self.labels
        self.success.labels(**lv, finished_reason=f.finish_reason).inc()
        self.e2e.labels(**lv).observe(f.finish_time - f.arrival_time)
        self.ttft.labels(**lv).observe(f.first_token_time - f.arrival_time)
        if f.completion_tokens > 1:
            tpot = (f.finish_time - f.first_token_time) / (f.completion_tokens - 1)
            self.tpot.labels(**lv).observe(tpot)
        self.queue.labels(**lv).observe(f.first_scheduled_time - f.arrival_time)
        self.prompt_tokens.labels(**lv).inc(f.prompt_tokens)
        self.generation_tokens.labels(**lv).inc(f.completion_tokens)


# --- the server -------------------------------------------------------------------------------


class _Channel:
    """Tokens of one request, from the engine loop to its HTTP handler."""

    __slots__ = ("event", "finished", "tokens")

    def __init__(self) -> None:
        self.tokens: list[TokenOut] = []
        self.finished: Finished | None = None
        self.event = asyncio.Event()

    async def next_batch(self) -> tuple[list[TokenOut], Finished | None]:
        while not self.tokens and self.finished is None:
            self.event.clear()
            await self.event.wait()
        batch, self.tokens = self.tokens, []
        return batch, self.finished


class StandinServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.speedup = settings.speedup
        # Simulated time: wall time since start × speedup, so that every latency the engine
        # reports is what the modelled GPU would show.
        self._epoch0 = time.time()
        self._mono0 = time.monotonic()
        self.core = EngineCore(settings.core, clock=self.sim_now)
        self.stats: deque[dict[str, Any]] = deque(maxlen=STATS_BUFFER)
        self.prom = PromMetrics()
        self.ready = False
        self.draining = False
        self.inflight = 0
        self._channels: dict[str, _Channel] = {}
        self._wake = asyncio.Event()
        self._init_gauges()
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/health_generate", self.health_generate, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/prometheus/metrics", self.prometheus, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ]
        )

    def sim_now(self) -> float:
        return self._epoch0 + (time.monotonic() - self._mono0) * self.speedup

    def _init_gauges(self) -> None:
        lv = self.prom.labels
        shape = self.settings.core.shape
        self.prom.kv_max.labels(**lv).set(self.core.max_blocks)
        self.prom.kv_tpb.labels(**lv).set(shape.tokens_per_block)
        self.prom.gpu_mem.labels(**lv).set(cost_model.gpu_memory_used_bytes(shape))
        self.prom.max_active.labels(**lv).set(shape.max_batch_size)

    # --- engine loop ----------------------------------------------------------------------

    async def engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
            result = self.core.step()
            # Chain deadlines so that sleep overshoot does not accumulate, but never run more
            # than 50 ms of iterations back to back to catch up after a stall.
            deadline = max(deadline, loop.time() - 0.05) + result.duration_s / self.speedup
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(result)

    def _deliver(self, result: IterationResult) -> None:
        self.stats.append(result.stats)
        self.prom.iteration(result.stats)
        channels = self._channels
        for tok in result.tokens:
            ch = channels.get(tok.request_id)
            if ch is not None:
                ch.tokens.append(tok)
                ch.event.set()
        for f in result.finished:
            self.prom.finished(f)
            ch = channels.get(f.request_id)
            if ch is not None:
                ch.finished = f
                ch.event.set()

    def _submit(self, spec: GenerationRequest) -> _Channel:
        self.core.add_request(spec)  # RequestRejected → 400 by the caller
        ch = _Channel()
        self._channels[spec.request_id] = ch
        self._wake.set()
        return ch

    def _release(self, request_id: str, ch: _Channel) -> None:
        if ch.finished is None:
            self.core.abort(request_id)  # the client left: free its KV blocks
        self._channels.pop(request_id, None)

    # --- plain endpoints --------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.ready and not self.draining:
            return Response(status_code=200)
        return Response("LLM is unavailable (stand-in draining).", status_code=503)

    async def health_generate(self, request: Request) -> Response:
        if not self.ready or self.draining:
            return Response("Generation health check failed: draining", status_code=503)
        request_id = f"health-{uuid.uuid4().hex}"
        self.inflight += 1
        ch: _Channel | None = None
        try:
            ch = self._submit(
                GenerationRequest(request_id, "<|user|>\nhi\n<|assistant|>\n", max_tokens=1)
            )
            finished: Finished | None = None
            while finished is None:
                _, finished = await ch.next_batch()
            return Response("Generation health check OK", status_code=200)
        except RequestRejected as exc:
            return Response(f"Generation health check failed: {exc}", status_code=500)
        finally:
            if ch is not None:
                self._release(request_id, ch)
            self.inflight -= 1

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": f"stand-in {STANDIN_VERSION}"})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.settings.served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tensorrt_llm",
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, request: Request) -> Response:
        # Like trtllm-serve: iteration stats since the last read, and reading empties them.
        out = list(self.stats)
        self.stats.clear()
        return JSONResponse(out)

    async def prometheus(self, request: Request) -> Response:
        lv = self.prom.labels
        used = self.core.used_blocks
        self.prom.running.labels(**lv).set(self.core.num_active)
        self.prom.waiting.labels(**lv).set(self.core.num_waiting)
        self.prom.kv_util.labels(**lv).set(used / self.core.max_blocks)
        self.prom.kv_used.labels(**lv).set(used)
        self.prom.kv_free.labels(**lv).set(self.core.max_blocks - used)
        return Response(generate_latest(self.prom.registry), media_type=CONTENT_TYPE_LATEST)

    # --- generation ---------------------------------------------------------------------------

    async def _body(self, request: Request, model: type[_Sampling]) -> _Sampling | Response:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "request body is not valid JSON")
        if not isinstance(raw, dict):
            return error_response(400, "request body must be a JSON object")
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            return error_response(400, message, param)

    async def completions(self, request: Request) -> Response:
        if not self.ready or self.draining:
            return error_response(503, "the engine is shutting down")
        body = await self._body(request, CompletionBody)
        if isinstance(body, Response):
            return body
        assert isinstance(body, CompletionBody)
        text, token_count = body.prompt_text()
        return await self._generate(body, text, token_count, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        if not self.ready or self.draining:
            return error_response(503, "the engine is shutting down")
        body = await self._body(request, ChatBody)
        if isinstance(body, Response):
            return body
        assert isinstance(body, ChatBody)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(body, body.prompt_text(), None, max_tokens, chat=True)

    async def _generate(
        self,
        body: _Sampling,
        prompt: str,
        prompt_tokens: int | None,
        max_tokens: int | None,
        *,
        chat: bool,
    ) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        spec = GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stop=body.stops(),
            ignore_eos=body.ignore_eos,
            seed=body.seed,
        )
        try:
            ch = self._submit(spec)
        except RequestRejected as exc:
            return error_response(400, str(exc))
        self.inflight += 1
        created = int(time.time())
        if body.stream:
            opts = body.stream_options
            stream = self._stream(
                request_id,
                ch,
                created,
                prompt_tokens=prompt_tokens or count_tokens(prompt),
                chat=chat,
                include_usage=bool(opts and opts.include_usage),
                continuous_usage=bool(opts and opts.continuous_usage_stats),
            )
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            parts: list[str] = []
            finished: Finished | None = None
            while finished is None:
                batch, finished = await ch.next_batch()
                parts.extend(t.text for t in batch)
        finally:
            self._release(request_id, ch)
            self.inflight -= 1
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finished.finish_reason, stop_reason=None)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.settings.served_model,
                "choices": [choice],
                "usage": _usage(finished.prompt_tokens, finished.completion_tokens),
            }
        )

    async def _stream(
        self,
        request_id: str,
        ch: _Channel,
        created: int,
        *,
        prompt_tokens: int,
        chat: bool,
        include_usage: bool,
        continuous_usage: bool,
    ) -> AsyncIterator[bytes]:
        # Chunks are formatted by hand: at a few thousand tokens per second json.dumps of whole
        # dicts would cost the server more than the simulated GPU does.
        obj = "chat.completion.chunk" if chat else "text_completion"
        model = json.dumps(self.settings.served_model)
        head = f'data: {{"id":"{request_id}","object":"{obj}","created":{created},"model":{model},'
        key = '"delta":{"content":' if chat else '"text":'
        close = "}" if chat else ""
        produced = 0
        try:
            if chat:
                yield (
                    head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                    '"logprobs":null,"finish_reason":null}]}\n\n'
                ).encode()
            finished: Finished | None = None
            while finished is None:
                batch, finished = await ch.next_batch()
                out = []
                for i, tok in enumerate(batch):
                    produced += 1
                    last = finished is not None and i == len(batch) - 1
                    reason = f'"{finished.finish_reason}"' if last and finished else "null"
                    usage = ""
                    if continuous_usage:
                        usage = ',"usage":' + json.dumps(_usage(prompt_tokens, produced))
                    out.append(
                        f'{head}"choices":[{{"index":0,{key}{json.dumps(tok.text)}{close},'
                        f'"logprobs":null,"finish_reason":{reason}}}]{usage}}}\n\n'
                    )
                if out:
                    yield "".join(out).encode()
            if include_usage:
                usage = json.dumps(_usage(finished.prompt_tokens, finished.completion_tokens))
                yield f'{head}"choices":[],"usage":{usage}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
        finally:
            self._release(request_id, ch)
            self.inflight -= 1


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The stand-in handles SIGTERM/SIGINT itself (drain, then exit 0). uvicorn's own
        # handling would re-raise the signal after shutdown, ending the process by SIGTERM.
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """Bound, not listening: connections are refused until the engine is loaded."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    # proto must be IPPROTO_TCP (not 0): asyncio turns Nagle off only on such sockets, and with
    # Nagle on, a keep-alive stream's first token waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def serve(settings: Settings, sock: socket.socket) -> int:
    server = StandinServer(settings)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    load_wall = settings.load_s / settings.speedup
    shape = settings.core.shape
    log.info(
        "stand-in loading %s %s on %d × %s (tp %d, pp %d) for %.2f s; KV cache %d tokens",
        shape.model.name,
        shape.precision,
        shape.gpus,
        shape.gpu.name,
        shape.tp_size,
        shape.pp_size,
        load_wall,
        cost_model.kv_capacity_tokens(shape),
    )
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=load_wall)
    if stop.is_set():
        log.info("stand-in stopped while loading")
        return 0

    config = uvicorn.Config(
        server.app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,  # trtllm-serve's TIMEOUT_KEEP_ALIVE
        timeout_graceful_shutdown=2,
    )
    web = _UvicornServer(config)
    engine = asyncio.create_task(server.engine_loop(), name="engine-loop")
    engine.add_done_callback(lambda task: _engine_died(task, stop))
    web_task = asyncio.create_task(web.serve(sockets=[sock]), name="uvicorn")
    while not web.started and not web_task.done():
        await asyncio.sleep(0.01)
    server.ready = True
    log.info("stand-in serving %s on %s:%d", settings.served_model, settings.host, settings.port)

    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, web_task}, return_when=asyncio.FIRST_COMPLETED)
    if stopped.done():
        server.draining = True
        log.info("stand-in draining %d request(s)", server.inflight)
        deadline = loop.time() + settings.drain_s
        while server.core.has_work() and not engine.done() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        # The engine is idle: give the handlers a moment to send their last chunks.
        flush = min(deadline, loop.time() + 1.0)
        while server.inflight and loop.time() < flush:
            await asyncio.sleep(0.02)
        if server.inflight or server.core.has_work():
            log.warning("stand-in drain bound reached; dropping %d request(s)", server.inflight)
        web.should_exit = True
    else:
        stopped.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await web_task
    failed = engine.done() and not engine.cancelled() and engine.exception() is not None
    engine.cancel()
    with contextlib.suppress(BaseException):
        await engine
    log.info("stand-in stopped")
    return 1 if failed else 0


def _engine_died(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("stand-in engine loop failed", exc_info=task.exception())
        stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on an unknown or malformed flag
    level = {"internal_error": "CRITICAL", "verbose": "DEBUG", "trace": "DEBUG"}.get(
        args.log_level, args.log_level.upper()
    )
    logging.basicConfig(level=level, format="[%(asctime)s] %(levelname)s %(message)s")
    try:
        settings = build_settings(args, os.environ)
    except ConfigError as exc:
        print(f"stand-in: {exc}", file=sys.stderr)
        return 1
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"stand-in: failed to bind {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    with sock:
        return asyncio.run(serve(settings, sock))


if __name__ == "__main__":
    sys.exit(main())
