"""Response bodies: choices (text, tool calls, logprobs) and the SSE chunks of a streamed reply.

Stream chunks follow OpenAI's shapes: ``usage`` appears only with ``stream_options.include_usage``
(null on every chunk but the last), the first chat delta is ``{"role": "assistant", "content": ""}``,
content deltas carry only ``content``, and the closing delta is ``{}`` with the finish reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvboost_hf.server.api import requests as schemas
from kvboost_hf.server.decoding.logprobs import chat_logprobs, completion_logprobs
from kvboost_hf.server.decoding.tools import ToolCall, parse_tool_calls
from kvboost_hf.server.scheduling.candidates import Choice, PromptPlan


def tool_calls_of(choice: Choice, tools: list[dict[str, Any]] | None) -> list[ToolCall]:
    """The calls in a chat choice's text (none when the request offered no tools)."""
    return parse_tool_calls(choice.reply.text, tools) if tools else []


def chat_finish(choice: Choice, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and choice.reply.finish_reason is not None else choice.reply.finish_reason


def chat_choice(tokenizer, choice: Choice, tools: list[dict[str, Any]] | None, logprobs: bool) -> schemas.ChatChoice:
    calls = tool_calls_of(choice, tools)
    message = schemas.AssistantMessage(
        content=None if calls else choice.reply.text,
        tool_calls=[c.openai() for c in calls] or None,
    )
    return schemas.ChatChoice(
        index=choice.index, message=message, finish_reason=chat_finish(choice, calls),
        logprobs=chat_logprobs(tokenizer, choice.reply.logprobs or []) if logprobs else None,
    )


def completion_choice(tokenizer, choice: Choice, echo_text: str | None, logprobs: bool) -> schemas.CompletionChoice:
    """A completion choice; with ``echo_text`` the prompt comes first (its logprobs too, when asked)."""
    text = (echo_text or "") + choice.reply.text
    segments = [(echo_text or "", choice.prompt_logprobs or []), (choice.reply.text, choice.reply.logprobs or [])]
    return schemas.CompletionChoice(
        index=choice.index, text=text, finish_reason=choice.reply.finish_reason,
        logprobs=completion_logprobs(tokenizer, segments) if logprobs else None,
    )


def usage_of(plans: list[PromptPlan], choices: list[Choice]) -> schemas.Usage:
    """Prompt tokens once per prompt, completion tokens of every choice, cached tokens of each prompt's best
    (its generations', or scoring it for ``echo``: tokens not forwarded)."""
    prompt = sum(len(p.prompt_ids) for p in plans)
    cached = sum(max((max(c.reply.cached_tokens, getattr(c.prompt_logprobs, "cached_tokens", 0))
                      for c in choices if c.plan is p), default=0) for p in plans)
    return schemas.Usage.of(prompt, sum(c.reply.completion_tokens for c in choices), min(cached, prompt))


def data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass
class ChunkWriter:
    """Builds the SSE lines of one streamed response."""

    response_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def chat_delta(self, index: int, delta: dict[str, Any], finish: str | None = None,
                   logprobs: dict | None = None) -> str:
        return data(self._envelope([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]))

    def text(self, index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        return data(self._envelope([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]))

    def usage(self, usage: schemas.Usage) -> str:
        return data({**self._envelope([]), "usage": usage.model_dump(mode="json")})
