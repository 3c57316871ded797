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


def test_sdpa_forward_on_a_marked_layer_is_float32_sdpa_of_the_cast_inputs():
    model = make_tiny("gemma3", seed=4).to(torch.bfloat16)
    layer = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(1, 4, 3, 16, generator=gen).to(torch.bfloat16)
    key, value = (torch.randn(1, 2, 9, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = torch.zeros(1, 1, 3, 9, dtype=torch.bfloat16)
    mask[..., :2] = torch.finfo(torch.bfloat16).min  # a float mask in the model's dtype is cast too
    kw = dict(scaling=layer.scaling, is_causal=False)
    one, one_mask = queries[:, :, :1], mask[:, :, :1]
    stock, _ = attention.sdpa_forward(layer, one, key, value, one_mask, **kw)
    assert torch.equal(stock, sdpa_attention_forward(layer, one, key, value, one_mask, **kw)[0])  # not marked
    assert attention.attention_in_float32(model)
    out, _ = attention.sdpa_forward(layer, one, key, value, one_mask, **kw)
    expected, _ = sdpa_attention_forward(layer, one.float(), key.float(), value.float(), one_mask.float(), **kw)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))
    assert not torch.equal(out, stock)  # bf16 SDPA rounds differently: the test can tell the two apart
    # Several query rows too: a prompt's numerics must not depend on its chunking.
    rows, _ = attention.sdpa_forward(layer, queries, key, value, mask, **kw)
    expected, _ = sdpa_attention_forward(layer, queries.float(), key.float(), value.float(), mask.float(), **kw)
    assert torch.equal(rows, expected.to(torch.bfloat16))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_float32_attention_runs_every_layer_in_float32_and_changes_the_namespace(family, monkeypatch):
    from kvboost_hf.models.namespace import namespace

    model = make_tiny(family, seed=5, num_layers=3).to(torch.bfloat16)
    ids = random_ids(SLIDING_WINDOW + 5, 6)

    def decode_logits():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
            return model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits.float()

    ref = decode_logits()
    before = namespace(model)
    seen = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda module, q, *a, **k: seen.append((q.shape[-2], q.dtype)) or real(module, q, *a, **k))
    assert attention.attention_in_float32(model) and attention.attention_in_float32(model)  # idempotent
    assert model.config._attn_implementation == attention.ATTENTION_NAME
    out = decode_logits()
    layers = model.config.num_hidden_layers
    assert seen == [(ids.shape[1] - 1, torch.float32)] * layers + [(1, torch.float32)] * layers
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()  # the same model, other rounding
    assert namespace(model) != before  # stored K/V of the two never mix


def test_float32_attention_leaves_eager_models_alone():
    model = make_tiny("llama").to(torch.bfloat16)
    model.set_attn_implementation("eager")
    assert not attention.attention_in_float32(model)
    assert not any(attention.owned_attention(m) for m in model.modules())


def test_every_sdpa_call_of_the_package_goes_through_sdpa_forward():
    """Forwards that must agree bit for bit (a decode step, a row-exact verification row, a packed batch
    row) agree only if they reach SDPA the same way: through ``attention.sdpa_forward``."""
    from pathlib import Path

    import kvboost_hf

    root = Path(kvboost_hf.__file__).parent
    users = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if "sdpa_attention_forward" in p.read_text())
    assert users == ["models/attention.py"]
