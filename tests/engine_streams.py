"""One streaming completion straight to an engine (stand-in or real), for tests that keep
requests in flight while something happens to the agent: every SSE data line is kept, and
`started` is set at the first one.

Not a test module: test modules import it by name (tests/ is on pytest's path).
"""

from __future__ import annotations

import threading

import httpx


def stream_completion(
    url: str,
    prompt: str,
    chunks: list[str],
    started: threading.Event,
    *,
    max_tokens: int,
    model: str = "llama-8b",
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # the engines' extension: exactly max_tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
                started.set()
