"""KVBuffer / BufferedCache: appending in place gives DynamicCache's K/V, and nothing handed out changes later."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvboost_hf import ChunkStore, ControllerSettings, disable_chunk_reuse, enable_chunk_reuse, make_draft
from kvboost_hf.cache import BufferedCache
from kvboost_hf.cache.buffer import SPARE_TOKENS, BufferedLayer, BufferedSlidingLayer, KVBuffer
from tests.conftest import FAMILIES, SLIDING_WINDOW, make_tiny, random_ids


def states(n: int, seed: int, batch: int = 1, heads: int = 2, dim: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, n, dim, generator=g).to(dtype),
            torch.randn(batch, heads, n, dim, generator=g).to(dtype))


def test_appends_equal_concatenation_and_earlier_views_never_change():
    buffer, keys, values = KVBuffer(), None, None
    cat_k = cat_v = None
    handed = []
    for step, n in enumerate([5, 1, 1, 3, *[1] * (SPARE_TOKENS + 4)]):  # past one buffer's spare room
        k, v = states(n, step)
        keys, values = buffer.append(keys, values, k, v)
        cat_k = k if cat_k is None else torch.cat([cat_k, k], dim=-2)
        cat_v = v if cat_v is None else torch.cat([cat_v, v], dim=-2)
        assert torch.equal(keys, cat_k) and torch.equal(values, cat_v)
        handed.append((keys, keys.clone(), values, values.clone()))
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for k, k0, v, v0 in handed)
    assert buffer.keys.shape[-2] - keys.shape[-2] <= SPARE_TOKENS  # bounded slack


def test_a_crop_or_replaced_tensors_start_a_fresh_buffer_so_old_views_keep_their_tokens():
    buffer = KVBuffer()
    keys, values = buffer.append(None, None, *states(6, 0))
    keys, values = buffer.append(keys, values, *states(1, 1))
    before = keys.clone()
    cropped_k, cropped_v = keys[..., :4, :], values[..., :4, :]  # what DynamicLayer.crop leaves
    new_k, new_v = states(3, 2)
    after_k, after_v = buffer.append(cropped_k, cropped_v, new_k, new_v)
    assert torch.equal(keys, before)  # the rejected tokens' view is untouched
    assert torch.equal(after_k, torch.cat([before[..., :4, :], new_k], dim=-2))
    assert after_k.data_ptr() != keys.data_ptr()
    # a layer's tensors replaced by others (a load of stored K/V) are copied, never written through
    loaded_k, loaded_v = states(5, 3)
    saved = loaded_k.clone()
    out_k, _ = buffer.append(loaded_k, loaded_v, *states(1, 4))
    assert torch.equal(loaded_k, saved) and torch.equal(out_k[..., :5, :], saved)


def test_a_sliding_window_keeps_its_last_tokens_and_the_forward_sees_all():
    layer, plain = BufferedSlidingLayer(sliding_window=4), DynamicSlidingWindowLayer(sliding_window=4)
    for step, n in enumerate([6, 1, 2, *[1] * (SPARE_TOKENS + 3)]):
        k, v = states(n, step)
        got, want = layer.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
    assert layer.get_seq_length() == plain.get_seq_length() and layer.cumulative_length == plain.cumulative_length


def test_changed_batch_or_dtype_refills_instead_of_writing_across():
    buffer = KVBuffer()
    keys, values = buffer.append(None, None, *states(3, 0))
    keys, values = buffer.append(keys, values, *states(1, 1))
    wide = (keys.repeat_interleave(2, dim=0), values.repeat_interleave(2, dim=0))  # batch_repeat_interleave
    k2, _ = buffer.append(*wide, *states(1, 2, batch=2))
    assert k2.shape == (2, 2, 5, 8) and torch.equal(k2[:, :, :4], wide[0])
    half = (k2.to(torch.bfloat16), _.to(torch.bfloat16))
    k3, _ = buffer.append(*half, *states(1, 3, batch=2, dtype=torch.bfloat16))
    assert k3.dtype == torch.bfloat16 and torch.equal(k3[:, :, :5], half[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_buffered_cache_equals_plain_generate(family):
    model = make_tiny(family, seed=3)
    ids = random_ids(2 * SLIDING_WINDOW + 3, 11)  # past the sliding window
    cache = BufferedCache(config=model.config)
    assert all(isinstance(layer, (BufferedLayer, BufferedSlidingLayer)) for layer in cache.layers)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3), dict(do_sample=True, top_k=5)):
        torch.manual_seed(0)
        plain = model.generate(ids, max_new_tokens=SLIDING_WINDOW + 6, **options)
        torch.manual_seed(0)
        got = model.generate(ids, max_new_tokens=SLIDING_WINDOW + 6, past_key_values=BufferedCache(config=model.config),
                             **options)
        assert torch.equal(got, plain), options


def test_a_config_less_buffered_cache_grows_buffered_layers():
    model = make_tiny("llama", seed=3)
    ids = random_ids(9, 2)
    cache = BufferedCache()
    got = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert torch.equal(got, model.generate(ids, max_new_tokens=6, do_sample=False))
    assert cache.layers and all(type(layer) is BufferedLayer for layer in cache.layers)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_draft_appends_its_tokens_in_place_and_output_is_unchanged(family):
    model = make_tiny(family, seed=5)
    ids = random_ids(2 * SLIDING_WINDOW + 1, 4)
    plain = model.generate(ids, max_new_tokens=SLIDING_WINDOW + 4, do_sample=False)
    draft = make_draft(make_tiny(family, seed=5), bits=8, activations=torch.float32)  # a twin's: prefills itself
    seen = []
    forward = draft.forward

    def spy(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        seen.extend(type(layer) for layer in getattr(cache, "layers", []))
        return forward(*args, **kwargs)

    draft.forward = spy
    enable_chunk_reuse(model, ChunkStore(max_bytes=10_000_000, chunk_size=8))
    try:
        always = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=4)
        got = model.generate(ids, max_new_tokens=SLIDING_WINDOW + 4, do_sample=False, draft=draft, speculation=always)
    finally:
        disable_chunk_reuse(model)
        disable_chunk_reuse(draft)
    assert torch.equal(got, plain)
    assert seen and all(issubclass(kind, (BufferedLayer, BufferedSlidingLayer)) for kind in seen)


def test_a_recording_sliding_layer_crops_and_appends_as_transformers_does():
    """Assisted decoding's pattern: record the past, forward a draft, crop the rejected part, go on."""
    layer, plain = BufferedSlidingLayer(sliding_window=6), DynamicSlidingWindowLayer(sliding_window=6)
    for target in (layer, plain):
        target.activate_past_recording()
    seen = []
    for seed, (n, rejected) in enumerate([(9, 0), (4, 2), (3, 0), (5, 4), (1, 0), (6, 3), (2, 1), (1, 0)]):
        k, v = states(n, seed)
        got, want = layer.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), seed
        seen.append((got, [t.clone() for t in got]))
        layer.crop(-rejected)
        plain.crop(-rejected)
        assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values), seed
    assert all(torch.equal(a, b) for got, before in seen for a, b in zip(got, before))  # what forwards saw stays


