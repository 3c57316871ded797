"""The exactness guarantee's scope: bit for bit equal to HF's own prompt-cache continuation.

A prefix warmed in one forward (as HF's "prompt cache" pattern prefills it) and reused from the
store gives the same logits, to the bit, as ``generate(past_key_values=deepcopy(prompt_cache))``:
in fp32 and in bf16, where a full prefill of the whole prompt may differ in the last bits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm
from tests.conftest import random_ids

STEPS = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reuse_is_bitwise_hf_prompt_cache_continuation(tiny, dtype):
    model = copy.deepcopy(tiny).to(dtype)
    prefix = random_ids(40, 21)
    prompt = torch.cat([prefix, random_ids(9, 22)], dim=1)
    prompt_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, past_key_values=prompt_cache, use_cache=True)
    ref = model.generate(prompt, past_key_values=copy.deepcopy(prompt_cache), **STEPS)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    warm(model, prefix, store)
    enable_chunk_reuse(model, store)
    out = model.generate(prompt, **STEPS)
    assert last_request_stats(model).exact_tokens == 40
    disable_chunk_reuse(model)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)
