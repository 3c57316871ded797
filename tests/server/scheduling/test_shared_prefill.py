"""A burst of requests sharing a new prefix under the batch scheduler: the prefix is computed once and
reused exactly by every other row (they wait for the prefill in flight, then load it from the store)."""

from __future__ import annotations

import httpx

from kvboost_hf.batching.scheduler import common_prefix, waits_for_prefill
from kvboost_hf.server.engine.generation import SamplingParams, generate_reply, stop_token_ids
from kvboost_hf.store import ChunkStore
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, BurstGate, all_at_once, cycle_words, serve, tiny_tokenizer

SYSTEM = cycle_words(70, start=11)  # a prefix no request has sent before the burst


def test_waits_for_prefill_only_for_chunks_the_store_lacks():
    shared = list(range(100, 164))  # 64 tokens
    assert common_prefix(shared + [1, 2], shared + [1, 3]) == 65
    assert common_prefix([], shared) == 0
    assert waits_for_prefill(shared + [7], [(shared + [9], 0)], chunk_tokens=16)
    assert not waits_for_prefill(shared + [7], [(shared + [9], 64)], chunk_tokens=16)  # it loaded all of it
    assert waits_for_prefill(shared + [7], [(shared + [9], 48)], chunk_tokens=16)  # one chunk still computed
    assert not waits_for_prefill(shared[:15] + [7], [(shared, 0)], chunk_tokens=16)  # less than a chunk shared
    assert not waits_for_prefill(shared, [], chunk_tokens=16)


def alone(model, tokenizer, prompt: str, max_tokens: int) -> tuple[str, str]:
    ids = tokenizer(prompt)["input_ids"]
    reply = generate_reply(model, tokenizer, ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                           stop_token_ids(model, tokenizer))
    return reply.text, reply.finish_reason


def test_a_burst_on_a_new_shared_prefix_computes_it_once_and_answers_exactly(monkeypatch):
    model, tokenizer = make_tiny("gemma3", seed=23), tiny_tokenizer()  # sliding (16) and full layers
    prompts = [f"{SYSTEM} {cycle_words(3 + i, start=40 + 7 * i)}" for i in range(8)]
    expected = [alone(model, tokenizer, p, 6) for p in prompts]
    shared = common_prefix(*(tokenizer(p)["input_ids"] for p in prompts[:2]))
    store = ChunkStore(max_bytes=50_000_000, chunk_size=16)
    gate = BurstGate(8, monkeypatch)
    handle = model.register_forward_pre_hook(gate)
    try:
        with serve(model, tokenizer, store, scheduler="batch", max_batch_size=8, max_batched_tokens=24) as server:
            replies = all_at_once(lambda i: httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": MODEL_NAME, "prompt": prompts[i], "max_tokens": 6, "temperature": 0}), 8)
            stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
    finally:
        handle.remove()
    got = [replies[i].json() for i in range(8)]
    for i, body in enumerate(got):
        assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == expected[i], i
    cached = sorted(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in got)
    whole_chunks = shared // 16 * 16
    assert cached[0] == 0 and all(c >= whole_chunks for c in cached[1:]), (cached, shared)
    assert gate.all_queued.is_set() and stats["batching"]["shared_prefill_waits"] >= 1
