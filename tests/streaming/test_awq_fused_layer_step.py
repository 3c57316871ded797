"""The fused decoder's in-place protocol (``kernels.decoder``): on cache layers that offer it, a layer is one
``torch.ops.kvboost.layer_step`` call that writes its new keys and values into the layer's buffers itself, with the
bits, tokens and cache state of the four calls it replaces (two layer ops, the cache's update, attention)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from kvboost_hf.cache import BufferedCache, buffer
from kvboost_hf.cache.buffer import BufferedLayer
from kvboost_hf.cache.chunk_reuse import ChunkReuseCache, ReuseRequest
from kvboost_hf.kernels import decoder as fused_decoder
from kvboost_hf.kernels.decoder import unfuse_decoder
from kvboost_hf.kernels.layer import layer_arguments
from kvboost_hf.kernels.plan import KEYS_IN_ORDER
from tests.streaming.fused_models import awq_model

STEP_OP = "kvboost::layer_step"


def op_calls(fn, name: str = STEP_OP):
    """``(fn(), how many times the op ``name`` ran)``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(1 for event in prof.events() if event.name == name)


def new_cache(kind: str, config):
    if kind == "dynamic":  # generate's cache: the decoder swaps in its in-place layers at the prefill
        return DynamicCache(config=config)
    if kind == "recording":  # assisted decoding's: sliding layers keep every key until the next crop
        cache = DynamicCache(config=config)
        cache.activate_past_recording()
        return cache
    if kind == "buffered":
        return BufferedCache(config=config)
    cache = ChunkReuseCache(config)  # a reuse cache as a managed request holds it
    cache.request = ReuseRequest()
    return cache


