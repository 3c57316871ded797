"""Requests reuse must step aside for, and the stats and errors users see around them."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import StaticCache

from kvboost_hf import ChunkReuseCache, ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm
from kvboost_hf.cache import chunk_reuse as cache_module
from tests.conftest import make_tiny, random_ids

GREEDY = dict(max_new_tokens=5, do_sample=False)


def shared_prefix_prompts(seed: int = 0):
    first = random_ids(50, seed)
    return first, torch.cat([first[:, :45], random_ids(11, seed + 1)], dim=1)


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_per_position_outputs_come_back_whole(tiny, flag):
    if flag == "output_attentions":
        tiny.set_attn_implementation("eager")
    try:
        first, second = shared_prefix_prompts()
        kw = dict(GREEDY, return_dict_in_generate=True, **{flag: True})
        ref = tiny.generate(second, **kw)
        enable_chunk_reuse(tiny, ChunkStore(max_bytes=10**8, chunk_size=8))
        tiny.generate(first, **GREEDY)
        out = tiny.generate(second, **kw)
        stats = last_request_stats(tiny)
        field = "hidden_states" if flag == "output_hidden_states" else "attentions"
        prefill_ref, prefill = getattr(ref, field)[0], getattr(out, field)[0]
        assert len(prefill) == len(prefill_ref)
        for a, b in zip(prefill_ref, prefill):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
        assert torch.equal(out.sequences, ref.sequences)
        assert stats.reused_tokens == 0 and flag in stats.reason
        tiny.generate(second, **GREEDY)  # the prompt was still stored
        assert last_request_stats(tiny).reused_tokens == second.shape[1] - 1
    finally:
        disable_chunk_reuse(tiny)
        tiny.set_attn_implementation("sdpa")


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(use_cache=False), "use_cache=False"),
        (dict(cache_implementation="static"), "cache_implementation='static'"),
        ("static-object", "StaticCache"),
    ],
)
def test_stats_describe_the_latest_call_after_stepping_aside(kw, why):
    model = make_tiny("llama")
    first, second = shared_prefix_prompts()
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8))
    model.generate(first, **GREEDY)
    model.generate(second, **GREEDY)
    assert last_request_stats(model).reused_tokens == 45
    if kw == "static-object":
        kw = dict(past_key_values=StaticCache(config=model.config, max_cache_len=128))
    model.generate(second, **GREEDY, **kw)
    stats = last_request_stats(model)
    assert stats.reused_tokens == 0 and stats.prompt_tokens == second.shape[1] and why in stats.reason


def test_chunk_reuse_cache_without_enabling_reuse_warns_once(caplog, monkeypatch):
    model = make_tiny("llama")
    monkeypatch.setattr(cache_module, "_warned_unmanaged", False)
    ids = random_ids(20, 1)
    with caplog.at_level(logging.WARNING, logger="kvboost_hf.cache"):
        out = model.generate(ids, past_key_values=ChunkReuseCache(model.config, ChunkStore()), **GREEDY)
        model.generate(ids, past_key_values=ChunkReuseCache(model.config, ChunkStore()), **GREEDY)
    warnings = [r for r in caplog.records if "enable_chunk_reuse" in r.getMessage()]
    assert len(warnings) == 1
    assert torch.equal(out, model.generate(ids, **GREEDY))


def test_warm_accepts_keyword_store_and_defaults_to_the_enabled_one():
    model = make_tiny("llama")
    docs = [random_ids(20, 7)[0].tolist(), random_ids(20, 8)[0].tolist()]
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    assert warm(model, store=store, documents=docs).prompt_tokens == 40
    with pytest.raises(ValueError, match="store="):
        warm(model, documents=docs)
    enable_chunk_reuse(model, store)
    other = random_ids(20, 9)[0].tolist()
    assert warm(model, other).stored_chunks > 0
    model.generate(torch.tensor([other + [5, 6]]), **GREEDY)
    assert last_request_stats(model).reused_tokens == 20


def test_exact_is_accepted_as_a_strategy_name():
    model = make_tiny("llama")
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8), recompute_strategy="exact")
    first, second = shared_prefix_prompts()
    model.generate(first, **GREEDY)
    model.generate(second, **GREEDY)
    assert last_request_stats(model).strategy == "exact" and last_request_stats(model).exact_tokens == 45


def test_integral_float_budgets_are_accepted_and_others_refused():
    store = ChunkStore(2e9, 128.0, max_disk_bytes=None)
    assert store.max_bytes == 2_000_000_000 and isinstance(store.max_bytes, int) and store.chunk_size == 128
    with pytest.raises(ValueError, match="max_bytes"):
        ChunkStore(2.5)


def test_a_cache_without_the_models_config_neither_reuses_nor_stores(tiny):
    """Its layers appear only inside the first forward: a warm lookup had nowhere to load into, yet
    recorded the tokens as held (a wrong continuation). It steps aside, and says why."""
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    enable_chunk_reuse(tiny, store)
    ids = random_ids(30, 5)
    expected = tiny.generate(ids, **GREEDY)  # stores the prompt under the model's namespace
    for _ in range(2):
        out = tiny.generate(ids, past_key_values=ChunkReuseCache(None, store), **GREEDY)
        assert torch.equal(out, expected)
        stats = last_request_stats(tiny)
        assert stats.reused_tokens == 0 and "without the model's config" in stats.reason
