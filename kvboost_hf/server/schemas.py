"""Request and response bodies of the OpenAI API subset the server implements (pydantic models).

Requests accept and ignore OpenAI fields that do not change the output here (``user``,
``metadata``, ``store``, ...). Fields that would change it and are not supported (``n`` > 1,
``logprobs``, ``echo``, tools, penalties) are refused with a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = 1
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extension: keep generating past the end-of-sequence token.
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported (send separate requests for several samples)")
        return 1

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        stops = [s for s in stops if s]
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float:
        if value:
            raise ValueError("presence and frequency penalties are not supported; send 0")
        return 0.0

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> None:
        if value:
            raise ValueError("logit_bias is not supported")
        return None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a token id list, or a list holding one of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request is supported (send separate requests)")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[TextPart] | None) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if any(part.type != "text" or part.text is None for part in value):
            raise ValueError("only text content parts are supported")
        return "".join(part.text for part in value)

    def template_dict(self) -> dict:
        """The message as the tokenizer's chat template expects it (``developer`` is a system message)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is a synonym of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return self


class WarmRequest(BaseModel):
    """``POST /v1/warm``: exactly one of ``text`` (tokenized like a completion prompt) or ``messages``."""

    text: str | None = None
    messages: list[ChatMessage] | None = None
    pin: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> WarmRequest:
        if (self.text is None) == (self.messages is None):
            raise ValueError("send exactly one of 'text' or 'messages'")
        if self.text is not None and not self.text:
            raise ValueError("text is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvboost-hf"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
