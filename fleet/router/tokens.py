"""Prompt tokens of an OpenAI request body, counted the way the engine counts them.

The stand-in engine's tokenizer is ⌈characters ÷ 4⌉ over the prompt (chat messages rendered
with Llama-3-style headers), so for it the count is exact; token-id prompts are exact for any
engine. For a real model's text the same rule is an estimate (English runs near 4 characters a
token): the strategies compare replicas with it, they never bill by it.
"""

from __future__ import annotations

from typing import Any

from fleet_core.tokens import count_tokens


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def rendered_chat(body: dict[str, Any]) -> str:
    """A chat request's messages as the stand-in renders them into one prompt (Llama-3-style
    headers), ready for the assistant's turn."""
    messages = body.get("messages") or []
    rendered = "".join(
        f"<|{m.get('role', '')}|>\n{_text(m.get('content'))}\n"
        for m in messages
        if isinstance(m, dict)
    )
    return rendered + "<|assistant|>\n"


def prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        return count_tokens(rendered_chat(body))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return max(1, len(prompt))
        prompt = prompt[0] if prompt else ""
    return count_tokens(str(prompt))


def max_output(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and value > 0 else None
