"""Request bodies of the OpenAI API subset the server implements (pydantic models); the response
bodies live in :mod:`.bodies` and are re-exported here.

Requests accept and ignore OpenAI fields that do not change the output here (``user``,
``metadata``, ``store``, ``parallel_tool_calls``, ...). Fields that would change it and are not
supported (``suffix``, non-text content parts) are refused with a 400 naming the field.
Cross-field checks raise :class:`ParamError`, so the 400 names the field (``param``) too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvboost_hf.server.api.bodies import (  # noqa: F401 - re-exported: schemas.<Body> names request and response bodies
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    new_id,
    now,
)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096  # total characters of a request's stop strings
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64; candidate k of n uses seed + k, which must fit too
MAX_TOKENS_LIMIT = 2**31 - 1  # beyond any context; the model's context gives the real bound (a 400 naming it)
MAX_CHOICES = 16  # n, best_of and list prompts: at most this many generations per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (completions allow 5; we allow 20)


class ParamError(ValueError):
    """A request-level validation error that names the offending field (``param`` of the 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# A salt is 1-256 printable characters (no control characters: those name the server's own shared entries).
SALT_PATTERN = r"^[^\x00-\x1f\x7f]+$"


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    # Requests with different salts never share stored K/V (as vLLM's cache_salt); the same salt shares.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, pattern=SALT_PATTERN)
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    # vLLM extension: keep generating past the end-of-sequence token.
    ignore_eos: bool = False

    @field_validator("n", mode="before")
    @classmethod
    def _default_n(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        bad = {k: v for k, v in (value or {}).items() if not -100.0 <= v <= 100.0}
        if bad:
            raise ValueError(f"biases must be in [-100, 100]; got {bad}")
        return value or None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        stops = [s for s in stops if s]
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        total = sum(len(s) for s in stops)
        if total > MAX_STOP_CHARS:
            raise ValueError(f"the stop strings have {total} characters in all; at most {MAX_STOP_CHARS} are supported")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _zero_default(cls, value: float | None) -> float:
        return value or 0.0

    def check_candidate_seeds(self, candidates: int) -> None:
        """Candidate ``k`` of ``candidates`` samples with ``seed + k``: the last one must be an int64 too."""
        if self.seed is not None and self.seed + candidates - 1 > SEED_MAX:
            raise ParamError("seed", f"seed + {candidates - 1} (one seed per candidate) must be at most {SEED_MAX}: "
                                     f"lower seed to at most {SEED_MAX - candidates + 1}")


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a token id list, or a list of either (one choice set each).

    ``max_tokens`` 0 is allowed with ``echo`` (the prompt's logprobs only, as lm-eval asks).
    """

    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> list[str] | list[list[int]]:
        prompts = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) else [value]
        if any(isinstance(p, list) and not p for p in prompts) or (isinstance(value, list) and not value):
            raise ValueError("the prompt is empty")
        if len(prompts) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request")
        return prompts

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        best_of = self.best_of or self.n
        if best_of < self.n:
            raise ParamError("best_of", f"best_of ({best_of}) must be at least n ({self.n})")
        if best_of > 1 and self.stream and best_of != self.n:
            raise ParamError("best_of", "best_of > n cannot be streamed (OpenAI refuses it too)")
        if best_of * len(self.prompt) > MAX_CHOICES:
            raise ParamError("n", f"prompts x best_of (or n) must be at most {MAX_CHOICES}")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens 0 is only allowed with echo")
        self.check_candidate_seeds(best_of)
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

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
        """The message as chat templates expect it: ``developer`` is a system message, a legacy
        ``function`` result a ``tool`` message, tool call arguments a dict."""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            out["name"] = self.name
        return out


def _arguments(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is a synonym of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Legacy function calling: mapped onto tools / tool_choice.
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.functions:
            if self.tools:
                raise ParamError("functions", "send tools or the legacy functions, not both")
            self.tools = [Tool(function=f) for f in self.functions]
            call = self.function_call
            self.tool_choice = {"type": "function", "function": call} if isinstance(call, dict) else call
        self.tool_choice = self._checked_tool_choice()
        self.check_candidate_seeds(self.n)
        return self

    def _checked_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice in ("auto", "required") and not self.tools:
            raise ParamError("tool_choice", f"tool_choice {choice!r} needs tools")
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            names = [t.function.name for t in self.tools or []]
            if choice.get("type", "function") != "function" or not isinstance(name, str):
                raise ParamError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
            if name not in names:
                raise ParamError("tool_choice", f"tool_choice names function {name!r}, which is not in tools {names}")
        return choice

    @property
    def offered_tools(self) -> list[dict]:
        """The tools the prompt shows the model, as dicts (none with ``tool_choice: "none"``)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []] if self.tool_choice != "none" else []

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether a tool call is forced, the forced function's name or None for any tool)."""
        if self.tool_choice == "required":
            return True, None
        if isinstance(self.tool_choice, dict):
            return True, self.tool_choice["function"]["name"]
        return False, None


class WarmRequest(BaseModel):
    """``POST /v1/warm``: exactly one of ``text`` (tokenized like a completion prompt) or ``messages`` (the
    opening turns of later chats: what every chat starting with them renders first is warmed)."""

    text: str | None = None
    messages: list[ChatMessage] | None = None
    pin: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, pattern=SALT_PATTERN)  # only requests with it find these
    shared: bool = False  # an admin key only (--api-keys): entries every tenant reads as a leading prefix

    @model_validator(mode="after")
    def _one_of(self) -> WarmRequest:
        if (self.text is None) == (self.messages is None):
            raise ValueError("send exactly one of 'text' or 'messages'")
        if self.text is not None and not self.text:
            raise ValueError("text is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.shared and self.cache_salt is not None:
            raise ValueError("shared entries are read by every tenant: send no cache_salt with shared")
        return self


class WarmResponse(BaseModel):
    """``POST /v1/warm``'s answer. ``prompt_tokens``: the tokens warmed; ``reusable_tokens``: how many of
    them a later prompt continuing them loads from the store (its ``cached_tokens``; a prompt that is
    exactly the warmed tokens reuses one fewer); ``reused_tokens``: how many the store already held."""

    object: Literal["warm"] = "warm"
    prompt_tokens: int
    reusable_tokens: int
    reused_tokens: int
    stored_chunks: int
    seconds: float


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: ``prompt`` text, or chat ``messages`` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "send exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
