"""cache_salt on the server: a request finds only K/V stored under its own salt, on both schedulers,
in its reply, its echoed prompt logprobs, /v1/warm, and the batch scheduler's shared-prefill waits."""

from __future__ import annotations

import time

import httpx
import pytest

from kvboost_hf.store import ChunkStore
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, all_at_once, cycle_words, serve, tiny_tokenizer

PROMPT = cycle_words(60, start=3)


def complete(server, salt=None, **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("scheduler", ["workers", "batch"])
def test_only_requests_with_the_same_salt_share(scheduler):
    model, tokenizer = make_tiny("llama", seed=31), tiny_tokenizer()
    with serve(model, tokenizer, ChunkStore(max_bytes=50_000_000, chunk_size=16), scheduler=scheduler) as server:
        first = complete(server, "alice")
        assert cached(first) == 0
        again = complete(server, "alice")
        assert cached(again) > 0 and again["choices"][0]["text"] == first["choices"][0]["text"]
        assert cached(complete(server, "bob")) == 0
        assert cached(complete(server)) == 0
        echoed = complete(server, "carol", echo=True, logprobs=0, max_tokens=1)
        assert cached(echoed) == 0  # prompt logprobs are not served from another salt's entries either
        warmed = httpx.post(f"{server.base_url}/v1/warm", json={"text": cycle_words(40, start=50),
                                                                  "cache_salt": "dave"}, timeout=120).json()
        assert warmed["reusable_tokens"] > 0
        body = {"model": MODEL_NAME, "prompt": cycle_words(44, start=50), "max_tokens": 1, "temperature": 0}
        nosalt = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
        dave = httpx.post(f"{server.base_url}/v1/completions", json={**body, "cache_salt": "dave"}, timeout=120).json()
        assert cached(nosalt) == 0 and cached(dave) > 0


def test_an_empty_salt_is_a_400(tiny_server):
    reply = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": "a b", "max_tokens": 1, "cache_salt": ""})
    assert reply.status_code == 400 and "cache_salt" in reply.text


def test_a_burst_under_different_salts_never_waits_on_another_salts_prefill():
    """Waiting for another salt's prefill would show in TTFT that someone is sending this prefix."""
    model, tokenizer = make_tiny("llama", seed=32), tiny_tokenizer()
    handle = model.register_forward_pre_hook(lambda *_: time.sleep(0.01))
    try:
        with serve(model, tokenizer, ChunkStore(max_bytes=50_000_000, chunk_size=16), scheduler="batch",
                   max_batch_size=8, max_batched_tokens=24) as server:
            replies = all_at_once(lambda i: complete(server, f"user-{i}"), 4)
            stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
    finally:
        handle.remove()
    assert [cached(replies[i]) for i in range(4)] == [0, 0, 0, 0]
    assert stats["batching"]["shared_prefill_waits"] == 0