def decode(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a 12-token prefill, a 9-row chunk, then one token at a time to the end of ``ids``."""
    out, start = [], 0
    for end in (12, 21, *range(22, ids.shape[1] + 1)):
        out.append(model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits)
        start = end
    return torch.cat(out, dim=1)


def four_calls(monkeypatch):
    """Makes the fused decoder compute every layer with the four calls (as on a cache without the protocol)."""
    monkeypatch.setattr(fused_decoder, "_updates_layers_only", lambda cache: False)


@pytest.mark.parametrize("kind", ["dynamic", "recording", "buffered", "reuse"])
@pytest.mark.parametrize("batch", [1, 2])
def test_one_call_a_layer_gives_the_bits_and_the_cache_of_four(kind, batch, tiny_awq, kernels_built, fast_loops,
                                                              monkeypatch):
    """Past the sliding window (16 tokens) and through many refills of the buffers (2 spare tokens each)."""
    monkeypatch.setattr(buffer, "SPARE_TOKENS", 2)
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (batch, 40), generator=torch.Generator().manual_seed(21 + batch))
    with torch.no_grad():
        step_cache = new_cache(kind, model.config)
        fused, steps = op_calls(lambda: decode(model, step_cache, ids))
        loops = fast_loops["n"]
        with monkeypatch.context() as patch:
            four_calls(patch)
            four_cache = new_cache(kind, model.config)
            four, none = op_calls(lambda: decode(model, four_cache, ids))
    layers = model.config.num_hidden_layers
    assert loops == 21 and none == 0  # every forward took the loop
    # every layer of every step but the first after each refill (one in three with 2 spare tokens), and never at the
    # prefill (nothing held yet)
    assert layers * 10 <= steps < layers * 20
    assert torch.equal(fused, four)
    assert_same_cache(step_cache, four_cache)


def assert_same_cache(cache, other) -> None:
    """Every layer of the two caches of one kind alike: class, keys, values, length, window, reuse history."""
    for a, b in zip(cache.layers, other.layers, strict=True):
        assert type(a) is type(b)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.get_seq_length() == b.get_seq_length()
        if a.is_sliding:
            assert a.cumulative_length == b.cumulative_length
        if hasattr(a, "full_states"):
            for x, y in zip(a.full_states(), b.full_states(), strict=True):
                assert torch.equal(x, y)


def test_where_update_does_more_it_runs(tiny_awq, kernels_built, fast_loops, caplog):
    """No call of the one-call op where the cache's or a layer's update does more than the protocol: a reuse cache
    no request manages (its update warns), a layer class that overrides update without the protocol, a forward
    autograd records."""
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(5))

    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="kvboost_hf.cache.chunk_reuse"):
        _, steps = op_calls(lambda: decode(model, ChunkReuseCache(model.config), ids))
    assert steps == 0 and "without chunk reuse enabled" in caplog.text

    updates = {"n": 0}

    class Counting(BufferedLayer):
        kvboost_keys_in_order = True  # its keys in order (KEYS_IN_ORDER), but an update of its own

        def update(self, *args, **kwargs):
            updates["n"] += 1
            return super().update(*args, **kwargs)

    assert getattr(Counting, KEYS_IN_ORDER)
    cache = BufferedCache(config=model.config)
    cache.layers = [Counting() if type(layer) is BufferedLayer else layer for layer in cache.layers]
    with torch.no_grad():
        _, steps = op_calls(lambda: decode(model, cache, ids))
    forwards = 2 + (ids.shape[1] - 21)
    assert updates["n"] == forwards  # its one layer took every forward through update
    assert steps > 0  # the others did not

    model.requires_grad_(False)  # the loop takes a forward with grad enabled where nothing requires grad
    fast_loops["n"] = 0
    _, steps = op_calls(lambda: decode(model, BufferedCache(config=model.config), ids))
    assert fast_loops["n"] == forwards and steps == 0


def test_the_one_call_op_refuses_buffers_that_do_not_fit(tiny_awq, kernels_built):
    model = awq_model("gemma3", tiny_awq, None)
    a, head_dim = layer_arguments(model.model.layers[0]), model.config.head_dim
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 2, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    cos = torch.randn(1, 2, head_dim, generator=gen).to(torch.bfloat16)
    kv_heads = a.outs[1] // head_dim
    room = torch.zeros(1, kv_heads, 8, head_dim, dtype=torch.bfloat16)
    step = torch.ops.kvboost.layer_step
    with pytest.raises(RuntimeError, match="must lie in the buffers' 8 positions"):
        step(*a.step(hidden, cos, cos, head_dim), room, room.clone(), 0, 7, 0.25, 0)  # 2 rows past 7
    with pytest.raises(RuntimeError, match="key and value buffers must be"):
        step(*a.step(hidden, cos, cos, head_dim), room.float(), room.float(), 0, 0, 0.25, 0)
    with pytest.raises(RuntimeError, match="key and value buffers must be"):
        step(*a.step(hidden, cos, cos, head_dim), room, room[:, :, :4].clone(), 0, 0, 0.25, 0)
    values = room.clone()
    out, k, v = step(*a.step(hidden, cos, cos, head_dim), room, values, 0, 3, 0.25, 0)
    assert out.shape == hidden.shape and torch.equal(room[:, :, 3:5], k) and torch.equal(values[:, :, 3:5], v)
    assert not room[:, :, 5:].any() and not values[:, :, 5:].any()  # nothing written past the new rows


def _halving(update, calls: dict):
    """An ``update`` (bound or not) wrapped to store halved values, counting its calls."""
    def wrapped(*args, **kwargs):
        calls["n"] += 1
        args = list(args)
        at = 2 if len(args) > 2 and isinstance(args[0], Cache | BufferedLayer) else 1
        args[at] = args[at] * 0.5
        return update(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("where", ["cache instance", "layer instance", "Cache class", "layer class"])
def test_an_update_patched_or_set_on_an_instance_runs_at_every_call(where, tiny_awq, kernels_built, monkeypatch):
    """An ``update`` set on the cache or a layer, or patched on transformers' ``Cache`` or on an in-place layer class,
    is not what the protocol mirrors: every forward runs it, as the decoder's own forward does."""
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(31))
    layers = model.config.num_hidden_layers

    def run():
        calls = {"n": 0}
        cache = BufferedCache(config=model.config)
        if where == "cache instance":
            cache.update = _halving(cache.update, calls)
        elif where == "layer instance":
            cache.layers[-1].update = _halving(cache.layers[-1].update, calls)  # the full-attention layer
        with monkeypatch.context() as patch:
            if where == "Cache class":
                patch.setattr(Cache, "update", _halving(Cache.update, calls))
            elif where == "layer class":
                patch.setattr(BufferedLayer, "update", _halving(BufferedLayer.update, calls))
            with torch.no_grad():
                logits, steps = op_calls(lambda: decode(model, cache, ids))
        return logits, steps, calls["n"]

    fused, steps, calls = run()
    forwards = 2 + ids.shape[1] - 21
    assert calls == forwards * (layers if where in ("cache instance", "Cache class") else 1)
    if where in ("cache instance", "Cache class"):
        assert steps == 0
    else:
        assert 0 < steps < layers * (forwards - 1)  # the other layers still take the one call
    assert unfuse_decoder(model) == 1
    plain, _, plain_calls = run()
    assert plain_calls == calls and torch.equal(fused, plain)


