"""ChunkReuseCache.drop_rows: rows no tracked forward appended leave without untracking any token id."""

from __future__ import annotations

import torch

from kvboost_hf.cache import ChunkReuseCache
from tests.conftest import make_tiny, random_ids


def test_dropping_untracked_rows_keeps_the_tracked_tokens_and_crops_like_crop():
    model = make_tiny("gemma3", seed=2)  # a sliding layer (window 16) past its window, and a full layer
    ids = random_ids(20, 3)
    cache, reference = ChunkReuseCache(model.config), ChunkReuseCache(model.config)
    with torch.no_grad():
        for c in (cache, reference):
            c.activate_past_recording()  # as assisted decoding's cache: a sliding layer keeps its past until a crop
            c.track(ids[0])
            model(ids, past_key_values=c, use_cache=True)
        model.model(random_ids(3, 4), past_key_values=cache, use_cache=True)  # three rows nobody tracked
    assert cache.get_seq_length() == 23 and cache.num_tokens == 20
    cache.drop_rows(3)
    assert cache.get_seq_length() == 20 and cache.num_tokens == 20 and cache.token_ids() == ids[0].tolist()
    for ours, theirs in zip(cache.layers, reference.layers):
        assert torch.equal(ours.keys, theirs.keys[..., -ours.keys.shape[-2]:, :])
    nxt = random_ids(1, 5)
    with torch.no_grad():
        assert torch.equal(model(nxt, past_key_values=cache).logits, model(nxt, past_key_values=reference).logits)
    cache.drop_rows(0)
    assert cache.get_seq_length() == 21 and cache.num_tokens == 20  # the last forward was not tracked either