@pytest.fixture(scope="module")
def kernels_loaded():
    """The kernels' ops loaded in this process, as an int4 model loads them: crops count a buffer's views with them."""
    from kvboost_hf import kernels

    status = kernels.available()
    assert status.built, f"the kernels must build in CI: {status.reason}"


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_a_crop_that_no_one_else_sees_keeps_the_buffer_and_appends_over_the_dropped_rows(kind, kernels_loaded):
    """Assisted decoding's rounds: forward the candidates, crop the rejected, go on; no view is kept by anyone."""
    layer = BufferedLayer() if kind == "full" else BufferedSlidingLayer(sliding_window=6)
    plain = DynamicLayer() if kind == "full" else DynamicSlidingWindowLayer(sliding_window=6)
    if kind == "sliding":
        layer.activate_past_recording()
        plain.activate_past_recording()
    buffers = []
    for seed, (n, rejected) in enumerate([(9, 0), (4, 2), (3, 0), (5, 4), (1, 0), (6, 3), (2, 1), (1, 0)] * 3):
        k, v = states(n, seed)
        got, want = layer.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), seed
        del got
        layer.crop(-rejected)
        plain.crop(-rejected)
        assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values), seed
        buffers.append(layer.buffer.keys)
    # the prefill's exact buffer, then one with spare room that every later round appends into
    assert len({b.data_ptr() for b in buffers}) == 2 and buffers[-1] is buffers[2]


