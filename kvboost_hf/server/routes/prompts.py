"""Prompts of the two routes as token ids: completion prompts (text or ids) and chats through the template."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.api.requests import ChatMessage
from kvboost_hf.server.decoding.tools import plain_turns, template_renders_tools, with_tools_system


async def completion_prompt_ids(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """A completion prompt's token ids: a string tokenized, ids checked against the vocabulary (400)."""
    if isinstance(prompt, str):
        return (await run_in_threadpool(tokenizer, prompt))["input_ids"]
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt",
                       code="invalid_value")
    return list(prompt)


async def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> list[int]:
    """Chat messages through the tokenizer's chat template (tools in it, or as text where it knows none); 400
    when there is no template or it refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the tokenizer has no chat template: use /v1/completions", param="messages")
    dicts = [m.template_dict() for m in messages]
    extra: dict[str, Any] = {}
    if template_renders_tools(tokenizer):
        extra = {"tools": tools} if tools else {}
    else:  # the template knows no tools: tool turns as text, the tool list in the system message
        if any(d["role"] == "tool" or d.get("tool_calls") for d in dicts):
            dicts = plain_turns(dicts)
        if tools:
            dicts = with_tools_system(dicts, tools)
    try:
        encoded = await run_in_threadpool(
            tokenizer.apply_chat_template, dicts, add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=True, **extra,
        )
    except Exception as err:  # jinja raise_exception: e.g. roles must alternate
        raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None
    return list(encoded["input_ids"])


async def routed_prompt(tokenizer, path: str, body: dict) -> tuple[list[int], str | None] | None:
    """``(prompt ids, cache_salt)`` the server gives a ``/v1/completions`` (its first prompt) or
    ``/v1/chat/completions`` body, as a router in front of replicas computes them; None for other routes
    and for bodies the server would refuse, a malformed ``cache_salt`` included (the replica answers those)."""
    from pydantic import ValidationError

    from kvboost_hf.server.api.requests import ChatCompletionRequest, CompletionRequest

    try:
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(body)
            return await chat_prompt_ids(tokenizer, chat.messages, tools=chat.offered_tools or None), chat.cache_salt
        if path == "/v1/completions":
            completion = CompletionRequest.model_validate(body)
            ids = await completion_prompt_ids(tokenizer, completion.prompt[0], len(tokenizer))
            return ids, completion.cache_salt
    except (ValidationError, APIError, ValueError, TypeError, IndexError):
        return None
    return None
