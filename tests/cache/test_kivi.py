"""KIVICache: live int8/int4 K/V that says it is approximate and never touches the store."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf import ChunkStore, KIVICache, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.cache.kivi import KIVILayer
from tests.conftest import make_tiny, random_ids

FAMILIES = ("llama", "qwen2", "gemma3")


def _teacher_forced(model, ids: torch.Tensor, cache, step: int = 1) -> torch.Tensor:
    """Logits of every position, fed ``step`` tokens at a time after a 16-token prefill."""
    logits = [model(ids[:, :16], past_key_values=cache, use_cache=True).logits]
    for start in range(16, ids.shape[1], step):
        logits.append(model(ids[:, start : start + step], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_is_exact_and_decoding_stays_close(family):
    model = make_tiny(family, seed=3, num_layers=3)
    ids = random_ids(80, seed=4)
    with torch.no_grad():
        exact = _teacher_forced(model, ids, DynamicCache(config=model.config))
        errors = {}
        for bits in (8, 4):
            cache = KIVICache(model.config, bits=bits, residual_length=8)
            approx = _teacher_forced(model, ids, cache)
            assert torch.equal(approx[:, :16], exact[:, :16])  # the prefill attends to exact states
            assert cache.get_seq_length() == ids.shape[1]
            errors[bits] = ((approx - exact).norm() / exact.norm()).item()
    assert 0 < errors[8] < errors[4] < 0.2, errors
    assert errors[8] < 0.02, errors


def test_layers_quantize_full_attention_only_and_hold_fewer_bytes():
    model = make_tiny("gemma3", seed=1, num_layers=4)
    cache = KIVICache(model.config, bits=4, residual_length=8)
    kinds = [type(layer).__name__ for layer in cache.layers]
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert [i for i, k in enumerate(kinds) if k == "KIVILayer"] == full and full
    with torch.no_grad():
        model(random_ids(200, seed=2), past_key_values=cache, use_cache=True)
        model(random_ids(10, seed=3), past_key_values=cache, use_cache=True)  # flushes into the codes
    layer = cache.layers[full[0]]
    float_bytes = 2 * 210 * model.config.num_key_value_heads * model.config.head_dim * 4
    residual_bytes = 2 * layer.keys.numel() * layer.keys.element_size()
    assert 0 < layer.quantized_bytes + residual_bytes < float_bytes / 4


def test_bad_settings_are_refused():
    config = make_tiny("llama").config
    with pytest.raises(ValueError, match="kv_bits"):
        KIVICache(config, bits=3)
    with pytest.raises(ValueError, match="residual_length"):
        KIVICache(config, bits=8, residual_length=0)
    with pytest.raises(ValueError, match="kv_bits"):
        KIVILayer(2)


def test_kv_bits_on_a_reuse_model_steps_reuse_aside_and_stores_nothing():
    model = make_tiny("gemma3", seed=5, num_layers=3)
    store = ChunkStore(chunk_size=16)
    enable_chunk_reuse(model, store)
    try:
        ids = random_ids(64, seed=6)
        with torch.no_grad():
            exact = model.generate(ids, max_new_tokens=8, do_sample=False)  # fills the store
            stored = len(store)
            approx = model.generate(ids, max_new_tokens=8, do_sample=False, kv_bits=8)
            stats = last_request_stats(model)
            assert stats.reused_tokens == 0 and "kv_bits=8" in stats.reason and "approximate" in stats.reason
            assert len(store) == stored  # approximate K/V never reach the store
            chunked = model.generate(ids, max_new_tokens=8, do_sample=False, kv_bits=4, prefill_chunk_size=16)
            assert chunked.shape == exact.shape
            assert torch.equal(approx[:, :64], ids) and approx.shape == exact.shape
            with pytest.raises(ValueError, match="past_key_values"):
                model.generate(ids, max_new_tokens=2, kv_bits=8, past_key_values=DynamicCache(config=model.config))
            with pytest.raises(ValueError, match="kv_bits"):
                model.generate(ids, max_new_tokens=2, kv_bits=2)
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), exact)  # exact again
            assert last_request_stats(model).reused_tokens > 0
    finally:
        disable_chunk_reuse(model)


def test_crop_rolls_back_through_the_residual_and_into_the_codes():
    model = make_tiny("llama", seed=2, num_layers=2)
    ids = random_ids(40, seed=9)
    with torch.no_grad():
        exact = DynamicCache(config=model.config)
        model(ids, past_key_values=exact, use_cache=True)
        for remove in (3, 20, 40):
            cache = KIVICache(model.config, bits=8, residual_length=8)
            model(ids[:, :16], past_key_values=cache, use_cache=True)
            for t in range(16, 40):
                model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache.crop(-remove)
            keep = 40 - remove
            assert cache.get_seq_length() == keep
            probe_k = torch.zeros(1, model.config.num_key_value_heads, 1, model.config.head_dim)
            keys, _ = cache.layers[0].update(probe_k, probe_k.clone())
            assert keys.shape[-2] == keep + 1
            if keep:
                ref = exact.layers[0].keys[..., :keep, :]
                assert ((keys[..., :keep, :] - ref).norm() / ref.norm()) < 0.02


def test_assisted_decoding_runs_on_a_kivi_cache():
    model, draft = make_tiny("llama", seed=2, num_layers=2), make_tiny("llama", seed=3, num_layers=1)
    ids = random_ids(30, seed=1)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft,
                             past_key_values=KIVICache(model.config, bits=8, residual_length=4))
    assert out.shape == (1, 42) and torch.equal(out[:, :30], ids)
