"""The stand-in's HTTP server: an engine's API (trtllm-serve's, vLLM's or SGLang's dialect,
dialect.py) over the simulated engine (EngineCore, in simulated time), its engine loop, its
lifecycle (bound at once, listening once "loaded", a bounded drain on SIGTERM), main() for
trtllm-serve's command line and run() for every dialect's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import uvicorn
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet_agent.engine.core import (
    EngineCore,
    Finished,
    GenerationRequest,
    IterationResult,
    RequestRejected,
    TokenOut,
)
from fleet_agent.engine.standin.dialect_metrics import SglangMetrics, VllmMetrics
from fleet_agent.engine.standin.openai_schemas import (
    ChatBody,
    CompletionBody,
    PriorityChatBody,
    PriorityCompletionBody,
    SamplingBody,
    validation_message,
)
from fleet_agent.engine.standin.power import PowerMeter
from fleet_agent.engine.standin.prometheus_metrics import PromMetrics
from fleet_agent.engine.standin.settings import ConfigError, Settings, build_parser, build_settings
from fleet_agent.engine.standin.weights import (
    BEHAVIOUR_FILE,
    Behaviour,
    WeightsError,
    find_weights,
    read_all,
    read_mb_s,
)
from fleet_agent.telemetry import sim_gpu_state
from fleet_core import cost_model, power_model
from fleet_core.gpus import MIB
from fleet_core.tokens import count_tokens

STANDIN_VERSION = "0.1.0"
STATS_BUFFER = 1000  # iteration stats kept for /metrics between reads
POWER_REPORT_S = 0.5  # wall seconds between power reports (and power-limit reads)
log = logging.getLogger("standin")


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
        gpu = settings.core.shape.gpu
        self.power = PowerMeter(power_model.idle_power_w(gpu), self.sim_now())
        self._limits_key: int | None = None
        self._energy_j = 0.0  # what the energy counters already count
        self.stats: deque[dict[str, Any]] = deque(maxlen=STATS_BUFFER)
        self.prom = PromMetrics()
        self.dialect = settings.dialect
        # The vLLM or SGLang dialect's own /metrics families (trtllm's are self.prom's).
        self.engine_metrics: VllmMetrics | SglangMetrics | None = None
        if self.dialect.engine == "vllm":
            self.engine_metrics = VllmMetrics(settings.served_model)
        elif self.dialect.engine == "sglang" and self.dialect.metrics:
            self.engine_metrics = SglangMetrics(settings.served_model)
        lenient = self.dialect.engine != "trtllm"  # vLLM and SGLang ignore unknown fields
        self._completion_body = PriorityCompletionBody if lenient else CompletionBody
        self._chat_body = PriorityChatBody if lenient else ChatBody
        self.ready = False
        self.draining = False
        self.inflight = 0
        self._channels: dict[str, _Channel] = {}
        self._wake = asyncio.Event()
        weights = settings.weights
        self.behaviour = weights.behaviour if weights is not None else Behaviour()
        self._error_debt = 0.0  # "errors": every request adds the share, a whole one fails
        self._rng = random.Random()
        self._init_gauges()
        self.app = Starlette(routes=self._routes())

    def _routes(self) -> list[Route]:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        engine = self.dialect.engine
        if engine in ("trtllm", "sglang"):
            routes.append(Route("/health_generate", self.health_generate, methods=["GET"]))
        if engine in ("trtllm", "vllm"):
            routes.append(Route("/version", self.version, methods=["GET"]))
        if engine == "sglang":
            routes.append(Route("/get_model_info", self.model_info, methods=["GET"]))
        if engine == "trtllm":
            routes.append(Route("/metrics", self.metrics, methods=["GET"]))
            routes.append(Route("/prometheus/metrics", self.prometheus, methods=["GET"]))
        elif self.engine_metrics is not None:
            routes.append(Route("/metrics", self.engine_prometheus, methods=["GET"]))
        return routes

    def sim_now(self) -> float:
        return self._epoch0 + (time.monotonic() - self._mono0) * self.speedup

    def _init_gauges(self) -> None:
        lv = self.prom.labels
        shape = self.settings.core.shape
        self.prom.kv_max.labels(**lv).set(self.core.max_blocks)
        self.prom.kv_tpb.labels(**lv).set(shape.tokens_per_block)
        self.prom.gpu_mem.labels(**lv).set(cost_model.gpu_memory_used_bytes(shape))
        self.prom.max_active.labels(**lv).set(shape.max_batch_size)
        for index in self.settings.gpu_indexes:
            self.prom.gpu_power.labels(**lv, gpu=str(index)).set(self.power.idle_w)
            self.prom.gpu_power_limit.labels(**lv, gpu=str(index)).set(shape.gpu.tdp_w)

    # --- engine loop ----------------------------------------------------------------------

    async def engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
            started = self.sim_now()
            result = self.core.step()
            self.power.iteration(started, result.duration_s, result.power_w, result.capped)
            # Chain deadlines so that sleep overshoot does not accumulate, but never run more
            # than 50 ms of iterations back to back to catch up after a stall.
            wall = result.duration_s * self.behaviour.slow / self.speedup
            deadline = max(deadline, loop.time() - 0.05) + wall
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(result)

    # --- power ----------------------------------------------------------------------------------

    async def power_loop(self) -> None:
        """Every POWER_REPORT_S: the power limit in, the GPUs' power out."""
        while True:
            self.report_power()
            await asyncio.sleep(POWER_REPORT_S)

    def report_power(self) -> None:
        """Read the simulated GPUs' limits (when the file changed), publish the power drawn
        since the last report on /prometheus/metrics and in the shared state."""
        settings, lv = self.settings, self.prom.labels
        shape = settings.core.shape
        state_dir = settings.gpu_state_dir
        if state_dir is not None:
            key = sim_gpu_state.limits_mtime_ns(state_dir)
            if key != self._limits_key:
                self._limits_key = key
                limits = sim_gpu_state.read_limits(state_dir)
                # A TP group runs at the pace of its most limited GPU.
                mine = [limits[g] for g in settings.gpu_indexes if g in limits]
                limit = power_model.clamp_limit_w(shape.gpu, min(mine)) if mine else None
                if limit != self.core.power_limit_w:
                    log.info("stand-in power limit: %s W per GPU", limit or shape.gpu.tdp_w)
                self.core.power_limit_w = limit
        reading = self.power.read(self.sim_now())
        enforced = power_model.clamp_limit_w(shape.gpu, self.core.power_limit_w)
        for index in settings.gpu_indexes:
            gpu = str(index)
            self.prom.gpu_power.labels(**lv, gpu=gpu).set(reading.power_w)
            self.prom.gpu_power_limit.labels(**lv, gpu=gpu).set(enforced)
            self.prom.gpu_energy.labels(**lv, gpu=gpu).inc(self.power.energy_j - self._energy_j)
        self._energy_j = self.power.energy_j
        if state_dir is None:
            return
        activity = sim_gpu_state.GpuActivity(
            at=time.time(),
            power_w=reading.power_w,
            busy=reading.busy,
            memory_used_mib=cost_model.gpu_memory_used_bytes(shape) // MIB,
            capped=reading.capped,
        )
        for index in settings.gpu_indexes:
            try:
                sim_gpu_state.write_activity(state_dir, index, activity)
            except OSError as exc:
                log.warning("stand-in cannot report GPU %d's power: %s", index, exc)

    def _deliver(self, result: IterationResult) -> None:
        self.stats.append(result.stats)
        self.prom.iteration(result.stats)
        metrics = self.engine_metrics
        if metrics is not None:
            metrics.iteration(result)
        channels = self._channels
        for tok in result.tokens:
            ch = channels.get(tok.request_id)
            if ch is not None:
                ch.tokens.append(tok)
                ch.event.set()
        for f in result.finished:
            self.prom.finished(f)
            if metrics is not None:
                metrics.finished(f)
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
        if self.dialect.engine == "trtllm":
            return Response("LLM is unavailable (stand-in draining).", status_code=503)
        return Response(status_code=503)

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
        if self.dialect.engine == "trtllm":
            return JSONResponse({"version": f"stand-in {STANDIN_VERSION}"})
        return JSONResponse({"version": self.dialect.version})

    async def models(self, request: Request) -> Response:
        owner = {"trtllm": "tensorrt_llm", "vllm": "vllm", "sglang": "sglang"}
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": owner[self.dialect.engine],
            }
            for name in self.settings.served_models or (self.settings.served_model,)
        ]
        if self.dialect.engine != "trtllm":
            for card in cards:  # vLLM's and SGLang's ModelCard carry these too
                card["root"] = self.settings.served_model
                card["max_model_len"] = self.core.max_seq_len
        return JSONResponse({"object": "list", "data": cards})

    async def model_info(self, request: Request) -> Response:
        # SGLang's /get_model_info (the fields the stand-in can fill).
        return JSONResponse(
            {
                "model_path": self.settings.served_model,
                "tokenizer_path": self.settings.served_model,
                "is_generation": True,
            }
        )

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
        text = generate_latest(self.prom.registry) + generate_latest(self.prom.power_registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def engine_prometheus(self, request: Request) -> Response:
        """vLLM's or SGLang's /metrics: its families, then the stand-in's power."""
        metrics = self.engine_metrics
        assert metrics is not None
        metrics.refresh(self.core)
        text = generate_latest(metrics.registry) + generate_latest(self.prom.power_registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # --- generation ---------------------------------------------------------------------------

    async def _body(self, request: Request, model: type[SamplingBody]) -> SamplingBody | Response:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self.dialect.invalid("request body is not valid JSON")
        if not isinstance(raw, dict):
            return self.dialect.invalid("request body must be a JSON object")
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            message, param = validation_message(exc)
            return self.dialect.invalid(message, param)

    def _bad_version_error(self) -> Response | None:
        """A bad version's share of failures (fleet-standin.json "errors"), spread evenly."""
        share = self.behaviour.errors
        if not share:
            return None
        self._error_debt += share
        if self._error_debt < 1.0:
            return None
        self._error_debt -= 1.0
        # The engine's own shape for a failed generation (dialect.py).
        message = f"stand-in bad version: {BEHAVIOUR_FILE} says errors={share:g}"
        return self.dialect.error(500, message)

    async def completions(self, request: Request) -> Response:
        if not self.ready or self.draining:
            return self.dialect.error(503, "the engine is shutting down")
        if (failed := self._bad_version_error()) is not None:
            return failed
        body = await self._body(request, self._completion_body)
        if isinstance(body, Response):
            return body
        assert isinstance(body, CompletionBody)
        text, token_count = body.prompt_text()
        return await self._generate(body, text, token_count, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        if not self.ready or self.draining:
            return self.dialect.error(503, "the engine is shutting down")
        if (failed := self._bad_version_error()) is not None:
            return failed
        body = await self._body(request, self._chat_body)
        if isinstance(body, Response):
            return body
        assert isinstance(body, ChatBody)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(body, body.prompt_text(), None, max_tokens, chat=True)

    async def _generate(
        self,
        body: SamplingBody,
        prompt: str,
        prompt_tokens: int | None,
        max_tokens: int | None,
        *,
        chat: bool,
    ) -> Response:
        refused = self._check_request(body)
        if refused is not None:
            return refused
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        spec = GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stop=body.stops(),
            ignore_eos=body.ignore_eos,
            # A bad version's "wrong_answers": greedy decoding no longer gives the same text.
            seed=self._rng.getrandbits(31) if self.behaviour.wrong_answers else body.seed,
            priority=self.dialect.priority_key(getattr(body, "priority", None)),
        )
        try:
            ch = self._submit(spec)
        except RequestRejected as exc:
            return self.dialect.error(400, str(exc))
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

    def _check_request(self, body: SamplingBody) -> Response | None:
        """What the engine refuses before scheduling: vLLM, a model it does not serve
        (serving_engine._check_model, 404; none or "" means the served one) and a priority
        without the priority policy; SGLang, a request past --max-queued-requests (503)."""
        dialect = self.dialect
        served = self.settings.served_models or (self.settings.served_model,)
        if dialect.check_model and body.model and body.model not in served:
            return dialect.error(404, f"The model `{body.model}` does not exist.", "model")
        if dialect.refuse_priority and getattr(body, "priority", None):
            return dialect.error(
                400, "Priority scheduling is not enabled (--scheduling-policy priority)."
            )
        if dialect.max_queued is not None and self.core.num_waiting >= dialect.max_queued:
            return dialect.error(503, "The request queue is full.")
        return None

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

    if settings.weights is not None:
        read = await _read_weights(settings, stop)
        if read is None:
            log.info("stand-in stopped while reading its weights")
            return 0
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
    power = asyncio.create_task(server.power_loop(), name="power-loop")
    power.add_done_callback(lambda task: _engine_died(task, stop))
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
    failed = any(
        task.done() and not task.cancelled() and task.exception() is not None
        for task in (engine, power)
    )
    for task in (engine, power):
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
    log.info("stand-in stopped")
    return 1 if failed else 0


async def _read_weights(settings: Settings, stop: asyncio.Event) -> tuple[int, float] | None:
    """Read the checkpoint's files once (real I/O: load time follows the disk); None when
    stopped meanwhile. A file that cannot be read ends the stand-in (WeightsError)."""
    weights = settings.weights
    assert weights is not None
    log.info(
        "stand-in reading %d file(s), %.1f MB, of %s%s",
        len(weights.files),
        weights.bytes / 1e6,
        weights.path,
        f" at most {settings.read_mb_s:g} MB/s" if settings.read_mb_s else "",
    )
    if weights.behaviour.bad:
        log.warning(
            "stand-in BAD VERSION (%s in %s): %s",
            BEHAVIOUR_FILE,
            weights.path,
            weights.behaviour.describe(),
        )
    halt = threading.Event()
    reading = asyncio.ensure_future(asyncio.to_thread(read_all, weights, settings.read_mb_s, halt))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not reading.done():
        halt.set()
        with contextlib.suppress(Exception):
            await reading
        return None
    stopping.cancel()
    done, seconds = reading.result()
    log.info(
        "stand-in read %.1f MB in %.2f s (%.0f MB/s)",
        done / 1e6,
        seconds,
        done / 1e6 / max(seconds, 1e-9),
    )
    return done, seconds


def _engine_died(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("stand-in %s failed", task.get_name(), exc_info=task.exception())
        stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    """trtllm-serve's dialect (`python -m fleet_agent.engine.standin`)."""
    args = build_parser().parse_args(argv)  # exits 2 on an unknown or malformed flag
    return run(args.model, args.log_level, lambda env: build_settings(args, env))


def run(model: str, log_level: str, build: Callable[[Mapping[str, str]], Settings]) -> int:
    """Configure (`build` turns the environment into Settings), load, serve, drain: every
    dialect's main after its command line is parsed."""
    level = {"internal_error": "CRITICAL", "verbose": "DEBUG", "trace": "DEBUG"}.get(
        log_level, log_level.upper()
    )
    logging.basicConfig(level=level, format="[%(asctime)s] %(levelname)s %(message)s")
    try:
        settings = build(os.environ)
        settings = dataclasses.replace(
            settings,
            weights=find_weights(model, os.environ),
            read_mb_s=read_mb_s(os.environ),
        )
    except (ConfigError, WeightsError) as exc:
        print(f"stand-in: {exc}", file=sys.stderr)
        return 1
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"stand-in: failed to bind {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    with sock:
        try:
            return asyncio.run(serve(settings, sock))
        except WeightsError as exc:
            print(f"stand-in: {exc}", file=sys.stderr)
            return 1
