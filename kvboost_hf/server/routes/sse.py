"""The SSE stream of a reply: role chunks, content deltas per choice index, closing chunks, usage, ``[DONE]``.

Content is streamed as it is generated, except when the request offers tools: a reply that may
turn out to be a tool call is held back and sent at the end, as ``content`` or as one
``tool_calls`` delta. Logprobs of a streamed choice come in one chunk just before its finish.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from kvboost_hf.server.decoding.logprobs import chat_logprobs, completion_logprobs
from kvboost_hf.server.engine.generation import SamplingParams
from kvboost_hf.server.routes.choices import ChunkWriter, chat_finish, data, tool_calls_of, usage_of
from kvboost_hf.server.scheduling.candidates import Choice, PromptPlan
from kvboost_hf.server.scheduling.workers import Job

logger = logging.getLogger(__name__)


async def sse_events(service, job: Job, route: str, arrival: float, deadline: float, writer: ChunkWriter,
                     plans: list[PromptPlan], params: SamplingParams, tools: list[dict] | None,
                     echoes: list[str] | None, still_allowed: Callable[[], bool] = lambda: True) -> AsyncIterator[str]:
    """The lines of one streamed response; cancels the job when the client leaves before the end, or when
    ``still_allowed()`` turns false (its API key was revoked): then an error event ends the stream."""
    chat = writer.chat
    indices = [number * plan.keep + k for number, plan in enumerate(plans) for k in range(plan.keep)]
    finished = False
    try:
        for index in indices:
            if chat:
                yield writer.chat_delta(index, {"role": "assistant", "content": ""})
            elif echoes:
                yield writer.text(index, echoes[index // plans[0].keep])
        while True:
            try:
                kind, value = await service.next_event(job, deadline, None)
            except TimeoutError:
                job.cancel()
                error = service.timeout_error()
                yield data(error.body())
                break
            if not still_allowed():
                job.cancel()
                service.metrics.observe_outcome("cancelled")
                yield data({"error": {"message": "the API key was revoked while the request ran",
                                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
                break
            if kind == "delta":
                index, piece = value
                yield writer.chat_delta(index, {"content": piece}) if chat else writer.text(index, piece)
            elif kind == "done":
                for choice in value:
                    service._record(route, arrival, choice.reply, params)
                    echo = echoes[choice.index // choice.plan.keep] if echoes else None
                    for line in closing_chunks(service.tokenizer, writer, choice, params, tools, echo):
                        yield line
                if writer.include_usage:
                    yield writer.usage(usage_of(plans, value))
                break
            elif kind in ("error", "cancelled"):
                service.metrics.observe_outcome("failed" if kind == "error" else "cancelled")
                message = f"generation failed: {value}" if kind == "error" else "generation cancelled"
                yield data({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
                break
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream: stop generating for it
            job.cancel()
            service.metrics.observe_outcome("cancelled")
            logger.info("client disconnected mid-stream; generation cancelled")

def closing_chunks(tokenizer, writer: ChunkWriter, choice: Choice, params: SamplingParams,
                   tools: list[dict] | None, echo_text: str | None = None) -> list[str]:
    """A streamed choice's last chunks: held-back content or tool calls, logprobs, the finish reason
    (``echo_text``: the prompt streamed before the reply, which the logprobs' offsets count)."""
    reply, index = choice.reply, choice.index
    if not writer.chat:
        segments = [(echo_text or "", choice.prompt_logprobs or []), (reply.text, reply.logprobs or [])]
        logprobs = completion_logprobs(tokenizer, segments) if params.logprobs is not None else None
        return [writer.text(index, "", finish=reply.finish_reason, logprobs=logprobs)]
    lines = []
    calls = tool_calls_of(choice, tools)
    if calls:
        lines.append(writer.chat_delta(index, {"tool_calls": [c.openai(k) for k, c in enumerate(calls)]}))
    elif tools and reply.text:
        lines.append(writer.chat_delta(index, {"content": reply.text}))
    if params.logprobs is not None:
        lines.append(writer.chat_delta(index, {"content": ""}, logprobs=chat_logprobs(tokenizer, reply.logprobs or [])))
    lines.append(writer.chat_delta(index, {}, finish=chat_finish(choice, calls)))
    return lines
