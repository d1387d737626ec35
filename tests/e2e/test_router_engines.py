"""The router's class reaches each engine as the engine's own request field.

A real `fleetctl router run --table FILE` in front of a CAPTURING UPSTREAM (an aiohttp server
in the test that keeps every body it receives and answers a one-token completion): what the
router forwards is read byte for byte. The table has one deployment per engine: trtllm (no
"engine" key: the default), vllm and sglang without "priority_fields" (the router takes the
engine's defaults from fleet_core/engines/), and a vllm deployment whose table entry says
what to add (the fleet's routing table always does; here: nothing, as for `scheduling_policy:
fcfs`). The stand-in's honouring of the field is bench/engine_priority.py's subject.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from threaded_app import ThreadedApp

from fleet.lab.harness import RouterProcess

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class CapturingUpstream(ThreadedApp):
    """A TEST DOUBLE of an engine: keeps (path, body bytes) of every POST, on its own loop."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[tuple[str, bytes]] = []

    async def _handle(self, request: web.Request) -> web.Response:
        self.bodies.append((request.path, await request.read()))
        return web.json_response(COMPLETION)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)


def row(name: str, upstream: CapturingUpstream, **extra: Any) -> dict[str, Any]:
    return {
        "deployment": name,
        "models": [name],
        "model_uri": f"s3://models/{name}",
        "tp_size": 1,
        "replicas": [{"server": f"srv-{name}", "gpu_model": "H100", "url": upstream.url}],
        **extra,
    }


@pytest.fixture
def upstream() -> Iterator[CapturingUpstream]:
    with CapturingUpstream() as up:
        yield up


def start_router(tmp: Path, upstream: CapturingUpstream, **settings: str) -> RouterProcess:
    table = tmp / "table.json"
    rows = [
        row("tr", upstream),
        row("vl", upstream, engine="vllm"),
        row("sg", upstream, engine="sglang"),
        row("fcfs", upstream, engine="vllm", priority_fields={"interactive": {}, "batch": {}}),
    ]
    table.write_text(json.dumps({"results": rows}))
    # About the priority field, not callers: explicitly unauthenticated.
    settings = {"FLEET_ROUTER_CLIENT_AUTH": "none", **settings}
    return RouterProcess(tmp / "router.log", settings, "--table", str(table))


def send(router: RouterProcess, raw: bytes, priority: str, *, chat: bool = False) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    reply = httpx.post(
        f"{router.url}{path}",
        content=raw,
        headers={"Content-Type": "application/json", "x-fleet-priority": priority},
        timeout=10,
    )
    assert reply.status_code == 200, reply.text


def body(model: str, **extra: Any) -> bytes:
    return json.dumps({"model": model, "prompt": "hello", "max_tokens": 1, **extra}).encode()


def test_each_engine_gets_its_own_priority_field_and_trtllm_bodies_pass_unchanged(
    upstream: CapturingUpstream, tmp_path: Path
) -> None:
    router = start_router(tmp_path, upstream)
    try:
        sent = [
            ("tr", body("tr"), "batch"),
            ("vl", body("vl"), "interactive"),
            ("vl", body("vl"), "batch"),
            ("sg", body("sg"), "batch"),
            ("fcfs", body("fcfs"), "batch"),
        ]
        for _, raw, priority in sent:
            send(router, raw, priority)
        forwarded = [b for _, b in upstream.bodies]
        assert len(forwarded) == len(sent)
        # trtllm-serve forbids unknown fields: its body is the client's, byte for byte; so is
        # the body of a deployment whose table entry adds nothing.
        assert forwarded[0] == sent[0][1]
        assert forwarded[4] == sent[4][1]
        # vLLM and SGLang (the agent starts SGLang lower-first, as vLLM): 0 interactive, 10 batch.
        assert json.loads(forwarded[1]) == {**json.loads(sent[1][1]), "priority": 0}
        assert json.loads(forwarded[2]) == {**json.loads(sent[2][1]), "priority": 10}
        assert json.loads(forwarded[3]) == {**json.loads(sent[3][1]), "priority": 10}
        # The chat route too, with the default class (no header: interactive).
        chat = json.dumps({"model": "sg", "messages": [{"role": "user", "content": "hi"}]})
        reply = httpx.post(f"{router.url}/v1/chat/completions", content=chat, timeout=10)
        assert reply.status_code == 200
        path, raw = upstream.bodies[-1]
        assert path == "/v1/chat/completions"
        assert json.loads(raw) == {**json.loads(chat), "priority": 0}
        state = httpx.get(f"{router.url}/state", timeout=5).json()["deployments"]
        engines = {d["deployment"]: (d["engine"], d["priority_fields"]) for d in state}
        assert engines["tr"] == ("trtllm", {"interactive": {}, "batch": {}})
        assert engines["vl"] == (
            "vllm",
            {"interactive": {"priority": 0}, "batch": {"priority": 10}},
        )
    finally:
        router.stop()


def test_the_routers_class_wins_over_a_clients_own_priority(
    upstream: CapturingUpstream, tmp_path: Path
) -> None:
    router = start_router(tmp_path, upstream)
    try:
        send(router, body("vl", priority=-100), "batch")  # a batch client jumping the queue
        send(router, body("vl", priority=10), "batch")  # already its class's value
        first, second = (json.loads(b) for _, b in upstream.bodies)
        assert first["priority"] == 10 and second["priority"] == 10
        assert first["prompt"] == "hello" and first["max_tokens"] == 1
        # A body with spaces before its closing brace still parses once the field is added.
        send(router, b'{"model": "vl", "prompt": "x", "max_tokens": 1 }\n', "interactive")
        assert json.loads(upstream.bodies[-1][1])["priority"] == 0
    finally:
        router.stop()


def test_with_passing_priority_off_every_body_passes_as_sent(
    upstream: CapturingUpstream, tmp_path: Path
) -> None:
    router = start_router(tmp_path, upstream, FLEET_ROUTER_PASS_PRIORITY="false")
    try:
        sent = [body("vl"), body("sg"), body("vl", priority=3)]
        for raw in sent:
            send(router, raw, "batch")
        got = [b for _, b in upstream.bodies]
        assert got[:2] == sent[:2]  # byte for byte
        # A client's own priority is the engine's field: taken out, never passed on.
        assert json.loads(got[2]) == {
            k: v for k, v in json.loads(sent[2]).items() if k != "priority"
        }
    finally:
        router.stop()
