"""Chunked prefill (``prefill_chunk_size``) and continued prompt caches reuse the store for every chunk."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf import ChunkReuseCache, ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from tests.conftest import random_ids

GREEDY = dict(max_new_tokens=8, do_sample=False)


def shared(seed: int = 0):
    first = random_ids(60, seed)
    return first, torch.cat([first[:, :50], random_ids(20, seed + 1)], dim=1)


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_every_prefill_chunk_reuses_the_store(tiny, kv_bits):
    first, second = shared()
    ref = tiny.generate(second, **GREEDY, prefill_chunk_size=16)
    enable_chunk_reuse(tiny, ChunkStore(max_bytes=10**8, chunk_size=8, kv_bits=kv_bits))
    tiny.generate(first, **GREEDY)
    out = tiny.generate(second, **GREEDY, prefill_chunk_size=16)
    stats = last_request_stats(tiny)
    disable_chunk_reuse(tiny)
    # Every chunk keeps its last token for the forward: 15 + 15 + 15 + 2 of the 50 shared tokens.
    assert stats.prompt_tokens == 70 and stats.reused_tokens == 47 and stats.recomputed_tokens == 23
    if kv_bits is None:
        assert torch.equal(out, ref) and stats.exact_tokens == 47
    else:
        assert stats.approximate_tokens == 47 and out.shape == ref.shape


def test_a_continued_prompt_cache_reuses_what_follows_it(tiny):
    first, second = shared(3)
    prompt_cache = ChunkReuseCache(tiny.config)
    enable_chunk_reuse(tiny, ChunkStore(max_bytes=10**8, chunk_size=8))
    tiny.generate(first, **GREEDY)
    with torch.no_grad():
        tiny(second[:, :20], past_key_values=prompt_cache, use_cache=True)
    out = tiny.generate(second, past_key_values=copy.deepcopy(prompt_cache), **GREEDY)
    stats = last_request_stats(tiny)
    disable_chunk_reuse(tiny)
    plain_cache = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(second[:, :20], past_key_values=plain_cache, use_cache=True)
    assert torch.equal(out, tiny.generate(second, past_key_values=plain_cache, **GREEDY))
    assert stats.reused_tokens == 30  # tokens 20..49 came from the store, on top of the caller's 20