def test_the_pair_an_append_returns_holds_its_views_across_a_crop(kernels_loaded):
    buffer = KVBuffer()
    kept = buffer.append(None, None, *states(9, 0))
    kept = buffer.append(*kept, *states(2, 1))
    before = [t.clone() for t in kept]
    keys, values = buffer.cropped(kept[0][..., :9, :], kept[1][..., :9, :])
    buffer.append(keys, values, *states(2, 2))
    assert all(torch.equal(a, b) for a, b in zip(kept, before))


def test_without_the_kernels_loaded_a_crop_copies_into_a_fresh_buffer(kernels_loaded, monkeypatch):
    from kvboost_hf.kernels import ops

    monkeypatch.setattr(ops, "_registered", False)  # as in a process where no model loaded them
    assert ops.storage_users(torch.zeros(1)) is None
    layer = BufferedLayer()
    layer.update(*states(9, 0))
    layer.update(*states(2, 1))
    buffer = layer.buffer.keys
    layer.crop(-2)
    layer.update(*states(3, 2))
    assert layer.buffer.keys is not buffer


def test_the_storage_use_count_counts_every_view_on_any_tensor(kernels_loaded):
    from kvboost_hf.kernels import ops

    base = torch.zeros(2, 3, 4)
    assert ops.storage_users(base) == 1
    view, other = base[0], base.view(-1)[2:]
    assert ops.storage_users(base) == ops.storage_users(view) == 3
    del view, other
    assert ops.storage_users(base) == 1 and ops.storage_users(torch.zeros(0)) >= 1


@pytest.mark.parametrize("held", ["view", "view of a view", "values only", "dlpack", "numpy"])
def test_a_view_still_held_across_a_crop_never_sees_a_later_append(held, kernels_loaded):
    layer = BufferedLayer()
    layer.update(*states(9, 0))
    layer.update(*states(2, 1))
    kept = {"view": lambda: layer.keys, "view of a view": lambda: layer.keys[..., 5:, :],
            "values only": lambda: layer.values, "dlpack": lambda: torch.from_dlpack(layer.keys),
            "numpy": lambda: torch.from_numpy(layer.keys.numpy())}[held]()
    before = kept.clone()
    buffer = layer.buffer.keys
    layer.crop(-2)
    layer.update(*states(3, 2))
    assert torch.equal(kept, before)  # the dropped rows it shows were not written over
    assert layer.buffer.keys is not buffer  # the crop went to a fresh buffer instead
    want = torch.cat([torch.cat([states(9, 0)[0], states(2, 1)[0]], dim=-2)[..., :9, :], states(3, 2)[0]], dim=-2)
    assert torch.equal(layer.keys, want)


def test_a_cache_filled_under_inference_mode_continues_outside_it():
    model = make_tiny("gemma3", seed=2)
    ids = random_ids(2 * SLIDING_WINDOW, 5)
    cache = BufferedCache(config=model.config)
    with torch.inference_mode():
        first = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    with torch.no_grad():
        got = model.generate(first, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert torch.equal(got, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_forwards_that_autograd_records_concatenate_and_backpropagate_as_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # as many K/V heads as heads: attention reads the cache's own tensors, not copies
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2)).train()
    ids = random_ids(12, 6)
    grads = []
    for cache in (DynamicCache(config=model.config), BufferedCache(config=model.config)):
        model.zero_grad()
        chunks = (model(ids[:, i : i + 3], past_key_values=cache, use_cache=True) for i in range(0, 12, 3))
        loss = sum(out.logits.sum() for out in chunks)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_layer_edges_follow_transformers():
    layer = BufferedLayer()
    layer.update(*states(300, 0))
    layer.update(*states(1, 1))
    layer.reset()
    assert layer.buffer.keys is None and layer.get_seq_length() == 0  # reset frees the buffer
    promoted = BufferedLayer()
    promoted.update(*states(3, 2))
    keys, _ = promoted.update(*states(1, 3, dtype=torch.bfloat16))
    assert keys.dtype == torch.float32  # as torch.cat promotes: the history keeps its precision
    with pytest.raises(RuntimeError):
        promoted.update(*states(1, 4, batch=2))  # another batch raises, as with DynamicLayer
    one, plain = BufferedSlidingLayer(sliding_window=1), DynamicSlidingWindowLayer(sliding_window=1)
    for step, n in enumerate([3, 1, 1]):
        k, v = states(n, step)
        assert all(torch.equal(a, b) for a, b in zip(one.update(k, v), plain.update(k, v)))
        assert torch.equal(one.keys, plain.keys)
