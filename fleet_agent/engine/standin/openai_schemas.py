"""The OpenAI request bodies the stand-in accepts: as strict as trtllm-serve's (unknown fields
refused), or, for the vLLM and SGLang dialects, ignoring unknown fields as those servers do and
taking their `priority` field. The error bodies are each dialect's (dialect.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    # trtllm-serve's request models forbid unknown fields too (OpenAIBaseModel, extra="forbid").
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = True  # trtllm-serve's default once stream_options is given
    continuous_usage_stats: bool | None = False


class SamplingBody(_Strict):
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
    def _supported(self) -> SamplingBody:
        if self.n != 1:
            raise ValueError("the stand-in serves n=1 only")
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when stream is true.")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionBody(SamplingBody):
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


class ChatBody(SamplingBody):
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


class PriorityCompletionBody(CompletionBody):
    # vLLM's and SGLang's request models log and drop unknown fields instead of refusing them,
    # and take a request without "model" (the served model).
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # type: ignore[assignment]
    priority: int | None = None  # lower first in vLLM; SGLang: see dialect.PriorityMode


class PriorityChatBody(ChatBody):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # type: ignore[assignment]
    priority: int | None = None


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else str(err["msg"]))
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return "; ".join(parts), (str(first[0]) if first else None)
