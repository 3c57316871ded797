"""``POST /v1/warm``: store the K/V of a text, or of what later chats starting with some messages share.

Chat messages are not warmed as they render alone: many templates drop a system message that no
user turn follows (Gemma, Llama 2) or fold it into the first user turn. The warmed tokens are the
common prefix of the messages rendered with several stand-in next turns
(:func:`kvboost_hf.generation.warm.continuation_probes`): exactly what every later chat that starts with these
messages renders first, whatever the template.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from kvboost_hf.generation.warm import continuation_probes, probe_texts, reusable_tokens, shared_prefix, warm
from kvboost_hf.server.api import requests as schemas
from kvboost_hf.server.api.keys import Grant
from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.scheduling.workers import Job


async def chat_warm_prefix(service, messages: list[schemas.ChatMessage]) -> list[int]:
    """The token prefix every later chat starting with ``messages`` shares, rendered through the
    server's own chat path (``service.chat_prompt``); 400 when the template refuses them or the chats
    share nothing."""
    last_role = messages[-1].template_dict()["role"]
    renderings = []
    texts = await run_in_threadpool(probe_texts, service.tokenizer)
    for extra, generation in continuation_probes(last_role, texts):
        turns = messages if extra is None else [*messages, schemas.ChatMessage(**extra)]
        renderings.append(await service.chat_prompt(turns, add_generation_prompt=generation))
    prefix = shared_prefix(renderings)
    if not prefix:
        raise APIError(400, "later chats starting with these messages share no leading token under this chat "
                            "template: there is nothing to warm", param="messages", code="invalid_value")
    return prefix


async def warm_request(service, body: schemas.WarmRequest, grant: Grant | None = None) -> dict[str, Any]:
    """Warm ``body``'s text or chat prefix on a worker; the answer says what later prompts will reuse.

    ``prompt_tokens``: the tokens warmed (for messages, the shared chat prefix); ``reusable_tokens``:
    how many of them the store now holds for a later prompt that continues them (a chat whose whole
    prompt is the prefix reuses one fewer: the model forwards at least one token). With ``shared`` (an
    admin key), the entries are read by every tenant (see :mod:`.tenancy`).
    """
    if not service.settings.reuse:
        raise APIError(400, "reuse is off on this server: warming would have no effect", code="reuse_disabled")
    tenancy = service.tenancy
    scope = tenancy.shared_scope(grant) if body.shared else tenancy.scope(grant, body.cache_salt)
    if body.text is not None:
        ids = list((await run_in_threadpool(service.tokenizer, body.text))["input_ids"])
    else:
        ids = await chat_warm_prefix(service, body.messages)
    service.check_prompt_length(len(ids))
    arrival = time.perf_counter()

    def work(job: Job) -> tuple[Any, int]:
        stats = warm(service.model, ids, service.store, pin=body.pin, cache_salt=scope)
        return stats, reusable_tokens(service.model, ids, service.store, cache_salt=scope)

    job = Job(work)
    service.submit(job)
    deadline = arrival + service.settings.request_timeout
    try:
        while True:
            kind, value = await service.next_event(job, deadline, None)
            if kind == "done":
                break
            if kind == "error":
                raise APIError(500, f"warming failed: {value}", type="server_error")
    except TimeoutError:
        job.cancel()
        raise service.timeout_error() from None
    stats, reusable = value
    tenancy.check_still_allowed(grant)
    if body.shared:
        tenancy.note_shared(grant, len(ids), reusable, service.tokenizer.decode(ids[:64], skip_special_tokens=True))
    return schemas.WarmResponse(prompt_tokens=len(ids), reusable_tokens=reusable, reused_tokens=stats.reused_tokens,
                                stored_chunks=stats.stored_chunks, seconds=time.perf_counter() - arrival).model_dump()
