"""attention.decode_step_mask (the mask transformers itself passes to SDPA for a decode step) and the
one-time switch to ``kvboost_sdpa``."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvboost_hf.models import attention
from kvboost_hf.models.attention import decode_step_mask
from tests.conftest import SLIDING_WINDOW, make_tiny, random_ids


@pytest.mark.parametrize("context", [5, SLIDING_WINDOW - 2, SLIDING_WINDOW - 1, SLIDING_WINDOW + 9])
def test_decode_step_masks_are_the_ones_transformers_passes(context):
    """Pins transformers' rule (a sliding layer gets an all-True mask once its window is full, every
    other decode step none): row-exact verification and packed decoding rows copy the call."""
    model = make_tiny("gemma3")
    assert model.config._attn_implementation == "sdpa"
    seen = []

    def recording(module, query, key, value, mask, **kwargs):
        seen.append((module.sliding_window if module.is_sliding else None, key.shape[-2], mask))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS.register("sdpa", recording)
    try:
        ids = random_ids(context + 1, 3)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)
            seen.clear()
            model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True)
    finally:
        ALL_ATTENTION_FUNCTIONS.register("sdpa", original)
    assert len(seen) == model.config.num_hidden_layers and any(window for window, _, _ in seen)
    for window, keys, mask in seen:
        expected = decode_step_mask(window, keys, torch.device("cpu"))
        if expected is None:
            assert mask is None, (window, keys)
        else:
            assert mask is not None and mask.dtype == expected.dtype and torch.equal(mask.reshape(-1), expected.reshape(-1))
    full = [mask for window, keys, mask in seen if window is not None and keys >= window]
    assert bool(full) == (context + 1 >= SLIDING_WINDOW)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kvboost_sdpa_outside_a_routed_forward_is_stock_sdpa_bit_for_bit(family):
    """The switch is kept for good, so plain requests on a switched model must not change at all."""
    model = make_tiny(family, seed=2)
    ids = random_ids(SLIDING_WINDOW + 7, 5)  # beyond a sliding window: masks of both kinds
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    assert attention.use_kvboost_sdpa(model)
    out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))


def test_use_kvboost_sdpa_switches_once_under_concurrent_callers(caplog):
    model = make_tiny("llama")
    start, results = threading.Barrier(8), []

    def call() -> None:
        start.wait(60)
        results.append(attention.use_kvboost_sdpa(model))

    with caplog.at_level(logging.INFO, logger="kvboost_hf.models.attention"):
        threads = [threading.Thread(target=call) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert results == [True] * 8
    assert model.config._attn_implementation == attention.ATTENTION_NAME
    assert sum("now runs attention" in r.getMessage() for r in caplog.records) == 1
