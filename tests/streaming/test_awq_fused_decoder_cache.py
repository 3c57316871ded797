"""A fused int4 decoder appends to ``generate``'s new ``DynamicCache`` in place (``fuse_decoder(fresh_layer=...)``):
the same tokens, keys and values as transformers' concatenating layers; a cache that already holds states, an
decoder fused without one, or another layer kind keeps its layers; every attribute of a swapped layer goes with it."""

from __future__ import annotations

import copy
import pickle

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from kvboost_hf.cache.buffer import BufferedLayer, BufferedSlidingLayer, in_place_layer
from kvboost_hf.kernels.decoder import FRESH_LAYER, KernelDecoderMixin, fuse_decoder, unfuse_decoder
from tests.streaming.fused_models import awq_model

IDS = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(9))


def layer_kinds(cache) -> set[type]:
    return {type(layer) for layer in cache.layers}


def generated(model, **kw):
    with torch.no_grad():
        # 20 tokens whatever they are: where greedy reaches EOS depends on the ISA path's numerics
        return model.generate(IDS, max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                              **kw)


def test_generate_appends_in_place_with_the_tokens_keys_and_values_of_concatenation(tiny_awq, kernels_built,
                                                                                   fast_loops):
    model = awq_model("gemma3", tiny_awq, None)  # sliding layers of 16 tokens: 42 go past the window
    fast_loops["n"] = 0
    fused = generated(model)
    assert fast_loops["n"] == 20  # the prefill and every step took the loop
    assert layer_kinds(fused.past_key_values) == {BufferedLayer, BufferedSlidingLayer}
    assert unfuse_decoder(model) == 1
    plain = generated(model)
    assert layer_kinds(plain.past_key_values) == {DynamicLayer, DynamicSlidingWindowLayer}
    assert torch.equal(fused.sequences, plain.sequences)
    for a, b in zip(fused.past_key_values.layers, plain.past_key_values.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.get_seq_length() == b.get_seq_length()
    fuse_decoder(model, fresh_layer=in_place_layer)
    again = generated(model, past_key_values=plain.past_key_values)  # a cache holding states keeps its layers
    assert layer_kinds(again.past_key_values) == {DynamicLayer, DynamicSlidingWindowLayer}


def test_a_swapped_layer_keeps_what_generate_set_on_it(tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # as generate does for some decoding modes, before the prefill
    with torch.no_grad():
        model(input_ids=IDS, past_key_values=cache)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(type(layer) is BufferedSlidingLayer and layer.record_past for layer in sliding)
    assert all(layer.sliding_window == model.config.sliding_window for layer in sliding)


def test_a_decoder_fused_without_a_fresh_layer_keeps_transformers_layers(tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    fuse_decoder(model)  # fused without a fresh layer: the loop, transformers' layers
    fast_loops["n"] = 0
    out = generated(model)
    assert fast_loops["n"] == 20 and layer_kinds(out.past_key_values) == {DynamicLayer, DynamicSlidingWindowLayer}


def test_a_copy_and_an_unfused_decoder_forget_the_fresh_layer(tiny_awq, kernels_built):
    model = awq_model("gemma3", tiny_awq, None)
    assert isinstance(model.model, KernelDecoderMixin) and model.model.__dict__[FRESH_LAYER] is in_place_layer
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert FRESH_LAYER not in copied.model.__dict__
    unfuse_decoder(model)
    assert FRESH_LAYER not in model.model.__dict__


def test_in_place_layer_takes_only_empty_dynamic_layers():
    states = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    held = DynamicLayer()
    held.update(*states)
    assert in_place_layer(held) is None
    assert in_place_layer(StaticLayer(max_cache_len=8)) is None
    assert type(in_place_layer(DynamicLayer())) is BufferedLayer
    window = DynamicSlidingWindowLayer(sliding_window=4)
    window.record_past = True
    new = in_place_layer(window)
    assert type(new) is BufferedSlidingLayer and new.sliding_window == 4 and new.record_past

    class OwnLayer(DynamicLayer):  # a subclass may keep its states its own way: not taken
        pass

    assert in_place_layer(OwnLayer()) is None


GENERATE_OPTIONS = {
    "beam search": dict(num_beams=3, do_sample=False),  # reorders the cache every step: a fresh buffer each time
    "seeded sampling, two sequences": dict(do_sample=True, top_k=20, num_return_sequences=2),
    "prompt lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),  # crops rejected rows
    "repetition penalty and a stop length": dict(do_sample=False, repetition_penalty=1.3, min_new_tokens=5),
}


def test_every_generate_option_gives_the_tokens_of_concatenating_layers(tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(4))
    for name, options in GENERATE_OPTIONS.items():
        outputs = []
        for fused in (True, False):
            if fused:
                fuse_decoder(model, fresh_layer=in_place_layer)
            else:
                unfuse_decoder(model)
            torch.manual_seed(7)
            fast_loops["n"] = 0
            with torch.no_grad():
                outputs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, **options))
            assert (fast_loops["n"] > 0) == fused, name
        assert torch.equal(*outputs), name
