"""The router's HTTP front: OpenAI-compatible, an aiohttp server with its own forwarding client.

The server is aiohttp's. Forwarding goes through `upstream.py`, a small keep-alive HTTP/1.1
client on asyncio protocols and httptools: on this machine an httpx-based proxy measured ten
times slower than an aiohttp one (docs/performance.md), and aiohttp's ClientSession was still
about half of the router's CPU per request (bench/router_overhead.py). aiohttp's
ClientSession remains for the polls and the load reports.

Per request: the body is read once and forwarded unchanged, but for the class's priority field
of engines that schedule by priority (priority.py; `pass_priority` off: never); `model` selects
the deployment; `x-fleet-priority: interactive|batch` (default interactive) its class in the
waiting room and in the engine. The
deployment's strategy picks a replica (or the request waits; 429 + Retry-After when the room
is full). Connect errors and 503s before the first byte go to another replica (at most
`attempts` in all); once a byte has reached the client the request stays where it is. SSE
streams pass through chunk by chunk; the time to the first chunk is the TTFT.

Callers (callers.py, limits.py): with `client_auth` keys, a request needs a client key
(`Authorization: Bearer fk_…`, else 401); its key's per-minute limits over the rate window and
its tenant's concurrency share of a contended deployment turn it away with 429 + Retry-After.
The tenant labels the metrics and the request log (logger `fleet.router.requests`: one line per
request with tenant, key id, deployment, status and duration; never the key).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fleet.router import callers as callers_source
from fleet.router.admission import PRIORITIES, Priority
from fleet.router.callers import ANONYMOUS_CALLER, Caller, Callers
from fleet.router.config import RouterSettings
from fleet.router.discovery import WorkerView, client_tls
from fleet.router.limits import KeyLimits, RateLimiter, over_share, share_slots
from fleet.router.metrics import RouterMetrics
from fleet.router.pool import DeploymentPool, NoReplica, QueueFull, Ticket
from fleet.router.prefix import request_blocks
from fleet.router.priority import with_priority
from fleet.router.strategy import Request
from fleet.router.tokens import max_output, prompt_tokens
from fleet.router.upstream import Response as UpstreamResponse
from fleet.router.upstream import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)
requests_log = logging.getLogger("fleet.router.requests")
PRIORITY_HEADER = "x-fleet-priority"


def openai_error(
    status: int, message: str, kind: str, *, retry_after: int | None = None
) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def unauthenticated(message: str) -> web.Response:
    error = {"message": message, "type": "authentication_error", "param": None, "code": 401}
    return web.json_response({"error": error}, status=401, headers={"WWW-Authenticate": "Bearer"})


_NOBODY = Caller(KeyLimits(key_id=""), name="", tenant="-")  # a 401's line in the request log


class _Retry(Exception):
    """The replica failed before the first byte: try another."""


class _Used:
    """The output tokens a successful try wrote (for the key's token count)."""

    __slots__ = ("tokens",)

    def __init__(self) -> None:
        self.tokens = 0


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.http: aiohttp.ClientSession | None = None  # polls and reports
        self.upstream: UpstreamClient | None = None  # forwarding
        self.view: WorkerView | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._report_refused = False
        # The first routing-table read (and callers read, with keys) is over, done or failed
        self.polled = asyncio.Event()
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.keys = settings.client_auth == "keys"
        self.callers = Callers()
        self.callers_ok = not self.keys  # /readyz waits for the first callers read
        if self.keys:
            self.metrics.tenants = ()  # the callers' tenants, once read
        self.limiter = RateLimiter(settings.rate_window_s)
        self.held: dict[tuple[str, str], int] = {}  # (deployment, tenant) -> in flight + waiting
        self._first_reads = {"fleet", "callers"} if self.keys else {"fleet"}

    # -- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/state", self.state)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        s = self.settings
        tls = client_tls(s)  # verifies every https peer; never turned off
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, ssl=tls)
        self.http = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.upstream = UpstreamClient(
            connect_timeout_s=s.connect_timeout_s,
            total_timeout_s=s.request_timeout_s,
            ssl_context=tls,
        )
        self.view = WorkerView(s, self.http)
        self.view.on_change = self._views_changed
        self._tasks = [
            asyncio.create_task(self._every(s.fleet_poll_s, self.view.poll_fleet, "fleet")),
            asyncio.create_task(self._every(s.agent_poll_s, self.view.poll_agents, "agents")),
        ]
        if self.keys:
            self._tasks.append(
                asyncio.create_task(self._every(s.fleet_poll_s, self._poll_callers, "callers"))
            )
        if s.report_s > 0 and s.token is not None:
            self._tasks.append(asyncio.create_task(self._every(s.report_s, self._report, "report")))

    async def _stop(self, _: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.close()
        if self.upstream is not None:
            await self.upstream.close()

    async def _every(self, interval: float, poll: Any, what: str) -> None:
        failing = False
        while True:
            started = time.monotonic()
            try:
                await poll()
                if failing:
                    log.info("router: %s poll works again", what)
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep polling: the view stays as it was
                if not failing:
                    log.warning("router: %s poll failed: %s", what, exc)
                failing = True
            if what in ("fleet", "callers"):
                self._first_reads.discard(what)
                if not self._first_reads:
                    self.polled.set()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _poll_callers(self) -> None:
        """The client keys and tenants, from the callers file or the fleet."""
        s = self.settings
        if s.callers_file is not None:
            callers = callers_source.read_file(s.callers_file)
        else:
            assert self.http is not None
            token = s.token.get_secret_value() if s.token is not None else None
            callers = await callers_source.fetch(self.http, s.fleet_url, token)
        self.callers = callers
        self.limiter.forget(callers.ids())
        tenants = tuple(sorted({c.tenant for c in callers.by_hash.values()}))
        if tenants != self.metrics.tenants:
            self.metrics.tenants = tenants
            for pool in self.view.pools.values() if self.view else []:
                self.metrics.pool(pool)
        self.callers_ok = True

    async def _report(self) -> None:
        """POST the load per deployment to the fleet (autoscaler signals)."""
        assert self.http is not None and self.view is not None and self.settings.token
        deployments: dict[str, dict[str, Any]] = {}
        for pool in self.view.pools.values():
            p95, ttft = self.metrics.p95s(pool.name)
            deployments[pool.name] = {
                "waiting": len(pool.queue),
                "p95_s": p95,
                "ttft_p95_s": ttft,
                # Per model version: what a rollout's analysis compares (fleet/rollout/)
                "versions": self.metrics.version_figures(pool.name, [pool.stable, pool.canary]),
            }
            # Demand counters (fleet/autoscaler/demand.py): 0 is a figure (nothing came).
            requests, tokens = self.metrics.arrivals.get(pool.name, (0, 0))
            deployments[pool.name].update(arrived=requests, arrived_tokens=tokens)
        url = f"{self.settings.fleet_url.rstrip('/')}/api/v1/routing/report"
        headers = {"Authorization": f"Bearer {self.settings.token.get_secret_value()}"}
        body: dict[str, Any] = {"router": self.identity, "deployments": deployments}
        if self.keys:
            # What this router admitted per limited key over its window: the fleet answers
            # with the other routers' sums, which count here against the same limits.
            usage = self.limiter.usage(time.monotonic())
            body["callers"] = {k: {"requests": r, "tokens": t} for k, (r, t) in usage.items()}
            body["window_s"] = self.settings.rate_window_s
        timeout = aiohttp.ClientTimeout(total=5)
        async with self.http.post(url, json=body, headers=headers, timeout=timeout) as reply:
            if reply.status == 200 and self.keys:
                self._take_others(await reply.json())
            if reply.status == 403 and not self._report_refused:
                self._report_refused = True
                log.warning(
                    "router: the fleet refuses load reports from this token (%s); the "
                    "autoscaler will not see this router's queue (use a router token)",
                    (await reply.text())[:200],
                )
            elif reply.status >= 400 and reply.status != 403:
                raise RuntimeError(f"POST {url}: HTTP {reply.status}")

    def _take_others(self, answer: Any) -> None:
        """The other routers' usage per key from the report's answer (none: an older fleet)."""
        others: dict[str, tuple[float, float]] = {}
        figures = answer.get("callers") if isinstance(answer, dict) else None
        for key_id, row in (figures or {}).items():
            if isinstance(row, dict):
                requests, tokens = row.get("requests"), row.get("tokens")
                if isinstance(requests, int | float) and isinstance(tokens, int | float):
                    others[str(key_id)] = (float(requests), float(tokens))
        peers = answer.get("routers") if isinstance(answer, dict) else None
        self.limiter.set_others(
            others, time.monotonic(), peers if isinstance(peers, int) and peers >= 0 else None
        )

    def _views_changed(self) -> None:
        assert self.view is not None
        for pool in self.view.pools.values():
            pool.refresh_versions()  # an agent said a replica restarted on another version
            pool.pump()  # a replica became ready: admit waiters
            self.metrics.pool(pool)

    # -- small endpoints ------------------------------------------------------------------

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        ok = self.view is not None and self.view.table_ok and self.callers_ok
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def prometheus(self, _: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, _: web.Request) -> web.Response:
        names = sorted(self.view.by_model) if self.view else []
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "fleet"} for n in names]
        return web.json_response({"object": "list", "data": data})

    async def state(self, _: web.Request) -> web.Response:
        """The router's view, for operators and tests."""
        pools = self.view.pools.values() if self.view else []
        return web.json_response(
            {
                "deployments": [
                    {
                        "deployment": p.name,
                        "models": sorted(p.models),
                        "strategy": p.strategy.name,
                        "engine": p.engine,
                        "priority_fields": {c: dict(p.priorities[c].fields) for c in PRIORITIES},
                        "queue": {c: p.queue.depth(c) for c in PRIORITIES},
                        "expected_output_tokens": round(p.estimate.value, 1),
                        "versions": {
                            "stable": p.stable or None,
                            "canary": p.canary or None,
                            "canary_weight": p.canary_weight,
                        },
                        "replicas": [
                            {
                                "url": r.url,
                                "server": r.server,
                                "gpu_model": r.gpu_model,
                                "ready": r.ready,
                                "inflight": r.inflight,
                                "limit": r.limit,
                                "queued": r.queued,
                                "running": r.running,
                                "kv_use": r.kv_use,
                                "capacity": round(r.capacity, 1),
                                "ejected": r.ejected_until > time.monotonic(),
                                "version": r.version or None,
                                "prefix": r.prefix.view(),
                            }
                            for r in p.replicas.values()
                        ],
                    }
                    for p in pools
                ]
            }
        )

    # -- the proxy ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=True)

    async def _proxy(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """Authenticate the caller, serve, and log one line (never the key)."""
        started = time.monotonic()
        caller = ANONYMOUS_CALLER
        status = "error"
        deployment = ""
        try:
            if self.keys:
                authorization = request.headers.get("Authorization")
                found = self.callers.authenticate(authorization)
                if found is None:
                    status, caller = "401", _NOBODY
                    return unauthenticated(
                        "unknown or revoked client key"
                        if authorization
                        else "a client key is required: Authorization: Bearer fk_…"
                    )
                caller = found
            response, deployment = await self._serve(request, chat, caller, started)
            status = str(response.status)
            return response
        finally:
            if requests_log.isEnabledFor(logging.INFO):
                requests_log.info(
                    "tenant=%s key=%s deployment=%s status=%s duration_s=%.3f",
                    caller.tenant,
                    caller.key_id or "-",
                    deployment or "-",
                    status,
                    time.monotonic() - started,
                )

    async def _serve(
        self, request: web.Request, chat: bool, caller: Caller, started: float
    ) -> tuple[web.StreamResponse, str]:
        """The response, and the deployment it was for ("" when none was found)."""
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            error = openai_error(400, "the body must be a JSON object", "invalid_request_error")
            return error, ""
        model = body.get("model")
        pool = self.view.by_model.get(model) if self.view and isinstance(model, str) else None
        if pool is None or not isinstance(model, str):
            served = ", ".join(sorted(self.view.by_model)) if self.view else ""
            error = openai_error(
                404,
                f"model {model!r} is not served here (served: {served or 'none'})",
                "invalid_request_error",
            )
            return error, ""
        priority_text = request.headers.get(PRIORITY_HEADER, "interactive").strip().lower()
        if priority_text not in PRIORITIES:
            error = openai_error(
                400,
                f"{PRIORITY_HEADER} must be interactive or batch, not {priority_text!r}",
                "invalid_request_error",
            )
            return error, pool.name
        priority: Priority = "interactive" if priority_text == "interactive" else "batch"
        fields = pool.priorities[priority]
        raw = with_priority(
            raw, body, fields if self.settings.pass_priority else fields.without_fields()
        )
        cost = Request(
            model=model,
            prompt_tokens=prompt_tokens(body, chat),
            expected_output=pool.estimate.expected(max_output(body)),
            blocks=request_blocks(body, chat),
        )
        self.metrics.arrived(pool.name, cost.prompt_tokens + cost.expected_output)
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        s = self.settings
        status = "error"
        version = ""  # of the replica that answered
        tenant, limits = caller.tenant, caller.limits
        charged = 0.0  # the tokens counted against the key at admission
        used = _Used()
        held_key = (pool.name, tenant)
        held = self.held.get(held_key, 0)
        share = self.callers.share(tenant) if self.keys else 1.0
        if share < 1.0:
            slots = sum(r.limit for r in pool.replicas.values())
            if held >= share_slots(share, slots) and over_share(
                held, share, slots, _contended(pool)
            ):
                self.metrics.finished(pool.name, priority, "429", 0.0, "", tenant)
                error = openai_error(
                    429,
                    f"deployment {pool.name!r} is busy and tenant {tenant!r} holds its share "
                    f"({share:g} of {slots} slots)",
                    "rate_limit_error",
                    retry_after=s.retry_after_s,
                )
                return error, pool.name
        if limits.limited:
            refusal = self.limiter.check(limits, started)
            if refusal is not None:
                self.metrics.finished(pool.name, priority, "429", 0.0, "", tenant)
                error = openai_error(
                    429, refusal.message, "rate_limit_error", retry_after=refusal.retry_after_s
                )
                return error, pool.name
            charged = cost.prompt_tokens + cost.expected_output
            self.limiter.admit(limits, started, charged)
        self.held[held_key] = held + 1
        try:
            for attempt in range(s.attempts):
                self.metrics.queue_depth(pool)
                try:
                    ticket = await pool.acquire(
                        cost, priority, exclude=frozenset(tried), timeout=s.queue_timeout_s
                    )
                except QueueFull as exc:
                    status = "429"
                    error = openai_error(
                        429, str(exc), "rate_limit_error", retry_after=s.retry_after_s
                    )
                    return error, pool.name
                except NoReplica as exc:
                    status = "503"
                    if attempt and tried:
                        exc = NoReplica(f"{exc} (tried {len(tried)} that failed)")
                    wait = s.retry_after_s if exc.retry_after_s is None else exc.retry_after_s
                    error = openai_error(
                        503, str(exc), "service_unavailable", retry_after=max(1, round(wait))
                    )
                    return error, pool.name
                finally:
                    self.metrics.queue_depth(pool)
                self.metrics.inflight(pool, ticket.replica)
                try:
                    response = await self._forward(
                        request, raw, pool, ticket, stream, started, tenant, used
                    )
                except _Retry:
                    tried.add(ticket.replica.url)
                    continue
                status = str(response.status)
                version = ticket.replica.version
                return response, pool.name
            status = "503"
            error = openai_error(
                503,
                f"deployment {pool.name!r}: {len(tried)} replicas failed before answering",
                "service_unavailable",
                retry_after=s.retry_after_s,
            )
            return error, pool.name
        finally:
            now = time.monotonic()
            left = self.held.get(held_key, 1) - 1
            if left > 0:
                self.held[held_key] = left
            else:
                self.held.pop(held_key, None)
            if limits.limited:
                # What the request used: its prompt and output when answered, else nothing.
                actual = cost.prompt_tokens + used.tokens if status == "200" else 0
                self.limiter.settle(limits, now, actual - charged)
            self.metrics.finished(pool.name, priority, status, now - started, version, tenant)

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        pool: DeploymentPool,
        ticket: Ticket,
        stream: bool,
        started: float,
        tenant: str,
        used: _Used,
    ) -> web.StreamResponse:
        """One try on the ticket's replica. Raises _Retry when it failed before any byte
        reached the client; otherwise the response (complete, or a stream cut short)."""
        assert self.upstream is not None
        content_type = request.headers.get("Content-Type", "application/json")
        response: web.StreamResponse | None = None
        output_tokens, ok, failed = 0, False, False
        error = False  # the replica answered 5xx, or its stream broke off (per version)
        answered = False  # it answered at all (a client gone before that decides nothing)
        try:
            target = request.raw_path  # as the client sent it; absolute-form is rebuilt
            if not target.startswith("/"):
                target = request.path_qs
            upstream = await self.upstream.post(ticket.replica.url, target, raw, content_type)
            answered = True
            try:
                if upstream.status == 503:  # draining or overloaded: another replica may answer
                    failed = True
                    raise _Retry
                if (
                    stream
                    and upstream.status == 200
                    and upstream.content_type.startswith("text/event-stream")
                ):
                    response = web.StreamResponse(status=200, headers=upstream.headers)
                    await response.prepare(request)  # bytes are out: no retry from here on
                    output_tokens = await self._relay(
                        upstream, response, pool, ticket, started, tenant
                    )
                    await response.write_eof()
                    ok = True
                    return response
                error = upstream.status >= 500
                data = await upstream.read()
                # No TTFT here: a client that does not stream sees its first token with its
                # last, and that is the request's duration, not its time to first token.
                if upstream.status == 200:
                    output_tokens, ok = _completion_tokens(data), True
                return web.Response(body=data, status=upstream.status, headers=upstream.headers)
            finally:
                upstream.release()  # a whole answer frees the connection, any other closes it
        except ConnectionResetError:
            # Writing to a client that went away (aiohttp's ClientConnectionResetError is one):
            # not the replica's fault.
            if response is None:
                raise
            return response
        except UpstreamError as exc:
            if response is None:
                failed = True
                log.info("router: %s failed before answering: %s", ticket.replica.url, exc)
                raise _Retry from exc
            log.warning("router: stream from %s cut after it began: %s", ticket.replica.url, exc)
            error = True
            return response
        finally:
            pool.release(ticket, output_tokens=output_tokens, ok=ok, failed=failed)
            if answered or failed:
                self.metrics.attempt(pool.name, ticket.replica.version, error=failed or error)
            self.metrics.inflight(pool, ticket.replica)
            if ok:
                used.tokens = output_tokens
                self.metrics.output(pool.name, output_tokens)

    async def _relay(
        self,
        upstream: UpstreamResponse,
        response: web.StreamResponse,
        pool: DeploymentPool,
        ticket: Ticket,
        started: float,
        tenant: str,
    ) -> int:
        """Pass the SSE stream through chunk by chunk; count its events (one per token chunk)
        and take the usage figure when the engine sends one."""
        tokens = 0
        usage: int | None = None
        pending = b""
        first = True
        while chunk := await upstream.read_chunk():
            if first:
                elapsed = time.monotonic() - started
                self.metrics.ttft(pool.name, elapsed, ticket.replica.version, tenant)
                first = False
            await response.write(chunk)
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            seen = 0
            for event in events:
                if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
                    continue
                if b'"usage"' in event:
                    usage = _usage_tokens(event[6:]) or usage
                opening = b'"role"' in event
                closing = (
                    b'"finish_reason":null' not in event and b'"finish_reason": null' not in event
                )
                if (opening or closing) and not _has_text(event[6:]):
                    continue  # a chat stream's role chunk, or a last one with no token in it
                if b'"choices":[]' not in event and b'"choices": []' not in event:
                    seen += 1
            tokens += seen
            ticket.streamed(seen)
        return usage if usage is not None else tokens


def _contended(pool: DeploymentPool) -> bool:
    """Requests wait in the deployment's room, or no replica could take one more now."""
    if len(pool.queue):
        return True
    now = time.monotonic()
    return not any(
        r.ready and r.inflight < r.limit and r.ejected_until <= now for r in pool.replicas.values()
    )


def _usage_tokens(data: bytes) -> int | None:
    try:
        usage = json.loads(data).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


def _has_text(data: bytes) -> bool:
    try:
        choices = json.loads(data).get("choices") or []
    except (ValueError, AttributeError):
        return True
    return any(
        (c.get("delta") or {}).get("content") or c.get("text")
        for c in choices
        if isinstance(c, dict)
    )


def _completion_tokens(data: bytes) -> int:
    return _usage_tokens(data) or 0