def test_the_one_call_op_refuses_what_its_write_would_get_wrong(tiny_awq, kernels_built):
    """Overlapping key and value buffers, a bad window (before anything is written), buffers made under inference
    mode written outside it; a write moves the buffers' version counters, as a Python write does."""
    model = awq_model("gemma3", tiny_awq, None)
    a, head_dim = layer_arguments(model.model.layers[0]), model.config.head_dim
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 1, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    cos = torch.randn(1, 1, head_dim, generator=gen).to(torch.bfloat16)
    args = a.step(hidden, cos, cos, head_dim)
    shape = (1, a.outs[1] // head_dim, 6, head_dim)
    step = torch.ops.kvboost.layer_step
    keys = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must not share memory"):
        step(*args, keys, keys, 0, 2, 0.25, 0)
    shifted = torch.zeros(*shape[:2], shape[2] + 1, shape[3], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must not share memory"):
        step(*args, shifted[:, :, :-1], shifted[:, :, 1:], 0, 2, 0.25, 0)  # one row apart
    halves = torch.zeros(2, *shape[1:], dtype=torch.bfloat16)
    step(*args, halves[:1], halves[1:], 0, 2, 0.25, 0)  # two halves of one tensor: allowed
    values = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        step(*args, keys, values, 0, 2, 0.25, -1)
    assert not keys.any() and not values.any()
    with torch.inference_mode():
        frozen_keys, frozen_values = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="made under inference mode"):
        step(*args, frozen_keys, frozen_values, 0, 2, 0.25, 0)
    versions = keys._version, values._version
    with torch.no_grad():
        step(*args, keys, values, 0, 2, 0.25, 0)
    assert keys._version > versions[0] and values._version > versions[1]


def test_rope_takes_cos_and_sin_broadcast_as_expand_takes_them(tiny_awq, kernels_built):
    """The layer ops read cos/sin with expand()'s strides (0 where a size 1 is broadcast) without calling it: one
    table for every row of a batch, as a 2-D table, or per row, the same bits; a shape expand() refuses is refused."""
    model = awq_model("gemma3", tiny_awq, None)
    a, head_dim = layer_arguments(model.model.layers[0]), model.config.head_dim
    gen = torch.Generator().manual_seed(13)
    hidden = torch.randn(2, 3, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    cos = torch.randn(1, 3, head_dim, generator=gen).to(torch.bfloat16)
    sin = torch.randn(1, 3, head_dim, generator=gen).to(torch.bfloat16)
    inputs = torch.ops.kvboost.layer_attention_inputs
    shared = inputs(*a.inputs(hidden, cos, sin, head_dim))
    for c, s in ((cos.expand(2, 3, head_dim).clone(), sin.expand(2, 3, head_dim).clone()), (cos[0], sin[0]),
                 (cos.expand(2, 3, head_dim), sin.expand(2, 3, head_dim))):
        for x, y in zip(shared, inputs(*a.inputs(hidden, c, s, head_dim))):
            assert torch.equal(x, y)
    one_row = inputs(*a.inputs(hidden[:, :1], cos[:, :1], sin[:, :1], head_dim))  # first row alone: its bits
    for x, y in zip(shared[:2], one_row[:2]):
        assert torch.equal(x[:, :, :1], y)
    with pytest.raises(RuntimeError, match="do not broadcast"):
        inputs(*a.inputs(hidden, torch.cat([cos] * 3), torch.cat([sin] * 3), head_dim))
    with pytest.raises(RuntimeError, match="one layout"):
        inputs(*a.inputs(hidden, cos, sin.expand(2, 3, head_dim).clone(), head_dim))
