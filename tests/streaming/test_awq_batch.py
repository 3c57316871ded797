"""An int4 model on kvboost_hf's kernels as rows of the server's continuous batch: each request's
greedy tokens equal what the same server returns for it alone. The kernels' rows do not depend on
what else is in the forward; attention and norms are torch's, and a batched prompt is prefilled in
other chunk shapes, so logprobs agree closely rather than bit for bit (docs/kernels.md)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvboost_hf import ChunkStore, kernels
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer
from tests.streaming.conftest import load_awq


def specs() -> list[dict]:
    """12 completions: prompts of 3-60 words (some sharing a prefix), 4-14 tokens each."""
    shared = cycle_words(24, start=7)
    return [{"prompt": (shared + " " if i % 3 else "") + cycle_words(3 + (i * 13) % 36, start=40 + i),
             "max_tokens": 4 + (i * 5) % 11} for i in range(12)]


def body(spec: dict) -> dict:
    return {"model": MODEL_NAME, "prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
            "logprobs": 1}


def reply(data: dict) -> tuple:
    """Text, finish reason, tokens and their logprobs."""
    choice = data["choices"][0]
    logprobs = choice["logprobs"]
    return choice["text"], choice["finish_reason"], logprobs["tokens"], logprobs["token_logprobs"]


async def together(url: str, all_specs: list[dict]) -> list[tuple]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json=body(s)) for s in all_specs))
    return [reply(r.json()) for r in replies]


@pytest.mark.parametrize("settings", [dict(residency_mode="full_resident"),
                                      dict(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)])
def test_batch_rows_of_a_kernel_model_equal_each_request_alone(tiny_awq, settings):
    assert kernels.available().built, kernels.available().reason
    model = load_awq(tiny_awq["gemma3"][1], kernel="kvboost", **settings)
    assert isinstance(model.get_output_embeddings(), kernels.KernelLinear)
    all_specs = specs()
    with serve(model, tiny_tokenizer(), ChunkStore(max_bytes=50_000_000, chunk_size=8), scheduler="batch",
               max_batch_size=6, max_batched_tokens=24, max_queue=64) as server:
        alone = [reply(httpx.post(f"{server.base_url}/v1/completions", json=body(s), timeout=300).json())
                 for s in all_specs]
        before = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["batching"]["max_batch_size_seen"]
        batched = asyncio.run(together(server.base_url, all_specs))
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["batching"]
    assert before == 1 and stats["max_batch_size_seen"] > 1  # alone, then really batched
    assert stats["prefill_chunks"] > len(all_specs)  # long prompts prefilled in chunks beside decodes
    for spec, one, many in zip(all_specs, alone, batched):
        assert many[:3] == one[:3], spec  # greedy text, finish reason and tokens: identical
        assert max(abs(a - b) for a, b in zip(many[3], one[3])) < 0.02, spec
