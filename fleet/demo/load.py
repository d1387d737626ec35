"""The demo's clients: an open-loop replay of the arrivals through the router.

Open loop: each request leaves at its scheduled time whatever happened to the ones before (a
closed loop would slow down with the fleet and hide the overload). Each is a streaming
completion (ignore_eos: exactly the arrival's output tokens) with a prompt of the arrival's
length (filler text, 4 characters a token: the stand-in's tokenizer); the time to its first
byte and to its end are recorded. Every request carries the demo tenant's client key
(`Authorization: Bearer fk_…`): the router requires one. Runs on its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from fleet.demo.plan import Arrival


@dataclass
class Result:
    sent_at: float  # seconds since the replay started
    scheduled_at: float
    status: int  # HTTP status; 0: no answer (connection error, timeout)
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.latency_s is not None


class Replay:
    def __init__(
        self,
        router_url: str,
        model: str,
        arrivals: Sequence[Arrival],
        client_key: str,
        timeout_s: float = 120,
    ) -> None:
        self.url = f"{router_url.rstrip('/')}/v1/completions"
        self.model = model
        self._headers = {"Authorization": f"Bearer {client_key}"}
        self.arrivals = list(arrivals)
        self.timeout_s = timeout_s
        self.results: list[Result] = []
        self.started: float | None = None  # time.monotonic() at the replay's zero
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="demo-load", daemon=True)
        self._stop = threading.Event()
        self.done = threading.Event()

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 10)

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def snapshot(self) -> list[Result]:
        with self.lock:
            return list(self.results)

    def _run(self) -> None:
        asyncio.run(self._main())
        self.done.set()

    async def _main(self) -> None:
        assert self.started is not None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=self._headers
        ) as http:
            tasks: list[asyncio.Task[None]] = []
            for i, arrival in enumerate(self.arrivals):
                if self._stop.is_set():
                    break
                delay = arrival.at_s - self.elapsed()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(http, i, arrival)))
            while tasks and not self._stop.is_set():
                _, pending = await asyncio.wait(tasks, timeout=0.5)
                tasks = list(pending)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, http: aiohttp.ClientSession, i: int, arrival: Arrival) -> None:
        # A unique head: no two prompts share a cached prefix.
        prompt = f"request {i}: " + "x" * max(0, 4 * arrival.prompt_tokens - 16)
        body = {
            "model": arrival.deployment or self.model,
            "prompt": prompt,
            "max_tokens": arrival.output_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        result = Result(sent_at=self.elapsed(), scheduled_at=arrival.at_s, status=0)
        began = time.monotonic()
        try:
            async with http.post(self.url, json=body) as reply:
                result.status = reply.status
                async for chunk in reply.content.iter_any():
                    if result.ttft_s is None:
                        result.ttft_s = time.monotonic() - began
                    result.output_tokens += chunk.count(b"data: {")
                if reply.status == 200:
                    result.latency_s = time.monotonic() - began
        except (aiohttp.ClientError, TimeoutError):
            result.status = 0
        with self.lock:
            self.results.append(result)
