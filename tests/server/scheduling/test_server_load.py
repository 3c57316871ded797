"""A bounded load test: 32 concurrent SDK clients, 64 greedy requests; every one succeeds and
equals the same request sent alone. And the real Gemma-3-270M behind the server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvboost_hf import disable_chunk_reuse
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer, words

CLIENTS = 32
REQUESTS = 64


def load_messages(i: int) -> list[dict]:
    """Four shared 40-word system prompts, a distinct short question each."""
    return [{"role": "system", "content": cycle_words(40, start=7 * (i % 4))},
            {"role": "user", "content": words(10 + i % 80, 11 + i // 4 % 80)}]


async def send(client, i: int) -> tuple[str, str | None, int]:
    kw = dict(model=MODEL_NAME, messages=load_messages(i), max_tokens=6, temperature=0)
    if i % 2:  # half of them stream
        text, finish = "", None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, -1
    out = await client.chat.completions.create(**kw)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.prompt_tokens_details.cached_tokens


async def run_concurrently(server) -> list:
    client = server.async_client()
    todo = list(range(REQUESTS))
    results: dict[int, tuple] = {}

    async def one_client():
        while todo:
            i = todo.pop(0)
            results[i] = await send(client, i)

    await asyncio.wait_for(asyncio.gather(*(one_client() for _ in range(CLIENTS))), timeout=300)
    await client.close()
    return [results[i] for i in range(REQUESTS)]


SCHEDULERS = {"workers": dict(scheduler="workers", workers=2),
              "batch": dict(scheduler="batch", max_batch_size=8, max_batched_tokens=64)}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_32_concurrent_clients_get_the_outputs_of_sequential_requests(scheduler):
    with serve(make_tiny("mistral", seed=13), tiny_tokenizer(), max_queue=REQUESTS, **SCHEDULERS[scheduler]) as server:
        concurrent = asyncio.run(run_concurrently(server))
        assert server.queue.completed == REQUESTS
        client = server.client()
        alone = []
        for i in range(REQUESTS):
            out = client.chat.completions.create(model=MODEL_NAME, messages=load_messages(i), max_tokens=6,
                                                 temperature=0)
            alone.append((out.choices[0].message.content, out.choices[0].finish_reason))
        assert [(text, finish) for text, finish, _ in concurrent] == alone
        assert all(finish in ("stop", "length") for _, finish in alone)
        # The shared system prompts were reused under load.
        assert sum(1 for *_, cached in concurrent if cached > 40) >= REQUESTS // 4
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
        assert stats["requests"]["completed"] == 2 * REQUESTS
        assert stats["reuse"]["reused_tokens"] > 0
        assert stats["queue"]["depth"] == 0


@pytest.mark.parametrize("scheduler", ["workers", "batch"])
def test_real_gemma_behind_the_server(gemma, scheduler):
    model, tokenizer = gemma
    try:
        with serve(model, tokenizer, model_name="gemma-3-270m", workers=1, scheduler=scheduler) as server:
            client = server.client()
            system = ("You are the support assistant of a shelving company. Modules are 80 cm wide and 30 cm deep; "
                      "each shelf holds 25 kg; delivery takes five to eight working days.")
            first = client.chat.completions.create(
                model="gemma-3-270m", max_tokens=4, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "How wide is a module?"}],
            )
            assert first.usage.prompt_tokens > 40 and first.usage.completion_tokens >= 1
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "How much can a shelf hold?"}]
            second = client.chat.completions.create(model="gemma-3-270m", max_tokens=4, temperature=0,
                                                    messages=messages)
            assert second.usage.prompt_tokens_details.cached_tokens > 30  # the system prompt came from the store
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model="gemma-3-270m", max_tokens=4, temperature=0,
                                                        messages=messages, stream=True)
                if c.choices
            )
            assert streamed == second.choices[0].message.content
    finally:
        disable_chunk_reuse(model)
